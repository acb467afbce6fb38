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


def _replay_incremental(samples: list[Sample], slots: int, gen: GenCosts, t0: float) -> list[Iteration]:
    """replay_engine for the incremental engine, in O(finishes log n) per step: a sample admitted
    at step a has generated `it - a` tokens at the start of step `it` and finishes at step
    a + R - 1."""
    pending = deque(samples)
    free = list(range(slots))
    heapq.heapify(free)
    its: list[Iteration] = []
    heap: list[tuple[int, int, Sample]] = []
    t, it, seq = t0, 0, 0
    live = prompt_sum = admit_sum = 0
    while pending or live:
        joined = []
        while pending and free:
            s = pending.popleft()
            s.slot, s.start = heapq.heappop(free), t
            joined.append(s)
        f = [0.0] * len(GEN_FEATURES)
        if live:
            f[0], f[1], f[2] = 1, live, prompt_sum + live * it - admit_sum
        if joined:
            f[3], f[4] = 1, len(joined)
            f[5] = (sum({s.group: s.prompt for s in joined}.values()) if gen.share_prompt
                    else sum(s.prompt for s in joined))
            for s in joined:
                heapq.heappush(heap, (it + s.response - 1, seq, s))
                seq += 1
                live, prompt_sum, admit_sum = live + 1, prompt_sum + s.prompt, admit_sum + it
        t += gen.step_s(f)
        finished = []
        while heap and heap[0][0] <= it:
            a_it, _, s = heapq.heappop(heap)
            s.end, s.done_gen = t, s.response
            finished.append(s)
            live, prompt_sum, admit_sum = live - 1, prompt_sum - s.prompt, admit_sum - (a_it - s.response + 1)
            heapq.heappush(free, s.slot)
        if finished:
            f[6] = len(finished)
            t += gen.finish_s * len(finished)
        its.append(Iteration(f, joined, finished))
        it += 1
    return its
