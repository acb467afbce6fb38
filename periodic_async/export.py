"""`python -m periodic_async.export CHECKPOINT_DIR OUT_DIR`: a checkpoint's policy as a Hugging Face
directory (config, tokenizer, safetensors), which loads on any layout and in any engine.

A checkpoint's shards are per rank (train/checkpoint.py), so run this with the checkpoint's world
size - a TP=2 checkpoint under `torchrun --nproc_per_node 2 -m periodic_async.export ...` - on the
run's backend. The model directory the run trained from (model.path, or run_dir/model_init for the
tiny model) must still exist: it gives the architecture, the tokenizer and the reference layout.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def export_checkpoint(ckpt_dir: str, out_dir: str) -> None:
    import torch.distributed as dist

    from .actor.tri_model import TriModelActor
    from .backend import get_backend
    from .config import config_from_dict
    from .models.convert import save_hf_checkpoint
    from .models.mcore import arch_from_hf_dir
    from .train.checkpoint import load_checkpoint
    from .train.trainer import drain

    with open(os.path.join(ckpt_dir, "meta.json")) as f:
        meta = json.load(f)
    cfg = config_from_dict(meta["config"])
    backend = get_backend(cfg.backend)
    rank, world, local_rank = backend.init_distributed()
    if world != meta["world_size"]:
        raise SystemExit(f"export: {ckpt_dir} was written by {meta['world_size']} processes; run with that many "
                         f"(torchrun --nproc_per_node {meta['world_size']}), not {world}")
    layout = meta["layout"]
    backend.init_model_parallel(layout["tensor_model_parallel_size"], layout["pipeline_model_parallel_size"],
                                cfg.trainer.seed)
    model_dir = cfg.model.path or os.path.join(cfg.trainer.run_dir, "model_init")
    arch = arch_from_hf_dir(model_dir)
    device = backend.device(local_rank) if cfg.backend != "cpu" else "cpu"
    actor = TriModelActor(cfg.actor, arch, model_dir, cfg.model.dtype, device, with_reference=False, with_old=False)
    _, state = load_checkpoint(ckpt_dir, rank, world, layout)
    actor.load_state_dict(state)
    named = actor.export_weights()
    if rank == 0:
        save_hf_checkpoint(named, model_dir, out_dir)
    else:
        drain(named)
    dist.barrier()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m periodic_async.export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a checkpoint directory (run_dir/checkpoints/step_NNNNNN)")
    ap.add_argument("out", help="the HF directory to write")
    args = ap.parse_args(argv)
    if not os.path.exists(os.path.join(args.checkpoint, "meta.json")):
        print(f"export: {args.checkpoint} is not a checkpoint directory (no meta.json)", file=sys.stderr)
        return 2
    export_checkpoint(args.checkpoint, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
