"""The bounded-staleness math: AReaL's decoupled PPO loss, VCPO's effective sample size, learning-
rate scale and minimum-variance baseline - against the GRPO loss they reduce to and hand-computed
values - and their wiring (registries, config keys, the optimizer's one-step lr scale, the actor)."""
import math

import pytest
import torch

from periodic_async import algo
from periodic_async.algo import compute_advantages, variance_control as vc
from periodic_async.config import ActorConfig, ConfigError, load_config
from periodic_async.config.sections import AlgoConfig

DEFAULT = "configs/default.yaml"
MODES = ("token-mean", "seq-mean-token-mean")


def _random_inputs(seed: int, behaviour_equals_prox: bool = True):
    """LossInputs of 3 rows x 7 positions ([B, S]) with responses of 5, 2 and 0 tokens."""
    g = torch.Generator().manual_seed(seed)
    b, s = 3, 7
    mask = torch.zeros(b, s)
    mask[0, 1:6] = 1.0
    mask[1, 3:5] = 1.0
    old = -torch.rand(b, s, generator=g) * 3                                   # [B, S]
    logp = (old + 0.3 * torch.randn(b, s, generator=g)).requires_grad_(True)   # [B, S]
    rollout = old.clone() if behaviour_equals_prox else old + 0.5 * torch.randn(b, s, generator=g)
    adv = torch.randn(b, 1, generator=g).expand(b, s).contiguous()
    entropy = torch.rand(b, s, generator=g).requires_grad_(True)
    ref = old + 0.1 * torch.randn(b, s, generator=g)
    return dict(logp=logp, entropy=entropy, old_logp=old, ref_logp=ref, rollout_logp=rollout,
                advantages=adv, mask=mask)


def _run(name: str, cfg: ActorConfig, tensors: dict, normaliser: float):
    t = {k: (v.detach().clone().requires_grad_(v.requires_grad) if v is not None else None)
         for k, v in tensors.items()}
    loss, metrics = algo.build_policy_loss(name, cfg)(algo.LossInputs(**t, normaliser=normaliser))
    loss.backward()
    return loss, metrics, t["logp"].grad, t["entropy"].grad


# ---------------------------------------------------------------------- decoupled PPO


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("cap", [None, 2.0])
def test_decoupled_equals_grpo_when_behaviour_is_proximal(mode, seed, cap):
    """pi_behav == pi_prox: w = 1 exactly, so loss, gradients and shared metrics are GRPO's, bit for bit."""
    kw = dict(loss_agg_mode=mode, kl_coef=0.1, entropy_coef=0.01, clip_ratio=0.2)
    tensors = _random_inputs(seed)
    norm = 7.0 if mode == "token-mean" else 2.0
    want = _run("grpo", ActorConfig(**kw), tensors, norm)
    got = _run("decoupled_ppo", ActorConfig(**kw, behav_imp_weight_cap=cap), tensors, norm)
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
    for k, v in want[1].items():
        assert torch.equal(got[1][k], v), k
    assert got[1]["ppo/behave_imp_weight/sum"] == got[1]["ppo/behave_imp_weight/count"] == 7.0
    assert got[1]["ppo/behave_imp_weight/capped"] == 0.0
    assert got[1]["vcpo/rho_sum"] == got[1]["vcpo/rho_sq_sum"] == got[1]["vcpo/num_seqs"] == 2.0


def test_decoupled_differs_from_grpo_when_stale():
    tensors = _random_inputs(3, behaviour_equals_prox=False)
    want = _run("grpo", ActorConfig(), tensors, 7.0)
    got = _run("decoupled_ppo", ActorConfig(), tensors, 7.0)
    assert not torch.equal(got[0], want[0])


def test_decoupled_loss_hand_computed_with_a_capped_token():
    """Row 0: pi_behav = (0.5, 0.25, 0.1), pi_prox = (0.5, 0.5, 0.6) -> w = (1, 2, 6); r = (1.1, 1.5,
    1.0); A = +1. cap 5 masks token 3. PPO-clip (eps 0.2) per token: -1.1, -1.2 (clipped), -1.0.
    Row 1: one token, behaviour == prox, r = 0.9, A = -1 -> max(0.9, 0.8) = 0.9.
    token-mean over 4 tokens: (-1.1 * 1 - 1.2 * 2 - 1.0 * 0 + 0.9 * 1) / 4 = -2.6 / 4."""
    behav = torch.log(torch.tensor([[0.5, 0.25, 0.1], [0.3, 1.0, 1.0]]))
    prox = torch.log(torch.tensor([[0.5, 0.5, 0.6], [0.3, 1.0, 1.0]]))
    logp = (prox + torch.log(torch.tensor([[1.1, 1.5, 1.0], [0.9, 1.0, 1.0]]))).requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([[1.0] * 3, [-1.0] * 3])
    cfg = ActorConfig(kl_coef=0.0, entropy_coef=0.0, clip_ratio=0.2, behav_imp_weight_cap=5.0)
    objective = algo.build_policy_loss("decoupled_ppo", cfg)
    x = algo.LossInputs(logp=logp, entropy=torch.zeros(2, 3), old_logp=prox, ref_logp=None, rollout_logp=behav,
                        advantages=adv, mask=mask, normaliser=4.0)
    loss, m = objective(x)
    assert loss.item() == pytest.approx(-2.6 / 4, rel=1e-6)
    # gradient w.r.t. logp: -A * w * r on unclipped tokens, 0 on the clipped and the capped ones
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.1, 0.0, 0.0], [0.9, 0.0, 0.0]]) / 4)
    # raw weights (1, 2, 6, 1): mean 2.5, max 6, 1 of 4 tokens capped
    fin = objective.finalize_metrics({k: float(v) for k, v in m.items()})
    assert fin["ppo/behave_imp_weight/mean"] == pytest.approx(2.5, rel=1e-6)
    assert float(m["ppo/behave_imp_weight/max"]) == pytest.approx(6.0, rel=1e-6)
    assert fin["ppo/behave_imp_weight/capped_frac"] == pytest.approx(0.25)
    # sequence ratios rho = (1 * 2 * 6, 1) = (12, 1): ESS = 13^2 / 145, over N = 2
    assert fin["vcpo/ess_ratio"] == pytest.approx(169 / 145 / 2, rel=1e-5)
    assert not any(k in fin for k in ("vcpo/rho_sum", "ppo/behave_imp_weight/count"))
    assert fin["actor/pg_loss"] == pytest.approx(-2.6 / 4, rel=1e-6)


def test_cap_masks_out_rather_than_clips():
    w = torch.tensor([[0.5, 3.0, 9.0, 40.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    capped_w, capped = algo.cap_behaviour_weights(w, mask, 5.0)
    assert capped_w.tolist() == [[0.5, 3.0, 0.0, 1.0]]        # outside the response: weight 1, no cap
    assert capped.tolist() == [[False, False, True, False]]
    assert torch.equal(algo.cap_behaviour_weights(w, mask, None)[0], torch.tensor([[0.5, 3.0, 9.0, 1.0]]))


def test_sequence_ratios_are_bounded():
    prox = torch.zeros(2, 100)
    behav = torch.full((2, 100), -1.0)          # log-ratio +1 per token: sum 100, clamped to 20
    mask = torch.ones(2, 100)
    mask[1] = 0.0
    rho = algo.sequence_importance_ratios(prox, behav, mask)
    assert rho.tolist() == pytest.approx([math.exp(20.0), 1.0])


def test_decoupled_needs_rollout_logprobs():
    x = algo.LossInputs(**{**_random_inputs(0), "rollout_logp": None}, normaliser=1.0)
    with pytest.raises(ValueError, match="decoupled_ppo' needs the rollout engine's per-token log-probs"):
        algo.build_policy_loss("decoupled_ppo", ActorConfig())(x)


# ---------------------------------------------------------------------- VCPO pure functions


def test_effective_sample_size_hand_values():
    assert vc.effective_sample_size([1.0, 1.0, 1.0, 1.0]) == 4.0
    assert vc.effective_sample_size([2.0, 0.0, 0.0, 0.0]) == 1.0
    assert vc.effective_sample_size([1.0, 2.0, 3.0]) == pytest.approx(36 / 14)     # (1+2+3)^2 / (1+4+9)
    assert vc.effective_sample_size([0.5, 0.5]) == 2.0                               # scale-free
    assert vc.effective_sample_size([0.0, 0.0]) == 0.0
    assert vc.ess_ratio(6.0, 14.0, 3) == pytest.approx(6 / 7)
    assert vc.ess_ratio(4.0, 4.0, 4) == 1.0
    assert vc.ess_ratio(0.0, 0.0, 0) == 1.0


def test_lr_scale_rules_floor_and_ceiling():
    # sqrt (VCPO's official rule): sqrt(min(1, ratio / base))
    assert vc.lr_scale(0.25) == 0.5
    assert vc.lr_scale(0.25, base=0.5) == pytest.approx(0.5 ** 0.5)
    assert vc.lr_scale(0.6, base=0.55) == 1.0          # above the base: the full lr
    assert vc.lr_scale(0.01, floor=0.2) == 0.2
    # linear (the earlier rule)
    assert vc.lr_scale(0.5, rule="linear") == 0.5
    assert vc.lr_scale(0.05, floor=0.1, rule="linear") == 0.1
    assert vc.lr_scale(0.3, floor=0.1, rule="linear") == 0.3
    assert vc.lr_scale(0.3, rule="linear", base=0.6) == 0.5
    for rule in ("sqrt", "linear"):
        assert vc.lr_scale(1.0, rule=rule) == 1.0 and vc.lr_scale(1.2, rule=rule) == 1.0
    with pytest.raises(ValueError, match="actor.vcpo_lr_scale_rule: unknown 'log'"):
        vc.lr_scale(0.5, rule="log")


def test_min_variance_baseline_hand_values():
    # rewards (1, 0, 0, 1), rho (3, 1, 1, 1): rho^2 (9, 1, 1, 1), b* = (9 + 1) / 12 = 5/6
    assert vc.min_variance_baseline([1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 1.0, 1.0]) == pytest.approx(5 / 6)
    assert vc.min_variance_baseline([1.0, 0.0, 0.0, 1.0], [2.0] * 4) == 0.5         # equal rho: the mean
    assert vc.min_variance_baseline([0.2, 0.7, 0.4], [0.3] * 3) == pytest.approx((0.2 + 0.7 + 0.4) / 3)
    with pytest.raises(ValueError, match="importance ratios must be >= 0"):
        vc.min_variance_baseline([1.0, 0.0], [1.0, -1.0])
    with pytest.raises(ValueError, match="2 rewards but 3 importance ratios"):
        vc.min_variance_baseline([1.0, 0.0], [1.0, 1.0, 1.0])


def test_vcpo_baseline_estimator():
    (adv,) = compute_advantages("vcpo_baseline", [[1.0, 0.0, 0.0, 1.0]], group_rhos=[[3.0, 1.0, 1.0, 1.0]])
    assert adv == pytest.approx([1 / 6, -5 / 6, -5 / 6, 1 / 6])
    # without ratios (on-policy) or with equal ones: grpo without the std division (the group mean)
    rewards = [[0.3, 0.9, 0.1], [1.0, 0.0]]
    no_std = AlgoConfig(norm_adv_by_std_in_grpo=False)
    mean_baseline = compute_advantages("grpo", rewards, no_std)
    assert compute_advantages("vcpo_baseline", rewards) == mean_baseline
    weighted = compute_advantages("vcpo_baseline", rewards, group_rhos=[[0.7] * 3, [2.0] * 2])
    for got, want in zip(weighted, mean_baseline):
        assert got == pytest.approx(want)
    with pytest.raises(ValueError, match="algo.adv_estimator: 'grpo' takes no importance ratios"):
        compute_advantages("grpo", rewards, group_rhos=[[1.0] * 3, [1.0] * 2])


# ---------------------------------------------------------------------- registries and config


def test_registry_names_resolve_and_unknown_names_name_the_key():
    assert isinstance(algo.build_policy_loss("decoupled_ppo", ActorConfig()), algo.losses.DecoupledPPOLoss)
    assert "vcpo_baseline" in algo.ADV_ESTIMATORS and "decoupled_ppo" in algo.POLICY_LOSSES
    with pytest.raises(ValueError, match=r"actor.policy_loss: unknown 'decoupled'; allowed: cispo, decoupled_ppo, grpo, gspo"):
        algo.build_policy_loss("decoupled", ActorConfig())
    with pytest.raises(ValueError, match=r"algo.adv_estimator: unknown 'vcpo'; allowed: .*vcpo_baseline"):
        compute_advantages("vcpo", [[0.0, 1.0]])


def test_new_keys_default_off_and_validate():
    cfg = load_config(DEFAULT)
    assert cfg.actor.behav_imp_weight_cap is None and cfg.actor.vcpo_lr_scale is False
    cfg.validate(world_size=1)
    load_config(DEFAULT, ["actor.policy_loss=decoupled_ppo", "actor.behav_imp_weight_cap=5.0",
                          "actor.vcpo_lr_scale=true", "actor.vcpo_lr_scale_min=0.1",
                          "algo.adv_estimator=vcpo_baseline"]).validate(world_size=1)


@pytest.mark.parametrize("overrides, message", [
    (["actor.policy_loss=decoupled_ppo", "actor.behav_imp_weight_cap=1.0"],
     "actor.behav_imp_weight_cap: must be > 1 (or null for no cap), got 1.0"),
    (["actor.behav_imp_weight_cap=5.0"],
     "actor.behav_imp_weight_cap: only used by actor.policy_loss 'decoupled_ppo', got 'grpo'"),
    (["actor.vcpo_lr_scale_min=1.5"], "actor.vcpo_lr_scale_min: must be in [0, 1], got 1.5"),
    (["actor.vcpo_lr_scale=true"], "actor.vcpo_lr_scale: needs a policy loss that reports the importance ratios' "
                                   "ESS (decoupled_ppo), got actor.policy_loss 'grpo'"),
    (["actor.policy_loss=decoupled"], "actor.policy_loss: 'decoupled' is not allowed"),
    (["algo.adv_estimator=vcpo"], "algo.adv_estimator: 'vcpo' is not allowed"),
])
def test_new_keys_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT, overrides).validate(world_size=1)
    assert message in str(e.value)


# ---------------------------------------------------------------------- the optimizer's one-step lr scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_step_equals_a_plain_step_at_the_scaled_lr(dtype):
    """step(lr_scale=s) moves the weights exactly as a step of an optimizer built with lr * s, and
    the param groups' lr is back to lr afterwards (the next, unscaled, steps agree too)."""
    from periodic_async.actor.optimizer import build_optimizer
    lr, s = 1e-2, 0.37

    def model_and_opt(lr_):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3).to(dtype)
        return model, build_optimizer(model.parameters(), ActorConfig(lr=lr_, weight_decay=0.1))

    def backward(model):
        x = torch.arange(8.0).reshape(2, 4).to(dtype)
        model(x).square().sum().backward()

    scaled_model, scaled = model_and_opt(lr)
    plain_model, plain = model_and_opt(lr * s)
    for model, opt, kw in ((scaled_model, scaled, {"lr_scale": s}), (plain_model, plain, {})):
        backward(model)
        opt.step(**kw)
        opt.zero_grad()
    for a, b in zip(scaled_model.parameters(), plain_model.parameters()):
        assert torch.equal(a, b)
    assert scaled.lr == lr and all(g["lr"] == lr for g in scaled.inner.param_groups)
    before = [p.detach().clone() for p in scaled_model.parameters()]
    backward(scaled_model)
    scaled.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, scaled_model.parameters()))


# ---------------------------------------------------------------------- through the actor (TP = PP = DP = 1)


def _actor(model_dir, **kw):
    from periodic_async.actor.tri_model import TriModelActor
    from periodic_async.models.mcore import arch_from_hf_dir
    import helpers
    cfg = ActorConfig(**{"kl_coef": 0.0, "entropy_coef": 0.0, "ppo_epochs": 1, "adam_eps": 1e-4, "lr": 1e-2, **kw})
    return TriModelActor(cfg, arch_from_hf_dir(model_dir), model_dir, temperature=helpers.TEMPERATURE,
                         with_reference=False)


def test_actor_decoupled_ppo_and_vcpo_lr_scale(tmp_path, megatron_tp1):
    """In the actor: decoupled_ppo on a batch whose behaviour log-probs are the policy's own equals
    GRPO (w = 1, ESS / N = 1); with stale behaviour log-probs, actor.vcpo_lr_scale steps at
    lr * ESS / N - the same weights as an unscaled actor built with that lr - and reports the scale."""
    from periodic_async.actor.packing import pack_micro_batch
    import helpers
    model_dir = helpers.make_hf_model_dir(tmp_path / "policy", init_std=0.2, seed=3)
    samples = helpers.tri_groups()[0]
    mb = pack_micro_batch(samples, 0)
    grpo = _actor(model_dir)
    own = grpo.compute_logprobs(mb)["policy"]
    mb_on = pack_micro_batch(samples, 0)
    mb_on.rollout_logp = torch.where(mb_on.loss_mask > 0, own, mb_on.rollout_logp)
    want = grpo.train_micro_step(mb_on, 9.0)
    dec = _actor(model_dir, policy_loss="decoupled_ppo", vcpo_lr_scale=True)
    got = dec.train_micro_step(mb_on, 9.0)
    assert got["actor/pg_loss"] == pytest.approx(want["actor/pg_loss"], rel=1e-5)
    assert got["ppo/behave_imp_weight/mean"] == pytest.approx(1.0, abs=1e-5)
    assert got["vcpo/ess_ratio"] == pytest.approx(1.0, abs=1e-4) and got["vcpo/lr_scale"] <= 1.0
    for (n, a), b in zip(grpo.policy.named_parameters(), dec.policy.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")
    dec.optimizer.zero_grad()

    # stale behaviour (the fixed rollout log-probs of tri_groups): ESS / N < 1 scales this step's lr
    stale = _actor(model_dir, policy_loss="decoupled_ppo", vcpo_lr_scale=True, vcpo_lr_scale_min=0.05)
    m = stale.train_micro_step(mb, 9.0)
    scale = m["vcpo/lr_scale"]
    assert 0.05 <= scale < 0.99 and scale == pytest.approx(max(0.05, m["vcpo/ess_ratio"] ** 0.5))
    assert m["ppo/behave_imp_weight/max"] >= m["ppo/behave_imp_weight/mean"] > 0
    step = stale.optimizer_step()
    assert step["actor/lr"] == 1e-2 and stale._lr_scale == 1.0                 # restored, consumed
    reference = _actor(model_dir, policy_loss="decoupled_ppo", lr=1e-2 * scale)
    reference.train_micro_step(mb, 9.0)
    reference.optimizer_step()
    for a, b in zip(stale.policy.parameters(), reference.policy.parameters()):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------- the baseline in the loss


def test_min_variance_advantages_on_tensors_equal_the_float_estimator():
    """Rows of 3 groups in mixed order (as a micro-batch may hold them): A = R - b*_g, the same as
    the torch-free estimator on each group's own rewards and ratios; a group whose ratios are all 0
    falls back to its mean."""
    rewards = torch.tensor([1.0, 0.0, 0.3, 0.0, 1.0, 0.9, 0.5, 0.2])
    groups = torch.tensor([7, 7, 2, 7, 7, 2, 4, 4])
    rho = torch.tensor([3.0, 1.0, 0.7, 1.0, 1.0, 0.2, 0.0, 0.0])
    got = algo.losses.min_variance_advantages(rewards, groups, rho)
    want = torch.zeros(8)
    for g in (7, 2, 4):
        idx = (groups == g).nonzero()[:, 0]
        (adv,) = compute_advantages("vcpo_baseline", [rewards[idx].tolist()], group_rhos=[rho[idx].tolist()])
        want[idx] = torch.tensor(adv)
    torch.testing.assert_close(got, want)
    assert got[:2].tolist() == pytest.approx([1 / 6, -5 / 6]) and got[6:].tolist() == pytest.approx([0.15, -0.15])


@pytest.mark.parametrize("loss_name", ["grpo", "decoupled_ppo"])
def test_loss_with_rewards_and_groups_equals_the_loss_with_baseline_advantages(loss_name):
    """Given rewards and groups, the loss re-centres the rewards on b* from the sequence ratios
    pi_prox / pi_behav (old_logp / rollout_logp) and is then the loss with those advantages."""
    t = _random_inputs(3, behaviour_equals_prox=False)
    rewards, groups = torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0, 0, 1])
    rho = algo.sequence_importance_ratios(t["old_logp"], t["rollout_logp"], t["mask"])
    assert not torch.allclose(rho[:2], torch.ones(2))        # the ratios matter here
    baseline = float((rho[:2] ** 2 * rewards[:2]).sum() / (rho[:2] ** 2).sum())
    want_adv = torch.tensor([1.0 - baseline, 0.0 - baseline, 0.0])[:, None].expand(3, 7).contiguous()
    cfg = ActorConfig(policy_loss=loss_name, entropy_coef=0.01)
    loss, metrics, g_logp, _ = _run(loss_name, cfg, {**t, "rewards": rewards, "group_ids": groups}, 7.0)
    ref_loss, ref_metrics, ref_g, _ = _run(loss_name, cfg, {**t, "advantages": want_adv}, 7.0)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(g_logp, ref_g)
    # the given advantages were ignored: with them the loss differs
    plain, _, _, _ = _run(loss_name, cfg, t, 7.0)
    assert not torch.allclose(plain, loss)


def test_vcpo_baseline_needs_whole_groups_per_micro_batch():
    with pytest.raises(ConfigError, match=r"actor.micro_batch_size \(6\) must be a multiple of rollout.n \(4\)"):
        load_config(DEFAULT, ["algo.adv_estimator=vcpo_baseline", "actor.micro_batch_size=6",
                              "rollout.n=4"]).validate(world_size=1)


def test_min_variance_baseline_minimises_the_weighted_gradient_variance():
    """With equal score norms, b* = sum rho^2 R / sum rho^2 minimises sum_i rho_i^2 (R_i - b)^2 (the
    second moment of the importance-weighted terms rho_i (R_i - b) g_i): no b on a fine grid does
    better (the earlier sum rho R / sum rho does worse whenever the ratios differ)."""
    import random
    rng = random.Random(0)
    for _ in range(20):
        rewards = [float(rng.random() < 0.5) for _ in range(8)]
        rhos = [rng.lognormvariate(0.0, 1.0) for _ in range(8)]
        second_moment = lambda b: sum(r * r * (x - b) ** 2 for r, x in zip(rhos, rewards))  # noqa: E731
        best = vc.min_variance_baseline(rewards, rhos)
        assert all(second_moment(best) <= second_moment(i / 200) + 1e-12 for i in range(201))


def test_rewards_reach_the_loss_divided_by_the_group_std():
    """algo.norm_adv_by_std_in_grpo with vcpo_baseline: train/step.py hands the loss each reward
    divided by its group's population std (1 when the std is under 1e-8, as VCPO's official code),
    so the loss's R - b* is (R - b*) / std. Groups: rewards (1, 0, 0, 1) (std 0.5) and (1, 1) (std 0)."""
    from periodic_async.rollout.base import RolloutResult
    from periodic_async.scheduling.group import Group
    from periodic_async.train.step import BatchResult, _micro_batches
    groups = {0: [1.0, 0.0, 0.0, 1.0], 1: [1.0, 1.0]}

    class Feed:
        sizes, n = {0: 4, 1: 2}, 2

        def __init__(self):
            self.i = 0

        def get(self):
            g, self.i = self.i, self.i + 1
            results = [RolloutResult(g, k, [1, 2], [3], [-0.5], "length", 0) for k in range(len(groups[g]))]
            return Group(g, [1, 2], "", results, groups[g], [0.0] * len(groups[g]))

    class Actor:
        def pack(self, samples):
            from periodic_async.actor.packing import pack_micro_batch
            return pack_micro_batch(samples, 0)

    def rewards(by_std):
        mbs = list(_micro_batches(Actor(), Feed(), {0: 0, 1: 0}, 0, lambda g: None, 6, BatchResult({}, []),
                                  with_rewards=True, rewards_by_std=by_std))
        return [x for mb in mbs for x in mb.rewards.tolist()]
    assert rewards(True) == [2.0, 0.0, 0.0, 2.0, 1.0, 1.0]
    assert rewards(False) == [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    rho = torch.tensor([3.0, 1.0, 1.0, 1.0])
    adv = algo.losses.min_variance_advantages(torch.tensor([2.0, 0.0, 0.0, 2.0]), torch.zeros(4, dtype=torch.long), rho)
    assert adv.tolist() == pytest.approx([(1 - 5 / 6) / 0.5, -5 / 6 / 0.5, -5 / 6 / 0.5, (1 - 5 / 6) / 0.5])
