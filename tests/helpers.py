"""Shared test helpers (a plain module, not a test file): random HF model directories and the
TP-parity computation that both the in-process TP=1 test and the torchrun TP=2 worker
(tests/dist_tp_worker.py) run, so the two sides compute exactly the same thing.

Importable as `helpers` from test files (pytest puts tests/ on sys.path) and from scripts run as
`python tests/<script>.py` (the script's directory is sys.path[0]).
"""
from __future__ import annotations

import os
import signal

import torch

# ---------------------------------------------------------------------- random HF model dirs


def make_hf_model_dir(path, arch: str = "qwen2", hidden: int = 128, heads: int = 4, kv_heads: int = 2,
                      layers: int = 2, ffn: int = 256, vocab: int = 24, tied: bool = True,
                      init_std: float = 0.2, seed: int = 0, rope_theta: float = 1.0e6,
                      max_positions: int = 128, **extra_config) -> str:
    """Write a random-init Qwen2ForCausalLM / LlamaForCausalLM directory (safetensors) plus the char
    tokenizer to `path` and return it as a str.

    `init_std` is the config's initializer_range: a large value (0.2) makes logits far from uniform,
    so layout mistakes show up as large errors. HF initialises RMSNorm weights to 1 and the Qwen2
    q/k/v biases to 0, which would hide a swapped norm or a mis-split bias; both are therefore
    re-drawn (norms ~ N(1, 0.1), biases ~ N(0, init_std)). Deterministic in `seed`; the global RNG
    is left untouched. `vocab` may exceed the tokenizer's size (the extra rows are unused ids).
    `extra_config` overrides / adds config fields (e.g. attention_bias=True for llama).
    """
    from periodic_async.models.tiny import rope_config_kwargs
    from periodic_async.models.tokenizer import build_char_tokenizer, mark_char_tokenizer

    path = str(path)
    tok = build_char_tokenizer()
    if vocab < len(tok):
        raise ValueError(f"vocab={vocab} is smaller than the char tokenizer ({len(tok)} tokens)")
    if hidden % heads:
        raise ValueError(f"hidden={hidden} is not divisible by heads={heads}")
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                  **rope_config_kwargs(rope_theta),
                  tie_word_embeddings=tied, rms_norm_eps=1e-6, initializer_range=init_std,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    if arch == "qwen2":
        from transformers import Qwen2Config as ConfigCls, Qwen2ForCausalLM as ModelCls
        cfg = ConfigCls(**{**common, "architectures": ["Qwen2ForCausalLM"], **extra_config})
    elif arch == "llama":
        from transformers import LlamaConfig as ConfigCls, LlamaForCausalLM as ModelCls
        cfg = ConfigCls(**{**common, "head_dim": hidden // heads, "attention_bias": False, "mlp_bias": False,
                           "architectures": ["LlamaForCausalLM"], **extra_config})
    else:
        raise ValueError(f"arch '{arch}': allowed qwen2, llama")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = ModelCls(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(1.0, 0.1)
                elif name.endswith(".bias"):
                    p.normal_(0.0, init_std)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    mark_char_tokenizer(path)
    return path


def load_hf_model(path: str):
    """The HF transformers model of a directory, fp32, eager attention (the exact reference)."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


# ---------------------------------------------------------------------- fixed inputs

LOGITS_SHAPE = (2, 11)          # [B, S] of the fixed logits input
TEMPERATURE = 0.8               # the actor's sampling temperature (exercises the logits scaling)
NORMALISER = 17.0               # batch-wide normaliser; deliberately != this micro-batch's token count
KL_COEF, ENTROPY_COEF = 0.1, 0.01


def fixed_input_ids(vocab: int, shape=LOGITS_SHAPE, seed: int = 123) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, shape, generator=g)


def megatron_inputs(input_ids: torch.Tensor):
    """(position_ids [B, S], attention_mask [1, 1, S, S] bool, True = masked) for a causal forward."""
    from periodic_async.actor.packing import causal_mask
    b, s = input_ids.shape
    return torch.arange(s)[None].expand(b, -1).contiguous(), causal_mask(s)


def fixed_samples():
    """Three sequences of different prompt/response lengths with non-trivial advantages."""
    from periodic_async.actor.packing import TrainSample
    return [
        TrainSample([5, 6, 7, 8], [9, 10, 11, 12, 1], 1.3),
        TrainSample([3, 4, 5, 6, 7, 8], [20, 21], -0.7),
        TrainSample([12, 13, 14], [15, 16, 17, 18, 19, 2, 1], 0.4),
    ]


def fixed_micro_batch(pad_token_id: int = 0):
    from periodic_async.actor.packing import pack_unshared
    return pack_unshared(fixed_samples(), pad_token_id)


def actor_config():
    from periodic_async.config import ActorConfig
    return ActorConfig(kl_coef=KL_COEF, entropy_coef=ENTROPY_COEF)


# ---------------------------------------------------------------------- the TP-parity computation


def gather_vocab(local: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary tensor from vocab-parallel shards on the last dim (TP rank order)."""
    from megatron.core import parallel_state as ps
    import torch.distributed as dist
    size = ps.get_tensor_model_parallel_world_size()
    if size == 1:
        return local.detach().clone()
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def tp_parity_quantities(model_dir: str, ref_dir: str | None = None) -> dict:
    """Everything the TP-parity test compares, computed on the CURRENT process group and Megatron
    parallel state (call Backend.init_model_parallel(tp, 1, seed) first); every TP rank must call it.

    Builds an TriModelActor (policy + reference) from `model_dir`; when `ref_dir` is given the reference is
    re-loaded from it so the KL term and its gradient are non-zero. Returns a dict of CPU tensors /
    floats, identical on every rank:
      weights:        HF-layout export of the policy (must equal the source checkpoint exactly)
      logits:         policy logits [B, S, V] on fixed_input_ids, gathered over TP
      logits_mc:      the same via megatron's gather_from_tensor_model_parallel_region
      logp, entropy:  vocab-parallel logprobs_entropy (temperature TEMPERATURE) on those logits
      entropy_metric: the same entropy with entropy_grad=False (entropy_metric_grad: requires_grad)
      metrics:        TriModelActor.train_micro_step on fixed_micro_batch + actor/grad_norm (global_grad_norm)
      grads:          FULL policy gradients in HF layout
      replicated_grad_max_diff: max |grad_rank0 - grad_rank_r| over non-sharded parameters
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from periodic_async.actor.tri_model import TriModelActor
    from periodic_async.actor.logprobs import logprobs_entropy
    from periodic_async.models.convert import (_tp_shard_dim, export_hf_weights, gather_tp,
                                               load_hf_checkpoint, mcore_to_hf_full)
    from periodic_async.models.mcore import arch_from_hf_dir

    arch = arch_from_hf_dir(model_dir)
    actor = TriModelActor(actor_config(), arch, model_dir, temperature=TEMPERATURE, with_reference=True)
    if ref_dir is not None:
        load_hf_checkpoint(actor.reference, arch, ref_dir)
    out: dict = {"tp": ps.get_tensor_model_parallel_world_size()}
    out["weights"] = {n: t.clone() for n, t in export_hf_weights(actor.policy, arch)}

    ids = fixed_input_ids(arch.vocab_size)
    pos, mask = megatron_inputs(ids)
    labels = torch.roll(ids, -1, dims=1)
    with torch.no_grad():
        local = actor.policy(ids, pos, mask)                          # [B, S, V/TP]
        out["logits"] = gather_vocab(local)
        out["logits_mc"] = gather_from_tensor_model_parallel_region(local).clone()
        logp, ent = logprobs_entropy(local, labels, TEMPERATURE, True)
        out["logp"], out["entropy"] = logp.clone(), ent.clone()
    # the entropy as a metric (entropy_grad=False: computed without autograd, its own TP reduction)
    ent_metric = logprobs_entropy(local.detach().requires_grad_(), labels, TEMPERATURE, True, entropy_grad=False)[1]
    out["entropy_metric"], out["entropy_metric_grad"] = ent_metric.detach().clone(), ent_metric.requires_grad

    metrics = actor.train_micro_step(fixed_micro_batch(), NORMALISER)
    params = dict(actor.policy.named_parameters())
    trainable = [p for p in params.values() if p.requires_grad]
    missing = [n for n, p in params.items() if p.requires_grad and p.grad is None]
    if missing:
        raise RuntimeError(f"no gradient for {missing}")
    metrics["actor/grad_norm"] = TriModelActor.global_grad_norm(trainable)
    out["metrics"] = metrics
    out["grads"] = {n: t.clone() for n, t in mcore_to_hf_full(lambda n: gather_tp(n, params[n].grad), arch)}

    # replicated parameters (norms) must get the same gradient on every TP rank
    diff = 0.0
    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1:
        for n, p in params.items():
            if _tp_shard_dim(n) is None:
                parts = [torch.empty_like(p.grad) for _ in range(tp)]
                dist.all_gather(parts, p.grad.contiguous(), group=ps.get_tensor_model_parallel_group())
                diff = max(diff, max(float((q - parts[0]).abs().max()) for q in parts))
    out["replicated_grad_max_diff"] = diff
    return out


# ---------------------------------------------------------------------- the tri-model parity computation

# Four GRPO groups (K = 3) with different prompt and response lengths; one group per micro-batch.
TRI_GROUPS = [
    ([5, 6, 7, 8], [[9, 10, 11, 12, 1], [9, 3], [14, 15, 16]], [1.1, -0.4, -0.7]),
    ([3, 4, 5, 6, 7, 8], [[20, 21], [22, 1], [4, 4, 4, 4]], [-0.9, 0.2, 0.7]),
    ([12, 13, 14], [[15, 16, 17, 18, 19, 2, 1], [6], [7, 8, 9]], [0.4, 1.2, -1.6]),
    ([9, 10], [[11, 12, 13], [14, 1], [15, 16, 17, 18]], [0.3, -1.0, 0.7]),
]


def tri_groups():
    """TRI_GROUPS as lists of TrainSample (rollout log-probs included, from a fixed formula)."""
    from periodic_async.actor.packing import TrainSample
    return [[TrainSample(prompt, resp, adv, [-0.5 - 0.01 * j for j in range(len(resp))])
             for resp, adv in zip(responses, advs)] for prompt, responses, advs in TRI_GROUPS]


def tri_model_config(shared_prompt: bool = False, **kw):
    """ppo_epochs 2 (the old model exists), small export buckets (many collectives), Adam eps 1e-4
    (see test_periodic: eps 1e-8 turns fp32 rounding on tiny gradients into visible updates)."""
    from periodic_async.config import ActorConfig
    kw = {"kl_coef": KL_COEF, "entropy_coef": ENTROPY_COEF, "ppo_epochs": 2, "export_bucket_mb": 0.02,
          "adam_eps": 1e-4, "lr": 1e-2, **kw}
    return ActorConfig(shared_prompt=shared_prompt, **kw)


def tri_model_quantities(model_dir: str, ref_dir: str | None = None, shared_prompt: bool = False,
                         dtype: str = "float32") -> dict:
    """Everything the tri-model parity test compares, on the CURRENT Megatron parallel state
    (any TP x PP x DP); every rank must call it. DP rank r trains on groups r, r + DP, ...
    Returns (identical on every rank, CPU):
      weights:   HF-layout export of the policy (bucketed over TP and PP) = the checkpoint
      logp:      {'policy', 'old', 'ref'} per-token log-probs of group 0's micro-batch
      epoch1:    loss-term sums of the first pass (old-policy shortcut) over all groups
      grads:     the full batch gradient in HF layout, after finalize_grads; grad_norm
      epoch2:    loss-term sums of a second pass after one optimizer step (old model forward)
      weights_after: the policy after the step
    """
    from megatron.core import parallel_state as ps
    from periodic_async.actor.packing import pack_micro_batch
    from periodic_async.actor.tri_model import TriModelActor
    from periodic_async.models.convert import export_hf_weights, load_hf_checkpoint
    from periodic_async.models.mcore import arch_from_hf_dir

    arch = arch_from_hf_dir(model_dir)
    eng = TriModelActor(tri_model_config(shared_prompt), arch, model_dir, dtype=dtype, temperature=TEMPERATURE,
                         with_reference=True, attention_impl="sdpa" if shared_prompt else None)
    if ref_dir is not None:
        load_hf_checkpoint(eng.reference, arch, ref_dir)
    out: dict = {"layout": (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                            ps.get_data_parallel_world_size())}
    out["weights"] = {n: t.clone() for n, t in eng.export_weights()}
    groups = tri_groups()
    mbs = [pack_micro_batch(g, 0, shared_prompt) for g in groups]
    out["logp"] = {k: v.clone() for k, v in eng.compute_logprobs(mbs[0]).items()}
    normaliser = float(sum(len(s.response_ids) for g in groups for s in g))
    mine = mbs[ps.get_data_parallel_rank()::ps.get_data_parallel_world_size()]
    eng.refresh_old()
    out["epoch1"] = eng.forward_backward(iter(mine), len(mine), normaliser=normaliser)
    eng.finalize_grads()
    out["grads"] = {n: t.clone() for n, t in export_hf_weights(eng.policy, arch, 1 << 14, select=eng.optimizer.grad_of)}
    out["grad_norm"] = eng.step_finalized()["actor/grad_norm"]
    out["epoch2"] = eng.forward_backward(iter(mine), len(mine), use_old=True, normaliser=normaliser)
    out["weights_after"] = {n: t.clone() for n, t in eng.export_weights()}
    return out


# ---------------------------------------------------------------------- reference paths


def generate_reference(engine, requests):
    """What an HFRolloutEngine (rollout/hf_engine.py) generates for `requests`, the slow, simple
    way: `reference_generate`, one sequence at a time, with the engine's model and policy version."""
    from periodic_async.rollout.base import RolloutResult
    from periodic_async.rollout.sampling import reference_generate
    out = []
    for r in requests:
        for k in r.samples():
            ids, lps, reason = reference_generate(engine.model, r, k, engine.eos_token_id)
            out.append(RolloutResult(r.group_index, k, list(r.prompt_ids), ids, lps, reason, engine.policy_version))
    return out


def score(scorer, groups, stats) -> None:
    """Fill each group's rewards and advantages with a Scorer (scheduling/scorer.py), as the
    producer does in two calls; add the time and error counts to `stats` (a RolloutStats)."""
    scorer.rewards(groups, stats)
    scorer.advantages(groups)


# ---------------------------------------------------------------------- fault injection


def kill_worker(pool, wid: int) -> None:
    """SIGKILL local rollout worker `wid` of a WorkerPool, as a crash would."""
    os.kill(pool.pids()[wid], signal.SIGKILL)


def kill_worker_hook(killed: dict, at_version: int, worker: int = 0):
    """A Trainer hook that SIGKILLs rollout worker `worker` once, in the step trained at policy
    version `at_version`, right after the first complete request is rewarded (the worker still has
    work). `killed` receives the pid."""
    def hook(trainer):
        producer = trainer.producer
        score = producer.scorer.rewards

        def killing_score(groups, stats):
            if trainer.version == at_version and not killed:
                killed["pid"] = producer.pool.pids()[worker]
                kill_worker(producer.pool, worker)
            return score(groups, stats)
        producer.scorer.rewards = killing_score
    return hook


# ---------------------------------------------------------------------- variable group sizes


from periodic_async.scheduling.group_sizing import GroupSizer  # noqa: E402


class CyclingGroupSize(GroupSizer):
    """A group sizer (scheduling/group_sizing.py) giving prompt i of every batch K = sizes[i % len]."""

    def __init__(self, sizes):
        self.sizes = tuple(sizes)

    def group_size(self, step: int, group_index: int) -> int:
        return self.sizes[group_index % len(self.sizes)]


def mixed_k_hook(sizes=(2, 4, 8)):
    """A Trainer hook: the batch's groups get K = 2, 4, 8, 2, 4, 8, ... (rank 0 plans)."""
    def hook(trainer):
        if trainer.planner is not None:
            trainer.planner.group_sizer = CyclingGroupSize(sizes)
    return hook


# ---------------------------------------------------------------------- accelerator rules on CPU


def install_collective_guard(device=None):
    """Make every tensor collective raise when NCCL / HCCL would refuse its tensor: gloo (the CPU
    stand-in) takes float64 and tensors on any device, HCCL has no float64, and neither NCCL nor
    HCCL takes a tensor off the process's device (`device`, default the backend's). Object
    collectives (broadcast_object_list, on the trainer's gloo feed group) are what they are; isend /
    irecv are checked through batch_isend_irecv (P2POp refuses a wrapped isend)."""
    import torch.distributed as dist
    from periodic_async.backend import active_backend
    expected = torch.device(device) if device is not None else active_backend().current_device()

    def check(op, tensors):
        for t in tensors:
            if t.dtype == torch.float64:
                raise TypeError(f"dist.{op} on a float64 tensor {tuple(t.shape)}: HCCL has no float64")
            if t.device != expected:
                raise TypeError(f"dist.{op} on a tensor on {t.device}: NCCL / HCCL need it on {expected}")

    def wrap(op, pick):
        real = getattr(dist, op)

        def guarded(*args, **kwargs):
            check(op, pick(*args, **kwargs))
            return real(*args, **kwargs)
        setattr(dist, op, guarded)

    first = lambda t, *a, **k: [t]                                  # noqa: E731
    wrap("all_reduce", first)
    wrap("broadcast", first)
    wrap("reduce", first)
    wrap("send", first)
    wrap("recv", first)
    wrap("all_gather", lambda out, t, *a, **k: [t, *out])
    wrap("all_gather_into_tensor", lambda out, t, *a, **k: [out, t])
    wrap("reduce_scatter_tensor", lambda out, t, *a, **k: [out, t])
    wrap("batch_isend_irecv", lambda ops, *a, **k: [op.tensor for op in ops])


def stop_after_step(trainer, last: int) -> None:
    """Patch `trainer` to stop (as a SIGTERM would: a checkpoint, then KeyboardInterrupt) after
    step `last`; the caller resets periodic_async.train.stop.STOP.requested afterwards."""
    from periodic_async.train.stop import STOP
    step = trainer.step

    def stopping(s):
        out = step(s)
        if s == last:
            STOP.requested = True
        return out
    trainer.step = stopping


def kill_worker_after_publish(killed: dict, version: int, worker: int):
    """A Trainer hook: SIGKILL rollout worker `worker` right after weights `version` are published
    (it is taking them, or about to); `killed` receives the pid."""
    def hook(trainer):
        publish = trainer.producer.update_weights

        def killing_publish(named, v):
            publish(named, v)
            if v == version and not killed:
                killed["pid"] = trainer.producer.pool.pids()[worker]
                kill_worker(trainer.producer.pool, worker)
        trainer.producer.update_weights = killing_publish
    return hook
