"""Rollout / training mismatch correction (`actor.rollout_correction`, verl's `rollout_is` /
`rollout_rs` names; docs/rollout-correction.md).

Being on-policy does not make the rollout engine's log-probs equal the trainer's: vLLM (or
vllm-ascend, in bf16, with other kernels) and Megatron disagree numerically, and the gap is a
known cause of collapse. With r_t = pi_old(y_t) / pi_rollout(y_t) per response token (pi_old: the
trainer's policy at the step's start, i.e. the proximal policy; pi_rollout: the engine's
log-probs the sample carries):

- importance sampling, truncated (TIS): `rollout_is: token` weights each token's policy-gradient
  term by min(r_t, C); `sequence` weights every token of a response by min(prod_t r_t, C);
  C = `rollout_is_threshold`. The weights are detached.
- rejection (masking; MIS / IcePop style): `rollout_rs: token` drops tokens whose r_t leaves
  [lower, upper]; `sequence` drops whole responses whose prod_t r_t leaves it; `geometric` uses
  the geometric mean exp(mean_t log r_t) (length-independent). upper = `rollout_rs_threshold`
  (default `rollout_is_threshold`), lower = `rollout_rs_threshold_lower` (default 1 / upper); both
  defaults as verl. `sequence` is the product of the token ratios, as verl's `sequence`; the
  geometric mean is verl's separate `geometric` level. There is no default level: off, as verl.

Dropped tokens keep their place in the batch's loss normaliser (like decoupled PPO's capped
tokens): the normaliser is fixed before the batch's first micro-step, so micro-batch sums stay
exact while groups stream in.

The gap is measured every step whatever the switches (`rollout_corr/*`, reduced over
micro-batches and DP ranks as sums, turned into means by `finalize_metrics`).

Shapes: every per-token tensor is shaped like the micro-batch's labels, [B, S] (plain) or [N, L]
(shared prompt); in both layouts one row holds one response, so a row is a sequence. `mask` is 1
on response tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from .variance_control import SEQ_LOG_RATIO_BOUND

IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")

# per micro-batch sums, summed over micro-batches and ranks, then divided in finalize_metrics
SUM_KEYS = ("rollout_corr/abs_log_ratio_sum", "rollout_corr/k1_sum", "rollout_corr/k3_sum",
            "rollout_corr/ratio_sum", "rollout_corr/is_weight_sum", "rollout_corr/is_truncated",
            "rollout_corr/rs_masked", "rollout_corr/token_count",
            "rollout_corr/rs_masked_seqs", "rollout_corr/seq_count")
MAX_KEYS = ("rollout_corr/rollout_is_max",)


@dataclass
class Correction:
    """What one micro-batch's policy-gradient terms are multiplied by, and its gap metrics."""
    is_weight: Optional[torch.Tensor] = None    # [B, S] detached truncated IS weight; None: off
    rs_mask: Optional[torch.Tensor] = None      # [B, S] 1 keep / 0 drop; None: off
    metrics: dict = field(default_factory=dict)


def rs_bounds(cfg) -> tuple[float, float]:
    """(lower, upper) of the rejection band: upper defaults to rollout_is_threshold and lower to
    1 / upper (verl's defaults)."""
    upper = cfg.rollout_rs_threshold if cfg.rollout_rs_threshold is not None else cfg.rollout_is_threshold
    lower = cfg.rollout_rs_threshold_lower if cfg.rollout_rs_threshold_lower is not None else 1.0 / upper
    return lower, upper


def compute_correction(old_logp: torch.Tensor, rollout_logp: Optional[torch.Tensor], mask: torch.Tensor,
                       cfg) -> Correction:
    """The correction of one micro-batch: `cfg` the RolloutCorrectionConfig (None: metrics only)."""
    if rollout_logp is None:
        return Correction()
    m = mask.to(old_logp.dtype)                                                   # [B, S]
    log_r = ((old_logp.detach() - rollout_logp).clamp(-20.0, 20.0)) * m           # [B, S], 0 off-response
    ratio = torch.exp(log_r)                                                       # [B, S], 1 off-response
    tokens = m.sum(-1)                                                             # [B]
    has_tokens = (tokens > 0).to(m.dtype)                                          # [B]
    seq_log_r = log_r.sum(-1)                                                      # [B]
    out = Correction(metrics={
        "rollout_corr/abs_log_ratio_sum": log_r.abs().sum(),
        "rollout_corr/k1_sum": (-log_r * m).sum(),                  # KL(rollout || old), k1
        "rollout_corr/k3_sum": ((ratio - 1.0 - log_r) * m).sum(),   # KL(rollout || old), k3
        "rollout_corr/ratio_sum": (ratio * m).sum(),
        "rollout_corr/rollout_is_max": (ratio * m).amax() if m.numel() else ratio.new_zeros(()),   # no host sync
        "rollout_corr/token_count": m.sum(),
        "rollout_corr/seq_count": has_tokens.sum(),
    })
    weight = ratio * m + (1.0 - m)
    truncated = torch.zeros_like(m)
    if cfg is not None and cfg.rollout_is is not None:
        cap = float(cfg.rollout_is_threshold)
        if cfg.rollout_is == "sequence":
            seq_w = torch.exp(seq_log_r.clamp(-SEQ_LOG_RATIO_BOUND, SEQ_LOG_RATIO_BOUND))          # [B]
            weight = seq_w[:, None].expand_as(m) * m + (1.0 - m)
        truncated = (weight > cap).to(m.dtype) * m
        weight = weight.clamp(max=cap)
        out.is_weight = weight.detach()
    out.metrics["rollout_corr/is_weight_sum"] = (weight * m).sum()
    out.metrics["rollout_corr/is_truncated"] = truncated.sum()
    keep = torch.ones_like(m)
    if cfg is not None and cfg.rollout_rs is not None:
        lower, upper = rs_bounds(cfg)
        if cfg.rollout_rs == "token":
            stat = ratio                                                           # [B, S]
            keep = ((stat >= lower) & (stat <= upper)).to(m.dtype)
        else:
            seq_stat = seq_log_r if cfg.rollout_rs == "sequence" else seq_log_r / tokens.clamp(min=1.0)   # [B]
            inside = (seq_stat >= math.log(lower)) & (seq_stat <= math.log(upper))
            keep = inside.to(m.dtype)[:, None].expand_as(m).contiguous()
        out.rs_mask = keep * m + (1.0 - m)
    dropped = (1.0 - keep) * m
    out.metrics["rollout_corr/rs_masked"] = dropped.sum()
    out.metrics["rollout_corr/rs_masked_seqs"] = ((dropped.sum(-1) > 0).to(m.dtype) * has_tokens).sum()
    out.metrics = {k: v.detach() for k, v in out.metrics.items()}
    return out


def finalize_metrics(reduced: dict[str, float]) -> dict[str, float]:
    """Batch sums -> the reported means and shares (keys absent when no token reported)."""
    out = {k: v for k, v in reduced.items() if k not in SUM_KEYS}
    tokens = reduced.get("rollout_corr/token_count", 0.0)
    if tokens > 0:
        out["rollout_corr/log_ratio_abs_mean"] = reduced["rollout_corr/abs_log_ratio_sum"] / tokens
        out["rollout_corr/kl"] = reduced["rollout_corr/k1_sum"] / tokens
        out["rollout_corr/k3_kl"] = reduced["rollout_corr/k3_sum"] / tokens
        out["rollout_corr/ratio_mean"] = reduced["rollout_corr/ratio_sum"] / tokens
        out["rollout_corr/rollout_is_mean"] = reduced["rollout_corr/is_weight_sum"] / tokens
        out["rollout_corr/rollout_is_truncated_fraction"] = reduced["rollout_corr/is_truncated"] / tokens
        out["rollout_corr/rollout_rs_masked_fraction"] = reduced["rollout_corr/rs_masked"] / tokens
    seqs = reduced.get("rollout_corr/seq_count", 0.0)
    if seqs > 0:
        out["rollout_corr/rollout_rs_masked_seq_fraction"] = reduced["rollout_corr/rs_masked_seqs"] / seqs
    return out
