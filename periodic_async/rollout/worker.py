"""Rollout workers in their own processes, and the pool that feeds, watches and syncs them.

Each worker process owns a rollout engine on its own device (its own cores on CPU) and serves
requests continuously: new requests join the running batch as slots free up. Results go back on
the worker's own pipe as each response finishes (a queue shared by all workers would stay locked
forever if a worker were killed while writing to it).

Weight sync (one node): the trainer writes the policy's HF-layout tensors into ONE flat
shared-memory buffer and tells every worker the new version; each worker copies from the buffer
into its engine when it is idle and acknowledges. The pool dispatches the next batch only after
every worker has acknowledged, so every sample of batch t comes from policy t. In the async mode
(`post_weights`) the update reaches workers that are generating: an interruptible engine takes it
between two decode steps, any other once drained; acknowledgements are collected by whoever reads
the workers' messages (`poll`).

Faults: a worker that dies, or makes no progress for `worker_timeout_s` while it has work, is
killed and restarted from the buffer (the current weights); the samples it still owed are
re-dispatched (only those - `sample_indices`), and a late or duplicate result is dropped, so no
sample is lost or counted twice. Workers die with the trainer (PR_SET_PDEATHSIG on Linux) and
`close()` stops and joins them: no orphan processes.
"""
from __future__ import annotations

import logging
import math
import os
import pickle
import queue
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
import torch.multiprocessing as mp

from ..lifetime import die_with_parent
from ..scheduling.staleness import STRICT, StalenessRule
from .base import RolloutRequest, RolloutResult
from .dispatch import least_loaded_worker
from .messages import (Assign, Error, Generate, Hello, Placed, Ready, Reject, Results, Stop, Update,
                       Updated)

log = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    """A rollout worker failed in a way a restart does not fix (e.g. it cannot start)."""


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


Layout = list[tuple[str, tuple[int, ...]]]


def _views(buf: torch.Tensor, layout: Layout) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, view into the flat buffer) in layout order."""
    offset = 0
    for name, shape in layout:
        n = math.prod(shape)
        yield name, buf[offset:offset + n].view(shape)
        offset += n


def _weights(buf, layout: Layout):
    """What an engine loads from the pool's buffer: views of the tensor the worker was given, or,
    for a vLLM engine with tensor parallelism, the buffer's named handle (weight_sync.SharedWeights:
    picklable, so vLLM's TP processes open it themselves; iterating it gives the same views)."""
    return _views(buf, layout) if isinstance(buf, torch.Tensor) else buf


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


def _worker_main(wid: int, settings: WorkerSettings, placement: dict, inbox, outbox, buf: torch.Tensor | None,
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
            engine = HFRolloutEngine(settings.model_dir, settings.pad_token_id, settings.eos_token_id, settings.max_slots, device)
        if sync is None:
            if version > 0 or settings.load_format == "dummy":
                engine.update_weights(_weights(buf, layout), version)
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
        if state["update"] is not None and (interrupt or (idle and not new)):
            v = state["update"]
            engine.update_weights(_weights(buf, layout) if sync is None else receive(), v)
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


@dataclass
class _Handle:
    process: mp.Process | None     # None: a worker on another node (its relay's connection)
    inbox: object                  # .put(msg) reaches the worker
    reader: object                 # the read end of this worker's result pipe (None once broken)
    pid: int = 0
    last_progress: float = 0.0
    remote: bool = False
    ready: bool = False            # said Ready (and, broadcast sync, paired)

    def alive(self) -> bool:
        if self.remote:
            return self.reader is not None
        return self.process.is_alive()


class _ConnectionInbox:
    """A remote worker's inbox: messages go over its relay's connection (a broken one shows up
    as EOF on the read side, where the pool handles it)."""

    def __init__(self, conn):
        self.conn = conn

    def put(self, msg) -> None:
        try:
            self.conn.send(msg)
        except (OSError, ValueError):
            pass


class WorkerPool:
    """Parent-side owner of the rollout worker processes."""

    def __init__(self, settings: WorkerSettings, placements: list[dict], layout: Layout, dtype: torch.dtype = torch.float32,
                 worker_timeout_s: float = 120.0, startup_timeout_s: float = 300.0,
                 initial_weights: Iterable[tuple[str, torch.Tensor]] | None = None,
                 staleness: StalenessRule = STRICT, remote_workers: int = 0, remote_address: str | None = None,
                 initial_version: int = 0):
        """initial_weights: version 0 in the shared buffer before the workers start (needed when
        they start from dummy weights, settings.load_format == "dummy"). staleness: which results
        are delivered (scheduling/staleness.py); others are dropped and counted.
        remote_workers: slots after the local ones (`placements`) for workers on other nodes, whose
        relays connect to `remote_address` (rollout/remote.py); they need the broadcast sync.
        initial_version: the version of initial_weights (a resumed run's checkpoint step)."""
        if settings.load_format == "dummy" and initial_weights is None:
            raise ValueError("rollout workers with dummy weights need initial_weights for version 0")
        if remote_workers and settings.weight_sync != "broadcast":
            raise ValueError("rollout workers on other nodes (remote_workers > 0) need weight_sync 'broadcast'")
        self.settings, self.placements, self.layout = settings, placements, layout
        self.worker_timeout_s, self.startup_timeout_s = worker_timeout_s, startup_timeout_s
        self.staleness = staleness
        self.placed: dict[int, dict] = {}     # wid -> the device and visible-device variables it reported
        self._ctx = mp.get_context("spawn")
        self._shared = self._buf = None
        if settings.tensor_parallel_size > 1:
            self._shared = self._named_buffer(settings, layout, dtype)
            self._buf = self._shared.tensor()
        else:
            self._buf = torch.zeros(sum(math.prod(s) for _, s in layout), dtype=dtype).share_memory_()
        self.version = initial_version
        if initial_version and initial_weights is None:
            raise ValueError("a pool starting at a version > 0 needs that version's initial_weights")
        self.restarts = 0
        self.dropped_results = 0
        self._owner: dict[tuple[int, int], int] = {}          # (group, k) -> worker id
        self._requests: dict[int, RolloutRequest] = {}        # group -> its request (for re-dispatch)
        self._workers: list[_Handle | None] = [None] * len(placements)
        self._workers += [_Handle(None, None, None, remote=True) for _ in range(remote_workers)]
        self._pending: list[RolloutRequest] = []              # dispatched while no worker was connected
        self._pending_since = 0.0
        self._started = False                                 # every slot has been ready once
        self._arrivals: queue.Queue = queue.Queue()           # relays' connections, from the listener thread
        self._listener = None
        self._closed = False
        self._stash: list = []                                # results received while awaiting acks
        # Updates while workers generate (trainer.mode async): the trainer thread writes the
        # buffer and posts the version (`post_weights`); the thread that reads the workers'
        # messages (`poll`) collects the acks. The lock keeps a write and a worker (re)start, which
        # reads the buffer, apart; `_acked` is set once every worker holds `applied_version`.
        import threading
        self._lock = threading.RLock()
        self._acked = threading.Event()
        self._acked.set()
        self._awaiting: set[int] = set()
        self.applied_version = initial_version
        self._next_check = 0.0
        if initial_weights is not None:
            self._write_buffer(initial_weights)
        self._pairs: dict[int, object] = {}                   # broadcast sync: wid -> pair group
        self._keys: dict[int, str] = {}                       # wid -> its current pair group's name
        self._spawned = 0
        # Every worker process is started from this one long-lived thread: PR_SET_PDEATHSIG (the
        # worker dies with its parent) fires when the parent THREAD exits, and a replacement for a
        # worker lost mid-batch would otherwise be started by the batch's producer thread and be
        # killed when that thread ends with the batch.
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-spawner")
        self._store = self._sync_address = None
        if settings.weight_sync == "broadcast":
            from . import weight_sync
            self._store, self._sync_address = weight_sync.serve_store()
            self._plan = weight_sync.bucket_plan(layout, settings.bucket_bytes, self._buf.element_size())
        try:
            if remote_workers:
                self._listen(remote_address)
            for wid in range(len(placements)):
                self._spawn(wid)
            self._await(Ready, set(range(len(self._workers))), self.startup_timeout_s)
            self._started = True
        except BaseException:
            self.close()
            raise

    def _named_buffer(self, settings: WorkerSettings, layout: Layout, dtype: torch.dtype):
        """The weights buffer as a named file (weight_sync.SharedWeights), for vLLM engines whose
        TP processes load from it; removed when the pool closes or is collected."""
        if settings.engine != "vllm" or settings.weight_sync != "shm":
            raise ValueError(f"tensor_parallel_size {settings.tensor_parallel_size} needs engine 'vllm' and "
                             f"weight_sync 'shm' (got '{settings.engine}', '{settings.weight_sync}')")
        import weakref

        from .weight_sync import SharedWeights
        shared = SharedWeights.create(layout, dtype)
        self._unlink_buffer = weakref.finalize(self, shared.unlink)
        return shared

    def _worker_buffer(self):
        """What a local worker gets of the buffer: the shared tensor, or its named handle (TP > 1)."""
        return self._buf if self._shared is None else self._shared

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def pids(self) -> list[int]:
        """Process ids of the local workers (a remote worker's pid is on its own node)."""
        return [h.pid for h in self._workers if h is not None and not h.remote]

    # ------------------------------------------------------------------ workers on other nodes
    def _listen(self, address: str) -> None:
        from multiprocessing.connection import Listener

        from .remote import rollout_key, split_address
        self._listener = Listener(split_address(address), authkey=rollout_key())
        self.remote_address = "%s:%d" % self._listener.address

        def accept():
            while not self._closed:
                try:
                    self._arrivals.put(self._listener.accept())
                except Exception as e:  # noqa: BLE001 - a wrong key, a port scan: log, keep listening
                    if self._closed:
                        return
                    log.warning("rollout pool: refused a connection at %s (%s)", self.remote_address, e)
        import threading
        threading.Thread(target=accept, name="rollout-listener", daemon=True).start()

    def _admit_arrivals(self) -> None:
        """Give each newly connected relay a vacant remote slot (or turn it away)."""
        while True:
            try:
                conn = self._arrivals.get_nowait()
            except queue.Empty:
                return
            try:
                if not conn.poll(10):
                    raise EOFError("no hello")
                hello = conn.recv()
                if not isinstance(hello, Hello):
                    raise ValueError(f"expected a Hello, got {type(hello).__name__}")
                host, local_rank, pid = hello.host, hello.local_rank, hello.pid
                vacant = [wid for wid, h in enumerate(self._workers) if h.remote and h.reader is None]
                if not vacant:
                    conn.send(Reject(f"all {sum(h.remote for h in self._workers)} remote rollout slots are taken"))
                    conn.close()
                    continue
                wid = vacant[0]
                self._spawned += 1
                self._keys[wid] = f"worker{wid}-{self._spawned}"
                self._pairs.pop(wid, None)
                port = int(self._sync_address.rsplit(":", 1)[1])
                conn.send(Assign(wid, self.settings, self.layout, self.version, port, self._keys[wid]))
            except (EOFError, OSError, ValueError, TypeError) as e:
                log.warning("rollout pool: a relay's hello failed (%s)", e)
                conn.close()
                continue
            log.info("rollout pool: remote worker %d is %s local rank %d (relay pid %d)", wid, host, local_rank, pid)
            self._workers[wid] = _Handle(None, _ConnectionInbox(conn), conn, pid=pid,
                                         last_progress=time.monotonic(), remote=True)

    def _vacate(self, wid: int, why: str) -> None:
        """A remote worker is gone: close its connection (its relay exits and torchrun restarts
        it); the slot waits for the next relay."""
        h = self._workers[wid]
        log.warning("remote rollout worker %d %s; its slot waits for a new connection", wid, why)
        if h.reader is not None:
            h.reader.close()
        self._pairs.pop(wid, None)
        self._workers[wid] = _Handle(None, None, None, remote=True)

    # ------------------------------------------------------------------ processes
    def _spawn(self, wid: int) -> None:
        self._spawner.submit(self._start_process, wid).result()

    def _start_process(self, wid: int) -> None:
        inbox = self._ctx.Queue()
        reader, writer = self._ctx.Pipe(duplex=False)
        sync = None
        if self.settings.weight_sync == "broadcast":
            self._spawned += 1
            self._keys[wid] = f"worker{wid}-{self._spawned}"     # a fresh pair group per process
            self._pairs.pop(wid, None)
            sync = (self._sync_address, self._keys[wid])
        p = self._ctx.Process(target=_worker_main, name=f"rollout-worker-{wid}", daemon=True,
                              args=(wid, self.settings, self.placements[wid], inbox, writer,
                                    self._worker_buffer() if sync is None else None, self.layout,
                                    self.version, sync))
        from ..backend import get_backend
        with get_backend(self.settings.backend).spawn_env(self.placements[wid]):
            p.start()
        writer.close()   # the worker holds the only write end: its death shows up as EOF here
        self._workers[wid] = _Handle(p, inbox, reader, pid=p.pid, last_progress=time.monotonic())

    def _recv(self, timeout: float):
        """The next message from any worker, or None after `timeout` s. A broken pipe (a worker
        killed mid-message) closes that channel and kills the worker; the health check restarts it."""
        from multiprocessing.connection import wait
        if self._listener is not None:
            self._admit_arrivals()
        readers = {h.reader: wid for wid, h in enumerate(self._workers) if h is not None and h.reader is not None}
        if not readers:
            time.sleep(timeout)
            return None
        for conn in wait(list(readers), timeout):
            wid = readers[conn]
            try:
                return conn.recv()
            except (EOFError, OSError, pickle.UnpicklingError, AttributeError, ValueError):
                h = self._workers[wid]
                h.reader = None
                conn.close()
                if h.process is not None and h.process.is_alive():
                    h.process.kill()
        return None

    def _await(self, kind: type, wids: set[int], timeout: float, version: int | None = None) -> None:
        """Wait for a `kind` message (Ready / Updated) from each worker in `wids`, restarting
        any that dies meanwhile (a restarted worker starts at the current version: it counts)."""
        name = kind.__name__.lower()      # "ready" / "updated", as the messages below say
        deadline = time.monotonic() + timeout
        waiting = set(wids)
        next_check = time.monotonic() + 0.2
        while waiting:
            now = time.monotonic()
            if now > deadline:
                remote = [w for w in waiting if self._workers[w].remote]
                hint = (f"; {len(remote)} of them on other nodes: start them with `torchrun --nproc_per_node N -m "
                        f"periodic_async.rollout.remote --connect {getattr(self, 'remote_address', '?')}` and the same "
                        f"PERIODIC_ASYNC_ROLLOUT_KEY") if remote else ""
                raise WorkerError(f"rollout workers {sorted(waiting)} did not report '{name}' within {timeout:.0f} s{hint}")
            if now >= next_check:   # also while other workers keep sending
                next_check = now + 0.2
                for wid in list(waiting):
                    h = self._workers[wid]
                    if h.remote:
                        if h.reader is None and h.process is None and h.inbox is not None:
                            self._vacate(wid, f"lost its connection while the pool waited for '{name}'")
                        if self._workers[wid].reader is None and (kind is not Ready or self._started):
                            waiting.discard(wid)     # it gets the current weights when it reconnects
                        continue
                    if not h.process.is_alive():
                        self._restart(wid, f"died while the pool waited for '{name}'")
                        self._await(Ready, {wid}, self.startup_timeout_s)
                        waiting.discard(wid)
            msg = self._recv(0.2)
            if msg is None:
                continue
            self._handle_side_message(msg)
            if isinstance(msg, kind) and msg.wid in waiting and (version is None or msg.version == version):
                waiting.discard(msg.wid)
            elif isinstance(msg, Ready) and kind is Updated and msg.wid in waiting and msg.version == version:
                waiting.discard(msg.wid)    # restarted mid-update: it loaded the new weights at start
            elif isinstance(msg, Results):
                self._stash.append(msg)     # results that arrived while waiting: results() takes them

    def _handle_side_message(self, msg) -> None:
        if isinstance(msg, Error):
            raise WorkerError(msg.text)
        if isinstance(msg, (Updated, Ready)) and self._awaiting and msg.version == self.version:
            with self._lock:      # an ack of a posted update (a restarted worker starts with it)
                self._awaiting.discard(msg.wid)
                if not self._awaiting:
                    self.applied_version = self.version
                    self._acked.set()
        if isinstance(msg, Placed):
            self.placed[msg.wid] = msg.info
        elif isinstance(msg, Ready):
            h = self._workers[msg.wid]
            if not h.remote:
                h.pid = msg.pid
            if self.settings.weight_sync == "broadcast":
                self._pair_with(msg.wid)
            h.ready = True
            if self._pending:          # requests that waited for a connected worker
                pending, self._pending = self._pending, []
                self.dispatch(pending)
        elif not isinstance(msg, (Results, Updated)):
            # e.g. a worker running other code than the trainer (files changed under a running job)
            raise WorkerError(f"unexpected message {type(msg).__name__} from rollout worker {getattr(msg, 'wid', '?')}")

    def _pair_with(self, wid: int) -> None:
        """Broadcast sync: join a (re)started worker's pair group and send it the current weights
        unless it starts from them (the checkpoint at version 0)."""
        from . import weight_sync
        group = weight_sync.pair_group(self.settings.backend, self._store, None, self._keys[wid], rank=0,
                                       timeout_s=self.startup_timeout_s)
        self._pairs[wid] = group
        if self.version > 0 or self.settings.load_format == "dummy":
            weight_sync.send_weights(group, self.settings.backend, self._buf, self._plan)

    def _restart(self, wid: int, why: str) -> None:
        h = self._workers[wid]
        if h.remote:
            self._vacate(wid, why)
            return
        log.warning("rollout worker %d (pid %d) %s; restarting it with weights version %d", wid, h.pid, why, self.version)
        if h.process.is_alive():
            h.process.kill()
        h.process.join(timeout=10)
        if h.reader is not None:
            h.reader.close()
        self.restarts += 1
        self._spawn(wid)

    def kill_worker(self, wid: int) -> None:
        """Testing aid: SIGKILL a worker, as a crash would."""
        os.kill(self._workers[wid].pid, signal.SIGKILL)

    # ------------------------------------------------------------------ generation
    def dispatch(self, requests: list[RolloutRequest]) -> None:
        """Send each request to the worker with the least outstanding samples (ties: the lowest id;
        dispatch.least_loaded_worker)."""
        if self.settings.max_model_len is not None:
            from .vllm_engine import check_fits    # importable without vLLM
            for r in requests:
                check_fits(r, self.settings.max_model_len)
        load = {wid: 0 for wid, h in enumerate(self._workers) if not h.remote or h.reader is not None}
        if not load:      # only remote slots, none connected: they go out when a worker is ready
            if not self._pending:
                self._pending_since = time.monotonic()
            self._pending.extend(requests)
            return
        for w in self._owner.values():
            load[w] += 1
        per_worker: dict[int, list[RolloutRequest]] = {}
        for r in requests:
            wid = least_loaded_worker(load)
            ks = r.samples()
            for k in ks:
                self._owner[(r.group_index, k)] = wid
            load[wid] += len(ks)
            self._requests.setdefault(r.group_index, r)
            per_worker.setdefault(wid, []).append(r)
        now = time.monotonic()
        for wid, reqs in per_worker.items():
            self._workers[wid].last_progress = now
            self._workers[wid].inbox.put(Generate(reqs))

    def results(self) -> Iterator[RolloutResult]:
        """Results of everything dispatched, as they arrive, each exactly once."""
        while self._owner or self._pending:
            yield from self.poll(0.2)
        self._requests.clear()
        self.dropped_results += sum(len(m.results) for m in self._stash)   # duplicates of delivered samples
        self._stash.clear()

    def poll(self, timeout: float = 0.2) -> list[RolloutResult]:
        """One round: a health check every 0.2 s (restarts, re-dispatch), then the next message
        from any worker (waiting up to `timeout` s); returns the new results it delivered (each
        sample once, late duplicates and refused versions dropped)."""
        if time.monotonic() >= self._next_check:   # also while other workers keep the pipes busy
            self._check_health()
            self._next_check = time.monotonic() + 0.2
        msg = self._stash.pop(0) if self._stash else self._recv(timeout)
        if msg is None:
            return []
        self._handle_side_message(msg)
        if not isinstance(msg, Results):
            return []
        wid, out = msg.wid, []
        for r in msg.results:
            key = (r.group_index, r.sample_index)
            if self._owner.get(key) is None or not self.staleness.admit(r.policy_version, self.version):
                self.dropped_results += 1     # a late duplicate, or from a policy the rule refuses
                continue
            del self._owner[key]
            self._workers[wid].last_progress = time.monotonic()
            out.append(r)
        return out

    def forget(self, group_index: int) -> None:
        """Every sample of `group_index` is delivered: drop its request (kept for re-dispatch)."""
        self._requests.pop(group_index, None)

    def _check_health(self) -> None:
        now = time.monotonic()
        if self._pending and now - self._pending_since > self.startup_timeout_s:
            raise WorkerError(f"no rollout worker connected for {self.startup_timeout_s:.0f} s while "
                              f"{len(self._pending)} requests waited (all rollout nodes gone?)")
        for wid, h in enumerate(self._workers):
            owed = [key for key, w in self._owner.items() if w == wid]
            if h.remote and h.inbox is None and not owed:
                continue              # a vacant slot
            dead = not h.alive()
            stuck = owed and now - h.last_progress > self.worker_timeout_s
            if not (dead or stuck):
                continue
            with self._lock:    # a (re)starting worker reads the weights buffer
                self._restart(wid, "died" if dead else f"made no progress for {self.worker_timeout_s:.0f} s")
                if not h.remote:
                    self._await(Ready, {wid}, self.startup_timeout_s)
            by_group: dict[int, list[int]] = {}
            for g, k in owed:
                by_group.setdefault(g, []).append(k)
                del self._owner[(g, k)]
            again = []
            for g, ks in sorted(by_group.items()):
                r = self._requests[g]
                again.append(RolloutRequest(r.group_index, r.prompt_ids, r.n, r.sampling, r.seed, sorted(ks)))
            log.warning("re-dispatching %d samples of %d groups from worker %d", len(owed), len(by_group), wid)
            self.dispatch(again)

    # ------------------------------------------------------------------ weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Write the new weights into the shared buffer, then wait until every worker has them."""
        # a remote worker that connected but is not ready yet was given the previous version: it
        # must be paired (and hold those weights) before the update below can reach it
        joining = {wid for wid, h in enumerate(self._workers) if h.remote and h.reader is not None and not h.ready}
        if joining:
            self._await(Ready, joining, self.startup_timeout_s)
        self._write_buffer(named_tensors)
        self.version = version
        for h in self._workers:
            if h.inbox is not None:
                h.inbox.put(Update(version))
        if self.settings.weight_sync == "broadcast":
            from . import weight_sync
            for wid in list(self._pairs):
                try:
                    weight_sync.send_weights(self._pairs[wid], self.settings.backend, self._buf, self._plan)
                except RuntimeError as e:   # the worker died: its restart receives version `version`
                    self._restart(wid, f"failed during the weight broadcast ({e})")
        self._await(Updated, {wid for wid, h in enumerate(self._workers) if not h.remote or h.reader is not None},
                    self.startup_timeout_s, version=version)
        self.applied_version = version

    def post_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Asynchronous update (trainer.mode async; the shm sync only): once every worker holds the
        previous posted version, write these weights into the buffer and tell every worker; returns
        without waiting for them. Workers take the update between two decode steps (an
        interruptible engine) or once drained; `poll`, on the thread that reads the workers,
        collects the acks and advances `applied_version`."""
        if self.settings.weight_sync != "shm":
            raise ValueError("post_weights: asynchronous updates need weight_sync 'shm'")
        if not self._acked.wait(self.startup_timeout_s):
            raise WorkerError(f"rollout workers {sorted(self._awaiting)} did not take weights version {self.version} "
                              f"within {self.startup_timeout_s:.0f} s")
        with self._lock:
            self._write_buffer(named_tensors)
            self.version = version
            self._awaiting = {wid for wid, h in enumerate(self._workers) if h.inbox is not None}
            self._acked.clear()
            for wid in self._awaiting:
                self._workers[wid].inbox.put(Update(version))

    def _write_buffer(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy a full set of HF-layout tensors into the shared buffer (all names of the layout)."""
        expected = dict(self.layout)
        views = dict(_views(self._buf, self.layout))
        seen = set()
        for name, t in named_tensors:
            if name not in views:
                raise KeyError(f"rollout weight sync: workers have no parameter '{name}'")
            if tuple(t.shape) != expected[name]:
                raise ValueError(f"rollout weight sync: '{name}' has shape {tuple(t.shape)}, workers expect {expected[name]}")
            views[name].copy_(t)
            seen.add(name)
        if seen != set(views):
            raise KeyError(f"rollout weight sync: no tensor received for {sorted(set(views) - seen)[:5]}")

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for h in self._workers:
            if h is not None and h.inbox is not None and h.alive():
                try:
                    h.inbox.put(Stop())
                except (OSError, ValueError):
                    pass
        if self._listener is not None:
            self._listener.close()
        deadline = time.monotonic() + 5
        for h in self._workers:
            if h is None:
                continue
            if h.remote:           # its relay forwards the stop, then closes its end
                if h.reader is not None:
                    h.reader.close()
                continue
            h.process.join(timeout=max(0.1, deadline - time.monotonic()))
            if h.process.is_alive():
                h.process.kill()
                h.process.join(timeout=5)
        self._spawner.shutdown(wait=False)
        if self._shared is not None:
            self._unlink_buffer()
