"""Policy losses, chosen by `actor.policy_loss`, and the pieces they are made of (PPO-clip, KL
estimators, token aggregation).

Conventions: per-token tensors are shaped like the micro-batch's labels - [B, S] (one row per
sequence, position t holds the quantity for predicting token t+1) or [N, L] (one row per response,
shared-prompt packing); `mask` is 1 where the label is a response token. Aggregation divides by a
normaliser fixed for the WHOLE batch (its response-token or sequence count), so summing micro-batch
losses gives the batch loss whatever the order or split of the micro-batches (exact gradient
accumulation).

A loss is a class registered by name: built once with the ActorConfig, called by the actor on the
last pipeline stage of every micro-step with a `LossInputs`, returning (loss, metrics). Its
`metric_keys` are fixed so that every rank reduces the same keys whatever its stage; a key that no
micro-batch reported (e.g. the KL without a reference model) is left out of the step's metrics.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .registry import Registry

POLICY_LOSSES = Registry("actor.policy_loss")     # name -> PolicyLoss subclass
register_policy_loss = POLICY_LOSSES.register


def build_policy_loss(name: str, cfg) -> "PolicyLoss":
    return POLICY_LOSSES.lookup(name)(cfg)


@dataclass
class LossInputs:
    """One micro-batch on the last pipeline stage; every tensor shaped like its labels."""
    logp: torch.Tensor                    # policy log-probs (with gradient)
    entropy: torch.Tensor                 # policy entropy per position (with gradient when the loss has entropy_grad)
    old_logp: torch.Tensor                # old / proximal policy (the policy at the step's start), detached
    ref_logp: Optional[torch.Tensor]      # reference model, or None when none is built
    rollout_logp: Optional[torch.Tensor]  # behaviour policy: the rollout engine's log-probs (0 where none)
    advantages: torch.Tensor              # the sequence's advantage at each of its positions
    mask: torch.Tensor                    # float, 1 on response tokens
    normaliser: float                     # the batch-wide normaliser `aggregate` divides by


class PolicyLoss:
    """Base of the registered losses: `__call__(inputs) -> (loss, {metric: detached scalar})`.
    `entropy_grad`: whether the loss differentiates `LossInputs.entropy` (else the actor computes
    it without autograd, as a metric only)."""
    metric_keys: tuple[str, ...] = ()
    entropy_grad: bool = True

    def __init__(self, cfg):
        self.cfg = cfg

    def __call__(self, x: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        raise NotImplementedError


@register_policy_loss("grpo")
class GRPOLoss(PolicyLoss):
    """PPO-clip on the old policy's ratio, + kl_coef * KL(policy || reference), - entropy_coef * entropy."""
    metric_keys = ("actor/pg_loss", "actor/pg_clipfrac", "actor/kl_loss", "actor/entropy", "actor/loss")

    def __init__(self, cfg):
        super().__init__(cfg)
        self.entropy_grad = bool(cfg.entropy_coef)      # entropy_coef 0: the entropy is a metric

    def __call__(self, x: LossInputs):
        cfg = self.cfg
        agg = lambda t: aggregate(t, x.mask, cfg.loss_agg_mode, x.normaliser)  # noqa: E731
        pg_tok, clipped = clipped_pg_loss(x.logp, x.old_logp, x.advantages, cfg.clip_ratio)
        pg_loss = agg(pg_tok)
        loss = pg_loss
        m = {"actor/pg_loss": pg_loss.detach(), "actor/pg_clipfrac": agg(clipped.float()).detach()}
        if x.ref_logp is not None:
            kl = agg(kl_penalty(x.logp, x.ref_logp, cfg.kl_type))
            m["actor/kl_loss"] = kl.detach()
            if cfg.kl_coef:
                loss = loss + cfg.kl_coef * kl
        ent = agg(x.entropy if cfg.entropy_coef else x.entropy.detach())
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * ent
        m["actor/entropy"] = ent.detach()
        m["actor/loss"] = loss.detach()
        return loss, m


# ---------------------------------------------------------------------- pieces


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
    """PPO-clip per-token loss max(-A r, -A clip(r, 1-e, 1+e)) with r = exp(logp - old_logp), the
    log-ratio clamped to [-20, 20] first (as verl) so that one far-off token cannot overflow exp.
    Returns (loss, clipped: bool where the clipped branch was taken), both shaped like logp."""
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))
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
