"""CISPO: Clipped IS-weight Policy Optimization (MiniMax-M1, arXiv 2506.13585), registered as
`actor.policy_loss: cispo`.

Instead of clipping the token's update (PPO, which drops the gradient of clipped tokens), CISPO
clips the importance weight and keeps every token's gradient: per token
-sg[clip(r_t, 1 - low, 1 + high)] * A * log pi(y_t), r_t = pi / pi_old. No gradient flows through
the weight (it is detached), so the gradient is -clip(r_t) * A * grad log pi(y_t). The paper
bounds only the top (a large `actor.clip_ratio_low`, e.g. 1.0, leaves the bottom open: the
weight is then clipped at 0 from below) and tunes the top; here both come from
`actor.clip_ratio_low / _high` (default `actor.clip_ratio`). `actor/pg_clipfrac` is the share of
tokens whose weight was clipped. GRPO's KL and entropy terms apply unchanged.

Shapes: logp / old_logp / advantages / mask [B, S] or [N, L] (one response per row).
"""
from __future__ import annotations

import torch

from .losses import GRPOLoss, LossInputs, clip_bounds, register_policy_loss


@register_policy_loss("cispo")
class CISPOLoss(GRPOLoss):
    def policy_gradient_tokens(self, x: LossInputs, correction):
        low, high = clip_bounds(self.cfg)
        ratio = torch.exp((x.logp - x.old_logp).detach().clamp(-20.0, 20.0))               # [B, S]
        weight = ratio.clamp(1.0 - low, 1.0 + high)                                       # detached
        return -x.advantages * weight * x.logp, weight != ratio, {}
