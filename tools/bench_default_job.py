"""The default job (`./run.sh`, configs/default.yaml) at two revisions of this repository, side by
side: did a change make what a new user sees first slower or worse?

    python tools/bench_default_job.py --before REV [--after WORKTREE_OR_REV] [--repeats 3] [overrides...]

Each revision runs `python -m periodic_async --config configs/default.yaml` (plus the overrides)
from its own git worktree with this venv's Python, the two alternated (before, after, before, ...)
so that slow phases of a shared machine hit both. Per run: the wall time of the whole process
(start-up included, as a user waits for it), the mean step time from metrics.jsonl
(timing_s/step) and the last step's critic/score/mean. Prints one table and the mean and spread
(min..max) per revision.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worktree(rev: str, into: str) -> str:
    path = os.path.join(into, rev.replace("/", "_"))
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-q", path, rev], check=True)
    return path


def _run(tree: str, run_dir: str, overrides: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    cmd = [sys.executable, "-m", "periodic_async", "--config", "configs/default.yaml",
           f"trainer.run_dir={run_dir}", "trainer.progress_bar=false", *overrides]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: the default job failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if "timing_s/step" in r]
    return {"wall_s": wall, "step_s": statistics.mean(r["timing_s/step"] for r in steps),
            "score": steps[-1].get("critic/score/mean", float("nan")), "steps": len(steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="git revision to compare against")
    ap.add_argument("--after", default=ROOT, help="a worktree path or a git revision (default: this checkout)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_default_job_") as tmp:
        before = _worktree(args.before, tmp)
        after = args.after if os.path.isdir(args.after) else _worktree(args.after, tmp)
        results: dict[str, list[dict]] = {"before": [], "after": []}
        try:
            for i in range(args.repeats):
                for name, tree in (("before", before), ("after", after)):
                    r = _run(tree, os.path.join(tmp, f"run_{name}_{i}"), args.overrides)
                    results[name].append(r)
                    print(f"repeat {i + 1} {name:6s}: wall {r['wall_s']:6.1f} s, step {r['step_s']:.3f} s, "
                          f"{r['steps']} steps, final score {r['score']:.3f}", flush=True)
        finally:
            for tree in (before, after):
                if tree.startswith(tmp):
                    subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree], check=False)
    print(f"\n{'':8s} {'wall s mean (min..max)':>26s} {'step s mean (min..max)':>26s} {'final score':>18s}")
    for name, rs in results.items():
        w, s, sc = ([r[k] for r in rs] for k in ("wall_s", "step_s", "score"))
        print(f"{name:8s} {statistics.mean(w):10.1f} ({min(w):.1f}..{max(w):.1f})      "
              f"{statistics.mean(s):8.3f} ({min(s):.3f}..{max(s):.3f})   {statistics.mean(sc):8.3f} "
              f"({min(sc):.3f}..{max(sc):.3f})")


if __name__ == "__main__":
    main()
