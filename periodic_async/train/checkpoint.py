"""Checkpoints at step boundaries, and resuming from them.

A checkpoint is taken after a step's weight sync, where the run's whole state is small and
consistent: no generation is in flight, the old model equals the policy, the rollout workers hold
policy version `step`. It holds, per rank, the actor's shard (policy weights, fp32 main weights,
AdamW state) and the RNG states; and, once, the step, the policy version, the data loader's
position, the group sizer's state (rollout.group_sizing: sagc) and the non-finite counter. The
reference model is its checkpoint directory's, the rollout seeds are a function of (seed, step,
prompt) (scheduling/plan.py), and the workers are started from the saved policy, so a resumed run
repeats the interrupted run's later steps.

Layout (run_dir/checkpoints/):
    step_000010/meta.json          step, version, loader and group-sizer state, layout, config
    step_000010/dist/              the actor (policy weights, fp32 main weights, AdamW moments) in
                                   Megatron-core's distributed checkpoint format (torch_dist)
    step_000010/rank_00000.pt      rank 0's RNG states
Writing goes to a temporary directory renamed into place once every rank has written (a
directory without meta.json, or a temporary one, is never picked up); the last
`trainer.keep_checkpoints` are kept.

Every tensor in dist/ is stored with its global shape and each rank's slice of it, so a checkpoint
loads on another TP / PP / DP layout (Megatron reshards it); a model of another shape is refused,
naming the tensor. The per-rank RNG states are restored on the same layout only (the trainer's
computation draws no random numbers; the rollout seeds come from the plan). `python -m
periodic_async.export` writes any checkpoint's policy as an HF directory.
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
DIST_DIR = "dist"


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


def save_checkpoint(run_dir: str, step: int, rank: int, world: int, sharded_state: dict, meta: dict,
                    keep: int) -> str:
    """Every rank calls this (collective). `sharded_state`: the actor's sharded_state_dict().
    Returns the checkpoint directory."""
    root = checkpoint_root(run_dir)
    final = os.path.join(root, f"step_{step:06d}")
    tmp = os.path.join(root, f".tmp-step_{step:06d}")
    try:
        if rank == 0:
            for name in os.listdir(root) if os.path.isdir(root) else ():
                if name.startswith(".tmp-step_"):     # a write cut short earlier (disk full, a kill)
                    shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            os.makedirs(os.path.join(tmp, DIST_DIR))
        _barrier()
        _dist_save(sharded_state, os.path.join(tmp, DIST_DIR))
        torch.save({"rng": _rng_state()}, os.path.join(tmp, f"rank_{rank:05d}.pt"))
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


def _start_writer_results_queue() -> None:
    """Megatron's torch_dist writer collects its writer processes' results through a queue of a
    multiprocessing manager process it starts on first use (a module global), which would outlive
    a SIGKILLed trainer. Started here instead, with the manager set to die with the trainer
    (PR_SET_PDEATHSIG), as the rollout workers are."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from ..lifetime import die_with_parent
    if getattr(filesystem_async, "_results_queue", "absent") is None:
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
        manager.start(initializer=die_with_parent)
        filesystem_async._results_queue = manager.Queue()
        _MANAGERS.append(manager)       # keeps it (and its queue's connection) alive


_MANAGERS: list = []


def _dist_save(sharded_state: dict, path: str) -> None:
    """dist_checkpointing.save; a failed write (disk full, unwritable) becomes an OSError whose
    message is each failed rank's error, not torch's multi-rank traceback dump."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint.api import CheckpointException
    _start_writer_results_queue()
    try:
        dist_checkpointing.save(sharded_state, path)
    except (CheckpointException, CheckpointingException) as e:
        raise OSError(_dist_error(e)) from e


def read_meta(path: str) -> dict:
    try:
        with open(os.path.join(path, "meta.json")) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise RunCheckpointError(f"cannot read {os.path.join(path, 'meta.json')}: {e}") from e


def load_checkpoint(path: str, rank: int, layout: dict, sharded_state: dict) -> tuple[dict, dict]:
    """(meta, the loaded state for `sharded_state`'s structure: actor.load_sharded_state_dict's
    input). Any TP / PP / DP layout loads; this rank's RNG states are restored when the layout is
    the checkpoint's. A tensor of another shape (another model) is refused, naming it."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint.api import CheckpointException
    meta = read_meta(path)
    dist_dir = os.path.join(path, DIST_DIR)
    if not os.path.isdir(dist_dir):
        raise RunCheckpointError(f"checkpoint {path} has no {DIST_DIR}/ directory (written by an older version?)")
    try:
        loaded = dist_checkpointing.load(sharded_state, dist_dir)
    except (CheckpointException, CheckpointingException, KeyError, ValueError, RuntimeError) as e:
        raise RunCheckpointError(f"checkpoint {path} does not fit this model: {_dist_error(e)}") from e
    if meta.get("layout") == layout:
        shard = os.path.join(path, f"rank_{rank:05d}.pt")
        try:
            _set_rng_state(torch.load(shard, map_location="cpu", weights_only=False)["rng"])
        except (OSError, RuntimeError, EOFError, KeyError) as e:
            raise RunCheckpointError(f"cannot read {shard}: {e}") from e
    return meta, loaded


def _dist_error(e: Exception) -> str:
    """One line for a distributed-checkpoint error: torch's CheckpointException carries each
    failed rank's exception (its str is a traceback per rank)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        errors = {r: (f[0] if isinstance(f, tuple) else f) for r, f in failures.items()}
        return "; ".join(f"rank {r}: {_dist_error(err)}" for r, err in sorted(errors.items()))
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:500]


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
