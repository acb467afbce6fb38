"""The producer (the temporary data generator): one batch plan in, scored groups out.

- `ColocatedProducer` (mode `sync`): the rollout engine lives in the trainer process; the whole
  batch is generated, then scored, then handed over.
- `WorkerProducer` (modes `periodic` and `sync_split`): a producer thread dispatches the batch's
  requests to the rollout worker processes, assembles each request's responses as they finish,
  scores them (off the trainer's critical path), sends whatever the plan asks for next under the
  same policy version (plan.py: `on_scored`; pilot -> commit, backfill) and puts each group ready
  to train on a bounded queue.
  In `periodic` the trainer consumes groups in completion order while the rest still generate;
  `sync_split` (the fair baseline on the same device split) hands groups over only once the whole
  batch is generated.

`start(plan)` is called only after the weights of version `plan.step - 1` reached every engine,
so a batch never mixes policies; every result carries the version that produced it.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

from ..rollout.base import RolloutRequest, RolloutResult
from .group import Group
from .plan import BatchPlan
from .scorer import Scorer


@dataclass
class RolloutStats:
    """Rollout-side timings of one batch (perf_counter seconds, comparable across processes)."""
    t_dispatch: float = 0.0
    t_last_group: float = 0.0
    reward_s: float = 0.0
    num_errors: int = 0        # reward items scored 0.0 (reward/manager.py: RewardBatch), by cause
    num_timeouts: int = 0
    num_invalid: int = 0
    first_reward_error: str | None = None
    results: list[RolloutResult] = field(default_factory=list)   # for timelines and idle ratios

    @property
    def gen_s(self) -> float:
        return self.t_last_group - self.t_dispatch


class GroupProducer:
    """start(plan) begins a batch; groups() yields its num_groups scored groups; close()."""

    def start(self, plan: BatchPlan) -> None:
        raise NotImplementedError

    def groups(self) -> Iterator[Group]:
        raise NotImplementedError

    def update_weights(self, named_tensors, version: int) -> None:
        raise NotImplementedError

    def generate_eval(self, requests: list[RolloutRequest]) -> list[RolloutResult]:
        """Generate requests outside any batch (validation), between batches: every result once."""
        raise NotImplementedError

    @property
    def stats(self) -> RolloutStats:
        return self._stats

    def close(self) -> None:
        pass


class ColocatedProducer(GroupProducer):
    """Mode `sync`: generate the whole batch in-process, score it, then hand it over."""

    def __init__(self, engine, scorer: Scorer):
        self.engine, self.scorer = engine, scorer
        self._groups: list[Group] = []
        self._stats = RolloutStats()

    def start(self, plan: BatchPlan) -> None:
        """Generate in rounds: the plan's requests, then whatever its answers to their scored
        parts ask for (pilot -> commit, backfill), until nothing is left."""
        self._stats = stats = RolloutStats(t_dispatch=time.perf_counter())
        self._groups = []
        pending = list(plan.requests)
        while pending:
            results = list(self.engine.generate(pending))
            stats.t_last_group = time.perf_counter()
            stats.results += results
            by_request = _split_by_request(pending, results)
            parts = [plan.part_group(req, got) for req, got in zip(pending, by_request)]
            self.scorer.rewards(parts, stats)
            sent, pending = pending, []
            for req, part in zip(sent, parts):
                more, ready = plan.on_scored(req, part)
                pending += more
                self._groups += ready
        self.scorer.advantages(self._groups)
        self._groups += plan.finish()

    def groups(self) -> Iterator[Group]:
        yield from self._groups

    def update_weights(self, named_tensors, version: int) -> None:
        self.engine.update_weights(named_tensors, version)

    def generate_eval(self, requests: list[RolloutRequest]) -> list[RolloutResult]:
        return list(self.engine.generate(requests))

    def close(self) -> None:
        self.engine.close()


def _split_by_request(requests: list[RolloutRequest], results: list[RolloutResult]) -> list[list[RolloutResult]]:
    """Each request's results, in request order (a slot may have several requests: pilot, commit)."""
    owner = {}
    for i, req in enumerate(requests):
        for k in req.samples():
            owner[(req.group_index, k)] = i
    out: list[list[RolloutResult]] = [[] for _ in requests]
    for r in results:
        i = owner.pop((r.group_index, r.sample_index), None)
        if i is None:
            raise RuntimeError(f"group {r.group_index}: sample {r.sample_index} received twice or never requested")
        out[i].append(r)
    return out


_DONE = object()


class WorkerProducer(GroupProducer):
    """Modes `periodic` / `sync_split`: rollout worker processes fed by a producer thread."""

    def __init__(self, pool, scorer: Scorer, queue_size: int, wait_for_batch: bool):
        self.pool, self.scorer, self.wait_for_batch = pool, scorer, wait_for_batch
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._thread: threading.Thread | None = None
        self._stats = RolloutStats()
        self._stop = threading.Event()

    def start(self, plan: BatchPlan) -> None:
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("a batch is still being generated; consume it before starting the next")
        self._stats = RolloutStats()
        self._thread = threading.Thread(target=self._produce, args=(plan,), name="rollout-producer", daemon=True)
        self._thread.start()

    def generate_eval(self, requests: list[RolloutRequest]) -> list[RolloutResult]:
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("validation while a batch is being generated: run it between batches")
        self.pool.dispatch(requests)
        return list(self.pool.results())

    def _produce(self, plan: BatchPlan) -> None:
        """Dispatch the batch, assemble each request's responses as they finish, score them, send
        what the plan asks for next, enqueue the groups ready to train on."""
        stats = self._stats
        try:
            stats.t_dispatch = time.perf_counter()
            owner: dict[tuple[int, int], RolloutRequest] = {}    # (group, sample) -> its request
            got: dict[int, list[RolloutResult]] = {}              # id(request) -> its results so far

            def send(requests: list[RolloutRequest]) -> None:
                for req in requests:
                    got[id(req)] = []
                    for k in req.samples():
                        owner[(req.group_index, k)] = req
                if requests:
                    self.pool.dispatch(requests)

            send(list(plan.requests))
            held = []
            for result in self.pool.results():
                stats.results.append(result)
                req = owner.pop((result.group_index, result.sample_index), None)
                if req is None:
                    raise RuntimeError(f"group {result.group_index}: sample {result.sample_index} received twice "
                                       "or never requested")
                part = got[id(req)]
                part.append(result)
                if len(part) < len(req.samples()):
                    continue
                del got[id(req)]
                group = plan.part_group(req, part)
                self.scorer.rewards([group], stats)
                more, ready = plan.on_scored(req, group)
                send(more)
                self.scorer.advantages(ready)
                stats.t_last_group = time.perf_counter()
                if self.wait_for_batch:
                    held += ready
                else:
                    for g in ready:
                        self._put(g)
            if got:
                raise RuntimeError(f"the rollout pool ended the batch with {len(got)} requests incomplete")
            for group in held + plan.finish():
                self._put(group)
            self._put(_DONE)
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
            self._put(e)

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def groups(self) -> Iterator[Group]:
        while True:
            item = self._queue.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def update_weights(self, named_tensors, version: int) -> None:
        self.pool.update_weights(named_tensors, version)

    def close(self) -> None:
        self._stop.set()
        self.pool.close()
        if self._thread is not None:
            self._thread.join(timeout=5)
