"""rollout.pilot and rollout.backfill: the allocation switches' configuration, their validation and
the exact threshold arithmetic the pilot's verdicts use (torch-free; what the switches do is
scheduling/allocation.py and docs/allocation.md).

The thresholds are compared exactly on counts: s * den >= num * n_pilot with p_upper = num / den.
A float threshold is read as the nearest fraction with denominator at most 10**6, so 1/3 written
as 0.3333333333333333 (or passed as the string "1/3" or a Fraction) is exactly one third.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Optional

_THRESHOLD_MAX_DENOMINATOR = 10 ** 6

@dataclass
class PilotConfig:
    """rollout.pilot: pilot-commit allocation (scheduling/allocation.py)."""
    enabled: bool = False                 # set by rollout.selection: pilot (the allocator's switch)
    n_pilot: int = 2                      # pilot rollouts per prompt; commit = K - n_pilot
    p_lower: float = 0.0                  # p <= p_lower: deferred to the next epoch
    p_upper: float = 1.0                  # p >= p_upper: solved, never sampled again
    success_threshold: float = 1.0        # a rollout succeeds when its reward >= this
    replay_max_age: int = 4               # steps a surplus prompt may wait in the replay buffer
    budget: Optional[int] = None          # rollouts per step, every phase; None: B * K
    num_candidates: Optional[int] = None  # prompts piloted in a step's first round; None: B

    def resolved_budget(self, batch_size: int, group_size: int) -> int:
        return self.budget if self.budget is not None else batch_size * group_size

    def resolved_candidates(self, batch_size: int) -> int:
        return self.num_candidates if self.num_candidates is not None else batch_size

    def validate(self, batch_size: int, group_size: int) -> None:
        """Raise ValueError naming the key; nothing is checked while the pilot is off."""
        if not self.enabled:
            return
        if group_size < 2:
            raise ValueError(f"rollout.n must be >= 2 with rollout.selection pilot, got {group_size}")
        if not 1 <= self.n_pilot < group_size:
            raise ValueError(f"rollout.pilot.n_pilot must be in [1, rollout.n - 1] = [1, {group_size - 1}] so that "
                             f"a commit of at least one rollout follows, got {self.n_pilot}")
        lower = threshold_fraction(self.p_lower, "rollout.pilot.p_lower")
        upper = threshold_fraction(self.p_upper, "rollout.pilot.p_upper")
        if not 0 <= lower <= 1:
            raise ValueError(f"rollout.pilot.p_lower must be in [0, 1], got {self.p_lower}")
        if not 0 <= upper <= 1:
            raise ValueError(f"rollout.pilot.p_upper must be in [0, 1], got {self.p_upper}")
        if lower > upper:
            raise ValueError(f"rollout.pilot.p_lower must be <= p_upper, got p_lower={self.p_lower} "
                             f"> p_upper={self.p_upper}")
        if not any(classify(s, self.n_pilot, lower, upper) == "passed" for s in range(self.n_pilot + 1)):
            raise ValueError(f"rollout.pilot.p_lower / p_upper: no success count s of n_pilot={self.n_pilot} has "
                             f"p_lower={self.p_lower} < s/{self.n_pilot} < p_upper={self.p_upper}, so no prompt "
                             f"would ever be committed")
        if not math.isfinite(self.success_threshold):
            raise ValueError(f"rollout.pilot.success_threshold must be a finite number, got {self.success_threshold}")
        if self.replay_max_age < 0:
            raise ValueError(f"rollout.pilot.replay_max_age must be >= 0 steps, got {self.replay_max_age}")
        if self.budget is not None and self.budget < 1:
            raise ValueError(f"rollout.pilot.budget must be >= 1 rollouts (or null: B * K), got {self.budget}")
        if self.num_candidates is not None and self.num_candidates < 1:
            raise ValueError(f"rollout.pilot.num_candidates must be >= 1 (or null: B), got {self.num_candidates}")
        budget = self.resolved_budget(batch_size, group_size)
        pilots = self.resolved_candidates(batch_size) * self.n_pilot
        if pilots + (group_size - self.n_pilot) > budget:
            raise ValueError(f"rollout.pilot.budget: {budget} rollouts do not cover the pilots of "
                             f"num_candidates={self.resolved_candidates(batch_size)} x n_pilot={self.n_pilot} "
                             f"plus one commit of {group_size - self.n_pilot}")


@dataclass
class BackfillConfig:
    """rollout.backfill: in-batch replacement of zero-variance groups (scheduling/allocation.py)."""
    enabled: bool = False                 # set by rollout.selection: backfill (the allocator's switch)
    max_groups: Optional[int] = None      # extra groups drawn per step at most; None: B

    def resolved_max_groups(self, batch_size: int) -> int:
        return self.max_groups if self.max_groups is not None else batch_size

    def validate(self, batch_size: int) -> None:
        if self.enabled and self.max_groups is not None and self.max_groups < 0:
            raise ValueError(f"rollout.backfill.max_groups must be >= 0 (or null: B), got {self.max_groups}")


def validate_allocation(pilot: PilotConfig, backfill: BackfillConfig, batch_size: int, group_size: int) -> None:
    """Both sections and their combination; raises ValueError naming the key."""
    if batch_size < 1:
        raise ValueError(f"data.train_batch_size must be >= 1, got {batch_size}")
    pilot.validate(batch_size, group_size)
    backfill.validate(batch_size)
    if pilot.enabled and backfill.enabled:
        raise ValueError("rollout.backfill: cannot be combined with the pilot - a committed pilot holds a success "
                         "and a failure, so its groups always have varying rewards and backfill would never act")


def threshold_fraction(value: Any, key: str = "threshold") -> Fraction:
    """A rate threshold as an exact fraction: a Fraction or int as it is, a string such as "1/3"
    parsed exactly, a float as the nearest fraction with denominator <= 10**6 (so the float 1/3 is
    exactly one third and 0.25 is 1/4)."""
    if isinstance(value, bool):
        raise ValueError(f"{key} must be a number or a fraction string, got {value!r}")
    try:
        if isinstance(value, (Fraction, int)):
            return Fraction(value)
        if isinstance(value, str):
            return Fraction(value.strip())
        if isinstance(value, float) and math.isfinite(value):
            return Fraction(value).limit_denominator(_THRESHOLD_MAX_DENOMINATOR)
    except (ValueError, ZeroDivisionError):
        pass
    raise ValueError(f"{key} must be a finite number or a fraction string such as '1/3', got {value!r}")


def classify(successes: int, n: int, p_lower: Fraction, p_upper: Fraction) -> str:
    """'solved' if s/n >= p_upper, else 'deferred' if s/n <= p_lower, else 'passed' - compared on
    integers, s * den vs num * n, so a rate equal to a bound is exactly on it."""
    if successes * p_upper.denominator >= p_upper.numerator * n:
        return "solved"
    if successes * p_lower.denominator <= p_lower.numerator * n:
        return "deferred"
    return "passed"
