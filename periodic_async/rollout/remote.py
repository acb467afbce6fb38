"""Rollout workers on other nodes: a relay per device, launched by torchrun on each rollout node.

    # trainer node(s): as usual, plus rollout.remote_workers / rollout.remote_address
    PERIODIC_ASYNC_ROLLOUT_KEY=... torchrun ... -m periodic_async --config cfg.yaml \
        rollout.remote_workers=8 rollout.remote_address=0.0.0.0:29650 rollout.weight_sync=broadcast
    # each rollout node
    PERIODIC_ASYNC_ROLLOUT_KEY=... torchrun --nproc_per_node 8 --max-restarts 100 \
        -m periodic_async.rollout.remote --connect trainer0:29650

Each relay connects to the pool (trainer rank 0), is given a worker slot - the worker settings,
the weight layout, the current policy version and a pair-group name on the pool's weight-sync
store - and spawns the same worker process a local slot runs (worker_main.py `run_worker`), on its
local device (the LOCAL_RANK-th, made the only one it sees). From then on it relays messages
both ways between the pool's connection and the worker's queue and pipe; the weights go straight
from the pool to the worker over the broadcast sync (weight_sync.py), not through the relay.

Why torchrun: it is already the trainer's launcher, and on a rollout node it gives what is
needed - one process per device (LOCAL_RANK), restarts of a failed process (--max-restarts) and
signal forwarding - with nothing to run on the nodes beforehand. Ray would add a cluster service
on every node for what here is one connection per worker, and the fault handling that matters
(re-dispatching exactly the samples a lost worker owed) stays the pool's either way.

Requests and results travel over `multiprocessing.connection` (stdlib): length-prefixed pickles
after an HMAC challenge on a shared key (PERIODIC_ASYNC_ROLLOUT_KEY); unpickling bytes from an
unauthenticated peer would be code execution, so there is no default key.

Faults: the relay and its worker die together (PR_SET_PDEATHSIG both ways down); a relay whose
pool connection breaks, or whose worker dies, exits non-zero and torchrun restarts it; the pool
re-dispatches what that worker owed to the others and gives the slot to the next relay that
connects (it receives the current weights when it pairs).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import sys
import threading
import time
from multiprocessing.connection import AuthenticationError, Client

from ..netaddr import split_address
from .messages import Assign, Hello, Reject, Stop

KEY_VAR = "PERIODIC_ASYNC_ROLLOUT_KEY"


def rollout_key() -> bytes:
    """The shared secret of the pool and its remote relays (PERIODIC_ASYNC_ROLLOUT_KEY)."""
    key = os.environ.get(KEY_VAR, "")
    if not key:
        raise RuntimeError(f"rollout workers on other nodes authenticate with a shared key: set {KEY_VAR} to the "
                           "same secret on the trainer and on every rollout node")
    return key.encode()


def connect(address: str, key: bytes, timeout_s: float):
    """Connect to the pool, retrying until `timeout_s` (the trainer may start after the relay)."""
    host, port = split_address(address)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Client((host, port), authkey=key)
        except AuthenticationError:
            raise RuntimeError(f"the rollout pool at {address} refused this relay's key ({KEY_VAR} differs)") from None
        except OSError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no rollout pool at {address} within {timeout_s:.0f} s ({e})") from None
            time.sleep(0.5)


def _pool_to_worker(conn, inbox, worker, stopping: threading.Event) -> None:
    """Relay thread: requests, updates and stop from the pool into the worker's queue."""
    try:
        while True:
            msg = conn.recv()
            inbox.put(msg)
            if isinstance(msg, Stop):
                stopping.set()
                return
    except (EOFError, OSError):
        # the pool is gone (trainer stopped or node partition): nothing will collect the results
        worker.kill()
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m periodic_async.rollout.remote",
                                 description="A rollout worker for a trainer on another node (run under torchrun).")
    ap.add_argument("--connect", required=True, metavar="HOST:PORT", help="the trainer's rollout.remote_address")
    ap.add_argument("--model-dir", default=None,
                    help="the model directory on this node (default: the trainer's path, e.g. on a shared filesystem)")
    ap.add_argument("--connect-timeout-s", type=float, default=300.0)
    args = ap.parse_args(argv)

    import torch.multiprocessing as mp

    from ..backend import backend_without_setup
    from ..lifetime import die_with_parent
    from .worker_main import run_worker

    die_with_parent()     # torchrun's agent killed: this relay goes too (and its worker after it)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    conn = connect(args.connect, rollout_key(), args.connect_timeout_s)
    conn.send(Hello(socket.gethostname(), local_rank, os.getpid()))
    msg = conn.recv()
    if isinstance(msg, Reject):
        print(f"rollout relay {socket.gethostname()}:{local_rank}: {msg.reason}", file=sys.stderr, flush=True)
        return 0       # every slot is taken: not a failure torchrun should retry
    if not isinstance(msg, Assign):
        raise RuntimeError(f"rollout relay: the pool at {args.connect} sent {type(msg).__name__}, not an Assign "
                           "(a trainer running other code?)")
    wid, settings, layout, version = msg.wid, msg.settings, msg.layout, msg.version
    store_port, pair_key = msg.store_port, msg.pair_key
    if args.model_dir:
        settings = dataclasses.replace(settings, model_dir=args.model_dir)
    backend = backend_without_setup(settings.backend)
    placement = backend.node_worker_placement(local_rank, local_world)
    host, _ = split_address(args.connect)

    ctx = mp.get_context("spawn")
    inbox = ctx.Queue()
    reader, writer = ctx.Pipe(duplex=False)
    worker = ctx.Process(target=run_worker, name=f"rollout-worker-{wid}", daemon=True,
                         args=(wid, settings, placement, inbox, writer, None, layout, version,
                               (f"{host}:{store_port}", pair_key)))
    with backend.spawn_env(placement):
        worker.start()
    writer.close()
    stopping = threading.Event()       # the pool said stop: the run is over, not a fault
    threading.Thread(target=_pool_to_worker, args=(conn, inbox, worker, stopping), daemon=True).start()
    while True:      # worker -> pool
        try:
            msg = reader.recv()
        except (EOFError, OSError):
            break
        try:
            conn.send(msg)
        except OSError:
            if stopping.is_set():
                continue           # the pool closed after its stop; let the worker finish
            worker.kill()
            return 1
    worker.join(timeout=10)
    conn.close()
    return 0 if stopping.is_set() and worker.exitcode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
