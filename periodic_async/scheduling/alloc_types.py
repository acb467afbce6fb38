"""What the allocator (allocation.py) hands the producer and what it keeps of one step
(torch-free): the drawn `Candidate`, the `AllocRequest`s to dispatch, the `TrainableGroup`s to
train, the `Outcome` of one delivery, which phases form a group (`group_parts`), and the per-step
bookkeeping (`StepState`, its slots and pilot rounds) shared by the allocator's core and its
pilot-commit part (pilot_commit.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional

from .prompt_reserve import PromptKey

FULL, PILOT, COMMIT = "full", "pilot", "commit"


class Candidate(NamedTuple):
    """A prompt drawn from the loader, with the loader epoch it was served from."""
    key: PromptKey
    epoch: int


Draw = Callable[[], Optional[Candidate]]


@dataclass(frozen=True)
class AllocRequest:
    """One request to dispatch: the samples `sample_indices` of the group of size `group_size` in
    slot `slot` (the RolloutRequest's group_index, which also fixes its seed), for prompt `key`.
    `reused`: not to dispatch - a pilot generated in an earlier step, whose rollouts the planner
    kept (rollout.pilot.reuse_pilots); it appears only among a TrainableGroup's parts."""
    slot: int
    key: PromptKey
    phase: str
    group_size: int
    sample_indices: tuple[int, ...]
    reused: bool = False

    @property
    def num_samples(self) -> int:
        return len(self.sample_indices)


@dataclass(frozen=True)
class TrainableGroup:
    """A group to train on: the outputs of `parts` merged, `group_size` responses in sample-index
    order, with `rewards` in that order."""
    slot: int
    key: PromptKey
    group_size: int
    parts: tuple[AllocRequest, ...]
    rewards: tuple[float, ...]


@dataclass
class Outcome:
    """What on_group asks of the producer: more requests to dispatch, groups ready to train, and
    whether the step has anything outstanding left; `kept`: (slot, key) of the surplus passers
    of this step whose pilot rollouts the planner must keep for a later step (reuse_pilots)."""
    requests: list[AllocRequest] = field(default_factory=list)
    ready: list[TrainableGroup] = field(default_factory=list)
    done: bool = False
    kept: list[tuple[int, PromptKey]] = field(default_factory=list)


def group_parts(group_size: int, n_pilot: Optional[int] = None) -> list[tuple[str, tuple[int, ...]]]:
    """The (phase, sample indices) whose outputs form one training group of `group_size`: one full
    part without a pilot, else the pilot's first n_pilot samples and the commit's rest."""
    if n_pilot is None:
        return [(FULL, tuple(range(group_size)))]
    if not 1 <= n_pilot < group_size:
        raise ValueError(f"n_pilot must be in [1, {group_size - 1}], got {n_pilot}")
    return [(PILOT, tuple(range(n_pilot))), (COMMIT, tuple(range(n_pilot, group_size)))]


def is_zero_variance(rewards) -> bool:
    """All rewards equal: every GRPO advantage of the group is zero."""
    return len(rewards) > 0 and max(rewards) == min(rewards)


# ---------------------------------------------------------------- one step's bookkeeping

PENDING, PASSED, COMMITTED, SURPLUS, SOLVED, DEFERRED, TRAINED, DROPPED = (
    "pending", "passed", "committed", "surplus", "solved", "deferred", "trained", "dropped")

PILOT_COUNTERS = ("pilot/piloted", "pilot/committed", "pilot/solved_dropped", "pilot/deferred",
                   "pilot/readmitted", "pilot/replay_added", "pilot/replayed", "pilot/replay_expired",
                   "pilot/rollouts", "pilot/fresh_filled", "pilot/rounds")
BACKFILL_COUNTERS = ("rollout/backfilled", "rollout/zero_variance_groups", "rollout/backfill_unreplaced",
                      "rollout/rollouts")


@dataclass
class SlotState:
    key: PromptKey
    epoch: int
    status: str = PENDING
    requests: dict[str, AllocRequest] = field(default_factory=dict)
    rewards: dict[str, tuple[float, ...]] = field(default_factory=dict)
    pilot_std: Optional[float] = None
    pilot_version: Optional[int] = None    # the oldest policy version of its pilot (reuse_pilots)


@dataclass
class Round:
    slots: list[int]
    commit_slots: int                     # passers of this round that may be committed


@dataclass
class StepState:
    step: int
    draw: Draw
    slots: dict[int, SlotState] = field(default_factory=dict)
    outstanding: set = field(default_factory=set)          # (slot, phase) requested, not delivered
    rounds: list[Round] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    committed: int = 0
    spent: int = 0
    group_size: int = 0         # K of this step (a group sizer may change it from step to step)
    budget: int = 0             # rollouts this step may spend
    trainable: int = 0          # groups made trainable so far
    n_pilot: int = 0            # pilot rollouts per prompt this step (rollout.pilot.n_pilot, or K // 4)
    reused: set = field(default_factory=set)    # keys committed on a stored pilot (reuse_pilots)
