"""How much can overlapping generation with training gain when both share the same 2 CPU cores?
The bound behind issue 30's "default mode >= 1.3x colocated sync on long tails", measured.

Colocated sync runs generation (G) and then the micro-steps and optimizer (T) one after the other,
each on both cores. Periodic asynchrony at eta = 0 may train on batch t's scored groups while batch
t's generation goes on, but batch t + 1's generation waits for batch t's weights. On shared cores
overlapping pays only where a stage uses its second core less well than the other stage would:
what each stage does on ONE core decides it. This tool runs `tools/bench_vs_trl.py`'s project side
in colocated sync on two cores and on one core (this process's first one or two, by affinity),
alternated, repeated; reads each run's G, T and the rest R (weight sync, scoring) per step with
`tools/profile_run.py`; optionally the periodic mode on two cores beside them; and prints:

- sync on 2 cores: G2 + T2 + R2;
- the on-policy overlap estimate: the best mix of three ways to use the cores within one batch -
  generation on both, generation and training on one each, training on both - with each stage's
  rate taken as uniform over the step (a linear program, `bounds`). When overlap pays
  (G2 / G1 + T2 / T1 > 1) and G1 <= T1 it is G1 + T2 * (1 - G1 / T1) + R2: generation on one core
  while the trainer trains on the other from the step's first instant, then the rest of the
  training on both. Real schedules are slower (the trainer cannot start before groups exist; the
  two processes share caches). Not a proof: a long tail's few decode rows scale worse than
  generation's average, so overlapping just the tail can do a little better than this;
- the packing bound: both stages on one core each, both cores busy all step, no dependency:
  (G1 + T1) / 2 + R2, a hard bound as far as one thread never uses its core worse than two threads
  do. Only overlapping batch t + 1's generation with batch t's training (eta >= 1, the async
  mode) could approach it.

    python tools/overlap_bound.py --setups long_tail --repeats 2 --modes sync,sync_shared --periodic

Each ratio is sync's step over the bound: the largest speed-up over sync that schedule could show.
No test asserts these numbers; the formulas are tested (tests/test_profile.py).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

PERIODIC_OF = {"sync": "periodic", "sync_shared": "periodic_shared"}


def stage_seconds(p: dict) -> dict:
    """A profile_run.profile of a colocated run -> per-step G (generation), T (micro-steps +
    optimizer: profile's train stage) and R (the rest of the step: weight sync, scoring, waits),
    in seconds."""
    g, t = p["stages"]["generate"]["busy_s"], p["stages"]["train"]["busy_s"]
    return {"G": g, "T": t, "R": max(0.0, p["step_s"] - g - t), "step": p["step_s"]}


def bounds(two: dict, one: dict) -> dict:
    """The step of each schedule from stage seconds on two cores (`two`) and one core (`one`).

    on_policy: the linear program over the time spent with generation on 2 cores (a), both stages
    on one core each (b) and training on 2 cores (c): a / G2 + b / G1 = 1 (generation done),
    b / T1 + c / T2 = 1 (training done), minimise a + b + c = G2 + T2 + b (1 - G2 / G1 - T2 / T1),
    so b = min(G1, T1) when that coefficient is negative (overlap pays), else b = 0 (sync)."""
    g2, t2, r2 = two["G"], two["T"], two["R"]
    g1, t1 = one["G"], one["T"]
    sync = g2 + t2 + r2
    gain = 1.0 - g2 / g1 - t2 / t1 if g1 > 0 and t1 > 0 else 0.0
    on_policy = g2 + t2 + (min(g1, t1) * gain if gain < 0 else 0.0) + r2
    packing = (g1 + t1) / 2 + r2
    return {"sync": sync, "on_policy": on_policy, "packing": packing,
            "gen_scaling": g1 / g2 if g2 else 0.0, "train_scaling": t1 / t2 if t2 else 0.0}


@contextlib.contextmanager
def cores(n: int):
    """This process (and the children it starts) on its first n cores for the block."""
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < n:
        sys.exit(f"overlap_bound: needs {n} cores, this process has {len(mine)}")
    os.sched_setaffinity(0, mine[:n])
    try:
        yield
    finally:
        os.sched_setaffinity(0, mine)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setups", default="long_tail")
    ap.add_argument("--modes", default="sync", help="colocated modes: sync, sync_shared")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--periodic", action="store_true", help="also run each mode's periodic counterpart on 2 cores")
    args = ap.parse_args()
    import bench_vs_trl
    from profile_run import profile
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in PERIODIC_OF]
    if bad:
        sys.exit(f"overlap_bound: --modes takes {', '.join(PERIODIC_OF)}; got {', '.join(bad)}")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for setup in [s.strip() for s in args.setups.split(",") if s.strip()]:
            work = bench_vs_trl.make_work(os.path.join(d, setup), setup, args.steps, 0)
            for mode in modes:
                runs = {"2 cores": [], "1 core": [], "periodic": []}
                sides = [("2 cores", mode, 2), ("1 core", mode, 1)] + \
                    ([("periodic", PERIODIC_OF[mode], 2)] if args.periodic else [])
                for rep in range(args.repeats):
                    for side, run_mode, n in (sides if rep % 2 == 0 else sides[::-1]):
                        run_dir = os.path.join(d, setup, f"{mode}_{side.replace(' ', '')}_{rep}")
                        os.makedirs(run_dir)
                        bench_vs_trl.log(f"{setup} {mode} repeat {rep + 1}/{args.repeats}: {run_mode} on {n} core(s)")
                        with cores(n):
                            bench_vs_trl.run_project(work, setup, run_mode, args.steps, args.micro_batch, run_dir,
                                                     account=True)
                        p = profile(run_dir, warmup=args.warmup)
                        runs[side].append(stage_seconds(p) if side != "periodic" else
                                          {"step": p["step_s"], "idle": p["trainer"].get("idle", 0.0)})
                        bench_vs_trl.log(f"  {side}: " + ", ".join(f"{k} {v:.3f}" for k, v in runs[side][-1].items()))
                mean = {side: {k: statistics.fmean(r[k] for r in rs) for k in rs[0]} for side, rs in runs.items() if rs}
                b = bounds(mean["2 cores"], mean["1 core"])
                rows.append((setup, mode, mean, b))
    print(f"\noverlap_bound: steps {args.steps}, warm-up {args.warmup}, repeats {args.repeats} (means; seconds per step)\n")
    print("| setup | mode | G2 / T2 / R2 | G1 / T1 | one-core slowdown G / T | sync step | on-policy overlap estimate "
          "(x sync) | packing bound (x sync) | periodic measured (x sync) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for setup, mode, mean, b in rows:
        two, one = mean["2 cores"], mean["1 core"]
        per = mean.get("periodic")
        per_txt = f"{per['step']:.3f} ({b['sync'] / per['step']:.2f}x; trainer idle {per['idle']:.3f})" if per else "-"
        print(f"| {setup} | {mode} | {two['G']:.3f} / {two['T']:.3f} / {two['R']:.3f} | {one['G']:.3f} / {one['T']:.3f} "
              f"| {b['gen_scaling']:.2f}x / {b['train_scaling']:.2f}x | {b['sync']:.3f} "
              f"| {b['on_policy']:.3f} ({b['sync'] / b['on_policy']:.2f}x) | {b['packing']:.3f} "
              f"({b['sync'] / b['packing']:.2f}x) | {per_txt} |")


if __name__ == "__main__":
    main()
