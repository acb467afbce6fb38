"""Advantage estimators: per-group rewards -> per-sample advantages, chosen by `algo.adv_estimator`.

Torch-free (plain floats), so the scheduling side and a simulator can call them anywhere. Groups
may have different sizes K; each estimator sees one group at a time.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

from .registry import Registry
from .variance_control import min_variance_baseline

# name -> fn(rewards of one group, AlgoConfig or None) -> advantages of that group; an estimator
# with `uses_importance_ratios = True` also takes `rhos=` (the group's sequence-level ratios)
ADV_ESTIMATORS = Registry("algo.adv_estimator")
register_adv_estimator = ADV_ESTIMATORS.register


def compute_advantages(name: str, group_rewards: Sequence[Sequence[float]], cfg=None,
                       group_rhos: Optional[Sequence[Sequence[float]]] = None) -> list[list[float]]:
    """Advantages of each group with the estimator `name` (`cfg`: the AlgoConfig, or None for defaults).
    group_rhos: per group, each sequence's importance ratio pi_prox / pi_behav, for the estimators
    that use them (None: all 1, i.e. on-policy)."""
    fn = ADV_ESTIMATORS.lookup(name)
    takes_rhos = getattr(fn, "uses_importance_ratios", False)
    if group_rhos is not None and not takes_rhos:
        raise ValueError(f"algo.adv_estimator: '{name}' takes no importance ratios")
    if group_rhos is not None and len(group_rhos) != len(group_rewards):
        raise ValueError(f"{len(group_rewards)} groups of rewards but {len(group_rhos)} of importance ratios")
    out = []
    for i, rewards in enumerate(group_rewards):
        if len(rewards) < 2:
            raise ValueError(f"group {i} has {len(rewards)} response(s): '{name}' needs at least 2 per prompt")
        if group_rhos is not None:
            out.append(fn(rewards, cfg, rhos=group_rhos[i]))
        else:
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


@register_adv_estimator("vcpo_baseline")
def min_variance_baseline_advantages(rewards: Sequence[float], cfg=None,
                                     rhos: Optional[Sequence[float]] = None) -> list[float]:
    """VCPO's REINFORCE advantages A_i = r_i - b*, b* = sum(rho_i^2 r_i) / sum(rho_i^2) over the
    group (variance_control.min_variance_baseline), rho_i = sequence i's pi_prox / pi_behav. Without
    ratios (on-policy: all rho = 1) b* is the group mean. (Trained, the loss computes it from the
    ratios, on rewards divided by the group's std when algo.norm_adv_by_std_in_grpo: train/step.py.)"""
    baseline = min_variance_baseline(rewards, [1.0] * len(rewards) if rhos is None else rhos)
    return [x - baseline for x in rewards]


min_variance_baseline_advantages.uses_importance_ratios = True
