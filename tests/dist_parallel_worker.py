"""Tri-model parity worker, run under torchrun by tests/test_tri_model.py (not a test file itself):

    python -m torch.distributed.run --standalone --nproc_per_node N tests/dist_parallel_worker.py \
        --tp TP --pp PP --out OUT_DIR --case NAME MODEL_DIR REF_DIR SHARED DTYPE [--case ...]

DP = N / (TP * PP). For every case it runs helpers.tri_model_quantities (the same function the
in-process TP=PP=DP=1 side runs); rank 0 saves the result to OUT_DIR/NAME.pt.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dist_tp_worker import _exit_when_orphaned  # noqa: E402  (also guards this worker)

import torch  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

from helpers import install_collective_guard, tri_model_quantities  # noqa: E402


@record
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--case", nargs=5, action="append", required=True,
                    metavar=("NAME", "MODEL_DIR", "REF_DIR", "SHARED", "DTYPE"))
    args = ap.parse_args()

    from periodic_async.backend import get_backend
    backend = get_backend("cpu")
    rank, world, _ = backend.init_distributed()
    backend.init_model_parallel(args.tp, args.pp, 0)
    install_collective_guard()   # NCCL / HCCL rules: no float64, no tensor off the device
    for name, model_dir, ref_dir, shared, dtype in args.case:
        t0 = time.time()
        res = tri_model_quantities(model_dir, ref_dir, shared_prompt=shared == "1", dtype=dtype)
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save(res, os.path.join(args.out, f"{name}.pt"))
            print(f"[rank 0] {name}: layout(tp,pp,dp)={res['layout']} epoch1={res['epoch1']} "
                  f"({time.time() - t0:.1f} s)", flush=True)
    torch.distributed.barrier()
    backend.shutdown_distributed()


if __name__ == "__main__":
    main()
