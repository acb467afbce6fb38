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

Issue 28's accuracy and VCPO experiments name their variants instead (`--variants`), validate
every `--val-every` steps, vary the seed per repeat and report per variant over the seeds (mean and
range): steps, rollouts and wall-clock to each `--targets` accuracy, the final held-out reward, ESS / N,
the share of steps under 0.6 N and the gradient-norm variance. A variant's name is built from

    periodic | asyncE | streamE          E = trainer.max_staleness; streamE streams with
                                         trainer.stream_slack max(1, E // 2) (tools/bench_modes.py)
    [_drained]                           rollout.interruptible=false: workers finish their batch
    [_lr | _baseline | _both]            VCPO's lr control, its baseline, or both

e.g. `--variants periodic,async1,async4,async8` (accuracy) or
`--variants periodic,async8_drained,async8_drained_lr,async8_drained_baseline,async8_drained_both`
(the VCPO ablation: the degradation first, then each part). Every async variant uses decoupled PPO.
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_allocation import ROOT, curve, run_once  # noqa: E402 - the same subprocess runner

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


def named_variant(name: str) -> tuple[str, list[str]]:
    """(trainer.mode, overrides) for a variant named as the module docstring says."""
    m = re.fullmatch(r"(periodic|(async|stream)(\d+))(_drained)?(?:_(lr|baseline|both))?", name)
    if m is None or (m.group(1) == "periodic" and (m.group(4) or m.group(5))):
        sys.exit(f"--variants: unknown variant '{name}' (periodic, asyncE or streamE, then _drained, "
                 f"then _lr, _baseline or _both)")
    if m.group(1) == "periodic":
        return "periodic", []
    eta = int(m.group(3))
    extra = [f"trainer.max_staleness={eta}", *DECOUPLED]
    if m.group(2) == "stream":
        extra.append(f"trainer.stream_slack={max(1, eta // 2)}")
    if m.group(4):
        extra.append("rollout.interruptible=false")
    extra += {None: [], "lr": VCPO, "baseline": VCPO_BASELINE, "both": VCPO + VCPO_BASELINE}[m.group(5)]
    return "async", extra


def summarise(records: list[dict], val_key: str, targets: tuple[float, ...] = ()) -> dict:
    steps = [r for r in records if r.get("step", 0) > 0]
    vals = [r[val_key] for r in records if val_key in r]
    wall = sum(r["timing_s/step"] for r in steps)
    tokens = sum(r.get("perf/total_num_tokens", 0) for r in steps)
    tail = steps[-max(1, len(steps) // 4):]
    ess = [r["vcpo/ess_ratio"] for r in steps if "vcpo/ess_ratio" in r]
    gnorm = [r["actor/grad_norm"] for r in steps]
    held_out = curve(records, val_key)     # (step, rollouts, wall s of training steps, reward) per validation
    t, per_step = 0.0, []
    for r in steps:
        t += r["timing_s/step"]
        per_step.append((r["step"], t, r.get("critic/score/mean", float("nan")), r.get("vcpo/ess_ratio", 1.0),
                         r["actor/grad_norm"]))
    return {"wall_s": wall, "step_s": wall / len(steps), "tok_s": tokens / wall,
            "train_reward": statistics.fmean(r.get("critic/score/mean", 0.0) for r in tail),
            "val_first": vals[0] if vals else float("nan"), "val_last": vals[-1] if vals else float("nan"),
            "staleness": statistics.fmean(r["training/off_policy/trajectory_staleness/mean"] for r in steps),
            "staleness_max": max(r["training/off_policy/trajectory_staleness/max"] for r in steps),
            "interrupted": statistics.fmean(r.get("rollout/interrupted_ratio", 0.0) for r in steps),
            "ess_mean": statistics.fmean(ess) if ess else 1.0, "ess_min": min(ess) if ess else 1.0,
            "ess_low": sum(e < 0.6 for e in ess) / len(ess) if ess else 0.0,
            "gnorm_mean": statistics.fmean(gnorm), "gnorm_var": statistics.pvariance(gnorm), "curve": per_step,
            "val_curve": held_out,
            # (step, rollouts, wall s) of the first validation at or above each target; None: never
            "reach": {t: next(((st, n, w) for st, n, w, v in held_out if v >= t), None) for t in targets}}


def spread(xs: list[float], fmt: str) -> str:
    """'mean (min..max)' of the values, or the one value."""
    if not xs:
        return "-"
    if len(xs) == 1:
        return format(xs[0], fmt)
    return f"{format(statistics.fmean(xs), fmt)} ({format(min(xs), fmt)}..{format(max(xs), fmt)})"


def seed_table(results: dict, targets: list[float]) -> list[str]:
    """One row per variant over its repeats (seeds): mean (range). Steps, rollouts and wall-clock to a
    target are over the seeds that reached it, with how many did."""
    head = ["variant", "seeds", "final held-out", "best held-out"]
    for t in targets:
        head += [f"reached {t}", f"steps to {t}", f"rollouts to {t}", f"wall s to {t}"]
    head += ["step s", "staleness mean", "ESS/N mean", "steps ESS/N < 0.6", "grad-norm var",
             "train reward (last 1/4)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for v in dict.fromkeys(name for name, _ in results):
        runs = [s for (name, _), s in results.items() if name == v]
        row = [v, str(len(runs)), spread([s["val_curve"][-1][3] for s in runs], ".3f"),
               spread([max(x[3] for x in s["val_curve"]) for s in runs], ".3f")]
        for t in targets:
            hits = [s["reach"][t] for s in runs if s["reach"].get(t) is not None]
            row += [f"{len(hits)} / {len(runs)}", spread([h[0] for h in hits], ".0f"),
                    spread([h[1] for h in hits], ".0f"), spread([h[2] for h in hits], ".0f")]
        row += [spread([s["step_s"] for s in runs], ".3f"), spread([s["staleness"] for s in runs], ".2f"),
                spread([s["ess_mean"] for s in runs], ".3f"), spread([100 * s["ess_low"] for s in runs], ".0f") + " %",
                spread([s["gnorm_var"] for s in runs], ".4f"), spread([s["train_reward"] for s in runs], ".3f")]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def plot_seeds(results: dict, path: str, title: str, val_key: str) -> None:
    """Held-out reward against steps and wall-clock (mean over seeds, band min..max), ESS / N and the
    gradient norm per step (10-step means, mean over seeds)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 4, figsize=(22, 4.8))
    names = list(dict.fromkeys(v for v, _ in results))
    for i, v in enumerate(names):
        runs = [s for (name, _), s in results.items() if name == v]
        kw = dict(color=f"C{i}", linestyle="--" if re.search(r"_(lr|baseline|both)$", v) else "-",
                  linewidth=2.2 if v == "periodic" else 1.4)
        n = min(len(s["val_curve"]) for s in runs)
        steps = [x[0] for x in runs[0]["val_curve"][:n]]
        vals = [[s["val_curve"][j][3] for s in runs] for j in range(n)]
        walls = [statistics.fmean(s["val_curve"][j][2] for s in runs) for j in range(n)]
        mean = [statistics.fmean(x) for x in vals]
        for ax, xs in ((axes[0], steps), (axes[1], walls)):
            ax.plot(xs, mean, label=f"{v} ({len(runs)} seeds)", marker=".", **kw)
            ax.fill_between(xs, [min(x) for x in vals], [max(x) for x in vals], color=f"C{i}", alpha=0.12)
        m = min(len(s["curve"]) for s in runs)
        for ax, col in ((axes[2], 3), (axes[3], 4)):
            ax.plot([runs[0]["curve"][j][0] for j in range(m)],
                    smooth([statistics.fmean(s["curve"][j][col] for s in runs) for j in range(m)]), **kw)
    axes[0].set(xlabel="step", ylabel=f"{val_key} (mean, band: min..max)")
    axes[1].set(xlabel="wall-clock s (training steps; mean over seeds)", ylabel=val_key)
    axes[2].set(xlabel="step", ylabel="vcpo/ess_ratio (ESS / N, 10-step mean)")
    axes[3].set(xlabel="step", ylabel="actor/grad_norm (10-step mean)")
    finish(fig, axes, f"{title}: periodic against bounded-staleness async over seeds (dashed: with VCPO parts)",
           path, legend_size=8)


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
    finish(fig, axes, f"{title}: periodic against bounded-staleness async (dashed: with VCPO)", path, legend_size=7)


def smooth(xs: list[float], w: int = 10) -> list[float]:
    """Trailing mean over w points."""
    return [statistics.fmean(xs[max(0, i - w + 1):i + 1]) for i in range(len(xs))]


def finish(fig, axes, title: str, path: str, legend_size: int) -> None:
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=legend_size)
    fig.suptitle(title)
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
    p.add_argument("--variants", default=None,
                   help="named variants (module docstring); replaces --etas / --vcpo / --vcpo-baseline")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--vary-seed", action="store_true", help="repeat r runs with trainer.seed=1+r (else all seed 1)")
    p.add_argument("--val-every", type=int, default=None, help="validate every N steps (default: first and last only)")
    p.add_argument("--val-metric", default="mean", choices=("mean", "greedy"),
                   help="mean@4 of the sampled responses, or greedy@1")
    p.add_argument("--targets", default="", help="held-out accuracies to report steps / wall-clock to, e.g. 0.5,0.6")
    p.add_argument("--val-size", type=int, default=128)
    p.add_argument("--png", default=None)
    p.add_argument("--write-docs", default=None, help="put the table into this markdown file")
    p.add_argument("--doc-block", default="async-bench")
    p.add_argument("--keep-runs", default=None)
    p.add_argument("--reuse-runs", action="store_true")
    p.add_argument("overrides", nargs="*", help="key=value for every run")
    args = p.parse_args()
    etas = [int(e) for e in args.etas.split(",") if e]
    val_key = ("val-core/synthetic/reward/greedy@1" if args.val_metric == "greedy"
               else "val-core/synthetic/reward/mean@4")
    targets = [float(t) for t in args.targets.split(",") if t]
    val_every = args.val_every or args.steps
    overrides = [f"data.val_size={args.val_size}", "trainer.val_n=4",
                 *args.overrides]
    root = args.keep_runs or tempfile.mkdtemp(prefix="bench_async_")
    results = {}
    table_variants = (variants(etas, args.vcpo, args.vcpo_baseline) if args.variants is None
                      else {v: named_variant(v) for v in args.variants.split(",") if v})
    print(f"{args.config}: {args.steps} steps, {list(table_variants)}, {args.repeats} repeats; runs in {root}", flush=True)
    for rep in range(args.repeats):
        for name, (mode, extra) in table_variants.items():
            run_dir = os.path.join(root, name.replace(" ", "_").replace("=", "").replace("+", "") + f"_{rep}")
            # val_every = steps (the default): held-out reward before the first and after the last step only
            seed = [f"trainer.seed={1 + rep}"] if args.vary_seed else []
            records = run_once(args.config, mode, "grpo", args.steps, val_every, run_dir,
                               [*overrides, *extra, *seed], reuse=args.reuse_runs)
            results[(name, rep)] = summarise(records, val_key, tuple(targets))
    lines = table(results)
    if args.variants is not None:
        lines = seed_table(results, targets) + [""] + lines
    print("\n".join(lines))
    title = os.path.splitext(os.path.basename(args.config))[0]
    if args.png and args.variants is None:
        plot(results, args.png, title)
    elif args.png:
        plot_seeds(results, args.png, title, val_key)
    if args.write_docs:
        from docblock import replace_block
        cmd = "python tools/bench_async.py " + " ".join(sys.argv[1:])
        head = [f"Command: `{cmd}`", "",
                f"Run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {args.steps} steps per run, "
                f"{args.repeats} repeat(s){' (seeds 1..' + str(args.repeats) + ')' if args.vary_seed else ''}; "
                f"held-out `{val_key}` on {args.val_size} prompts every {val_every} steps.", ""]
        replace_block(args.write_docs, args.doc_block, head + lines)


if __name__ == "__main__":
    main()
