"""`python -m periodic_async.export CHECKPOINT_DIR OUT_DIR`: a checkpoint's policy as a Hugging Face
directory (config, tokenizer, safetensors), which loads on any layout and in any engine.

One process on the CPU, whatever layout and backend wrote the checkpoint: its policy is stored in
Megatron-core's distributed format (train/checkpoint.py), which loads at TP = PP = 1 here. The
model directory the run trained from (model.path, or run_dir/model_init for the tiny model) must
still exist: it gives the architecture, the tokenizer and the HF names.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def export_checkpoint(ckpt_dir: str, out_dir: str) -> None:
    from .actor.tri_model import TriModelActor
    from .backend import get_backend
    from .config import config_from_dict
    from .models.convert import save_hf_checkpoint
    from .models.mcore import arch_from_hf_dir
    from .train.checkpoint import load_checkpoint, read_meta

    cfg = config_from_dict(read_meta(ckpt_dir)["config"])
    backend = get_backend("cpu")
    backend.init_distributed()
    backend.init_model_parallel(1, 1, cfg.trainer.seed)
    model_dir = cfg.model.path or os.path.join(cfg.trainer.run_dir, "model_init")
    arch = arch_from_hf_dir(model_dir)
    actor = TriModelActor(cfg.actor, arch, model_dir, cfg.model.dtype, "cpu", with_reference=False, with_old=False)
    _, loaded = load_checkpoint(ckpt_dir, 0, {}, actor.sharded_state_dict(with_optimizer=False))
    actor.load_sharded_state_dict(loaded, with_optimizer=False)
    named = actor.export_weights()
    save_hf_checkpoint(named, model_dir, out_dir)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m periodic_async.export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a checkpoint directory (run_dir/checkpoints/step_NNNNNN)")
    ap.add_argument("out", help="the HF directory to write")
    args = ap.parse_args(argv)
    from .__main__ import _quiet_third_party
    _quiet_third_party()
    if not os.path.exists(os.path.join(args.checkpoint, "meta.json")):
        print(f"export: {args.checkpoint} is not a checkpoint directory (no meta.json)", file=sys.stderr)
        return 2
    from .errors import INPUT_ERROR_EXIT_CODE, InputError
    try:
        export_checkpoint(args.checkpoint, args.out)
    except InputError as e:
        print(f"export: {e}", file=sys.stderr)
        return INPUT_ERROR_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
