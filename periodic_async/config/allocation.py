"""rollout.pilot and rollout.backfill: the allocation switches' configuration, their validation and
the exact threshold arithmetic the pilot's verdicts use (torch-free; what the switches do is
scheduling/allocation.py and docs/allocation.md).

The pilot's defaults are the official code's (databricks/pilot-commit, recipe/pc and
train_scripts/pc_qwen2.5-1.5b_p32c96.sh): n_pilot = K / 4 (32 of 128), a prompt passes when its
pilot accuracy p lies in [1/8, 3/4] (diversity_threshold_lower 0.125 <= p <= 1 -
diversity_threshold_upper 0.25, both inclusive), and a prompt at p >= 1.0 is excluded from the next
epoch on (exclude_threshold_upper). `PilotConfig.v0` gives the settings that decide exactly as this
project's first pilot did (one threshold both the top of the band and eviction, evicted at once,
fill rounds from the prompt reserve only).

The thresholds are compared exactly on counts: pass_lower <= s / n is s * den >= num * n with
pass_lower = num / den. A float threshold is read as the nearest fraction with denominator at
most 10**6, so 1/3 written as 0.3333333333333333 (or passed as the string "1/3" or a Fraction) is
exactly one third.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, NamedTuple, Optional

_THRESHOLD_MAX_DENOMINATOR = 10 ** 6
EVICT_FROM = ("next_epoch", "now")
FILL_FROM = ("reserve_then_loader", "loader", "reserve")


@dataclass
class PilotConfig:
    """rollout.pilot: pilot-commit allocation (scheduling/allocation.py)."""
    enabled: bool = False                 # set by rollout.selection: pilot (the allocator's switch)
    n_pilot: Optional[int] = None         # pilot rollouts per prompt; commit = K - n_pilot; None: K // 4 (>= 1)
    pass_lower: float = 0.125             # a prompt passes (is committed) when pass_lower <= p <= pass_upper
    pass_upper: float = 0.75
    evict_at: Optional[float] = 1.0       # p >= evict_at: never piloted again (None: never evicted)
    evict_from: str = "next_epoch"        # next_epoch: refused from the loader's next epoch on | now
    fill_from: str = "reserve_then_loader"  # where a step short of B commits finds more prompts
    success_threshold: float = 1.0        # a rollout succeeds when its reward >= this
    replay_max_age: int = 4               # steps a surplus passer may wait in the prompt reserve
    # async (eta > 0): a reserve entry whose pilot rollouts are at most eta versions old is
    # committed on them (K - n_pilot new rollouts) instead of piloted again, most varied first
    reuse_pilots: bool = False
    budget: Optional[int] = None          # rollouts per step, every phase; None: B * K
    num_candidates: Optional[int] = None  # prompts piloted per round (the first and each fresh fill); None: B
    # replaced by the keys above (refused with the equivalent settings): PilotConfig.v0
    p_lower: Optional[float] = None
    p_upper: Optional[float] = None

    @classmethod
    def v0(cls, n_pilot: int = 2, p_lower: Any = 0.0, p_upper: Any = 1.0, **rest) -> "PilotConfig":
        """The settings under which the allocator decides exactly as the first version did, whose
        `p_lower` / `p_upper` meant: deferred at p <= p_lower, solved (evicted at once) at p >=
        p_upper, passed strictly between, fill rounds from the prompt reserve only. With p = s /
        n_pilot, "strictly between" is the inclusive band from the first s / n above p_lower to
        the last below p_upper (tests/test_allocation_v0.py replays a recorded trace of the first
        version against these settings)."""
        lo = threshold_fraction(p_lower, "rollout.pilot.p_lower")
        hi = threshold_fraction(p_upper, "rollout.pilot.p_upper")
        band = [Fraction(s, n_pilot) for s in range(n_pilot + 1) if lo < Fraction(s, n_pilot) < hi]
        # floats, as a config file holds them: s / n with n <= 10**3 reads back exactly (threshold_fraction)
        pass_lower, pass_upper = (float(band[0]), float(band[-1])) if band else (1.0, 0.0)
        return cls(enabled=True, n_pilot=n_pilot, pass_lower=pass_lower, pass_upper=pass_upper, evict_at=float(hi),
                   evict_from="now", fill_from="reserve", **rest)

    def resolved_n_pilot(self, group_size: int) -> int:
        """n_pilot, or K // 4 (at least 1) when unset: the official script pilots 32 of 128."""
        return self.n_pilot if self.n_pilot is not None else max(1, group_size // 4)

    def resolved_budget(self, batch_size: int, group_size: int) -> int:
        return self.budget if self.budget is not None else batch_size * group_size

    def resolved_candidates(self, batch_size: int) -> int:
        return self.num_candidates if self.num_candidates is not None else batch_size

    def thresholds(self) -> "Thresholds":
        return Thresholds(threshold_fraction(self.pass_lower, "rollout.pilot.pass_lower"),
                          threshold_fraction(self.pass_upper, "rollout.pilot.pass_upper"),
                          None if self.evict_at is None else threshold_fraction(self.evict_at, "rollout.pilot.evict_at"))

    def validate(self, batch_size: int, group_size: int) -> None:
        """Raise ValueError naming the key; nothing is checked while the pilot is off."""
        if not self.enabled:
            return
        for old in ("p_lower", "p_upper"):
            if getattr(self, old) is not None:
                raise ValueError(f"rollout.pilot.{old}: replaced by pass_lower / pass_upper (inclusive band), "
                                 f"evict_at and evict_from; the first version's p_lower=a, p_upper=b are "
                                 f"PilotConfig.v0 (docs/allocation.md: pass_lower/pass_upper the s/n_pilot "
                                 f"strictly between a and b, evict_at=b, evict_from=now, fill_from=reserve)")
        if group_size < 2:
            raise ValueError(f"rollout.n must be >= 2 with rollout.selection pilot, got {group_size}")
        n_pilot = self.resolved_n_pilot(group_size)
        if not 1 <= n_pilot < group_size:
            raise ValueError(f"rollout.pilot.n_pilot must be in [1, rollout.n - 1] = [1, {group_size - 1}] so that "
                             f"a commit of at least one rollout follows, got {n_pilot}")
        t = self.thresholds()
        for key, value in (("pass_lower", t.pass_lower), ("pass_upper", t.pass_upper), ("evict_at", t.evict_at)):
            if value is not None and not 0 <= value <= 1:
                raise ValueError(f"rollout.pilot.{key} must be in [0, 1], got {getattr(self, key)}")
        if not any(t.passes(s, n_pilot) for s in range(n_pilot + 1)):
            unset = " (n_pilot unset: K // 4)" if self.n_pilot is None else ""
            raise ValueError(f"rollout.pilot.pass_lower / pass_upper: no success count s of n_pilot={n_pilot}{unset} "
                             f"has pass_lower={self.pass_lower} <= s/{n_pilot} <= pass_upper={self.pass_upper}, so "
                             f"no prompt would ever be committed; widen the band or raise rollout.pilot.n_pilot")
        if self.evict_from not in EVICT_FROM:
            raise ValueError(f"rollout.pilot.evict_from must be one of {', '.join(EVICT_FROM)}, got {self.evict_from!r}")
        if self.fill_from not in FILL_FROM:
            raise ValueError(f"rollout.pilot.fill_from must be one of {', '.join(FILL_FROM)}, got {self.fill_from!r}")
        if not math.isfinite(self.success_threshold):
            raise ValueError(f"rollout.pilot.success_threshold must be a finite number, got {self.success_threshold}")
        if self.reuse_pilots and self.fill_from == "loader":
            raise ValueError("rollout.pilot.reuse_pilots: needs the prompt reserve, but rollout.pilot.fill_from is "
                             "'loader' (fills never read it); use reserve_then_loader or reserve")
        if self.replay_max_age < 0:
            raise ValueError(f"rollout.pilot.replay_max_age must be >= 0 steps, got {self.replay_max_age}")
        if self.budget is not None and self.budget < 1:
            raise ValueError(f"rollout.pilot.budget must be >= 1 rollouts (or null: B * K), got {self.budget}")
        if self.num_candidates is not None and self.num_candidates < 1:
            raise ValueError(f"rollout.pilot.num_candidates must be >= 1 (or null: B), got {self.num_candidates}")
        budget = self.resolved_budget(batch_size, group_size)
        pilots = self.resolved_candidates(batch_size) * n_pilot
        if pilots + (group_size - n_pilot) > budget:
            raise ValueError(f"rollout.pilot.budget: {budget} rollouts do not cover the pilots of "
                             f"num_candidates={self.resolved_candidates(batch_size)} x n_pilot={n_pilot} "
                             f"plus one commit of {group_size - n_pilot}")


class Thresholds(NamedTuple):
    """The pilot's thresholds as exact fractions (evict_at None: never evicted)."""
    pass_lower: Fraction
    pass_upper: Fraction
    evict_at: Optional[Fraction]

    def passes(self, successes: int, n: int) -> bool:
        """pass_lower <= s/n <= pass_upper, on integers (s * den vs num * n): a rate on a bound is in."""
        return (successes * self.pass_lower.denominator >= self.pass_lower.numerator * n
                and successes * self.pass_upper.denominator <= self.pass_upper.numerator * n)

    def evicts(self, successes: int, n: int) -> bool:
        """s/n >= evict_at, on integers."""
        return self.evict_at is not None and successes * self.evict_at.denominator >= self.evict_at.numerator * n


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
        raise ValueError("rollout.backfill: cannot be combined with the pilot - both choose which prompts a step "
                         "trains on (one rule at a time: rollout.selection)")


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
