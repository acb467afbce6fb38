"""Where one training step's CPU time goes, by op and input shape (torch.profiler): the project's
step from tools/bench_train_step.py (pack -> forward_backward -> optimizer, then the policy's
forward alone), after two warm-up steps.

    python tools/profile_train_step.py --setup medium [--shared] [--rows 30] [--by-op]

Prints the op table sorted by self CPU time (grouped by input shape unless --by-op) and each
matmul shape's GFLOP/s over its own time: compare with tools/peak_flops.py's rate at the model's
shapes. The numbers in docs/performance.md ("The training step's profile") come from this.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    import bench_train_step as bts
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setup", default="medium", choices=sorted(bts.SETUPS))
    p.add_argument("--shared", action="store_true", help="the shared-prompt step")
    p.add_argument("--rows", type=int, default=30, help="rows of the op table")
    p.add_argument("--by-op", action="store_true", help="group by op only, not by input shape")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from periodic_async.models.tiny import make_random_model_dir
    hidden, layers, heads, kv, ffn, _, _ = bts.SETUPS[a.setup]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_random_model_dir(os.path.join(tmp, a.setup), hidden, layers, heads, kv, ffn, bts.VOCAB)
        args = argparse.Namespace(setup=a.setup, model_dir=model_dir, threads=a.threads, repo=None,
                                  variant="new-shared" if a.shared else "new")
        step = bts.project_worker(args)
        for i in range(2):
            print(f"warm-up step {i + 1}: " + ", ".join(f"{k} {v:.2f} s" for k, v in step().items()), flush=True)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            phases = step()
    print("profiled step: " + ", ".join(f"{k} {v:.2f} s" for k, v in phases.items()))
    events = prof.key_averages(group_by_input_shape=not a.by_op)
    print(events.table(sort_by="self_cpu_time_total", row_limit=a.rows, max_name_column_width=45,
                       max_shapes_column_width=70))
    total = sum(e.self_cpu_time_total for e in events)
    mm = [e for e in prof.key_averages(group_by_input_shape=True) if e.key == "aten::mm" and e.input_shapes]
    print(f"aten::mm: {sum(e.self_cpu_time_total for e in mm) / total:.0%} of the self CPU time")
    for e in sorted(mm, key=lambda e: -e.self_cpu_time_total):
        (m, k), (_, n) = e.input_shapes[0], e.input_shapes[1]
        secs = e.self_cpu_time_total / 1e6
        print(f"  [{m}, {k}] x [{k}, {n}]: {e.count} calls, {secs:.2f} s, "
              f"{2 * m * k * n * e.count / secs / 1e9:.0f} GFLOP/s")


if __name__ == "__main__":
    main()
