"""Weight sync by process-group broadcast (`rollout.weight_sync: broadcast`): the path for rollout
workers that do not share memory with the trainer (other nodes).

Each rollout worker and the pool (in trainer rank 0) form a two-member process group of their own:
rank 0 the pool, rank 1 the worker. The groups are "stateless" - built directly on a TCPStore the
pool serves (`ProcessGroupGloo(store, rank, size)`), never the default group - so they neither
touch the trainer's Megatron groups nor vLLM's own process group inside the worker, and a
restarted worker simply gets a fresh pair group (a new store prefix) without involving anyone else.

A sync sends the pool's host copy of the weights (the flat buffer, HF layout) to each worker in
buckets of at most `bucket_bytes`: one broadcast per bucket, into a receive buffer of one bucket,
from which the worker's engine loads tensor by tensor - peak extra memory about one bucket.

Devices: gloo on cpu; the same code takes NCCL / HCCL groups on cuda / npu (buckets are moved to
the device first). Only the gloo path has run (CPU, single node): untested on GPU and NPU.

`SharedWeights` (end of the file) is the shm sync's buffer in a named file, for workers whose
engine loads in processes the pool never spawned (vLLM with rollout.tensor_parallel_size > 1).
"""
from __future__ import annotations

import math
import os
import socket
import tempfile
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

from ..backend import get_backend
from ..netaddr import split_address

Layout = list[tuple[str, tuple[int, ...]]]


def bucket_plan(layout: Layout, bucket_bytes: int, itemsize: int) -> list[tuple[int, int, list[int]]]:
    """[(flat offset, numel, [layout indices])]: consecutive tensors, each bucket at most
    bucket_bytes (a bigger tensor alone)."""
    plan: list[tuple[int, int, list[int]]] = []
    offset = 0
    for i, (_, shape) in enumerate(layout):
        n = math.prod(shape)
        if not plan or (plan[-1][1] + n) * itemsize > bucket_bytes:
            plan.append((offset, 0, []))
        start, numel, idx = plan[-1]
        plan[-1] = (start, numel + n, idx + [i])
        offset += n
    return plan


def serve_store(host: str = "0.0.0.0") -> tuple[dist.TCPStore, str]:
    """The pool's rendezvous store on a free port; returns (store, "host:port" for workers)."""
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300))
    addr = socket.gethostbyname(socket.gethostname()) if host == "0.0.0.0" else host
    return store, f"{addr}:{store.port}"


def pair_group(backend: str, store: dist.Store | None, address: str | None, key: str, rank: int,
               timeout_s: float = 300.0):
    """The two-member group named `key` (rank 0: the pool, rank 1: a worker). The pool passes its
    store; a worker passes the pool's "host:port". Blocks until both members have joined."""
    if store is None:
        host, port = split_address(address)
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    prefixed = dist.PrefixStore(f"weight-sync/{key}/", store)
    return get_backend(backend).pair_group(prefixed, rank, 2, timeout_s)


def send_weights(group, backend: str, buf: torch.Tensor, plan, device: torch.device | None = None) -> None:
    """Pool side: broadcast the flat host buffer to the group's worker, bucket by bucket. `device`:
    where the buckets go for the group's backend (default: the calling thread's current device;
    a sender thread passes the pool's, since a thread's current device is its own)."""
    device = device if device is not None else get_backend(backend).current_device()
    for start, numel, _ in plan:
        bucket = buf[start:start + numel]
        if device.type != "cpu":
            bucket = bucket.to(device, non_blocking=True)
        group.broadcast([bucket], dist.BroadcastOptions()).wait()


def recv_weights(group, backend: str, layout: Layout, plan, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Worker side: receive the buckets (in plan order) and yield each tensor as it arrives. Each
    is a copy: an engine may hold on to some tensors while it reads on (vLLM keeps parts of a
    fused weight across its loader's steps), and the receive buffer is reused for the next bucket."""
    device = get_backend(backend).current_device()
    largest = max(numel for _, numel, _ in plan)
    recv = torch.empty(largest, dtype=dtype, device=device)
    for _, numel, idx in plan:
        bucket = recv[:numel]
        group.broadcast([bucket], dist.BroadcastOptions()).wait()
        offset = 0
        for i in idx:
            name, shape = layout[i]
            n = math.prod(shape)
            yield name, bucket[offset:offset + n].view(shape).clone()
            offset += n


# ---------------------------------------------------------------------- the shm buffer, by name

_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
_SHM_PREFIX = "periodic-async-weights-"


@dataclass(frozen=True)
class SharedWeights:
    """The pool's flat HF-layout weights buffer in a named shared-memory file, and a picklable
    handle to it (path, dtype, layout): any process of the node maps it by name. vLLM with tensor
    parallelism loads in TP processes of its own, which neither a tensor shared by file
    descriptor nor a Python generator can reach through vLLM's collective_rpc (its arguments are
    pickled, a tensor by value); this handle is a few hundred bytes and each TP process opens the
    buffer itself. Iterating it yields (name, view into the buffer) in layout order, as
    worker._views does for the pool's usual buffer."""
    path: str
    dtype: str                                  # a torch dtype's name, e.g. "bfloat16"
    layout: tuple[tuple[str, tuple[int, ...]], ...]

    @classmethod
    def create(cls, layout, dtype: torch.dtype) -> "SharedWeights":
        """A new zeroed buffer for `layout` (the pool calls `unlink` when it closes)."""
        _remove_stale_buffers()
        path = os.path.join(_SHM_DIR, f"{_SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
        open(path, "xb").close()                # exclusive: never someone else's file
        shared = cls(path, str(dtype).removeprefix("torch."), tuple((n, tuple(s)) for n, s in layout))
        shared.tensor()                         # sizes the (sparse, zero) file
        return shared

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for _, shape in self.layout)

    def tensor(self) -> torch.Tensor:
        """The whole buffer, mapped shared: writes are seen by every process that maps it."""
        return torch.from_file(self.path, shared=True, size=self.numel, dtype=getattr(torch, self.dtype))

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        buf = self.tensor()
        offset = 0
        for name, shape in self.layout:
            n = math.prod(shape)
            yield name, buf[offset:offset + n].view(shape)
            offset += n

    def unlink(self) -> None:
        """Remove the name (processes that mapped it keep their mapping until they drop it)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _remove_stale_buffers() -> None:
    """Buffers left by pools that were killed before they could unlink theirs (the pid in the name
    is gone): a buffer holds a whole model, so they must not pile up in /dev/shm."""
    for name in os.listdir(_SHM_DIR):
        if not name.startswith(_SHM_PREFIX):
            continue
        pid = name[len(_SHM_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            try:
                os.unlink(os.path.join(_SHM_DIR, name))
            except OSError:
                pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
