"""Scoring of complete groups: decode the responses, reward them, compute their advantages with
the configured estimator (algo/advantages.py)."""
from __future__ import annotations

import time
from typing import Callable

from ..algo import compute_advantages
from ..reward.overlong import overlong_penalty
from .group import Group


class Scorer:
    """overlong: (max_new_tokens, buffer_len, penalty_factor) of DAPO's soft overlong punishment
    (reward.overlong_buffer), added to every reward here - the one place every mode scores - or None."""

    def __init__(self, reward_manager, decode: Callable[[list[int]], str], adv_estimator: str = "grpo",
                 algo_cfg=None, overlong: tuple[int, int, float] | None = None):
        self.reward, self.decode = reward_manager, decode
        self.adv_estimator, self.algo_cfg = adv_estimator, algo_cfg
        self.overlong = overlong

    def rewards(self, groups: list[Group], stats) -> None:
        """Fill each group's rewards (a part of a group too: a pilot's samples decide its commit)."""
        t0 = time.perf_counter()
        items = [(self.decode(r.response_ids), g.answer) for g in groups for r in g.results]
        scored = self.reward.score(items)
        it = iter(scored.scores)
        for g in groups:
            g.rewards = [next(it) for _ in g.results]
            if self.overlong is not None:
                g.overlong_penalties = [overlong_penalty(len(r.response_ids), *self.overlong) for r in g.results]
                g.rewards = [x + p for x, p in zip(g.rewards, g.overlong_penalties)]
        stats.reward_s += time.perf_counter() - t0
        stats.num_errors += scored.num_errors
        stats.num_timeouts += scored.num_timeouts
        stats.num_invalid += scored.num_invalid
        if stats.first_reward_error is None:
            stats.first_reward_error = scored.first_error

    def advantages(self, groups: list[Group]) -> None:
        """Fill each complete group's advantages from its rewards (over all of its K responses,
        never per part)."""
        advantages = compute_advantages(self.adv_estimator, [g.rewards for g in groups], self.algo_cfg)
        for g, adv in zip(groups, advantages):
            g.advantages = adv


def reward_fault_summary(stats, num_items: int) -> str | None:
    """One line for a step's reward failures (None if there were none): the trainer logs it once
    per step instead of a line per item, which a broken reward fn would turn into hundreds."""
    failed = stats.num_errors + stats.num_timeouts + stats.num_invalid
    if not failed:
        return None
    return (f"reward fn failed on {failed} of {num_items} responses, scored 0.0 ({stats.num_errors} raised or "
            f"lost their worker, {stats.num_timeouts} timed out, {stats.num_invalid} returned a non-number or "
            f"non-finite value); first: {stats.first_reward_error}")
