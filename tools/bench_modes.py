"""Benchmark the training modes side by side: colocated sync, same-split sync, periodic (on CPU
with its worker sharing the trainer's cores, the default, and on split cores).

    python tools/bench_modes.py [--config configs/default.yaml] [--steps 14] [--warmup 4]
                                [--repeats 3] [--png docs/timeline_modes.png]
                                [--variants sync,sync_split,periodic_split,periodic] [key=value ...]

Besides the four named below, `--variants` takes async ones on split cores: `asyncE_split`
(trainer.max_staleness E, each batch trained at its own step) and `streamE_split` (the same eta,
streaming with trainer.stream_slack max(1, E // 2): a step takes the first groups to finish from
any batch), both with decoupled PPO. Every variant is compared with sync_split and its bound;
async ones with periodic_split too.

Each run is a fresh `python -m periodic_async` process; the modes alternate within each repeat so
that machine noise hits them alike. For each mode it prints tokens/s (whole job, steps after the
warm-up), the stage times, and the ratios, next to the theoretical bound of overlapping
generation with training, (T_gen + T_train) / max(T_gen, T_train), from the same-split sync
run's stage times (for the split-core variants). It also draws a timeline PNG (one row per worker
slot and one for the trainer: generate / train micro-step / weight update) for sync_split,
periodic_split and periodic.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

# name: (trainer.mode, overrides). On CPU the split modes' workers share the trainer's cores by
# default (rollout.cpu_cores: shared); `_split` variants give each stage its own cores, the
# setting under which (T_gen + T_train) / max(T_gen, T_train) bounds what overlap can gain.
VARIANTS = {"sync": ("sync", []),
            "sync_split": ("sync_split", ["rollout.cpu_cores=split"]),
            "periodic_split": ("periodic", ["rollout.cpu_cores=split"]),
            "periodic": ("periodic", [])}
MODES = list(VARIANTS)
MAX_SLOT_LANES = 16
DECOUPLED = ["actor.policy_loss=decoupled_ppo", "actor.behav_imp_weight_cap=5.0"]


def variant(name: str) -> tuple[str, list[str]]:
    """(trainer.mode, overrides) of a variant name (module docstring)."""
    if name in VARIANTS:
        return VARIANTS[name]
    m = re.fullmatch(r"(async|stream)(\d+)_split", name)
    if not m:
        sys.exit(f"--variants: unknown variant '{name}' (one of {', '.join(VARIANTS)}, asyncE_split, streamE_split)")
    eta = int(m.group(2))
    extra = ["rollout.cpu_cores=split", f"trainer.max_staleness={eta}", *DECOUPLED]
    if m.group(1) == "stream":
        if eta < 1:
            sys.exit(f"--variants: {name} needs eta >= 1")
        extra.append(f"trainer.stream_slack={max(1, eta // 2)}")
    return "async", extra


def run_once(config: str, variant_name: str, steps: int, run_dir: str, overrides: list[str]) -> list[dict]:
    mode, extra = variant(variant_name)
    cmd = [sys.executable, "-m", "periodic_async", "--config", config, f"trainer.mode={mode}", *extra,
           f"trainer.total_steps={steps}", f"trainer.run_dir={run_dir}", "trainer.progress_bar=false",
           "trainer.save_final=false", "trainer.record_timeline=true", "trainer.tensorboard=false", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"run failed ({mode}): {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def summarise(records: list[dict], warmup: int) -> dict:
    rs = records[warmup:]
    step_s = sum(r["timing_s/step"] for r in rs)
    mean = lambda k: statistics.fmean(r[k] for r in rs)
    return {"tokens_per_s": sum(r["perf/total_num_tokens"] for r in rs) / step_s,
            "step_s": mean("timing_s/step"), "gen_s": mean("timing_s/gen"), "train_s": mean("timing_s/update_actor"),
            "sync_s": mean("timing_s/update_weights"), "trainer_idle": mean("trainer/idle_ratio"),
            "rollouter_idle": mean("rollouter/idle_ratio"), "overlap": mean("perf/overlap_ratio")}


def draw_timeline(run_dirs: dict[str, str], steps: tuple[int, int], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = {"generate": "#4C72B0", "train": "#DD8452", "update_weights": "#55A868"}
    fig, axes = plt.subplots(len(run_dirs), 1, figsize=(12, 3.2 * len(run_dirs)), squeeze=False)
    for ax, (mode, run_dir) in zip(axes[:, 0], run_dirs.items()):
        with open(os.path.join(run_dir, "timeline.jsonl")) as f:
            events = [e for e in map(json.loads, f) if steps[0] <= e["step"] <= steps[1]]
        t0 = min(e["start"] for e in events)

        def lane_key(lane):
            if lane == "trainer":
                return (1, 0, 0)
            w, s = lane.split("/")
            return (0, int(w[6:]), int(s[4:]))
        # at most MAX_SLOT_LANES slot rows per worker stay readable; the trainer row is on top
        lanes = sorted({e["lane"] for e in events if e["lane"] == "trainer" or lane_key(e["lane"])[2] < MAX_SLOT_LANES},
                       key=lane_key)
        for i, lane in enumerate(lanes):
            for kind, color in colors.items():
                bars = [(e["start"] - t0, max(e["end"] - e["start"], 1e-4)) for e in events
                        if e["lane"] == lane and e["kind"] == kind]
                if bars:
                    ax.broken_barh(bars, (i - 0.4, 0.8), facecolors=color, label=kind)
        ax.set_yticks(range(len(lanes)))
        ax.set_yticklabels(lanes, fontsize=6)
        ax.set_xlabel("seconds")
        ax.set_title(f"{mode}: steps {steps[0]}-{steps[1]} (first {MAX_SLOT_LANES} slots of each worker shown)")
        handles, labels = ax.get_legend_handles_labels()
        uniq = dict(zip(labels, handles))
        ax.legend(uniq.values(), uniq.keys(), loc="upper right", fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/default.yaml")
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--png", default="docs/timeline_modes.png")
    p.add_argument("--variants", default=",".join(MODES))
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    if args.warmup >= args.steps:
        sys.exit("--warmup must be smaller than --steps")
    modes = [v for v in args.variants.split(",") if v]
    for v in modes:
        variant(v)
    if modes == MODES:
        return classic(args)
    tmp = tempfile.mkdtemp(prefix="bench_modes_")
    results = run_all(modes, args, tmp)
    compare(modes, results, args)
    print(f"runs: {tmp}")


def run_all(modes: list[str], args, tmp: str) -> dict[str, list[dict]]:
    """Every variant once per repeat, alternated."""
    results: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.repeats):
        for mode in modes:
            run_dir = os.path.join(tmp, f"{mode}_{r}")
            s = summarise(run_once(args.config, mode, args.steps, run_dir, args.overrides), args.warmup)
            results[mode].append(s)
            print(f"[repeat {r + 1}/{args.repeats}] {mode:16s} {s['tokens_per_s']:9.0f} tokens/s  "
                  f"step {s['step_s']:.3f} s  gen {s['gen_s']:.3f} s  train {s['train_s']:.3f} s", flush=True)
    return results


def compare(modes: list[str], results: dict, args) -> None:
    """Per variant: median tokens/s and stage times, its ratio to sync_split and to periodic_split
    per repeat (mean and range), and the share of sync_split's overlap bound it reaches."""
    def ratios(a, b):
        return [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(results[a], results[b])]

    def spread(xs):
        return f"{statistics.fmean(xs):.2f}x ({min(xs):.2f}-{max(xs):.2f})"
    bounds = ([(s["gen_s"] + s["train_s"]) / max(s["gen_s"], s["train_s"]) for s in results["sync_split"]]
              if "sync_split" in results else None)
    print(f"\n{args.repeats} repeats, steps {args.warmup + 1}-{args.steps} of each run (config {args.config} "
          f"{' '.join(args.overrides)})")
    print("| variant | tokens/s (median) | step s | T_gen s | T_train s | trainer idle | x sync_split | "
          "of the bound | x periodic_split |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m in modes:
        med = {k: statistics.median(x[k] for x in results[m]) for k in results[m][0]}
        vs_sync = ratios(m, "sync_split") if bounds else None
        of_bound = [r / b for r, b in zip(vs_sync, bounds)] if bounds else None
        vs_per = ratios(m, "periodic_split") if "periodic_split" in results else None
        print(f"| {m} | {med['tokens_per_s']:.0f} | {med['step_s']:.3f} | {med['gen_s']:.3f} | {med['train_s']:.3f} | "
              f"{med['trainer_idle']:.2f} | {spread(vs_sync) if vs_sync else '-'} | "
              f"{f'{statistics.fmean(of_bound):.0%}' if of_bound else '-'} | {spread(vs_per) if vs_per else '-'} |")
    if bounds:
        print(f"\noverlap bound (T_gen + T_train) / max from sync_split: {spread(bounds)}")


def classic(args) -> None:
    """The four modes of the default comparison, with the timeline PNG."""
    tmp = tempfile.mkdtemp(prefix="bench_modes_")
    results = run_all(MODES, args, tmp)
    med = {m: {k: statistics.median(x[k] for x in results[m]) for k in results[m][0]} for m in MODES}
    # Ratios are taken within each repeat (runs next to each other in time see the same machine
    # speed), then the median over repeats: this machine's speed drifts by tens of percent.
    bounds = [(s["gen_s"] + s["train_s"]) / max(s["gen_s"], s["train_s"]) for s in results["sync_split"]]
    r_split = [p["tokens_per_s"] / s["tokens_per_s"] for p, s in zip(results["periodic_split"], results["sync_split"])]
    r_coloc = [p["tokens_per_s"] / s["tokens_per_s"] for p, s in zip(results["periodic"], results["sync"])]
    of_bound = [r / b for r, b in zip(r_split, bounds)]
    bound, ratio_split, ratio_coloc = map(statistics.median, (bounds, r_split, r_coloc))
    print(f"\nmedians over {args.repeats} repeats, steps {args.warmup + 1}-{args.steps} of each run "
          f"(config {args.config} {' '.join(args.overrides)})")
    print(f"| mode | tokens/s | step s | T_gen s | T_train s | weight sync s | trainer idle | rollouter idle | overlap |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m in MODES:
        x = med[m]
        print(f"| {m} | {x['tokens_per_s']:.0f} | {x['step_s']:.3f} | {x['gen_s']:.3f} | {x['train_s']:.3f} | "
              f"{x['sync_s']:.4f} | {x['trainer_idle']:.2f} | {x['rollouter_idle']:.2f} | {x['overlap']:.2f} |")
    print(f"\nper repeat: periodic_split / sync_split = {', '.join(f'{x:.3f}' for x in r_split)}; "
          f"bound = {', '.join(f'{x:.3f}' for x in bounds)}; of bound = {', '.join(f'{x:.0%}' for x in of_bound)}")
    print(f"median: periodic_split / sync_split = {ratio_split:.3f}   theoretical bound (T_gen + T_train) / max = {bound:.3f}"
          f"   -> {statistics.median(of_bound):.1%} of the bound (target >= 85%)")
    r_split_coloc = [p["tokens_per_s"] / s["tokens_per_s"] for p, s in zip(results["periodic_split"], results["sync"])]
    print(f"median: periodic (shared cores, the default) / colocated sync = {ratio_coloc:.3f} "
          f"(per repeat {', '.join(f'{x:.3f}' for x in r_coloc)}); periodic_split / colocated sync = "
          f"{statistics.median(r_split_coloc):.3f}")
    last = args.repeats - 1
    draw_timeline({m: os.path.join(tmp, f"{m}_{last}") for m in ("sync_split", "periodic_split", "periodic")},
                  (args.steps - 2, args.steps - 1), args.png)
    print(f"timeline: {args.png}   runs: {tmp}")


if __name__ == "__main__":
    main()
