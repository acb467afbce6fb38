"""Which DP rank trains which group, and when a rank packs a micro-batch: the rules shared by the
trainer (train/feed.py, train/step.py) and the torch-free simulator (tools/sim/replay.py), so both
make the same choices."""
from __future__ import annotations


def assign_groups(sizes: dict[int, int], dp_size: int) -> dict[int, int]:
    """group index -> DP rank, balancing the number of samples (groups may differ in K): largest
    group first to the least-loaded rank (ties: lower group index, lower rank). Deterministic, so
    every rank computes the same assignment; with equal K it is group i -> rank i mod DP."""
    load = [0] * dp_size
    owner = {}
    for g in sorted(sizes, key=lambda g: (-sizes[g], g)):
        r = min(range(dp_size), key=lambda r: (load[r], r))
        owner[g] = r
        load[r] += sizes[g]
    return owner


def micro_batch_due(pending: int, groups_left: int, micro_batch_size: int) -> bool:
    """Whether a DP rank packs a micro-batch now, in epoch 1 (groups in completion order): when
    `micro_batch_size` of its samples are pending, or some are and none of its groups is still to
    come (`groups_left` == 0). The micro-batch is the first `micro_batch_size` pending samples."""
    return pending >= micro_batch_size or (pending > 0 and groups_left == 0)
