"""Which DP rank trains which group: the one rule, shared by the trainer (train/feed.py,
train/step.py) and the torch-free simulator (scheduling/simulator.py), so both make the same choice."""
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
