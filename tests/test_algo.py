"""The algorithms against hand-computed values (advantage estimators, KL estimators, PPO-clip,
aggregation), exact gradient accumulation, and the registries chosen by name."""
import math
from types import SimpleNamespace

import pytest
import torch

from periodic_async import algo
from periodic_async.algo import compute_advantages


def test_grpo_advantages_hand_computed():
    # rewards 1,0,0,1: mean 0.5, unbiased std sqrt(1/3) -> +-0.5 / 0.57735 = +-0.866025
    (adv,) = compute_advantages("grpo", [[1.0, 0.0, 0.0, 1.0]])
    assert adv == pytest.approx([0.866025, -0.866025, -0.866025, 0.866025], abs=2e-6)
    # groups of different sizes; identical rewards give zero advantage
    a, b = compute_advantages("grpo", [[0.5, 0.5, 0.5], [0.0, 1.0]])
    assert a == [0.0, 0.0, 0.0]
    assert b == pytest.approx([-0.5 / math.sqrt(0.5), 0.5 / math.sqrt(0.5)], abs=2e-6)
    no_std = SimpleNamespace(norm_adv_by_std_in_grpo=False)
    assert compute_advantages("grpo", [[0.0, 2.0]], no_std) == [[-1.0, 1.0]]
    with pytest.raises(ValueError, match="at least 2"):
        compute_advantages("grpo", [[1.0]])


def test_rloo_advantages_hand_computed():
    # r_i - mean of the others: 3 - (1+2)/2 = 1.5, 1 - 2.5 = -1.5, 2 - 2 = 0
    assert compute_advantages("rloo", [[3.0, 1.0, 2.0], [1.0, 1.0]]) == [[1.5, -1.5, 0.0], [0.0, 0.0]]


def test_unknown_names_are_refused_with_the_allowed_ones():
    with pytest.raises(ValueError, match=r"algo.adv_estimator: unknown 'gae'; allowed: grpo, rloo"):
        compute_advantages("gae", [[0.0, 1.0]])
    with pytest.raises(ValueError, match=r"actor.policy_loss: unknown 'dpo'; allowed: .*grpo"):
        algo.build_policy_loss("dpo", None)
    with pytest.raises(ValueError, match="registered twice"):
        algo.register_policy_loss("grpo")(algo.PolicyLoss)


def test_kl_estimators_hand_computed():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert algo.kl_penalty(logp, ref, "kl").item() == pytest.approx(math.log(2))
    assert algo.kl_penalty(logp, ref, "mse").item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert algo.kl_penalty(logp, ref, "low_var_kl").item() == pytest.approx(0.5 + math.log(2) - 1)
    assert algo.kl_penalty(ref, ref, "low_var_kl").item() == 0.0
    with pytest.raises(ValueError, match="actor.kl_type"):
        algo.kl_penalty(logp, ref, "k9")


def test_clipped_pg_loss_hand_computed():
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5]))
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, clipped = algo.clipped_pg_loss(logp, old, adv, clip_ratio=0.2)
    # ratio 1.5, A=+1: max(-1.5, -1.2) = -1.2 (clipped); A=-1: max(1.5, 1.2) = 1.5
    # ratio 0.5, A=+1: max(-0.5, -0.8) = -0.5;           A=-1: max(0.5, 0.8) = 0.8 (clipped)
    assert loss.tolist() == pytest.approx([-1.2, 1.5, -0.5, 0.8])
    assert clipped.tolist() == [True, False, False, True]


def test_on_policy_gradient_is_minus_advantage_times_score():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    adv = torch.tensor([0.5, -2.0])
    loss, _ = algo.clipped_pg_loss(logp, logp.detach(), adv, 0.2)
    loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([-0.5, 2.0])


def test_aggregate_modes():
    vals = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert algo.batch_normaliser(mask.sum(-1).tolist(), "token-mean") == 3.0
    assert algo.aggregate(vals, mask, "token-mean", 3.0).item() == pytest.approx((1 + 2 + 4) / 3)
    assert algo.batch_normaliser(mask.sum(-1).tolist(), "seq-mean-token-mean") == 2.0
    assert algo.aggregate(vals, mask, "seq-mean-token-mean", 2.0).item() == pytest.approx((1.5 + 4) / 2)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_micro_batch_split_gives_the_same_loss_sum(mode):
    torch.manual_seed(0)
    vals = torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.3).float()
    mask[:, 0] = 1
    norm = algo.batch_normaliser(mask.sum(-1).tolist(), mode)
    whole = algo.aggregate(vals, mask, mode, norm)
    parts = sum(algo.aggregate(vals[i:j], mask[i:j], mode, norm) for i, j in [(0, 1), (1, 4), (4, 6)])
    assert parts.item() == pytest.approx(whole.item(), abs=1e-6)


def test_log_ratio_is_clamped_before_exp():
    """A token whose log-ratio is far off (a stale or broken old log-prob) cannot overflow exp."""
    logp = torch.tensor([0.0, 0.0], requires_grad=True)
    old = torch.tensor([-200.0, 200.0])
    loss, clipped = algo.clipped_pg_loss(logp, old, torch.tensor([-1.0, 1.0]), 0.2)
    assert torch.isfinite(loss).all()
    assert loss.tolist() == pytest.approx([math.exp(20.0), -math.exp(-20.0)], rel=1e-6)
    loss.sum().backward()
    assert torch.isfinite(logp.grad).all()
