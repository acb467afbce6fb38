"""One batch's plan: the prompts as rollout requests, each with its own K and seed (torch-free
apart from the request types)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..rollout.base import RolloutRequest, SamplingParams
from .group_sizing import FixedGroupSize


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
    parameters, a seed per prompt from (seed, step, prompt index)."""

    def __init__(self, loader, tokenize: Callable, sampling: SamplingParams, seed: int, group_sizer=None,
                 default_n: int = 8):
        self.loader, self.tokenize, self.sampling, self.seed = loader, tokenize, sampling, seed
        self.group_sizer = group_sizer if group_sizer is not None else FixedGroupSize(default_n)

    def plan(self, step: int) -> BatchPlan:
        records = self.loader.next_batch()
        requests = []
        for i, rec in enumerate(records):
            k = int(self.group_sizer.group_size(step, i))
            if k < 2:
                raise ValueError(f"group size {k} for prompt {i} of step {step}: a group needs at least 2 responses")
            requests.append(RolloutRequest(i, self.tokenize(rec), k, self.sampling, request_seed(self.seed, step, i)))
        return BatchPlan(step, requests, {i: rec.answer for i, rec in enumerate(records)})
