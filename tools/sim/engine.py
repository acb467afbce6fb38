"""One rollout engine's continuous batching, replayed: who holds which slot when, and what each
engine step holds (its cost features, costs.GEN_FEATURES).

An engine batches continuously with `slots` slots, the lowest free slot first. Two engine models:
`incremental` (rollout/hf_engine.py today, and vLLM: a finished sequence leaves at once, only the
newcomers are prefilled, each distinct prompt once) and `reprefill` (engine_reprefill.py: the
retired hf_engine.py up to bc37220).
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from .costs import GEN_FEATURES, GenCosts


@dataclass
class Sample:
    """One sample of a request (group, index k, prompt and response tokens); the replay fills
    in its engine, slot, start and end."""
    group: int
    k: int
    prompt: int
    response: int
    engine: int = 0
    slot: int = -1
    reward: float = 0.0          # simulated reward (pipeline.py: selection)
    version: int = 0             # the policy version its engine held when it was admitted
    start: float = 0.0
    end: float = 0.0
    done_gen: int = 0


@dataclass
class Iteration:
    """One engine step: its cost features (GEN_FEATURES order), who joined at its start and who
    finished at its end."""
    features: list[float]
    joined: list[Sample]
    finished: list[Sample]


def replay_engine(samples: list[Sample], slots: int, gen: GenCosts, t0: float = 0.0) -> list[Iteration]:
    """Continuous batching of `samples` (in admission order, all waiting at t0) on one engine;
    fills each sample's slot, start and end, returns the engine steps. The structure (who joins
    and finishes when) does not depend on the costs: all requests arrive at once."""
    if gen.engine == "reprefill":
        from .engine_reprefill import replay_reprefill     # imports this module's Sample / Iteration
        return replay_reprefill(samples, slots, gen, t0)
    return _replay_incremental(samples, slots, gen, t0)


def live_engine(slots: int, gen: GenCosts, t0: float = 0.0):
    """A steppable engine of `gen.engine`'s model (LiveEngine, engine_reprefill.LiveReprefill)."""
    if gen.engine == "reprefill":
        from .engine_reprefill import LiveReprefill     # imports this module's Sample / Iteration
        return LiveReprefill(slots, gen, t0)
    return LiveEngine(slots, gen, t0)


def _replay_incremental(samples: list[Sample], slots: int, gen: GenCosts, t0: float) -> list[Iteration]:
    """replay_engine for the incremental engine: a LiveEngine with every sample waiting at t0."""
    eng = LiveEngine(slots, gen, t0)
    eng.add(samples, t0)
    its = []
    while not eng.idle:
        its.append(eng.step())
    return its


class LiveEngine:
    """The incremental engine stepped one engine step at a time, with samples arriving at any
    time (`add(samples, ready)`): what the event-driven replay (pipeline.py) runs, and
    replay_engine with every sample waiting at t0. A step starts at `next_start`: admits, lowest
    free slot first, the waiting samples that have arrived by then, in arrival order; a sample
    admitted at step a has generated `it - a` tokens at the start of step `it` and finishes at
    step a + R - 1; its end is the step's end, before the finished sequences' sends (finish_s)."""

    def __init__(self, slots: int, gen: GenCosts, t0: float = 0.0):
        self.gen, self.t = gen, t0
        self.free = list(range(slots))
        heapq.heapify(self.free)
        self.pending: deque[tuple[float, Sample]] = deque()     # (arrival, sample), arrival order
        self.heap: list[tuple[int, int, Sample]] = []
        self.it = self.seq = 0
        self.live = self.prompt_sum = self.admit_sum = 0

    def add(self, samples: list[Sample], ready: float) -> None:
        self.pending.extend((ready, s) for s in samples)

    @property
    def idle(self) -> bool:
        return not self.live and not self.pending

    @property
    def next_start(self) -> float | None:
        """When the next engine step starts (None: nothing to do until a sample arrives)."""
        if self.live:
            return self.t
        if self.pending:
            return max(self.t, self.pending[0][0])
        return None

    def step(self) -> Iteration:
        """Run the engine step that starts at next_start; afterwards `t` is when it is free again."""
        gen, it = self.gen, self.it
        t = self.t = self.next_start
        joined = []
        while self.pending and self.free and self.pending[0][0] <= t:
            s = self.pending.popleft()[1]
            s.slot, s.start = heapq.heappop(self.free), t
            joined.append(s)
        f = [0.0] * len(GEN_FEATURES)
        if self.live:
            f[0], f[1], f[2] = 1, self.live, self.prompt_sum + self.live * it - self.admit_sum
        if joined:
            f[3], f[4] = 1, len(joined)
            f[5] = (sum({s.group: s.prompt for s in joined}.values()) if gen.share_prompt
                    else sum(s.prompt for s in joined))
            for s in joined:
                heapq.heappush(self.heap, (it + s.response - 1, self.seq, s))
                self.seq += 1
                self.live, self.prompt_sum, self.admit_sum = self.live + 1, self.prompt_sum + s.prompt, \
                    self.admit_sum + it
        t += gen.step_s(f)
        finished = []
        while self.heap and self.heap[0][0] <= it:
            a_it, _, s = heapq.heappop(self.heap)
            s.end, s.done_gen = t, s.response
            finished.append(s)
            self.live, self.prompt_sum = self.live - 1, self.prompt_sum - s.prompt
            self.admit_sum -= a_it - s.response + 1
            heapq.heappush(self.free, s.slot)
        if finished:
            f[6] = len(finished)
            t += gen.finish_s * len(finished)
        self.t, self.it = t, it + 1
        return Iteration(f, joined, finished)
