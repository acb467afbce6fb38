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

    @property
    def size(self) -> int:
        return len(self.results)

    @property
    def policy_versions(self) -> list[int]:
        """The version that generated each response (the staleness rule judges them)."""
        return [r.policy_version for r in self.results]


def collect_groups(results, prompts: dict[int, tuple[list[int], str]], sizes: dict[int, int]) -> list[Group]:
    """Assemble streamed results into complete groups (in group_index order). Raises if a group is
    incomplete or a sample arrives twice, so nothing is silently lost or double-counted."""
    by_group: dict[int, dict[int, RolloutResult]] = {g: {} for g in prompts}
    for r in results:
        slot = by_group[r.group_index]
        if r.sample_index in slot:
            raise RuntimeError(f"group {r.group_index}: sample {r.sample_index} received twice")
        slot[r.sample_index] = r
    groups = []
    for g, slot in sorted(by_group.items()):
        if len(slot) != sizes[g]:
            raise RuntimeError(f"group {g}: {len(slot)} of {sizes[g]} responses received")
        prompt_ids, answer = prompts[g]
        groups.append(Group(g, prompt_ids, answer, [slot[k] for k in sorted(slot)]))
    return groups
