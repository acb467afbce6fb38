"""Held-out accuracy of one or more runs against step and against wall-clock, from each run's
metrics.jsonl (val-core/<source>/reward/mean@<n>: with `reward.name: exact` the mean reward of the
sampled held-out responses is their exact accuracy).

Wall-clock is the run's training time, the sum of timing_s/step up to the step (validation passes,
timing_s/testing, and start-up are left out, so runs with different val_every compare).

    .venv/bin/python tools/plot_learning_curve.py runs/countdown_warm_s1 runs/countdown_warm_s2 \
        --out docs/countdown_learning_curve.png
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from periodic_async.telemetry.logger import read_metrics  # noqa: E402


def accuracy_curve(records: list[dict], key: str | None = None) -> tuple[str, list[tuple[int, float, float]]]:
    """(the metric's key, [(step, training seconds so far, held-out accuracy)]) at every validation.
    key None: the run's one val-core/.../mean@n metric."""
    if key is None:
        keys = sorted({k for r in records for k in r if k.startswith("val-core/") and "/mean@" in k})
        if len(keys) != 1:
            raise ValueError(f"--metric: the run has {len(keys)} val-core mean@n metrics ({', '.join(keys) or 'none'}); "
                             "name one, and check trainer.val_every / data.val_size")
        key = keys[0]
    elapsed, points = 0.0, []
    for r in records:
        elapsed += float(r.get("timing_s/step", 0.0))
        if isinstance(r.get(key), (int, float)):
            points.append((int(r["step"]), elapsed, float(r[key])))
    return key, points


def first_reaching(points: list[tuple[int, float, float]], level: float) -> tuple[int, float] | None:
    """(step, seconds) of the first validation at or above `level`; None if none is."""
    return next(((s, t) for s, t, a in points if a >= level), None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dirs", nargs="+")
    ap.add_argument("--out", required=True, help="the PNG to write")
    ap.add_argument("--metric", default=None, help="default: the run's val-core/.../mean@n")
    ap.add_argument("--title", default="countdown: GRPO from the warm start (exact reward)")
    args = ap.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for run in args.run_dirs:
        key, points = accuracy_curve(read_metrics(run), args.metric)
        steps, secs, acc = zip(*points)
        label = os.path.basename(os.path.normpath(run))
        by_step.plot(steps, acc, marker=".", label=label)
        by_time.plot(secs, acc, marker=".", label=label)
        marks = ", ".join(f"{lvl}: " + (f"step {hit[0]}, {hit[1]:.0f} s" if (hit := first_reaching(points, lvl)) else "not reached")
                          for lvl in (0.5, 0.8))
        print(f"{run}: {key} {acc[0]:.3f} at step {steps[0]} -> {acc[-1]:.3f} at step {steps[-1]} "
              f"({secs[-1]:.0f} s of training); first at {marks}")
    for ax in (by_step, by_time):
        ax.axhline(0.8, color="grey", linestyle="--", linewidth=0.8)
        ax.grid(alpha=0.3)
    by_step.set_xlabel("step")
    by_time.set_xlabel("training wall-clock (s, validation excluded)")
    by_step.set_ylabel("held-out exact accuracy (mean of sampled)")
    by_step.legend(fontsize=8)
    fig.suptitle(args.title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
