"""RL algorithms, chosen by name from the config (verl's registries):

- advantage estimators (`algo.adv_estimator`): advantages.py - "grpo", "rloo",
  "vcpo_baseline" (VCPO's importance-weighted baseline);
- policy losses (`actor.policy_loss`): losses.py - "grpo" (PPO-clip + KL to the reference + entropy),
  "decoupled_ppo" (AReaL: PPO-clip on the proximal policy, weighted by pi_prox / pi_behav); gspo.py -
  "gspo" (sequence-level ratio and clip); cispo.py - "cispo" (clipped, detached IS weight x log-prob);
  Dr. GRPO is a recipe (algo.norm_adv_by_std_in_grpo: false + actor.loss_agg_mode:
  seq-mean-token-sum-norm; docs/algorithms.md);
- variance control for off-policy batches (ESS, learning-rate scale, baseline): variance_control.py;
- rollout / training mismatch correction (truncated IS, rejection; `actor.rollout_correction`),
  applied inside every policy loss: rollout_correction.py.

The actor (periodic_async/actor) calls the loss it was built with inside its micro-step and knows
nothing of GRPO; the scorer (scheduling/scorer.py) calls the configured estimator on each complete
scored group. An estimator with `uses_importance_ratios` (vcpo_baseline) needs the ratios
pi_prox / pi_behav, known only in the loss: the scorer's values (ratios 1) are replaced there, per
micro-batch, by losses.importance_baseline_advantages.
Register a new one with `@register_adv_estimator("name")` / `@register_policy_loss("name")`.
"""
from . import variance_control
from .advantages import ADV_ESTIMATORS, compute_advantages, register_adv_estimator

_LOSSES = ("POLICY_LOSSES", "LossInputs", "PolicyLoss", "aggregate", "batch_normaliser", "build_policy_loss",
           "clip_bounds", "dual_clip",
           "clipped_pg_loss", "kl_penalty", "register_policy_loss", "behaviour_weights", "cap_behaviour_weights",
           "sequence_importance_ratios")


_MORE_LOSSES = ("gspo", "cispo")


def __getattr__(name):
    # losses.py needs torch; the estimators do not, so the scheduling side (and a simulator) can
    # import this package without it
    if name in _LOSSES or name == "losses":
        import importlib
        losses = importlib.import_module(f"{__name__}.losses")
        for module in _MORE_LOSSES:      # the losses built on losses.GRPOLoss register on import
            importlib.import_module(f"{__name__}.{module}")
        return losses if name == "losses" else getattr(losses, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ADV_ESTIMATORS", "compute_advantages", "register_adv_estimator", "POLICY_LOSSES", "LossInputs",
           "PolicyLoss", "aggregate", "batch_normaliser", "build_policy_loss", "clipped_pg_loss", "kl_penalty",
           "register_policy_loss", "behaviour_weights", "cap_behaviour_weights", "sequence_importance_ratios",
           "variance_control"]
