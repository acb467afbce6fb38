"""Pilot-commit allocation, in-batch backfill and the prompt reserve, without models or torch.

A tiny driver plays the producer: it dispatches the allocator's requests, delivers each one's
rewards in an order chosen by a seeded RNG, and dispatches whatever on_group asks for next.
Rewards are a function of (step, key, sample index), so a result never depends on arrival order.
"""
import json
import random
from fractions import Fraction

import pytest

from periodic_async.data.dataset import PromptLoader
from periodic_async.data.records import PromptRecord
from periodic_async.config.allocation import (BackfillConfig, PilotConfig, Thresholds, threshold_fraction,
                                              validate_allocation)
from periodic_async.scheduling.allocation import COMMIT, FULL, PILOT, Allocator, Candidate, group_parts
from periodic_async.scheduling.prompt_reserve import PromptReserve
from allocation_trace import scenario


def _records(n):
    return [PromptRecord(f"{i}=", str(i), i) for i in range(n)]


def draw_from_loader(loader, key=lambda record: record.index):
    """A `draw` over a PromptLoader: its next record, tagged with the epoch it came from (read
    before the draw: the loader moves to the next epoch after an epoch's last record)."""
    def draw() -> Candidate:
        epoch = loader.epoch
        (record,) = loader.next_batch(1)
        return Candidate(key(record), epoch)
    return draw


def _draw_list(keys, epoch=0):
    it = iter(keys)
    return lambda: (Candidate(next(it), epoch))


def _run_step(alloc, step, draw, reward, order_seed=None):
    """Drive one step; returns (every request dispatched, groups trained, metrics).
    reward(step, key, sample_index) -> float. order_seed None: first in, first out."""
    rng = random.Random(order_seed)
    pending = list(alloc.begin_step(step, draw))
    dispatched = list(pending)
    ready = []
    done = not pending
    while pending:
        req = pending.pop(rng.randrange(len(pending)) if order_seed is not None else 0)
        out = alloc.on_group(step, req.slot, req.phase, [reward(step, req.key, k) for k in req.sample_indices])
        pending += out.requests
        dispatched += out.requests
        ready += out.ready
        done = out.done
    assert done and alloc.outstanding == 0
    metrics = alloc.end_step(step)
    assert metrics.get("alloc/trainable_groups", len(ready)) == len(ready)
    return dispatched, sorted(ready, key=lambda g: g.slot), metrics


def _pilot(n_pilot=2, p_lower=0.0, p_upper=1.0, **kw):
    """The first version's rule (PilotConfig.v0: deferred at p <= p_lower, evicted at once at p >=
    p_upper, passed strictly between, fills from the reserve), whose decisions these hand-computed
    cases spell out; the official rule's are tests/test_pilot_official.py's."""
    return PilotConfig.v0(n_pilot=n_pilot, p_lower=p_lower, p_upper=p_upper, **kw)


# ---------------------------------------------------------------- switches off: the identity

def test_every_switch_off_is_the_identity():
    alloc = Allocator(PilotConfig(), BackfillConfig(), batch_size=3, group_size=4, num_prompts=10)
    requests = alloc.begin_step(0, _draw_list([7, 2, 9, 5]))
    assert [(r.slot, r.key, r.phase, r.group_size, r.sample_indices) for r in requests] == [
        (0, 7, FULL, 4, (0, 1, 2, 3)), (1, 2, FULL, 4, (0, 1, 2, 3)), (2, 9, FULL, 4, (0, 1, 2, 3))]
    zero_variance = alloc.on_group(0, 1, FULL, [0.0, 0.0, 0.0, 0.0])
    assert zero_variance.requests == [] and [g.slot for g in zero_variance.ready] == [1]
    middle = alloc.on_group(0, 2, FULL, [1.0, 0.0, 1.0, 1.0])
    last = alloc.on_group(0, 0, FULL, [0.5, 0.5, 0.0, 1.0])
    assert last.done and last.requests == []
    groups = sorted(zero_variance.ready + middle.ready + last.ready, key=lambda g: g.slot)
    assert [(g.slot, g.key, g.group_size, g.rewards) for g in groups] == [
        (0, 7, 4, (0.5, 0.5, 0.0, 1.0)), (1, 2, 4, (0.0, 0.0, 0.0, 0.0)), (2, 9, 4, (1.0, 0.0, 1.0, 1.0))]
    assert all(len(g.parts) == 1 and g.parts[0].phase == FULL for g in groups)
    assert alloc.end_step(0) == {}


def test_group_parts_say_which_phases_form_a_group():
    assert group_parts(5) == [(FULL, (0, 1, 2, 3, 4))]
    assert group_parts(5, 2) == [(PILOT, (0, 1)), (COMMIT, (2, 3, 4))]
    with pytest.raises(ValueError):
        group_parts(3, 3)


# ---------------------------------------------------------------- thresholds

def test_threshold_boundaries_are_exact_thirds():
    third, two_thirds = threshold_fraction(1 / 3), threshold_fraction(2 / 3)
    assert third == Fraction(1, 3) and two_thirds == Fraction(2, 3)
    assert threshold_fraction("1/3") == Fraction(1, 3) and threshold_fraction(0.25) == Fraction(1, 4)
    # the band is inclusive: n_pilot = 3, p = 1/3 and 2/3 both on a bound, both pass
    band = Thresholds(third, two_thirds, None)
    assert [band.passes(s, 3) for s in range(4)] == [False, True, True, False]
    assert [band.passes(s, 6) for s in range(7)] == [False, False, True, True, True, False, False]
    # eviction is inclusive too, and independent of the band
    assert [Thresholds(third, two_thirds, two_thirds).evicts(s, 3) for s in range(4)] == [False, False, True, True]
    assert not any(Thresholds(third, two_thirds, None).evicts(s, 3) for s in range(4))
    # a float comparison would get p == 1/3 wrong: 1/3 as a Fraction of the float is below one third
    assert Fraction(1, 3) > Fraction(1 / 3)
    # v0's strict (p_lower, p_upper) on thirds leaves no count between: refused, not silently empty
    with pytest.raises(ValueError, match="no success count s of n_pilot=3"):
        _pilot(n_pilot=3, p_lower=1 / 3, p_upper=2 / 3).validate(batch_size=4, group_size=6)


@pytest.mark.parametrize("p_lower, p_upper, expected", [
    (1 / 3, 1.0, {0: "deferred", 1: "deferred", 2: "committed", 3: "solved"}),
    (0.0, 2 / 3, {0: "deferred", 1: "committed", 2: "solved", 3: "solved"}),
])
def test_allocator_applies_inclusive_bounds_with_n_pilot_3(p_lower, p_upper, expected):
    # prompt s succeeds on exactly s of its 3 pilot samples
    alloc = Allocator(_pilot(n_pilot=3, p_lower=p_lower, p_upper=p_upper), BackfillConfig(),
                      batch_size=4, group_size=5, num_prompts=4)
    dispatched, groups, metrics = _run_step(alloc, 0, _draw_list([0, 1, 2, 3]),
                                            lambda step, key, k: 1.0 if k < key else 0.0)
    committed = {r.key for r in dispatched if r.phase == COMMIT}
    outcome = {key: ("committed" if key in committed else "solved" if key in alloc.solved
                     else "deferred" if key in alloc.deferred else "?") for key in range(4)}
    assert outcome == expected
    n_solved = sum(v == "solved" for v in expected.values())
    assert metrics["pilot/solved_dropped"] == n_solved and metrics["pilot/deferred"] == 4 - 1 - n_solved
    assert metrics["pilot/selected_ratio"] == 0.25
    (group,) = groups
    assert group.group_size == 5 and [p.sample_indices for p in group.parts] == [(0, 1, 2), (3, 4)]


# ---------------------------------------------------------------- commit order and replay

def test_commits_go_to_the_first_passers_in_slot_order_whatever_the_arrival():
    # B=2, four candidates all pass; budget 4*2 pilots + 2*2 commits = 12
    alloc = Allocator(_pilot(n_pilot=2, budget=12, num_candidates=4), BackfillConfig(),
                      batch_size=2, group_size=4, num_prompts=10)
    alloc.begin_step(0, _draw_list(["a", "b", "c", "d"]))
    passing = [1.0, 0.0]
    assert alloc.on_group(0, 3, PILOT, passing).requests == []     # rank unknown: slots 0..2 pending
    assert alloc.on_group(0, 2, PILOT, passing).requests == []
    out = alloc.on_group(0, 1, PILOT, passing)                      # at most slot 0 passes before it
    assert [(r.slot, r.phase, r.sample_indices) for r in out.requests] == [(1, COMMIT, (2, 3))]
    out = alloc.on_group(0, 0, PILOT, passing)                      # slots 2 and 3 are now surplus
    assert [(r.slot, r.phase) for r in out.requests] == [(0, COMMIT)]
    assert alloc.replay.entries() == [("c", 0), ("d", 0)]
    alloc.on_group(0, 0, COMMIT, [1.0, 1.0])
    last = alloc.on_group(0, 1, COMMIT, [0.0, 1.0])
    assert last.done and [(g.slot, g.rewards) for g in last.ready] == [(1, (1.0, 0.0, 0.0, 1.0))]
    metrics = alloc.end_step(0)
    assert metrics["pilot/rollouts"] == 12 and metrics["pilot/replay_added"] == 2
    assert metrics["pilot/selected_ratio"] == 0.5 and metrics["pilot/replay_size"] == 2


def test_replay_fills_a_later_step_with_a_fresh_pilot_and_expires_old_entries():
    # B=1, K=4, n_pilot=2, 3 candidates, budget 12, replay_max_age=1
    alloc = Allocator(_pilot(n_pilot=2, budget=12, num_candidates=3, replay_max_age=1), BackfillConfig(),
                      batch_size=1, group_size=4, num_prompts=100)
    mixed = lambda step, key, k: float(k % 2 == 0)                   # noqa: E731 - pilot 1 of 2: passes
    _, groups, m0 = _run_step(alloc, 0, _draw_list([10, 11, 12]), mixed)
    assert [g.key for g in groups] == [10] and alloc.replay.entries() == [(11, 0), (12, 0)]
    assert m0["pilot/rollouts"] == 3 * 2 + 2
    # step 1: every candidate fails (deferred); 12 - 6 = 6 rollouts left fit one fill of K=4
    fails_new = lambda step, key, k: 0.0 if key >= 20 else float(k % 2 == 0)   # noqa: E731
    dispatched, groups, m1 = _run_step(alloc, 1, _draw_list([20, 21, 22]), fails_new)
    assert [(r.slot, r.key, r.phase) for r in dispatched[3:]] == [(3, 11, PILOT), (3, 11, COMMIT)]
    assert [(g.slot, g.key) for g in groups] == [(3, 11)]
    assert m1["pilot/replayed"] == 1 and m1["pilot/deferred"] == 3 and m1["pilot/rollouts"] == 10
    assert m1["pilot/selected_ratio"] == 0.25 and alloc.replay.entries() == [(12, 0)]
    # step 2: key 12 is two steps old, past replay_max_age=1: discarded and counted, never piloted
    dispatched, groups, m2 = _run_step(alloc, 2, _draw_list([30, 31, 32]), lambda s, key, k: 0.0)
    assert m2["pilot/replay_expired"] == 1 and m2["pilot/replay_size"] == 0 and m2["pilot/replayed"] == 0
    assert groups == [] and 12 not in {r.key for r in dispatched}
    assert alloc.totals["pilot/replay_expired"] == 1


def test_a_replayed_key_drawn_again_by_the_loader_leaves_the_buffer():
    # B=1, K=3, n_pilot=2, 2 candidates, budget 2*2 + 1: one commit per step, the other passer is surplus
    alloc = Allocator(_pilot(n_pilot=2, budget=5, num_candidates=2), BackfillConfig(), batch_size=1,
                      group_size=3, num_prompts=10)
    passes = lambda step, key, k: float(k == 0)                      # noqa: E731
    _run_step(alloc, 0, _draw_list(["a", "b"]), passes)
    assert alloc.replay.entries() == [("b", 0)]
    dispatched, groups, metrics = _run_step(alloc, 1, _draw_list(["b", "c"]), passes)
    assert [(r.slot, r.key, r.phase) for r in dispatched] == [(0, "b", PILOT), (1, "c", PILOT), (0, "b", COMMIT)]
    assert [g.key for g in groups] == ["b"] and alloc.replay.entries() == [("c", 1)]
    assert metrics["pilot/replayed"] == 0 and metrics["pilot/rollouts"] == 5


def test_prompt_reserve_age_order_and_state():
    buf = PromptReserve(max_age=2)
    buf.add("a", 3)
    buf.add("b", 4)
    buf.add("a", 5)                                  # re-added: refreshed and moved to the back
    assert buf.entries() == [("b", 4), ("a", 5)]
    assert buf.take(5, 5) == ["b"]                   # "a" was added at step 5 itself: it waits
    buf.add("c", 5)
    assert buf.expire(7) == 0 and len(buf) == 2      # age 2 == max_age: kept
    assert buf.expire(8) == 2 and len(buf) == 0      # age 3 > max_age: gone
    buf.add((1, "x"), 9)
    restored = PromptReserve(max_age=2)
    restored.load_state_dict(json.loads(json.dumps(buf.state_dict())))
    assert restored.entries() == [((1, "x"), 9)]


# ---------------------------------------------------------------- solved and deferred prompts

def test_solved_prompts_are_never_resampled():
    # prompts 0 and 3 are always solved; the others pass; loader without shuffling, B=2, 6 prompts
    loader = PromptLoader(_records(6), batch_size=2, shuffle=False)
    alloc = Allocator(_pilot(n_pilot=2), BackfillConfig(), batch_size=2, group_size=4, num_prompts=6)
    reward = lambda step, key, k: 1.0 if key in (0, 3) or k == 0 else 0.0   # noqa: E731
    piloted = []
    for step in range(8):
        dispatched, _, metrics = _run_step(alloc, step, draw_from_loader(loader), reward, order_seed=step)
        piloted.append(sorted(r.key for r in dispatched if r.phase == PILOT))
    assert alloc.solved == {0, 3}
    # step 0 pilots 0,1 (0 solved), step 1: 2,3 (3 solved), then only 1, 2, 4, 5 ever again
    assert piloted[:3] == [[0, 1], [2, 3], [4, 5]]
    assert all(0 not in keys and 3 not in keys for keys in piloted[2:])
    assert alloc.totals["pilot/solved_dropped"] == 2


def test_deferred_prompt_comes_back_in_the_next_epoch():
    # 4 prompts, B=2, no shuffling: epoch 0 is steps 0-1, epoch 1 steps 2-3
    loader = PromptLoader(_records(4), batch_size=2, shuffle=False)
    alloc = Allocator(_pilot(n_pilot=2), BackfillConfig(), batch_size=2, group_size=4, num_prompts=4)
    reward = lambda step, key, k: 0.0 if (key == 3 and step < 2) else float(k == 0)   # noqa: E731
    piloted, committed = [], []
    for step in range(4):
        dispatched, groups, metrics = _run_step(alloc, step, draw_from_loader(loader), reward)
        piloted.append([r.key for r in dispatched if r.phase == PILOT])
        committed.append([g.key for g in groups])
        if step == 1:
            assert alloc.deferred == {3: 0} and metrics["pilot/deferred"] == 1
        if step == 3:
            assert metrics["pilot/readmitted"] == 1 and alloc.deferred == {}
    assert piloted == [[0, 1], [2, 3], [0, 1], [2, 3]]
    assert committed == [[0, 1], [2], [0, 1], [2, 3]]


def test_deferred_prompt_is_refused_while_the_loader_is_in_its_epoch():
    alloc = Allocator(_pilot(n_pilot=2, num_candidates=1), BackfillConfig(), batch_size=1, group_size=3,
                      num_prompts=5)
    _run_step(alloc, 0, _draw_list(["q"], epoch=4), lambda s, key, k: 0.0)
    assert alloc.deferred == {"q": 4}
    draws = iter([Candidate("q", 4), Candidate("r", 4), Candidate("q", 5)])
    dispatched, _, _ = _run_step(alloc, 1, lambda: next(draws), lambda s, key, k: 0.0)
    assert [r.key for r in dispatched] == ["r"]
    assert not alloc.admits(Candidate("q", 4)) and alloc.admits(Candidate("q", 5))


def test_draws_stop_when_every_prompt_is_solved():
    loader = PromptLoader(_records(3), batch_size=2, shuffle=False)
    alloc = Allocator(_pilot(n_pilot=2), BackfillConfig(), batch_size=2, group_size=3, num_prompts=3)
    _run_step(alloc, 0, draw_from_loader(loader), lambda s, key, k: 1.0)
    _run_step(alloc, 1, draw_from_loader(loader), lambda s, key, k: 1.0)    # 2, refuses 0 and 1, 2 again
    assert alloc.solved == {0, 1, 2}
    dispatched, groups, metrics = _run_step(alloc, 2, draw_from_loader(loader), lambda s, key, k: 1.0)
    assert dispatched == [] and groups == [] and metrics["pilot/piloted"] == 0


# ---------------------------------------------------------------- the budget

def test_budget_is_never_exceeded_and_decisions_ignore_arrival_order():
    for seed in range(150):
        sc = scenario(seed)     # the recorded trace's random settings (tests/allocation_trace.py)
        batch, k, budget = sc["batch"], sc["k"], sc["budget"]
        cfg = _pilot(n_pilot=sc["n_pilot"], p_lower=sc["p_lower"], p_upper=sc["p_upper"], budget=budget,
                     num_candidates=sc["num_candidates"], replay_max_age=sc["replay_max_age"],
                     success_threshold=sc["success_threshold"])
        success_rate, salt = sc["success_rate"], sc["salt"]

        def reward(step, key, sample, salt=salt, success_rate=success_rate):
            u = random.Random(hash((salt, step, key, sample)) & 0xFFFFFFFF).random()
            return rng_choice_reward(u, success_rate[key])

        runs = []
        for order in (None, seed + 1000):
            loader = PromptLoader(_records(12), batch_size=batch, seed=seed)
            alloc = Allocator(cfg, BackfillConfig(), batch_size=batch, group_size=k, num_prompts=12)
            trace = []
            solved_before = set()
            for step in range(6):
                dispatched, groups, metrics = _run_step(alloc, step, draw_from_loader(loader), reward, order)
                spent = sum(r.num_samples for r in dispatched)
                assert spent <= budget and spent == metrics["pilot/rollouts"], (seed, step)
                assert len(groups) <= batch
                assert not solved_before & {r.key for r in dispatched}, (seed, step)
                for g in groups:
                    assert len(g.rewards) == k
                    assert sorted(i for p in g.parts for i in p.sample_indices) == list(range(k))
                solved_before = set(alloc.solved)
                trace.append((sorted((r.slot, r.key, r.phase, r.sample_indices) for r in dispatched),
                              [(g.slot, g.key, g.rewards) for g in groups], metrics))
            runs.append((trace, alloc.state_dict()))
        assert runs[0] == runs[1], seed


def rng_choice_reward(u, rate):
    """0.0 / 0.75 / 1.0: a success under threshold 0.5 for the upper two, under 1.0 only for 1.0."""
    if u >= rate:
        return 0.0
    return 1.0 if u < rate / 2 else 0.75


# ---------------------------------------------------------------- backfill

def test_backfill_replaces_zero_variance_groups_up_to_its_cap():
    # B=3, K=2, max_groups=2; keys 0, 1, 3 give equal rewards, 2 and 4 do not
    flat = {0, 1, 3}
    reward = lambda step, key, k: 1.0 if key in flat else float(k)    # noqa: E731
    for order in (None, 1, 2, 3):
        alloc = Allocator(PilotConfig(), BackfillConfig(enabled=True, max_groups=2), batch_size=3, group_size=2,
                          num_prompts=10)
        dispatched, groups, metrics = _run_step(alloc, 0, _draw_list(range(10)), reward, order)
        # slots 0, 1 dropped -> backfills slot 3 (key 3: flat, cap now spent) and slot 4 (key 4)
        assert sorted((r.slot, r.key) for r in dispatched) == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4)]
        assert [(g.slot, g.key) for g in groups] == [(2, 2), (4, 4)]
        assert metrics == {"rollout/backfilled": 2.0, "rollout/zero_variance_groups": 3.0,
                           "rollout/backfill_unreplaced": 1.0, "rollout/rollouts": 10.0,
                           "alloc/trainable_groups": 2.0}


def test_backfill_with_a_zero_cap_only_filters():
    alloc = Allocator(PilotConfig(), BackfillConfig(enabled=True, max_groups=0), batch_size=2, group_size=3,
                      num_prompts=4)
    dispatched, groups, metrics = _run_step(alloc, 0, _draw_list([0, 1, 2]),
                                            lambda s, key, k: 0.0 if key == 0 else float(k == 1))
    assert len(dispatched) == 2 and [g.key for g in groups] == [1]
    assert metrics["rollout/backfilled"] == 0 and metrics["rollout/backfill_unreplaced"] == 1


# ---------------------------------------------------------------- resume and duplicates

def test_state_dict_round_trip_gives_the_same_later_decisions():
    cfg = _pilot(n_pilot=2, p_lower=0.0, p_upper=1.0, budget=20, num_candidates=4, replay_max_age=2)
    reward = lambda step, key, k: float((step + k + len(key)) % 3 == 0)   # noqa: E731

    def make():
        loader = PromptLoader([PromptRecord(f"{i}=", str(i), i) for i in range(15)], batch_size=2, seed=3)
        return loader, Allocator(cfg, BackfillConfig(), batch_size=2, group_size=5, num_prompts=15)

    def key(record):
        return f"p{record.index}" + "x" * (record.index % 4)

    loader, alloc = make()
    for step in range(3):
        _run_step(alloc, step, draw_from_loader(loader, key), reward, order_seed=step)
    saved = json.loads(json.dumps({"alloc": alloc.state_dict(), "loader": loader.state_dict()}))
    assert saved["alloc"]["solved"] or saved["alloc"]["deferred"] or saved["alloc"]["replay"]["entries"]
    expected = [_run_step(alloc, step, draw_from_loader(loader, key), reward, order_seed=step)
                for step in range(3, 8)]
    loader2, alloc2 = make()
    loader2.load_state_dict(saved["loader"])
    alloc2.load_state_dict(saved["alloc"])
    resumed = [_run_step(alloc2, step, draw_from_loader(loader2, key), reward, order_seed=step + 50)
               for step in range(3, 8)]
    assert [(sorted(d, key=lambda r: (r.slot, r.phase)), g, m) for d, g, m in resumed] == \
           [(sorted(d, key=lambda r: (r.slot, r.phase)), g, m) for d, g, m in expected]
    assert alloc2.state_dict() == alloc.state_dict()
    alloc2.begin_step(8, draw_from_loader(loader2, key))
    with pytest.raises(RuntimeError, match="in progress"):
        alloc2.load_state_dict(saved["alloc"])


def test_duplicate_delivery_is_ignored_and_a_conflicting_one_raises():
    alloc = Allocator(_pilot(n_pilot=2), BackfillConfig(), batch_size=2, group_size=4, num_prompts=4)
    alloc.begin_step(0, _draw_list([0, 1]))
    first = alloc.on_group(0, 0, PILOT, [1.0, 0.0])
    assert [(r.slot, r.phase) for r in first.requests] == [(0, COMMIT)]
    again = alloc.on_group(0, 0, PILOT, [1.0, 0.0])
    assert again.requests == [] and again.ready == [] and not again.done
    with pytest.raises(RuntimeError, match="twice with different rewards"):
        alloc.on_group(0, 0, PILOT, [0.0, 1.0])
    with pytest.raises(RuntimeError, match="never requested phase 'commit' of slot 1"):
        alloc.on_group(0, 1, COMMIT, [1.0, 0.0])
    with pytest.raises(RuntimeError, match="1 rewards for 2 requested samples"):
        alloc.on_group(0, 1, PILOT, [1.0])
    with pytest.raises(RuntimeError, match="arrived, but the steps in progress are 0"):
        alloc.on_group(1, 1, PILOT, [1.0, 0.0])
    with pytest.raises(RuntimeError, match="still outstanding"):
        alloc.end_step(0)
    alloc.on_group(0, 1, PILOT, [1.0, 1.0])
    done = alloc.on_group(0, 0, COMMIT, [0.0, 0.0])
    assert done.done and [g.slot for g in done.ready] == [0]
    assert alloc.on_group(0, 0, COMMIT, [0.0, 0.0]).ready == []       # the group is not handed over twice
    metrics = alloc.end_step(0)
    assert metrics["alloc/duplicates"] == 2 and metrics["alloc/trainable_groups"] == 1
    with pytest.raises(RuntimeError, match="steps in progress are none"):
        alloc.on_group(0, 0, COMMIT, [0.0, 0.0])


# ---------------------------------------------------------------- configuration

@pytest.mark.parametrize("pilot, backfill, message", [
    (_pilot(p_lower=0.8, p_upper=0.5), BackfillConfig(), "rollout.pilot.pass_lower / pass_upper: no success count"),
    (_pilot(n_pilot=4), BackfillConfig(), r"rollout.pilot.n_pilot must be in \[1, rollout.n - 1\]"),
    (_pilot(p_upper=1.5), BackfillConfig(), r"rollout.pilot.evict_at must be in \[0, 1\]"),
    (PilotConfig(enabled=True, pass_upper=1.5), BackfillConfig(), r"rollout.pilot.pass_upper must be in \[0, 1\]"),
    (_pilot(budget=9, num_candidates=4), BackfillConfig(), "rollout.pilot.budget: 9 rollouts do not cover"),
    (_pilot(replay_max_age=-1), BackfillConfig(), "rollout.pilot.replay_max_age"),
    (PilotConfig(enabled=True, pass_lower="a"), BackfillConfig(), "rollout.pilot.pass_lower must be a finite number"),
    (PilotConfig(enabled=True, n_pilot=2, evict_from="later"), BackfillConfig(), "rollout.pilot.evict_from must be one of"),
    (PilotConfig(enabled=True, n_pilot=2, fill_from="x"), BackfillConfig(), "rollout.pilot.fill_from must be one of"),
    (PilotConfig(enabled=True, p_upper=0.9), BackfillConfig(), "rollout.pilot.p_upper: replaced by pass_lower"),
    # n_pilot unset: K // 4 = 1 at K = 4, and no count of 1 lies in [1/8, 3/4]
    (PilotConfig(enabled=True), BackfillConfig(), r"no success count s of n_pilot=1 \(n_pilot unset: K // 4\)"),
    (PilotConfig(), BackfillConfig(enabled=True, max_groups=-1), "rollout.backfill.max_groups"),
    (_pilot(), BackfillConfig(enabled=True), "rollout.backfill: cannot be combined with the pilot"),
])
def test_validation_names_the_key(pilot, backfill, message):
    with pytest.raises(ValueError, match=message):
        validate_allocation(pilot, backfill, batch_size=4, group_size=4)


def test_disabled_sections_are_not_checked():
    validate_allocation(PilotConfig(n_pilot=9, pass_lower=1.0, pass_upper=0.0, p_upper=0.5),
                        BackfillConfig(max_groups=-1),
                        batch_size=4, group_size=2)
