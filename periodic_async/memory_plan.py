"""The memory plan: what each device of a run holds, in bytes, against the device's memory.

`plan_memory(cfg, arch, ...)` -> `MemoryPlan`: one `DevicePlan` per kind of device (the trainer
ranks of each pipeline stage, the rollout workers), each a list of `Item`s. The trainer refuses a
config whose plan does not fit (`MemoryPlan.check`, before any model is built);
`tools/memory_plan.py` prints the table.

Exact and estimated items:
- Model state is exact: policy weights, fp32 master weights, gradients, AdamW's two moments and the
  frozen old / reference weights, from this rank's parameter count under Megatron-core's TP / PP
  sharding (`models/sizes.py: stage_param_numel`) and the byte sizes the actor allocates (actor/optimizer.py,
  `TriModelActor.memory_bytes`; tests/test_memory_plan.py checks one against the other). Megatron
  keeps RMSNorm weights in fp32 whatever model.dtype is, so they are counted at 4 bytes.
- Activations, logits, optimizer-step temporaries, export buckets and the rollout engines' KV cache
  and prefill are estimates: upper bounds at the configured lengths (every prompt
  data.max_prompt_length tokens, every response rollout.max_new_tokens), from the tensors the code
  keeps alive, not measured.

Peak per device = what is held throughout (weights, optimizer state, KV cache) + the largest of
the transient phases (a micro-step's activations, the optimizer step's temporaries, a weight-export
bucket), since those never coexist.

Torch-free: it runs where neither the checkpoint nor the accelerator is (`resolve_arch` falls back
to models/known.py by the checkpoint directory's name).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from .config import Config, ConfigError
from .models.sizes import DTYPE_BYTES, stage_param_numel, vllm_shard_numel  # noqa: F401 - re-exported

if TYPE_CHECKING:
    from .models.mcore import ModelArch

GiB = 1 << 30
MiB = 1 << 20
NORM_BYTES = 4          # Megatron builds RMSNorm weights in fp32 (no Float16Module cast here)
MODEL_STATE_KEYS = ("policy", "master", "grads", "optimizer", "old", "ref")   # = TriModelActor.memory_bytes()

# phases: "" = held throughout; the others are transient and never overlap (the peak takes the largest)
HELD, MICRO_STEP, OPT_STEP, EXPORT, PREFILL = "", "micro-step", "optimizer step", "weight export", "prefill"

_TP_PP_HINT = ("raise parallel.tensor_model_parallel_size or parallel.pipeline_model_parallel_size "
               "(model state is divided by TP x PP)")
_ACT_HINT = ("lower actor.micro_batch_size or actor.micro_batch_tokens (or data.max_prompt_length / "
             "rollout.max_new_tokens), or raise parallel.tensor_model_parallel_size")


@dataclass(frozen=True)
class Item:
    key: str
    label: str
    nbytes: int
    estimate: bool = False
    phase: str = HELD
    hint: str = ""


@dataclass
class DevicePlan:
    """One kind of device: every device of it holds the same items (e.g. the TP ranks of a stage)."""
    name: str                  # who runs there, e.g. "trainer ranks 0-3"
    devices: str               # which devices, e.g. "npu 0-3" ("" when unknown)
    items: list[Item]
    capacity: Optional[int]    # device memory in bytes; None: no limit checked (cpu)
    share: float = 1.0         # the part of the device this process may take (vLLM's gpu_memory_utilization)
    note: str = ""
    count: int = 1             # devices of this kind

    @property
    def held(self) -> int:
        return sum(i.nbytes for i in self.items if i.phase == HELD)

    def phase_bytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for i in self.items:
            if i.phase != HELD:
                out[i.phase] = out.get(i.phase, 0) + i.nbytes
        return out

    @property
    def peak(self) -> int:
        return self.held + max(self.phase_bytes().values(), default=0)

    @property
    def limit(self) -> Optional[int]:
        return None if self.capacity is None else int(self.capacity * self.share)

    @property
    def headroom(self) -> Optional[int]:
        return None if self.limit is None else self.limit - self.peak

    @property
    def fits(self) -> bool:
        return self.limit is None or self.peak <= self.limit

    @property
    def biggest(self) -> Item:
        return max(self.items, key=lambda i: i.nbytes)


@dataclass
class MemoryPlan:
    devices: list[DevicePlan]
    header: list[str] = field(default_factory=list)   # what was planned: model, layout, lengths
    notes: list[str] = field(default_factory=list)

    @property
    def checked(self) -> bool:
        """False when no device has a known capacity (cpu): nothing was checked."""
        return any(d.capacity is not None for d in self.devices)

    @property
    def fits(self) -> bool:
        return all(d.fits for d in self.devices)

    def biggest(self) -> tuple[DevicePlan, Item]:
        """The largest item of the devices that overflow (of all devices when everything fits)."""
        pool = [d for d in self.devices if not d.fits] or self.devices
        return max(((d, d.biggest) for d in pool), key=lambda di: di[1].nbytes)

    def verdict(self) -> str:
        dev, item = self.biggest()
        if not self.checked:
            return f"NOT CHECKED (no device memory limit); biggest item: {item.label} {_gib(item.nbytes)} ({dev.name})"
        if self.fits:
            return f"FITS: every device has headroom; biggest item: {item.label} {_gib(item.nbytes)} ({dev.name})"
        over = [d for d in self.devices if not d.fits]
        return ("DOES NOT FIT: " + "; ".join(f"{d.name} need {_gib(d.peak)} of {_gib(d.limit)}" for d in over)
                + f"; biggest item: {item.label} {_gib(item.nbytes)} ({dev.name})")

    def check(self) -> None:
        """Raise ConfigError naming the biggest item (and what lowers it) unless every device fits."""
        if self.fits:
            return
        dev, item = self.biggest()
        over = "; ".join(
            f"{d.name} ({d.devices or 'device'}) need {_gib(d.peak)} of {_gib(d.limit)}"
            + (f" (rollout.gpu_memory_utilization {d.share:g} of {_gib(d.capacity)})" if d.share < 1 else "")
            for d in self.devices if not d.fits)
        estimate = " (an estimate)" if item.estimate else ""
        raise ConfigError(f"memory plan: the config does not fit: {over}; biggest item: {item.label} "
                          f"{_gib(item.nbytes)}{estimate} on {dev.name}; {item.hint or 'lower it'}. "
                          "The full table: python tools/memory_plan.py --config <this config>")

    def format(self) -> str:
        lines = list(self.header)
        # GiB, or MiB when every device stays under 1 GiB (the tiny model)
        scale, unit = (GiB, "GiB") if max(d.peak for d in self.devices) >= GiB else (MiB, "MiB")
        num = lambda n: f"{n / scale:9.2f}"   # noqa: E731
        width = max(len(_item_label(i)) for d in self.devices for i in d.items) + 4
        for d in self.devices:
            lines += ["", f"{d.name}" + (f" ({d.devices})" if d.devices else "") + (", each:" if d.count > 1 else ":")]
            for phase in [HELD, *d.phase_bytes()]:
                indent = "  " if phase == HELD else "    "
                if phase != HELD:
                    lines.append(f"  during the {phase}:")
                lines += [f"{indent}{_item_label(i):<{width + 2 - len(indent)}}{num(i.nbytes)}"
                          for i in d.items if i.phase == phase]
            lines.append(f"  {'peak (held + largest phase)':<{width}}{num(d.peak)}")
            if d.capacity is not None:
                lines.append(f"  {'device memory':<{width}}{num(d.capacity)}")
                if d.share < 1:
                    lines.append(f"  {f'its share (x {d.share:g})':<{width}}{num(d.limit)}")
                lines.append(f"  {'headroom':<{width}}{num(d.headroom)}  {'ok' if d.fits else 'OVER'}")
            if d.note:
                lines.append(f"  ({d.note})")
        lines += ["", f"{unit} (2^{30 if scale == GiB else 20} bytes). * = estimate (upper bound at the configured "
                  "lengths); model state (policy, master, gradients, optimizer, old, reference) is exact."]
        lines += self.notes
        lines += ["", self.verdict()]
        return "\n".join(lines)


def _gib(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / GiB:.2f} GiB"


def _item_label(i: Item) -> str:
    return i.label + ("*" if i.estimate else "")


# ---------------------------------------------------------------------- model state
# (parameter counts per device: models/sizes.py)


def model_state_bytes(arch: "ModelArch", cfg: Config, stage: int = 0, with_old: Optional[bool] = None,
                      with_reference: bool = True) -> dict[str, int]:
    """The actor's model state on one rank of `stage`, keyed like TriModelActor.memory_bytes():
    policy, master (fp32 main copies of the low-precision weights), grads (fp32 with master
    weights, else the weights' dtype), optimizer (AdamW's two moments of each main parameter),
    old / ref (frozen weights; 0 when not built or offloaded to host memory)."""
    a = cfg.actor
    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    numel, norms = stage_param_numel(arch, tp, pp, stage)
    low = numel - norms                       # the weights in model.dtype (norms stay fp32)
    e = DTYPE_BYTES[cfg.model.dtype]
    policy = low * e + norms * NORM_BYTES
    keeps_master = a.fp32_master_weights and e != 4
    main = numel * 4 if keeps_master else policy
    if with_old is None:
        with_old = a.ppo_epochs > 1 or not a.old_logp_shortcut
    fe = e if a.frozen_dtype == "same" else DTYPE_BYTES[a.frozen_dtype]
    frozen = 0 if a.offload_frozen else low * fe + norms * NORM_BYTES
    return {"policy": policy, "master": low * 4 if keeps_master else 0, "grads": main, "optimizer": 2 * main,
            "old": frozen if with_old else 0, "ref": frozen if with_reference else 0}


# ---------------------------------------------------------------------- the plan


def group_sizes(cfg: Config) -> tuple[int, ...]:
    """Every K a batch can have: rollout.n, or under rollout.group_sizing: sagc every candidate
    (the controller may reach any of them)."""
    if cfg.rollout.group_sizing == "sagc":
        return tuple(cfg.rollout.sagc.candidates)
    return (cfg.rollout.n,)


def micro_batch_tokens(cfg: Config) -> tuple[int, int, int]:
    """(tokens through the model, sequences of S tokens for the attention term (0 with shared-prompt
    packing: fused attention), rows the loss's fp32 log-softmax runs over) of one micro-batch at the
    configured maximum lengths. Shared-prompt packing computes each prompt once: a micro-batch of B
    responses spans ceil(B/K) groups (one more when its boundary cuts groups)."""
    b, p, r = cfg.actor.micro_batch_size, cfg.data.max_prompt_length, cfg.rollout.max_new_tokens
    budget = cfg.actor.micro_batch_tokens
    if budget is not None:
        # a token budget bounds the padded tensor itself; the attention term rows x S^2 is largest
        # with the widest rows: budget // S sequences of S = prompt + response tokens
        return (budget, 0, budget) if cfg.actor.shared_prompt else (budget, budget // (p + r), budget)
    if not cfg.actor.shared_prompt:
        return b * (p + r), b, b * (p + r)

    def groups(k):
        return math.ceil(b / k) if (b % k == 0 or k % b == 0) else min(b, math.ceil(b / k) + 1)
    most = max(groups(k) for k in group_sizes(cfg))      # the smallest K puts the most prompts in
    return most * p + b * r, 0, b * r


def num_micro_steps(cfg: Config, dp: int) -> int:
    """Epoch-1 micro-steps of one DP rank at the largest K: every micro_batch_size sequences, or
    under a token budget the count its schedule is started with (dp_assignment's bound)."""
    k = max(group_sizes(cfg))
    seqs = math.ceil(cfg.data.train_batch_size * k / dp)
    if cfg.actor.micro_batch_tokens is None:
        return math.ceil(seqs / cfg.actor.micro_batch_size)
    p, r = cfg.data.max_prompt_length, cfg.rollout.max_new_tokens
    if cfg.actor.shared_prompt:     # atoms: groups
        return math.ceil(math.ceil(cfg.data.train_batch_size / dp) / max(1, cfg.actor.micro_batch_tokens // (p + k * r)))
    return math.ceil(seqs / max(1, cfg.actor.micro_batch_tokens // (p + r)))


def _trainer_items(arch: "ModelArch", cfg: Config, stage: int, dp: int) -> list[Item]:
    a, tp, pp = cfg.actor, cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    e = DTYPE_BYTES[cfg.model.dtype]
    with_old = a.ppo_epochs > 1 or not a.old_logp_shortcut
    ms = model_state_bytes(arch, cfg, stage, with_old=with_old, with_reference=a.uses_reference)
    fdt = cfg.model.dtype if a.frozen_dtype == "same" else a.frozen_dtype
    off = ", offloaded to host" if a.offload_frozen else ""
    frozen_hint = "set actor.frozen_dtype: bfloat16 or actor.offload_frozen: true"
    items = [
        Item("policy", f"policy weights ({cfg.model.dtype})", ms["policy"], hint=_TP_PP_HINT),
        Item("master", "fp32 master weights", ms["master"], hint=_TP_PP_HINT),
        Item("grads", "gradients (" + ("fp32" if ms["master"] or e == 4 else cfg.model.dtype) + ")", ms["grads"],
             hint=_TP_PP_HINT),
        Item("optimizer", "optimizer state (AdamW, 2 moments)", ms["optimizer"], hint=_TP_PP_HINT),
        Item("old", f"old policy ({fdt}{off})" if with_old else "old policy (not built: ppo_epochs 1)", ms["old"],
             hint=frozen_hint),
        Item("ref", f"reference model ({fdt}{off})" if a.uses_reference else "reference model (not built: kl_coef 0)",
             ms["ref"], hint=frozen_hint),
    ]
    # -- one micro-step (policy only: the frozen models run under no_grad and keep nothing)
    h, ffn = arch.hidden_size, arch.ffn_hidden_size
    qd, kvd = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    tokens, seqs, loss_rows = micro_batch_tokens(cfg)
    n_micro = num_micro_steps(cfg, dp)
    in_flight = min(pp - stage, n_micro)      # 1F1B: stage s holds pp - s micro-batches' activations
    layers = arch.num_layers // pp
    # kept for backward per token and layer (Korthikanti et al. 2022, no recompute, no sequence
    # parallelism): the two norms' inputs and the two linear inputs they feed, replicated over TP;
    # q, k, v (Megatron's local attention expands k / v to every head; the shared-prompt kernels do
    # not), the attention output (linear_proj's input), fc1's gate + up, SiLU(gate) and fc2's input,
    # split by TP.
    qkv = 3 * qd if seqs else qd + 2 * kvd
    per_token = 4 * h + (qkv + qd + 4 * ffn) // tp
    act = tokens * e * (per_token * layers + (2 * h if stage == pp - 1 else 0)) * in_flight
    if a.micro_batch_tokens is not None:
        lengths = f"actor.micro_batch_tokens {a.micro_batch_tokens} tokens" + (", shared prompt" if a.shared_prompt else "")
    else:
        lengths = f"{a.micro_batch_size} x {cfg.data.max_prompt_length}+{cfg.rollout.max_new_tokens} tokens" + (
            ", shared prompt" if a.shared_prompt else "")
    items.append(Item("activations", f"activations ({lengths}, {layers} layers"
                      + (f", {in_flight} micro-batches in flight" if in_flight > 1 else "") + ")",
                      act, estimate=True, phase=MICRO_STEP, hint=_ACT_HINT))
    if seqs:
        # Megatron's DotProductAttention (the local spec) materialises the probabilities [B, heads/TP,
        # S, S]: the fp32 softmax output (kept for its backward) and, below fp32, its copy in model.dtype
        # (kept by the probabilities x V matmul)
        s = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
        per = 4 + (e if e < 4 else 0)
        items.append(Item("attention", "attention probabilities (unfused, [B, heads/TP, S, S])",
                          seqs * (arch.num_heads // tp) * s * s * per * layers * in_flight, estimate=True,
                          phase=MICRO_STEP, hint="lower actor.micro_batch_size or the sequence length, raise "
                          "parallel.tensor_model_parallel_size, or set actor.shared_prompt: true (fused attention)"))
    if stage == pp - 1:
        # the policy's logits [tokens, V/TP] in model.dtype, and about three fp32 [rows, V/TP]: the
        # upcast logits, the log-softmax / exp kept for backward, and the logits' gradient
        v = arch.vocab_size // tp
        items.append(Item("logits", "logits + fp32 log-softmax / gradient", tokens * v * e + loss_rows * v * 4 * 3,
                          estimate=True, phase=MICRO_STEP, hint=_ACT_HINT))
    # -- optimizer step: torch's foreach AdamW makes one temporary per main parameter (sqrt(v))
    items.append(Item("opt_temp", "AdamW step temporaries", ms["optimizer"] // 2, estimate=True, phase=OPT_STEP,
                      hint=_TP_PP_HINT))
    # -- weight export to the rollout side: about one TP/PP-gathered bucket at a time
    items.append(Item("export", "weight export bucket", int(a.export_bucket_mb * MiB), estimate=True, phase=EXPORT,
                      hint="lower actor.export_bucket_mb"))
    return items


def _rollout_items(arch: "ModelArch", cfg: Config, engines: int,
                   on_accelerator: bool) -> tuple[list[Item], float, str]:
    """(items, share of the device, note) of one rollout engine serving 1/engines of each batch; a
    vLLM engine with rollout.tensor_parallel_size > 1: of each of its devices."""
    r = cfg.rollout
    p, n_new = cfg.data.max_prompt_length, r.max_new_tokens
    concurrent = min(r.max_slots, math.ceil(cfg.data.train_batch_size / engines) * r.n)
    numel, _ = stage_param_numel(arch)
    h, kvd, ffn = arch.hidden_size, arch.num_kv_heads * arch.head_dim, arch.ffn_hidden_size
    kv_per_token = arch.num_layers * 2 * kvd       # elements, K and V of every layer
    bucket = ([Item("sync_bucket", "weight-sync bucket (broadcast)", int(cfg.actor.export_bucket_mb * MiB),
                    estimate=True, hint="lower actor.export_bucket_mb")] if r.weight_sync == "broadcast" else [])
    seq_hint = "lower rollout.max_slots (or data.max_prompt_length / rollout.max_new_tokens)"
    if r.engine == "hf":
        # the HF engine loads the checkpoint in fp32 whatever model.dtype (rollout/hf_engine.py)
        items = [Item("rollout_weights", "rollout weights (hf engine: fp32)", numel * 4,
                      hint="use rollout.engine: vllm (model.dtype weights) or a smaller model"),
                 Item("kv_cache", f"KV cache (fp32, {concurrent} seqs x {p + n_new} tokens)",
                      concurrent * (p + n_new) * kv_per_token * 4, estimate=True, hint=seq_hint),
                 # prefill of every active row at once: one layer's MLP working set (gate/up/SiLU
                 # products) and the residual stream, then the last position's logits
                 Item("prefill", f"prefill activations ({concurrent} x {p} tokens, one layer)",
                      concurrent * p * (3 * ffn + 2 * h) * 4, estimate=True, phase=PREFILL, hint=seq_hint),
                 Item("prefill_logits", "last-position logits", concurrent * arch.vocab_size * 4, estimate=True,
                      phase=PREFILL, hint=seq_hint)] + bucket
        return items, 1.0, ""
    e = DTYPE_BYTES[cfg.model.dtype]
    max_model_len = r.max_model_len or arch.max_position_embeddings
    tp = r.tensor_parallel_size
    shard_numel, shard_kvd = vllm_shard_numel(arch, tp)
    of_tp = f", 1/{tp} per device" if tp > 1 else ""
    items = [Item("rollout_weights", f"rollout weights (vllm: {cfg.model.dtype}{of_tp})", shard_numel * e,
                  hint="raise rollout.tensor_parallel_size or rollout.gpu_memory_utilization, or use a smaller "
                  "model")]
    if on_accelerator:
        # vLLM takes gpu_memory_utilization of each device; its KV cache is what its weights and
        # activations leave: it must hold max_slots sequences (at least one of max_model_len), each
        # device the key/value heads of its shard
        tokens = max(concurrent * (p + n_new), max_model_len)
        items.append(Item("kv_cache", f"KV cache needed ({concurrent} seqs x {p + n_new} tokens, at least "
                          f"max_model_len {max_model_len}{of_tp})", tokens * arch.num_layers * 2 * shard_kvd * e,
                          estimate=True, hint="raise rollout.gpu_memory_utilization or rollout.tensor_parallel_size, "
                          "lower rollout.max_slots or rollout.max_model_len"))
        note = "vLLM fills its share: the headroom goes to its activations and more KV blocks"
        return items + bucket, r.gpu_memory_utilization, note
    items.append(Item("kv_cache", "KV cache (rollout.vllm_kv_cache_gb)", int(r.vllm_kv_cache_gb * GiB),
                      hint="lower rollout.vllm_kv_cache_gb"))
    return items + bucket, 1.0, ""


def _span(lo: int, hi: int) -> str:
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def plan_memory(cfg: Config, arch: "ModelArch", device_memory: Optional[int] = None,
                worker_memory: Optional[int] = None, world_size: Optional[int] = None,
                local_world_size: Optional[int] = None, arch_source: str = "") -> MemoryPlan:
    """The plan of `cfg` on `arch`. device_memory: bytes per trainer device (None: no limit checked);
    worker_memory: per rollout-worker device, remote ones included (default: device_memory).
    world_size: trainer processes (default TP x PP); local_world_size: those on this node (default
    world_size), which take devices 0.., the local rollout workers the next ones
    (backend.rollout_placements)."""
    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    world = world_size or tp * pp
    local = local_world_size or world
    dp = max(1, world // (tp * pp))
    if worker_memory is None:
        worker_memory = device_memory
    dev = cfg.backend
    on_accel = dev != "cpu"
    devices: list[DevicePlan] = []
    for stage in range(pp):
        lo, hi = stage * tp * dp, (stage + 1) * tp * dp - 1     # Megatron's rank order: TP, DP, then PP
        who = f"trainer rank{'s' if hi > lo else ''} {_span(lo, hi)}" + (f" (PP stage {stage})" if pp > 1 else "")
        where = f"{dev} {_span(lo, hi)}" if on_accel and world == local else ""
        devices.append(DevicePlan(who, where, _trainer_items(arch, cfg, stage, dp), device_memory, count=hi - lo + 1))
    sync = cfg.trainer.mode == "sync"
    workers = 0 if sync else cfg.rollout.num_workers
    rollout_tp = cfg.rollout.tensor_parallel_size if cfg.rollout.engine == "vllm" else 1
    # workers on other nodes (rollout.remote_workers, rollout/remote.py): same engine, own devices
    remote = 0 if sync else getattr(cfg.rollout, "remote_workers", 0)
    if sync:
        # the HF engine runs in trainer rank 0's process, on its device
        items, _, _ = _rollout_items(arch, cfg, 1, on_accel)
        first = devices[0]
        rank0 = DevicePlan("trainer rank 0 + colocated rollout engine (sync)", f"{dev} 0" if on_accel else "",
                           first.items + items, device_memory)
        if first.count > 1:
            lo, hi = 1, tp * dp - 1
            first.name = f"trainer rank{'s' if hi > lo else ''} {_span(lo, hi)}" + (" (PP stage 0)" if pp > 1 else "")
            first.devices = f"{dev} {_span(lo, hi)}" if first.devices else ""
            first.count = hi - lo + 1
            devices.insert(0, rank0)
        else:
            devices[0] = rank0
    elif workers + remote:
        # every engine serves an equal share of each batch; a vLLM engine spans rollout_tp devices
        items, share, note = _rollout_items(arch, cfg, workers + remote, on_accel)
        engine = cfg.rollout.engine + (f" TP {rollout_tp}, {rollout_tp} devices per worker" if rollout_tp > 1 else "")
        if workers:
            where = f"{dev} {_span(local, local + workers * rollout_tp - 1)}" if on_accel else ""
            devices.append(DevicePlan(f"rollout worker{'s' if workers > 1 else ''} {_span(0, workers - 1)}, "
                                      f"{engine}", where, items, worker_memory, share=share, note=note,
                                      count=workers * rollout_tp))
        if remote:
            devices.append(DevicePlan(f"remote rollout worker{'s' if remote > 1 else ''} "
                                      f"{_span(workers, workers + remote - 1)}, {engine}",
                                      "other nodes" if on_accel else "", list(items), worker_memory, share=share,
                                      note=note, count=remote * rollout_tp))
    numel, _ = stage_param_numel(arch)
    header = [f"model: {arch_source or arch.arch}: {numel / 1e9:.2f}e9 parameters, {arch.num_layers} layers, "
              f"hidden {arch.hidden_size}, vocab {arch.vocab_size}; model.dtype {cfg.model.dtype}",
              f"layout: backend {dev}, TP={tp} PP={pp} DP={dp} ({world} trainer process{'es' if world > 1 else ''}), "
              f"mode {cfg.trainer.mode}, {workers} rollout worker{'s' if workers != 1 else ''}"
              + (f" + {remote} on other nodes" if remote else "")
              + (f" ({cfg.rollout.engine}" + (f", TP {rollout_tp}" if rollout_tp > 1 else "") + ")"
                 if workers + remote else "")
              + (f"; {local + workers * rollout_tp} {dev} devices on this node ({local} trainer + {workers} x "
                 f"{rollout_tp} rollout)" if on_accel and workers else ""),
              (f"lengths: micro-batch {cfg.actor.micro_batch_size} sequences" if cfg.actor.micro_batch_tokens is None
               else f"lengths: micro-batch of at most {cfg.actor.micro_batch_tokens} tokens (actor.micro_batch_tokens)")
              + f" of {cfg.data.max_prompt_length} prompt + "
              f"{cfg.rollout.max_new_tokens} new tokens; rollout.max_slots {cfg.rollout.max_slots}"]
    notes = []
    if device_memory is None:
        notes.append("No device memory limit given: nothing checked (the cpu backend has none: trainer and workers "
                     "share the host's RAM); tools/memory_plan.py --device-memory-gb checks against one.")
    return MemoryPlan(devices, header, notes)


# ---------------------------------------------------------------------- the architecture


def resolve_arch(cfg: Config) -> tuple["ModelArch", str]:
    """(ModelArch, where it came from): the tiny model's without model.path; the checkpoint's
    config.json when the directory exists here; else the built-in table (models/known.py) by the
    directory's name."""
    from .models.mcore import UnsupportedModel, arch_from_hf_dict, arch_from_hf_dir
    if cfg.model.path is None:
        from .models.tiny import tiny_arch
        from .data.synthetic import tiny_alphabet
        return tiny_arch(cfg.model.tiny, tiny_alphabet(cfg.data)), "the tiny model (model.path null)"
    if os.path.isdir(cfg.model.path):
        return arch_from_hf_dir(cfg.model.path), f"{cfg.model.path}/config.json"
    from .models.known import KNOWN_HF_CONFIGS, known_hf_config
    known = known_hf_config(cfg.model.path)
    if known is None:
        raise UnsupportedModel(f"model.path: {cfg.model.path} does not exist here and its name is not in the "
                               f"built-in table; known: {', '.join(KNOWN_HF_CONFIGS)}")
    name, hf = known
    return (arch_from_hf_dict(hf, source=f"built-in {name}"),
            f"{name} from the built-in table ({cfg.model.path} is not on this machine)")
