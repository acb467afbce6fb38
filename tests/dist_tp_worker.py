"""TP-parity worker, run under torchrun by tests/test_tensor_parallel.py (not a test file itself):

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist_tp_worker.py \
        --tp 2 --out OUT_DIR --case NAME MODEL_DIR REF_DIR [--case ...]

For every case it runs helpers.tp_parity_quantities (the same function the in-process TP=1 side
runs) and rank 0 saves the result to OUT_DIR/NAME.pt with torch.save.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time


def _exit_when_orphaned(poll_s: float = 1.0) -> None:
    """torchrun starts workers in their own sessions: if the launcher is killed (e.g. by the test's
    timeout), a worker would otherwise wait ~10 min for the dead agent's store. Exit instead."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(3)
    threading.Thread(target=watch, daemon=True, name="orphan-watchdog").start()


_exit_when_orphaned()   # before the slow imports

import torch  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from helpers import install_collective_guard, tp_parity_quantities  # noqa: E402


@record   # torchrun's failure summary then carries the worker's traceback
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--case", nargs=3, action="append", required=True, metavar=("NAME", "MODEL_DIR", "REF_DIR"))
    args = ap.parse_args()

    from periodic_async.backend import get_backend
    backend = get_backend("cpu")
    rank, world, _ = backend.init_distributed()
    if world % args.tp:
        raise SystemExit(f"world size {world} is not divisible by --tp {args.tp}")
    backend.init_model_parallel(args.tp, 1, args.seed)
    install_collective_guard()   # NCCL / HCCL rules: no float64, no tensor off the device
    for name, model_dir, ref_dir in args.case:
        t0 = time.time()
        res = tp_parity_quantities(model_dir, ref_dir if ref_dir != "-" else None)
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save(res, os.path.join(args.out, f"{name}.pt"))
            print(f"[rank 0] {name}: TP={res['tp']} metrics={res['metrics']} "
                  f"replicated_grad_max_diff={res['replicated_grad_max_diff']:.3g} ({time.time() - t0:.1f} s)",
                  flush=True)
    torch.distributed.barrier()
    backend.shutdown_distributed()


if __name__ == "__main__":
    main()
