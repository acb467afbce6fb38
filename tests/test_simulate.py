"""The scheduling replay (tools/sim/) on hand-computable cases, and the calibration of
tools/simulate.py on a synthetic timeline made with known costs."""
from __future__ import annotations

import json
import os
import random
import sys

import pytest
import yaml

# tools/ is not a package: tools/sim is imported as `sim` with tools/ on the path, as its scripts do
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
try:
    from sim import calibration, replay
    from sim.costs import GEN_FEATURES, Cluster, Costs, GenCosts, Workload
    from sim.engine import Sample, replay_engine
    from sim.lengths import FixedLengths, LogNormalLengths, ParetoLengths, parse_lengths
    from sim.planner import PromptSet
    from sim.replay import replay_step, simulate
finally:
    sys.path.pop(0)

C = 0.001     # seconds per sequence per engine step


def _row_costs(**kw) -> Costs:
    """Every row of an engine step (decode or prefill) costs C: a wave of S sequences of R tokens
    takes R * S * C."""
    return Costs(gen=GenCosts(decode_row_s=C, prefill_row_s=C), **kw)


def test_engine_replay_continuous_batching():
    # 3 sequences, 2 slots: the third takes the first free slot (the lowest) as soon as one finishes
    ss = [Sample(0, 0, 4, 2), Sample(0, 1, 4, 5), Sample(1, 0, 4, 1)]
    its = replay_engine(ss, 2, GenCosts(decode_s=1.0, prefill_s=10.0, prefill_token_s=0.5))
    assert [s.slot for s in ss] == [0, 1, 0]
    # step 0: prefill of the shared prompt once (10 + 0.5 * 4); step 1: decode of 2 rows (1) + prefill of
    # the newcomer's prompt (12) -> the first finishes at 12 (end of step 1), the newcomer at 25 (R = 1)
    assert ss[0].end == 12 + 1 and ss[2].start == 13 and ss[2].end == 13 + 1 + 12
    assert ss[1].end == 13 + 13 + 1 + 1 == 28
    assert [it.features[6] for it in its] == [0, 1, 1, 0, 1]


def test_sync_step_is_generation_plus_training():
    n_prompts, k, r = 8, 4, 5
    wl = Workload(n_prompts, k, FixedLengths(r), FixedLengths(3), micro_batch_size=8)
    costs = _row_costs(micro_step_s=0.02, optimizer_s=0.01)
    p = simulate("sync", wl, Cluster(0, 1, slots=4, colocated_devices=1, colocated_engines=1), costs, steps=2)
    t_gen = n_prompts * k * r * C                  # every sequence pays C at each of its R engine steps
    t_train = n_prompts * k / 8 * 0.02 + 0.01
    assert p.gen_s == pytest.approx(t_gen)
    assert p.train_s == pytest.approx(t_train)
    assert p.step_s == pytest.approx(t_gen + t_train)
    assert p.tokens_per_step == n_prompts * k * (r + 3)
    assert p.tokens_per_s_per_device == pytest.approx(p.tokens_per_step / p.step_s)


@pytest.mark.parametrize("prompts", [4, 16, 32])
def test_periodic_with_equal_stage_times_approaches_the_overlap_bound(prompts):
    # one group per wave (K = slots): group g is scored at (g + 1) w, w = R K C; a micro-step (one
    # group) also takes w, so periodic ends at (P + 1) w and sync_split at 2 P w: T_gen == T_train
    k, r = 8, 4
    w = r * k * C
    wl = Workload(prompts, k, FixedLengths(r), FixedLengths(2), micro_batch_size=k)
    costs = _row_costs(micro_step_s=w)
    cl = Cluster(1, 1, slots=k)
    per = simulate("periodic", wl, cl, costs, steps=1)
    split = simulate("sync_split", wl, cl, costs, steps=1)
    assert per.gen_s == pytest.approx(prompts * w) and per.train_s == pytest.approx(prompts * w)
    assert per.step_s == pytest.approx((prompts + 1) * w)
    assert split.step_s == pytest.approx(2 * prompts * w)
    bound = 2.0         # (T_gen + T_train) / max(T_gen, T_train)
    ratio = split.step_s / per.step_s
    assert ratio == pytest.approx(2 * prompts / (prompts + 1))
    if prompts >= 16:
        assert ratio / bound >= 0.94


def test_long_tail_ordering():
    wl = Workload(16, 8, ParetoLengths(8, 1.2, 256), FixedLengths(16), micro_batch_size=16)
    costs = Costs(gen=GenCosts(decode_s=2e-3, decode_row_s=5e-5, prefill_s=2e-3, prefill_token_s=2e-5),
                  micro_step_s=0.04, token_s=2e-6, optimizer_s=5e-3, reward_call_s=1e-4, sync_s=3e-3,
                  dispatch_s=2e-3, result_s=5e-4)
    split = Cluster(1, 1, slots=32)
    sync = simulate("sync", wl, Cluster(0, 1, slots=32, colocated_devices=1, colocated_engines=1), costs, steps=8)
    sync_split = simulate("sync_split", wl, split, costs, steps=8)
    periodic = simulate("periodic", wl, split, costs, steps=8)
    # the same devices per stage: the split alone changes little; overlap wins
    assert abs(sync_split.step_s / sync.step_s - 1) < 0.05
    assert sync.step_s >= periodic.step_s and sync_split.step_s >= periodic.step_s
    assert periodic.step_s <= 0.8 * sync_split.step_s
    # ... but less than the bound: the trainer still waits for the tail's groups
    bound = (sync_split.gen_s + sync_split.train_s) / max(sync_split.gen_s, sync_split.train_s)
    assert sync_split.step_s / periodic.step_s < 0.97 * bound


def test_dispatch_and_dp_assignment_follow_the_real_code():
    from periodic_async.rollout import worker
    from periodic_async.train import step
    sizes = {0: 8, 1: 4, 2: 8, 3: 2, 4: 6}
    assert replay.assign_groups is step.assign_groups      # the trainer's own rule, not a copy
    from periodic_async.scheduling import dp_assignment
    # when a rank packs: the trainer's rule (train/step.py cuts with cut_micro_batches, which
    # decides with micro_batch_due)
    assert step.cut_micro_batches is dp_assignment.cut_micro_batches
    assert replay.micro_batch_due is dp_assignment.micro_batch_due
    assert replay.least_loaded_worker is worker.least_loaded_worker    # the rollout pool's rule
    reqs = [[Sample(g, k, 3, 2) for k in range(n)] for g, n in sizes.items()]
    per_engine = replay.dispatch(reqs, 2)
    # least outstanding samples first, ties to the lower engine: 0 -> e0 (8), 1 -> e1 (4), 2 -> e1 (12),
    # 3 -> e0 (10), 4 -> e0 (16)
    assert [sorted({s.group for s in e}) for e in per_engine] == [[0, 3, 4], [1, 2]]


def test_the_simulator_is_torch_free():
    import subprocess
    tools = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
    code = (f"import sys; sys.path.insert(0, {tools!r})\n"
            "import sim.calibration, sim.engine_reprefill, sim.projection, sim.replay, sim.pipeline, sim.planner\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_the_runtime_never_imports_the_simulator():
    """tools/sim imports the runtime's rules; the runtime imports nothing from tools/."""
    import ast
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "periodic_async")
    found = []
    for d, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(d, name)
                with open(path) as f:
                    tree = ast.parse(f.read(), path)
                for node in ast.walk(tree):
                    mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                            [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
                    found += [(path, m) for m in mods if m.split(".")[0] in ("sim", "tools")]
    assert not found


def test_dp_ranks_train_their_groups_and_wait_for_each_other():
    wl = Workload(4, 4, FixedLengths(2), FixedLengths(2), micro_batch_size=4)
    costs = _row_costs(micro_step_s=0.1, optimizer_s=0.05)
    one = simulate("sync_split", wl, Cluster(1, 1, slots=16), costs, steps=1)
    two = simulate("sync_split", wl, Cluster(1, 2, slots=16), costs, steps=1)
    assert one.train_s == pytest.approx(4 * 0.1 + 0.05)
    assert two.train_s == pytest.approx(2 * 0.1 + 0.05)       # rank 0's share: 2 groups
    assert one.step_s - two.step_s == pytest.approx(0.2)


# ---------------------------------------------------------------------- async and the plug-ins
LONG_TAIL = Workload(16, 8, ParetoLengths(8, 1.2, 256), FixedLengths(16), micro_batch_size=16)
TAIL_COSTS = Costs(gen=GenCosts(decode_s=2e-3, decode_row_s=5e-5, prefill_s=2e-3, prefill_token_s=2e-5),
                   micro_step_s=0.04, token_s=2e-6, optimizer_s=5e-3, reward_call_s=1e-4, reward_item_s=1e-5,
                   sync_s=3e-3, dispatch_s=2e-3, result_s=5e-4, handoff_busy_s=1e-3, handoff_wait_s=2e-3)


def test_async_with_eta_0_is_the_periodic_replay():
    # periodic: one batch after the other (replay_step each); async: one pipeline over all batches,
    # each dispatched when may_dispatch lets it - with eta = 0 the same schedule, to the last bit
    cl = Cluster(2, 1, slots=16)
    ev_p, ev_a = [], []
    per = simulate("periodic", LONG_TAIL, cl, TAIL_COSTS, steps=6, seed=3, events=ev_p)
    asy = simulate("async", LONG_TAIL, cl, TAIL_COSTS, steps=6, seed=3, events=ev_a, eta=0)
    assert asy.batches is not None and per.batches is None      # two code paths
    for f in ("step_s", "gen_s", "train_s", "sync_s", "tokens_per_step", "tokens_per_s_per_device",
              "rollout_idle", "trainer_idle", "wall_s"):
        assert getattr(asy, f) == getattr(per, f), f
    assert [{**e, "mode": None} for e in ev_a] == [{**e, "mode": None} for e in ev_p]


@pytest.mark.parametrize("eta", [1, 2])
def test_async_keeps_the_staleness_bound_and_overlaps_batches(eta):
    cl = Cluster(1, 1, slots=32)
    per = simulate("periodic", LONG_TAIL, cl, TAIL_COSTS, steps=10, seed=1)
    asy = simulate("async", LONG_TAIL, cl, TAIL_COSTS, steps=10, seed=1, eta=eta)
    stale = []
    for b in asy.batches:
        # batch b is trained at version b - 1; its oldest token's policy is at most eta behind
        assert b.dispatch_version >= b.step - 1 - eta
        stale.append((b.step - 1) - b.oldest_version)
    assert max(stale) <= eta
    assert max(stale) == eta            # the bound is used: batches b + 1 .. b + eta ran on older weights
    assert asy.batches[eta].dispatch == 0.0 and asy.batches[eta + 1].dispatch > 0.0
    # a simulated time, not a measurement: overlapping batches hide the long tail
    assert asy.wall_s <= per.wall_s
    assert asy.wall_s < 0.9 * per.wall_s


def test_one_reward_call_per_poll():
    # 2 groups of K = 2, same lengths, 4 slots: all four finish in one engine step, so one poll
    # holds both groups and the producer scores them in one call (call + 4 items), not two
    wl = Workload(2, 2, FixedLengths(3), FixedLengths(2), micro_batch_size=4)
    costs = _row_costs(reward_call_s=0.5, reward_item_s=0.01)
    events = []
    simulate("periodic", wl, Cluster(1, 1, slots=4), costs, steps=1, events=events)
    rewards = [e for e in events if e["kind"] == "reward"]
    assert len(rewards) == 1 and rewards[0]["items"] == 4 and rewards[0]["groups"] == [0, 1]
    assert rewards[0]["end"] - rewards[0]["start"] == pytest.approx(0.5 + 4 * 0.01)


def test_sagc_in_the_replay_decides_as_the_runtime_sizer():
    from periodic_async.config.sections import SAGCConfig
    from periodic_async.scheduling.group_sizing import StragglerAwareGroupSize
    cfg = SAGCConfig(candidates=(4, 8, 16), tau=2.0, eta=1.0, seed=5)
    wl = Workload(8, 8, ParetoLengths(8, 1.2, 256), FixedLengths(16), micro_batch_size=16)
    p = simulate("async", wl, Cluster(1, 1, slots=32), TAIL_COSTS, steps=12, seed=2, eta=1,
                 sizer=StragglerAwareGroupSize(cfg, 8))
    played = [b.group_size for b in p.batches]
    for b in p.batches:       # every group of a batch has the batch's K
        assert {len([s for s in b.samples if s.group == g]) for g in range(wl.prompts)} == {b.group_size}
    # a fresh runtime sizer, told what the replay saw in the order it happened (a batch decided at its
    # dispatch, observed when its last group is in; eta = 1: batch b + 1 decided before b is observed)
    calls = sorted([(b.dispatch, 0, b.step, None) for b in p.batches] +
                   [(b.done_at, 1, b.step, [[s.response for s in b.samples if s.group == g]
                                            for g in range(wl.prompts)]) for b in p.batches])
    ref, want = StragglerAwareGroupSize(cfg, 8), {}
    for _, kind, step, lengths in calls:
        if kind == 0:
            want[step] = ref.begin_step(step)
        else:
            ref.observe(step, lengths)
    assert played == [want[b.step] for b in p.batches]
    assert len(set(played)) > 1                 # the lengths fed back moved K
    assert p.batches[1].dispatch < p.batches[0].done_at     # delayed feedback happened


def test_pilot_commit_replay_spends_no_more_than_the_budget():
    from periodic_async.scheduling.allocation import Allocator, BackfillConfig, PilotConfig
    pc = PilotConfig.v0(n_pilot=2, p_lower=0.0, p_upper=1.0, budget=96, num_candidates=24)
    alloc = Allocator(pc, BackfillConfig(), 16, 8, 200)
    p = simulate("periodic", LONG_TAIL, Cluster(1, 1, slots=32), TAIL_COSTS, steps=8, allocator=alloc,
                 prompts=PromptSet(LONG_TAIL, 200, "beta:0.5,0.5", seed=1))
    for b in p.batches:
        assert b.rollouts <= alloc.budget_for(b.group_size) == 96
        assert b.rollouts == b.metrics["pilot/rollouts"]
        assert b.metrics["pilot/rollouts"] == 2 * b.metrics["pilot/piloted"] + 6 * b.metrics["pilot/committed"]
        trained = [g for g in b.groups.values() if g]
        assert len(trained) == b.metrics["alloc/trainable_groups"] <= 16
    assert p.rollouts_per_step < 16 * 8
    # async with eta 2: the allocator's steps overlap (its bookkeeping is per step), each in budget
    alloc = Allocator(pc, BackfillConfig(), 16, 8, 200)
    a = simulate("async", LONG_TAIL, Cluster(1, 1, slots=32), TAIL_COSTS, steps=8, eta=2, allocator=alloc,
                 prompts=PromptSet(LONG_TAIL, 200, "beta:0.5,0.5", seed=1))
    assert len(a.batches) == 8 and all(b.rollouts <= 96 for b in a.batches)
    assert a.batches[1].dispatch < a.batches[0].done_at         # step 2 was planned while step 1 piloted


def test_backfill_replay_draws_more_groups_within_its_budget():
    from periodic_async.scheduling.allocation import Allocator, BackfillConfig, PilotConfig
    alloc = Allocator(PilotConfig(), BackfillConfig(enabled=True, max_groups=4), 16, 8, 200)
    p = simulate("periodic", LONG_TAIL, Cluster(1, 1, slots=32), TAIL_COSTS, steps=6, allocator=alloc,
                 prompts=PromptSet(LONG_TAIL, 200, "beta:0.3,0.3", seed=2))
    plain = simulate("periodic", LONG_TAIL, Cluster(1, 1, slots=32), TAIL_COSTS, steps=6)
    for b in p.batches:
        assert 16 * 8 <= b.rollouts <= alloc.budget_for(8) == 20 * 8
        assert b.rollouts == 8 * (16 + b.metrics["rollout/backfilled"])
    assert p.rollouts_per_step > plain.rollouts_per_step


# ---------------------------------------------------------------------- calibration
TRUE = Costs(gen=GenCosts(decode_s=1.5e-3, decode_row_s=4e-5, decode_ctx_s=2e-7, prefill_s=2.5e-3,
                          prefill_row_s=3e-5, prefill_token_s=6e-6, finish_s=2e-5),
             micro_step_s=4e-3, token_s=3e-6, attn_s=2e-8, optimizer_s=3e-3, reward_call_s=2e-4,
             reward_item_s=1e-5, sync_s=4e-3, dispatch_s=3e-3, result_s=1e-3, handoff_busy_s=1e-3,
             handoff_wait_s=2e-3, post_train_s=5e-4)


def _synthetic_run(d, mode, costs, steps=6, slots=16, prompts=12, n=4, mbs=8, seed=1):
    """A run directory whose timeline the replay made with `costs`, as the trainer writes it."""
    wl = Workload(prompts, n, LogNormalLengths(12, 0.6, 48), LogNormalLengths(10, 0.4, 30), mbs)
    events = []
    cl = Cluster(1, 1, slots=slots) if mode != "sync" else Cluster(0, 1, slots=slots, colocated_devices=1,
                                                                    colocated_engines=1)
    rng = random.Random(seed)
    t, metrics = 100.0, []
    for step in range(1, steps + 1):
        rep = replay_step(mode, replay.plan_requests(wl, rng), cl, costs, mbs, t0=t, step=step)
        events += rep.events
        metrics.append({"step": step, "timing_s/step": rep.step_s, "perf/total_num_tokens": rep.tokens,
                        "perf/throughput": rep.tokens / rep.step_s / cl.devices(mode), "timing_s/gen": rep.gen_s,
                        "timing_s/update_actor": rep.train_s})
        t += rep.step_s + 0.01
    os.makedirs(d)
    with open(os.path.join(d, "config.yaml"), "w") as f:
        yaml.safe_dump({"backend": "cpu", "model": {"path": None}, "trainer": {"mode": mode},
                        "rollout": {"max_slots": slots, "n": n}, "data": {"train_batch_size": prompts},
                        "actor": {"micro_batch_size": mbs}}, f)
    for name, rows in (("timeline.jsonl", events), ("metrics.jsonl", metrics)):
        with open(os.path.join(d, name), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return d


@pytest.mark.parametrize("engine", ["incremental", "reprefill"])
def test_calibration_recovers_known_costs(tmp_path, engine):
    true = Costs.from_dict(TRUE.to_dict())
    true.gen.engine = engine
    if engine == "reprefill":
        true.gen.prefill_row_s = 0.0       # every prefill holds all rows' tokens: rows and tokens both vary
    d = _synthetic_run(str(tmp_path / "run"), "periodic", true)
    calib = calibration.calibrate([d], warmup=0)["modes"]["periodic"]
    got = Costs.from_dict(calib["costs"])
    assert calib["diagnostics"]["generation"]["engine"] == engine
    assert calib["diagnostics"]["generation"]["slot_match"] == 1.0
    for name in GEN_FEATURES:
        assert getattr(got.gen, name) == pytest.approx(getattr(true.gen, name), rel=0.02, abs=1e-9), name
    for name in ("micro_step_s", "token_s", "attn_s", "optimizer_s", "sync_s", "dispatch_s", "result_s",
                 "handoff_busy_s", "handoff_wait_s", "post_train_s"):
        assert getattr(got, name) == pytest.approx(getattr(true, name), rel=0.02, abs=1e-9), name
    # K is the same for every group: only the cost of a group's scoring is identifiable
    assert got.reward_call_s + 4 * got.reward_item_s == pytest.approx(true.reward_call_s + 4 * true.reward_item_s)
    # and the prediction with the recovered costs is the measurement (the same lengths replayed)
    p = calibration.predict_from_calibration({"modes": {"periodic": calib}}, "periodic", measured_lengths=True)
    assert p.step_s == pytest.approx(calib["measured"]["step_s"], rel=1e-3)


def test_calibrated_sync_split_predicts_periodic(tmp_path):
    runs = [_synthetic_run(str(tmp_path / m), m, TRUE) for m in ("sync", "sync_split", "periodic")]
    calib = calibration.calibrate(runs, warmup=0)
    assert set(calib["modes"]) == {"sync", "sync_split", "periodic"}
    p = calibration.predict_from_calibration(calib, "periodic", costs_from="sync_split", measured_lengths=True)
    assert p.step_s == pytest.approx(calib["modes"]["periodic"]["measured"]["step_s"], rel=0.01)
    for mode in ("sync", "sync_split"):
        p = calibration.predict_from_calibration(calib, mode, measured_lengths=True)
        assert p.step_s == pytest.approx(calib["modes"][mode]["measured"]["step_s"], rel=0.01)
        # lengths drawn from the pooled empirical distribution instead: close, not equal
        p = calibration.predict_from_calibration(calib, mode, steps=40)
        assert p.step_s == pytest.approx(calib["modes"][mode]["measured"]["step_s"], rel=0.15)


def test_length_specs():
    assert parse_lengths("fixed:7").sample(random.Random(0), 3) == [7, 7, 7]
    ln = parse_lengths("lognormal:200,0.5,512").sample(random.Random(0), 5000)
    assert max(ln) <= 512 and min(ln) >= 1
    assert sorted(ln)[2500] == pytest.approx(200, rel=0.05)
    pa = parse_lengths("pareto:10,1.5,300").sample(random.Random(0), 5000)
    assert min(pa) >= 10 and max(pa) == 300
    with pytest.raises(ValueError):
        parse_lengths("gamma:1")
