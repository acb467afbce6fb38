"""GRPO: group-normalised advantages, the clipped policy-gradient loss, KL estimators, entropy.

Conventions (B = sequences, S = positions): per-token tensors are [B, S] aligned so that position
t holds the quantity for predicting token t+1 (the label); `mask` [B, S] is 1 where that label is
a response token. Loss aggregation divides by a normaliser fixed for the WHOLE batch (its response
token count, or sequence count), so summing micro-batch losses gives the batch loss whatever the
order or split of the micro-batches (gradient accumulation is exact).
"""
from __future__ import annotations

from typing import Sequence

import torch


def group_advantages(group_rewards: Sequence[Sequence[float]], eps: float = 1e-6,
                     norm_by_std: bool = True) -> list[list[float]]:
    """A_i = (r_i - mean(group)) / (std(group) + eps) per group (std unbiased, as in GRPO/verl).
    Groups may have different sizes; a group of identical rewards gets zero advantages."""
    out = []
    for rewards in group_rewards:
        r = torch.tensor(rewards, dtype=torch.float64)
        if len(r) < 2:
            raise ValueError(f"group of size {len(r)}: GRPO needs at least 2 responses per prompt")
        a = r - r.mean()
        if norm_by_std:
            a = a / (r.std(unbiased=True) + eps)
        out.append(a.tolist())
    return out


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimators on sampled tokens (Schulman's k1/k2/k3).
    low_var_kl (k3): exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10] as in verl."""
    if kind == "kl":
        return logp - ref_logp
    if kind == "mse":
        return 0.5 * (logp - ref_logp).square()
    if kind == "low_var_kl":
        log_ratio = (ref_logp - logp).clamp(-20.0, 20.0)
        return (log_ratio.exp() - log_ratio - 1).clamp(-10.0, 10.0)
    raise ValueError(f"actor.kl_type: unknown '{kind}'; allowed: low_var_kl, kl, mse")


def clipped_pg_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                    clip_ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO-clip per-token loss max(-A r, -A clip(r, 1-e, 1+e)) with r = exp(logp - old_logp).
    Returns (loss [B, S], clipped [B, S] bool: where the clipped branch was taken)."""
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio, 1.0 + clip_ratio)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def aggregate(token_values: torch.Tensor, mask: torch.Tensor, mode: str, normaliser: float) -> torch.Tensor:
    """Sum of masked per-token values over this micro-batch divided by the batch-wide normaliser.
    token-mean: normaliser = response tokens in the batch.
    seq-mean-token-mean: each sequence's token mean, summed; normaliser = sequences in the batch."""
    mask = mask.to(token_values.dtype)
    if mode == "token-mean":
        return (token_values * mask).sum() / normaliser
    if mode == "seq-mean-token-mean":
        per_seq = (token_values * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_seq.sum() / normaliser
    raise ValueError(f"actor.loss_agg_mode: unknown '{mode}'; allowed: token-mean, seq-mean-token-mean")


def batch_normaliser(response_lengths: Sequence[int], mode: str) -> float:
    """The normaliser `aggregate` expects, from the response lengths of the WHOLE batch: its
    response-token count (token-mean) or its number of non-empty responses (seq-mean-token-mean)."""
    if mode == "token-mean":
        return float(sum(response_lengths))
    if mode == "seq-mean-token-mean":
        return float(sum(1 for n in response_lengths if n > 0))
    raise ValueError(f"actor.loss_agg_mode: unknown '{mode}'; allowed: token-mean, seq-mean-token-mean")
