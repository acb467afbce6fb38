"""One GRPO training step (forward, loss, backward, optimizer) on 64 sequences: this project's old
code, its new code (unshared and shared-prompt) and a plain Hugging Face transformers step (what
TRL's GRPOTrainer computes), side by side, alternating.

    python tools/bench_train_step.py --setup small --base /tmp/train_base
    python tools/bench_train_step.py --setup medium --repeats 2 --warmup 0 --base /tmp/train_base
    python tools/bench_train_step.py --setup small --variants new new-shared hf
    python tools/bench_train_step.py --setup medium --variants new-shared new-shared@system hf hf@held

`--base` is a checkout of the code to compare against (e.g. `git worktree add /tmp/train_base HEAD`);
without it the `base` variants are skipped. Each variant runs in its own worker process (the base
one with that checkout first on sys.path / PYTHONPATH), built once; the parent then asks the
workers for one step at a time in turn, `--repeats` rounds, so a load change on a shared machine
hits every variant alike. Reported per variant: min and median wall seconds, CPU seconds (process
time / threads: less sensitive to other processes), tokens/s (64 x (prompt + completion) tokens a
step, the same logical tokens for every variant), and the ratios to the HF step and to `base`.

Setups (Qwen2, random init, the char tokenizer's vocabulary of 24, fp32, AdamW, no KL so no reference
model, ppo_epochs 1, 8 prompts x 8 completions):
- small: hidden 256, 4 layers, 4 heads, 2 KV heads, ffn 1024 (3.9M params); prompt 64 + completion 64.
- medium: hidden 512, 8 layers, 8 heads, 4 KV heads, ffn 2048 (31.5M params); prompt 128 + completion 64.
The project's steps are TriModelActor.pack -> forward_backward -> optimizer_step(1 / normaliser),
as train/step.py runs them, with ActorConfig's default micro_batch_size (32). The HF step is
Qwen2ForCausalLM (attn_implementation sdpa) in the same micro-batches: logits of the completion
positions only (logits_to_keep, as TRL), log-probs by logsumexp + gather, the PPO-clip token-mean
loss, backward, grad-norm clipping at 1.0 and torch.optim.AdamW.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SETUPS = {   # name: (hidden, layers, heads, kv_heads, ffn, prompt len, completion len)
    "small": (256, 4, 4, 2, 1024, 64, 64),
    "medium": (512, 8, 8, 4, 2048, 128, 64),
}
GROUPS, K, VOCAB = 8, 8, 24
VARIANTS = ("base", "new", "new-shared", "hf")
OPTIONAL = ("base-shared",)


def samples(prompt_len: int, completion_len: int):
    """(prompt ids, completion ids, advantage) of 8 groups x 8, fixed seed; advantages are
    normalised within each group, as GRPO's."""
    import torch
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(GROUPS):
        prompt = torch.randint(2, VOCAB, (prompt_len,), generator=g).tolist()
        adv = torch.randn(K, generator=g)
        adv = (adv - adv.mean()) / (adv.std() + 1e-6)
        out += [(prompt, torch.randint(2, VOCAB, (completion_len,), generator=g).tolist(), float(a)) for a in adv]
    return out


# ---------------------------------------------------------------------- workers


def project_worker(args):
    """TriModelActor of the checkout on sys.path[0] (this repo or --repo)."""
    import torch
    from periodic_async.backend import get_backend
    from periodic_async.config import ActorConfig
    from periodic_async.actor.packing import TrainSample
    from periodic_async.actor.tri_model import TriModelActor
    from periodic_async.models.mcore import arch_from_hf_dir
    backend = get_backend("cpu")
    backend.init_distributed()
    backend.init_model_parallel(1, 1, 0)
    torch.set_num_threads(args.threads)
    *_, p_len, r_len = SETUPS[args.setup]
    cfg = ActorConfig(shared_prompt=args.variant.partition("@")[0].endswith("shared"), kl_coef=0.0, entropy_coef=0.0, ppo_epochs=1)
    arch = arch_from_hf_dir(args.model_dir)
    actor = TriModelActor(cfg, arch, args.model_dir, with_reference=False)
    batch = [TrainSample(p, r, a) for p, r, a in samples(p_len, r_len)]
    mbs = cfg.micro_batch_size
    normaliser = float(sum(len(s.response_ids) for s in batch))

    def step():
        t0 = time.perf_counter()
        micro = [actor.pack(batch[i:i + mbs]) for i in range(0, len(batch), mbs)]
        t1 = time.perf_counter()
        actor.forward_backward(iter(micro), len(micro))
        t2 = time.perf_counter()
        actor.optimizer_step(grad_scale=1.0 / normaliser)
        t3 = time.perf_counter()
        # the policy's forward alone (no graph kept), timed outside the step: backward ~ the rest
        with torch.no_grad():
            for mb in micro:
                actor.compute_logprobs(mb)
        return {"pack": t1 - t0, "forward_backward": t2 - t1, "optimizer": t3 - t2,
                "forward_no_grad": time.perf_counter() - t3}
    return step


def hf_worker(args):
    """The TRL-equivalent step on transformers' Qwen2ForCausalLM."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    *_, p_len, r_len = SETUPS[args.setup]
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    data = samples(p_len, r_len)
    ids = torch.tensor([p + r for p, r, _ in data])
    adv = torch.tensor([a for *_, a in data])
    mbs, clip = 32, 0.2
    n_tokens = float(len(data) * r_len)

    def step():
        for i in range(0, len(data), mbs):
            x = ids[i:i + mbs]
            logits = model(input_ids=x, attention_mask=torch.ones_like(x), logits_to_keep=r_len + 1).logits
            logits = logits[:, :-1]                                   # positions predicting the completion
            target = x[:, -r_len:]
            logp = logits.gather(-1, target[..., None]).squeeze(-1) - torch.logsumexp(logits, -1)
            ratio = torch.exp(logp - logp.detach())
            a = adv[i:i + mbs, None]
            loss = torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip, 1 + clip)).sum() / n_tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def worker(args) -> None:
    """Build, say ready, then one timed step per 'step' line on stdin (a JSON line back)."""
    if args.repo:
        sys.path.insert(0, args.repo)
    hf = args.variant.partition("@")[0] == "hf"
    step = hf_worker(args) if hf else project_worker(args)
    if not hf:
        import periodic_async
        src = os.path.dirname(os.path.dirname(os.path.abspath(periodic_async.__file__)))
    else:
        src = "transformers"
    print(json.dumps({"ready": True, "src": src}), flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        w0, c0 = time.perf_counter(), time.process_time()
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        phases = step() or {}
        wall = time.perf_counter() - w0 - phases.get("forward_no_grad", 0.0)   # the step itself
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0     # with the forward-only pass
        print(json.dumps({"wall": wall, "cpu": (time.process_time() - c0) / args.threads, "phases": phases,
                          "faults": faults}), flush=True)


# ---------------------------------------------------------------------- parent


class Worker:
    def __init__(self, variant, setup, model_dir, repo, threads):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", variant, "--setup", setup,
               "--model-dir", model_dir, "--threads", str(threads)]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        from periodic_async.backend_setup import host_malloc_env
        env.update(host_malloc_env(variant.partition("@")[2]))     # VARIANT@system / hf@held
        if repo:
            cmd += ["--repo", repo]
            env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
        self.variant = variant
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     stderr=subprocess.DEVNULL)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.variant} exited (rc {self.proc.wait()})")
        return json.loads(line)

    def step(self) -> dict:
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self):
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        except OSError:
            pass
        self.proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setup", choices=sorted(SETUPS), default="small")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS),
                    help=f"from {', '.join(VARIANTS + OPTIONAL)}; VARIANT@system: the project's cpu backend with "
                    "glibc's malloc defaults (PERIODIC_ASYNC_HOST_MALLOC=system); hf@held: the HF step with the "
                    "project's malloc settings (glibc's MALLOC_* variables)")
    ap.add_argument("--base", help="checkout of the code to compare against (the base variants)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per variant first")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--repo", help=argparse.SUPPRESS)
    args = ap.parse_args()
    for v in args.variants:
        name, _, malloc = v.partition("@")
        # the HF step can be given the project's settings (held); a project step can drop them (system)
        if name not in VARIANTS + OPTIONAL or malloc not in (("", "held") if name == "hf" else ("", "system")):
            ap.error(f"--variants: {v!r}: allowed {', '.join(VARIANTS + OPTIONAL)}, a project one with @system, hf@held")
    if args.worker:
        args.variant = args.worker
        worker(args)
        return

    sys.path.insert(0, HERE)
    from periodic_async.models.tiny import make_random_model_dir
    hidden, layers, heads, kv, ffn, p_len, r_len = SETUPS[args.setup]
    variants = [v for v in args.variants if args.base or not v.startswith("base")]
    if len(variants) < len(args.variants):
        print("no --base checkout: base variants skipped")
    tokens = GROUPS * K * (p_len + r_len)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_random_model_dir(os.path.join(tmp, args.setup), hidden, layers, heads, kv, ffn, VOCAB)
        workers = {}
        try:
            for v in variants:
                workers[v] = Worker(v, args.setup, model_dir, args.base if v.startswith("base") else HERE, args.threads)
                print(f"{v:12s} from {workers[v].info['src']}", flush=True)
            for _ in range(args.warmup):
                for w in workers.values():
                    w.step()
            times = {v: [] for v in variants}
            for r in range(args.repeats):
                for v, w in workers.items():
                    times[v].append(w.step())
                print(f"round {r + 1}: " + "  ".join(f"{v} {times[v][-1]['wall']:.2f}s" for v in variants), flush=True)
        finally:
            for w in workers.values():
                w.close()

    def stat(v, key, fn):
        return fn([t[key] for t in times[v]])
    print(f"\nsetup {args.setup}: {GROUPS * K} sequences x ({p_len} + {r_len}) tokens = {tokens} tokens a step, "
          f"{args.threads} threads, {args.repeats} rounds (min / median)")
    print(f"{'variant':18s} {'wall min':>9s} {'wall med':>9s} {'cpu min':>8s} {'cpu med':>8s} {'tok/s':>8s}"
          f" {'vs hf':>7s} {'vs base':>8s} {'page faults/step':>17s}")
    for v in variants:
        wmin, wmed = stat(v, "wall", min), stat(v, "wall", statistics.median)
        cmin, cmed = stat(v, "cpu", min), stat(v, "cpu", statistics.median)
        vs_hf = f"{stat('hf', 'wall', min) / wmin:6.2f}x" if "hf" in times else "-"
        vs_base = f"{stat('base', 'wall', min) / wmin:7.2f}x" if "base" in times else "-"
        faults = stat(v, "faults", statistics.median)
        print(f"{v:18s} {wmin:9.2f} {wmed:9.2f} {cmin:8.2f} {cmed:8.2f} {tokens / wmin:8.0f} {vs_hf:>7s} {vs_base:>8s}"
              f" {faults:17.0f}")
    print("(vs hf / vs base: that variant's min wall time / this one's: > 1 is faster; page faults: minor "
          "faults in the step and its forward-only pass, median)")
    phase_account(args, times, variants, p_len, r_len)


def phase_account(args, times, variants, p_len: int, r_len: int) -> None:
    """The project's step by phase (median over rounds), as seconds and GFLOP/s against the matmul
    rate at a micro-step's rows (tools/peak_flops.py, measured now). FLOPs are the unshared
    sequence's (tools/sim/flops.py), so a shared-prompt variant's rate counts the work it avoided."""
    from peak_flops import dense_shape, measure
    from sim.flops import forward_flops
    hidden, layers, heads, kv, ffn, *_ = SETUPS[args.setup]
    shape = dense_shape(hidden, layers, heads, kv, ffn, VOCAB)
    rows = 32 * (p_len + r_len)      # ActorConfig's default micro_batch_size of 32 sequences
    rate = measure(shape, [rows], args.threads)["by_rows"][rows]["model_rate_flops"]
    fwd = GROUPS * K * forward_flops(shape, p_len + r_len)
    print(f"\nphases of the project's step (median s; GFLOP/s and share of the matmul rate at {rows} rows, "
          f"{rate / 1e9:.1f} GFLOP/s; forward {fwd / 1e9:.2f} GFLOP, backward 2x that):")
    print(f"{'variant':18s} {'pack':>7s} {'forward':>16s} {'backward (f+b - f)':>22s} {'optimizer':>10s}")
    for v in variants:
        ph = [t["phases"] for t in times[v] if t.get("phases")]
        if not ph:
            continue
        med = {k: statistics.median(p[k] for p in ph) for k in ph[0]}
        f, b = med["forward_no_grad"], med["forward_backward"] - med["forward_no_grad"]
        print(f"{v:18s} {med['pack']:7.3f} {f:7.3f} ({fwd / f / rate:4.0%} rate) {b:10.3f} ({2 * fwd / b / rate:4.0%} rate)"
              f" {med['optimizer']:10.3f}")


if __name__ == "__main__":
    main()
