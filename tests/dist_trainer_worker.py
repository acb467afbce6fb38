"""The Trainer with groups of different K, run under torchrun by tests/test_tri_model.py (not a
test file itself):

    python -m torch.distributed.run --standalone --nproc_per_node N tests/dist_trainer_worker.py \
        --sizes 2,4,8 CONFIG [key=value ...]

`python -m periodic_async` with one test hook: rank 0's planner gives prompt i of every batch
K = sizes[i % len(sizes)] (helpers.mixed_k_hook); and every tensor collective checked against the
NCCL / HCCL rules (helpers.install_collective_guard).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dist_tp_worker import _exit_when_orphaned  # noqa: E402,F401  (also guards this worker)

from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

from helpers import install_collective_guard, mixed_k_hook  # noqa: E402


@record
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", required=True)
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    from periodic_async.backend import get_backend
    from periodic_async.config import load_config
    from periodic_async.train.trainer import Trainer
    backend = get_backend("cpu")
    install_collective_guard()   # NCCL / HCCL rules: no float64, no tensor off the device
    trainer = Trainer(load_config(args.config, args.overrides))
    mixed_k_hook(tuple(int(k) for k in args.sizes.split(",")))(trainer)
    trainer.fit()
    backend.shutdown_distributed()


if __name__ == "__main__":
    main()
