"""GSPO: Group Sequence Policy Optimization (Zheng et al., arXiv 2507.18071; verl's
`loss_mode: gspo`), registered as `actor.policy_loss: gspo`.

The importance ratio is the sequence's, length-normalised: s_i = exp(mean over response i's
tokens of (log pi - log pi_old)), and it is clipped per sequence, not per token. In the token-level
form (the paper's GSPO-token, verl's implementation) every token t of response i carries
s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)] - equal to s_i in value, with the gradient of its own
log-prob - so the per-token loss is max(-A s_i,t, -A clip(s_i,t, 1 - low, 1 + high)), averaged per
sequence (`actor.loss_agg_mode: seq-mean-token-mean`, the paper's sequence mean; other modes are
refused at validation). The paper's clip range is small because the ratio is a geometric mean:
`actor.clip_ratio_low: 3.0e-4`, `actor.clip_ratio_high: 4.0e-4` (docs/algorithms.md has the overrides).

Shapes: logp / old_logp / advantages / mask [B, S] or [N, L] (one response per row).
"""
from __future__ import annotations

import torch

from .losses import GRPOLoss, LossInputs, clip_bounds, register_policy_loss

LOG_RATIO_MAX = 10.0      # the sequence log-ratio is clamped above (verl's bound) before exp


def sequence_ratio_tokens(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """s_i,t = exp(sg[mean_t (logp - old_logp)] + logp - sg[logp]) per token; [B, S] like logp."""
    m = mask.to(logp.dtype)
    length = m.sum(-1).clamp(min=1.0)                                                    # [B]
    seq_log_ratio = ((logp - old_logp) * m).sum(-1) / length                              # [B]
    log_ratio = logp - logp.detach() + seq_log_ratio.detach()[:, None]                   # [B, S]
    return torch.exp(log_ratio.clamp(max=LOG_RATIO_MAX))


@register_policy_loss("gspo")
class GSPOLoss(GRPOLoss):
    """GSPO's sequence-level clipped objective + GRPO's KL and entropy terms."""

    def policy_gradient_tokens(self, x: LossInputs, correction):
        low, high = clip_bounds(self.cfg)
        ratio = sequence_ratio_tokens(x.logp, x.old_logp, x.mask)                          # [B, S]
        unclipped = -x.advantages * ratio
        clipped = -x.advantages * ratio.clamp(1.0 - low, 1.0 + high)
        return torch.maximum(unclipped, clipped), clipped > unclipped, {}
