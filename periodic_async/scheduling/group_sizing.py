"""Group size K per prompt, chosen when a batch is planned (torch-free).

Every group carries its own K (RolloutRequest.n, Group.size); nothing downstream assumes a
constant. `FixedGroupSize` is `rollout.n` for every prompt; a sizer is any object with
`group_size(step, group_index) -> int`, so a controller that adapts K per step plugs in here.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FixedGroupSize:
    n: int

    def group_size(self, step: int, group_index: int) -> int:
        return self.n
