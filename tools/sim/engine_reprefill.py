"""The `reprefill` engine model: rollout/hf_engine.py up to bc37220 (retired), where any
admission re-prefills the whole active set and finished rows stay in the decode batch until then.
Kept to fit and replay timelines recorded with that engine (tools/simulate.py calibrate --engine
reprefill, and --engine auto, which fits both models and keeps the better one)."""
from __future__ import annotations

import heapq
from collections import deque

from .costs import GEN_FEATURES, GenCosts
from .engine import Iteration, Sample


def replay_reprefill(samples: list[Sample], slots: int, gen: GenCosts, t0: float = 0.0) -> list[Iteration]:
    """engine.replay_engine for the reprefill engine: a LiveReprefill with every sample waiting at t0."""
    eng = LiveReprefill(slots, gen, t0)
    eng.add(samples, t0)
    its = []
    while not eng.idle:
        its.append(eng.step())
    return its


class LiveReprefill:
    """The reprefill engine stepped one engine step at a time, samples arriving at any time (the
    interface of engine.LiveEngine)."""

    def __init__(self, slots: int, gen: GenCosts, t0: float = 0.0):
        self.gen, self.t = gen, t0
        self.free = list(range(slots))
        heapq.heapify(self.free)
        self.pending: deque[tuple[float, Sample]] = deque()
        self.rows: list[Sample] = []      # the decode batch (since the last prefill, done rows too)
        self.live: list[Sample] = []      # unfinished, holding a slot
        self.need_prefill = True

    def add(self, samples: list[Sample], ready: float) -> None:
        for s in samples:
            s.done_gen = 0
            self.pending.append((ready, s))

    @property
    def idle(self) -> bool:
        return not self.live and not self.pending

    @property
    def next_start(self) -> float | None:
        if self.live:
            return self.t
        if self.pending:
            return max(self.t, self.pending[0][0])
        return None

    def step(self) -> Iteration:
        gen = self.gen
        t = self.t = self.next_start
        joined = []
        while self.pending and self.free and self.pending[0][0] <= t:
            s = self.pending.popleft()[1]
            s.slot, s.start = heapq.heappop(self.free), t
            joined.append(s)
        f = [0.0] * len(GEN_FEATURES)
        self.live = self.live + joined
        if joined or self.need_prefill:
            self.rows = list(self.live)
            f[3], f[4], f[5] = 1, len(self.rows), sum(s.prompt + s.done_gen for s in self.rows)
            self.need_prefill = False
        else:
            f[0], f[1], f[2] = 1, len(self.rows), sum(s.prompt + s.done_gen for s in self.rows)
        stepping = [s for s in self.rows if s.done_gen < s.response]
        t += gen.step_s(f)
        finished = []
        for s in stepping:
            s.done_gen += 1
            if s.done_gen >= s.response:
                s.end = t
                finished.append(s)
        if finished:
            done = set(map(id, finished))
            self.live = [s for s in self.live if id(s) not in done]
            for s in finished:
                heapq.heappush(self.free, s.slot)
            f[6] = len(finished)
            t += gen.finish_s * len(finished)
        if all(s.done_gen >= s.response for s in self.rows):
            self.need_prefill = True
        self.t = t
        return Iteration(f, joined, finished)
