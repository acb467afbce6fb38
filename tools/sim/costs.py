"""The cost model: what each stage of a step costs (GenCosts per engine step, Costs for the rest),
the cluster (engines, slots, trainer devices, DP ranks) and the workload a replay runs.

An engine step costs
    decode_s + decode_row_s * rows + decode_ctx_s * context tokens of the rows     (decode)
  + prefill_s + prefill_row_s * rows + prefill_token_s * tokens prefilled          (prefill)
  + finish_s * sequences finished (their results sent);
a micro-step costs micro_step_s + token_s * tokens (padded to the longest row) + attn_s * rows *
width^2; scoring a group reward_call_s + reward_item_s * K; the weight sync sync_s + sync_byte_s *
bytes; the latencies between stages are in Costs (dispatch, result, hand-off, optimizer -> sync).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from .lengths import Lengths

GEN_FEATURES = ("decode_s", "decode_row_s", "decode_ctx_s", "prefill_s", "prefill_row_s", "prefill_token_s",
                "finish_s")


@dataclass
class GenCosts:
    """One rollout engine (device): seconds per engine step, by what the step holds."""
    decode_s: float = 0.0           # a decode forward
    decode_row_s: float = 0.0       # per sequence in it
    decode_ctx_s: float = 0.0       # per context token of its sequences (KV reads)
    prefill_s: float = 0.0          # a prefill forward
    prefill_row_s: float = 0.0      # per sequence prefilled
    prefill_token_s: float = 0.0    # per token prefilled
    finish_s: float = 0.0           # per finished sequence (its result sent)
    engine: str = "incremental"     # incremental | reprefill (engine.py)
    share_prompt: bool = True       # incremental: a prompt shared by several newcomers is prefilled once

    def step_s(self, f: list[float]) -> float:
        return sum(getattr(self, k) * v for k, v in zip(GEN_FEATURES, f))


@dataclass
class Costs:
    gen: GenCosts = field(default_factory=GenCosts)
    # training, per DP rank (one rank = a TP group of devices)
    micro_step_s: float = 0.0
    token_s: float = 0.0
    attn_s: float = 0.0             # per row x width^2 of a micro-batch
    pad: bool = True                # micro-batches are padded to their longest row (unshared packing)
    optimizer_s: float = 0.0
    # the rest of the step
    reward_call_s: float = 0.0
    reward_item_s: float = 0.0
    sync_s: float = 0.0
    sync_byte_s: float = 0.0
    dispatch_s: float = 0.0         # step start -> the engines start
    result_s: float = 0.0           # engine step end -> the producer has the result
    handoff_busy_s: float = 0.0     # previous micro-step end -> next start, when its group was there
    handoff_wait_s: float = 0.0     # group scored -> its micro-step starts, when the trainer waited
    post_train_s: float = 0.0       # optimizer end -> weight sync start

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Costs":
        d = dict(d)
        gen = GenCosts(**{k: v for k, v in d.pop("gen", {}).items() if k in {f.name for f in fields(GenCosts)}})
        return cls(gen=gen, **{k: v for k, v in d.items() if k in {f.name for f in fields(cls)}})


@dataclass
class Cluster:
    """split modes: `rollout_devices` engines with `slots` slots each, `trainer_devices` trainer
    devices in DP ranks of `tp`; sync: `colocated_engines` engines (default: one per device) and
    the trainer on all `trainer_devices + rollout_devices` devices unless `colocated_devices`."""
    rollout_devices: int = 1
    trainer_devices: int = 1
    slots: int = 32
    tp: int = 1
    colocated_devices: int | None = None
    colocated_engines: int | None = None

    def devices(self, mode: str) -> int:
        if mode == "sync":
            if self.colocated_devices is not None:
                return self.colocated_devices
            return self.trainer_devices + self.rollout_devices
        return self.trainer_devices + self.rollout_devices

    def engines(self, mode: str) -> int:
        if mode == "sync":
            return self.colocated_engines if self.colocated_engines is not None else self.devices(mode)
        return self.rollout_devices

    def dp(self, mode: str) -> int:
        devices = self.devices(mode) if mode == "sync" else self.trainer_devices
        return max(1, devices // self.tp)


@dataclass
class Workload:
    prompts: int
    n: int
    response_lengths: Lengths
    prompt_lengths: Lengths
    micro_batch_size: int
    weight_bytes: float = 0.0
