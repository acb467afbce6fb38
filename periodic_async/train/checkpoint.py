"""Checkpoints at step boundaries, and resuming from them.

A checkpoint is taken after a step's weight sync, where the run's whole state is small and
consistent: no generation is in flight, the old model equals the policy, the rollout workers hold
policy version `step`. It holds, per rank, the actor's shard (policy weights, fp32 main weights,
AdamW state) and the RNG states; and, once, the step, the policy version, the data loader's
position and the non-finite counter. The reference model is its checkpoint directory's, the
rollout seeds are a function of (seed, step, prompt) (scheduling/plan.py), and the workers are
started from the saved policy, so a resumed run repeats the interrupted run's later steps.

Layout (run_dir/checkpoints/):
    step_000010/meta.json          step, version, loader state, layout, config
    step_000010/rank_00000.pt      rank 0's actor shard + RNG states
Writing goes to a temporary directory renamed into place once every rank has written (a
directory without meta.json, or a temporary one, is never picked up); the last
`trainer.keep_checkpoints` are kept.

The shards are per rank (torch.save of the local state), so a checkpoint loads on the same
TP / PP / DP layout only (a different one is refused, naming the sizes); the layout-free form is
the HF export of its policy (`python -m periodic_async.export`).
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil

import numpy as np
import torch
import torch.distributed as dist

from ..errors import InputError

_NAME = re.compile(r"^step_(\d{6,})$")


class RunCheckpointError(InputError):
    """A run checkpoint that cannot be written or loaded here (named in the message); not the
    model directory's CheckpointError (models/convert.py)."""


def checkpoint_root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def complete_checkpoints(run_dir: str) -> list[str]:
    """Finished checkpoints of a run directory, oldest first."""
    root = checkpoint_root(run_dir)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _NAME.match(name)
        if m and os.path.exists(os.path.join(root, name, "meta.json")):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return [p for _, p in sorted(found)]


def resolve_resume(resume: str, run_dir: str) -> str | None:
    """trainer.resume -> the checkpoint directory to load, or None. auto: the newest in run_dir
    (None when there is none); none: None; otherwise a checkpoint directory."""
    if resume == "none":
        return None
    if resume == "auto":
        found = complete_checkpoints(run_dir)
        return found[-1] if found else None
    if not os.path.exists(os.path.join(resume, "meta.json")):
        raise RunCheckpointError(f"trainer.resume: {resume} is not a checkpoint directory (no meta.json)")
    return resume


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def save_checkpoint(run_dir: str, step: int, rank: int, world: int, actor_state: dict, meta: dict,
                    keep: int) -> str:
    """Every rank calls this (collective: barriers). Returns the checkpoint directory."""
    root = checkpoint_root(run_dir)
    final = os.path.join(root, f"step_{step:06d}")
    tmp = os.path.join(root, f".tmp-step_{step:06d}")
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        _barrier()
        torch.save({**actor_state, "rng": _rng_state()}, os.path.join(tmp, f"rank_{rank:05d}.pt"))
        _barrier()
        if rank == 0:
            with open(os.path.join(tmp, "meta.json"), "w") as f:
                json.dump({**meta, "step": step, "world_size": world}, f, indent=1)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            for old in complete_checkpoints(run_dir)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        # e.g. disk full: the previous checkpoints are untouched (only the temporary one is partial)
        raise RunCheckpointError(f"could not write checkpoint {final}: {e}") from e
    _barrier()
    return final


def load_checkpoint(path: str, rank: int, world: int, layout: dict) -> tuple[dict, dict]:
    """(meta, this rank's actor state); refuses a checkpoint of another layout, naming it."""
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    saved = meta.get("layout", {})
    diff = {k: (saved.get(k), v) for k, v in layout.items() if saved.get(k) != v}
    if diff:
        what = ", ".join(f"{k} {a} (checkpoint) vs {b} (this run)" for k, (a, b) in diff.items())
        raise RunCheckpointError(f"checkpoint {path} was written with another layout: {what}; it loads only on "
                              "the same layout (its HF export loads on any: python -m periodic_async.export)")
    shard = os.path.join(path, f"rank_{rank:05d}.pt")
    try:
        state = torch.load(shard, map_location="cpu", weights_only=False)
    except (OSError, RuntimeError, EOFError) as e:
        raise RunCheckpointError(f"cannot read {shard}: {e}") from e
    _set_rng_state(state.pop("rng"))
    return meta, state


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
