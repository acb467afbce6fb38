"""Pilot-commit with the official code's rule (databricks/pilot-commit recipe/pc): the inclusive
pass band [pass_lower, pass_upper] apart from eviction (evict_at, from the next epoch on),
n_pilot = K // 4 when unset, and fill rounds that pilot fresh prompts within the step's budget.
Hand-computed decisions through the allocator's public API; the v0 rule's are test_allocation.py's
and test_allocation_v0.py's."""
import random

import pytest

from periodic_async.config.allocation import BackfillConfig, PilotConfig
from periodic_async.data.dataset import PromptLoader
from periodic_async.data.records import PromptRecord
from periodic_async.scheduling.allocation import COMMIT, PILOT, Allocator, Candidate

from test_allocation import _run_step, draw_from_loader


def _official(**kw):
    return PilotConfig(enabled=True, **kw)


def _draws(pairs):
    """A draw over explicit (key, loader epoch) pairs; None once they are spent."""
    it = iter(pairs)
    return lambda: (lambda got: None if got is None else Candidate(*got))(next(it, None))


def _draw_list(keys, epoch=0):
    return _draws([(k, epoch) for k in keys])


# ---------------------------------------------------------------- the band and eviction at their bounds

def test_band_bounds_are_inclusive_and_eviction_is_separate():
    # n_pilot 8, K 16: prompt s succeeds on exactly s of its 8 pilots; band [1/8, 3/4], evict at 1
    alloc = Allocator(_official(n_pilot=8), BackfillConfig(), batch_size=9, group_size=16, num_prompts=9)
    dispatched, groups, metrics = _run_step(alloc, 0, _draw_list(range(9)), lambda step, key, i: float(i < key))
    committed = sorted(r.key for r in dispatched if r.phase == COMMIT)
    # s = 1 (1/8) and s = 6 (3/4) sit on the bounds and pass; s = 0 below, s = 7 above the band
    assert committed == [1, 2, 3, 4, 5, 6]
    assert sorted(alloc.deferred) == [0, 7, 8]        # s = 8 evicted, and deferred for the rest of its epoch
    assert alloc.solved == {8}
    assert metrics["pilot/deferred"] == 2 and metrics["pilot/solved_dropped"] == 1
    assert metrics["pilot/committed"] == 6 and len(groups) == 6


def test_a_band_reaching_evict_at_trains_the_prompt_and_evicts_it_after():
    alloc = Allocator(_official(n_pilot=2, pass_upper=1.0), BackfillConfig(), batch_size=2, group_size=4,
                      num_prompts=4)
    dispatched, groups, _ = _run_step(alloc, 0, _draw_list(["easy", "mid"]),
                                      lambda step, key, i: 1.0 if key == "easy" or i == 0 else 0.0)
    assert sorted(g.key for g in groups) == ["easy", "mid"]
    assert alloc.solved == {"easy"} and "easy" not in alloc.deferred


@pytest.mark.parametrize("evict_from, admitted_in_epoch_0", [("next_epoch", True), ("now", False)])
def test_eviction_only_from_the_next_epoch(evict_from, admitted_in_epoch_0):
    cfg = _official(n_pilot=2, pass_upper=1.0, evict_from=evict_from, fill_from="reserve")
    alloc = Allocator(cfg, BackfillConfig(), batch_size=1, group_size=4, num_prompts=3)
    always = lambda step, key, i: 1.0     # noqa: E731  every pilot succeeds: passes (band to 1) and is evicted
    _run_step(alloc, 0, _draws([("a", 0)]), always)
    assert alloc.solved == {"a"}
    # drawn again in the same loader epoch (a step drawing more than the dataset): the official
    # code applies exclusions when the next epoch starts, so it is still admitted
    assert alloc.admits(Candidate("a", 0)) is admitted_in_epoch_0
    d, _, _ = _run_step(alloc, 1, _draws([("a", 0), ("b", 0)]), always)
    assert [r.key for r in d if r.phase == PILOT] == (["a"] if admitted_in_epoch_0 else ["b"])
    # from the next epoch on it is refused in either setting, and stays refused
    assert not alloc.admits(Candidate("a", 1)) and not alloc.admits(Candidate("a", 5))
    d, _, _ = _run_step(alloc, 2, _draws([("a", 1), ("c", 1)]), always)
    assert [r.key for r in d if r.phase == PILOT] == ["c"]


def test_evicted_epochs_survive_a_checkpoint_and_an_old_checkpoint_keeps_its_keys_refused():
    cfg = _official(n_pilot=2, pass_upper=1.0)
    alloc = Allocator(cfg, BackfillConfig(), batch_size=1, group_size=4, num_prompts=3)
    _run_step(alloc, 0, _draws([("a", 3)]), lambda step, key, i: 1.0)
    state = alloc.state_dict()
    assert state["solved"] == ["a"] and state["solved_epochs"] == [3]
    again = Allocator(cfg, BackfillConfig(), batch_size=1, group_size=4, num_prompts=3)
    again.load_state_dict(state)
    assert again.admits(Candidate("a", 3)) and not again.admits(Candidate("a", 4))
    del state["solved_epochs"]          # written before evict_from existed: evicted at once
    old = Allocator(cfg, BackfillConfig(), batch_size=1, group_size=4, num_prompts=3)
    old.load_state_dict(state)
    assert not old.admits(Candidate("a", 0))


# ---------------------------------------------------------------- n_pilot = K // 4

@pytest.mark.parametrize("k, n_pilot", [(8, 2), (12, 3), (16, 4), (128, 32)])
def test_n_pilot_defaults_to_a_quarter_of_the_group(k, n_pilot):
    alloc = Allocator(_official(), BackfillConfig(), batch_size=2, group_size=k, num_prompts=4)
    (first, second) = alloc.begin_step(0, _draw_list([0, 1]))
    assert first.phase == PILOT and first.sample_indices == tuple(range(n_pilot))
    s = -(-n_pilot // 8)            # the fewest successes in the band: ceil(n_pilot / 8)
    out = alloc.on_group(0, 0, PILOT, [1.0] * s + [0.0] * (n_pilot - s))
    (commit,) = out.requests
    assert commit.phase == COMMIT and commit.sample_indices == tuple(range(n_pilot, k))


def test_n_pilot_follows_each_steps_group_size():
    alloc = Allocator(_official(), BackfillConfig(), batch_size=1, group_size=8, num_prompts=4)
    (req,) = alloc.begin_step(0, _draw_list([0]), group_size=16)
    assert req.num_samples == 4


# ---------------------------------------------------------------- fresh fills within the budget

def test_fresh_fill_rounds_by_hand():
    # B 2, K 4, n_pilot 2 (commit 2), budget 16, 2 candidates a round; pass iff 1 of 2 succeeds
    pilots = {"a": (1.0, 0.0), "b": (0.0, 0.0), "c": (0.0, 0.0), "d": (0.0, 1.0)}
    reward = lambda step, key, i: pilots[key][i] if i < 2 else 0.5     # noqa: E731
    alloc = Allocator(_official(n_pilot=2, budget=16, num_candidates=2), BackfillConfig(), batch_size=2,
                      group_size=4, num_prompts=8)
    dispatched, groups, m = _run_step(alloc, 0, _draw_list("abcd"), reward)
    # round 1: a passes (commit: 4 + 2 = 6 spent), b deferred; fill: (16 - 6 - 2) // 2 = 4 >= 2
    # fresh pilots c, d (10 spent); d passes and takes the last commit (12 spent): B met, no round 3
    assert [(r.key, r.phase) for r in dispatched] == [("a", PILOT), ("b", PILOT), ("a", COMMIT), ("c", PILOT),
                                                      ("d", PILOT), ("d", COMMIT)]
    assert sorted(g.key for g in groups) == ["a", "d"]
    assert m["pilot/fresh_filled"] == 2 and m["pilot/rounds"] == 2 and m["pilot/rollouts"] == 12
    # the same with fills from the reserve only (v0): the step trains on a alone
    v0 = Allocator(_official(n_pilot=2, budget=16, num_candidates=2, fill_from="reserve"), BackfillConfig(),
                   batch_size=2, group_size=4, num_prompts=8)
    _, groups, m = _run_step(v0, 0, _draw_list("abcd"), reward)
    assert [g.key for g in groups] == ["a"] and m["pilot/fresh_filled"] == 0


def test_the_last_fill_round_stops_where_a_pilot_and_its_commit_no_longer_fit():
    # every pilot fails: rounds of 3 fresh pilots (2 each) while (budget - spent - 2) // 2 allows
    alloc = Allocator(_official(n_pilot=2, budget=17, num_candidates=3), BackfillConfig(), batch_size=3,
                      group_size=4, num_prompts=50)
    dispatched, groups, m = _run_step(alloc, 0, _draw_list(range(50)), lambda step, key, i: 0.0)
    # round 1: 6 spent; fill (17-6-2)//2 = 4 -> 3 (12 spent); fill (17-12-2)//2 = 1 (14); (17-14-2)//2 = 0
    assert [m["pilot/rounds"], m["pilot/piloted"], m["pilot/rollouts"]] == [3, 7, 14]
    assert groups == []


def test_budget_never_exceeded_with_fresh_fills_and_decisions_ignore_arrival_order():
    for seed in range(120):
        rng = random.Random(seed)
        batch, k = rng.randint(1, 4), rng.randint(4, 12)
        n_pilot = rng.choice([None, rng.randint(1, k - 1)])
        n = n_pilot or max(1, k // 4)
        candidates = rng.randint(1, 2 * batch)
        budget = rng.randint(candidates * n + k - n, 3 * batch * k)
        band = sorted(rng.sample(range(n + 1), 2))
        cfg = _official(n_pilot=n_pilot, pass_lower=band[0] / n, pass_upper=band[1] / n,
                        evict_at=rng.choice([None, 1.0, (band[1] + 1) / n if band[1] < n else 1.0]),
                        evict_from=rng.choice(["next_epoch", "now"]),
                        fill_from=rng.choice(["reserve_then_loader", "loader", "reserve"]),
                        budget=budget, num_candidates=candidates, replay_max_age=rng.randint(0, 3))
        rate = {key: rng.random() for key in range(10)}
        salt = rng.randrange(10 ** 6)

        def reward(step, key, i, salt=salt, rate=rate):
            return float(random.Random(hash((salt, step, key, i)) & 0xFFFFFFFF).random() < rate[key])

        runs = []
        for order in (None, seed + 1000):
            loader = PromptLoader([PromptRecord(f"{i}=", str(i), i) for i in range(10)], batch_size=batch, seed=seed)
            alloc = Allocator(cfg, BackfillConfig(), batch_size=batch, group_size=k, num_prompts=10)
            trace, evicted_before = [], {}
            for step in range(8):
                drawn, draw = [], draw_from_loader(loader)

                def logged(draw=draw, drawn=drawn):
                    got = draw()
                    drawn.append(tuple(got))
                    return got
                dispatched, groups, metrics = _run_step(alloc, step, logged, reward, order)
                spent = sum(r.num_samples for r in dispatched)
                assert spent <= budget and spent == metrics["pilot/rollouts"], (seed, step)
                assert len(groups) <= batch, (seed, step)
                for g in groups:
                    assert sorted(i for p in g.parts for i in p.sample_indices) == list(range(k))
                # an evicted prompt is piloted again only if drawn in the epoch it was evicted in
                for r in dispatched:
                    if r.phase == PILOT and r.key in evicted_before:
                        assert cfg.evict_from == "next_epoch", (seed, step, r.key)
                        assert any(key == r.key and e <= evicted_before[r.key] for key, e in drawn), (seed, step)
                state = alloc.state_dict()
                evicted_before = dict(zip(state["solved"], state["solved_epochs"]))
                trace.append((sorted((r.slot, r.key, r.phase, r.sample_indices) for r in dispatched),
                              [(g.slot, g.key, g.rewards) for g in groups], metrics))
            runs.append((trace, alloc.state_dict()))
        assert runs[0] == runs[1], seed
