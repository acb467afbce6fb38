"""Which DP rank trains which group, and how a rank's samples become micro-batches: the one rule,
shared by the trainer (train/step.py), the timeline (telemetry/timeline.py) and the torch-free
simulator (tools/sim/replay.py), so that all of them make the same choice."""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, Optional, Sequence, TypeVar

T = TypeVar("T")


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


def num_micro_batches(sizes: dict[int, int], owner: dict[int, int], dp_rank: int, micro_batch_size: int) -> int:
    """Micro-batches a DP rank runs in epoch 1 (`cut_micro_batches` of its groups): known up front
    from the group sizes (the pipeline schedule needs the count before the first group arrives)."""
    mine = sum(k for g, k in sizes.items() if owner[g] == dp_rank)
    return -(-mine // micro_batch_size)


def cut_micro_batches(parts: Iterable[Sequence[T]], micro_batch_size: int,
                      on_split: Optional[Callable[[T], None]] = None) -> Iterator[list[T]]:
    """The micro-batch split rule: a DP rank's groups (`parts`, each its samples) in completion
    order, cut every `micro_batch_size` samples as soon as that many are pending; what is left when
    `parts` ends (the rank's last group arrived) is the last, shorter micro-batch. Lazy: a part is
    pulled only when no full micro-batch is pending. `on_split(sample)`: called (to raise) when a
    cut would separate `sample` from the previous sample of its group."""
    pending: list[T] = []
    part_of: list[int] = []
    for i, part in enumerate(parts):
        pending += part
        part_of += [i] * len(part)
        while micro_batch_due(len(pending), 1, micro_batch_size):
            if on_split is not None and len(pending) > micro_batch_size and \
                    part_of[micro_batch_size - 1] == part_of[micro_batch_size]:
                on_split(pending[micro_batch_size])
            batch, pending = pending[:micro_batch_size], pending[micro_batch_size:]
            part_of = part_of[micro_batch_size:]
            yield batch
    if micro_batch_due(len(pending), 0, micro_batch_size):
        yield pending
