"""Rollout allocation and group sizing, side by side (allocation on the default next_digit job,
which learns in a few hundred steps; group sizing on long_tail, whose lengths vary).

    python tools/bench_allocation.py [--config configs/long_tail.yaml] [--steps 150] [--modes sync,periodic]
                                     [--variants grpo,backfill,pilot] [--repeats 1] [--val-every 10]
                                     [--targets 0.3,0.4] [--png docs/allocation_curves.png]
                                     [--write-docs docs/performance.md] [key=value ...]

Each run is a fresh `python -m periodic_async` process; within a repeat the (mode, variant) runs
alternate in a fixed order, so machine drift hits them alike. The policy's quality is the held-out
validation reward (data.val_size prompts, greedy and val_n samples, every --val-every steps), the
same prompts for every variant - `critic/score/mean` would not do: pilot and backfill choose which
groups are trained on, and pilot stops drawing solved prompts. Wall-clock is the sum of the steps'
`timing_s/step` (validation excluded), rollouts the sum of `rollout/generated`.

Variants: grpo (plain), backfill (rollout.backfill), pilot (rollout.pilot with success = reward
>= 0.3: the right digit on next_digit, at least half the answer on long_tail. A random-init model
rarely answers exactly, so the default success_threshold 1.0 defers nearly every prompt; on
long_tail 0.1, the first character, is met by nearly every sample within a few steps, so two
successful pilots mark almost every prompt solved and the run starves), fixed4 / fixed8 / fixed16 (rollout.n)
sagc (rollout.group_sizing: sagc from rollout.n = 8), sagc_group (its per-group straggler statistic)
sagc_prior (with the prompt prior) and sagc_seedforget (the seed's forgetting rule,
rollout.sagc.forgetting: seed). --vary-seed: repeat r runs with trainer.seed = 1 + r. Pilot and backfill are not combined: the
configuration refuses it (one selection rule at a time). pilot_official pilots 3B prompts a round with a budget of ~10 rounds (the official script's
step, B = 32 and K = 8 assumed); pilot_noevict never evicts; pilot_noevict_reuse also reuses stored
pilot rollouts within eta (async only: --modes async trainer.max_staleness=N). pilot_v0 is the first version's pilot rule
(docs/allocation.md), kept to reproduce the numbers measured with it.

Per run it prints: steps, rollouts and wall-clock until the validation reward first reaches each
target, the final and best validation reward, mean step time, the generation tail (seconds a step's
generation ran with at most half its responses still going: rollouter/tail_s), and the
straggler-step rate (share of steps whose longest response is over tau = 2 x the median, SAGC's event). The PNG has the
validation reward against rollouts and against wall-clock, one line per run.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

VARIANTS = {
    "grpo": [],
    "backfill": ["rollout.selection=backfill"],
    # the official rule (n_pilot K / 4, band [1/8, 3/4], evicted at 1.0 from the next epoch, fresh fills)
    "pilot": ["rollout.selection=pilot", "rollout.pilot.success_threshold=0.3"],
    # 64 prompts piloted per round (2B at the configs' B = 32): 2B x n_pilot pilot rollouts leave
    # B x (K - 2 n_pilot) of the B x K budget for commits, so more passers are found when most fail
    "pilot2b": ["rollout.selection=pilot", "rollout.pilot.success_threshold=0.3",
                "rollout.pilot.num_candidates=64"],
    # the official script's step: 3B prompts piloted a round (gen batch 3B) and up to ~10 rounds
    # (max_num_gen_batches 10), so a step keeps piloting until B pass: rollouts per step above B x K
    # (budget 2560 = 10 x 96 x 2 pilots + 32 x 6 commits at B = 32, K = 8), all counted
    "pilot_official": ["rollout.selection=pilot", "rollout.pilot.success_threshold=0.3",
                       "rollout.pilot.num_candidates=96", "rollout.pilot.budget=2560"],
    # the official rule without eviction: at K = 8, n_pilot is 2, and 2 of 2 successes evict a
    # prompt whose success rate is only 0.5 one time in four
    "pilot_noevict": ["rollout.selection=pilot", "rollout.pilot.success_threshold=0.3",
                      "rollout.pilot.evict_at=null"],
    # the first version's rule (PilotConfig.v0 with p_lower 0, p_upper 1), for the numbers measured with it
    "pilot_v0": ["rollout.selection=pilot", "rollout.pilot.success_threshold=0.3", "rollout.pilot.n_pilot=2",
                 "rollout.pilot.pass_lower=0.5", "rollout.pilot.pass_upper=0.5", "rollout.pilot.evict_from=now",
                 "rollout.pilot.fill_from=reserve"],
    "fixed4": ["rollout.n=4"],
    "fixed8": ["rollout.n=8"],
    "fixed16": ["rollout.n=16"],
    "sagc": ["rollout.group_sizing=sagc", "rollout.n=8"],
    # SAGC with the per-group straggler statistic, and with the prompt prior
    "sagc_group": ["rollout.group_sizing=sagc", "rollout.n=8", "rollout.sagc.straggler_statistic=group"],
    "sagc_prior": ["rollout.group_sizing=sagc", "rollout.n=8", "rollout.sagc.prompt_prior=true"],
    # SAGC with the seed's forgetting (played arm only, towards Beta(0, 0)) instead of towards the prior
    "sagc_seedforget": ["rollout.group_sizing=sagc", "rollout.n=8", "rollout.sagc.forgetting=seed"],
    # pilot without eviction, reusing stored pilot rollouts within eta (async only: trainer.mode async,
    # trainer.max_staleness > 0)
    "pilot_noevict_reuse": ["rollout.selection=pilot", "rollout.pilot.success_threshold=0.3",
                            "rollout.pilot.evict_at=null", "rollout.pilot.reuse_pilots=true"],
}
TAU = 2.0


def log(msg: str) -> None:
    print(f"[bench_allocation {datetime.datetime.now(datetime.timezone.utc):%H:%M:%S}] {msg}", flush=True)


def run_once(config: str, mode: str, variant: str, steps: int, val_every: int, run_dir: str,
             overrides: list[str], reuse: bool = False) -> list[dict]:
    """One run's metrics records; with `reuse`, those of a finished run already in run_dir."""
    done = os.path.join(run_dir, "metrics.jsonl")
    if reuse and os.path.exists(done):
        with open(done) as f:
            records = [json.loads(line) for line in f]
        if max((r.get("step", 0) for r in records), default=0) >= steps:
            log(f"  {mode} {variant}: reusing {run_dir}")
            return records
    cmd = [sys.executable, "-m", "periodic_async", "--config", config, f"trainer.mode={mode}", *VARIANTS[variant],
           f"trainer.total_steps={steps}", f"trainer.run_dir={run_dir}", "trainer.progress_bar=false",
           "trainer.save_final=false", "trainer.tensorboard=false", "trainer.save_every=0",
           f"trainer.val_every={val_every}", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if proc.returncode != 0:
        sys.exit(f"run failed ({mode} {variant}): {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    log(f"  {mode} {variant}: {steps} steps in {time.time() - t0:.0f} s")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def curve(records: list[dict], val_key: str) -> list[tuple[int, int, float, float]]:
    """(step, rollouts so far, wall-clock s so far, validation reward) at each validation (step 0:
    before training)."""
    out, rollouts, wall = [], 0, 0.0
    for r in records:
        if r.get("step", 0) > 0:
            rollouts += int(r.get("rollout/generated", 0))
            wall += r.get("timing_s/step", 0.0)
        if val_key in r:
            out.append((r.get("step", 0), rollouts, wall, r[val_key]))
    return out


def summarise(records: list[dict], val_key: str, targets: list[float]) -> dict:
    steps = [r for r in records if r.get("step", 0) > 0]
    c = curve(records, val_key)
    stragglers = [r["response_length/max"] > TAU * r["response_length/median"] for r in steps
                  if "response_length/median" in r]
    out = {"curve": c, "final": c[-1][3], "best": max(v for *_, v in c),
           "step_s": statistics.fmean(r["timing_s/step"] for r in steps),
           "rollouts": sum(int(r.get("rollout/generated", 0)) for r in steps),
           "wall_s": sum(r["timing_s/step"] for r in steps),
           "straggler_rate": statistics.fmean(stragglers) if stragglers else float("nan"),
           # over the steps that trained on something (an empty step has no group size)
           "group_size": statistics.fmean([r.get("sagc/group_size", r.get("rollout/group_size/mean", 0)) for r in steps
                                           if r.get("training/empty_batch", 0) != 1] or [float("nan")]),
           "empty_steps": sum(1 for r in steps if r.get("training/empty_batch", 0) == 1),
           "trainable": statistics.fmean(r.get("alloc/trainable_groups", float("nan")) for r in steps),
           # seconds a step's generation spent with at most half its responses still running
           "tail_s": statistics.fmean([r["rollouter/tail_s"] for r in steps if "rollouter/tail_s" in r]
                                      or [float("nan")]),
           "reused": sum(int(r.get("pilot/reused", 0)) for r in steps),
           "reach": {}}
    for t in targets:
        hit = next(((s, n, w) for s, n, w, v in c if v >= t), None)
        out["reach"][t] = hit
    return out


def table(results: dict, targets: list[float], val_key: str) -> list[str]:
    head = ["mode", "variant", "repeat", "final val", "best val"]
    for t in targets:
        head += [f"steps to {t}", f"rollouts to {t}", f"wall s to {t}"]
    head += ["rollouts", "wall s", "step s", "gen tail s", "mean K", "trained groups / step", "empty steps",
             "straggler steps"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (mode, variant, rep), s in results.items():
        row = [mode, variant, str(rep + 1), f"{s['final']:.3f}", f"{s['best']:.3f}"]
        for t in targets:
            hit = s["reach"][t]
            row += ["-", "-", "-"] if hit is None else [str(hit[0]), str(hit[1]), f"{hit[2]:.0f}"]
        row += [str(s["rollouts"]), f"{s['wall_s']:.0f}", f"{s['step_s']:.2f}",
                "-" if s["tail_s"] != s["tail_s"] else f"{s['tail_s']:.3f}", f"{s['group_size']:.1f}",
                "-" if s["trainable"] != s["trainable"] else f"{s['trainable']:.1f}", str(s["empty_steps"]),
                f"{s['straggler_rate']:.0%}"]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def plot(results: dict, val_key: str, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {"sync": "--", "periodic": "-", "sync_split": ":"}
    colours = {v: f"C{i}" for i, v in enumerate(dict.fromkeys(v for _, v, _ in results))}
    for (mode, variant, rep), s in results.items():
        c = s["curve"]
        kw = dict(color=colours[variant], marker=".", alpha=1.0 if rep == 0 else 0.5,
                  label=f"{variant} ({mode})" if rep == 0 else None)   # repeats: same colour, fainter
        axes[0].plot([x[1] for x in c], [x[3] for x in c], styles.get(mode, "-"), **kw)
        axes[1].plot([x[2] for x in c], [x[3] for x in c], styles.get(mode, "-"), **kw)
    axes[0].set_xlabel("rollouts generated")
    axes[1].set_xlabel("wall-clock s (training steps, validation excluded)")
    for ax in axes:
        ax.set_ylabel(val_key)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle(f"{title}: held-out reward against rollouts and wall-clock "
                 "(dashed: sync, solid: periodic, fainter: later repeats)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "long_tail.yaml"))
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--modes", default="sync,periodic")
    p.add_argument("--variants", default="grpo,backfill,pilot")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--vary-seed", action="store_true", help="repeat r runs with trainer.seed=1+r (else all seed 1)")
    p.add_argument("--val-every", type=int, default=10)
    p.add_argument("--val-size", type=int, default=128)
    p.add_argument("--val-n", type=int, default=4)
    p.add_argument("--val-metric", default="mean", choices=("mean", "greedy"),
                   help="mean@val_n of the sampled responses, or greedy@1")
    p.add_argument("--targets", default="0.3,0.4")
    p.add_argument("--png", default=None)
    p.add_argument("--write-docs", default=None, help="put the table into this markdown file")
    p.add_argument("--doc-block", default="allocation-bench")
    p.add_argument("--keep-runs", default=None)
    p.add_argument("--reuse-runs", action="store_true",
                   help="with --keep-runs: read the runs already finished there instead of running them again")
    p.add_argument("overrides", nargs="*", help="key=value for every run")
    args = p.parse_args()
    modes, variants = args.modes.split(","), args.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            sys.exit(f"--variants: unknown '{v}'; allowed: {', '.join(VARIANTS)}")
    targets = [float(t) for t in args.targets.split(",") if t]
    val_key = ("val-core/synthetic/reward/greedy@1" if args.val_metric == "greedy"
               else f"val-core/synthetic/reward/mean@{args.val_n}")
    overrides = [f"data.val_size={args.val_size}", f"trainer.val_n={args.val_n}", *args.overrides]
    root = args.keep_runs or tempfile.mkdtemp(prefix="bench_allocation_")
    results = {}
    log(f"{args.config}: {args.steps} steps, modes {modes}, variants {variants}, {args.repeats} repeats; runs in {root}")
    for rep in range(args.repeats):
        for variant in variants:
            for mode in modes:
                run_dir = os.path.join(root, f"{mode}_{variant}_{rep}")
                seed = [f"trainer.seed={1 + rep}"] if args.vary_seed else []
                records = run_once(args.config, mode, variant, args.steps, args.val_every, run_dir,
                                   overrides + seed, reuse=args.reuse_runs)
                results[(mode, variant, rep)] = summarise(records, val_key, targets)
    lines = table(results, targets, val_key)
    cmd = "python tools/bench_allocation.py " + " ".join(sys.argv[1:])
    print("\n".join(lines))
    if args.png:
        plot(results, val_key, args.png, os.path.splitext(os.path.basename(args.config))[0])
    if args.write_docs:
        from docblock import replace_block
        head = [f"Command: `{cmd}`", "",
                f"Run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; validation metric "
                f"`{val_key}` on {args.val_size} held-out prompts every {args.val_every} steps.", ""]
        replace_block(args.write_docs, args.doc_block, head + lines)


if __name__ == "__main__":
    main()
