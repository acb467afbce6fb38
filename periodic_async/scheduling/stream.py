"""Streaming consumption in async mode (`trainer.stream_slack` s > 0): a step trains the first B
groups to finish, from whichever batch, while no group is kept past its deadline (torch-free).

Deadlines. A batch dispatched while every worker held version v or newer has no token older than
v, so a step at trainer version t - 1 may train its groups while t - 1 - v <= eta: the group's
deadline is step v + 1 + eta (staleness.py: `deadline`). The trainer's admission check stays the
judge; this order only makes sure it never has to refuse.

Why a slack. The staleness rule dispatches batch b once the workers hold b - 1 - lookahead, so a
batch dispatched at the first moment has deadline b + (eta - lookahead). With lookahead = eta
(the batch-bound schedule, `stream_slack: 0`) every batch's deadline is its own step: steps 1..t
must train all of batches 1..t, so a step that took a group of a later batch would leave a group
of an earlier one past its deadline, and the only feasible order is batch by batch. A slack
s = eta - lookahead >= 1 trades run-ahead for reordering: the producer runs eta - s batches
ahead, and a group may be trained up to s steps after its batch's own step (or before it).

The choice (earliest-deadline feasibility). Step t, having taken k groups, takes the ready group
that finished first, unless taking it would leave some step d in [t, its deadline) with more
pending groups due by d than steps t..d can still train: it needs, for every such d,
P(<= d) <= (d - t + 1) B - k - 1, where P(<= d) counts the pending groups (dispatched, not yet
taken: ready or generating) whose deadline is d or earlier. Otherwise the step waits: for a group
with an earlier deadline to finish. The pending group of the earliest deadline is always
feasible, so the step never waits for nothing.

That it is always feasible: a batch b dispatched at version v adds B groups with deadline
D = v + 1 + eta; every pending group belongs to batches <= b <= v + 1 + lookahead, of which
(t - 1) B + k are taken, so P(<= D) <= (b - t + 1) B - k <= (D - t + 1) B - k (lookahead <= eta):
dispatching keeps the condition, taking a feasible group keeps it, and so every group is taken
by its deadline. tests/test_stream.py checks it on random arrivals.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Batch:
    deadline: int           # the last step that may train its groups
    pending: int            # its groups not yet taken (ready or generating)
    taken: set = field(default_factory=set)     # group indices (within the batch) taken


class StreamOrder:
    """Which ready group a step takes next. `batch_size`: B, groups per step and per batch.
    Single-threaded: the producer calls it under its lock."""

    def __init__(self, batch_size: int, max_staleness: int):
        self.batch_size, self.max_staleness = batch_size, max_staleness
        self._batches: dict[int, _Batch] = {}
        self._ready: list[tuple[int, object]] = []      # (batch, group) in completion order

    def add_batch(self, batch: int, num_groups: int, dispatch_version: int) -> None:
        """Batch `batch` is dispatched while every worker holds `dispatch_version` or newer."""
        if batch in self._batches:
            raise ValueError(f"batch {batch} dispatched twice")
        self._batches[batch] = _Batch(dispatch_version + 1 + self.max_staleness, num_groups)

    def add_ready(self, batch: int, group) -> None:
        """A scored group of `batch` (its `group_index`: its index within the batch)."""
        self._ready.append((batch, group))

    def take(self, step: int, k: int):
        """The (k+1)-th group of step `step` as (batch, group), or None: wait for the next group
        to finish. Raises if a pending group is already past its deadline (a broken invariant:
        the trainer would refuse it)."""
        late = [b for b, st in self._batches.items() if st.pending and st.deadline < step]
        if late:
            raise RuntimeError(f"step {step}: batch {late[0]} has groups past their deadline "
                               f"{self._batches[late[0]].deadline}")
        for i, (batch, group) in enumerate(self._ready):
            if self._feasible(step, k, self._batches[batch].deadline):
                del self._ready[i]
                st = self._batches[batch]
                st.pending -= 1
                st.taken.add(group.group_index)
                return batch, group
        return None

    def _feasible(self, step: int, k: int, deadline: int) -> bool:
        for d in range(step, deadline):
            due = sum(st.pending for st in self._batches.values() if st.deadline <= d)
            if due > (d - step + 1) * self.batch_size - k - 1:
                return False
        return True

    def done(self, batch: int) -> bool:
        """Every group of `batch` is taken."""
        return self._batches[batch].pending == 0

    def forget(self, batch: int) -> None:
        del self._batches[batch]

    def taken(self, batch: int) -> set:
        """Group indices of `batch` taken so far."""
        return self._batches[batch].taken

    @property
    def num_ready(self) -> int:
        return len(self._ready)
