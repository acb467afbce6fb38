"""The soak's checker (tools/soak.py check_trace) on hand-made sample traces: a clean killed +
resumed run passes, and a lost sample, a duplicated one, a wrong prompt, a stale version, a step
trained twice by one run and a resume from the wrong checkpoint are each found. Also the trace
file itself (telemetry/sample_trace.py): a line cut by a kill is skipped and the resumed run's
lines start on a new line."""
import json
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

from soak import check_trace  # noqa: E402

from periodic_async.telemetry.sample_trace import SampleTrace, effective_steps, read_sample_trace  # noqa: E402

K, GROUPS, STEPS = 2, 2, 4
EXPECTED = {s: [([s, g], f"a{s}{g}") for g in range(GROUPS)] for s in range(1, STEPS + 1)}


def _group(step, g, samples=None, prompt=None, versions=None):
    samples = list(range(K)) if samples is None else samples
    return {"step": step, "group": g, "prompt": prompt or [step, g], "answer": f"a{step}{g}",
            "samples": samples, "versions": versions or [step - 1] * len(samples)}


def _run(after, steps, groups=None):
    groups = groups or {}
    run = {"run": f"r{after}", "after_step": after, "pid": 1, "groups": {}, "steps": {}}
    for s in steps:
        gs = groups.get(s, [_group(s, g) for g in range(GROUPS)])
        run["groups"][s] = gs
        run["steps"][s] = {"step": s, "groups": len(gs), "samples": sum(len(g["samples"]) for g in gs)}
    return run


def _check(runs, resumes=(2,)):
    return check_trace(runs, EXPECTED, STEPS, K, 0, list(resumes))


def test_killed_and_resumed_run_passes_taking_the_resumed_steps():
    # killed after step 3 (its step 3 undone), a partial step 4 without its step line, resumed from 2
    killed = _run(0, [1, 2, 3])
    killed["groups"][4] = [_group(4, 0)]
    out = _check([killed, _run(2, [3, 4])])
    assert out["problems"] == []
    assert (out["steps"], out["samples_checked"], out["lost"], out["duplicated"]) == (4, 16, 0, 0)


def test_lost_duplicated_wrong_prompt_and_stale_samples_are_found():
    bad = {3: [_group(3, 0, samples=[0]), _group(3, 1)],                       # sample (0, 1) lost
           4: [_group(4, 0, samples=[0, 1, 1]), _group(4, 1, prompt=[9, 9], versions=[3, 1])]}
    out = _check([_run(0, [1, 2, 3]), _run(2, [3, 4], bad)])
    assert (out["lost"], out["duplicated"], out["wrong_prompts"], out["stale"]) == (1, 1, 1, 1)
    assert len(out["problems"]) == 4


def test_a_step_trained_twice_or_resumed_from_the_wrong_checkpoint_is_found():
    out = _check([_run(0, [1, 2, 3]), _run(1, [2, 3, 4])])       # resumed after 1, the newest was 2
    assert any("newest checkpoint was 2" in p for p in out["problems"])
    out = _check([_run(0, [1, 2, 3, 4])], resumes=())
    assert out["problems"] == []
    out = _check([_run(0, [1, 2, 4])], resumes=())                # step 3 never trained
    assert any("missing 3" in p for p in out["problems"]) and any("not consecutive" in p for p in out["problems"])
    # steps after the resume point come from the resumed run only
    killed, resumed = _run(0, [1, 2, 3]), _run(2, [3, 4])
    eff = effective_steps([killed, resumed])
    assert list(eff) == [1, 2, 3, 4] and eff[3][1] is resumed["groups"][3] and eff[2][1] is killed["groups"][2]


def test_trace_file_survives_a_cut_line(tmp_path):
    group = SimpleNamespace(group_index=0, prompt_ids=[1, 2], answer="x", size=2,
                            results=[SimpleNamespace(sample_index=0), SimpleNamespace(sample_index=1)],
                            policy_versions=[0, 0])
    t = SampleTrace(str(tmp_path), 0)
    t.record(1, [group], [11, 12], 0)
    t.close()
    with open(tmp_path / "samples.jsonl", "a") as f:
        f.write('{"run": "cut", "kind": "gro')              # the kill cut this line
    t = SampleTrace(str(tmp_path), 1)
    t.record(2, [group], [13, 12], 1)
    t.close()
    runs, bad = read_sample_trace(str(tmp_path / "samples.jsonl"))
    assert bad == 1 and [r["after_step"] for r in runs] == [0, 1]
    assert runs[1]["steps"][2]["worker_pids"] == [13, 12] and runs[1]["steps"][2]["restarts"] == 1
    assert runs[0]["groups"][1][0]["samples"] == [0, 1]
    with open(tmp_path / "samples.jsonl") as f:
        lines = f.read().splitlines()
    assert json.loads(lines[-1])["kind"] == "step"
