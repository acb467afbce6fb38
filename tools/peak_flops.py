"""The machine's matmul rate at a model's own shapes: the denominator of every stage's share of peak
(issue 30: "a FLOP/s account for every stage of every run").

    python tools/peak_flops.py [--setup small|medium | --config-json PATH] [--threads 2] [--rows 2048]
                               [--decode-rows 64] [--dtype float32] [--repeats 5] [--json OUT]

For each linear map of the model (QKV, attention output, gate+up, down, LM head; tools/sim/flops.py's
ModelShape) it times torch.matmul of [rows x in] @ [in x out] - `rows` tokens as the training micro-step
and prefill feed them, `decode-rows` as one decode step does - with torch.set_num_threads(threads),
best of `repeats` after a warm-up, and prints GFLOP/s per shape. Two summaries:

- peak: the fastest shape's rate: what the machine's matmul unit gives at all.
- model rate: all the model's matmuls at those rows one after another (total FLOPs / total time):
  the rate a forward could reach if nothing but its matmuls took time - the floor a stage is measured
  against in tools/profile_run.py (--peak-flops) and tools/bench_vs_trl.py.

No timing here is asserted by a test; the numbers are this machine's at the time of the run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_vs_trl import SETUPS  # noqa: E402 - (hidden, layers, heads, kv heads, ffn, prompt, new tokens)
from sim.flops import ModelShape  # noqa: E402

CHAR_VOCAB = 128   # a round vocabulary for --setup (the runs' char tokenizer has fewer: the LM head is small either way)


def dense_shape(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int) -> ModelShape:
    """The Qwen2 shape of the benchmarks' random-init models (head_dim = hidden / heads)."""
    return ModelShape(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=hidden // heads,
                      ffn=ffn, vocab=vocab)


def shape_of(setup: str | None, config_json: str | None) -> ModelShape:
    if config_json:
        with open(config_json) as f:
            return ModelShape.from_hf_config(json.load(f))
    if setup not in SETUPS:
        sys.exit(f"--setup: '{setup}' is not one of {', '.join(SETUPS)} (or give --config-json)")
    return dense_shape(*SETUPS[setup][:5], vocab=CHAR_VOCAB)


def linear_maps(shape: ModelShape) -> list[tuple[str, int, int, int]]:
    """(name, in, out, times per forward) of every matmul with a weight."""
    q, kv = shape.attn_dim, shape.kv_heads * shape.head_dim
    return [("qkv", shape.hidden, q + 2 * kv, shape.layers), ("attn_out", q, shape.hidden, shape.layers),
            ("gate_up", shape.hidden, 2 * shape.ffn, shape.layers), ("down", shape.ffn, shape.hidden, shape.layers),
            ("lm_head", shape.hidden, shape.vocab, 1)]


def time_matmul(rows: int, n_in: int, n_out: int, dtype, repeats: int) -> float:
    """Best seconds of one [rows x n_in] @ [n_in x n_out]."""
    import torch
    a, b = torch.randn(rows, n_in, dtype=dtype), torch.randn(n_in, n_out, dtype=dtype)
    reps = max(1, int(2e8 // (2 * rows * n_in * n_out)))   # ~0.2 GFLOP per timing: above timer noise
    torch.matmul(a, b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b)
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def measure(shape: ModelShape, rows_list: list[int], threads: int, dtype_name: str = "float32",
            repeats: int = 5) -> dict:
    import torch
    torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    out = {"threads": threads, "dtype": dtype_name, "shapes": [], "by_rows": {}}
    for rows in rows_list:
        flops = secs = 0.0
        for name, n_in, n_out, times in linear_maps(shape):
            s = time_matmul(rows, n_in, n_out, dtype, repeats)
            f = 2.0 * rows * n_in * n_out
            out["shapes"].append({"rows": rows, "name": name, "in": n_in, "out": n_out, "gflops": f / s / 1e9})
            flops, secs = flops + f * times, secs + s * times
        out["by_rows"][rows] = {"model_rate_flops": flops / secs}
    out["peak_flops"] = max(s["gflops"] for s in out["shapes"]) * 1e9
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setup", default="medium")
    p.add_argument("--config-json", default=None, help="an HF config.json instead of a --setup")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, default=2048, help="tokens per training micro-step / prefill")
    p.add_argument("--decode-rows", type=int, default=64, help="sequences per decode step")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None, help="also write the result here")
    a = p.parse_args()
    shape = shape_of(a.setup, a.config_json)
    r = measure(shape, [a.rows, a.decode_rows], a.threads, a.dtype, a.repeats)
    print(f"{a.config_json or a.setup}: hidden {shape.hidden}, {shape.layers} layers, ffn {shape.ffn}, vocab "
          f"{shape.vocab}; {a.dtype}, {a.threads} threads")
    for s in r["shapes"]:
        print(f"  rows {s['rows']:5d}  {s['name']:9s} [{s['in']} x {s['out']}]  {s['gflops']:8.1f} GFLOP/s")
    for rows, v in r["by_rows"].items():
        print(f"model rate at {rows} rows: {v['model_rate_flops'] / 1e9:.1f} GFLOP/s")
    print(f"peak (fastest shape): {r['peak_flops'] / 1e9:.1f} GFLOP/s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
