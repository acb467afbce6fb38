"""An engine in the trainer's own process behind the rollout pool's interface (mode `sync`), so
that the producer core (scheduling/producer.py) drives it exactly like worker processes:
`dispatch(requests)`, `poll()` -> the results finished since, `publish(named, version)` between
batches. The engine serves continuously: requests dispatched while it runs (a pilot's
commit, a backfill) join the running batch."""
from __future__ import annotations

from typing import Iterable

from .base import RolloutEngine, RolloutRequest, RolloutResult


class ColocatedPool:
    restarts = 0          # nothing to restart: an engine failure is the trainer's own exception

    def __init__(self, engine: RolloutEngine):
        self.engine = engine
        self.version = self.applied_version = engine.policy_version
        self._new: list[RolloutRequest] = []
        self._running = None      # the engine's serve() iterator while anything is in flight
        self._outstanding = 0     # samples dispatched, not yet returned

    def dispatch(self, requests: list[RolloutRequest]) -> None:
        self._new.extend(requests)
        self._outstanding += sum(len(r.samples()) for r in requests)

    def _take(self) -> list[RolloutRequest] | None:
        new, self._new = self._new, []
        return new or None

    def poll(self, timeout: float = 0.2) -> list[RolloutResult]:
        """Run the engine until some sequences finish; their results ([] once nothing is left)."""
        if self._running is None:
            if not self._new:
                return []
            self._running = self.engine.serve(self._take)
        finished = next(self._running, None)
        if finished is None:
            self._running = None
            return []
        self._outstanding -= len(finished)
        if self._outstanding == 0:      # nothing in flight: end the engine's loop now
            self._running.close()
            self._running = None
        return list(finished)

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
