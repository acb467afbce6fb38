"""The pool that feeds, watches and syncs the rollout worker processes (rollout/worker_main.py),
local ones and those on other nodes (rollout/remote.py); the messages: rollout/messages.py.

Dispatch: each request goes to the worker with the fewest outstanding samples (dispatch.py);
results are delivered as they arrive, each sample exactly once.

Weights: the buffer, the updates and their acknowledgements are the pool's other half,
rollout/pool_weights.py.

Faults: a worker that dies, or makes no progress for `worker_timeout_s` while it has work, is
killed and restarted from the buffer (the current weights); the samples it still owed are
re-dispatched (only those - `sample_indices`), and a late or duplicate result is dropped, so no
sample is lost or counted twice. Workers die with the trainer (PR_SET_PDEATHSIG on Linux) and
`close()` stops and joins them: no orphan processes.
"""
from __future__ import annotations

import logging
import math
import pickle
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Iterator, Protocol

import torch
import torch.multiprocessing as mp

from .base import RolloutRequest, RolloutResult
from .dispatch import least_loaded_worker
from .messages import Assign, Error, Generate, Placed, Ready, Receiving, Reject, Results, Stop, Updated, WorkerError
from .pool_weights import PoolWeights
from .slots import ConnectionInbox, RelayListener, WorkerHandle
from .weights_buffer import Layout
from .worker_main import WorkerSettings, run_worker

__all__ = ["WorkerPool", "WorkerSettings", "WorkerError", "Layout"]

log = logging.getLogger(__name__)


class Admits(Protocol):
    """Which results the pool delivers (scheduling/staleness.py's StalenessRule is one)."""
    def admit(self, sample_version: int, pool_version: int) -> bool: ...


class WorkerPool(PoolWeights):
    """Parent-side owner of the rollout worker processes."""

    def __init__(self, settings: WorkerSettings, placements: list[dict], layout: Layout, dtype: torch.dtype = torch.float32,
                 worker_timeout_s: float = 120.0, startup_timeout_s: float = 300.0,
                 initial_weights: Iterable[tuple[str, torch.Tensor]] | None = None,
                 staleness: Admits | None = None, remote_workers: int = 0, remote_address: str | None = None,
                 initial_version: int = 0):
        """initial_weights: version 0 in the shared buffer before the workers start (needed when
        they start from dummy weights, settings.load_format == "dummy"). staleness: which results
        are delivered - anything with `admit(sample_version, pool_version) -> bool`, the trainer's
        scheduling/staleness.StalenessRule; None: strictly on-policy, `0 <= version - v <= 0`
        (that rule at max_staleness 0). Others are dropped and counted.
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
        self._admit = staleness.admit if staleness is not None else (lambda v, version: 0 <= version - v <= 0)
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
        self._workers: list[WorkerHandle | None] = [None] * len(placements)
        self._workers += [WorkerHandle(None, None, None, remote=True) for _ in range(remote_workers)]
        self._pending: list[RolloutRequest] = []              # dispatched while no worker was connected
        self._pending_since = 0.0
        self._started = False                                 # every slot has been ready once
        self._listener: RelayListener | None = None           # accepts relays (remote_workers)
        self._closed = False
        self._stash: list = []                                # results received while awaiting acks
        # Weight updates (pool_weights.py): `publish` writes the buffer and posts the version;
        # the thread that reads the workers' messages (`poll`) collects the acks. The lock keeps
        # a write and a worker (re)start, which reads the buffer, apart; `_acked` is set once
        # every worker holds `version` (then applied_version == version).
        import threading
        self._lock = threading.RLock()
        self._acked = threading.Event()
        self._acked.set()
        self._awaiting: set[int] = set()
        self.applied_version = initial_version
        self._senders: dict[int, threading.Thread] = {}     # broadcast sync: wid -> its send of `version`
        self._send_failed: set[int] = set()                 # broadcast sends that failed: restart those
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
            from ..backend import get_backend
            self._sync_device = get_backend(settings.backend).current_device()   # the sender threads' device
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

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def pids(self) -> list[int]:
        """Process ids of the local workers (a remote worker's pid is on its own node)."""
        return [h.pid for h in self._workers if h is not None and not h.remote]

    # ------------------------------------------------------------------ workers on other nodes
    def _listen(self, address: str) -> None:
        self._listener = RelayListener(address)
        self.remote_address = self._listener.address

    def _admit_arrivals(self) -> None:
        """Give each newly connected relay a vacant remote slot (or turn it away)."""
        for conn, hello in self._listener.hellos():
            host, local_rank, pid = hello.host, hello.local_rank, hello.pid
            try:
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
            self._workers[wid] = WorkerHandle(None, ConnectionInbox(conn), conn, pid=pid,
                                              last_progress=time.monotonic(), remote=True)

    def _vacate(self, wid: int, why: str) -> None:
        """A remote worker is gone: close its connection (its relay exits and torchrun restarts
        it); the slot waits for the next relay."""
        h = self._workers[wid]
        log.warning("remote rollout worker %d %s; its slot waits for a new connection", wid, why)
        if h.reader is not None:
            h.reader.close()
        self._pairs.pop(wid, None)
        self._workers[wid] = WorkerHandle(None, None, None, remote=True)
        if wid in self._awaiting:
            self._on_ack(wid)       # it is sent the current weights when a relay takes the slot

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
        p = self._ctx.Process(target=run_worker, name=f"rollout-worker-{wid}", daemon=True,
                              args=(wid, self.settings, self.placements[wid], inbox, writer,
                                    self._worker_buffer() if sync is None else None, self.layout,
                                    self.version, sync))
        from ..backend import get_backend
        with get_backend(self.settings.backend).spawn_env(self.placements[wid]):
            p.start()
        writer.close()   # the worker holds the only write end: its death shows up as EOF here
        self._workers[wid] = WorkerHandle(p, inbox, reader, pid=p.pid, last_progress=time.monotonic())

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
        if isinstance(msg, (Updated, Ready)) and self._awaiting:
            self._on_ack(msg.wid, msg.version)     # an ack of a published update (a restarted worker starts with it)
        if isinstance(msg, Receiving):
            self._send_to(msg.wid, msg.version)
        elif isinstance(msg, Placed):
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
        elif not isinstance(msg, (Results, Updated, Receiving)):
            # e.g. a worker running other code than the trainer (files changed under a running job)
            raise WorkerError(f"unexpected message {type(msg).__name__} from rollout worker {getattr(msg, 'wid', '?')}")

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
            if self._owner.get(key) is None or not self._admit(r.policy_version, self.version):
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
            failed = wid in self._send_failed
            if not (dead or stuck or failed):
                continue
            self._send_failed.discard(wid)
            why = "died" if dead else ("lost its weight broadcast" if failed else
                                       f"made no progress for {self.worker_timeout_s:.0f} s")
            with self._lock:    # a (re)starting worker reads the weights buffer
                self._restart(wid, why)
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

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._awaiting and self._started:
            # a published version still being taken: a broadcast-sync worker that said Receiving
            # waits for our send (which only reading its messages starts); let them finish
            try:
                self._await(Updated, set(self._awaiting), min(60.0, self.startup_timeout_s), version=self.version)
            except Exception as e:  # noqa: BLE001 - closing anyway; the workers are stopped or killed below
                log.warning("closing the rollout pool with weights version %d not taken by every worker (%s)",
                            self.version, e)
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
