"""Advantage estimators: per-group rewards -> per-sample advantages, chosen by `algo.adv_estimator`.

Torch-free (plain floats), so the scheduling side and a simulator can call them anywhere. Groups
may have different sizes K; each estimator sees one group at a time.
"""
from __future__ import annotations

import math
from typing import Sequence

from .registry import Registry

# name -> fn(rewards of one group, AlgoConfig or None) -> advantages of that group
ADV_ESTIMATORS = Registry("algo.adv_estimator")
register_adv_estimator = ADV_ESTIMATORS.register


def compute_advantages(name: str, group_rewards: Sequence[Sequence[float]], cfg=None) -> list[list[float]]:
    """Advantages of each group with the estimator `name` (`cfg`: the AlgoConfig, or None for defaults)."""
    fn = ADV_ESTIMATORS.lookup(name)
    out = []
    for i, rewards in enumerate(group_rewards):
        if len(rewards) < 2:
            raise ValueError(f"group {i} has {len(rewards)} response(s): '{name}' needs at least 2 per prompt")
        out.append(fn(rewards, cfg))
    return out


def _mean_std(r: Sequence[float]) -> tuple[float, float]:
    mean = math.fsum(r) / len(r)
    var = math.fsum((x - mean) ** 2 for x in r) / (len(r) - 1)      # unbiased, as GRPO / verl
    return mean, math.sqrt(var)


@register_adv_estimator("grpo")
def grpo_advantages(rewards: Sequence[float], cfg=None) -> list[float]:
    """A_i = (r_i - mean) / (std + eps) (std unbiased; `algo.norm_adv_by_std_in_grpo: false` skips
    the division, Dr. GRPO). A group of identical rewards gets zero advantages."""
    eps = getattr(cfg, "adv_eps", 1e-6)
    mean, std = _mean_std(rewards)
    if getattr(cfg, "norm_adv_by_std_in_grpo", True):
        return [(x - mean) / (std + eps) for x in rewards]
    return [x - mean for x in rewards]


@register_adv_estimator("rloo")
def rloo_advantages(rewards: Sequence[float], cfg=None) -> list[float]:
    """REINFORCE leave-one-out: A_i = r_i - mean of the other K - 1 rewards."""
    k, total = len(rewards), math.fsum(rewards)
    return [x - (total - x) / (k - 1) for x in rewards]
