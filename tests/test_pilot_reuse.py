"""rollout.pilot.reuse_pilots: in async mode (eta > 0) a surplus passer's pilot rollouts are kept
with the prompt reserve's entry, and a later step commits on them (K - n_pilot new rollouts)
while they are at most eta versions old at the version that step is trained at (step - 1); the
reserve is then served most varied pilot first. Hand-computed cases and a randomised property on
the allocator alone, then one async run of the real trainer.
"""
import random

import pytest

from periodic_async.config.allocation import BackfillConfig, PilotConfig
from periodic_async.scheduling.allocation import COMMIT, PILOT, Allocator, Candidate
from periodic_async.scheduling.prompt_reserve import PilotRecord, PromptReserve


def _alloc(eta, reuse=True, batch_size=2, group_size=4, n_pilot=2, **pilot):
    cfg = PilotConfig(enabled=True, n_pilot=n_pilot, reuse_pilots=reuse, **pilot)
    return Allocator(cfg, BackfillConfig(), batch_size, group_size, num_prompts=1000, max_staleness=eta)


def _draw(keys):
    it = iter(keys)
    return lambda: Candidate(next(it), 0)


def _step(alloc, step, keys, reward, version, group_size=None, order=None):
    """Drive one step: every part's samples were made by policy `version(step, key)`;
    reward(step, key, sample) -> float. Returns (dispatched requests, trained groups, metrics)."""
    rng = random.Random(order)
    pending = list(alloc.begin_step(step, _draw(keys), group_size=group_size))
    dispatched, ready = list(pending), []
    while pending:
        req = pending.pop(rng.randrange(len(pending)) if order is not None else 0)
        assert not req.reused
        out = alloc.on_group(step, req.slot, req.phase, [reward(step, req.key, k) for k in req.sample_indices],
                             version=version(step, req.key))
        pending += out.requests
        dispatched += out.requests
        ready += out.ready
    return dispatched, sorted(ready, key=lambda g: g.slot), alloc.end_step(step)


def _half(step, key, k):
    """Every pilot passes at n_pilot 2 (one success of two): p = 1/2 is in the band [1/8, 3/4]."""
    return 1.0 if k % 2 == 0 else 0.0


def _surplus_step(alloc):
    """Step 1: four candidates all pass, B = 2 are committed, "c" and "d" go to the reserve with
    their pilots (made by version 0)."""
    _, groups, m = _step(alloc, 1, ["a", "b", "c", "d"], _half, lambda s, key: s - 1)
    assert [g.key for g in groups] == ["a", "b"] and m["pilot/replay_added"] == 2
    return groups


def test_a_stored_pilot_within_eta_is_committed_on_at_once():
    alloc = _alloc(eta=1, num_candidates=4, budget=16)
    _surplus_step(alloc)
    assert alloc.replay.record("c") == PilotRecord((1.0, 0.0), 0)
    # step 2 (trained at version 1): its own four pilots fail (deferred), so the fill round takes
    # the reserve; c and d are 1 version old <= eta 1: committed on their stored pilots at once
    fail = lambda step, key, k: 0.0 if step == 2 and key in "efgh" else _half(step, key, k)   # noqa: E731
    dispatched, groups, m = _step(alloc, 2, ["e", "f", "g", "h"], fail, lambda s, key: s - 1)
    commits = [r for r in dispatched if r.phase == COMMIT]
    assert sorted(r.key for r in commits) == ["c", "d"] and all(r.sample_indices == (2, 3) for r in commits)
    assert not any(r.phase == PILOT and r.key in "cd" for r in dispatched)        # not piloted again
    assert m["pilot/reused"] == 2 and m["pilot/replayed"] == 0 and m["pilot/committed"] == 2
    assert m["pilot/rollouts"] == 4 * 2 + 2 * 2                                   # pilots + the commits only
    for g in groups:
        pilot, commit = g.parts
        assert pilot.reused and pilot.sample_indices == (0, 1) and commit.sample_indices == (2, 3)
        assert g.rewards == (1.0, 0.0, 1.0, 0.0)                                  # stored + new, in order
    assert len(alloc.replay) == 0


def test_a_pilot_older_than_eta_is_piloted_again_never_reused():
    fail = lambda step, key, k: 0.0 if key not in "cd" else _half(step, key, k)    # noqa: E731
    alloc = _alloc(eta=1, num_candidates=4, budget=16, replay_max_age=4)
    _surplus_step(alloc)
    # step 3 (no step 2 in between) is trained at version 2: the pilots of version 0 are 2
    # versions old > eta 1, so c and d are piloted again under the current policy
    dispatched, groups, m = _step(alloc, 3, ["e", "f", "g", "h"], fail, lambda s, key: s - 1)
    assert m["pilot/reused"] == 0 and m["pilot/replayed"] == 2
    assert sorted(r.key for r in dispatched if r.phase == PILOT and r.key in "cd") == ["c", "d"]
    assert not any(p.reused for g in groups for p in g.parts)
    # the same at eta 2: reused
    alloc = _alloc(eta=2, num_candidates=4, budget=16, replay_max_age=4)
    _surplus_step(alloc)
    _, _, m = _step(alloc, 3, ["e", "f", "g", "h"], fail, lambda s, key: s - 1)
    assert m["pilot/reused"] == 2


def test_eta_0_or_the_switch_off_decides_as_without_reuse():
    """Strictly on-policy (eta 0) nothing is reused, whatever the switch: every decision and metric
    (but the counter of reuses) equals the run without it."""
    def run(alloc):
        out = []
        for step in range(1, 7):
            keys = [f"{step}-{i}" for i in range(8)]
            reward = lambda s, key, k: float(random.Random(f"{s}{key}{k}").random() < 0.4)   # noqa: E731
            dispatched, groups, m = _step(alloc, step, keys, reward, lambda s, key: s - 1, order=step)
            m.pop("pilot/reused", None)
            out.append(([(r.key, r.phase, r.sample_indices) for r in dispatched], [g.rewards for g in groups], m))
        return out
    reference = run(_alloc(eta=0, reuse=False, num_candidates=4, budget=24))
    assert run(_alloc(eta=0, reuse=True, num_candidates=4, budget=24)) == reference
    assert run(_alloc(eta=2, reuse=False, num_candidates=4, budget=24)) == reference
    assert not _alloc(eta=0).reuses_rollouts and _alloc(eta=1).reuses_rollouts


def test_the_reserve_serves_the_most_varied_pilot_first():
    reserve = PromptReserve(max_age=4)
    reserve.add("low", 0, PilotRecord((1.0, 0.0, 0.0, 0.0), 0))       # std 0.433
    reserve.add("none", 0)                                             # no record: last
    reserve.add("high", 0, PilotRecord((1.0, 1.0, 0.0, 0.0), 0))      # std 0.5
    reserve.add("high2", 0, PilotRecord((0.0, 1.0, 0.0, 1.0), 0))     # std 0.5, added later
    assert reserve.serving_order(1, by_variance=True) == ["high", "high2", "low", "none"]
    assert reserve.serving_order(1) == ["low", "none", "high", "high2"]            # oldest first
    assert reserve.serving_order(0, by_variance=True) == []                        # added at this step
    # records go with their entries, and not into the state dict (the rollouts are not in a checkpoint)
    assert reserve.take(1, 1) == ["low"] and reserve.record("low") is None
    restored = PromptReserve(max_age=4)
    restored.load_state_dict(reserve.state_dict())
    assert restored.entries() == reserve.entries() and restored.record("high") is None


def test_the_fill_round_reuses_by_variance_and_within_the_budget():
    # B 1, K 8, n_pilot 4, budget 16. Step 1 pilots a, b, c (12 rollouts): all pass, a is committed
    # (4), b (1 of 4, std 0.433) and c (2 of 4, std 0.5) go to the reserve in that order. Step 2's
    # three pilots fail (12 rollouts): 4 are left, no room to pilot a reserve entry again (K = 8),
    # room for one commit on a stored pilot: c, the more varied though the younger entry
    succ = {"a": 2, "b": 1, "c": 2}
    reward = lambda step, key, k: 1.0 if k < succ.get(key, 0) else 0.0     # noqa: E731
    alloc = _alloc(eta=1, batch_size=1, group_size=8, n_pilot=4, num_candidates=3, budget=16)
    _step(alloc, 1, ["a", "b", "c"], reward, lambda s, key: 0)
    assert [k for k, _ in alloc.replay.entries()] == ["b", "c"]
    dispatched, groups, m = _step(alloc, 2, ["x", "y", "z"], reward, lambda s, key: 1)
    assert [g.key for g in groups] == ["c"] and m["pilot/reused"] == 1
    assert m["pilot/rollouts"] == 12 + 4 == m["pilot/budget"]
    # without reuse the same step trains nothing: a full K no longer fits
    alloc = _alloc(eta=1, reuse=False, batch_size=1, group_size=8, n_pilot=4, num_candidates=3, budget=16)
    _step(alloc, 1, ["a", "b", "c"], reward, lambda s, key: 0)
    _, groups, m = _step(alloc, 2, ["x", "y", "z"], reward, lambda s, key: 1)
    assert groups == [] and m["pilot/replayed"] == 0


@pytest.mark.parametrize("seed", range(40))
def test_reused_pilots_are_never_older_than_eta_and_the_budget_holds(seed):
    """Random B, K per step (a group sizer may change it), eta, budgets, pilot versions anywhere the
    async schedule allows (batch t dispatched once the workers hold t - 1 - eta) and random arrival:
    every group trained at step t holds only samples within eta of version t - 1, the budget is
    never exceeded, and entries whose n_pilot differs from the step's are not reused."""
    rng = random.Random(seed)
    eta = rng.randint(1, 3)
    b = rng.randint(1, 4)
    alloc = _alloc(eta=eta, batch_size=b, group_size=8, n_pilot=None, num_candidates=rng.randint(b, 2 * b),
                   budget=rng.randint(3, 6) * b * 4 + 16, replay_max_age=rng.randint(0, 5),
                   pass_lower=0.1, pass_upper=1.0, evict_at=None)   # passes with one success
    versions = {}           # key (one step's) -> the version its pilot was made by
    reused = 0
    for step in range(1, 15):
        k = rng.choice([4, 8, 8, 8, 8, 8, 12])          # n_pilot = K // 4: 1, 2 or 3
        keys = [f"{step}-{i}" for i in range(100)]
        def ver(s, key, phase):
            if phase != PILOT:
                return s - 1
            # the newest version half the time, else any the schedule allows
            versions[key] = s - 1 if rng.random() < 0.5 else rng.randint(max(0, s - 1 - eta), s - 1)
            return versions[key]
        reward = lambda s, key, j: float(random.Random(f"{seed}{s}{key}{j}").random() < 0.3)           # noqa: E731
        rng_order = rng.randrange(1 << 30)
        pending = list(alloc.begin_step(step, _draw(keys), group_size=k))
        spent = sum(r.num_samples for r in pending)
        order = random.Random(rng_order)
        while pending:
            req = pending.pop(order.randrange(len(pending)))
            out = alloc.on_group(step, req.slot, req.phase, [reward(step, req.key, j) for j in req.sample_indices],
                                 version=ver(step, req.key, req.phase))
            pending += out.requests
            spent += sum(r.num_samples for r in out.requests)
            for g in out.ready:
                pilot = g.parts[0]
                if pilot.reused:
                    reused += 1
                    assert 0 <= (step - 1) - versions[g.key] <= eta, (step, versions[g.key], eta)
                # the stored pilot's samples are this step's pilot part: K rewards in all
                assert len(g.rewards) == g.group_size == k and pilot.num_samples == max(1, k // 4)
        m = alloc.end_step(step)
        assert spent == m["pilot/rollouts"] <= m["pilot/budget"]
    REUSED[seed] = reused


REUSED: dict = {}


def test_the_property_saw_reuses():
    """(after the property's cases) it tested something: reuses happened in most of its runs"""
    assert len(REUSED) == 40 and sum(n > 0 for n in REUSED.values()) >= 20, REUSED


# ---------------------------------------------------------------------- the planner keeps the rollouts

def _planner(eta, n_records=40):
    from periodic_async.data.dataset import PromptLoader
    from periodic_async.data.records import PromptRecord
    from periodic_async.rollout.base import SamplingParams
    from periodic_async.scheduling.plan import BatchPlanner
    loader = PromptLoader([PromptRecord(f"{i}=", str(i), i) for i in range(n_records)], batch_size=2, shuffle=False)
    alloc = _alloc(eta=eta, num_candidates=4, budget=16)
    return BatchPlanner(loader, lambda rec: [rec.index + 10], SamplingParams(), seed=0, default_n=4, selection=alloc)


def _deliver(plan, req, reward, version):
    """One request's samples, made by policy `version` (response [step, record, sample]) and
    rewarded by reward(step, record, sample), handed to its plan: (more requests, groups ready)."""
    from periodic_async.rollout.base import RolloutResult
    record = req.prompt_ids[0] - 10
    results = [RolloutResult(req.group_index, k, list(req.prompt_ids), [plan.step, record, k], [0.0] * 3, "stop",
                             version) for k in req.samples()]
    part = plan.part_group(req, results)
    part.rewards = [reward(plan.step, record, k) for k in req.samples()]
    return plan.on_scored(req, part)


def _generate_and_train(planner, step, reward, version, plan=None, pending=None):
    """Play the producer for one batch (or the rest of one: `plan`, `pending`); the groups ready
    to train, in release order."""
    if plan is None:
        plan = planner.plan(step)
        pending = list(plan.requests)
    ready = []
    while pending:
        more, groups = _deliver(plan, pending.pop(0), reward, version)
        pending += more
        ready += groups
    ready += plan.finish()
    planner.forget_step(step)
    return [g for g in ready if g.results]


def test_the_planner_trains_the_stored_pilot_rollouts_with_the_new_commit():
    """Step 1 (version 0): records 0-3 all pass, 0 and 1 train, 2 and 3 are kept with their pilot
    rollouts. Step 2 (version 1, eta 1): its own pilots (4-7) fail; 2 and 3 are committed on the
    stored rollouts: each group trained holds step 1's two pilot responses (version 0) and step
    2's two commit responses, in sample order, and the planner's store is empty after."""
    planner = _planner(eta=1)
    fail_late = lambda step, record, k: 0.0 if record >= 4 else _half(step, record, k)   # noqa: E731
    first = _generate_and_train(planner, 1, fail_late, version=0)
    assert sorted(g.results[0].response_ids[1] for g in first) == [0, 1]
    assert sorted(planner._pilot_store) == [2, 3]
    second = _generate_and_train(planner, 2, fail_late, version=1)
    assert sorted(g.results[0].response_ids[1] for g in second) == [2, 3]
    for g in second:
        record = g.results[0].response_ids[1]
        assert [r.response_ids for r in g.results] == [[1, record, 0], [1, record, 1], [2, record, 2], [2, record, 3]]
        assert g.policy_versions == [0, 0, 1, 1] and g.rewards == [1.0, 0.0, 1.0, 0.0]
        assert [r.sample_index for r in g.results] == [0, 1, 2, 3]
    assert planner._pilot_store == {}


def test_the_planner_drops_stored_rollouts_the_rule_will_not_reuse():
    """At eta 0 nothing is kept; at eta 1 the entries expire after replay_max_age (4) steps and
    their rollouts leave the store with them."""
    planner = _planner(eta=0)
    _generate_and_train(planner, 1, _half, version=0)
    assert planner._pilot_store == {} and len(planner.selection.replay) == 2       # keys only
    planner = _planner(eta=1)
    _generate_and_train(planner, 1, _half, version=0)
    assert sorted(planner._pilot_store) == [2, 3]
    for step in range(2, 8):        # every later step fills B from its own pilots: the reserve only ages
        _generate_and_train(planner, step, _half, version=step - 1)
    assert 2 not in planner._pilot_store and 3 not in planner._pilot_store
    assert set(planner._pilot_store) == {k for k, _ in planner.selection.replay.entries()}


def test_a_step_that_ends_while_another_waits_for_its_reused_commit_keeps_the_rollouts():
    """Steps overlap in async: step 2 commits on a stored pilot (the entry leaves the reserve),
    step 3 ends before step 2's commit is in - its end must not drop the rollouts step 2 trains."""
    planner = _planner(eta=2)
    fail_late = lambda step, record, k: 0.0 if record >= 4 else _half(step, record, k)   # noqa: E731
    _generate_and_train(planner, 1, fail_late, version=0)
    plan2 = planner.plan(2)
    pending, commits = list(plan2.requests), []
    while pending:                                      # step 2's pilots, not its commits
        more, _ = _deliver(plan2, pending.pop(0), fail_late, 1)
        commits += more
    assert len(commits) == 2 and len(planner.selection.replay) == 0
    _generate_and_train(planner, 3, _half, version=1)   # step 3 ends first
    second = _generate_and_train(planner, 2, fail_late, 1, plan=plan2, pending=commits)
    assert sorted(g.results[0].response_ids[1] for g in second) == [2, 3]
    assert [r.policy_version for g in second for r in g.results] == [0, 0, 1, 1] * 2


def test_async_training_with_reuse_keeps_the_bound(tmp_path):
    """The real trainer in async (eta 4, 10 steps, long_tail): with reuse_pilots on, every trained
    group is within eta (the trainer refuses any other: staleness.py) and whole. Whether a step
    reuses depends on timing (an entry must be in the reserve before a later step's fill round and
    its pilot still within eta: runs here reused 1-2 pilots in 10 steps); the decisions themselves
    are tested above, deterministically."""
    from periodic_async.config import load_config
    from periodic_async.train.trainer import Trainer
    from test_allocation_training import BASE, SWITCHES
    cfg = load_config("configs/long_tail.yaml", [
        f"trainer.run_dir={tmp_path}", "trainer.total_steps=10", *BASE, *SWITCHES["pilot"],
        "trainer.mode=async", "trainer.max_staleness=4", "rollout.num_workers=2",
        "rollout.pilot.reuse_pilots=true", "rollout.pilot.budget=64"])
    history = Trainer(cfg).fit()
    assert len(history) == 10 and all("pilot/reused" in h for h in history)
    assert max(h["training/off_policy/trajectory_staleness/max"] for h in history) <= 4
    assert all(h["alloc/trainable_groups"] == h["pilot/committed"] for h in history)


@pytest.mark.parametrize("overrides, error", [
    (["trainer.mode=periodic"], "needs trainer.mode async with trainer.max_staleness > 0"),
    (["trainer.mode=async", "trainer.max_staleness=0"], "got trainer.mode async, max_staleness 0"),
    (["trainer.mode=async", "trainer.max_staleness=1", "rollout.pilot.fill_from=loader"], "fill_from is 'loader'"),
])
def test_reuse_is_refused_where_no_stored_pilot_could_be_trained(overrides, error, tmp_path):
    from periodic_async.config import ConfigError, load_config
    from periodic_async.config.validation import validate
    cfg = load_config("configs/long_tail.yaml", [f"trainer.run_dir={tmp_path}", "rollout.selection=pilot",
                                                 "rollout.pilot.reuse_pilots=true", *overrides])
    with pytest.raises(ConfigError, match=error):
        validate(cfg)
