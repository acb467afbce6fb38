"""The event-driven replay of the producer core (scheduling/producer.py) over several batches:
what replay.py runs for every mode whose engines live in workers (sync_split, periodic, async).

The runtime's own rules decide, imported, not copied: when batch b may be dispatched
(scheduling/staleness.py `may_dispatch`, with the mode's eta from scheduling/mode.py), whether
groups are released as they complete or after the batch (Mode.release_on_completion), which
worker gets a request (rollout/dispatch.py), the DP ranks and micro-batches (trainer.py), and the
plug-ins (planner.py: the group sizer, the allocator).

- Dispatch: batch b is planned and its requests sent as soon as every engine holds version
  b - 1 - eta; a request reaches its engine dispatch_s later (a pilot's commit or a backfill
  too), to the engine with the fewest outstanding samples.
- Engines batch continuously (engine.live_engine: the incremental or the reprefill model); a
  sample's version is the weights its engine held when it was admitted (its first token's).
- The producer reads, one poll at a time, every result that reached it (result_s after its
  engine step); the requests a poll completes are scored in one reward call per batch
  (reward_call_s + reward_item_s * items), then each is handed to its plan (more requests, groups
  ready to train on), and the groups are released at the call's end (periodic, async) or when the
  batch's last request is in (sync_split). At a batch's end the sizer gets its lengths.
- The trainer trains batch b from (the end of batch b - 1's weight sync + step_gap_s) on its
  released groups (trainer.py); its engines hold version b step_gap_s after that weight sync.
  With eta > 0 generation goes on meanwhile (the engines' pause to load weights is not modelled).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from periodic_async.rollout.dispatch import least_loaded_worker
from periodic_async.scheduling.mode import Mode

from .costs import Cluster, Costs
from .engine import Sample, live_engine
from .planner import Request
from .trainer import train_step

RESULT, WEIGHTS, POLL, ENGINE = range(4)     # the order of events at the same time


@dataclass
class Batch:
    """One batch as replayed: its plan's decisions and its times (absolute seconds)."""
    step: int
    plan: object
    dispatch: float                   # planned and sent
    dispatch_version: int             # the version every engine held then
    group_size: int = 0               # K of its first request
    samples: list = field(default_factory=list)     # every sample generated for it
    open_requests: int = 0
    order: list = field(default_factory=list)       # training positions, in release order
    avail: dict = field(default_factory=dict)       # position -> released at
    groups: dict = field(default_factory=dict)      # position -> its samples
    held: list = field(default_factory=list)
    lengths: list = field(default_factory=list)     # response lengths of each released group (sizer)
    keys: list = field(default_factory=list)
    gen_end: float = 0.0              # its last request scored
    done: bool = False
    done_at: float = 0.0
    metrics: dict = field(default_factory=dict)     # the plan's and the sizer's
    t0: float = 0.0                   # the trainer starts on it
    sync_end: float = 0.0
    train_s: float = 0.0
    trainer_idle_s: float = 0.0
    events: list = field(default_factory=list)

    @property
    def rollouts(self) -> int:
        return len(self.samples)

    @property
    def oldest_version(self) -> int:
        return min((s.version for s in self.samples), default=self.dispatch_version)


def pick_engine(load: dict[int, int], samples: int) -> int:
    """rollout/worker.py WorkerPool.dispatch: a request to the engine with the fewest outstanding
    samples (the pool's rule, rollout/dispatch.py), whose load grows by its samples."""
    e = least_loaded_worker(load)
    load[e] += samples
    return e


class Pipeline:
    def __init__(self, mode: Mode, planner, cluster: Cluster, costs: Costs, micro_batch_size: int,
                 weight_bytes: float = 0.0, first_step: int = 1, last_step: int = 1, t0: float = 0.0,
                 step_gap_s: float = 0.0):
        if not mode.engine_in_workers:
            raise ValueError(f"mode {mode.name}: the event-driven replay runs the modes whose engines live in workers")
        self.mode, self.rule, self.planner, self.costs = mode, mode.staleness, planner, costs
        self.mbs, self.weight_bytes, self.gap = micro_batch_size, weight_bytes, step_gap_s
        self.dp = cluster.dp(mode.name)
        self.engines = [live_engine(cluster.slots, costs.gen, t0) for _ in range(cluster.engines(mode.name))]
        self.load = {e: 0 for e in range(len(self.engines))}
        self.scheduled = [False] * len(self.engines)
        self.first, self.last, self.t0 = first_step, last_step, t0
        self.next, self.next_train, self.train_from = first_step, first_step, t0
        self.version = first_step - 1
        self.batches: dict[int, Batch] = {}
        self.owner: dict[int, tuple[int, Request]] = {}      # id(sample) -> (step, request)
        self.got: dict[int, int] = {}                         # id(request) -> samples in
        self.inbox: list[tuple[float, Sample]] = []
        self.cursor, self.poll_due = t0, False
        self.heap: list = []
        self.seq = 0

    # ------------------------------------------------------------------ the loop
    def run(self) -> list[Batch]:
        self._dispatch_batches(self.t0)
        while self.heap:
            t, kind, _, arg = heapq.heappop(self.heap)
            if kind == RESULT:
                self.inbox += [(t, s) for s in arg]
                if not self.poll_due:
                    self._push(max(t, self.cursor), POLL, None)
                    self.poll_due = True
            elif kind == WEIGHTS:
                self.version = max(self.version, arg)
                self._dispatch_batches(t)
            elif kind == POLL:
                self.poll_due = False
                self._poll(t)
            else:
                self._engine_step(arg)
        missing = [b for b in range(self.first, self.last + 1) if b not in self.batches or not self.batches[b].done]
        if missing:
            raise RuntimeError(f"replay: batches {missing} never completed")
        return [self.batches[b] for b in range(self.first, self.last + 1)]

    def _push(self, t: float, kind: int, arg) -> None:
        heapq.heappush(self.heap, (t, kind, self.seq, arg))
        self.seq += 1

    # ------------------------------------------------------------------ dispatch and engines
    def _dispatch_batches(self, t: float) -> None:
        while self.next <= self.last and self.rule.may_dispatch(self.next, self.version):
            step, self.next = self.next, self.next + 1
            plan = self.planner.plan(step)
            b = self.batches[step] = Batch(step, plan, t, self.version)
            b.group_size = max(plan.train_sizes.values(), default=0)
            self._send(b, plan.requests, t)
            if not plan.requests:
                self._finish(b, t)

    def _send(self, b: Batch, requests: list[Request], t: float) -> None:
        for req in requests:
            e = pick_engine(self.load, len(req.samples))
            for s in req.samples:
                s.engine = e
                self.owner[id(s)] = (b.step, req)
            self.got[id(req)] = 0
            b.samples += req.samples
            self.engines[e].add(req.samples, t + self.costs.dispatch_s)
            if not self.scheduled[e]:
                self._push(self.engines[e].next_start, ENGINE, e)
                self.scheduled[e] = True
        b.open_requests += len(requests)

    def _engine_step(self, e: int) -> None:
        eng = self.engines[e]
        it = eng.step()
        for s in it.joined:
            s.version = self.version
        if it.finished:
            self._push(it.finished[0].end + self.costs.result_s, RESULT, it.finished)
        self.scheduled[e] = not eng.idle
        if not eng.idle:
            self._push(eng.next_start, ENGINE, e)

    # ------------------------------------------------------------------ the producer
    def _poll(self, t: float) -> None:
        """producer.py _deliver: one poll's results, one reward call per batch they complete."""
        c = self.costs
        results = sorted(self.inbox, key=lambda x: (x[0], x[1].engine, self.owner[id(x[1])][0], x[1].group, x[1].k))
        self.inbox = []
        complete: dict[int, list[Request]] = {}
        for _, s in results:
            self.load[s.engine] -= 1
            step, req = self.owner.pop(id(s))
            self.got[id(req)] += 1
            if self.got[id(req)] == len(req.samples):
                del self.got[id(req)]
                complete.setdefault(step, []).append(req)
        cursor = t
        for step, done in complete.items():
            b = self.batches[step]
            items = sum(len(r.samples) for r in done)
            a, cursor = cursor, cursor + c.reward_call_s + c.reward_item_s * items
            b.events.append({"step": step, "kind": "reward", "lane": "trainer", "start": a, "end": cursor,
                             "groups": [r.group for r in done], "items": items})
            for req in done:
                more, ready = b.plan.on_scored(req)
                self._send(b, more, cursor)
                b.gen_end = cursor
                self._release(b, ready, cursor)
                b.open_requests -= 1
            if b.open_requests == 0:
                self._finish(b, cursor)
        self.cursor = cursor

    def _release(self, b: Batch, ready: list, t: float) -> None:
        for pos, samples, key in ready:
            b.groups[pos] = samples
            if samples:
                b.lengths.append([s.response for s in samples])
                b.keys.append(key)
            if self.mode.release_on_completion:
                b.order.append(pos)
                b.avail[pos] = t
            else:
                b.held.append(pos)

    def _finish(self, b: Batch, t: float) -> None:
        """producer.py _finish: the plan's unfilled positions, the sizer's feedback, the held groups."""
        tail = b.plan.finish()
        b.metrics.update(b.plan.metrics)
        b.metrics.update(self.planner.observe(b.step, b.lengths, b.keys))
        for pos, samples, _ in tail:
            b.groups[pos] = samples
            b.held.append(pos)
        for pos in b.held:
            b.order.append(pos)
            b.avail[pos] = t
        b.held, b.done, b.done_at = [], True, t
        self._train()

    # ------------------------------------------------------------------ the trainer
    def _train(self) -> None:
        """Train every finished batch whose predecessor is trained; post its weights."""
        while self.next_train in self.batches and self.batches[self.next_train].done:
            b = self.batches[self.next_train]
            b.t0 = self.train_from
            tr = train_step(b.order, b.avail, b.groups, b.plan.train_sizes, self.dp, b.t0, self.costs, self.mbs,
                            self.weight_bytes, b.step)
            b.sync_end, b.train_s, b.trainer_idle_s = tr.sync_end, tr.train_busy_s, tr.wait_s
            b.events += tr.events
            self.train_from = tr.sync_end + self.gap
            self._push(self.train_from, WEIGHTS, b.step)
            self.next_train += 1
