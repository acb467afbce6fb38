"""Complements tests/test_policy_losses.py: CISPO in seq-mean-token-mean, GSPO on one-token
responses against a hand value (not only against GRPO), every new loss's micro-batch sums equal
the whole batch's loss AND gradient (the batch-wide normaliser, through the registered class), and
the step's normaliser for Dr. GRPO's seq-mean-token-sum-norm."""
import math

import pytest
import torch

from periodic_async import algo
from periodic_async.config import ActorConfig

OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.2, -3.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])          # responses of 2 and 1 tokens
ADV = torch.tensor([[1.0] * 3, [-1.0] * 3])


def _loss(name, logp, rows, normaliser, cfg):
    x = algo.LossInputs(logp=logp[rows], entropy=torch.zeros_like(logp[rows]), old_logp=OLD[rows], ref_logp=None,
                        rollout_logp=None, advantages=ADV[rows], mask=MASK[rows], normaliser=normaliser)
    return algo.build_policy_loss(name, cfg)(x)


def test_cispo_seq_mean_token_mean_hand_values():
    """r = (0.5, 1.5 | 1.1), clip_ratio_low 1.0 (open bottom, the paper's), high 0.28: weights
    (0.5, 1.28 | 1.1). seq-mean over 2 responses: loss = [-(0.5 lp00 + 1.28 lp01) / 2 + 1.1 lp10] / 2;
    dL/dlp00 = -0.5 / 4, dL/dlp01 = -1.28 / 4, dL/dlp10 = +1.1 / 2."""
    logp = (OLD + torch.log(torch.tensor([[0.5, 1.5, 3.0], [1.1, 3.0, 3.0]]))).requires_grad_(True)
    cfg = ActorConfig(loss_agg_mode="seq-mean-token-mean", kl_coef=0.0, clip_ratio_low=1.0, clip_ratio_high=0.28)
    loss, m = _loss("cispo", logp, slice(None), 2.0, cfg)
    loss.backward()
    lp = logp.detach()
    want = (-(0.5 * lp[0, 0] + 1.28 * lp[0, 1]) / 2 + 1.1 * lp[1, 0]) / 2
    assert float(loss.detach()) == pytest.approx(float(want), rel=1e-6)
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5 / 4, -1.28 / 4, 0.0], [1.1 / 2, 0.0, 0.0]]))
    assert float(m["actor/pg_clipfrac"]) == pytest.approx((1 / 2 + 0.0) / 2)   # one of 2 tokens in response 0


def test_gspo_one_token_responses_hand_values():
    """One token each: s_i = r_i = exp(0.05), exp(-0.1), inside clip 0.2; loss = (-s_0 + s_1) / 2,
    dL/dlogp = (-s_0 / 2, +s_1 / 2)."""
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    old = OLD[:, :2]
    logp = (old + torch.tensor([[0.05, 4.0], [-0.1, 4.0]])).requires_grad_(True)
    x = algo.LossInputs(logp=logp, entropy=torch.zeros(2, 2), old_logp=old, ref_logp=None, rollout_logp=None,
                        advantages=ADV[:, :2], mask=mask, normaliser=2.0)
    loss, m = algo.build_policy_loss("gspo", ActorConfig(loss_agg_mode="seq-mean-token-mean", kl_coef=0.0))(x)
    loss.backward()
    s0, s1 = math.exp(0.05), math.exp(-0.1)
    assert float(loss.detach()) == pytest.approx((-s0 + s1) / 2, rel=1e-6)
    torch.testing.assert_close(logp.grad, torch.tensor([[-s0 / 2, 0.0], [s1 / 2, 0.0]]))
    assert float(m["actor/pg_clipfrac"]) == 0.0


@pytest.mark.parametrize("name, mode", [
    ("gspo", "seq-mean-token-mean"), ("cispo", "token-mean"), ("cispo", "seq-mean-token-mean"),
    ("grpo", "seq-mean-token-sum-norm"), ("cispo", "seq-mean-token-sum-norm")])
def test_micro_batch_losses_and_gradients_sum_to_the_batch(name, mode):
    """Two one-response micro-batches with the batch's normaliser give the whole batch's loss and
    gradient (exact gradient accumulation); log-ratios both inside and outside the clip range."""
    norm = algo.batch_normaliser(MASK.sum(-1).tolist(), mode, 8)
    cfg = ActorConfig(loss_agg_mode=mode, kl_coef=0.0, clip_ratio=0.2)
    lr = torch.tensor([[0.1, 0.5, 0.0], [-0.1, 0.0, 0.0]])     # GSPO: s_0 = e^0.3 clipped, s_1 = e^-0.1 inside
    whole_logp = (OLD + lr).requires_grad_(True)
    whole, _ = _loss(name, whole_logp, slice(None), norm, cfg)
    whole.backward()
    split_logp = (OLD + lr).requires_grad_(True)
    parts = sum(_loss(name, split_logp, slice(i, i + 1), norm, cfg)[0] for i in range(2))
    parts.backward()
    torch.testing.assert_close(parts, whole)
    torch.testing.assert_close(split_logp.grad, whole_logp.grad)
    assert torch.count_nonzero(whole_logp.grad) > 0


def test_drgrpo_step_normaliser_counts_loss_carrying_responses_times_the_constant():
    """train/step.loss_normaliser with seq-mean-token-sum-norm: responses of 3 and 2 tokens, scale
    16 -> 2 x 16 = 32 whatever their lengths; overlong filtering drops the truncated one -> 16."""
    from periodic_async.rollout.base import RolloutResult
    from periodic_async.scheduling.group import Group
    from periodic_async.train.step import loss_normaliser

    def result(k, n, reason):
        return RolloutResult(0, k, [5, 6], [7] * n, [0.0] * n, reason, 0)
    groups = [Group(0, [5, 6], "1", [result(0, 3, "length"), result(1, 2, "stop")], [1.0, 0.0], [0.5, -0.5])]
    assert loss_normaliser(groups, "seq-mean-token-sum-norm", loss_scale_factor=16) == 32.0
    assert loss_normaliser(groups, "seq-mean-token-sum-norm", overlong_filter=True, loss_scale_factor=16) == 16.0


def test_drgrpo_recipe_file_is_default_plus_the_two_changes():
    """configs/drgrpo.yaml validates and differs from configs/default.yaml only in the recipe's keys
    (and the run directory)."""
    from periodic_async.config import load_config
    from periodic_async.config.loading import config_to_dict
    dr = load_config("configs/drgrpo.yaml")
    dr.validate(world_size=1)
    base = config_to_dict(load_config("configs/default.yaml"))
    got = config_to_dict(dr)
    diff = {(s, k) for s in base for k in (base[s] if isinstance(base[s], dict) else {})
            if isinstance(base[s], dict) and base[s][k] != got[s][k]}
    assert diff == {("algo", "norm_adv_by_std_in_grpo"), ("actor", "loss_agg_mode"), ("trainer", "run_dir")}
    assert dr.actor.loss_scale_factor is None and dr.rollout.max_new_tokens == 3
