"""The messages between the pool (rollout/worker.py), its worker processes (rollout/worker_main.py)
and the relays of workers on other nodes (rollout/remote.py): one frozen dataclass per kind,
torch-free. They cross multiprocessing queues, pipes and `multiprocessing.connection`s as pickles,
so every field is picklable; a relay passes them on unchanged.

Pool -> worker: Generate, Update, Stop.
Worker -> pool: Placed, Ready, Receiving, Updated, Results, Error (each names its worker, `wid`).
Relay <-> pool, once per connection: Hello (relay), then Assign or Reject (pool).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


# ---------------------------------------------------------------------- pool -> worker
@dataclass(frozen=True)
class Generate:
    """Requests to add to the worker's running batch (rollout/base.py RolloutRequest)."""
    requests: list


@dataclass(frozen=True)
class Update:
    """Load weights `version` (from the shared buffer, or the broadcast that follows)."""
    version: int


@dataclass(frozen=True)
class Stop:
    """Finish what is in flight, then exit."""


# ---------------------------------------------------------------------- worker -> pool
@dataclass(frozen=True)
class Placed:
    """The worker entered its placement: `info` = {"device": str, "env": {name: value | None}}."""
    wid: int
    info: dict


@dataclass(frozen=True)
class Ready:
    """The engine is built and holds weights `version`; `pid` is the worker process's."""
    wid: int
    pid: int
    version: int


@dataclass(frozen=True)
class Receiving:
    """Broadcast sync: the worker now takes weights `version` and waits for the pool's send."""
    wid: int
    version: int


@dataclass(frozen=True)
class Updated:
    """The engine now holds weights `version`."""
    wid: int
    version: int


@dataclass(frozen=True)
class Results:
    """Finished samples (rollout/base.py RolloutResult)."""
    wid: int
    results: list


@dataclass(frozen=True)
class Error:
    """The worker failed (to start, or while serving); the pool raises `text`."""
    wid: int
    text: str


# ---------------------------------------------------------------------- relay <-> pool handshake
@dataclass(frozen=True)
class Hello:
    """A relay connected: where it runs."""
    host: str
    local_rank: int
    pid: int


@dataclass(frozen=True)
class Assign:
    """The pool gives the relay slot `wid`: what its worker process starts with (`settings`: a
    worker.WorkerSettings), and the pair-group name on the pool's weight-sync store."""
    wid: int
    settings: Any
    layout: list
    version: int
    store_port: int
    pair_key: str


@dataclass(frozen=True)
class Reject:
    """No slot for this relay (every remote slot is taken)."""
    reason: str


class WorkerError(RuntimeError):
    """A rollout worker failed in a way a restart does not fix (e.g. it cannot start); what the
    pool raises for an Error message."""
