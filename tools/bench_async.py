"""Bounded-staleness async against periodic, side by side (docs/async.md, docs/performance.md).

    python tools/bench_async.py [--config configs/long_tail.yaml] [--steps 150] [--etas 1,2,4,8]
                                [--vcpo both|off|on] [--repeats 1] [--png docs/async_curves.png]
                                [--write-docs docs/performance.md] [--keep-runs DIR] [key=value ...]

Runs, each a fresh `python -m periodic_async` process, in a fixed alternating order per repeat:
periodic (strictly on-policy, GRPO loss), then for each eta `async` with trainer.max_staleness =
eta and AReaL's decoupled PPO (behaviour-weight cap 5), without and/or with VCPO's
learning-rate control (actor.vcpo_lr_scale: the step's learning rate times sqrt(ESS / N)).
`--vcpo-baseline` adds VCPO's baseline (algo.adv_estimator vcpo_baseline, (r - b*) / std) to the
VCPO variants; like GRPO's it divides by the group's std, so the advantage scale is comparable.

Per run: wall-clock (the sum of `timing_s/step`: the trainer's view, validation excluded),
throughput (tokens of the trained samples per second of that wall-clock), the speed-up over
periodic, the training reward of the last quarter of the steps, the held-out reward after the
last step (`val-core/.../mean@4`; validation runs only before the first and after the last step,
so it steals no time from a run that is generating ahead), staleness, ESS / N (mean, min, share of
steps under 0.6), the gradient norm's mean and variance. The PNG: training reward against
wall-clock, ESS / N and the gradient norm per step.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_allocation import ROOT, run_once  # noqa: E402 - the same subprocess runner

DECOUPLED = ["actor.policy_loss=decoupled_ppo", "actor.behav_imp_weight_cap=5.0"]
VCPO = ["actor.vcpo_lr_scale=true"]
VCPO_BASELINE = ["algo.adv_estimator=vcpo_baseline"]


def variants(etas: list[int], vcpo: str, baseline: bool = False) -> dict[str, tuple[str, list[str]]]:
    """name -> (trainer.mode, overrides)."""
    vcpo_keys = VCPO + (VCPO_BASELINE if baseline else [])
    out = {"periodic": ("periodic", [])}
    for eta in etas:
        if vcpo in ("both", "off"):
            out[f"async eta={eta}"] = ("async", [f"trainer.max_staleness={eta}", *DECOUPLED])
        if vcpo in ("both", "on"):
            out[f"async eta={eta} +vcpo"] = ("async", [f"trainer.max_staleness={eta}", *DECOUPLED, *vcpo_keys])
    return out


def summarise(records: list[dict], val_key: str) -> dict:
    steps = [r for r in records if r.get("step", 0) > 0]
    vals = [r[val_key] for r in records if val_key in r]
    wall = sum(r["timing_s/step"] for r in steps)
    tokens = sum(r.get("perf/total_num_tokens", 0) for r in steps)
    tail = steps[-max(1, len(steps) // 4):]
    ess = [r["vcpo/ess_ratio"] for r in steps if "vcpo/ess_ratio" in r]
    gnorm = [r["actor/grad_norm"] for r in steps]
    t, curve = 0.0, []
    for r in steps:
        t += r["timing_s/step"]
        curve.append((r["step"], t, r.get("critic/score/mean", float("nan")), r.get("vcpo/ess_ratio", 1.0),
                      r["actor/grad_norm"]))
    return {"wall_s": wall, "step_s": wall / len(steps), "tok_s": tokens / wall,
            "train_reward": statistics.fmean(r.get("critic/score/mean", 0.0) for r in tail),
            "val_first": vals[0] if vals else float("nan"), "val_last": vals[-1] if vals else float("nan"),
            "staleness": statistics.fmean(r["training/off_policy/trajectory_staleness/mean"] for r in steps),
            "staleness_max": max(r["training/off_policy/trajectory_staleness/max"] for r in steps),
            "interrupted": statistics.fmean(r.get("rollout/interrupted_ratio", 0.0) for r in steps),
            "ess_mean": statistics.fmean(ess) if ess else 1.0, "ess_min": min(ess) if ess else 1.0,
            "ess_low": sum(e < 0.6 for e in ess) / len(ess) if ess else 0.0,
            "gnorm_mean": statistics.fmean(gnorm), "gnorm_var": statistics.pvariance(gnorm), "curve": curve}


def table(results: dict) -> list[str]:
    head = ["variant", "repeat", "wall s", "step s", "tok/s", "speed-up", "train reward (last 1/4)",
            "held-out before -> after", "staleness mean / max", "interrupted", "ESS/N mean / min",
            "steps ESS/N < 0.6", "grad-norm mean / var"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base = {rep: s["step_s"] for (v, rep), s in results.items() if v == "periodic"}
    for (v, rep), s in results.items():
        speed = base[rep] / s["step_s"] if rep in base else float("nan")
        lines.append("| " + " | ".join([
            v, str(rep + 1), f"{s['wall_s']:.0f}", f"{s['step_s']:.3f}", f"{s['tok_s']:.0f}", f"{speed:.2f}x",
            f"{s['train_reward']:.3f}", f"{s['val_first']:.3f} -> {s['val_last']:.3f}",
            f"{s['staleness']:.2f} / {s['staleness_max']:.0f}", f"{s['interrupted']:.1%}",
            f"{s['ess_mean']:.3f} / {s['ess_min']:.3f}", f"{s['ess_low']:.0%}",
            f"{s['gnorm_mean']:.3f} / {s['gnorm_var']:.4f}"]) + " |")
    return lines


def plot(results: dict, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(xs, w=10):
        return [statistics.fmean(xs[max(0, i - w + 1):i + 1]) for i in range(len(xs))]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.6))
    names = list(dict.fromkeys(v for v, _ in results))
    colours = {v: f"C{i}" for i, v in enumerate(names)}
    for (v, rep), s in results.items():
        c = s["curve"]
        kw = dict(color=colours[v], alpha=1.0 if rep == 0 else 0.5, label=v if rep == 0 else None,
                  linestyle="--" if "vcpo" in v else "-", linewidth=2.2 if v == "periodic" else 1.2)
        axes[0].plot([x[1] for x in c], smooth([x[2] for x in c]), **kw)
        axes[1].plot([x[0] for x in c], [x[3] for x in c], **kw)
        axes[2].plot([x[0] for x in c], smooth([x[4] for x in c]), **kw)
    axes[0].set(xlabel="wall-clock s (training steps)", ylabel="critic/score/mean (10-step mean)")
    axes[1].set(xlabel="step", ylabel="vcpo/ess_ratio (ESS / N)")
    axes[2].set(xlabel="step", ylabel="actor/grad_norm (10-step mean)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{title}: periodic against bounded-staleness async (dashed: with VCPO)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "long_tail.yaml"))
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--etas", default="1,2,4,8")
    p.add_argument("--vcpo", default="both", choices=("both", "off", "on"))
    p.add_argument("--vcpo-baseline", action="store_true",
                   help="VCPO variants also use the (r - b*) / std baseline")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--val-size", type=int, default=128)
    p.add_argument("--png", default=None)
    p.add_argument("--write-docs", default=None, help="put the table into this markdown file")
    p.add_argument("--doc-block", default="async-bench")
    p.add_argument("--keep-runs", default=None)
    p.add_argument("--reuse-runs", action="store_true")
    p.add_argument("overrides", nargs="*", help="key=value for every run")
    args = p.parse_args()
    etas = [int(e) for e in args.etas.split(",") if e]
    val_key = "val-core/synthetic/reward/mean@4"
    overrides = [f"data.val_size={args.val_size}", "trainer.val_n=4",
                 *args.overrides]
    root = args.keep_runs or tempfile.mkdtemp(prefix="bench_async_")
    results = {}
    table_variants = variants(etas, args.vcpo, args.vcpo_baseline)
    print(f"{args.config}: {args.steps} steps, {list(table_variants)}, {args.repeats} repeats; runs in {root}", flush=True)
    for rep in range(args.repeats):
        for name, (mode, extra) in table_variants.items():
            run_dir = os.path.join(root, name.replace(" ", "_").replace("=", "").replace("+", "") + f"_{rep}")
            # val_every = steps: held-out reward before the first and after the last step only
            records = run_once(args.config, mode, "grpo", args.steps, args.steps, run_dir, [*overrides, *extra],
                               reuse=args.reuse_runs)
            results[(name, rep)] = summarise(records, val_key)
    lines = table(results)
    print("\n".join(lines))
    title = os.path.splitext(os.path.basename(args.config))[0]
    if args.png:
        plot(results, args.png, title)
    if args.write_docs:
        from docblock import replace_block
        cmd = "python tools/bench_async.py " + " ".join(sys.argv[1:])
        head = [f"Command: `{cmd}`", "",
                f"Run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {args.steps} steps per run, "
                f"{args.repeats} repeat(s); held-out `{val_key}` on {args.val_size} prompts.", ""]
        replace_block(args.write_docs, args.doc_block, head + lines)


if __name__ == "__main__":
    main()
