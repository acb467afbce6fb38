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
"""
from __future__ import annotations

import math
import socket
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

from ..backend import get_backend

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
        host, port = address.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
    prefixed = dist.PrefixStore(f"weight-sync/{key}/", store)
    return get_backend(backend).pair_group(prefixed, rank, 2, timeout_s)


def send_weights(group, backend: str, buf: torch.Tensor, plan) -> None:
    """Pool side: broadcast the flat host buffer to the group's worker, bucket by bucket."""
    device = get_backend(backend).current_device()
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
