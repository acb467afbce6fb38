"""Micro-batches by token budget against fixed counts, on the long_tail task (response lengths
1..48 with a long tail: where a fixed count of sequences pads most).

    python tools/bench_micro_batch_tokens.py [--steps 20] [--repeats 3] [--variants fixed32,tokens3072,...] [overrides...]

A variant is `fixedN` (actor.micro_batch_size=N) or `tokensT` (actor.micro_batch_tokens=T). The
defaults pair each fixed count with the budget that bounds memory alike: 32 sequences of at most
48 + 48 tokens = 3072 tokens, and 8 x 96 = 768. Each run is `python -m periodic_async --config
configs/long_tail.yaml` (periodic mode, the default) with the same seed, the variants alternated
within each repeat so a slow phase of the machine hits all of them. Per run, over the steps after
the first two (warm-up): mean step time (timing_s/step), training time (timing_s/update_actor:
forward, backward and optimizer, the waits for groups excluded), the padding share of the packed
tensors (micro_batch/padding_ratio), real and padding micro-steps. Prints a table per run and the
mean and spread (min..max) per variant; --png writes a bar chart.
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
KEYS = {"step_s": "timing_s/step", "train_s": "timing_s/update_actor", "padding": "micro_batch/padding_ratio",
        "micro_steps": "micro_batch/micro_steps", "padding_steps": "micro_batch/padding_micro_steps"}


def _override(variant: str) -> str:
    if variant.startswith("fixed"):
        return f"actor.micro_batch_size={int(variant[5:])}"
    if variant.startswith("tokens"):
        return f"actor.micro_batch_tokens={int(variant[6:])}"
    raise SystemExit(f"--variants: '{variant}' is neither fixedN nor tokensT")


def _run(variant: str, run_dir: str, steps: int, overrides: list[str]) -> dict:
    cmd = [sys.executable, "-m", "periodic_async", "--config", "configs/long_tail.yaml", f"trainer.run_dir={run_dir}",
           f"trainer.total_steps={steps}", "trainer.progress_bar=false", "trainer.save_final=false",
           _override(variant), *overrides]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{variant}: the run failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    rows = [r for r in rows if "timing_s/step" in r][2:]
    out = {k: statistics.mean(r[m] for r in rows) for k, m in KEYS.items()}
    out["wall_s"] = wall
    out["score"] = rows[-1].get("critic/score/mean", float("nan"))
    return out


def _spread(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.3f} ({min(xs):.3f}..{max(xs):.3f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", default="fixed32,tokens3072,fixed8,tokens768")
    ap.add_argument("--png", default=None, help="write a bar chart of step and training time here")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    variants = args.variants.split(",")
    for v in variants:
        _override(v)
    results: dict[str, list[dict]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="bench_mbt_") as tmp:
        for i in range(args.repeats):
            for v in variants:
                r = _run(v, os.path.join(tmp, f"{v}-{i}"), args.steps, args.overrides)
                results[v].append(r)
                print(f"repeat {i + 1} {v:>11}: step {r['step_s']:.3f} s, train {r['train_s']:.3f} s, padding "
                      f"{r['padding']:.3f}, micro-steps {r['micro_steps']:.1f} + {r['padding_steps']:.1f} padding, "
                      f"wall {r['wall_s']:.1f} s, score {r['score']:.3f}", flush=True)
    print(f"\nlong_tail, periodic, {args.steps} steps (mean over steps 3..), {args.repeats} alternated repeats: "
          "mean (min..max)")
    print(f"{'variant':>11} | {'step s':>20} | {'train s':>20} | {'padding share':>20} | {'micro-steps':>20} | "
          f"{'padding steps':>14}")
    for v in variants:
        rs = results[v]
        print(f"{v:>11} | {_spread([r['step_s'] for r in rs]):>20} | {_spread([r['train_s'] for r in rs]):>20} | "
              f"{_spread([r['padding'] for r in rs]):>20} | {_spread([r['micro_steps'] for r in rs]):>20} | "
              f"{statistics.mean(r['padding_steps'] for r in rs):>14.1f}")
    if args.png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
        for ax, key, title in zip(axes, ("step_s", "train_s", "padding"),
                                  ("step time (s)", "training time per step (s)", "padding share of packed tokens")):
            means = [statistics.mean(r[key] for r in results[v]) for v in variants]
            lo = [m - min(r[key] for r in results[v]) for m, v in zip(means, variants)]
            hi = [max(r[key] for r in results[v]) - m for m, v in zip(means, variants)]
            ax.bar(variants, means, yerr=[lo, hi], capsize=4, color=["C0" if v.startswith("fixed") else "C1"
                                                                     for v in variants])
            ax.set_title(title, fontsize=10)
            ax.tick_params(axis="x", labelsize=8)
        fig.suptitle(f"long_tail, periodic: fixed counts vs token budgets ({args.repeats} repeats, min..max)",
                     fontsize=10)
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
