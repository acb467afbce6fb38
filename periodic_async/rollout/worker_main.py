"""A rollout worker process: `run_worker` is its entry point, for a local slot of the pool
(rollout/worker.py) and for a relay's worker on another node (rollout/remote.py) alike.

The process enters its placement, builds its engine (HF or vLLM) on its own device (its own cores
on CPU), loads the weights it starts from, says Ready, and then serves requests continuously: new
requests join the running batch as slots free up. Results go back on the worker's own pipe as each
response finishes (a queue shared by all workers would stay locked forever if a worker were killed
while writing to it). Weight updates (messages.Update) are applied from the pool's shared buffer
(weights_buffer.py) or received over the broadcast sync (weight_sync.py): an interruptible engine
takes them between two decode steps, any other once drained. The messages: rollout/messages.py.
"""
from __future__ import annotations

import os
import queue
import random
import signal
import time
from dataclasses import dataclass

import torch

from ..lifetime import die_with_parent
from .base import RolloutRequest
from .messages import Error, Generate, Placed, Ready, Receiving, Results, Stop, Update, Updated
from .weights_buffer import Layout, engine_weights


@dataclass(frozen=True)
class WorkerSettings:
    """Everything a worker process needs to build its engine (picklable)."""
    backend: str
    model_dir: str
    pad_token_id: int
    eos_token_id: int | None
    max_slots: int
    # Testing aid: a random delay of up to this many seconds before each result is sent, so that
    # results from several workers arrive in a shuffled order. 0 in real runs.
    arrival_jitter_s: float = 0.0
    engine: str = "hf"                    # "hf" | "vllm" (rollout.engine)
    max_model_len: int | None = None      # vllm: prompt + max_new_tokens limit (None: the model's)
    load_format: str = "auto"             # vllm: "auto" (checkpoint) | "dummy" (random, then a sync)
    kv_cache_gb: float = 1.0              # vllm on cpu: KV-cache size
    gpu_memory_utilization: float = 0.9   # vllm on an accelerator: its share of the device
    # "shm": workers read the weights from the pool's shared-memory buffer (one node);
    # "broadcast": the pool sends them over a process group per worker (rollout/weight_sync.py)
    weight_sync: str = "shm"
    bucket_bytes: int = 256 << 20         # broadcast sync: bucket size
    dtype: str = "float32"                # the engine's and the sync's weight dtype (model.dtype)
    # take weight updates mid-generation when the engine can (rollout.interruptible); else drain
    interruptible: bool = True
    # vllm: devices per engine (rollout.tensor_parallel_size). > 1: vLLM's TP processes load new
    # weights from the pool's buffer by name (weight_sync.SharedWeights), shm sync only
    tensor_parallel_size: int = 1
    enforce_eager: bool | None = None     # vllm: no CUDA / ACL graphs (None: on cpu only)
    compile_decode: bool = False          # hf: the decode step through torch.compile (rollout.compile_decode)



def _dtype(settings: WorkerSettings) -> torch.dtype:
    return getattr(torch, settings.dtype)


def _initial_env(names: list[str]) -> dict[str, str | None]:
    """These variables as they were when this process started (Linux: /proc/self/environ), i.e.
    before any import could have read them."""
    try:
        with open("/proc/self/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return {n: os.environ.get(n) for n in names}
    return {n: (env[n.encode()].decode() if n.encode() in env else None) for n in names}


def run_worker(wid: int, settings: WorkerSettings, placement: dict, inbox, outbox, buf: torch.Tensor | None,
               layout: Layout, version: int, sync: tuple[str, str] | None = None) -> None:
    """`outbox` is this worker's own pipe to the pool: a worker killed mid-write can only break its
    own channel (a queue shared by all workers would stay locked forever)."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the trainer handles Ctrl-C and stops us
    try:
        from ..backend import get_backend
        backend = get_backend(settings.backend, role="rollout")
        device = backend.enter_placement(placement)
        outbox.send(Placed(wid, {"device": str(device), "env": _initial_env(list(placement.get("env") or ()))}))
        if settings.engine == "vllm":
            from .vllm_engine import VLLMRolloutEngine, prepare_vllm_env
            prepare_vllm_env()     # before vllm is imported in this process
            engine = VLLMRolloutEngine(settings.model_dir, settings.pad_token_id, settings.eos_token_id, settings.max_slots, device,
                                       max_model_len=settings.max_model_len, load_format=settings.load_format,
                                       dtype=settings.dtype, kv_cache_gb=settings.kv_cache_gb,
                                       gpu_memory_utilization=settings.gpu_memory_utilization,
                                       enforce_eager=settings.enforce_eager,
                                       tensor_parallel_size=settings.tensor_parallel_size)
        else:
            from .hf_engine import HFRolloutEngine
            engine = HFRolloutEngine(settings.model_dir, settings.pad_token_id, settings.eos_token_id, settings.max_slots, device,
                                     compile_decode=settings.compile_decode)
        if sync is None:
            if version > 0 or settings.load_format == "dummy":
                engine.update_weights(engine_weights(buf, layout), version)
            outbox.send(Ready(wid, os.getpid(), version))
        else:
            # broadcast sync: say ready, join this worker's pair group with the pool (which joins
            # on "ready"), then receive the current weights if the checkpoint is not them
            from . import weight_sync
            outbox.send(Ready(wid, os.getpid(), version))
            address, key = sync
            group = weight_sync.pair_group(settings.backend, None, address, key, rank=1)
            plan = weight_sync.bucket_plan(layout, settings.bucket_bytes, torch.empty((), dtype=_dtype(settings)).element_size())
            receive = lambda: weight_sync.recv_weights(group, settings.backend, layout, plan, _dtype(settings))  # noqa: E731
            if version > 0 or settings.load_format == "dummy":
                engine.update_weights(receive(), version)
    except BaseException as e:  # noqa: BLE001 - reported to the pool, which raises it
        outbox.send(Error(wid, f"worker {wid} failed to start: {type(e).__name__}: {e}"))
        return
    rng = random.Random(wid * 7919 + version)
    state = {"active": 0, "update": None, "stop": False}

    held: list[RolloutRequest] = []     # requests that arrived after a pending update (drained engine)
    interrupt = engine.interruptible and settings.interruptible

    def poll():
        """New requests since the last decode step, and weight updates: an interruptible engine
        takes them at once (its in-flight sequences continue under the new weights); any other
        is drained first - requests that arrive meanwhile wait until it has the new weights."""
        new: list[RolloutRequest] = []
        idle = state["active"] == 0
        while True:
            try:
                msg = inbox.get(timeout=0.02) if idle and not new and state["update"] is None else inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(msg, Generate):
                (held if state["update"] is not None and not interrupt else new).extend(msg.requests)
            elif isinstance(msg, Update):
                state["update"] = msg.version
            elif isinstance(msg, Stop):
                state["stop"] = True
                break
        if state["update"] is not None and not state["stop"] and (interrupt or (idle and not new)):
            v = state["update"]
            if sync is None:
                engine.update_weights(engine_weights(buf, layout), v)
            else:       # the pool sends once it hears this (it never waits on our generation)
                outbox.send(Receiving(wid, v))
                engine.update_weights(receive(), v)
            state["update"] = None
            outbox.send(Updated(wid, v))
            new += held
            held.clear()
        if state["stop"] and idle and not new:
            return None
        return new

    seat = placement.get("seat")     # cores shared with the trainer (backend.CoreSeat), or None

    def on_slots(n: int) -> None:
        state["active"] = n
        if seat is not None:
            seat.set_busy(n > 0)

    try:
        for finished in engine.serve(poll, on_slots=on_slots):
            for result in finished:
                result.timings["worker"] = wid
            if settings.arrival_jitter_s > 0:   # testing aid: send one at a time, in a shuffled order
                rng.shuffle(finished)
                for result in finished:
                    time.sleep(rng.uniform(0, settings.arrival_jitter_s))
                    outbox.send(Results(wid, [result]))
            else:
                outbox.send(Results(wid, finished))
    except Exception as e:  # noqa: BLE001 - reported to the pool, which raises it in the trainer
        outbox.send(Error(wid, f"rollout worker {wid} failed: {type(e).__name__}: {e}"))
    finally:
        engine.close()
