"""Straggler-aware group control (scheduling/group_sizing.py): the posterior, dual and selection
updates by hand, its behaviour on simulated length distributions, the neighbour constraint,
resuming from a state_dict, the prompt prior, the config checks, and one short training run.
All but the last test are torch-free and run in well under a second each."""
import json
import math
import random
from dataclasses import replace

import pytest

from periodic_async.config.loading import ConfigError
from periodic_async.config.sections import RolloutConfig, SAGCConfig
from periodic_async.scheduling.group_sizing import (FixedGroupSize, StragglerAwareGroupSize, build_group_sizer,
                                                     choose_size, group_straggler_share,
                                                     predict_straggler_probability, prompt_key, straggler_event,
                                                     straggler_ratio, validate_sagc)


def lognormal_batch(env: random.Random, group_size: int, sigma: float, prompts: int = 8):
    """A step's response lengths (tokens): `prompts` groups of `group_size`, lognormal around e^5."""
    return [[max(1, round(env.lognormvariate(5.0, sigma))) for _ in range(group_size)] for _ in range(prompts)]


def run(controller, lengths_of, steps, first_step=1):
    """Drive `controller` for `steps` steps; lengths_of(G) gives a step's lengths. Returns the sizes."""
    sizes = []
    for step in range(first_step, first_step + steps):
        g = controller.begin_step(step)
        controller.observe(step, lengths_of(g))
        sizes.append(g)
    return sizes


# ---------------------------------------------------------------------- the updates by hand


def test_choice_is_the_best_penalised_utility_among_neighbours():
    cands = (4, 8, 16)
    # lam 4: 2 - 0.4 = 1.6, 3 - 1.2 = 1.8, 4 - 2.0 = 2.0 -> 16
    assert choose_size(cands, 8, [0.1, 0.3, 0.5], 4.0) == 16
    # lam 6: 2 - 0.6 = 1.4, 3 - 1.8 = 1.2, 4 - 3.0 = 1.0 -> 4
    assert choose_size(cands, 8, [0.1, 0.3, 0.5], 6.0) == 4
    # from 4 only 4 and 8 are reachable: 8 (3.0) beats 4 (2 - 9 = -7) though 16 would score 4.0
    assert choose_size(cands, 4, [0.9, 0.0, 0.0], 10.0) == 8
    assert choose_size(cands, 16, [0.0, 0.0, 0.0], 0.0) == 16      # lam 0: the largest reachable
    assert choose_size((2, 4), 2, [0.5, 0.0], 2.0) == 4
    assert choose_size((2, 4), 4, [0.0, 0.5], 2.0) == 2            # 1 - 0 = 1 vs 2 - 1 = 1: tie -> smaller


def test_one_step_by_hand_draws_choice_and_updates():
    cfg = SAGCConfig(gamma=0.9, eta=0.25, delta=0.2, tau=2.0, seed=7)
    c = StragglerAwareGroupSize(cfg, 8)
    c.alpha, c.beta, c.lam = [2.0, 3.0, 1.0], [4.0, 1.0, 2.0], 0.5
    reference = random.Random(7)          # the controller draws one Beta per candidate, in order
    draws = [reference.betavariate(a, b) for a, b in zip(c.alpha, c.beta)]
    expected = max((4, 8, 16), key=lambda g: math.log2(g) - 0.5 * draws[(4, 8, 16).index(g)])
    assert c.begin_step(1) == expected == choose_size((4, 8, 16), 8, draws, 0.5)
    assert c.group_size(1, 0) == c.group_size(1, 5) == expected           # one G for every prompt
    assert c.begin_step(1) == expected and c.rng.getstate() == reference.getstate()   # no second draw

    c.pending[1] = (8, None)              # the played arm for the hand-computed update
    m = c.observe(1, [[10, 10, 10], [10, 50]])          # median 10, max 50: ratio 5 > 2, S = 1
    # every arm: 1 + 0.9 (a - 1); the played one (8) + S on alpha, + (1 - S) on beta
    assert c.alpha == pytest.approx([1.9, 3.8, 1.0]) and c.beta == pytest.approx([3.7, 1.0, 1.9])
    assert c.lam == pytest.approx(0.5 + 0.25 * (1 - 0.2))
    assert m["sagc/straggler_event"] == 1 and m["sagc/straggler_ratio"] == 5.0
    assert m["sagc/group_size"] == 8 and m["sagc/straggler_rate"] == 1.0 and m["sagc/lambda"] == pytest.approx(0.7)
    assert m["sagc/p_hat/8"] == pytest.approx(3.8 / 4.8) and m["sagc/p_hat/16"] == pytest.approx(1 / 2.9)

    c.begin_step(2)
    c.lam = 0.01
    m = c.observe(2, [[10, 11, 19]])                    # ratio 1.73: S = 0; the dual is projected onto >= 0
    assert m["sagc/straggler_event"] == 0 and c.lam == 0.0 and m["sagc/straggler_rate"] == 0.5


def test_forgotten_arm_returns_to_the_prior_not_to_zero():
    c = StragglerAwareGroupSize(SAGCConfig(gamma=0.5), 4)
    c.alpha, c.beta = [9.0, 5.0, 3.0], [1.0, 7.0, 4.0]
    for step in range(1, 60):             # stay at 4 (large lam), so 8 and 16 are never played
        c.lam = 100.0
        c.begin_step(step)
        c.pending[step] = (4, None)
        c.observe(step, [[10, 10]])
    assert c.alpha[1:] == pytest.approx([1.0, 1.0]) and c.beta[1:] == pytest.approx([1.0, 1.0])
    assert c.alpha[0] == pytest.approx(1.0) and c.beta[0] == pytest.approx(1.0 + 1 / (1 - 0.5))  # 1 + sum 0.5^k


def test_the_seed_forgetting_updates_the_played_arm_only_towards_zero():
    """forgetting: seed - alpha <- gamma alpha + S and beta <- gamma beta + (1 - S) on the played
    arm; the others keep their verdicts however long they are left alone."""
    c = StragglerAwareGroupSize(SAGCConfig(gamma=0.9, forgetting="seed"), 8)
    c.alpha, c.beta = [2.0, 3.0, 1.5], [4.0, 1.0, 2.0]
    c.begin_step(1)
    c.pending[1] = (8, None)
    c.observe(1, [[10, 10, 10], [10, 50]])              # S = 1
    assert c.alpha == pytest.approx([2.0, 0.9 * 3.0 + 1, 1.5]) and c.beta == pytest.approx([4.0, 0.9 * 1.0, 2.0])
    for step in range(2, 60):                           # 8 played, never straggling: 4 and 16 untouched
        c.begin_step(step)
        c.pending[step] = (8, None)
        c.observe(step, [[10, 10]])
    assert c.alpha[0::2] == [2.0, 1.5] and c.beta[0::2] == [4.0, 2.0]
    # the played arm's alpha decays towards 0 (not 1), its beta to 1 / (1 - gamma) = 10
    assert 0 < c.alpha[1] < 0.01 and c.beta[1] == pytest.approx(10.0, abs=0.05)


def test_straggler_ratio_and_prompt_key():
    assert straggler_ratio([1, 2, 3, 4]) == 4 / 2.5
    assert straggler_ratio([0, 0, 7]) == 7.0          # a zero median counts as 1
    assert prompt_key([1, 2, 3]) == prompt_key((1, 2, 3)) != prompt_key([1, 23])
    assert len(prompt_key([5])) == 16


def test_both_straggler_statistics_by_hand():
    # groups: [10, 10, 30] ratio 3 > 2 straggles; [10, 12] ratio 1.09 does not; [4, 4, 4, 20] ratio
    # 5 does; [] is left out. Pooled: median of the 12 lengths 10, max 30: ratio 3 -> 1.
    groups = [[10, 10, 30], [10, 12], [4, 4, 4, 20], []]
    assert group_straggler_share(groups, 2.0) == pytest.approx(2 / 3)
    assert straggler_event(groups, 2.0, "group") == pytest.approx(2 / 3)
    assert straggler_event(groups, 2.0, "step") == 1 and straggler_event(groups, 3.0, "step") == 0
    # a step whose pooled ratio is small but one group straggles on its own
    mixed = [[100, 100, 100, 100], [100, 100, 100, 100], [10, 10, 10, 25]]   # pooled: max 100, median 100
    assert straggler_event(mixed, 2.0, "step") == 0 and straggler_event(mixed, 2.0, "group") == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="rollout.sagc.straggler_statistic: unknown 'x'"):
        straggler_event(groups, 2.0, "x")


def test_the_group_statistic_updates_with_the_share():
    """Under `group` the posterior and the dual take the share of straggling groups as S_t."""
    c = StragglerAwareGroupSize(SAGCConfig(gamma=0.9, eta=0.25, delta=0.2, tau=2.0, straggler_statistic="group"), 8)
    c.alpha, c.beta, c.lam = [2.0, 3.0, 1.0], [4.0, 1.0, 2.0], 0.5
    c.begin_step(1)
    c.pending[1] = (8, None)
    m = c.observe(1, [[10, 10, 30], [10, 12], [4, 4, 4, 20], [10, 10]])     # 2 of 4 groups: S = 0.5
    assert c.alpha == pytest.approx([1.9, 2.8 + 0.5, 1.0]) and c.beta == pytest.approx([3.7, 1.0 + 0.5, 1.9])
    assert c.lam == pytest.approx(0.5 + 0.25 * (0.5 - 0.2))
    assert m["sagc/straggler_event"] == 0.5 and m["sagc/group_straggler_share"] == 0.5
    assert m["sagc/straggler_ratio"] == 3.0                # the pooled ratio is reported either way
    restored = StragglerAwareGroupSize(SAGCConfig(straggler_statistic="group"), 8)
    restored.load_state_dict(json.loads(json.dumps(c.state_dict())))
    assert restored.straggler_steps == 0.5


def test_the_group_statistic_grows_with_g_where_the_pooled_one_saturates():
    """Many prompts per step: the pooled max / median of B x G lengths is over tau at any G (the
    long_tail benchmark's situation), while the share of straggling groups still rises with G."""
    env = random.Random(3)
    pooled, share = {}, {}
    for g in (4, 8, 16):
        steps = [lognormal_batch(env, g, 0.5, prompts=32) for _ in range(200)]
        pooled[g] = sum(straggler_event(b, 2.0, "step") for b in steps) / 200
        share[g] = sum(straggler_event(b, 2.0, "group") for b in steps) / 200
    assert min(pooled.values()) > 0.95                     # saturated: nothing to trade
    assert share[4] < share[8] < share[16] and share[16] - share[4] > 0.2


def test_the_prompt_prior_predicts_the_chosen_statistic():
    fits = [(3.0, 0.5)] * 16
    step = predict_straggler_probability(fits, (4, 8, 16), 2.0, 1000.0, 0, 1, "step")
    group = predict_straggler_probability(fits, (4, 8, 16), 2.0, 1000.0, 0, 1, "group")
    assert step == predict_straggler_probability(fits, (4, 8, 16), 2.0, 1000.0, 0, 1)    # the default
    assert group[0] < group[1] < group[2] and all(g < s for g, s in zip(group, step))


# ---------------------------------------------------------------------- behaviour


def test_heavy_tailed_lengths_shrink_the_group_and_raise_lambda():
    # sigma 0.3 over 8 prompts: P(max/median > 2) about 0.28 / 0.48 / 0.73 at G = 4 / 8 / 16, so
    # delta = 0.2 is out of reach even at G = 4 and lambda keeps rising; the discounted posteriors
    # still let Thompson sampling try 16 now and then (a low draw), hence the margins
    for seed in range(3):
        env = random.Random(seed)
        c = StragglerAwareGroupSize(SAGCConfig(seed=seed), 16)
        sizes = run(c, lambda g: lognormal_batch(env, g, 0.3), 300)
        first, last = sizes[:50], sizes[-100:]
        assert sum(last) / 100 < 8 and sum(last) / 100 < sum(first) / 50 - 2, seed
        assert last.count(4) > 2 * last.count(16), seed
        assert c.lam > 5.0 and c.straggler_steps / c.steps_observed > 0.2, seed


def test_uniform_lengths_grow_the_group_to_the_largest():
    env = random.Random(6)
    c = StragglerAwareGroupSize(SAGCConfig(), 4)
    sizes = run(c, lambda g: [[env.randint(50, 60) for _ in range(g)] for _ in range(8)], 20)
    assert sizes[:2] == [8, 16] and set(sizes[2:]) == {16}
    assert c.lam == 0.0 and c.straggler_steps == 0


def test_long_run_straggler_rate_settles_near_delta():
    # known p(G): 0.05 / 0.15 / 0.45. delta 0.2 lies between p(8) and p(16): the controller mixes
    # 8 and 16. mean(S) - delta = lambda_T / (eta T) when the projection is inactive; lambda settles
    # near 8 here, so after 4000 steps the rate is within 8 / (0.25 * 4000) = 0.008 (+ noise) of delta.
    p = {4: 0.05, 8: 0.15, 16: 0.45}
    for seed in range(3):
        env = random.Random(100 + seed)
        c = StragglerAwareGroupSize(SAGCConfig(seed=seed), 8)
        sizes = run(c, lambda g: [[100, 100, 500]] if env.random() < p[g] else [[100, 100]], 4000)
        rate = c.straggler_steps / c.steps_observed
        assert abs(rate - 0.2) < 0.03, (seed, rate)
        assert sizes.count(8) > 1500 and sizes.count(16) > 500


def test_group_size_never_jumps_two_sizes():
    env = random.Random(9)
    c = StragglerAwareGroupSize(SAGCConfig(candidates=(2, 4, 8, 16, 32), eta=2.0, gamma=0.5), 2)
    regimes = [0.02, 0.6, 0.02, 0.6]      # calm, heavy, calm, heavy: the controller swings both ways
    sizes = [2]
    for r, sigma in enumerate(regimes):
        sizes += run(c, lambda g: lognormal_batch(env, g, sigma), 60, first_step=1 + 60 * r)
    index = [(2, 4, 8, 16, 32).index(g) for g in sizes]
    assert all(abs(a - b) <= 1 for a, b in zip(index, index[1:]))
    assert {2, 32} <= set(sizes)          # it did travel the whole range


# ---------------------------------------------------------------------- resume


@pytest.mark.parametrize("prompt_prior", [False, True])
def test_resumed_controller_makes_identical_decisions(prompt_prior):
    cfg = SAGCConfig(prompt_prior=prompt_prior)
    keys = [f"prompt-{i}" for i in range(8)]

    def drive(c, first, steps, env):
        out = []
        for step in range(first, first + steps):
            g = c.begin_step(step, keys)
            m = c.observe(step, lognormal_batch(env, g, 0.3), keys)
            out.append((g, m))
        return out

    env_a = random.Random(3)
    a = StragglerAwareGroupSize(cfg, 8)
    drive(a, 1, 30, env_a)
    state = json.loads(json.dumps(a.state_dict()))     # through JSON, as meta.json holds it
    env_b = random.Random()
    env_b.setstate(env_a.getstate())
    b = StragglerAwareGroupSize(cfg, 8)
    b.load_state_dict(state)
    assert drive(a, 31, 40, env_a) == drive(b, 31, 40, env_b)
    if prompt_prior:
        assert set(a.prompt_history) == set(keys)

    other = StragglerAwareGroupSize(SAGCConfig(candidates=(2, 4, 8)), 8)
    with pytest.raises(ValueError, match="rollout.sagc.candidates"):
        other.load_state_dict(state)


def test_observe_refuses_a_step_that_was_not_decided():
    c = StragglerAwareGroupSize(SAGCConfig(), 8)
    c.begin_step(1)
    with pytest.raises(ValueError, match="observe\\(step 2\\)"):
        c.observe(2, [[1, 2]])


def test_delayed_feedback_credits_the_size_each_step_played():
    """In the async mode step t + 1 is decided before step t's lengths are in: observe(t) must
    credit the arm step t played, not the one decided last, and the pending decision survives a
    checkpoint."""
    c = StragglerAwareGroupSize(SAGCConfig(candidates=[4, 8, 16]), 4)
    g1, g2 = c.begin_step(1), c.begin_step(2)
    assert g1 != g2          # lambda 0: each decision moves to the larger neighbour (4 -> 8 -> 16)
    j1 = c.candidates.index(g1)
    other = StragglerAwareGroupSize(SAGCConfig(candidates=[4, 8, 16]), 4)
    other.load_state_dict(json.loads(json.dumps(c.state_dict())))
    for ctl in (c, other):
        before = list(ctl.alpha)
        m = ctl.observe(1, [[10, 10, 10], [10, 50]])     # a straggler step: S = 1
        assert m["sagc/group_size"] == g1 and m["sagc/straggler_event"] == 1
        assert ctl.alpha[j1] == pytest.approx(1 + ctl.cfg.gamma * (before[j1] - 1) + 1)
        assert ctl.begin_step(2) == g2                  # still the decision made before
        assert ctl.observe(2, [[10, 10]])["sagc/group_size"] == g2
        with pytest.raises(ValueError, match="observe\\(step 1\\)"):
            ctl.observe(1, [[1, 2]])


# ---------------------------------------------------------------------- the prompt prior


def test_prompt_prior_predicts_long_tailed_batches_to_straggle_and_shrinks_g():
    env = random.Random(1)
    tail, calm = [f"tail-{i}" for i in range(8)], [f"calm-{i}" for i in range(8)]
    c = StragglerAwareGroupSize(SAGCConfig(prompt_prior=True), 8)
    step = 0
    for _ in range(2):                    # two groups of 16 per prompt: the history's fits
        for keys, sigma in ((tail, 0.3), (calm, 0.02)):
            step += 1
            c.begin_step(step, keys)
            c.observe(step, lognormal_batch(env, 16, sigma), keys)
    q_tail, q_calm = c._predict(100, tail), c._predict(100, calm)
    assert q_tail[0] < q_tail[1] < q_tail[2] and q_tail[2] > 0.5      # grows with G
    assert max(q_calm) < 0.05
    assert c._predict(100, ["never-seen"]) is None                    # no history for any prompt: no prior
    # a prompt never seen takes the mean (mu, E[log^2]) of the batch's known prompts
    known = [c.prompt_history[k] for k in tail[:4]]
    mean = [sum(h[0] for h in known) / 4, sum(h[1] for h in known) / 4]
    fits = [(h[0], math.sqrt(h[1] - h[0] ** 2)) for h in known + [mean] * 4]
    assert c._predict(100, tail[:4] + ["never-seen"] * 4) == predict_straggler_probability(
        fits, (4, 8, 16), 2.0, c.length_cap, 0, 100)
    assert StragglerAwareGroupSize(SAGCConfig(prompt_prior=True), 8)._predict(1, tail) is None

    # same state (lambda 4, flat posteriors, G = 8), 200 seeds, prior on vs off
    state = c.state_dict()
    state.update({"lambda": 4.0, "alpha": [1.0] * 3, "beta": [1.0] * 3, "size": 8})

    def picks(keys, prior_on):
        out = []
        for seed in range(200):
            d = StragglerAwareGroupSize(SAGCConfig(prompt_prior=prior_on), 8)
            version, internal, gauss_next = random.Random(seed).getstate()
            d.load_state_dict({**state, "rng": [version, list(internal), gauss_next]})
            out.append(d.begin_step(100, keys))
        return out

    tail_on, tail_off, calm_on = picks(tail, True), picks(tail, False), picks(calm, True)
    assert tail_on.count(16) < tail_off.count(16) - 20                 # predicted to straggle: smaller G
    assert calm_on.count(16) > tail_off.count(16) + 20                 # predicted calm: larger G


def test_prompt_prior_metrics_and_off_by_default():
    c = StragglerAwareGroupSize(SAGCConfig(), 8)
    c.begin_step(1, ["a"])
    c.observe(1, [[3, 4]], ["a"])
    assert c.prompt_history == {} and not SAGCConfig().prompt_prior
    p = StragglerAwareGroupSize(SAGCConfig(prompt_prior=True), 8)
    p.begin_step(1, ["a"])
    p.observe(1, [[3, 4]], ["a"])
    p.begin_step(2, ["a"])
    m = p.observe(2, [[3, 4]], ["a"])
    assert set(m) >= {"sagc/prompt_prior/4", "sagc/prompt_prior/8", "sagc/prompt_prior/16"}
    assert p.prompt_history["a"][0] == pytest.approx((math.log(3) + math.log(4)) / 2)


# ---------------------------------------------------------------------- config and wiring


@pytest.mark.parametrize("change, key", [
    ({"candidates": (8, 4, 16)}, "rollout.sagc.candidates"),
    ({"candidates": (1, 8)}, "rollout.sagc.candidates"),
    ({"candidates": ()}, "rollout.sagc.candidates"),
    ({"candidates": (4, 16)}, "rollout.n"),
    ({"tau": 1.0}, "rollout.sagc.tau"),
    ({"delta": 0.0}, "rollout.sagc.delta"),
    ({"delta": 1.0}, "rollout.sagc.delta"),
    ({"eta": 0.0}, "rollout.sagc.eta"),
    ({"gamma": 0.0}, "rollout.sagc.gamma"),
    ({"gamma": 1.5}, "rollout.sagc.gamma"),
    ({"seed": -1}, "rollout.sagc.seed"),
    ({"prompt_prior_weight": -1.0}, "rollout.sagc.prompt_prior_weight"),
    ({"prompt_ema": 0.0}, "rollout.sagc.prompt_ema"),
    ({"straggler_statistic": "batch"}, "rollout.sagc.straggler_statistic"),
    ({"forgetting": "none"}, "rollout.sagc.forgetting"),
])
def test_bad_sagc_values_name_the_key(change, key):
    validate_sagc(SAGCConfig(), 8)        # the defaults are valid
    with pytest.raises(ConfigError, match=f"^{key}: "):
        validate_sagc(replace(SAGCConfig(), **change), 8)


def test_config_wiring_names_the_key():
    from periodic_async.config import load_config
    cfg = load_config("configs/default.yaml", ["rollout.group_sizing=sagc", "rollout.sagc.candidates=[4, 8]",
                                               "rollout.sagc.tau=3"])
    assert cfg.rollout.sagc.candidates == (4, 8) and cfg.rollout.sagc.tau == 3.0
    cfg.validate(world_size=1)
    with pytest.raises(ConfigError, match="rollout.group_sizing: unknown sizer 'adaptive'; registered: fixed, sagc"):
        build_group_sizer(load_config("configs/default.yaml", ["rollout.group_sizing=adaptive"]).rollout)
    with pytest.raises(ConfigError, match="rollout.sagc.delta: must be in"):
        load_config("configs/default.yaml", ["rollout.group_sizing=sagc",
                                             "rollout.sagc.delta=2"]).validate(world_size=1)
    with pytest.raises(ConfigError, match="rollout.sagc.taus: unknown key"):
        load_config("configs/default.yaml", ["rollout.sagc.taus=3"])
    example = load_config("configs/sagc.yaml").validate(world_size=1)
    assert example.rollout.group_sizing == "sagc" and example.rollout.sagc == SAGCConfig()
    # fixed (the default) ignores the sagc section
    load_config("configs/default.yaml", ["rollout.sagc.delta=2"]).validate(world_size=1)


def test_build_group_sizer_and_planner_call_begin_step_once_per_step():
    from periodic_async.data.records import PromptRecord
    from periodic_async.rollout.base import SamplingParams
    from periodic_async.scheduling.plan import BatchPlanner
    assert build_group_sizer(RolloutConfig(n=6)) == FixedGroupSize(6)
    sizer = build_group_sizer(RolloutConfig(n=8, group_sizing="sagc"))
    assert isinstance(sizer, StragglerAwareGroupSize) and sizer.size == 8

    from periodic_async.data.dataset import PromptLoader
    loader = PromptLoader([PromptRecord(f"{i}=", str(i), i) for i in range(5)], batch_size=5, shuffle=False)
    planner = BatchPlanner(loader, lambda rec: [ord(c) for c in rec.prompt], SamplingParams(), seed=1,
                           group_sizer=sizer)
    plan = planner.plan(1)
    assert set(plan.group_sizes.values()) == {sizer.size} and sizer.step == 1
    state = sizer.rng.getstate()
    assert planner.plan(1).group_sizes == plan.group_sizes and sizer.rng.getstate() == state


def test_three_step_sync_run_logs_sagc_metrics_and_groups_have_the_chosen_k(tmp_path):
    from periodic_async.config import load_config
    from periodic_async.telemetry.logger import read_metrics
    from periodic_async.train.trainer import Trainer
    cfg = load_config("configs/default.yaml", [
        "trainer.mode=sync", f"trainer.run_dir={tmp_path / 'run'}", "trainer.total_steps=3",
        "trainer.progress_bar=false", "trainer.save_final=false", "trainer.save_every=3",
        "data.train_batch_size=4", "rollout.n=2", "actor.micro_batch_size=8", "reward.num_workers=0",
        "rollout.group_sizing=sagc", "rollout.sagc.candidates=[2, 4]"])
    trainer = Trainer(cfg)
    planned = []
    plan = trainer.planner.plan
    trainer.planner.plan = lambda step: planned.append(plan(step)) or planned[-1]
    trained = []                          # per step, the sizes of the groups the trainer consumed
    groups = trainer.producer.groups

    def recording_groups(step):
        trained.append([])
        for g in groups(step):
            trained[-1].append(g.size)
            yield g
    trainer.producer.groups = recording_groups
    history = trainer.fit()
    records = read_metrics(str(tmp_path / "run"))
    assert [r["step"] for r in records] == [1, 2, 3]
    for r, p in zip(records, planned):
        assert {"sagc/group_size", "sagc/lambda", "sagc/straggler_event", "sagc/straggler_rate",
                "sagc/p_hat/2", "sagc/p_hat/4"} <= set(r)
        assert set(p.group_sizes.values()) == {r["sagc/group_size"]}
        assert r["response_length/mean"] > 0
    assert [set(t) for t in trained] == [{r["sagc/group_size"]} for r in records]
    assert all(len(t) == 4 for t in trained)          # every prompt's group, each with the step's K
    assert records[0]["sagc/group_size"] == 4                 # lambda 0 at the start: the larger neighbour
    assert [h["sagc/group_size"] for h in history] == [r["sagc/group_size"] for r in records]
    with open(tmp_path / "run" / "checkpoints" / "step_000003" / "meta.json") as f:
        saved = json.load(f)["group_sizer"]
    assert saved["step"] == 3 and saved["steps_observed"] == 3 and saved["candidates"] == [2, 4]
