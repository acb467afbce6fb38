"""One batch's plan: the prompts as rollout requests, each with its own K and seed (torch-free
apart from the request types)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..data.records import DatasetError
from ..rollout.base import RolloutRequest, SamplingParams
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


class BatchPlanner:
    """The loader's next batch of records -> a BatchPlan: K from the group sizer, the sampling
    parameters, a seed per prompt from (seed, step, prompt index).

    `tokenize(record)` may return None for a record to leave out (an over-long prompt under
    data.overlong_prompt: skip): the loader's next record takes its place, so the batch keeps its
    size and a resumed run (the loader's state) draws the same replacements.
    """

    def __init__(self, loader, tokenize: Callable, sampling: SamplingParams, seed: int, group_sizer=None,
                 default_n: int = 8):
        self.loader, self.tokenize, self.sampling, self.seed = loader, tokenize, sampling, seed
        self.group_sizer = group_sizer if group_sizer is not None else FixedGroupSize(default_n)

    def plan(self, step: int) -> BatchPlan:
        pending = list(self.loader.next_batch())   # a copy: replacements are appended to it
        records, prompts = [], []
        skipped_in_a_row = 0
        for rec in pending:
            ids = self.tokenize(rec)
            if ids is None:
                skipped_in_a_row += 1
                # any 2N-1 consecutive draws hold one whole epoch of the N records: every one was refused
                if skipped_in_a_row >= 2 * len(self.loader.records):
                    raise DatasetError(f"data.overlong_prompt: skip left out every one of the "
                                       f"{len(self.loader.records)} records (all over data.max_prompt_length)")
                pending.extend(self.loader.next_batch(1))
                continue
            skipped_in_a_row = 0
            records.append(rec)
            prompts.append(ids)
        begin_step = getattr(self.group_sizer, "begin_step", None)
        if begin_step is not None:      # a sizer that picks one K per step sees the batch's prompts first
            begin_step(step, [prompt_key(ids) for ids in prompts])
        requests = []
        for i, (rec, ids) in enumerate(zip(records, prompts)):
            k = int(self.group_sizer.group_size(step, i))
            if k < 2:
                raise ValueError(f"group size {k} for prompt {i} of step {step}: a group needs at least 2 responses")
            requests.append(RolloutRequest(i, ids, k, self.sampling, request_seed(self.seed, step, i)))
        return BatchPlan(step, requests, {i: rec.answer for i, rec in enumerate(records)})
