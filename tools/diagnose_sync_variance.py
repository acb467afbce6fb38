"""Colocated sync's run-to-run variance (docs/performance.md, "Colocated sync's slow runs"): whole runs of
tools/bench_vs_trl.py's long_tail setup, wall against CPU time (the run's processes, user + sys),
with and without OMP_WAIT_POLICY=PASSIVE, alternated; the hypervisor's steal share over each run
(tools/machine_load.py) tells a slow VM from a slow program.

    python tools/diagnose_sync_variance.py [REPEATS] [MODE]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import bench_vs_trl  # noqa: E402
import machine_load  # noqa: E402

VARIANTS = {"default": {}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("repeats", nargs="?", type=int, default=3)
    ap.add_argument("mode", nargs="?", default="sync", choices=sorted(bench_vs_trl.MODES))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        work = bench_vs_trl.make_work(d, "long_tail", 8, 0)
        for rep in range(args.repeats):
            for name, env in VARIANTS.items():
                run_dir = os.path.join(d, f"{name}_{rep}")
                os.makedirs(run_dir)
                before = machine_load.snapshot()
                steps = bench_vs_trl.run_project(work, "long_tail", args.mode, 8, 16, run_dir, env_extra=env)
                print(f"{args.mode} {name} rep {rep}: {machine_load.describe(machine_load.since(before))}; "
                      f"steps {' '.join(f'{x:.2f}' for x in steps)}", flush=True)


if __name__ == "__main__":
    main()
