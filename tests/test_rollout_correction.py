"""Rollout / training mismatch correction (actor.rollout_correction, algo/rollout_correction.py):
truncated IS and rejection against hand-computed weights, masks, losses and gradients; exactly
the uncorrected loss when the engine agrees with the trainer; composition with decoupled PPO (the
ratio truncated, not applied twice); metrics reduced over micro-batches through the actor equal
to the whole batch's; and a run whose engine log-probs are perturbed on purpose reports the gap
it was given."""
import math

import pytest
import torch

from periodic_async import algo
from periodic_async.algo import rollout_correction as rc
from periodic_async.config import ActorConfig, ConfigError, load_config
from periodic_async.config.sections import RolloutCorrectionConfig

# 2 responses x 3 positions ([B, S]); row 0 has 2 response tokens, row 1 has 3.
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
RATIOS = torch.tensor([[3.0, 0.5, 7.0], [1.5, 1.0, 0.25]])      # pi_old / pi_rollout (7.0: off-response)
ADV = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
NORM = 5.0                                                         # token-mean: 5 response tokens


def _inputs():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.2, -3.0]])
    rollout = old - torch.log(RATIOS)
    logp = old.clone().requires_grad_(True)     # epoch 1: the policy is the old policy (ratio 1, unclipped)
    return dict(logp=logp, entropy=torch.zeros(2, 3), old_logp=old, ref_logp=None, rollout_logp=rollout,
                advantages=ADV, mask=MASK, normaliser=NORM)


def _loss(name="grpo", inputs=None, **corr):
    cfg = ActorConfig(rollout_correction=RolloutCorrectionConfig(**corr))
    x = inputs or _inputs()
    loss, metrics = algo.build_policy_loss(name, cfg)(algo.LossInputs(**x))
    loss.backward()
    return loss, x["logp"].grad, metrics


def _want(weight):
    """token-mean GRPO at ratio 1 with per-token factors `weight`: loss sum(-A w m) / N, dL/dlogp = -A w m / N."""
    grad = -ADV * weight * MASK / NORM
    return grad.sum(), grad


@pytest.mark.parametrize("corr, weight", [
    ({}, torch.ones(2, 3)),
    ({"rollout_is": "token", "rollout_is_threshold": 2.0}, torch.tensor([[2.0, 0.5, 1.0], [1.5, 1.0, 0.25]])),
    # sequence ratios: 3 * 0.5 = 1.5 and 1.5 * 1 * 0.25 = 0.375 (the off-response 7.0 does not count)
    ({"rollout_is": "sequence", "rollout_is_threshold": 2.0}, torch.tensor([[1.5, 1.5, 1.0], [0.375] * 3])),
    ({"rollout_is": "sequence", "rollout_is_threshold": 1.2}, torch.tensor([[1.2, 1.2, 1.0], [0.375] * 3])),
    # tokens outside [0.4, 2.5]: 3.0 and 0.25
    ({"rollout_rs": "token", "rollout_rs_threshold": 2.5, "rollout_rs_threshold_lower": 0.4},
     torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]])),
    # lower defaults to 1 / 2 = 0.5: row 1's 0.375 is out, row 0's 1.5 in
    ({"rollout_rs": "sequence", "rollout_rs_threshold": 2.0}, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])),
    # geometric means sqrt(1.5) = 1.22 and 0.375 ** (1/3) = 0.72: both inside [0.5, 2], row 1 out of [0.8, 2]
    ({"rollout_rs": "geometric", "rollout_rs_threshold": 2.0}, torch.ones(2, 3)),
    ({"rollout_rs": "geometric", "rollout_rs_threshold": 2.0, "rollout_rs_threshold_lower": 0.8},
     torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])),
    # rollout_rs_threshold null: upper = rollout_is_threshold 2.5, lower 1 / 2.5 = 0.4 (verl's defaults)
    ({"rollout_rs": "token", "rollout_is_threshold": 2.5}, torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]])),
    # both: truncated weights times the mask
    ({"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "token", "rollout_rs_threshold": 2.5,
      "rollout_rs_threshold_lower": 0.4}, torch.tensor([[0.0, 0.5, 1.0], [1.5, 1.0, 0.0]])),
])
def test_weights_masks_loss_and_gradient_equal_hand_computed(corr, weight):
    loss, grad, _ = _loss(**corr)
    want_loss, want_grad = _want(weight)
    torch.testing.assert_close(loss, want_loss)
    torch.testing.assert_close(grad, want_grad)


def test_weights_and_masks_from_compute_correction():
    x = _inputs()
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token",
                                  rollout_rs_threshold=2.5, rollout_rs_threshold_lower=0.4)
    c = rc.compute_correction(x["old_logp"], x["rollout_logp"], MASK, cfg)
    torch.testing.assert_close(c.is_weight, torch.tensor([[2.0, 0.5, 1.0], [1.5, 1.0, 0.25]]))
    torch.testing.assert_close(c.rs_mask, torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]]))
    m = rc.finalize_metrics({k: float(v) for k, v in c.metrics.items()})
    logs = torch.log(torch.tensor([3.0, 0.5, 1.5, 1.0, 0.25]))
    assert m["rollout_corr/log_ratio_abs_mean"] == pytest.approx(float(logs.abs().mean()))
    assert m["rollout_corr/kl"] == pytest.approx(float(-logs.mean()))
    assert m["rollout_corr/k3_kl"] == pytest.approx(float((logs.exp() - 1 - logs).mean()))
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(3.0)        # the off-response 7.0 is not seen
    assert m["rollout_corr/rollout_is_truncated_fraction"] == pytest.approx(1 / 5)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx((2.0 + 0.5 + 1.5 + 1.0 + 0.25) / 5)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 5)
    assert m["rollout_corr/rollout_rs_masked_seq_fraction"] == pytest.approx(1.0)   # each row lost a token


@pytest.mark.parametrize("name", ["grpo", "decoupled_ppo"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_equal_logprobs_give_exactly_the_uncorrected_loss(name, mode):
    """Engine == trainer: weights exp(0) = 1 and every ratio inside the band, so loss and gradient
    equal the switches-off ones bit for bit (with PPO ratios away from 1, so clipping is exercised)."""
    def inputs():
        x = _inputs()
        x["rollout_logp"] = x["old_logp"].clone()
        x["logp"] = (x["old_logp"] + torch.tensor([[0.3, -0.4, 0.0], [0.05, 0.5, -0.1]])).requires_grad_(True)
        return x
    on = dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="geometric", rollout_rs_threshold=2.0)
    for kw in (on, dict(on, rollout_is="sequence") if name == "grpo" else on):
        cfg_on = ActorConfig(loss_agg_mode=mode, rollout_correction=RolloutCorrectionConfig(**kw))
        cfg_off = ActorConfig(loss_agg_mode=mode)
        a, b = inputs(), inputs()
        loss_on, _ = algo.build_policy_loss(name, cfg_on)(algo.LossInputs(**a))
        loss_off, _ = algo.build_policy_loss(name, cfg_off)(algo.LossInputs(**b))
        loss_on.backward()
        loss_off.backward()
        assert torch.equal(loss_on, loss_off)
        assert torch.equal(a["logp"].grad, b["logp"].grad)


def test_decoupled_ppo_truncates_its_own_weight_instead_of_squaring_it():
    """decoupled_ppo weights by pi_prox / pi_behav, the same ratio: rollout_is token truncates it
    (min(r, C)), it is not multiplied by a second min(r, C)."""
    _, grad_plain, _ = _loss("decoupled_ppo")
    torch.testing.assert_close(grad_plain, _want(RATIOS)[1])
    loss, grad, m = _loss("decoupled_ppo", rollout_is="token", rollout_is_threshold=2.0)
    torch.testing.assert_close(grad, _want(torch.tensor([[2.0, 0.5, 1.0], [1.5, 1.0, 0.25]]))[1])
    # the rejection mask still multiplies on top
    _, grad_rs, _ = _loss("decoupled_ppo", rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token",
                          rollout_rs_threshold=2.5, rollout_rs_threshold_lower=0.4)
    torch.testing.assert_close(grad_rs, _want(torch.tensor([[0.0, 0.5, 1.0], [1.5, 1.0, 0.0]]))[1])


def test_metrics_summed_over_micro_batches_equal_the_whole_batch():
    """The per-micro-batch sums (and max) of rows {0} and {1}, finalized, equal the whole batch's."""
    cfg = ActorConfig(rollout_correction=RolloutCorrectionConfig(rollout_is="token", rollout_rs="sequence",
                                                                 rollout_rs_threshold=2.0))
    loss = algo.build_policy_loss("grpo", cfg)
    whole = _inputs()
    _, m_whole = loss(algo.LossInputs(**whole))
    parts = []
    for rows in (slice(0, 1), slice(1, 2)):
        x = {k: (v[rows] if torch.is_tensor(v) else v) for k, v in _inputs().items()}
        parts.append(loss(algo.LossInputs(**x))[1])
    reduced = {}
    for k in loss.metric_keys:
        if k in parts[0]:
            reduced[k] = sum(float(p[k]) for p in parts)
    for k in loss.max_metric_keys:
        reduced[k] = max(float(p[k]) for p in parts)
    got = loss.finalize_metrics({k: v for k, v in reduced.items() if not k.startswith("actor/")})
    want = loss.finalize_metrics({k: float(v) for k, v in m_whole.items() if not k.startswith("actor/")})
    assert set(got) == set(want) and any(k.startswith("rollout_corr/") for k in got)
    for k in want:
        assert got[k] == pytest.approx(want[k]), k


@pytest.mark.parametrize("overrides, message", [
    (["actor.rollout_correction.rollout_is=tokens"], "actor.rollout_correction.rollout_is: 'tokens' is not allowed"),
    (["actor.rollout_correction.rollout_is=token", "actor.rollout_correction.rollout_is_threshold=0.5"],
     "actor.rollout_correction.rollout_is_threshold: must be > 1"),
    (["actor.rollout_correction.rollout_rs=token", "actor.rollout_correction.rollout_rs_threshold=0.9"],
     "actor.rollout_correction.rollout_rs_threshold: must be > 1"),
    (["actor.rollout_correction.rollout_rs=token", "actor.rollout_correction.rollout_is_threshold=1.0"],
     "actor.rollout_correction.rollout_is_threshold: must be > 1 \\(rollout_rs_threshold null"),
    (["actor.rollout_correction.rollout_rs=sequence", "actor.rollout_correction.rollout_rs_threshold=2",
      "actor.rollout_correction.rollout_rs_threshold_lower=1.5"],
     "actor.rollout_correction.rollout_rs_threshold_lower: must be in"),
    (["actor.policy_loss=decoupled_ppo", "actor.rollout_correction.rollout_is=sequence"],
     "'sequence' with actor.policy_loss 'decoupled_ppo'"),
])
def test_bad_settings_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/default.yaml", overrides).validate(world_size=1)


@pytest.mark.parametrize("shift", [0.5, -1.0])
def test_a_run_with_perturbed_engine_logprobs_reports_and_masks_the_gap(tmp_path, shift):
    """Sync mode, the engine's log-prob of every response's first token shifted by `shift` on
    purpose: pi_old / pi_rollout there is exp(-shift) (0.61 or 2.72), outside [1 / 1.5, 1.5], so
    rollout_rs token masks exactly one token per response (the others agree to fp32 rounding): the
    masked share is responses / tokens = 1 / mean length, and k1 = shift / mean length. With
    -1.0 the ratio 2.72 also exceeds rollout_is_threshold 2: the truncated share is 1 / mean length
    too and the max ratio is e."""
    from periodic_async.train.trainer import Trainer
    cfg = load_config("configs/default.yaml", [
        f"trainer.run_dir={tmp_path}", "trainer.mode=sync", "trainer.total_steps=3", "trainer.progress_bar=false",
        "trainer.save_final=false", "actor.rollout_correction.rollout_is=token",
        "actor.rollout_correction.rollout_rs=token", "actor.rollout_correction.rollout_rs_threshold=1.5"])
    trainer = Trainer(cfg)
    pool = trainer.producer.pool
    poll = pool.poll

    def perturbed_poll(*a, **kw):
        results = poll(*a, **kw)
        for r in results:
            if r.logprobs:
                r.logprobs = [r.logprobs[0] + shift] + list(r.logprobs[1:])
        return results
    pool.poll = perturbed_poll
    history = trainer.fit()
    assert len(history) == 3
    for h in history:
        inv_len = 1.0 / h["response_length/mean"]
        assert h["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(inv_len, rel=1e-6)
        assert h["rollout_corr/kl"] == pytest.approx(shift * inv_len, rel=1e-3)
        if shift > 0:
            assert h["rollout_corr/rollout_is_truncated_fraction"] == 0.0
            assert h["rollout_corr/rollout_is_max"] < 1.01
        else:
            assert h["rollout_corr/rollout_is_truncated_fraction"] == pytest.approx(inv_len, rel=1e-6)
            assert h["rollout_corr/rollout_is_max"] == pytest.approx(math.exp(-shift), rel=1e-3)
        assert math.isfinite(h["actor/pg_loss"])


@pytest.mark.parametrize("name", ["grpo", "decoupled_ppo"])
def test_actor_reduction_over_micro_batches_equals_the_whole_batch(name):
    """The actor's own reduction (TriModelActor._reduce_metrics: sums of metric_keys, max of
    max_metric_keys, then finalize_metrics; single process, no DP group) over micro-batches {row 0}
    and {row 1} gives the whole batch's rollout_corr/* values; checked against hand-computed ones."""
    from types import SimpleNamespace

    from periodic_async.actor.tri_model import TriModelActor
    cfg = ActorConfig(policy_loss=name, rollout_correction=RolloutCorrectionConfig(
        rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token", rollout_rs_threshold=2.5,
        rollout_rs_threshold_lower=0.4))
    loss = algo.build_policy_loss(name, cfg)
    store = [loss(algo.LossInputs(**{k: (v[rows] if torch.is_tensor(v) else v) for k, v in _inputs().items()}))[1]
             for rows in (slice(0, 1), slice(1, 2))]
    actor = SimpleNamespace(objective=loss, cfg=cfg, device=torch.device("cpu"))
    got = TriModelActor._reduce_metrics(actor, store)
    logs = torch.log(torch.tensor([3.0, 0.5, 1.5, 1.0, 0.25]))    # the 5 response tokens' log r
    assert got["rollout_corr/kl"] == pytest.approx(float(-logs.mean()))
    assert got["rollout_corr/k3_kl"] == pytest.approx(float((logs.exp() - 1 - logs).mean()))
    assert got["rollout_corr/log_ratio_abs_mean"] == pytest.approx(float(logs.abs().mean()))
    assert got["rollout_corr/rollout_is_max"] == pytest.approx(3.0)                  # max of 3.0 and 1.5
    assert got["rollout_corr/rollout_is_truncated_fraction"] == pytest.approx(1 / 5)
    assert got["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 5)
    assert got["rollout_corr/rollout_rs_masked_seq_fraction"] == pytest.approx(1.0)
    assert not any(k in got for k in rc.SUM_KEYS)                                     # sums turned into means


def test_an_async_decoupled_ppo_run_reports_the_same_ratio_in_both_metric_families(tmp_path):
    """Async (eta = 2, stale samples) decoupled_ppo with rollout_is token and rollout_rs token on:
    it trains, and rollout_corr/* measures the very ratio decoupled PPO weights by (pi_prox /
    pi_behav = pi_old / pi_rollout), so its mean and max equal ppo/behave_imp_weight/{mean,max}
    every step, and a stale step shows a gap (k3 > 0)."""
    from test_periodic import _run
    _, history, _ = _run(tmp_path, "async", "trainer.max_staleness=2", "trainer.total_steps=4",
                         "rollout.num_workers=2", "rollout.arrival_jitter_s=0.01", "actor.policy_loss=decoupled_ppo",
                         "actor.behav_imp_weight_cap=5.0", "actor.rollout_correction.rollout_is=token",
                         "actor.rollout_correction.rollout_rs=token", "actor.rollout_correction.rollout_rs_threshold=3.0")
    assert len(history) == 4
    for h in history:
        assert h["rollout_corr/ratio_mean"] == pytest.approx(h["ppo/behave_imp_weight/mean"], rel=1e-5)
        assert h["rollout_corr/rollout_is_max"] == pytest.approx(h["ppo/behave_imp_weight/max"], rel=1e-5)
        assert 0.0 <= h["rollout_corr/rollout_rs_masked_fraction"] <= 1.0
        assert h["rollout_corr/k3_kl"] >= 0.0 and math.isfinite(h["actor/pg_loss"])
    stale = [h for h in history if h["training/off_policy/trajectory_staleness/max"] > 0]
    assert stale and any(h["rollout_corr/k3_kl"] > 0 for h in stale)
