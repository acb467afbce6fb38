"""Benchmark: shared-prompt packing vs unshared sequences, side by side in one run.

    python tools/bench_shared_prompt.py [--backend cpu|cuda|npu] [--models large,tiny]
        [--ks 2,4,8,16] [--ratios 1:4,1:1,4:1,16:1] [--resp-len 16] [--write-docs docs/performance.md]
        [--e2e --e2e-steps 20 --e2e-rounds 2]

For every model size, group size K and prompt:response length ratio, one GRPO group (one prompt,
K responses of equal length) goes through the tri-model engine's training micro-step (policy forward +
log-probs + clipped-PG loss + backward; no reference model) twice: packed by pack_unshared (K rows
[P | Rk]) and by pack_shared (one row [P | R1 .. RK], the backend's shared-prompt kernel). The two
are timed alternately (median of >= 3 repeats after a warm-up). Reported per case:
- tokens: positions run through the model (B * S), unshared vs shared;
- time: forward + backward seconds, and the speedup unshared / shared;
- ideal: the token-count ratio (P + K R) / (K (P + R)) and its speedup 1 / ratio; "of ideal" is
  speedup / ideal speedup (target >= 80% where attention is not dominant);
- attn: the causal attention-FLOP ratio (shared / unshared score pairs);
- act MiB: activation memory saved for backward (bytes of non-parameter tensors autograd saves,
  measured with saved-tensor hooks in a separate untimed pass; device-agnostic, and on CPU the only
  per-run peak-memory figure available), unshared vs shared.
--e2e additionally runs the trainer (`trainer.total_steps=N`, default config) with
actor.shared_prompt off and on and reports the GRPO step throughput.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODELS = {
    # name: (hidden, layers, heads, kv_heads, ffn, vocab)
    "tiny": (64, 2, 2, 2, 128, 32),
    "large": (512, 4, 8, 2, 1536, 4096),
}


def make_model_dir(path: str, name: str, seed: int = 0) -> str:
    from periodic_async.models.tiny import make_random_model_dir
    hidden, layers, heads, kv, ffn, vocab = MODELS[name]
    return make_random_model_dir(path, hidden, layers, heads, kv, ffn, vocab, seed)


class SavedActivationBytes:
    """Bytes of distinct non-parameter storages autograd saves for backward (activation memory)."""

    def __init__(self, model):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: set = set()
        self.bytes = 0

    def _pack(self, t):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in self.params and ptr not in self.seen:
            self.seen.add(ptr)
            self.bytes += st.nbytes()
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


def bench_model(name: str, backend, ks, ratios, resp_len: int, min_time: float, min_repeats: int, log):
    from periodic_async.config import ActorConfig
    from periodic_async.actor.tri_model import TriModelActor
    from periodic_async.actor.packing import TrainSample, pack_shared, pack_unshared
    from periodic_async.models.mcore import arch_from_hf_dir
    from kernels.shared_prompt import attention_flop_ratio, ideal_token_ratio

    device = backend.device(0)
    tmp = tempfile.mkdtemp(prefix=f"bench_sp_{name}_")
    model_dir = make_model_dir(tmp, name)
    arch = arch_from_hf_dir(model_dir)
    actors = {shared: TriModelActor(ActorConfig(shared_prompt=shared, grad_clip=0.0), arch, model_dir, device=device,
                            with_reference=False) for shared in (False, True)}
    gen = torch.Generator().manual_seed(0)
    rows = []
    for ratio in ratios:
        pr, rr = (int(x) for x in ratio.split(":"))
        p = max(1, resp_len * pr // rr)
        for k in ks:
            prompt = torch.randint(2, arch.vocab_size, (p,), generator=gen).tolist()
            group = [TrainSample(prompt, torch.randint(2, arch.vocab_size, (resp_len,), generator=gen).tolist(),
                                 float(torch.randn((), generator=gen))) for _ in range(k)]
            mbs = {False: pack_unshared(group, 0).to(device), True: pack_shared([group], 0).to(device)}
            normaliser = float(k * resp_len)

            def step(shared):
                backend.synchronize()
                t0 = time.perf_counter()
                actors[shared].train_micro_step(mbs[shared], normaliser)
                backend.synchronize()
                dt = time.perf_counter() - t0
                actors[shared].policy.zero_grad(set_to_none=True)
                return dt

            for shared in (False, True):       # warm-up (and kernel compilation on CUDA)
                step(shared)
            times = {False: [], True: []}
            while (len(times[False]) < min_repeats or sum(times[False]) + sum(times[True]) < min_time) \
                    and len(times[False]) < 50:
                for shared in (False, True):   # alternate: both see the same machine state
                    times[shared].append(step(shared))
            act = {}
            for shared in (False, True):
                with SavedActivationBytes(actors[shared].policy) as sb:
                    actors[shared].train_micro_step(mbs[shared], normaliser)
                actors[shared].policy.zero_grad(set_to_none=True)
                act[shared] = sb.bytes / 2 ** 20
            t_u, t_s = statistics.median(times[False]), statistics.median(times[True])
            ideal = ideal_token_ratio(p, [resp_len] * k)
            row = dict(model=name, k=k, ratio=ratio, p=p, r=resp_len,
                       tok_u=mbs[False].input_ids.numel(), tok_s=mbs[True].input_ids.numel(),
                       t_u=t_u, t_s=t_s, speedup=t_u / t_s, ideal=ideal, ideal_speedup=1 / ideal,
                       of_ideal=(t_u / t_s) * ideal, attn=attention_flop_ratio(p, [resp_len] * k),
                       act_u=act[False], act_s=act[True], reps=len(times[False]))
            rows.append(row)
            log(format_row(row))
    return rows


HEADER = ("| model | K | P:R | P, R | tokens unshared -> shared | fwd+bwd s unshared | fwd+bwd s shared | "
          "speedup | ideal ratio | ideal speedup | of ideal | attn-FLOP ratio | act MiB unshared -> shared |")
SEP = "|" + "---|" * 13


def format_row(r) -> str:
    return (f"| {r['model']} | {r['k']} | {r['ratio']} | {r['p']}, {r['r']} | {r['tok_u']} -> {r['tok_s']} | "
            f"{r['t_u']:.4f} | {r['t_s']:.4f} | {r['speedup']:.2f}x | {r['ideal']:.3f} | "
            f"{r['ideal_speedup']:.2f}x | {100 * r['of_ideal']:.0f}% | {r['attn']:.3f} | "
            f"{r['act_u']:.1f} -> {r['act_s']:.1f} |")


def run_e2e(steps: int, rounds: int, log) -> list[dict]:
    """The trainer with the default config, actor.shared_prompt false / true, alternating for
    `rounds` rounds; per setting the mean over rounds of the second half of each run."""
    from periodic_async.config import load_config
    from periodic_async.train.trainer import Trainer

    runs: dict[bool, list[dict]] = {False: [], True: []}
    for rnd in range(rounds):
        for shared in (False, True):
            run_dir = tempfile.mkdtemp(prefix=f"bench_sp_e2e_{int(shared)}_")
            cfg = load_config("configs/default.yaml" if os.path.exists("configs/default.yaml") else None, [
                f"trainer.total_steps={steps}", f"trainer.run_dir={run_dir}", "trainer.progress_bar=false",
                "trainer.save_final=false", f"actor.shared_prompt={str(shared).lower()}"])
            hist = Trainer(cfg).fit()
            tail = hist[len(hist) // 2:]                      # steady state: second half of the run
            res = dict(step_s=statistics.mean(h["timing_s/step"] for h in tail),
                       update_s=statistics.mean(h["timing_s/update_actor"] for h in tail),
                       throughput=statistics.mean(h["perf/throughput"] for h in tail),
                       score_first=hist[0]["critic/score/mean"], score_last=hist[-1]["critic/score/mean"],
                       kl_last=hist[-1]["actor/kl_loss"])
            runs[shared].append(res)
            log(f"e2e round {rnd} shared_prompt={shared}: {res}")
    out = []
    for shared, rs in runs.items():
        out.append(dict(shared=shared, steps=steps, rounds=len(rs),
                        **{k: statistics.mean(r[k] for r in rs) for k in rs[0]}))
    return out


def write_docs(path: str, command: str, rows, e2e, env: str) -> None:
    lines = ["## Shared-prompt attention", "",
             f"Command: `{command}`", "", f"Machine: {env}.", "",
             "One GRPO group per measurement (one prompt, K responses of R tokens), the tri-model engine's training "
             "micro-step (policy forward, log-probs, clipped-PG loss, backward; fp32), unshared rows vs one "
             "shared-prompt row, timed alternately in the same run (median). `ideal ratio` = "
             "(P + K R) / (K (P + R)), `of ideal` = measured speedup / ideal speedup, `attn-FLOP ratio` = causal "
             "attention score pairs shared / unshared, `act MiB` = activation memory saved for backward.", "",
             "Models (Qwen2 layout, random init): " + "; ".join(
                 f"{n}: hidden {h}, {l} layers, {a} heads / {kv} KV heads, ffn {f}, vocab {v}"
                 for n, (h, l, a, kv, f, v) in MODELS.items()) + ". CPU kernel: `sdpa` (dense or segmented "
             "SDPA, chosen per micro-batch).", "",
             HEADER, SEP] + [format_row(r) for r in rows]
    if e2e:
        lines += ["", "End-to-end GRPO step throughput (the trainer as `python -m periodic_async trainer.total_steps="
                  f"{e2e[0]['steps']} actor.shared_prompt=false|true`, default config; {e2e[0]['rounds']} alternating "
                  "runs per setting, mean over the second half of each run):", "",
                  "| actor.shared_prompt | step s | update_actor s | perf/throughput (tokens/s/device) | "
                  "score first -> last | final KL |",
                  "|---|---|---|---|---|---|"]
        for r in e2e:
            lines.append(f"| {str(r['shared']).lower()} | {r['step_s']:.3f} | "
                         f"{r['update_s']:.3f} | {r['throughput']:.0f} | {r['score_first']:.3f} -> "
                         f"{r['score_last']:.3f} | {r['kl_last']:.4f} |")
    from docblock import replace_block
    replace_block(path, "shared-prompt-bench", lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cuda", "npu"])
    ap.add_argument("--models", default="large,tiny")
    ap.add_argument("--ks", default="2,4,8,16")
    ap.add_argument("--ratios", default="1:4,1:1,4:1,16:1")
    ap.add_argument("--resp-len", type=int, default=16)
    ap.add_argument("--min-time", type=float, default=0.5, help="seconds of timed repeats per case (at least)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per case (at least)")
    ap.add_argument("--write-docs", default=None, help="replace the results section of this markdown file")
    ap.add_argument("--e2e", action="store_true", help="also run the trainer with shared_prompt off / on")
    ap.add_argument("--e2e-steps", type=int, default=20)
    ap.add_argument("--e2e-rounds", type=int, default=2, help="alternating off/on runs per setting")
    args = ap.parse_args(argv)

    import warnings
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from periodic_async.backend import get_backend
    backend = get_backend(args.backend)
    backend.init_distributed()
    backend.init_model_parallel(1, 1, seed=0)
    ks = [int(x) for x in args.ks.split(",")]
    ratios = args.ratios.split(",")
    log = lambda s: print(s, flush=True)
    load0, threads = os.getloadavg()[0], torch.get_num_threads()   # the e2e trainer re-pins threads
    log(HEADER)
    log(SEP)
    t0 = time.time()
    rows = []
    for name in args.models.split(","):
        rows += bench_model(name, backend, ks, ratios, args.resp_len, args.min_time, args.repeats, log)
    log(f"# kernel benchmark: {time.time() - t0:.0f} s")
    e2e = run_e2e(args.e2e_steps, args.e2e_rounds, log) if args.e2e else []
    if args.write_docs:
        env = (f"backend {args.backend}, torch {torch.__version__}, {threads} torch threads for the kernel table"
               + (f", {os.cpu_count()} CPU cores" if args.backend == "cpu" else "")
               + f"; 1-min load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end "
               "(the machine was shared with other jobs: single timings are noisy, alternation and medians "
               "keep the shared/unshared comparison fair)")
        cmd = "python tools/bench_shared_prompt.py " + " ".join(a for a in (argv if argv is not None else sys.argv[1:]))
        write_docs(args.write_docs, cmd.strip(), rows, e2e, env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
