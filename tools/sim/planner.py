"""The batch plans the event-driven replay (pipeline.py) runs, with the runtime's own plug-ins
(scheduling/plan.py's protocol: a batch's first requests, `on_scored(request)` -> more requests
and the groups ready to train on, `finish()` -> the positions no group took):

- group sizing: any runtime sizer (scheduling/group_sizing.py: FixedGroupSize, or
  StragglerAwareGroupSize = SAGC, which decides one K per batch at dispatch and learns from the
  batch's simulated lengths when it ends - in async mode possibly after later batches were
  decided, as in the runtime);
- selection: the runtime's Allocator (scheduling/allocation.py: pilot-commit or backfill), fed
  binary rewards drawn from a per-prompt success probability (`PromptSet`), so its pilots,
  commits, drops and backfills change the step's rollouts and time.

Nothing here decides what the runtime decides: it only supplies simulated prompts, lengths and
rewards, and carries the runtime's decisions to the replay.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from periodic_async.scheduling.alloc_types import FULL, Candidate
from periodic_async.scheduling.allocation import Allocator

from .costs import Workload
from .engine import Sample


@dataclass
class Request:
    """One request to dispatch: samples of the group in slot `group` (phase: full / pilot / commit)."""
    group: int
    samples: list[Sample]
    phase: str = FULL


Ready = tuple    # (training position, its samples, its prompt key or None): a group ready to train on


def plan_requests(workload: Workload, rng: random.Random, sizes: list[int] | None = None) -> list[list[Sample]]:
    """`workload.prompts` groups (K = sizes[g], default workload.n): a prompt length, then K response
    lengths, drawn per group."""
    reqs = []
    for g in range(workload.prompts):
        n = workload.n if sizes is None else sizes[g]
        p = workload.prompt_lengths.sample(rng, 1)[0]
        reqs.append([Sample(g, k, p, r) for k, r in enumerate(workload.response_lengths.sample(rng, n))])
    return reqs


def parse_success(spec: str):
    """A per-prompt success-probability distribution: fixed:P | uniform:LO,HI | beta:A,B."""
    kind, _, args = spec.partition(":")
    try:
        a = [float(x) for x in args.split(",")] if args else []
        if kind == "fixed" and len(a) == 1 and 0 <= a[0] <= 1:
            return lambda rng: a[0]
        if kind == "uniform" and len(a) == 2 and 0 <= a[0] <= a[1] <= 1:
            return lambda rng: rng.uniform(a[0], a[1])
        if kind == "beta" and len(a) == 2 and min(a) > 0:
            return lambda rng: rng.betavariate(a[0], a[1])
    except ValueError:
        pass
    raise ValueError(f"success spec '{spec}': expected fixed:P | uniform:LO,HI | beta:A,B")


class PromptSet:
    """A simulated dataset: `size` prompts, each with a prompt length and a success probability
    (drawn once), served like the loader serves records (a fresh shuffled order each epoch,
    `Candidate(key, epoch)`); a sample's reward is 1.0 with its prompt's probability, else 0.0."""

    def __init__(self, workload: Workload, size: int, success: str = "beta:1,1", seed: int = 0):
        rng = random.Random(seed)
        draw_p = parse_success(success)
        self.workload, self.size = workload, size
        self.prompt = workload.prompt_lengths.sample(rng, size)
        self.p = [draw_p(rng) for _ in range(size)]
        self._rng, self._order, self._i, self.epoch = rng, [], 0, 0

    def draw(self) -> Candidate:
        if self._i >= len(self._order):
            if self._order:
                self.epoch += 1
            self._order = list(range(self.size))
            self._rng.shuffle(self._order)
            self._i = 0
        key, self._i = self._order[self._i], self._i + 1
        return Candidate(key, self.epoch)

    def samples(self, key: int, slot: int, indices, rng: random.Random) -> list[Sample]:
        lengths = self.workload.response_lengths.sample(rng, len(indices))
        return [Sample(slot, k, self.prompt[key], r, reward=1.0 if rng.random() < self.p[key] else 0.0)
                for k, r in zip(indices, lengths)]


class FixedPlan:
    """plan.py BatchPlan: every request sent at once, each group trained at its own index."""

    def __init__(self, requests: list[list[Sample]]):
        self.requests = [Request(r[0].group, r) for r in requests]
        self.train_sizes = {r[0].group: len(r) for r in requests}
        self.metrics: dict = {}

    def on_scored(self, req: Request) -> tuple[list[Request], list[Ready]]:
        return [], [(req.group, req.samples, None)]

    def finish(self) -> list[Ready]:
        return []


class AllocatedPlan:
    """plan.py AllocatedPlan: the runtime's Allocator decides the requests and the trainable
    groups; a group takes the next training position as it becomes ready."""

    def __init__(self, step: int, alloc: Allocator, prompts: PromptSet, rng: random.Random, k: int):
        self.step, self.alloc, self.prompts, self.rng = step, alloc, prompts, rng
        self.train_sizes = {i: k for i in range(alloc.batch_size)}
        self._parts: dict[int, dict[str, list[Sample]]] = {}
        self._keys: dict[int, int] = {}
        self._positions = 0
        self.metrics: dict = {}
        self.requests = [self._request(r) for r in alloc.begin_step(step, prompts.draw, group_size=k)]

    def _request(self, ar) -> Request:
        self._keys[ar.slot] = ar.key
        return Request(ar.slot, self.prompts.samples(ar.key, ar.slot, ar.sample_indices, self.rng), ar.phase)

    def on_scored(self, req: Request) -> tuple[list[Request], list[Ready]]:
        self._parts.setdefault(req.group, {})[req.phase] = req.samples
        out = self.alloc.on_group(self.step, req.group, req.phase, [s.reward for s in req.samples])
        ready = []
        for tg in out.ready:
            parts = self._parts.pop(tg.slot)
            ready.append((self._positions, [s for a in tg.parts for s in parts[a.phase]], str(tg.key)))
            self._positions += 1
        return [self._request(r) for r in out.requests], ready

    def finish(self) -> list[Ready]:
        self.metrics = self.alloc.end_step(self.step)
        empty = [(i, [], None) for i in range(self._positions, self.alloc.batch_size)]
        self._positions = self.alloc.batch_size
        return empty


class Planner:
    """plan.py BatchPlanner for the replay: K from the runtime's group sizer (FixedGroupSize(n) by
    default), prompts and lengths drawn from the workload (or, `plans`, replayed), or - with an
    allocator - prompts drawn by the allocator from `prompts`."""

    def __init__(self, workload: Workload, rng: random.Random, sizer=None, allocator: Allocator | None = None,
                 prompts: PromptSet | None = None, plans: list | None = None):
        from periodic_async.scheduling.group_sizing import FixedGroupSize
        if allocator is not None and prompts is None:
            raise ValueError("an allocator needs a PromptSet (its prompts' success probabilities)")
        self.workload, self.rng, self.allocator, self.prompts, self.plans = workload, rng, allocator, prompts, plans
        self.sizer = sizer if sizer is not None else FixedGroupSize(workload.n)

    def plan(self, step: int):
        if self.plans:
            p = self.plans[(step - 1) % len(self.plans)]
            return FixedPlan([[Sample(g, k, pl, r) for k, r in enumerate(rs)] for g, (pl, rs) in enumerate(p)])
        if self.allocator is not None:
            return AllocatedPlan(step, self.allocator, self.prompts, self.rng, int(self.sizer.group_size(step, 0)))
        begin_step = getattr(self.sizer, "begin_step", None)
        if begin_step is not None:
            begin_step(step, None)      # the replay's prompts have no identity: no prompt prior
        sizes = [int(self.sizer.group_size(step, g)) for g in range(self.workload.prompts)]
        return FixedPlan(plan_requests(self.workload, self.rng, sizes))

    def observe(self, step: int, lengths: list[list[int]], keys: list) -> dict:
        """The batch's feedback to an adaptive sizer (producer.py: _finish), its metrics."""
        observe = getattr(self.sizer, "observe", None)
        if observe is None:
            return {}
        return observe(step, lengths, keys if all(k is not None for k in keys) else None)
