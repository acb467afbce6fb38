"""Predict step time and tokens/s/device of sync, sync_split, periodic and async from stage costs.

    python tools/simulate.py calibrate RUN_DIR... -o calib.json [--warmup 2] [--engine auto]
    python tools/simulate.py check --calib calib.json [--steps 30]
    python tools/simulate.py predict --calib calib.json --mode periodic|async [--eta 1] [--costs-from MODE]
        [--rollout-devices R] [--trainer-devices T] [--slots S] [--prompts B] [--n K]
        [--micro-batch M] [--lengths SPEC] [--prompt-lengths SPEC] [--steps 20] [--seed 0]
        [--group-sizing fixed|sagc [--sagc-candidates 4,8,16]]
        [--selection none|pilot|backfill [--success beta:1,1] [--dataset-size 1000]]
    python tools/simulate.py project [--model Qwen2.5-7B-Instruct] [--devices 8,16,32,64]
        [--lengths lognormal:200,0.5,512] [--prompt-len 190] [--prompts-per-device 8] [--n 8]
        [--slots 64] [--split-slots N] [--micro-batch 4] [--tp 4] [--steps 4]

The replay (tools/sim/replay.py) makes the real producer's decisions: the batch plan, continuous
batching per engine, groups scored and handed over in completion order (periodic) or after the
whole batch (sync_split), micro-batches of a DP rank's groups as they arrive, one optimizer step
and one weight sync per batch; async dispatches batch b as soon as the engines hold version
b - 1 - eta (the runtime's staleness rule), so batches b + 1 .. b + eta generate meanwhile. One
reward call per poll of the producer. The plug-ins are the runtime's own: group sizing (fixed,
sagc: StragglerAwareGroupSize fed the simulated lengths) and selection (pilot-commit, backfill:
the Allocator fed binary rewards drawn from per-prompt success probabilities, --success).

- calibrate: fits each mode's costs on its runs (trainer.record_timeline=true): per engine step
  (decode / prefill forwards, per row, per token; the engine model - incremental or reprefill -
  that fits the sample timings best), per micro-step (fixed + per padded token + attention), reward
  (per call + per item), optimizer step, weight sync, and the latencies between stages; keeps the
  runs' response / prompt lengths (empirical) and the measured step times.
- check: each calibrated mode predicted with its own costs and with the other split mode's,
  against its measured mean step time and perf/throughput.
- predict: one mode on any cluster and workload with calibrated costs. SPEC: fixed:N |
  lognormal:MEDIAN,SIGMA,CAP | pareto:XM,ALPHA,CAP | empirical:RUN_DIR. async and the plug-ins
  also print what each batch did (K, rollouts, the policy lag of its oldest sample).
- project: costs derived from hardware assumptions (each printed with its source) for a model on
  Ascend 910B NPUs, every mode on 8..64 devices, the trainer / rollout split searched.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))     # tools/sim, also when loaded by path

from sim.calibration import calibrate, predict_from_calibration  # noqa: E402
from sim.costs import Cluster, Costs, Workload  # noqa: E402
from sim.flops import ModelShape  # noqa: E402
from sim.lengths import EmpiricalLengths, FixedLengths, parse_lengths  # noqa: E402
from sim.planner import PromptSet  # noqa: E402
from sim.projection import Hardware, costs_from_hardware  # noqa: E402
from sim.replay import simulate  # noqa: E402


def cmd_calibrate(args) -> None:
    calib = calibrate(args.runs, warmup=args.warmup, engine_model=args.engine)
    with open(args.output, "w") as f:
        json.dump(calib, f, indent=1)
    for mode, m in calib["modes"].items():
        c, d = m["costs"], m["diagnostics"]["generation"]
        g = c["gen"]
        print(f"{mode}: {len(m['runs'])} run(s), {m['steps']} steps after the warm-up ({m['warmup']})")
        print(f"  engine model {d['engine']} (rms residual {d['rms_residual_s'] * 1e3:.2f} ms over "
              f"{d['observations']} stamp intervals, slots as replayed {d['slot_match']:.0%}): decode "
              f"{g['decode_s'] * 1e3:.3f} ms + {g['decode_row_s'] * 1e6:.1f} us/row + "
              f"{g['decode_ctx_s'] * 1e6:.2f} us/ctx token; prefill {g['prefill_s'] * 1e3:.3f} ms + {g['prefill_row_s'] * 1e6:.1f} us/row + "
              f"{g['prefill_token_s'] * 1e6:.2f} us/token; {g['finish_s'] * 1e6:.1f} us/finished sequence")
        print(f"  micro-step {c['micro_step_s'] * 1e3:.3f} ms + {c['token_s'] * 1e6:.2f} us/padded token + "
              f"{c['attn_s'] * 1e9:.2f} ns/(row x width^2); optimizer {c['optimizer_s'] * 1e3:.2f} ms; weight sync "
              f"{c['sync_s'] * 1e3:.2f} ms; reward {c['reward_call_s'] * 1e3:.3f} ms/call + "
              f"{c['reward_item_s'] * 1e6:.1f} us/item")
        print(f"  latencies: dispatch {c['dispatch_s'] * 1e3:.2f} ms, result {c['result_s'] * 1e3:.2f} ms, hand-off "
              f"{c['handoff_busy_s'] * 1e3:.2f} ms (trainer busy) / {c['handoff_wait_s'] * 1e3:.2f} ms (waiting), "
              f"optimizer -> sync {c['post_train_s'] * 1e3:.2f} ms")
        print(f"  measured: step {m['measured']['step_s']:.4f} s, {m['measured']['tokens_per_s_per_device']:.0f} "
              f"tokens/s/device")
    print(f"wrote {args.output}")


def cmd_check(args) -> None:
    with open(args.calib) as f:
        calib = json.load(f)
    modes = calib["modes"]
    print("Predicted with the measured steps' own response lengths replayed (replay), and with lengths drawn")
    print("from the runs' pooled empirical distribution (sampled, mean of --steps steps).")
    print("| mode | costs from | measured step s | replay step s | error | sampled step s | error | "
          "measured tokens/s/dev | replay tokens/s/dev | error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode in ("sync", "sync_split", "periodic"):
        if mode not in modes:
            continue
        meas = modes[mode]["measured"]
        sources = [mode] + [m for m in ("sync_split", "periodic") if mode != "sync" and m != mode and m in modes]
        for src in sources:
            r = predict_from_calibration(calib, mode, costs_from=src, measured_lengths=True)
            p = predict_from_calibration(calib, mode, costs_from=src, steps=args.steps, seed=args.seed)
            err = lambda a, b: f"{a / b - 1:+.1%}"   # noqa: E731
            print(f"| {mode} | {src} | {meas['step_s']:.4f} | {r.step_s:.4f} | {err(r.step_s, meas['step_s'])} | "
                  f"{p.step_s:.4f} | {err(p.step_s, meas['step_s'])} | {meas['tokens_per_s_per_device']:.0f} | "
                  f"{r.tokens_per_s_per_device:.0f} | "
                  f"{err(r.tokens_per_s_per_device, meas['tokens_per_s_per_device'])} |")


def _workload_overrides(args, base: Workload) -> Workload:
    return Workload(args.prompts or base.prompts, args.n or base.n,
                    parse_lengths(args.lengths) if args.lengths else base.response_lengths,
                    parse_lengths(args.prompt_lengths) if args.prompt_lengths else base.prompt_lengths,
                    args.micro_batch or base.micro_batch_size, base.weight_bytes)


def cmd_predict(args) -> None:
    with open(args.calib) as f:
        calib = json.load(f)
    src = args.costs_from or args.mode
    if src not in calib["modes"]:
        src = {"periodic": "sync_split", "sync_split": "periodic", "async": "periodic"}.get(args.mode, src)
    if src not in calib["modes"] and args.mode == "async":
        src = "sync_split"
    m = calib["modes"][src]
    wl = m["workload"]
    base = Workload(wl["prompts"], wl["n"], EmpiricalLengths(wl["response_lengths"]),
                    EmpiricalLengths(wl["prompt_lengths"]), wl["micro_batch_size"])
    workload = _workload_overrides(args, base)
    cl = m["cluster"]
    if args.mode == "sync":
        devices = args.trainer_devices or cl["world"]
        cluster = Cluster(0, devices, args.slots or wl["slots"], colocated_devices=devices,
                          colocated_engines=args.rollout_devices or 1)
    else:
        cluster = Cluster(args.rollout_devices or cl["engines"],
                          args.trainer_devices or max(1, cl["devices"] - cl["engines"]), args.slots or wl["slots"])
    sizer, alloc, prompts = _plugins(args, workload)
    p = simulate(args.mode, workload, cluster, Costs.from_dict(m["costs"]), steps=args.steps, seed=args.seed,
                 eta=args.eta, sizer=sizer, allocator=alloc, prompts=prompts)
    eta = f", eta {args.eta}" if args.mode == "async" else ""
    print(f"mode {args.mode}{eta} (costs calibrated on {src}: {', '.join(m['runs'])}); group sizing "
          f"{args.group_sizing}, selection {args.selection}")
    print(f"cluster: {cluster}")
    print(f"workload: {workload.prompts} prompts x {workload.n}, responses {workload.response_lengths.spec}, "
          f"prompts {workload.prompt_lengths.spec}, micro-batch {workload.micro_batch_size}")
    print(f"predicted over {p.steps} steps: step {p.step_s:.4f} s (gen {p.gen_s:.4f} s, train {p.train_s:.4f} s, "
          f"sync {p.sync_s:.4f} s), {p.tokens_per_step:.0f} tokens/step, {p.tokens_per_s_per_device:.0f} "
          f"tokens/s/device on {p.devices} devices; rollout idle {p.rollout_idle:.0%}, trainer waiting "
          f"{p.trainer_idle:.0%}")
    if p.batches is not None:
        print(f"simulated wall time {p.wall_s:.4f} s, {p.rollouts_per_step:.1f} rollouts/step")
        print("| batch | K | rollouts | dispatched at s | engines' version then | oldest sample's lag | step s |")
        print("|---|---|---|---|---|---|---|")
        for b in p.batches:
            print(f"| {b.step} | {b.group_size} | {b.rollouts} | {b.dispatch:.4f} | {b.dispatch_version} | "
                  f"{b.step - 1 - b.oldest_version} | {b.sync_end - b.t0:.4f} |")


def _plugins(args, workload: Workload):
    """The runtime's plug-ins for --group-sizing / --selection (None where off)."""
    from periodic_async.config.sections import SAGCConfig
    from periodic_async.scheduling.allocation import Allocator, BackfillConfig, PilotConfig
    from periodic_async.scheduling.group_sizing import StragglerAwareGroupSize
    sizer = alloc = prompts = None
    if args.group_sizing == "sagc":
        cands = tuple(int(x) for x in args.sagc_candidates.split(","))
        sizer = StragglerAwareGroupSize(SAGCConfig(candidates=cands, seed=args.seed), workload.n)
    if args.selection != "none":
        pilot = PilotConfig(enabled=args.selection == "pilot")
        backfill = BackfillConfig(enabled=args.selection == "backfill")
        alloc = Allocator(pilot, backfill, workload.prompts, workload.n, args.dataset_size)
        prompts = PromptSet(workload, args.dataset_size, args.success, seed=args.seed)
    return sizer, alloc, prompts


# ---------------------------------------------------------------------- the 910B projection
def hardware_910b() -> Hardware:
    return Hardware(
        name="Ascend 910B (64 GB)", peak_flops=313e12, hbm_bytes_per_s=1.6e12,
        mfu_train=0.35, mfu_prefill=0.40, mfu_decode=0.50, mbu_decode=0.70, decode_overhead_s=0.003,
        micro_step_overhead_s=0.010, optimizer_bytes_per_param=32, allreduce_bytes_per_s=20e9,
        sync_bytes_per_s=10e9, sync_overhead_s=0.1, reward_item_s=0.5e-3, dispatch_s=0.05,
        sources={
            "peak_flops": "313 TFLOP/s bf16 dense: the commonly quoted 910B figure; a measured bf16 4096^3 "
                          "matmul on an Ascend910B2 reaches 315 TFLOP/s (github.com/zzc0721/"
                          "torch-performance-test-data issue #109). Not a Huawei datasheet.",
            "hbm_bytes_per_s": "1.6 TB/s HBM2e: assumed (the brief's figure); public figures for the 910B vary "
                               "(0.4-1.6 TB/s) and no Huawei datasheet was found",
            "mfu_train": "35% assumed: Megatron-LM reaches 40-52% of A100 peak on large GPT models "
                         "(Narayanan et al., SC'21); a 7B model at TP=4 with micro-batches of 4 short rows is "
                         "smaller GEMMs, so less",
            "mfu_prefill": "40% assumed (prefill is compute-bound GEMMs of ~190-token prompts)",
            "mfu_decode": "50% assumed for the compute part of a decode step",
            "mbu_decode": "70% of the HBM bandwidth assumed for a decode step's weight + KV reads "
                          "(memory-bound kernels typically reach 60-80%)",
            "decode_overhead_s": "3 ms per engine step assumed (launch, sampling, scheduling). Check: the model "
                                 "gives ~25 ms per decode step at 64 rows; GPUStack reports a mean TPOT of "
                                 "27.6 ms for Qwen3-8B on 910B under vLLM without optimisations "
                                 "(docs.gpustack.ai, performance-lab/qwen3-8b/910b)",
            "micro_step_overhead_s": "10 ms per micro-step assumed (packing, schedule, p2p set-up)",
            "optimizer_bytes_per_param": "32 B/param of the TP shard: fp32 main weight, gradient, two Adam "
                                         "moments read and written, bf16 weight written (memory-bound)",
            "allreduce_bytes_per_s": "20 GB/s per device for the DP ring all-reduce of fp32 gradients "
                                     "(200 Gb/s RoCE port per NPU, ~80% used): assumed",
            "sync_bytes_per_s": "10 GB/s end to end for the weight sync: assumed - the shm path stages the "
                                "bf16 weights in host memory (device -> host, then host -> each engine's "
                                "device in parallel, PCIe 4.0 x16 at ~20 GB/s each way)",
            "sync_overhead_s": "0.1 s per sync assumed (acknowledgements, engine reload)",
            "reward_item_s": "0.5 ms per response assumed (math-verify on 8 reward workers)",
            "dispatch_s": "50 ms per step assumed (planning, request pickling, producer start)",
            "colocated_sync_bytes_per_s": "100 GB/s assumed for sync mode's weight update (an on-device copy "
                                          "into the colocated engine; the sleep / wake-up of a verl-style "
                                          "colocated engine is not modelled)",
        })


def cmd_project(args) -> None:
    from periodic_async.models.known import KNOWN_HF_CONFIGS
    shape = ModelShape.from_hf_config(KNOWN_HF_CONFIGS[args.model])
    hw = hardware_910b()
    lengths = parse_lengths(args.lengths)
    print(f"model {args.model}: {shape.total_params / 1e9:.2f} B parameters ({shape.matmul_params / 1e9:.2f} B in "
          f"matmuls), KV {shape.kv_bytes_per_token() / 1024:.0f} KiB/token bf16; {hw.name}")
    print("assumptions:")
    for k, v in hw.sources.items():
        print(f"  {k} = {getattr(hw, k):g}: {v}")
    print(f"workload: {args.prompts_per_device} prompts per device x K={args.n}, prompt {args.prompt_len} tokens, "
          f"responses {lengths.spec} (mean {lengths.mean():.0f}), micro-batch {args.micro_batch}, "
          f"{args.slots} slots per engine ({args.split_slots or args.slots} in the split modes), trainer TP={args.tp}, "
          f"rollout engines TP=1; mean of {args.steps} steps; split modes: the trainer / rollout split with the "
          f"shortest step")
    rows = []
    w_bytes = shape.total_params * 2
    for d in [int(x) for x in args.devices.split(",")]:
        wl = Workload(args.prompts_per_device * d, args.n, lengths, FixedLengths(args.prompt_len), args.micro_batch,
                      w_bytes)
        res = {}
        cl = Cluster(0, d, args.slots, tp=args.tp, colocated_devices=d, colocated_engines=d)
        c = costs_from_hardware(shape, hw, args.tp, max(1, d // args.tp), colocated=True)
        res["sync"] = (simulate("sync", wl, cl, c, steps=args.steps, seed=args.seed), None)
        splits = [t for t in range(args.tp, d, args.tp)]
        for mode in ("sync_split", "periodic"):
            best = None
            for t in splits:
                cl = Cluster(d - t, t, args.split_slots or args.slots, tp=args.tp)
                p = simulate(mode, wl, cl, costs_from_hardware(shape, hw, args.tp, t // args.tp), steps=args.steps,
                             seed=args.seed)
                if best is None or p.step_s < best[0].step_s:
                    best = (p, t)
            res[mode] = best
        rows.append((d, res))
    print("| NPUs | mode | trainer / rollout NPUs | step s | T_gen s | T_train s | tokens/s/NPU | vs sync | "
          "vs sync_split |")
    print("|---|---|---|---|---|---|---|---|---|")
    for d, res in rows:
        for mode in ("sync", "sync_split", "periodic"):
            p, t = res[mode]
            split = f"{d} colocated" if t is None else f"{t} / {d - t}"
            print(f"| {d} | {mode} | {split} | {p.step_s:.1f} | {p.gen_s:.1f} | {p.train_s:.1f} | "
                  f"{p.tokens_per_s_per_device:.0f} | "
                  f"{p.tokens_per_s_per_device / res['sync'][0].tokens_per_s_per_device:.2f}x | "
                  f"{p.tokens_per_s_per_device / res['sync_split'][0].tokens_per_s_per_device:.2f}x |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("calibrate")
    c.add_argument("runs", nargs="+")
    c.add_argument("-o", "--output", default="calib.json")
    c.add_argument("--warmup", type=int, default=2)
    c.add_argument("--engine", default="auto", choices=["auto", "incremental", "reprefill"],
                   help="the engine model to fit (auto: both, reprefill only if clearly better)")
    c.set_defaults(fn=cmd_calibrate)
    k = sub.add_parser("check")
    k.add_argument("--calib", required=True)
    k.add_argument("--steps", type=int, default=30)
    k.add_argument("--seed", type=int, default=0)
    k.set_defaults(fn=cmd_check)
    q = sub.add_parser("predict")
    q.add_argument("--calib", required=True)
    q.add_argument("--mode", required=True, choices=["sync", "sync_split", "periodic", "async"])
    q.add_argument("--eta", type=int, default=0, help="async: max_staleness (batches dispatched ahead)")
    q.add_argument("--costs-from", default=None, choices=["sync", "sync_split", "periodic"])
    q.add_argument("--group-sizing", default="fixed", choices=["fixed", "sagc"])
    q.add_argument("--sagc-candidates", default="4,8,16", help="sagc: the group sizes (--n among them)")
    q.add_argument("--selection", default="none", choices=["none", "pilot", "backfill"])
    q.add_argument("--success", default="beta:1,1",
                   help="selection: per-prompt success probability, fixed:P | uniform:LO,HI | beta:A,B")
    q.add_argument("--dataset-size", type=int, default=1000, help="selection: prompts in the simulated dataset")
    q.add_argument("--rollout-devices", type=int, default=None, help="engines (sync: colocated engines)")
    q.add_argument("--trainer-devices", type=int, default=None, help="trainer devices (sync: all devices)")
    q.add_argument("--slots", type=int, default=None)
    q.add_argument("--prompts", type=int, default=None)
    q.add_argument("--n", type=int, default=None)
    q.add_argument("--micro-batch", type=int, default=None)
    q.add_argument("--lengths", default=None)
    q.add_argument("--prompt-lengths", default=None)
    q.add_argument("--steps", type=int, default=20)
    q.add_argument("--seed", type=int, default=0)
    q.set_defaults(fn=cmd_predict)
    j = sub.add_parser("project")
    j.add_argument("--model", default="Qwen2.5-7B-Instruct")
    j.add_argument("--devices", default="8,16,32,64")
    j.add_argument("--lengths", default="lognormal:200,0.5,512")
    j.add_argument("--prompt-len", type=int, default=190)
    j.add_argument("--prompts-per-device", type=int, default=8)
    j.add_argument("--n", type=int, default=8)
    j.add_argument("--slots", type=int, default=64, help="slots per engine (colocated, and split by default)")
    j.add_argument("--split-slots", type=int, default=None,
                   help="slots per engine in the split modes (a rollout device holds no trainer state)")
    j.add_argument("--micro-batch", type=int, default=4)
    j.add_argument("--tp", type=int, default=4)
    j.add_argument("--steps", type=int, default=4)
    j.add_argument("--seed", type=int, default=0)
    j.set_defaults(fn=cmd_project)
    args = p.parse_args(argv)
    args.fn(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
