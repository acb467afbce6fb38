"""An engine in the trainer's own process behind the rollout pool's interface (mode `sync`), so
that the producer core (scheduling/producer.py) drives it exactly like worker processes:
`dispatch(requests)`, `poll()` -> the results finished since, `publish(named, version)` between
batches. The engine serves continuously: requests dispatched while it runs (a pilot's
commit, a backfill) join the running batch.

The engine's steps run on the trainer's side, not on the producer thread that calls `poll`: the
producer hands each step over (`Handoff`) and the trainer thread that waits for the batch runs it
(`serve_handoff`, called from the producer's trainer-side waits). Why: torch's CPU kernels run in
OpenMP, which keeps one thread team per thread that calls it; a second computing thread in the
process doubles the teams, and libgomp, seeing more threads than cores, makes every team's
workers sleep in the kernel between parallel regions instead of spinning. A decode-sized step
loop ran 1.6-2.5x slower on a second thread than on the main thread on 2 cores
(docs/performance.md, "Colocated sync's slow runs")."""
from __future__ import annotations

import threading
from typing import Callable, Iterable

from .base import RolloutEngine, RolloutRequest, RolloutResult

_NOT_TAKEN = object()


class Handoff:
    """One call at a time, offered by the producer thread and run by a trainer-side thread.

    `offer(fn, timeout)` (producer): fn's result once a trainer-side thread ran it; if none took it
    within `timeout`, it is withdrawn and `_NOT_TAKEN` is returned (the producer goes on with its
    loop: stop, weights, validation); once taken it is waited for to the end. fn's exception is
    raised in the producer, as if it had run there. `serve(timeout)` (trainer side, while it
    waits): runs the offered call if one comes within `timeout`; True if it ran one."""

    def __init__(self):
        self._lock = threading.Lock()
        self._offered = threading.Event()
        self._item: tuple | None = None        # (fn, box, done) offered, not yet taken

    def offer(self, fn: Callable, timeout: float):
        box: dict = {}
        done = threading.Event()
        with self._lock:
            self._item = (fn, box, done)
            self._offered.set()
        if not done.wait(timeout):
            with self._lock:
                if self._item is not None and self._item[2] is done:     # nobody took it: withdraw
                    self._item = None
                    self._offered.clear()
                    return _NOT_TAKEN
            done.wait()                                                   # taken: running there
        if "error" in box:
            raise box["error"]
        return box["value"]

    def serve(self, timeout: float) -> bool:
        if not self._offered.wait(timeout):
            return False
        with self._lock:
            item, self._item = self._item, None
            self._offered.clear()
        if item is None:
            return False
        fn, box, done = item
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - raised in the producer thread (offer)
            box["error"] = e
        finally:
            done.set()
        return True


class ColocatedPool:
    restarts = 0          # nothing to restart: an engine failure is the trainer's own exception

    def __init__(self, engine: RolloutEngine):
        self.engine = engine
        self.version = self.applied_version = engine.policy_version
        self._new: list[RolloutRequest] = []
        self._running = None      # the engine's serve() iterator while anything is in flight
        self._outstanding = 0     # samples dispatched, not yet returned
        self._handoff = Handoff()
        self.engine_threads: set[str] = set()     # names of the threads that ran engine steps

    def dispatch(self, requests: list[RolloutRequest]) -> None:
        self._new.extend(requests)
        self._outstanding += sum(len(r.samples()) for r in requests)

    def _take(self) -> list[RolloutRequest] | None:
        new, self._new = self._new, []
        return new or None

    def poll(self, timeout: float = 0.2) -> list[RolloutResult]:
        """Have the trainer side run the engine until some sequences finish; their results ([] once
        nothing is left, or when no trainer-side thread took the step within `timeout`)."""
        if self._running is None:
            if not self._new:
                return []
            self._running = self.engine.serve(self._take)
        finished = self._handoff.offer(self._engine_step, timeout)
        if finished is _NOT_TAKEN:
            return []
        if finished is None:
            self._running = None
            return []
        self._outstanding -= len(finished)
        if self._outstanding == 0:      # nothing in flight: end the engine's loop now
            self._running.close()
            self._running = None
        return list(finished)

    def _engine_step(self):
        self.engine_threads.add(threading.current_thread().name)
        return next(self._running, None)

    def serve_handoff(self, timeout: float) -> bool:
        """Trainer side, while it waits for the producer: run an engine step the producer offers
        within `timeout` (Handoff.serve)."""
        return self._handoff.serve(timeout)

    def forget(self, group_index: int) -> None:
        pass

    def pids(self) -> list[int]:
        return []       # no worker processes: the engine is the trainer's

    def publish(self, named_tensors: Iterable, version: int) -> None:
        """The engine is this process's: it loads the weights here and now (between batches)."""
        if self._outstanding:
            raise RuntimeError("weights for the colocated engine while it generates: a batch is still in flight")
        self.engine.update_weights(named_tensors, version)
        self.version = self.applied_version = version

    update_weights = publish

    def wait_applied(self, timeout: float) -> bool:
        return True

    def close(self) -> None:
        self.engine.close()
