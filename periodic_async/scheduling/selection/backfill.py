"""`rollout.selection: backfill`: in-batch replacement of zero-variance groups
(scheduling/allocation.py; docs/allocation.md), configured by `rollout.backfill`."""
from __future__ import annotations

import dataclasses

from ..allocation import Allocator, PilotConfig
from .registry import register_selection


@register_selection("backfill")
def backfill(rollout_cfg, batch_size: int, group_size: int, num_prompts: int) -> Allocator:
    return Allocator(PilotConfig(), dataclasses.replace(rollout_cfg.backfill, enabled=True), batch_size, group_size,
                     num_prompts=num_prompts)
