"""The producer (the temporary data generator): one batch plan in, scored groups out.

- `ColocatedProducer` (mode `sync`): the rollout engine lives in the trainer process; the whole
  batch is generated, then scored, then handed over.
- `AsyncProducer` (mode `async`): batches dispatched ahead within the staleness bound, below.
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

import copy
import dataclasses
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


# A request's key in the rollout pool is (step * _STEP_STRIDE + its group index, k): batches in
# flight together keep their own group indices (0.. within a batch); step 0 is validation's.
_STEP_STRIDE = 1 << 20


@dataclass
class _AsyncBatch:
    plan: BatchPlan
    loader_state: dict          # the prompt loader before this batch was planned
    prompt_counts: dict         # its skipped / truncated prompts (data/prompts.py)
    stats: RolloutStats
    out: queue.Queue            # its groups ready to train on, then _DONE (or an exception)
    open_requests: int = 0


class AsyncProducer(GroupProducer):
    """Mode `async` (bounded staleness, trainer.max_staleness = eta): one thread owns the rollout
    pool. It plans and dispatches batch b as soon as every worker holds version b - 1 - eta or
    newer (staleness.py: `may_dispatch`), so up to eta + 1 batches generate at once; it assembles
    and scores each request's responses as they arrive and puts each batch's groups on that
    batch's own queue, which the trainer reads at step b (`groups(b)`). New weights are posted
    without waiting (`update_weights`): the workers take them mid-generation and tag each token
    with its version. eta = 0 is the periodic schedule.

    `planner.plan(step)` runs on this thread (rank 0's prompt loader is only touched here once
    the producer runs); `loader_state(s)` is the loader as a checkpoint after step s must hold it:
    before batch s + 1 was planned, so that a resumed run re-plans and regenerates the batches
    that were in flight (their samples are not kept) and no prompt is lost or repeated."""

    def __init__(self, pool, scorer: Scorer, planner, rule, first_step: int, last_step: int, prompt_counts):
        self.pool, self.scorer, self.planner, self.rule = pool, scorer, planner, rule
        self._next, self._last, self._prompt_counts = first_step, last_step, prompt_counts
        self._batches: dict[int, _AsyncBatch] = {}
        self._owner: dict[tuple[int, int], tuple[int, RolloutRequest]] = {}   # pool key -> (step, request)
        self._got: dict[int, list[RolloutResult]] = {}                          # id(request) -> results so far
        self._evals: queue.Queue = queue.Queue()       # (requests, results list, done Event) to send
        self._eval: tuple | None = None                 # the one being generated
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._stats = RolloutStats()
        self._thread = threading.Thread(target=self._run, name="rollout-producer-async", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the trainer's side
    def batch(self, step: int) -> tuple[BatchPlan, dict]:
        """Batch `step`'s plan and prompt counts, once it is dispatched (blocks until then)."""
        with self._cond:
            while step not in self._batches:
                if self._error is not None:
                    raise self._error      # as it was raised (a DatasetError stays one)
                if step > self._last:
                    raise ValueError(f"step {step} is beyond the producer's last step {self._last}")
                self._cond.wait(0.1)
            b = self._batches[step]
        self._stats = b.stats
        return b.plan, b.prompt_counts

    def groups(self, step: int) -> Iterator[Group]:
        b = self._batches[step]
        while True:
            item = b.out.get()
            if item is _DONE:
                with self._cond:
                    del self._batches[step]
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def loader_state(self, step: int) -> dict:
        """The prompt loader's state after batch `step` was planned and before batch step + 1."""
        with self._cond:
            b = self._batches.get(step + 1)
            return b.loader_state if b is not None else copy.deepcopy(self.planner.loader.state_dict())

    def update_weights(self, named_tensors, version: int) -> None:
        self.pool.post_weights(named_tensors, version)

    def generate_eval(self, requests: list[RolloutRequest]) -> list[RolloutResult]:
        """Validation requests, generated once every worker holds the newest posted weights,
        beside the batches in flight."""
        results: list[RolloutResult] = []
        done = threading.Event()
        self._evals.put((requests, results, done))
        while not done.wait(0.1):
            if self._error is not None:
                raise self._error
        return results

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.pool.close()

    # ------------------------------------------------------------------ the producer thread
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._dispatch_batches()
                self._dispatch_eval()
                for result in self.pool.poll(0.05):
                    self._deliver(result)
        except BaseException as e:  # noqa: BLE001 - raised in the trainer by batch() / groups()
            with self._cond:
                self._error = e
                for b in self._batches.values():
                    b.out.put(e)
                self._cond.notify_all()

    def _dispatch_batches(self) -> None:
        while self._next <= self._last and self.rule.may_dispatch(self._next, self.pool.applied_version):
            step = self._next
            with self._cond:
                state = copy.deepcopy(self.planner.loader.state_dict())
                plan = self.planner.plan(step)
                b = _AsyncBatch(plan, state, self._prompt_counts(), RolloutStats(t_dispatch=time.perf_counter()),
                                queue.Queue())
                self._batches[step] = b
                self._next += 1
                self._cond.notify_all()
            self._send(step, list(plan.requests))
            if not plan.requests:
                self._finish(step, b)

    def _dispatch_eval(self) -> None:
        if self._eval is not None or self._evals.empty() or self.pool.applied_version != self.pool.version:
            return
        self._eval = self._evals.get()
        self._eval[1].clear()
        if not self._eval[0]:
            self._eval[2].set()
            self._eval = None
            return
        self._send(0, self._eval[0])

    def _send(self, step: int, requests: list[RolloutRequest]) -> None:
        wire = []
        for req in requests:
            if not 0 <= req.group_index < _STEP_STRIDE:
                raise ValueError(f"group index {req.group_index} out of range for the async producer")
            uid = step * _STEP_STRIDE + req.group_index
            self._got[id(req)] = []
            for k in req.samples():
                self._owner[(uid, k)] = (step, req)
            wire.append(dataclasses.replace(req, group_index=uid))
        if step in self._batches:
            self._batches[step].open_requests += len(requests)
        if wire:
            self.pool.dispatch(wire)

    def _deliver(self, result: RolloutResult) -> None:
        uid = result.group_index
        step, req = self._owner.pop((uid, result.sample_index), (None, None))
        if req is None:
            raise RuntimeError(f"sample {result.sample_index} of pool group {uid} received twice or never requested")
        result.group_index = req.group_index
        part = self._got[id(req)]
        part.append(result)
        if step == 0:        # validation
            results, done = self._eval[1], self._eval[2]
            results.append(result)
            if len(part) == len(req.samples()):
                del self._got[id(req)]
                self.pool.forget(uid)
            if not any(s == 0 for s, _ in self._owner.values()):
                self._eval = None
                done.set()
            return
        b = self._batches[step]
        b.stats.results.append(result)
        if len(part) < len(req.samples()):
            return
        del self._got[id(req)]
        self.pool.forget(uid)
        group = b.plan.part_group(req, part)
        self.scorer.rewards([group], b.stats)
        more, ready = b.plan.on_scored(req, group)
        self._send(step, more)
        self.scorer.advantages(ready)
        b.stats.t_last_group = time.perf_counter()
        for g in ready:
            b.out.put(g)
        b.open_requests -= 1
        if b.open_requests == 0:
            self._finish(step, b)

    def _finish(self, step: int, b: _AsyncBatch) -> None:
        for g in b.plan.finish():
            b.out.put(g)
        b.out.put(_DONE)
