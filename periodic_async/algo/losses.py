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
Optional: `max_metric_keys` (reduced by max instead of summed) and `finalize_metrics(reduced) ->
metrics` (applied once after the reduction, e.g. sums -> ratios).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch

from . import rollout_correction
from .registry import Registry
from .variance_control import SEQ_LOG_RATIO_BOUND, ess_ratio

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
    # [rows] each response's reward and group, when the advantages are to be re-centred here on
    # the importance-weighted baseline (algo.adv_estimator vcpo_baseline; whole groups per
    # micro-batch); None: `advantages` as given
    rewards: Optional[torch.Tensor] = None
    group_ids: Optional[torch.Tensor] = None


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
    """PPO-clip on the old policy's ratio, + kl_coef * KL(policy || reference), - entropy_coef * entropy.

    Every loss built on this one (a subclass overriding `policy_gradient_tokens`) gets the
    rollout / training mismatch correction (actor.rollout_correction, rollout_correction.py): its
    per-token policy-gradient terms are multiplied by the truncated IS weight and the rejection
    mask, and the gap's metrics (rollout_corr/*) are reported whatever the switches. A loss that
    already weights by pi_old / pi_rollout (`weights_by_behaviour_ratio`, decoupled_ppo) applies
    the truncation to that weight itself instead of getting a second copy of the ratio."""
    metric_keys = ("actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/kl_loss", "actor/entropy",
                   "actor/loss") + \
        rollout_correction.SUM_KEYS
    max_metric_keys = rollout_correction.MAX_KEYS      # reduced by max, not summed
    weights_by_behaviour_ratio = False

    def __init__(self, cfg):
        super().__init__(cfg)
        self.entropy_grad = bool(cfg.entropy_coef)      # entropy_coef 0: the entropy is a metric
        self.correction_cfg = getattr(cfg, "rollout_correction", None)

    def policy_gradient_tokens(self, x: LossInputs, correction: rollout_correction.Correction
                               ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Per-token policy-gradient loss, where the clipped branch was taken, and extra metrics."""
        cfg = self.cfg
        low, high = clip_bounds(cfg)
        pg_tok, clipped = clipped_pg_loss(x.logp, x.old_logp, x.advantages, low, high)
        extra = {}
        if getattr(cfg, "clip_ratio_c", None) is not None:
            pg_tok, lower = dual_clip(pg_tok, x.advantages, cfg.clip_ratio_c)
            extra["actor/pg_clipfrac_lower"] = aggregate(lower.float(), x.mask, cfg.loss_agg_mode, x.normaliser).detach()
        return pg_tok, clipped, extra

    def __call__(self, x: LossInputs):
        cfg = self.cfg
        if x.group_ids is not None:
            x = replace(x, advantages=importance_baseline_advantages(x))
        agg = lambda t: aggregate(t, x.mask, cfg.loss_agg_mode, x.normaliser)  # noqa: E731
        correction = rollout_correction.compute_correction(x.old_logp, x.rollout_logp, x.mask, self.correction_cfg)
        pg_tok, clipped, extra = self.policy_gradient_tokens(x, correction)
        if correction.is_weight is not None and not self.weights_by_behaviour_ratio:
            pg_tok = pg_tok * correction.is_weight
        if correction.rs_mask is not None:
            pg_tok = pg_tok * correction.rs_mask
        extra.update(correction.metrics)
        pg_loss = agg(pg_tok)
        loss = pg_loss
        m = {"actor/pg_loss": pg_loss.detach(), "actor/pg_clipfrac": agg(clipped.float()).detach(), **extra}
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

    def finalize_metrics(self, reduced: dict[str, float]) -> dict[str, float]:
        """Batch sums (over micro-batches and ranks) -> the reported means and ratios."""
        return rollout_correction.finalize_metrics(reduced)


@register_policy_loss("decoupled_ppo")
class DecoupledPPOLoss(GRPOLoss):
    """AReaL's decoupled PPO objective for batches generated by an older (behaviour) policy:
    -w * min(r A, clip(r) A), r = pi_theta / pi_prox, w = pi_prox / pi_behav, plus GRPO's KL and
    entropy terms. The trust region is centred on the proximal policy (`LossInputs.old_logp`: the
    weights at the step's start) and w corrects for the data coming from the behaviour policy
    (`LossInputs.rollout_logp`: the rollout engine's log-probs). Tokens whose w exceeds
    `actor.behav_imp_weight_cap` are masked out of the policy gradient (w := 0, as AReaL: a token
    that stale carries no trustworthy signal, and clipping it to the cap would still let it
    dominate); they stay in the loss's normaliser. With behaviour == proximal, w = 1 exactly and
    the loss is GRPO's, bit for bit.

    At the first optimizer step of a batch the actor's old-policy shortcut passes the policy's
    detached log-probs as old_logp: that is the proximal policy (the weights at the step's start,
    before the first update), so the shortcut is exact here too.

    Metrics: `ppo/behave_imp_weight/{mean,max,capped_frac}` over response tokens (before the cap),
    and the sequence-level effective sample size of pi_prox / pi_behav, `vcpo/ess_ratio` = ESS / N
    (variance_control.py), which actor.vcpo_lr_scale turns into the step's learning-rate scale.
    Sums are reported per micro-batch and turned into these by `finalize_metrics` after the
    actor's reduction over micro-batches and ranks."""
    _SUMS = ("ppo/behave_imp_weight/sum", "ppo/behave_imp_weight/capped", "ppo/behave_imp_weight/count",
             "vcpo/rho_sum", "vcpo/rho_sq_sum", "vcpo/num_seqs")
    metric_keys = GRPOLoss.metric_keys + _SUMS
    max_metric_keys = GRPOLoss.max_metric_keys + ("ppo/behave_imp_weight/max",)   # reduced by max, not summed
    weights_by_behaviour_ratio = True

    def __init__(self, cfg):
        super().__init__(cfg)
        self.cap = getattr(cfg, "behav_imp_weight_cap", None)

    def policy_gradient_tokens(self, x: LossInputs, correction):
        if x.rollout_logp is None:
            raise ValueError("actor.policy_loss: 'decoupled_ppo' needs the rollout engine's per-token log-probs "
                             "(the micro-batch has no rollout_logp)")
        pg_tok, clipped, m = super().policy_gradient_tokens(x, correction)
        raw = behaviour_weights(x.old_logp, x.rollout_logp)                                   # [B, S]
        weight, capped = cap_behaviour_weights(raw, x.mask, self.cap)                          # [B, S]
        if correction.is_weight is not None:
            # rollout_is: token - the same ratio pi_prox / pi_behav, truncated (not applied twice)
            weight = weight.clamp(max=float(self.correction_cfg.rollout_is_threshold))
        mask = x.mask.to(raw.dtype)
        raw = raw * mask
        rho = sequence_importance_ratios(x.old_logp, x.rollout_logp, x.mask)                 # [rows]
        has_tokens = (x.mask.sum(-1) > 0).to(rho.dtype)
        m.update({
            "ppo/behave_imp_weight/sum": raw.sum(), "ppo/behave_imp_weight/max": raw.max(),
            "ppo/behave_imp_weight/capped": (capped.to(mask.dtype) * mask).sum(),
            "ppo/behave_imp_weight/count": mask.sum(),
            "vcpo/rho_sum": (rho * has_tokens).sum(), "vcpo/rho_sq_sum": (rho.square() * has_tokens).sum(),
            "vcpo/num_seqs": has_tokens.sum()})
        return pg_tok * weight, clipped, m

    def finalize_metrics(self, reduced: dict[str, float]) -> dict[str, float]:
        """Batch sums (over micro-batches and ranks) -> the reported means and ratios."""
        out = {k: v for k, v in super().finalize_metrics(reduced).items() if k not in self._SUMS}
        count = reduced.get("ppo/behave_imp_weight/count", 0.0)
        if count > 0:
            out["ppo/behave_imp_weight/mean"] = reduced["ppo/behave_imp_weight/sum"] / count
            out["ppo/behave_imp_weight/capped_frac"] = reduced["ppo/behave_imp_weight/capped"] / count
        if "vcpo/num_seqs" in reduced:
            out["vcpo/ess_ratio"] = ess_ratio(reduced["vcpo/rho_sum"], reduced["vcpo/rho_sq_sum"],
                                              reduced["vcpo/num_seqs"])
        return out


# ---------------------------------------------------------------------- pieces


def behaviour_weights(prox_logp: torch.Tensor, behav_logp: torch.Tensor) -> torch.Tensor:
    """Per-token importance weight w = pi_prox / pi_behav, detached, the log-ratio clamped to
    [-20, 20] (as the PPO ratio); shaped like prox_logp. Exactly 1 where the two agree."""
    return torch.exp((prox_logp - behav_logp).detach().clamp(-20.0, 20.0))


def cap_behaviour_weights(weight: torch.Tensor, mask: torch.Tensor,
                          cap: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, capped): response tokens whose weight exceeds `cap` get weight 0 (masked out,
    AReaL's rule) and capped = True there; cap None: no cap. Positions outside the response get
    weight 1 (they carry no loss; this keeps them from scaling anything there). Both shaped like weight."""
    weight = torch.where(mask > 0, weight, torch.ones_like(weight))
    if cap is None:
        return weight, torch.zeros_like(weight, dtype=torch.bool)
    capped = (weight > cap) & (mask > 0)
    return torch.where(capped, torch.zeros_like(weight), weight), capped


def sequence_importance_ratios(prox_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """rho per row (one response per row in both layouts) = exp(sum over its response tokens of
    log pi_prox - log pi_behav), the sum clamped to +-SEQ_LOG_RATIO_BOUND; detached. [B, S] -> [B]."""
    log_rho = ((prox_logp - behav_logp).detach() * mask.to(prox_logp.dtype)).sum(-1)
    return torch.exp(log_rho.clamp(-SEQ_LOG_RATIO_BOUND, SEQ_LOG_RATIO_BOUND))




def min_variance_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """VCPO's A_i = R_i - b*_g, b*_g = sum_{j in g} rho_j^2 R_j / sum_{j in g} rho_j^2 over each
    response's group g (variance_control.min_variance_baseline, on tensors); a group whose ratios
    are all 0 falls back to its mean. rewards, rho [rows] float, group_ids [rows] long -> [rows]."""
    _, g = torch.unique(group_ids, return_inverse=True)                             # [rows] in 0..G-1
    n = int(g.max()) + 1 if g.numel() else 0
    rho = rho.to(rewards.dtype).square()
    zeros = rewards.new_zeros(n)
    rho_sum = zeros.scatter_add(0, g, rho)
    weighted = zeros.scatter_add(0, g, rho * rewards) / rho_sum.clamp_min(1e-30)
    mean = zeros.scatter_add(0, g, rewards) / zeros.scatter_add(0, g, torch.ones_like(rewards))
    baseline = torch.where(rho_sum > 0, weighted, mean)                              # [G]
    return rewards - baseline[g]


def importance_baseline_advantages(x: LossInputs) -> torch.Tensor:
    """The micro-batch's advantages re-centred on the minimum-variance baseline, from the
    sequence-level ratios pi_prox / pi_behav of its responses (old_logp: the proximal policy,
    rollout_logp: the behaviour policy); shaped like x.advantages (the row's value everywhere)."""
    if x.rollout_logp is None:
        raise ValueError("algo.adv_estimator: 'vcpo_baseline' needs the rollout engine's per-token log-probs")
    rho = sequence_importance_ratios(x.old_logp, x.rollout_logp, x.mask)           # [rows]
    adv = min_variance_advantages(x.rewards, x.group_ids, rho)                       # [rows]
    return adv[:, None].to(x.advantages.dtype).expand_as(x.advantages)


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


def clip_bounds(cfg) -> tuple[float, float]:
    """(low, high) of the PPO trust region [1 - low, 1 + high]: actor.clip_ratio_low / _high (DAPO's
    clip-higher), each defaulting to actor.clip_ratio."""
    low = getattr(cfg, "clip_ratio_low", None)
    high = getattr(cfg, "clip_ratio_high", None)
    return (cfg.clip_ratio if low is None else low), (cfg.clip_ratio if high is None else high)


def clipped_pg_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                    clip_ratio: float, clip_ratio_high: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO-clip per-token loss max(-A r, -A clip(r, 1 - low, 1 + high)) with r = exp(logp - old_logp),
    the log-ratio clamped to [-20, 20] first (as verl) so that one far-off token cannot overflow exp;
    low = clip_ratio, high = clip_ratio_high (None: clip_ratio). Returns (loss, clipped: bool where
    the clipped branch was taken), both shaped like logp."""
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio, 1.0 + high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def dual_clip(pg_tok: torch.Tensor, advantages: torch.Tensor, clip_ratio_c: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dual-clip PPO (Ye et al. 2020; verl's clip_ratio_c): for negative advantages the clipped
    per-token loss is bounded by -A c, so a token whose ratio exploded (r > c) cannot dominate.
    Returns (loss, lower: bool where the bound was taken), both shaped like pg_tok."""
    bound = -advantages * clip_ratio_c
    lower = (advantages < 0) & (pg_tok > bound)
    return torch.where(advantages < 0, torch.minimum(pg_tok, bound), pg_tok), lower


AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def aggregate(token_values: torch.Tensor, mask: torch.Tensor, mode: str, normaliser: float) -> torch.Tensor:
    """Sum of masked per-token values over this micro-batch divided by the batch-wide normaliser.
    token-mean: normaliser = response tokens in the batch.
    seq-mean-token-mean: each sequence's token mean, summed; normaliser = sequences in the batch.
    seq-mean-token-sum-norm: token sum; normaliser = sequences x a constant length (Dr. GRPO)."""
    mask = mask.to(token_values.dtype)
    if mode == "token-mean":
        return (token_values * mask).sum() / normaliser
    if mode == "seq-mean-token-mean":
        per_seq = (token_values * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_seq.sum() / normaliser
    if mode == "seq-mean-token-sum-norm":
        return (token_values * mask).sum() / normaliser
    raise ValueError(f"actor.loss_agg_mode: unknown '{mode}'; allowed: {', '.join(AGG_MODES)}")


def batch_normaliser(response_lengths: Sequence[int], mode: str, scale_factor: Optional[float] = None) -> float:
    """The normaliser `aggregate` expects, from the response lengths of the WHOLE batch: its
    response-token count (token-mean), its number of non-empty responses (seq-mean-token-mean), or
    that number times the constant `scale_factor` (seq-mean-token-sum-norm, Dr. GRPO: each
    response's token SUM over a constant length, so a long response is not down-weighted per token)."""
    if mode == "token-mean":
        return float(sum(response_lengths))
    if mode == "seq-mean-token-mean":
        return float(sum(1 for n in response_lengths if n > 0))
    if mode == "seq-mean-token-sum-norm":
        if scale_factor is None:
            raise ValueError("actor.loss_agg_mode: 'seq-mean-token-sum-norm' needs actor.loss_scale_factor")
        return float(sum(1 for n in response_lengths if n > 0)) * float(scale_factor)
    raise ValueError(f"actor.loss_agg_mode: unknown '{mode}'; allowed: {', '.join(AGG_MODES)}")
