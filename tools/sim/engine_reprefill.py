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
    """engine.replay_engine for the reprefill engine."""
    pending = deque(samples)
    free = list(range(slots))
    heapq.heapify(free)
    its: list[Iteration] = []
    t = t0
    rows: list[Sample] = []           # the decode batch (reprefill: since the last prefill, done rows too)
    live: list[Sample] = []           # unfinished, holding a slot
    need_prefill = True
    for s in samples:
        s.done_gen = 0
    while pending or live:
        joined = []
        while pending and free:
            s = pending.popleft()
            s.slot, s.start = heapq.heappop(free), t
            joined.append(s)
        f = [0.0] * len(GEN_FEATURES)
        live = live + joined
        if joined or need_prefill:
            rows = list(live)
            f[3], f[4], f[5] = 1, len(rows), sum(s.prompt + s.done_gen for s in rows)
            need_prefill = False
        else:
            f[0], f[1], f[2] = 1, len(rows), sum(s.prompt + s.done_gen for s in rows)
        stepping = [s for s in rows if s.done_gen < s.response]
        t += gen.step_s(f)
        finished = []
        for s in stepping:
            s.done_gen += 1
            if s.done_gen >= s.response:
                s.end = t
                finished.append(s)
        if finished:
            done = set(map(id, finished))
            live = [s for s in live if id(s) not in done]
            for s in finished:
                heapq.heappush(free, s.slot)
            f[6] = len(finished)
            t += gen.finish_s * len(finished)
        if all(s.done_gen >= s.response for s in rows):
            need_prefill = True
        its.append(Iteration(f, joined, finished))
    return its
