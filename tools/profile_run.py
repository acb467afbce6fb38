"""Profile a finished run from its metrics.jsonl, timeline.jsonl and config.yaml.

    python tools/profile_run.py RUN_DIR [--peak-flops F | --device NAME] [--warmup 1]
                            [--png out.png] [--trace out.json] [--json out.json]

Any mode, any config, any backend: the run needs trainer.record_timeline=true, nothing else. Prints
- tokens/s/device (perf/throughput) and tokens per step;
- each step broken into generate / reward / train / weight sync / idle, for the rollout side (per
  engine) and the trainer side (rank 0). Each side's shares partition the step: an instant counts
  once, for the first of its side's categories that is busy then (rollout: generate, reward, weight
  sync; trainer: train = micro-steps + optimizer step, weight sync; sync mode's colocated device:
  generate, reward, train, weight sync); idle is the rest (waiting, and the trainer's own overhead:
  planning, packing, metrics);
- the straggler share: the time between the 90th-percentile finish and the last finish of the
  step's samples, over the step time (what the slowest 10% of samples cost);
- FLOPs per step from the model shape (tools/sim/flops.py: a forward over S
  tokens is 2 N S + 2 L d S (S + 1); generation runs P + R - 1 tokens per sample; training runs
  the policy's forward + backward (3 forwards), the reference's forward when the run has a KL
  term (actor.kl_coef != 0: the reference is built only then) and the old policy's when
  ppo_epochs > 1, over P + R), achieved FLOP/s per device of each stage, over the stage's busy
  time and over the step, and MFU against --peak-flops or the --device table (none on cpu unless
  --peak-flops is given);
- writes a timeline PNG (one lane per generation slot, the producer's scoring, the trainer's
  micro-steps and optimizer step, the weight syncs) and a Chrome / Perfetto trace (traceEvents,
  ph "X", ts and dur in microseconds; pid per process / stage, tid per lane; open in
  ui.perfetto.dev or chrome://tracing).
Defaults: the steps after the first (--warmup 1), RUN_DIR/profile_timeline.png and
RUN_DIR/profile_trace.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))     # tools/sim, also when loaded by path

from sim.flops import generation_flops, training_flops  # noqa: E402
from sim.runs import model_shape_of_run, read_config, read_metrics, read_timeline, steps_of  # noqa: E402

# Dense bf16 peak FLOP/s per device, for MFU.
PEAK_FLOPS = {
    "h200": (989e12, "NVIDIA H200 SXM datasheet: 1,979 TFLOPS bf16 with 2:4 sparsity, 989 dense"),
    "h100": (989e12, "NVIDIA H100 SXM datasheet: 1,979 TFLOPS bf16 with 2:4 sparsity, 989 dense"),
    "a100": (312e12, "NVIDIA A100 datasheet: 312 TFLOPS bf16 dense"),
    "910b": (313e12, "Ascend 910B ~313 TFLOPS fp16/bf16 (the figure in common use; a measured bf16 "
                     "4096^3 matmul on an Ascend910B2 gives 315 TFLOPS: github.com/zzc0721/"
                     "torch-performance-test-data issue #109)"),
}


# ---------------------------------------------------------------------- intervals
def merge(intervals) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted((a, b) for a, b in intervals if b > a):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(intervals) -> float:
    return sum(b - a for a, b in merge(intervals))


def clip(intervals, lo: float, hi: float):
    return [(max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo)]


def subtract(a_list, b_list) -> list[tuple[float, float]]:
    """The parts of merged intervals a not covered by b."""
    out = []
    b_list = merge(b_list)
    for a, b in merge(a_list):
        cur = a
        for c, d in b_list:
            if d <= cur or c >= b:
                continue
            if c > cur:
                out.append((cur, c))
            cur = max(cur, d)
            if cur >= b:
                break
        if cur < b:
            out.append((cur, b))
    return out


def partition(window: tuple[float, float], categories: list[tuple[str, list]]) -> dict[str, float]:
    """Seconds of the window each category holds, in priority order (an instant counts for the
    first category busy then); 'idle' is the rest. The values sum to the window's length."""
    lo, hi = window
    taken: list[tuple[float, float]] = []
    out = {}
    for name, iv in categories:
        mine = subtract(clip(iv, lo, hi), taken)
        out[name] = length(mine)
        taken = merge(taken + mine)
    out["idle"] = (hi - lo) - length(taken)
    return out


def straggler_share(ends: list[float], step_s: float) -> float:
    """(last finish - 90th-percentile finish) / step time: the 90th-percentile finish is the time by
    which ceil(0.9 n) of the n samples had finished."""
    if not ends or step_s <= 0:
        return 0.0
    e = sorted(ends)
    return (e[-1] - e[math.ceil(0.9 * len(e)) - 1]) / step_s


# ---------------------------------------------------------------------- one step
def analyse_step(evs: list[dict], mode: str, cfg: dict, shape) -> dict:
    k: dict[str, list[dict]] = {}
    for e in evs:
        k.setdefault(e["kind"], []).append(e)
    st = k["step"][0]
    window = (st["start"], st["end"])
    step_s = window[1] - window[0]
    gens = k.get("generate", [])
    by_engine: dict[int, list] = {}
    for e in gens:
        by_engine.setdefault(e.get("worker", 0), []).append((e["start"], e["end"]))
    engines = st.get("engines", max(1, len(by_engine)))
    reward = [(e["start"], e["end"]) for e in k.get("reward", [])]
    micro = [(e["start"], e["end"]) for e in k.get("train", [])]
    opt = [(e["start"], e["end"]) for e in k.get("optimizer", [])]
    sync = [(e["start"], e["end"]) for e in k.get("update_weights", [])]
    train = micro + opt
    if mode == "sync":
        gen_all = [iv for ivs in by_engine.values() for iv in ivs]
        colocated = partition(window, [("generate", gen_all), ("reward", reward), ("train", train),
                                       ("weight_sync", sync)])
        rollout, trainer = colocated, colocated
    else:
        parts = [partition(window, [("generate", by_engine.get(w, [])), ("reward", reward), ("weight_sync", sync)])
                 for w in range(engines)]
        rollout = {key: statistics.fmean(p[key] for p in parts) for key in parts[0]}
        trainer = partition(window, [("train", train), ("weight_sync", sync)])
    ppo_epochs = (cfg.get("actor") or {}).get("ppo_epochs", 1)
    shortcut = (cfg.get("actor") or {}).get("old_logp_shortcut", True)
    # the reference model is built (and run) only for a KL term: ActorConfig.uses_reference
    reference = (cfg.get("actor") or {}).get("kl_coef", 0.0) != 0
    gen_flops = train_flops = 0.0
    if shape is not None:
        for e in gens:
            gen_flops += generation_flops(shape, e["prompt_tokens"], e["response_tokens"])
            train_flops += training_flops(shape, e["prompt_tokens"], e["response_tokens"], ppo_epochs, reference,
                                          shortcut)
    tokens = sum(e["prompt_tokens"] + e["response_tokens"] for e in gens)
    return {
        "step": st["step"], "step_s": step_s, "mode": mode, "engines": engines, "devices": st.get("devices"),
        "world": st.get("world", 1), "rollout": rollout, "trainer": trainer,
        "busy": {"generate_per_engine": statistics.fmean(length(iv) for iv in by_engine.values()) if by_engine else 0.0,
                 "reward": sum(b - a for a, b in reward), "micro_steps": sum(b - a for a, b in micro),
                 "optimizer": sum(b - a for a, b in opt), "weight_sync": sum(b - a for a, b in sync),
                 "gen_interval": st.get("gen_end", window[0]) - st.get("dispatch", window[0])},
        "straggler_share": straggler_share([e["end"] for e in gens], step_s),
        "samples": len(gens), "tokens": tokens,
        "response_tokens": sum(e["response_tokens"] for e in gens),
        "micro_step_tokens": sum(e.get("tokens", 0) for e in k.get("train", [])),
        "padded_tokens": sum(e.get("padded_tokens", 0) for e in k.get("train", [])),
        "flops": {"generate": gen_flops, "train": train_flops},
    }


def profile(run_dir: str, warmup: int = 1, peak_flops: float | None = None) -> dict:
    cfg = read_config(run_dir)
    if not cfg:
        raise SystemExit(f"{run_dir}: no config.yaml (the trainer writes it into every run directory)")
    metrics = {m["step"]: m for m in read_metrics(run_dir) if "timing_s/step" in m}
    events = read_timeline(run_dir)
    mode = cfg["trainer"]["mode"]
    shape, shape_src = model_shape_of_run(run_dir, cfg)
    per_step = steps_of(events)
    usable = sorted(s for s, evs in per_step.items() if any(e["kind"] == "step" for e in evs))
    if not usable:
        raise SystemExit(f"{run_dir}/timeline.jsonl has no step events: it was recorded before profile_run.py's "
                         "timeline fields existed; re-run with trainer.record_timeline=true")
    chosen = [s for s in usable if s > usable[0] - 1 + warmup] or usable[-1:]
    steps = [analyse_step(per_step[s], mode, cfg, shape) for s in chosen]
    mean = lambda xs: statistics.fmean(xs) if xs else 0.0   # noqa: E731
    step_s = mean([s["step_s"] for s in steps])
    engines, world = steps[0]["engines"], steps[0]["world"]
    devices = steps[0]["devices"] or (world + (engines if mode != "sync" else 0))
    keys_r = list(steps[0]["rollout"])
    keys_t = list(steps[0]["trainer"])
    gen_flops = mean([s["flops"]["generate"] for s in steps])
    train_flops = mean([s["flops"]["train"] for s in steps])
    gen_busy = mean([s["busy"]["generate_per_engine"] for s in steps])
    train_busy = mean([s["busy"]["micro_steps"] + s["busy"]["optimizer"] for s in steps])
    stages = {
        "generate": {"flops": gen_flops, "devices": engines, "busy_s": gen_busy,
                     "flops_per_s_busy": gen_flops / engines / gen_busy if gen_busy else 0.0,
                     "flops_per_s_step": gen_flops / engines / step_s},
        "train": {"flops": train_flops, "devices": world, "busy_s": train_busy,
                  "flops_per_s_busy": train_flops / world / train_busy if train_busy else 0.0,
                  "flops_per_s_step": train_flops / world / step_s},
    }
    if peak_flops:
        for v in stages.values():
            v["mfu_busy"] = v["flops_per_s_busy"] / peak_flops
            v["mfu_step"] = v["flops_per_s_step"] / peak_flops
    ms = [metrics[s["step"]] for s in steps if s["step"] in metrics]
    return {
        "run_dir": run_dir, "mode": mode, "backend": cfg.get("backend"), "steps": [s["step"] for s in steps],
        "model": {"source": shape_src, "params": shape.total_params if shape else None,
                  "matmul_params": shape.matmul_params if shape else None,
                  "layers": shape.layers if shape else None},
        "devices": devices, "engines": engines, "world": world,
        "slots": (cfg.get("rollout") or {}).get("max_slots"),
        "tokens_per_s_per_device": mean([m["perf/throughput"] for m in ms]),
        "tokens_per_s_per_device_total": sum(s["tokens"] for s in steps) / sum(s["step_s"] for s in steps) / devices,
        "tokens_per_step": mean([s["tokens"] for s in steps]),
        "metrics_tokens_per_step": mean([m["perf/total_num_tokens"] for m in ms]),
        "step_s": step_s, "metrics_step_s": mean([m["timing_s/step"] for m in ms]),
        "rollout": {k: mean([s["rollout"][k] for s in steps]) for k in keys_r},
        "trainer": {k: mean([s["trainer"][k] for s in steps]) for k in keys_t},
        "busy": {k: mean([s["busy"][k] for s in steps]) for k in steps[0]["busy"]},
        "metrics_timing": {k: mean([m[k] for m in ms if k in m]) for k in
                           ("timing_s/gen", "timing_s/reward", "timing_s/update_actor", "timing_s/update_weights")},
        "straggler_share": mean([s["straggler_share"] for s in steps]),
        "padded_tokens_per_step": mean([s["padded_tokens"] for s in steps]),
        "micro_step_tokens_per_step": mean([s["micro_step_tokens"] for s in steps]),
        "stages": stages, "peak_flops": peak_flops, "per_step": steps,
    }


def format_report(p: dict, peak_src: str | None) -> str:
    s = p["step_s"]
    pct = lambda x: f"{x:.3f} s ({x / s:4.0%})"   # noqa: E731
    m = p["model"]
    lines = [
        f"run {p['run_dir']}: mode {p['mode']}, backend {p['backend']}, steps {p['steps'][0]}-{p['steps'][-1]} "
        f"({len(p['steps'])} after the warm-up)",
        f"model: {m['params'] / 1e6:.3f} M parameters ({m['matmul_params'] / 1e6:.3f} M in matmuls), "
        f"{m['layers']} layers [{m['source']}]" if m["params"] else f"model: {m['source']}",
        f"devices: {p['devices']} ({p['world']} trainer rank(s), {p['engines']} rollout engine(s) x {p['slots']} slots"
        f"{', colocated' if p['mode'] == 'sync' else ''})",
        f"throughput: {p['tokens_per_s_per_device']:.0f} tokens/s/device (perf/throughput, mean); "
        f"{p['tokens_per_step']:.0f} tokens/step (metrics: {p['metrics_tokens_per_step']:.0f}); "
        f"step {s:.3f} s (timing_s/step {p['metrics_step_s']:.3f} s)",
        "step breakdown (mean per step; each side sums to the step):",
    ]
    side = "colocated device" if p["mode"] == "sync" else "rollout side (per engine)"
    lines.append(f"  {side:26s} " + "  ".join(f"{k} {pct(v)}" for k, v in p["rollout"].items())
                 + f"  = {sum(p['rollout'].values()):.3f} s")
    if p["mode"] != "sync":
        lines.append(f"  {'trainer side (rank 0)':26s} " + "  ".join(f"{k} {pct(v)}" for k, v in p["trainer"].items())
                     + f"  = {sum(p['trainer'].values()):.3f} s")
    b = p["busy"]
    lines.append(f"  busy (not exclusive): generation {b['generate_per_engine']:.3f} s per engine, timing_s/gen "
                 f"{b['gen_interval']:.3f} s, reward {b['reward']:.4f} s, micro-steps {b['micro_steps']:.3f} s, "
                 f"optimizer {b['optimizer']:.4f} s, weight sync {b['weight_sync']:.4f} s")
    if p["padded_tokens_per_step"]:
        lines.append(f"  trainer rank 0 packed {p['micro_step_tokens_per_step']:.0f} tokens/step into "
                     f"{p['padded_tokens_per_step']:.0f} padded positions "
                     f"({1 - p['micro_step_tokens_per_step'] / p['padded_tokens_per_step']:.0%} padding)")
    lines.append(f"straggler share: {p['straggler_share']:.1%} of the step between the 90th-percentile finish and "
                 f"the last finish (mean over steps)")
    for name, v in p["stages"].items():
        line = (f"{name:8s}: {v['flops'] / 1e9:.4g} GFLOP/step; per device ({v['devices']}): "
                f"{v['flops_per_s_busy'] / 1e9:.4g} GFLOP/s over its busy {v['busy_s']:.3f} s, "
                f"{v['flops_per_s_step'] / 1e9:.4g} GFLOP/s over the step")
        if "mfu_busy" in v:
            line += f"; MFU {v['mfu_busy']:.2%} busy, {v['mfu_step']:.2%} step"
        lines.append(line)
    if p["peak_flops"]:
        lines.append(f"peak: {p['peak_flops'] / 1e12:.4g} TFLOP/s per device ({peak_src})")
    else:
        lines.append("MFU: not printed (no peak FLOP/s known for this backend; give --peak-flops or --device)")
    return "\n".join(lines)


# ---------------------------------------------------------------------- trace and PNG
def _lanes(events: list[dict], mode: str):
    """(pid, tid, process name, thread name) of each event."""
    def where(e):
        if e["kind"] == "generate":
            w = e.get("worker", 0)
            proc = f"rollout engine {w}" + (" (in the trainer process)" if mode == "sync" else "")
            return 10 + w, e.get("slot", 0), proc, f"slot {e.get('slot', 0)}"
        if e["kind"] == "reward":
            return 2, 0, "producer (scoring)" if mode != "sync" else "trainer rank 0", "reward"
        if e["kind"] in ("train", "optimizer"):
            return 1, 0, "trainer rank 0", "micro-steps / optimizer"
        if e["kind"] == "update_weights":
            return 1, 1, "trainer rank 0", "weight sync"
        return 1, 2, "trainer rank 0", "steps"
    return where


def write_trace(events: list[dict], mode: str, path: str) -> dict:
    where = _lanes(events, mode)
    t0 = min(e["start"] for e in events)
    out, names = [], {}
    for e in events:
        pid, tid, pname, tname = where(e)
        names[(pid, None)] = pname
        names[(pid, tid)] = tname
        if e["kind"] == "generate":
            name = f"g{e.get('group')}/k{e.get('sample')}"
        elif e["kind"] == "train":
            name = f"micro-step {e.get('index', '')}"
        elif e["kind"] == "step":
            name = f"step {e['step']}"
        else:
            name = e["kind"]
        args = {k: v for k, v in e.items() if k not in ("start", "end", "lane", "kind")}
        out.append({"name": name, "cat": e["kind"], "ph": "X", "ts": (e["start"] - t0) * 1e6,
                    "dur": max(0.0, e["end"] - e["start"]) * 1e6, "pid": pid, "tid": tid, "args": args})
    meta = []
    for (pid, tid), name in sorted(names.items(), key=lambda x: (x[0][0], -1 if x[0][1] is None else x[0][1])):
        if tid is None:
            meta.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}})
        else:
            meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
    trace = {"traceEvents": meta + out, "displayTimeUnit": "ms",
             "otherData": {"mode": mode, "t0_perf_counter_s": t0}}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(trace, f)
    return trace


MAX_SLOT_LANES = 64


def draw_png(events: list[dict], mode: str, steps: tuple[int, int], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    evs = [e for e in events if steps[0] <= e["step"] <= steps[1]]
    t0 = min(e["start"] for e in evs)
    slots = sorted({(e.get("worker", 0), e.get("slot", 0)) for e in evs if e["kind"] == "generate"})
    shown = [ws for ws in slots if ws[1] < MAX_SLOT_LANES]
    lanes = ["weight sync", "trainer", "producer" if mode != "sync" else "reward"] + \
            [f"worker{w}/slot{s}" for w, s in reversed(shown)]
    y = {name: i for i, name in enumerate(reversed(lanes))}
    colors = {"generate": "#4C72B0", "reward": "#8172B3", "train": "#DD8452", "optimizer": "#C44E52",
              "update_weights": "#55A868"}
    lane_of = {"reward": lanes[2], "train": "trainer", "optimizer": "trainer", "update_weights": "weight sync"}
    fig, ax = plt.subplots(figsize=(13, max(3.0, 0.16 * len(lanes) + 1.5)))
    for kind, color in colors.items():
        bars: dict[str, list] = {}
        for e in evs:
            if e["kind"] != kind:
                continue
            lane = f"worker{e.get('worker', 0)}/slot{e.get('slot', 0)}" if kind == "generate" else lane_of[kind]
            if lane in y:
                bars.setdefault(lane, []).append((e["start"] - t0, max(e["end"] - e["start"], 1e-5)))
        for i, (lane, b) in enumerate(bars.items()):
            ax.broken_barh(b, (y[lane] - 0.4, 0.8), facecolors=color, label=kind if i == 0 else None,
                           edgecolor="white" if kind == "train" else None, linewidth=0.3)
    for e in evs:
        if e["kind"] == "step":
            ax.axvline(e["start"] - t0, color="grey", lw=0.6, ls="--")
            ax.axvline(e["end"] - t0, color="grey", lw=0.6, ls="--")
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(list(reversed(lanes)), fontsize=5 if len(lanes) > 40 else 7)
    ax.set_xlabel("seconds")
    more = f", first {MAX_SLOT_LANES} slots of each worker" if len(shown) < len(slots) else ""
    ax.set_title(f"{mode}: steps {steps[0]}-{steps[1]} (dashed: step boundaries{more})")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("--peak-flops", type=float, default=None, help="peak FLOP/s per device (e.g. 989e12)")
    p.add_argument("--device", choices=sorted(PEAK_FLOPS), default=None, help="peak FLOP/s from the built-in table")
    p.add_argument("--warmup", type=int, default=1, help="leading steps left out of the means (default 1)")
    p.add_argument("--png", default=None, help="timeline PNG (default RUN_DIR/profile_timeline.png; 'none': skip)")
    p.add_argument("--png-steps", default=None, help="A-B: steps drawn (default: the last two profiled)")
    p.add_argument("--trace", default=None, help="trace JSON (default RUN_DIR/profile_trace.json; 'none': skip)")
    p.add_argument("--json", default=None, help="also write the summary as JSON here")
    args = p.parse_args(argv)
    peak, src = args.peak_flops, "--peak-flops"
    if peak is None and args.device:
        peak, src = PEAK_FLOPS[args.device]
    for name, what in (("metrics.jsonl", "is it a run directory (trainer.run_dir)?"),
                       ("timeline.jsonl", "re-run with trainer.record_timeline=true")):
        if not os.path.exists(os.path.join(args.run_dir, name)):
            raise SystemExit(f"{args.run_dir}: no {name}; {what}")
    res = profile(args.run_dir, args.warmup, peak)
    print(format_report(res, src if peak else None))
    events = read_timeline(args.run_dir)
    if args.trace != "none":
        path = args.trace or os.path.join(args.run_dir, "profile_trace.json")
        tr = write_trace(events, res["mode"], path)
        print(f"trace: {path} ({sum(e['ph'] == 'X' for e in tr['traceEvents'])} events)")
    if args.png != "none":
        path = args.png or os.path.join(args.run_dir, "profile_timeline.png")
        if args.png_steps:
            a, _, b = args.png_steps.partition("-")
            rng = (int(a), int(b or a))
        else:
            rng = (res["steps"][-2] if len(res["steps"]) > 1 else res["steps"][-1], res["steps"][-1])
        draw_png(events, res["mode"], rng, path)
        print(f"timeline: {path} (steps {rng[0]}-{rng[1]})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
