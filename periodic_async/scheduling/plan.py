"""One batch's plan: the prompts as rollout requests, each with its own K and seed (torch-free
apart from the request types).

A plan is also what the producer asks, request by request, what follows: `on_scored(request,
part)` once a request's responses are in and rewarded returns more requests to send (under the
same policy version) and the groups ready to train on. A plain `BatchPlan` sends everything at
once and trains every group; `AllocatedPlan` asks the step's selection rule (selection/:
pilot-commit, backfill, or any registered one). Either way the trainer is told up front how many groups of which K it will receive
(`train_sizes`), and `finish()` fills the positions no group took with empty groups, so that every
trainer rank knows its micro-batch count before the batch's first group arrives.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..data.records import DatasetError
from ..rollout.base import RolloutRequest, RolloutResult, SamplingParams, with_budget
from .alloc_types import AllocRequest, Candidate
from .group import Group
from .group_sizing import FixedGroupSize, prompt_key


def request_seed(base_seed: int, step: int, group_index: int) -> int:
    """Sampling seed of one prompt: a function of (seed, step, prompt) only, never of batching."""
    return (base_seed * 1_000_003 + step) * 1_000_003 + group_index


@dataclass
class BatchPlan:
    """One batch's prompts, as requests, and what the groups need besides the results."""
    step: int
    requests: list[RolloutRequest]
    answers: dict[int, str]             # group index -> gold answer
    # group index -> (record index, loader epoch) of its prompt: a streaming checkpoint hands the
    # prompts not yet trained to the resumed run (producer.py: planner_state)
    records: dict = field(default_factory=dict)

    @property
    def num_groups(self) -> int:
        return len(self.requests)

    @property
    def num_samples(self) -> int:
        return sum(r.n for r in self.requests)

    @property
    def group_sizes(self) -> dict[int, int]:
        """group index -> K."""
        return {r.group_index: r.n for r in self.requests}

    @property
    def train_sizes(self) -> dict[int, int]:
        """Training position -> K of the groups the trainer receives (a Group's group_index is its
        position): here every prompt's group, at its own index."""
        return self.group_sizes

    def part_group(self, request: RolloutRequest, results: list[RolloutResult]) -> Group:
        """The responses of one request as a Group (sorted by sample index), not yet scored."""
        want = request.samples()
        got = sorted(results, key=lambda r: r.sample_index)
        if [r.sample_index for r in got] != sorted(want):
            raise RuntimeError(f"group {request.group_index}: samples {[r.sample_index for r in got]} received for "
                               f"a request of samples {sorted(want)}")
        return Group(request.group_index, request.prompt_ids, self.answers[request.group_index], got)

    def on_scored(self, request: RolloutRequest, part: Group) -> tuple[list[RolloutRequest], list[Group]]:
        """`part` (the responses of `request`, rewarded) is in: the requests to send next and the
        groups ready to train on (advantages still to compute, over each whole group)."""
        return [], [part]

    def finish(self) -> list[Group]:
        """After the last request: empty groups for the training positions no group took."""
        return []

    def end_metrics(self) -> dict[str, float]:
        """The plan's own metrics of the batch (after finish)."""
        return {}


@dataclass
class AllocatedPlan(BatchPlan):
    """A batch whose requests a selection rule (selection/; e.g. allocation.py's Allocator) decides
    as the step goes: pilots then commits, or full groups and backfills. Slots are the rule's (group_index = slot of every
    request, which fixes the seed); a trainable group takes the next free training position as it
    becomes ready, so positions follow readiness order, and decisions never do (the rule's
    promise). `prompt_of(key)` -> (prompt ids, answer, its generation budget or None) of a drawn prompt."""
    selection: object = None        # the rule (selection/__init__.py: its contract)
    prompt_of: Callable = None
    sampling: SamplingParams = None
    seed: int = 0
    group_size: int = 0
    max_groups: int = 0
    _parts: dict = field(default_factory=dict)      # slot -> {phase: rewarded part Group}
    # prompt key -> the rewarded pilot part Group of a reserve entry, shared by the planner's
    # plans (rollout.pilot.reuse_pilots: the rule's `kept` puts parts in, a reused pilot takes one out)
    pilot_store: dict = field(default_factory=dict)
    _phases: dict = field(default_factory=dict)     # (slot, sample indices) -> phase of that request
    _positions: int = 0
    _metrics: dict = field(default_factory=dict)
    _reward_sum: float = 0.0        # over every rollout of the step, trained on or not
    _reward_count: int = 0

    @property
    def train_sizes(self) -> dict[int, int]:
        return {i: self.group_size for i in range(self.max_groups)}

    def to_request(self, req: AllocRequest) -> RolloutRequest:
        ids, answer, budget = self.prompt_of(req.key)
        self.answers[req.slot] = answer
        self._phases[(req.slot, tuple(req.sample_indices))] = req.phase
        return RolloutRequest(req.slot, ids, req.group_size, with_budget(self.sampling, budget),
                              request_seed(self.seed, self.step, req.slot),
                              sample_indices=list(req.sample_indices))

    def on_scored(self, request: RolloutRequest, part: Group) -> tuple[list[RolloutRequest], list[Group]]:
        phase = self._phases[(request.group_index, tuple(request.samples()))]
        self._parts.setdefault(request.group_index, {})[phase] = part
        self._reward_sum += sum(part.rewards)
        self._reward_count += len(part.rewards)
        if getattr(self.selection, "reuses_rollouts", False):
            version = min((r.policy_version for r in part.results), default=None)
            out = self.selection.on_group(self.step, request.group_index, phase, part.rewards, version=version)
        else:
            out = self.selection.on_group(self.step, request.group_index, phase, part.rewards)
        for slot, key in getattr(out, "kept", ()):
            self.pilot_store[key] = self._parts[slot]["pilot"]
        more = [self.to_request(r) for r in out.requests]
        ready = []
        for tg in out.ready:
            parts = self._parts.pop(tg.slot)
            for a in tg.parts:
                if a.reused:
                    parts[a.phase] = self.pilot_store.pop(a.key)
            results = [r for a in tg.parts for r in parts[a.phase].results]
            rewards = [x for a in tg.parts for x in parts[a.phase].rewards]
            if len(results) != tg.group_size or [r.sample_index for r in results] != list(range(tg.group_size)):
                raise RuntimeError(f"step {self.step}, slot {tg.slot}: the parts {[a.phase for a in tg.parts]} hold "
                                   f"samples {[r.sample_index for r in results]}, not 0..{tg.group_size - 1}")
            if self._positions >= self.max_groups:
                raise RuntimeError(f"step {self.step}: the selection rule made more than {self.max_groups} groups trainable")
            penalties = [x for a in tg.parts for x in parts[a.phase].overlong_penalties]
            ready.append(Group(self._positions, part.prompt_ids, part.answer, results, rewards,
                               overlong_penalties=penalties))
            self._positions += 1
        return more, ready

    def finish(self) -> list[Group]:
        self._metrics = self.selection.end_step(self.step)
        for key in [k for k in self.pilot_store if not self.selection.holds_pilot(k)]:
            del self.pilot_store[key]       # expired, drawn again or evicted: the rule will not reuse it
        # the policy's score on everything it generated: critic/score/mean covers the trained
        # groups only, which the selection rule picks
        if self._reward_count:
            self._metrics["alloc/score_all/mean"] = self._reward_sum / self._reward_count
        empty = [Group(i, [], "", []) for i in range(self._positions, self.max_groups)]
        self._positions = self.max_groups
        return empty

    def end_metrics(self) -> dict[str, float]:
        return dict(self._metrics)


class BatchPlanner:
    """The loader's next batch of records -> a BatchPlan: K from the group sizer, the sampling
    parameters, a seed per prompt from (seed, step, prompt index).

    `tokenize(record)` may return None for a record to leave out (an over-long prompt under
    data.overlong_prompt: skip): the loader's next record takes its place, so the batch keeps its
    size and a resumed run (the loader's state) draws the same replacements.
    """

    def __init__(self, loader, tokenize: Callable, sampling: SamplingParams, seed: int, group_sizer=None,
                 default_n: int = 8, selection=None):
        self.loader, self.tokenize, self.sampling, self.seed = loader, tokenize, sampling, seed
        self.group_sizer = group_sizer if group_sizer is not None else FixedGroupSize(default_n)
        self.selection = selection      # the rule rollout.selection names (selection/), or None: plain batches
        self._records = {rec.index: rec for rec in loader.records}
        self._ids: dict[int, list[int]] = {}
        # A selection rule draws during its step, and with max_staleness > 0 steps overlap: the
        # draws of each step in progress are kept, so that a checkpoint taken meanwhile can hand
        # the prompts of the steps it does not keep to the resumed run (`redraw`, drawn first).
        self._drawn: dict[int, list[tuple[int, int]]] = {}    # step -> [(record index, loader epoch)]
        self._redraw: list[tuple[int, int]] = []
        self._pilot_store: dict = {}        # reuse_pilots: the reserve's pilot rollouts (AllocatedPlan)

    def plan(self, step: int) -> BatchPlan:
        if self.selection is not None:
            return self._selected_plan(step)
        pending = self._draw(self.loader.batch_size)   # [(record, epoch)]; replacements are appended
        records, prompts = [], []
        skipped_in_a_row = 0
        for rec, epoch in pending:
            ids = self.tokenize(rec)
            if ids is None:
                skipped_in_a_row += 1
                # any 2N-1 consecutive draws hold one whole epoch of the N records: every one was refused
                if skipped_in_a_row >= 2 * len(self.loader.records):
                    raise DatasetError(f"data.overlong_prompt: skip left out every one of the "
                                       f"{len(self.loader.records)} records (all over data.max_prompt_length)")
                pending.extend(self._draw(1))
                continue
            skipped_in_a_row = 0
            records.append((rec, epoch))
            prompts.append(ids)
        # a sizer that picks one K per step sees the batch's prompts first
        self.group_sizer.begin_step(step, [prompt_key(ids) for ids in prompts])
        requests = []
        for i, ids in enumerate(prompts):
            k = int(self.group_sizer.group_size(step, i))
            if k < 2:
                raise ValueError(f"group size {k} for prompt {i} of step {step}: a group needs at least 2 responses")
            requests.append(RolloutRequest(i, ids, k, with_budget(self.sampling, records[i][0].max_new_tokens),
                                           request_seed(self.seed, step, i)))
        return BatchPlan(step, requests, {i: rec.answer for i, (rec, _) in enumerate(records)},
                         records={i: (rec.index, epoch) for i, (rec, epoch) in enumerate(records)})

    def _draw(self, n: int) -> list:
        """n (record, loader epoch) pairs: a resumed run's `redraw` prompts first, then the loader's."""
        out = []
        while self._redraw and len(out) < n:
            index, epoch = self._redraw.pop(0)
            out.append((self._records[index], epoch))
        for _ in range(n - len(out)):
            epoch = self.loader.epoch
            (rec,) = self.loader.next_batch(1)
            out.append((rec, epoch))
        return out

    def state_dict(self, in_flight_after: int | None = None) -> dict:
        """What a checkpoint keeps of the planner: the loader's position, the group sizer's and
        the selection rule's state (None where they hold none; kept under the key "allocator",
        which checkpoints have always used). `in_flight_after=s`: taken while the steps after s
        are in progress (their selection rule still drawing): the prompts they drew go into
        `redraw`, which a resumed run draws before the loader's next, so none is lost or repeated."""
        redraw = None
        if in_flight_after is not None:
            redraw = [list(d) for step in sorted(self._drawn) if step > in_flight_after for d in self._drawn[step]]
            redraw += [list(d) for d in self._redraw]
        return {"loader": self.loader.state_dict(),
                "group_sizer": self.group_sizer.state_dict(),
                "allocator": self.selection.state_dict() if self.selection is not None else None,
                "redraw": redraw}

    def forget_step(self, step: int) -> None:
        """Step `step` is trained: its draws are no longer needed for a checkpoint."""
        self._drawn.pop(step, None)

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state["loader"])
        if state.get("group_sizer") is not None:
            self.group_sizer.load_state_dict(state["group_sizer"])
        if state.get("allocator") is not None and self.selection is not None:
            self.selection.load_state_dict(state["allocator"])
        self._redraw = [(int(i), int(e)) for i, e in state.get("redraw") or []]
        self._pilot_store.clear()       # stored pilot rollouts are not in a checkpoint: piloted afresh

    def _selected_plan(self, step: int) -> AllocatedPlan:
        """The selection rule draws the step's prompts itself (and more during the step, for backfill);
        a prompt left out by `tokenize` is skipped like in plan()."""
        drawn = self._drawn.setdefault(step, [])

        def draw() -> Candidate | None:
            for _ in range(2 * len(self.loader.records)):
                if self._redraw:        # a resumed run: the prompts of the steps its checkpoint did not keep
                    index, epoch = self._redraw.pop(0)
                else:
                    epoch = self.loader.epoch
                    (rec,) = self.loader.next_batch(1)
                    index = rec.index
                drawn.append((index, epoch))
                if self._prompt_ids(index) is not None:
                    return Candidate(index, epoch)
            raise DatasetError(f"data.overlong_prompt: skip left out every one of the "
                               f"{len(self.loader.records)} records (all over data.max_prompt_length)")

        rule = self.selection
        # the step's K from the group sizer (the rule draws the prompts, so a sizer's prompt
        # prior has none to look at yet)
        k = int(self.group_sizer.group_size(step, 0))
        plan = AllocatedPlan(step, [], {}, selection=rule, prompt_of=self._prompt_of, sampling=self.sampling,
                             seed=self.seed, group_size=k, max_groups=rule.batch_size, pilot_store=self._pilot_store)
        plan.requests = [plan.to_request(r) for r in rule.begin_step(step, draw, group_size=k)]
        return plan

    def _prompt_ids(self, index: int) -> list[int] | None:
        if index not in self._ids:
            self._ids[index] = self.tokenize(self._records[index])
        return self._ids[index]

    def _prompt_of(self, index: int) -> tuple[list[int], str, int | None]:
        rec = self._records[index]
        return self._prompt_ids(index), rec.answer, rec.max_new_tokens
