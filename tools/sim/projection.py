"""The hardware projection: stage costs (costs.Costs) derived from a model's shape (flops.py) and a
device's figures and assumed efficiencies, where no run on that hardware can be calibrated on
(tools/simulate.py project)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .costs import Costs, GenCosts
from .flops import ModelShape


@dataclass
class Hardware:
    """A device and the efficiencies assumed on it; each figure with where it comes from."""
    name: str
    peak_flops: float               # dense bf16 FLOP/s per device
    hbm_bytes_per_s: float
    mfu_train: float                # achieved / peak in the training micro-steps
    mfu_prefill: float
    mfu_decode: float               # compute part of a decode step
    mbu_decode: float               # achieved / peak HBM bandwidth when a decode step reads weights + KV
    decode_overhead_s: float        # per engine step (launch, sampling, scheduling)
    micro_step_overhead_s: float
    optimizer_bytes_per_param: float
    allreduce_bytes_per_s: float    # per device, data-parallel gradient all-reduce (ring)
    sync_bytes_per_s: float         # weight sync, trainer -> each rollout engine
    sync_overhead_s: float
    reward_item_s: float            # per response, all reward workers together
    dispatch_s: float
    colocated_sync_bytes_per_s: float = 100e9   # sync mode: the engine shares the trainer's device
    sources: dict = field(default_factory=dict)


def costs_from_hardware(shape: ModelShape, hw: Hardware, tp: int, dp: int, dtype_bytes: int = 2,
                        colocated: bool = False) -> Costs:
    """Stage costs of `shape` on `hw`: decode memory-bound (weights + KV read at mbu_decode of the
    HBM bandwidth) plus its compute at mfu_decode; prefill and training compute-bound at their
    MFU; training per DP rank of `tp` devices (policy fwd+bwd and reference fwd: 8 N per token,
    attention 8 L d per token pair), Adam memory-bound plus a ring all-reduce of fp32 gradients."""
    n = shape.matmul_params
    w_bytes = shape.total_params * dtype_bytes
    gen = GenCosts(
        decode_s=w_bytes / (hw.hbm_bytes_per_s * hw.mbu_decode) + hw.decode_overhead_s,
        decode_row_s=2 * n / (hw.peak_flops * hw.mfu_decode),
        decode_ctx_s=shape.kv_bytes_per_token(dtype_bytes) / (hw.hbm_bytes_per_s * hw.mbu_decode)
        + 4 * shape.layers * shape.attn_dim / (hw.peak_flops * hw.mfu_decode),
        prefill_s=hw.decode_overhead_s, prefill_token_s=2 * n / (hw.peak_flops * hw.mfu_prefill),
        engine="incremental", share_prompt=True)
    shard = shape.total_params / tp
    allreduce = 2 * (dp - 1) / dp * shard * 4 / hw.allreduce_bytes_per_s if dp > 1 else 0.0
    return Costs(
        gen=gen, micro_step_s=hw.micro_step_overhead_s,
        token_s=8 * n / (tp * hw.peak_flops * hw.mfu_train),
        attn_s=8 * shape.layers * shape.attn_dim / (tp * hw.peak_flops * hw.mfu_train),
        pad=True, optimizer_s=shard * hw.optimizer_bytes_per_param / hw.hbm_bytes_per_s + allreduce,
        reward_call_s=0.001, reward_item_s=hw.reward_item_s, sync_s=hw.sync_overhead_s,
        sync_byte_s=1.0 / (hw.colocated_sync_bytes_per_s if colocated else hw.sync_bytes_per_s),
        dispatch_s=hw.dispatch_s, result_s=0.001,
        handoff_busy_s=0.002, handoff_wait_s=0.002, post_train_s=0.0)
