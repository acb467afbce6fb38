"""Model-state bytes of a sharded actor, run under torchrun by tests/test_memory_plan.py (not a
test file itself):

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist_memory_plan_worker.py \
        --out OUT.json --case NAME MODEL_DIR [--case ...]

For each layout (TP=2, then PP=2) and case it builds a bf16 TriModelActor (fp32 main weights, old
and reference models) and records every rank's `memory_bytes()` and pipeline stage; rank 0 writes
{layout: {case: [{"stage", "bytes"} per rank]}} to OUT.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dist_tp_worker import _exit_when_orphaned  # noqa: E402,F401  (also guards this worker)

import torch.distributed as dist  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}


@record
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--case", nargs=2, action="append", required=True, metavar=("NAME", "MODEL_DIR"))
    args = ap.parse_args()

    from megatron.core import parallel_state as ps
    from periodic_async.actor.tri_model import TriModelActor
    from periodic_async.backend import get_backend
    from periodic_async.config import ActorConfig
    from periodic_async.models.mcore import arch_from_hf_dir
    backend = get_backend("cpu")
    rank, world, _ = backend.init_distributed()
    out: dict = {}
    for layout, (tp, pp) in LAYOUTS.items():
        backend.init_model_parallel(tp, pp, 0)
        for name, model_dir in args.case:
            eng = TriModelActor(ActorConfig(ppo_epochs=2, kl_coef=0.1), arch_from_hf_dir(model_dir), model_dir, "bfloat16")
            mine = {"stage": ps.get_pipeline_model_parallel_rank(), "bytes": eng.memory_bytes()}
            ranks = [None] * world
            dist.all_gather_object(ranks, mine)
            out.setdefault(layout, {})[name] = ranks
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(out, f)
    backend.shutdown_distributed()


if __name__ == "__main__":
    main()
