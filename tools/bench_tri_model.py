"""Tri-model micro-steps vs three separate passes: time and peak memory, side by side in one run.

    python tools/bench_tri_model.py                       # tiny and ~100M models, TP=1 and TP=2
    python tools/bench_tri_model.py --models tiny --tps 1 --repeats 3
    python tools/bench_tri_model.py --write-docs docs/performance.md

For each (model, TP) a worker (TP=2: torchrun, 2 gloo processes) builds ONE engine with policy,
old and reference and times, alternating between them (median of --repeats):
- tri-model: every micro-step runs policy + old + reference forwards and the loss in one pass
  through Megatron's schedule (the old model active: a later PPO epoch);
- tri-model + shortcut: the same with the old forward skipped (old == policy, first epoch);
- three passes (the usual design, e.g. verl): an old-policy forward-only pass over the batch and
  a reference forward-only pass, storing log-probs, then the policy's training pass using them.
All three compute the same loss (tests/test_tri_model.py asserts it). Memory: model-state bytes
per option (fp32 / bf16 frozen models / frozen offloaded) from the engine, and the peak growth
of the process's resident memory during each variant, in a second run where glibc maps every
allocation >= 64 KiB separately and returns it when freed, so the resident set follows the live
tensors (cpu; max_memory_allocated on a GPU).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODELS = {
    # name: (hidden, layers, heads, kv_heads, ffn, vocab, groups, K, prompt len, response len, micro-batch)
    "tiny": (64, 2, 2, 2, 128, 32, 4, 8, 16, 32, 8),
    "100m": (768, 12, 12, 4, 2048, 32000, 2, 4, 32, 64, 4),
}
VARIANTS = ("tri-model", "tri-model + shortcut", "three passes")


class PeakRSS:
    """Peak growth of this process's resident set while the block runs (sampled every 2 ms)."""

    def __enter__(self):
        self.base = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _watch(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())
        self.growth = self.peak - self.base


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from periodic_async.backend import get_backend
    from periodic_async.config import ActorConfig
    from periodic_async.actor.packing import TrainSample, pack_micro_batch
    from periodic_async.actor.tri_model import TriModelActor
    from periodic_async.models.mcore import arch_from_hf_dir
    from periodic_async.models.sizes import stage_param_numel
    from periodic_async.models.tiny import make_random_model_dir

    backend = get_backend(args.backend)
    rank, world, local_rank = backend.init_distributed()
    backend.init_model_parallel(world, 1, 0)            # TP = world size
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    device = backend.device(local_rank)
    hidden, layers, heads, kv, ffn, vocab, n_groups, k, p_len, r_len, mbs = MODELS[args.model]
    model_dir = os.path.join(args.tmp, args.model)
    if rank == 0 and not os.path.exists(os.path.join(model_dir, "config.json")):
        make_random_model_dir(model_dir, hidden, layers, heads, kv, ffn, vocab)
    dist.barrier()
    arch = arch_from_hf_dir(model_dir)
    n_params = stage_param_numel(arch)[0]          # the whole model (TP = PP = 1)

    def engine(**kw):
        cfg = ActorConfig(ppo_epochs=2, kl_coef=0.001, micro_batch_size=mbs, **kw)
        return TriModelActor(cfg, arch, model_dir, device=device)

    gen = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(n_groups):
        prompt = torch.randint(2, vocab, (p_len,), generator=gen).tolist()
        samples += [TrainSample(prompt, torch.randint(2, vocab, (r_len,), generator=gen).tolist(),
                                float(torch.randn((), generator=gen))) for _ in range(k)]
    batch = [pack_micro_batch(samples[i:i + mbs], 0) for i in range(0, len(samples), mbs)]
    normaliser = float(len(samples) * r_len)

    eng = engine()
    eng.old_is_current = False

    def run(variant):
        if variant == "three passes":
            pre = eng.forward_logprobs(batch, ("old", "ref"))
            eng.forward_backward(batch, len(batch), normaliser=normaliser, precomputed=pre)
        else:
            eng.forward_backward(batch, len(batch), use_old=variant == "tri-model", normaliser=normaliser)
        eng.optimizer.zero_grad()

    for v in VARIANTS:          # warm-up
        run(v)
    times = {v: [] for v in VARIANTS}
    mem = {v: 0 for v in VARIANTS}
    for _ in range(args.repeats):
        for v in VARIANTS:
            dist.barrier()
            backend.synchronize()
            if backend.name != "cpu":
                backend.reset_peak_memory()
            with PeakRSS() as rss:
                t0 = time.perf_counter()
                run(v)
                backend.synchronize()
                times[v].append(time.perf_counter() - t0)
            peak = backend.max_memory_allocated() if backend.name != "cpu" else rss.growth
            mem[v] = max(mem[v], peak)
    states = {"fp32 frozen": eng.memory_bytes()}
    del eng
    states["bf16 frozen"] = engine(frozen_dtype="bfloat16").memory_bytes()
    states["offloaded frozen"] = engine(offload_frozen=True).memory_bytes()
    if rank == 0:
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        print(json.dumps({"model": args.model, "tp": world, "params": n_params, "tokens": tokens,
                          "micro_batches": len(batch),
                          "time_s": {v: statistics.median(t) for v, t in times.items()},
                          "peak_bytes": mem, "state_bytes": states, "device": backend.name}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def drive(args) -> list[dict]:
    rows = []
    tmp = tempfile.mkdtemp(prefix="bench_tri_")
    for model in args.models.split(","):
        for tp in (int(t) for t in args.tps.split(",")):
            row = None
            for measure in ("time", "memory"):
                me = [os.path.abspath(__file__), "--worker", "--model", model, "--tmp", tmp, "--repeats",
                      str(args.repeats if measure == "time" else 1), "--backend", args.backend]
                cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(tp)]
                       + me if tp > 1 else [sys.executable] + me)
                print(f"[bench_tri_model] {model} TP={tp} ({measure}) ...", file=sys.stderr, flush=True)
                env = dict(os.environ, PYTHONWARNINGS="ignore",
                           OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // tp)))
                if measure == "memory":
                    # glibc: every allocation >= 64 KiB is its own mmap, returned to the OS when freed,
                    # so the resident set follows the live tensors (timings of this run are not used)
                    env.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("{")), None)
                if proc.returncode or line is None:
                    raise SystemExit(f"worker failed ({' '.join(cmd)}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
                got = json.loads(line)
                if row is None:
                    row = got
                else:
                    row["peak_bytes"] = got["peak_bytes"]
            rows.append(row)
            print(format_row(row), flush=True)
    return rows


HEADER = ("| model | TP | tri-model s | + shortcut s | three passes s | tri / three | shortcut saving | "
          "peak MiB tri / three | state MiB fp32 / bf16 / offload frozen |")
SEP = "|---|---|---|---|---|---|---|---|---|"


def format_row(r: dict) -> str:
    t, m, st = r["time_s"], r["peak_bytes"], r["state_bytes"]
    mib = lambda b: b / (1 << 20)   # noqa: E731
    total = lambda s: mib(sum(s.values()))   # noqa: E731
    return (f"| {r['model']} ({r['params'] / 1e6:.1f}M) | {r['tp']} | {t['tri-model']:.3f} | "
            f"{t['tri-model + shortcut']:.3f} | {t['three passes']:.3f} | "
            f"{t['tri-model'] / t['three passes']:.2f} | "
            f"{1 - t['tri-model + shortcut'] / t['tri-model']:.0%} | "
            f"{mib(m['tri-model']):.1f} / {mib(m['three passes']):.1f} | "
            f"{total(st['fp32 frozen']):.1f} / {total(st['bf16 frozen']):.1f} / {total(st['offloaded frozen']):.1f} |")


def write_docs(path: str, command: str, rows: list[dict], env: str) -> None:
    lines = ["## Tri-model engine", "", f"Command: `{command}`", "", f"Machine: {env}.", "",
             "One batch (groups x K responses, prompt P + response R tokens, micro-batches of the given size) "
             "through the engine, variants alternated in one process, median time. `tri-model`: policy + old + "
             "reference forwards and the loss in each micro-step; `+ shortcut`: old forward skipped (old == "
             "policy); `three passes`: old and reference forward-only passes storing log-probs, then the "
             "policy's training pass (the usual design). `peak MiB`: growth of resident memory during the "
             "variant, measured in a separate run with MALLOC_MMAP_THRESHOLD_=65536 so that freed tensors leave "
             "the resident set (cpu; device peak on a GPU). `state MiB`: policy weights + grads + Adam moments + "
             "resident frozen weights on this rank.", "",
             "Models (Qwen2 layout, random init): " + "; ".join(
                 f"{n}: hidden {h}, {layers} layers, {a} heads / {kv} KV, ffn {f}, vocab {v}; batch {g} x {k}, "
                 f"P {p}, R {rl}, micro-batch {mb}"
                 for n, (h, layers, a, kv, f, v, g, k, p, rl, mb) in MODELS.items()) + ".", "",
             HEADER, SEP] + [format_row(r) for r in rows]
    from docblock import replace_block
    replace_block(path, "tri-model-bench", lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cuda", "npu"])
    ap.add_argument("--models", default="tiny,100m")
    ap.add_argument("--tps", default="1,2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--write-docs", default=None, help="replace the tri-model section of this markdown file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--tmp", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    print(HEADER + "\n" + SEP, flush=True)
    rows = drive(args)
    if args.write_docs:
        env = f"{os.cpu_count()} CPU cores, backend {args.backend}"
        write_docs(args.write_docs, "python tools/bench_tri_model.py " + " ".join(argv or sys.argv[1:]), rows, env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
