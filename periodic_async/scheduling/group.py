"""A group: one prompt, its K responses, their rewards and advantages - the unit the queue carries."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..rollout.base import RolloutResult


@dataclass
class Group:
    group_index: int
    prompt_ids: list[int]
    answer: str
    results: list[RolloutResult]             # K of them (K = this group's size), sorted by sample_index
    rewards: list[float] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    # each response's soft overlong penalty, already added to its reward (reward.overlong_buffer);
    # empty when off
    overlong_penalties: list[float] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.results)

    @property
    def policy_versions(self) -> list[int]:
        """The version that generated each response (the staleness rule judges them)."""
        return [r.policy_version for r in self.results]
