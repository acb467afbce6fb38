"""DAPO's pieces (arXiv 2503.14476; verl's names): clip-higher (actor.clip_ratio_low / _high),
dual-clip (actor.clip_ratio_c), the soft overlong punishment (reward.overlong_buffer) and
overlong filtering (actor.overlong_filter) - against hand-computed values, and one run with all
of them on."""
import math

import pytest
import torch

from periodic_async import algo
from periodic_async.actor.packing import TrainSample, pack_micro_batch
from periodic_async.config import ActorConfig, ConfigError, load_config
from periodic_async.reward.overlong import overlong_penalty
from periodic_async.rollout.base import RolloutResult
from periodic_async.scheduling.group import Group
from periodic_async.train.step import loss_normaliser

RATIOS = torch.tensor([[0.7, 1.25, 1.35, 5.0], [0.7, 1.25, 1.35, 2.0]])   # pi / pi_old per token
ADV = torch.tensor([[1.0] * 4, [-1.0] * 4])


def _pg(**kw):
    """Per-token PPO loss and its gradient w.r.t. logp for RATIOS, one response per row, every token counted."""
    old = torch.zeros(2, 4)
    logp = torch.log(RATIOS).requires_grad_(True)
    x = algo.LossInputs(logp=logp, entropy=torch.zeros(2, 4), old_logp=old, ref_logp=None, rollout_logp=None,
                        advantages=ADV, mask=torch.ones(2, 4), normaliser=1.0)
    loss_fn = algo.build_policy_loss("grpo", ActorConfig(kl_coef=0.0, **kw))
    pg_tok, clipped, extra = loss_fn.policy_gradient_tokens(x, algo.losses.rollout_correction.Correction())
    pg_tok.sum().backward()
    return pg_tok.detach(), logp.grad, clipped, extra


def test_clip_higher_hand_computed():
    """[1 - 0.2, 1 + 0.28]: for A = +1 the ratio 1.25 is inside (loss -1.25, gradient -1.25) where the
    symmetric 0.2 clips it (loss -1.2, gradient 0); 1.35 clips at 1.28; for A = -1 the low side
    clips 0.7 at 0.8 (loss 0.8, gradient 0)."""
    pg, grad, clipped, _ = _pg(clip_ratio_low=0.2, clip_ratio_high=0.28)
    torch.testing.assert_close(pg, torch.tensor([[-0.7, -1.25, -1.28, -1.28], [0.8, 1.25, 1.35, 2.0]]))
    torch.testing.assert_close(grad, torch.tensor([[-0.7, -1.25, 0.0, 0.0], [0.0, 1.25, 1.35, 2.0]]))
    assert clipped.tolist() == [[False, False, True, True], [True, False, False, False]]
    pg_sym, grad_sym, _, _ = _pg()
    torch.testing.assert_close(pg_sym[0], torch.tensor([-0.7, -1.2, -1.2, -1.2]))
    torch.testing.assert_close(grad_sym[0], torch.tensor([-0.7, 0.0, 0.0, 0.0]))


def test_dual_clip_hand_computed():
    """c = 3: for A = -1 the ratio 5.0 gives loss min(5, 3) = 3 with no gradient, and the metric
    counts that one token; 2.0 < 3 is untouched; A > 0 rows are untouched."""
    pg, grad, _, extra = _pg(clip_ratio_c=3.0)
    torch.testing.assert_close(pg, torch.tensor([[-0.7, -1.2, -1.2, -1.2], [0.8, 1.25, 1.35, 2.0]]))
    pg5 = _pg_one(5.0, -1.0, clip_ratio_c=3.0)
    assert pg5 == (3.0, 0.0)
    assert _pg_one(5.0, -1.0) == (5.0, 5.0)                  # without the dual clip: unbounded
    assert float(extra["actor/pg_clipfrac_lower"]) == 0.0     # row 1's 2.0 < 3
    _, _, _, extra5 = _pg(clip_ratio_c=1.9)                   # now 2.0 > 1.9 on the A < 0 row
    assert float(extra5["actor/pg_clipfrac_lower"]) == 1.0    # one token, normaliser 1


def _pg_one(ratio, adv, **kw):
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    x = algo.LossInputs(logp=logp, entropy=torch.zeros(1, 1), old_logp=torch.zeros(1, 1), ref_logp=None,
                        rollout_logp=None, advantages=torch.tensor([[adv]]), mask=torch.ones(1, 1), normaliser=1.0)
    pg, _, _ = algo.build_policy_loss("grpo", ActorConfig(**kw)).policy_gradient_tokens(
        x, algo.losses.rollout_correction.Correction())
    pg.sum().backward()
    return round(float(pg.detach()), 6), round(float(logp.grad), 6)


@pytest.mark.parametrize("seed", [0, 1])
def test_equal_bounds_are_todays_loss_exactly(seed):
    g = torch.Generator().manual_seed(seed)
    logp, old = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    adv = torch.randn(3, 1, generator=g).expand(3, 5)
    want = algo.clipped_pg_loss(logp, old, adv, 0.2)
    got = algo.clipped_pg_loss(logp, old, adv, 0.2, 0.2)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    low, high = algo.losses.clip_bounds(ActorConfig(clip_ratio=0.2))
    assert (low, high) == (0.2, 0.2)


@pytest.mark.parametrize("length, factor, want", [
    (10, 1.0, 0.0), (15, 1.0, 0.0), (16, 1.0, -0.2), (18, 0.5, -0.3), (20, 1.0, -1.0), (20, 0.0, 0.0)])
def test_overlong_penalty_hand_values(length, factor, want):
    """L = 20, buffer 5: 0 up to 15 tokens, then (15 - y) / 5 * factor."""
    assert overlong_penalty(length, 20, 5, factor) == pytest.approx(want)
    assert overlong_penalty(length, 20, 0, factor) == 0.0


def test_filtered_samples_carry_no_loss_and_leave_the_normaliser():
    samples = [TrainSample([5, 6], [7, 8, 9], 1.0), TrainSample([5, 6], [7, 2], -1.0, in_loss=False)]
    for shared in (False, True):
        mb = pack_micro_batch(samples, 0, shared_prompt=shared)
        per_row = mb.loss_mask.sum(-1).tolist()
        assert per_row[0] == 3.0 and per_row[-1] == 0.0, (shared, per_row)

    def result(k, n, reason):
        return RolloutResult(0, k, [5, 6], [7] * n, [0.0] * n, reason, 0)
    groups = [Group(0, [5, 6], "1", [result(0, 3, "length"), result(1, 2, "stop")], [1.0, 0.0], [0.5, -0.5])]
    assert loss_normaliser(groups, "token-mean") == 5.0
    assert loss_normaliser(groups, "token-mean", overlong_filter=True) == 2.0
    assert loss_normaliser(groups, "seq-mean-token-mean", overlong_filter=True) == 1.0


@pytest.mark.parametrize("overrides, message", [
    (["actor.clip_ratio_low=1.5"], "actor.clip_ratio_low: must be in \\(0, 1\\]"),
    (["actor.clip_ratio_high=-0.1"], "actor.clip_ratio_high: must be > 0"),
    (["actor.clip_ratio_c=0.9"], "actor.clip_ratio_c: must be > 1"),
    (["reward.overlong_buffer.len=4"], "reward.overlong_buffer.len: must be in \\[0, rollout.max_new_tokens = 3\\]"),
    (["reward.overlong_buffer.len=1", "reward.overlong_buffer.penalty_factor=-1"],
     "reward.overlong_buffer.penalty_factor: must be >= 0"),
])
def test_bad_settings_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/default.yaml", overrides).validate(world_size=1)


def test_a_run_with_every_dapo_switch_trains(tmp_path):
    """Sync, 4 steps: clip-higher, dual-clip, a 1-token overlong buffer (every 3-token response is
    punished by the full factor 0.5) and overlong filtering. The penalty's share is the share of
    3-token responses, at least the truncated share; the penalty mean is -0.5 times that share."""
    from periodic_async.train.trainer import Trainer
    history = Trainer(load_config("configs/default.yaml", [
        f"trainer.run_dir={tmp_path}", "trainer.mode=sync", "trainer.total_steps=4", "trainer.progress_bar=false",
        "trainer.save_final=false", "actor.clip_ratio_high=0.28", "actor.clip_ratio_c=3.0",
        "actor.overlong_filter=true", "reward.overlong_buffer.len=1",
        "reward.overlong_buffer.penalty_factor=0.5"])).fit()
    assert len(history) == 4
    for h in history:
        share = h["reward/overlong_penalty/ratio"]
        assert h["reward/overlong_penalty/mean"] == pytest.approx(-0.5 * share)
        assert share >= h["response_length/clip_ratio"]
        assert "actor/pg_clipfrac_lower" in h and math.isfinite(h["actor/pg_loss"])
