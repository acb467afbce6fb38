"""The producer core: every training mode runs through this one loop (mode.py says what a mode is).

One thread owns the rollout pool (worker processes, or the trainer's own engine behind the same
interface: rollout/colocated.py). It plans batch b and dispatches its requests as soon as the
engines hold version b - 1 - eta (staleness.py: `may_dispatch`; eta = 0: the previous step's
weights), so up to eta + 1 batches generate at once; it assembles each request's responses as
they arrive, scores them, asks the batch's plan what follows (plan.py: `on_scored`: pilot ->
commit, backfill) and sends that under the same policy, computes the advantages of each group
ready to train on and hands it to the trainer: at once (`periodic`, `async`) or once the whole
batch is scored (`sync`, `sync_split`). At the end of a batch it tells the group sizer the
lengths it saw (SAGC's feedback), before the next batch is planned when eta = 0.

The trainer's side: `batch(step)` (the plan, once dispatched), `groups(step)` (its groups, in
the order they are released), `batch_done(step)` (the rollout statistics and the plan's and the
sizer's metrics), `update_weights(named, version)`, `planner_state(step)` for a checkpoint after
`step`, `generate_eval(requests)` for validation, `close()`.

Streaming (async with trainer.stream_slack > 0, stream.py): the batches' groups go into one
stream instead of a queue per batch; step t takes the first B to finish whatever batch they belong
to, each by its deadline (StreamOrder), `batch(t)` gives batch t's plan for the group sizes (every
batch has B groups of one K), and `batch_done(t)` the statistics of the groups step t took and the
metrics of the batches it finished taking.

Weights: `update_weights` publishes a version and returns; the engines take it (with eta = 0
nothing is generating then: the batch is over and the next one waits for these weights; with eta >
0 the workers take it mid-generation, every token tagged with its version) and this thread
collects their acknowledgements.
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
from .group_sizing import prompt_key
from .mode import Mode
from .plan import BatchPlan
from .scorer import Scorer
from .stream import StreamOrder


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


_DONE = object()
# how long a trainer-side wait blocks for a colocated engine step before it looks at its own
# condition again (a group handed over, an error): the latency a waiting trainer may add
_SERVE_S = 0.01

# A request's key in the rollout pool is (step * _STEP_STRIDE + its group index, k): batches in
# flight together keep their own group indices (0.. within a batch); step 0 is validation's.
_STEP_STRIDE = 1 << 20


@dataclass
class _Batch:
    plan: BatchPlan
    planner_state: dict         # the planner (loader, sizer, allocator) before this batch was planned
    prompt_counts: dict         # its skipped / truncated prompts (data/prompts.py)
    stats: RolloutStats
    out: queue.Queue            # its groups ready to train on, then _DONE (or an exception)
    open_requests: int = 0
    held: list = field(default_factory=list)        # groups kept until the batch ends (release after batch)
    lengths: list = field(default_factory=list)     # response lengths of each trained group
    keys: list = field(default_factory=list)        # and its prompt key (the sizer's feedback)
    metrics: dict = field(default_factory=dict)
    finished: bool = False                          # its last request is in (streaming: may be retired)


class Producer:
    """The one producer core (module docstring). `pool`: rollout/worker.WorkerPool or
    rollout/colocated.ColocatedPool; `planner`: plan.BatchPlanner, whose state this thread owns
    while it runs; `prompt_counts()`: the skipped / truncated prompts since the last call;
    `queue_size`: no further batch is dispatched while this many groups wait for the trainer;
    `weights_timeout_s`: how long a new version may wait for the engines to take the previous one;
    `batch_size`: B, groups per step (streaming needs it)."""

    def __init__(self, pool, scorer: Scorer, planner, mode: Mode, first_step: int, last_step: int,
                 prompt_counts, queue_size: int = 1024, weights_timeout_s: float = 600.0, batch_size: int = 0):
        self.pool, self.scorer, self.planner, self.mode = pool, scorer, planner, mode
        self.rule = mode.staleness
        self._next, self._last, self._prompt_counts, self._queue_size = first_step, last_step, prompt_counts, queue_size
        self._weights_timeout_s = weights_timeout_s
        self._batches: dict[int, _Batch] = {}
        self._waiting = 0                                # groups handed over, not yet taken by the trainer
        self._owner: dict[tuple[int, int], tuple[int, RolloutRequest]] = {}   # pool key -> (step, request)
        self._got: dict[int, list[RolloutResult]] = {}                          # id(request) -> results so far
        self._evals: queue.Queue = queue.Queue()       # (requests, results list, done Event) to send
        self._eval: tuple | None = None                 # the one being generated
        self._cond = threading.Condition()
        self._pool_lock = threading.Lock()              # one reader of the pool at a time
        # held while the planner's state changes (planning, a plan's decisions, a batch's end):
        # a checkpoint of a run whose selection rule draws while steps overlap reads it meanwhile
        self._plan_lock = threading.RLock()
        self._error: BaseException | None = None
        self._stop = threading.Event()
        # set by the trainer's side when the producer may have something to do (new weights, a
        # group taken, validation): an idle producer thread sleeps on it instead of polling, which
        # would take the GIL from the trainer hundreds of times a second
        self._wake = threading.Event()
        # a colocated engine (mode sync) runs its steps on the trainer's thread that waits in
        # batch / groups / generate_eval / update_weights, not on this one (rollout/colocated.py)
        self._serve_engine = getattr(pool, "serve_handoff", None)
        self._stats = RolloutStats()
        if mode.streaming and batch_size < 1:
            raise ValueError("a streaming producer needs batch_size (groups per step)")
        self._stream = StreamOrder(batch_size, mode.max_staleness) if mode.streaming else None
        self._plans: dict[int, tuple] = {}          # streaming: step -> (plan, prompt counts) until batch(step)
        self._took: dict[int, list] = {}            # streaming: step -> [(group, batch, t_dispatch, t_ready)]
        self._t_ready: dict[int, float] = {}        # streaming: id(group) -> when it was ready
        # started by the trainer's first request (batch, generate_eval), not here: whatever is
        # set up after construction (a resumed planner's state, the colocated engine's weights)
        # is in place before the first batch is planned
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
        self._start_lock = threading.Lock()

    def _ensure_started(self) -> None:
        with self._start_lock:
            if self._thread.ident is None:
                self._thread.start()

    # ------------------------------------------------------------------ the trainer's side
    def batch(self, step: int) -> tuple[BatchPlan, dict]:
        """Batch `step`'s plan and prompt counts, once it is dispatched (blocks until then)."""
        self._ensure_started()
        if self._stream is not None:
            return self._stream_batch(step)
        while True:
            with self._cond:
                if step in self._batches:
                    b = self._batches[step]
                    break
                if self._error is not None:
                    raise self._error      # as it was raised (a DatasetError stays one)
                if step > self._last:
                    raise ValueError(f"step {step} is beyond the producer's last step {self._last}")
                if self._serve_engine is None:
                    self._cond.wait(0.1)
                    continue
            self._serve_engine(_SERVE_S)
        self._stats = b.stats
        return b.plan, b.prompt_counts

    def groups(self, step: int) -> Iterator[Group]:
        if self._stream is not None:
            yield from self._stream_groups(step)
            return
        b = self._batches[step]
        while True:
            item = self._take_out(b.out)
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            with self._cond:
                self._waiting -= 1
            self._wake.set()
            yield item

    def _take_out(self, out: queue.Queue):
        """The next item of a batch's queue; meanwhile the colocated engine's steps run here."""
        if self._serve_engine is None:
            return out.get()
        while True:
            try:
                return out.get_nowait()
            except queue.Empty:
                self._serve_engine(_SERVE_S)

    def batch_done(self, step: int) -> tuple[RolloutStats, dict]:
        """After `groups(step)` ended: the batch's rollout statistics and metrics (the plan's,
        the group sizer's); the batch is forgotten."""
        if self._stream is not None:
            return self._stream_done(step)
        with self._cond:
            b = self._batches.pop(step)
        with self._plan_lock:
            self.planner.forget_step(step)
        return b.stats, {**b.plan.end_metrics(), **b.metrics}

    @property
    def stats(self) -> RolloutStats:
        """The statistics of the batch the trainer took last (`batch`)."""
        return self._stats

    def planner_state(self, step: int) -> dict:
        """The planner's state as a checkpoint after `step` must hold it: before batch step + 1
        was planned (a resumed run re-plans and regenerates the batches in flight: their samples
        are not kept, and no prompt is lost or repeated). With a selection rule and eta > 0 the
        batches in flight may have drawn after that (commits, backfills during batch `step`): the
        state now, with the prompts the batches after `step` drew to be drawn again."""
        if self._stream is not None:
            return self._stream_planner_state()
        if self.mode.max_staleness > 0 and self.planner.selection is not None:
            with self._plan_lock:
                return copy.deepcopy(self.planner.state_dict(in_flight_after=step))
        with self._cond:
            b = self._batches.get(step + 1)
            return b.planner_state if b is not None else copy.deepcopy(self.planner.state_dict())

    def update_weights(self, named_tensors, version: int) -> None:
        """Publish `version` to the engines (rollout/pool_weights.py: one protocol for every mode
        and sync) and return; this thread collects the acknowledgements, and batches wait for
        them as the staleness rule says. Waits first until the previous version is applied (its
        buffer is rewritten) - with eta = 0 it always is: the batch that needed it is trained."""
        self._wake.set()
        deadline = time.monotonic() + self._weights_timeout_s
        while not self.pool.wait_applied(0.1):
            if self._error is not None:
                raise self._error
            if time.monotonic() > deadline:
                raise RuntimeError(f"rollout engines did not take weights version {self.pool.version} within "
                                   f"{self._weights_timeout_s:.0f} s")
        # the producer thread reads the pool's messages only around this (and may be handing an
        # engine step over meanwhile: it is run here while the lock is waited for)
        while not self._pool_lock.acquire(timeout=_SERVE_S):
            if self._serve_engine is not None:
                self._serve_engine(0)
        try:
            self.pool.publish(named_tensors, version)
        finally:
            self._pool_lock.release()
        self._wake.set()

    def generate_eval(self, requests: list[RolloutRequest]) -> list[RolloutResult]:
        """Validation requests, generated once every engine holds the newest weights, beside any
        batch in flight; each result once."""
        results: list[RolloutResult] = []
        done = threading.Event()
        self._evals.put((requests, results, done))
        self._ensure_started()
        self._wake.set()
        while not done.is_set():
            if self._error is not None:
                raise self._error
            if self._serve_engine is None:
                done.wait(0.1)
            else:
                self._serve_engine(_SERVE_S)
        return results

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.ident is not None:
            self._thread.join(timeout=10)
        self.pool.close()

    # ------------------------------------------------------------------ the producer thread
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._dispatch_batches()
                self._dispatch_eval()
                if self._owner or self.pool.applied_version != self.pool.version:   # results or acks due
                    with self._pool_lock:
                        results = self.pool.poll(0.05)
                    self._deliver(results)
                elif self._wake.wait(0.1):
                    self._wake.clear()      # then look again: whatever set it is seen above
        except BaseException as e:  # noqa: BLE001 - raised in the trainer by batch() / groups()
            with self._cond:
                self._error = e
                for b in self._batches.values():
                    b.out.put(e)
                self._cond.notify_all()

    def _dispatch_batches(self) -> None:
        while True:
            version = self.pool.applied_version     # every worker holds it or newer
            if not (self._next <= self._last and self._waiting < self._queue_size
                    and self.rule.may_dispatch(self._next, version)):
                return
            step = self._next
            with self._plan_lock, self._cond:
                state = copy.deepcopy(self.planner.state_dict()) if self._stream is None else None
                plan = self.planner.plan(step)
                b = _Batch(plan, state, self._prompt_counts(), RolloutStats(t_dispatch=time.perf_counter()),
                           queue.Queue())
                self._batches[step] = b
                if self._stream is not None:
                    self._stream.add_batch(step, plan.num_groups, version)
                    self._plans[step] = (plan, b.prompt_counts)
                self._next += 1
                self._cond.notify_all()
            self._send(step, list(plan.requests))
            if not plan.requests:
                with self._plan_lock:
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
                raise ValueError(f"group index {req.group_index} out of range for the producer")
            uid = step * _STEP_STRIDE + req.group_index
            self._got[id(req)] = []
            for k in req.samples():
                self._owner[(uid, k)] = (step, req)
            wire.append(dataclasses.replace(req, group_index=uid))
        if step in self._batches:
            self._batches[step].open_requests += len(requests)
        if wire:
            with self._pool_lock:
                self.pool.dispatch(wire)

    def _deliver(self, results: list[RolloutResult]) -> None:
        """File each result under its request; score the requests these results completed (one
        reward call per batch), then hand each to its plan."""
        complete: dict[int, list[tuple[RolloutRequest, list[RolloutResult]]]] = {}
        for result in results:
            uid = result.group_index
            step, req = self._owner.pop((uid, result.sample_index), (None, None))
            if req is None:
                raise RuntimeError(f"sample {result.sample_index} of pool group {uid} received twice or never requested")
            result.group_index = req.group_index
            part = self._got[id(req)]
            part.append(result)
            if step == 0:
                self._deliver_eval(uid, req, part, result)
                continue
            self._batches[step].stats.results.append(result)
            if len(part) == len(req.samples()):
                del self._got[id(req)]
                self.pool.forget(uid)
                complete.setdefault(step, []).append((req, part))
        with self._plan_lock:
            self._score_and_decide(complete)

    def _score_and_decide(self, complete: dict) -> None:
        for step, done in complete.items():
            b = self._batches[step]
            parts = [b.plan.part_group(req, part) for req, part in done]
            self.scorer.rewards(parts, b.stats)
            for (req, _), part in zip(done, parts):
                more, ready = b.plan.on_scored(req, part)
                self._send(step, more)
                self.scorer.advantages(ready)
                b.stats.t_last_group = time.perf_counter()
                self._release(b, ready)
                b.open_requests -= 1
            if b.open_requests == 0:
                self._finish(step, b)

    def _deliver_eval(self, uid: int, req: RolloutRequest, part: list, result: RolloutResult) -> None:
        self._eval[1].append(result)
        if len(part) == len(req.samples()):
            del self._got[id(req)]
            self.pool.forget(uid)
        if not any(s == 0 for s, _ in self._owner.values()):
            done = self._eval[2]
            self._eval = None
            done.set()

    def _release(self, b: _Batch, ready: list[Group]) -> None:
        for g in ready:
            b.lengths.append([len(r.response_ids) for r in g.results])
            b.keys.append(prompt_key(g.prompt_ids))
        if not self.mode.release_on_completion:
            b.held += ready
            return
        self._put(b, ready)

    def _put(self, b: _Batch, groups: list[Group]) -> None:
        with self._cond:
            self._waiting += len(groups)
            if self._stream is not None:
                now = time.perf_counter()
                for g in groups:
                    self._t_ready[id(g)] = now
                    self._stream.add_ready(b.plan.step, g)
                self._cond.notify_all()
                return
        for g in groups:
            b.out.put(g)

    def _finish(self, step: int, b: _Batch) -> None:
        """The batch's last request is in: the plan's unfilled positions, the sizer's feedback,
        then the end marker."""
        tail = b.plan.finish()
        # an adaptive sizer (rollout.group_sizing: sagc) learns from the lengths
        b.metrics.update(self.planner.group_sizer.observe(step, b.lengths, b.keys))
        self._put(b, b.held + tail)
        b.held = []
        b.finished = True
        b.out.put(_DONE)

    # ------------------------------------------------------------------ streaming (stream.py)
    def _stream_batch(self, step: int) -> tuple[BatchPlan, dict]:
        with self._cond:
            while step not in self._plans:
                if self._error is not None:
                    raise self._error
                if step > self._last:
                    raise ValueError(f"step {step} is beyond the producer's last step {self._last}")
                self._cond.wait(0.1)
            return self._plans.pop(step)

    def _stream_groups(self, step: int) -> Iterator[Group]:
        """Step `step`'s B groups as the stream order gives them, at positions 0..B-1."""
        took = self._took.setdefault(step, [])
        for k in range(self._stream.batch_size):
            with self._cond:
                while (got := self._stream.take(step, k)) is None:
                    if self._error is not None:
                        raise self._error
                    self._cond.wait(0.1)
                batch, group = got
                self._waiting -= 1
                took.append((group, batch, self._batches[batch].stats.t_dispatch, self._t_ready.pop(id(group))))
            self._wake.set()
            yield dataclasses.replace(group, group_index=k)

    def _stream_done(self, step: int) -> tuple[RolloutStats, dict]:
        """Step `step`'s statistics: of the groups it took (dispatch of the oldest batch they came
        from to the last one ready; their results), with the reward time, faults and metrics of
        the batches whose last group it took (retired here)."""
        with self._cond:
            took = self._took.pop(step)
            retired = [u for u, b in self._batches.items() if b.finished and self._stream.done(u)]
            batches = [self._batches.pop(u) for u in retired]
            for u in retired:
                self._stream.forget(u)
        with self._plan_lock:
            for u in retired:
                self.planner.forget_step(u)
        stats = RolloutStats(t_dispatch=min(t for _, _, t, _ in took), t_last_group=max(t for *_, t in took),
                             results=[r for g, *_ in took for r in g.results])
        metrics = {}
        for b in batches:
            stats.reward_s += b.stats.reward_s
            stats.num_errors += b.stats.num_errors
            stats.num_timeouts += b.stats.num_timeouts
            stats.num_invalid += b.stats.num_invalid
            stats.first_reward_error = stats.first_reward_error or b.stats.first_reward_error
            metrics.update(b.plan.end_metrics())
            metrics.update(b.metrics)
        offsets = [batch - step for _, batch, _, _ in took]
        metrics["stream/other_batch_ratio"] = sum(o != 0 for o in offsets) / len(offsets)
        metrics["stream/batch_offset/mean"] = sum(offsets) / len(offsets)
        metrics["stream/batch_offset/min"] = float(min(offsets))
        metrics["stream/batch_offset/max"] = float(max(offsets))
        self._stats = stats
        return stats, metrics

    def _stream_planner_state(self) -> dict:
        """The planner now, with the prompts of every dispatched group not yet taken to be drawn
        first by a resumed run (`redraw`, in batch and group order): none lost, none repeated.
        Called between steps (no step is taking groups)."""
        with self._plan_lock, self._cond:
            state = copy.deepcopy(self.planner.state_dict(in_flight_after=self._last))
            untrained = [list(b.plan.records[i]) for u, b in sorted(self._batches.items())
                         for i in sorted(b.plan.records) if i not in self._stream.taken(u)]
            state["redraw"] = untrained + state["redraw"]
            return state
