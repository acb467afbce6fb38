"""`rollout.selection: pilot`: pilot-commit allocation (scheduling/allocation.py, pilot_commit.py;
docs/allocation.md), configured by `rollout.pilot`."""
from __future__ import annotations

import dataclasses

from ..allocation import Allocator, BackfillConfig
from .registry import register_selection


@register_selection("pilot")
def pilot_commit(rollout_cfg, batch_size: int, group_size: int, num_prompts: int, max_staleness: int = 0) -> Allocator:
    # eta bounds how old a reused pilot may be (rollout.pilot.reuse_pilots)
    return Allocator(dataclasses.replace(rollout_cfg.pilot, enabled=True), BackfillConfig(), batch_size, group_size,
                     num_prompts=num_prompts, max_staleness=max_staleness)
