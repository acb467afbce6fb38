"""tools/profile_run.py: on a short default run (periodic, record_timeline) and on hand-made timelines."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 3


def _load_profile():
    # tools/ is not a package: loaded by path
    spec = importlib.util.spec_from_file_location("pa_tools_profile", os.path.join(ROOT, "tools", "profile_run.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


prof = _load_profile()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("profile_run") / "run"
    cmd = [sys.executable, "-m", "periodic_async", "--config", "configs/default.yaml", f"trainer.run_dir={d}",
           f"trainer.total_steps={STEPS}", "trainer.record_timeline=true", "trainer.progress_bar=false",
           "trainer.save_final=false", "trainer.tensorboard=false"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return str(d)


@pytest.fixture(scope="module")
def profiled(run_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("profile_out")
    paths = {k: str(out / f"{k}") for k in ("png", "trace", "json")}
    prof.main([run_dir, "--warmup", "0", "--png", paths["png"] + ".png", "--trace", paths["trace"] + ".json",
               "--json", paths["json"] + ".json"])
    with open(paths["json"] + ".json") as f:
        summary = json.load(f)
    with open(paths["trace"] + ".json") as f:
        trace = json.load(f)
    return summary, trace, paths["png"] + ".png"


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {m["step"]: m for m in map(json.loads, f)}


def _config(run_dir):
    with open(os.path.join(run_dir, "config.yaml")) as f:
        return yaml.safe_load(f)


def test_breakdown_sums_to_the_step_and_matches_the_metrics(run_dir, profiled):
    summary, _, _ = profiled
    metrics = _metrics(run_dir)
    assert summary["steps"] == list(range(1, STEPS + 1))
    for s in summary["per_step"]:
        m = metrics[s["step"]]
        assert s["step_s"] == pytest.approx(m["timing_s/step"], abs=1e-6)
        for side in ("rollout", "trainer"):
            assert sum(s[side].values()) == pytest.approx(s["step_s"], rel=1e-6)
            assert all(v >= -1e-9 for v in s[side].values())
        # independent measurements of the same stages
        assert s["trainer"]["weight_sync"] == pytest.approx(m["timing_s/update_weights"], abs=1e-4)
        busy_train = s["busy"]["micro_steps"] + s["busy"]["optimizer"]
        assert 0.6 * m["timing_s/update_actor"] <= busy_train <= m["timing_s/update_actor"] * 1.01 + 1e-3
        assert s["rollout"]["generate"] <= m["timing_s/gen"] + 1e-3
        assert s["busy"]["reward"] == pytest.approx(m["timing_s/reward"], rel=0.2, abs=2e-3)
        assert 0.0 <= s["straggler_share"] <= 1.0


def test_token_counts_equal_the_metrics(run_dir, profiled):
    summary, _, _ = profiled
    metrics = _metrics(run_dir)
    cfg = _config(run_dir)
    per_step = cfg["data"]["train_batch_size"] * cfg["rollout"]["n"]
    for s in summary["per_step"]:
        m = metrics[s["step"]]
        assert s["samples"] == per_step
        assert s["tokens"] == m["perf/total_num_tokens"]
        assert s["response_tokens"] == pytest.approx(m["response_length/mean"] * per_step, rel=1e-9)
        assert s["micro_step_tokens"] == s["tokens"]           # one trainer rank trains every sample
    assert summary["tokens_per_s_per_device"] == pytest.approx(
        sum(metrics[s]["perf/throughput"] for s in summary["steps"]) / len(summary["steps"]))
    # the default periodic run on CPU: the worker shares the trainer's cores, one device in all
    assert summary["devices"] == 1 and summary["engines"] == 1


def test_trace_is_valid_with_one_event_per_sample(run_dir, profiled):
    _, trace, png = profiled
    cfg = _config(run_dir)
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    by_cat = {}
    for e in xs:
        by_cat[e["cat"]] = by_cat.get(e["cat"], 0) + 1
        assert e["ts"] >= 0 and e["dur"] >= 0 and isinstance(e["pid"], int) and isinstance(e["tid"], int)
    samples = STEPS * cfg["data"]["train_batch_size"] * cfg["rollout"]["n"]
    micro = STEPS * -(-cfg["data"]["train_batch_size"] * cfg["rollout"]["n"] // cfg["actor"]["micro_batch_size"])
    assert by_cat["generate"] == samples
    assert by_cat["train"] == micro
    assert by_cat["update_weights"] == by_cat["optimizer"] == by_cat["step"] == STEPS
    # one scoring call per poll of the rollout pool (the groups its results completed): together
    # they score every group of every step exactly once
    events = [json.loads(line) for line in open(os.path.join(run_dir, "timeline.jsonl"))]
    scored = {}
    for e in events:
        if e["kind"] == "reward":
            scored.setdefault(e["step"], []).extend(e["groups"])
    assert sorted(scored) == list(range(1, STEPS + 1))
    assert all(sorted(g) == list(range(cfg["data"]["train_batch_size"])) for g in scored.values()), scored
    assert by_cat["reward"] == sum(1 for e in events if e["kind"] == "reward")
    gen_pids = {e["pid"] for e in xs if e["cat"] == "generate"}
    train_pids = {e["pid"] for e in xs if e["cat"] == "train"}
    assert gen_pids.isdisjoint(train_pids)
    assert len({e["tid"] for e in xs if e["cat"] == "generate"}) == cfg["rollout"]["max_slots"]
    names = [e for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"]
    assert {e["pid"] for e in names} >= gen_pids | train_pids
    assert os.path.getsize(png) > 10_000


def test_report_prints_mfu_only_with_a_peak(run_dir, capsys):
    prof.main([run_dir, "--png", "none", "--trace", "none"])
    out = capsys.readouterr().out
    assert "tokens/s/device" in out and "straggler share" in out and "MFU: not printed" in out
    prof.main([run_dir, "--png", "none", "--trace", "none", "--peak-flops", "1e11"])
    out = capsys.readouterr().out
    assert "MFU" in out and "MFU: not printed" not in out and "peak: 0.1 TFLOP/s" in out


# ---------------------------------------------------------------------- formulas, hand-computed
def test_straggler_share():
    # 10 samples: the 90th-percentile finish is the 9th (ceil(0.9 * 10) = 9), at 9 s
    assert prof.straggler_share([float(i) for i in range(1, 11)], 20.0) == pytest.approx((10 - 9) / 20)
    # nine finish at 1 s, one straggler at 5 s: (5 - 1) / 10
    assert prof.straggler_share([1.0] * 9 + [5.0], 10.0) == pytest.approx(0.4)
    # 20 samples: ceil(18) = 18th finish
    assert prof.straggler_share([float(i) for i in range(20)], 38.0) == pytest.approx((19 - 17) / 38)
    assert prof.straggler_share([], 1.0) == 0.0


def test_partition_counts_each_instant_once():
    parts = prof.partition((0.0, 10.0), [("generate", [(0, 4), (3, 6)]), ("reward", [(5, 7)]),
                                         ("weight_sync", [(9, 11)])])
    assert parts == pytest.approx({"generate": 6.0, "reward": 1.0, "weight_sync": 1.0, "idle": 2.0})


def test_flop_formulas():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        from sim.flops import ModelShape, forward_flops, generation_flops, training_flops
    finally:
        sys.path.pop(0)
    shape = ModelShape(hidden=4, layers=1, heads=2, kv_heads=1, head_dim=2, ffn=8, vocab=10, tied=True)
    # q 4x4, k and v 4x2 each, o 4x4, MLP 3 x 4x8, LM head 10x4
    assert shape.matmul_params == 16 + 8 + 8 + 16 + 96 + 40 == 184
    # layers' matmuls + qkv bias + 2 norms, the final norm, the (tied) embedding
    assert shape.total_params == 184 - 40 + (4 + 2 + 2) + 2 * 4 + 4 + 40
    # S = 3: 2 N S + 2 L d S (S + 1) = 1104 + 2 * 1 * 4 * 3 * 4
    assert forward_flops(shape, 3) == 1104 + 96
    assert generation_flops(shape, 2, 2) == forward_flops(shape, 3)       # P + R - 1 tokens
    assert training_flops(shape, 2, 1) == 4 * forward_flops(shape, 3)     # fwd + bwd (3) + reference (1)
    assert training_flops(shape, 2, 1, ppo_epochs=2) == 9 * forward_flops(shape, 3)  # 2 x 4 + old once
    assert training_flops(shape, 2, 1, old_shortcut=False) == 5 * forward_flops(shape, 3)


def _write_run(d, events, metrics, mode="periodic", kl_coef=0.001):
    os.makedirs(os.path.join(d, "model_init"))
    with open(os.path.join(d, "model_init", "config.json"), "w") as f:
        json.dump({"model_type": "qwen2", "hidden_size": 4, "num_hidden_layers": 1, "num_attention_heads": 2,
                   "num_key_value_heads": 1, "head_dim": 2, "intermediate_size": 8, "vocab_size": 10,
                   "tie_word_embeddings": True}, f)
    with open(os.path.join(d, "config.yaml"), "w") as f:
        yaml.safe_dump({"backend": "cpu", "model": {"path": None}, "trainer": {"mode": mode},
                        "rollout": {"max_slots": 2, "n": 2}, "data": {"train_batch_size": 1},
                        "actor": {"micro_batch_size": 2, "ppo_epochs": 1, "kl_coef": kl_coef}}, f)
    with open(os.path.join(d, "timeline.jsonl"), "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(m) + "\n" for m in metrics)


def test_profile_of_a_hand_made_step(tmp_path):
    d = str(tmp_path / "run")
    def gen(k, a, b):
        return {"step": 1, "kind": "generate", "lane": f"worker0/slot{k}", "start": a, "end": b, "worker": 0,
                "slot": k, "group": 0, "sample": k, "prompt_tokens": 2, "response_tokens": 2, "finish": "stop"}
    events = [gen(0, 0.0, 1.0), gen(1, 0.5, 2.0),
              {"step": 1, "kind": "reward", "lane": "trainer", "start": 2.0, "end": 2.2, "groups": [0], "items": 2},
              {"step": 1, "kind": "train", "lane": "trainer", "start": 2.0, "end": 3.0, "index": 0, "sequences": 2,
               "tokens": 8, "response_tokens": 4, "padded_tokens": 8, "groups": [0]},
              {"step": 1, "kind": "optimizer", "lane": "trainer", "start": 3.0, "end": 3.5},
              {"step": 1, "kind": "update_weights", "lane": "trainer", "start": 3.5, "end": 4.0},
              {"step": 1, "kind": "step", "lane": "trainer", "start": 0.0, "end": 4.0, "mode": "periodic",
               "devices": 2, "engines": 1, "world": 1, "dp_size": 1, "micro_batch_size": 2, "dispatch": 0.0,
               "gen_end": 2.2}]
    _write_run(d, events, [{"step": 1, "timing_s/step": 4.0, "perf/throughput": 1.0, "perf/total_num_tokens": 8}])
    p = prof.profile(d, warmup=0, peak_flops=1e4)
    assert p["rollout"] == pytest.approx({"generate": 2.0, "reward": 0.2, "weight_sync": 0.5, "idle": 1.3})
    assert p["trainer"] == pytest.approx({"train": 1.5, "weight_sync": 0.5, "idle": 2.0})
    assert p["straggler_share"] == 0.0        # ceil(0.9 * 2) = 2: the 90th-percentile finish is the last
    g, t = p["stages"]["generate"], p["stages"]["train"]
    # generation: 2 samples x forward over P + R - 1 = 3 tokens (1200 FLOPs), busy 2 s on 1 engine
    assert g["flops"] == 2400 and g["flops_per_s_busy"] == pytest.approx(1200) and g["mfu_busy"] == pytest.approx(0.12)
    assert g["flops_per_s_step"] == pytest.approx(600)
    # training: 2 x 4 forwards over 4 tokens (2*184*4 + 2*4*4*5 = 1632), busy 1.5 s (micro-step + optimizer)
    assert t["flops"] == 2 * 4 * 1632 and t["mfu_busy"] == pytest.approx(13056 / 1.5 / 1e4)
    # without a KL term the reference model is not built: 3 forwards' worth per sample
    d0 = str(tmp_path / "run_no_kl")
    _write_run(d0, events, [{"step": 1, "timing_s/step": 4.0, "perf/throughput": 1.0, "perf/total_num_tokens": 8}],
               kl_coef=0.0)
    assert prof.profile(d0, warmup=0)["stages"]["train"]["flops"] == 2 * 3 * 1632


def test_a_run_without_a_timeline_gets_one_line_saying_what_to_do(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(SystemExit, match=r"no timeline\.jsonl; re-run with trainer\.record_timeline=true"):
        prof.main([str(tmp_path)])
    with pytest.raises(SystemExit, match=r"no metrics\.jsonl; is it a run directory"):
        prof.main([str(tmp_path / "nowhere")])


def test_machine_load_reads_steal_and_leaves_guest_time_out(tmp_path):
    """tools/machine_load.py: steal is /proc/stat's 8th field, and guest time (already inside user)
    is not counted twice; a run's steal share is the steal ticks over all ticks between snapshots."""
    spec = importlib.util.spec_from_file_location("pa_tools_machine_load", os.path.join(ROOT, "tools", "machine_load.py"))
    ml = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ml)
    stat = tmp_path / "stat"
    #               user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  100 0 50 800 10 0 5 35 20 0\ncpu0 100 0 50 800 10 0 5 35 20 0\nintr 1 2 3\n")
    assert ml.read_cpu_ticks(str(stat)) == (35, 1000)
    assert ml.read_cpu_ticks(str(tmp_path / "absent")) is None
    stat.write_text("cpu  100 0 50 800 10 0 5 35 20 0\n")
    before = ml.snapshot(str(stat))
    stat.write_text("cpu  160 0 70 880 10 0 5 75 90 0\n")   # +200 ticks, 40 of them steal, guest +70
    load = ml.since(before, str(stat))
    assert load["steal_share"] == pytest.approx(0.2)
    assert "steal 20.0%" in ml.describe(load)


def test_overlap_bound_is_the_linear_programs_optimum():
    """tools/overlap_bound.py: the on-policy estimate is the least a + b + c with generation on 2
    cores for a, both stages on one core each for b, training on 2 cores for c, both stages done
    (checked by brute force over b); overlap gains nothing when both stages scale perfectly, and
    what the second core does not give generation when it does not scale at all."""
    spec = importlib.util.spec_from_file_location("pa_tools_overlap_bound", os.path.join(ROOT, "tools", "overlap_bound.py"))
    ob = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ob)

    def brute(g2, t2, g1, t1):
        best = g2 + t2
        for i in range(20001):
            b = min(g1, t1) * i / 20000
            a, c = g2 * (1 - b / g1), t2 * (1 - b / t1)
            best = min(best, a + b + c)
        return best

    for g2, t2, g1, t1 in ((0.32, 0.90, 0.41, 1.47), (0.6, 0.3, 0.75, 0.55), (0.5, 0.5, 0.5, 0.5), (0.2, 1.0, 0.4, 2.0)):
        b = ob.bounds({"G": g2, "T": t2, "R": 0.05}, {"G": g1, "T": t1})
        assert b["sync"] == pytest.approx(g2 + t2 + 0.05)
        assert b["on_policy"] == pytest.approx(brute(g2, t2, g1, t1) + 0.05, abs=1e-4)
        assert b["packing"] == pytest.approx((g1 + t1) / 2 + 0.05)
        assert b["packing"] <= b["on_policy"] + 1e-12 <= b["sync"] + 1e-12
    perfect = ob.bounds({"G": 0.2, "T": 1.0, "R": 0.0}, {"G": 0.4, "T": 2.0})
    assert perfect["on_policy"] == pytest.approx(1.2)               # both scale 2x: nothing to win
    flat = ob.bounds({"G": 0.4, "T": 1.0, "R": 0.0}, {"G": 0.4, "T": 2.0})
    assert flat["on_policy"] == pytest.approx(0.4 + 1.0 * (1 - 0.4 / 2.0))   # generation on one core, hidden
    step = ob.stage_seconds({"step_s": 1.3, "stages": {"generate": {"busy_s": 0.3}, "train": {"busy_s": 0.9}}})
    assert step == pytest.approx({"G": 0.3, "T": 0.9, "R": 0.1, "step": 1.3})
