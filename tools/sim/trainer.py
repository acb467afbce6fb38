"""The trainer's side of one replayed step (train/feed.py, train/step.py): groups to DP ranks as
the trainer assigns them (scheduling/dp_assignment.py, the runtime's rule), each rank packing a
micro-batch whenever micro_batch_size of its samples are pending (or its last group arrived),
starting it at max(previous micro-step's end + handoff_busy_s, the group's arrival +
handoff_wait_s); then the optimizer step (after every rank's last micro-step), post_train_s, and
the weight sync, which ends the step."""
from __future__ import annotations

from dataclasses import dataclass

from periodic_async.scheduling.dp_assignment import assign_groups, micro_batch_due

from .costs import Costs
from .engine import Sample


@dataclass
class TrainReplay:
    opt_start: float
    sync_start: float
    sync_end: float
    train_busy_s: float          # rank 0's micro-steps
    wait_s: float                # rank 0 waiting for groups
    events: list[dict]


def train_step(order: list[int], avail: dict[int, float], samples: dict[int, list[Sample]], sizes: dict[int, int],
               dp: int, train_from: float, costs: Costs, micro_batch_size: int, weight_bytes: float,
               step: int) -> TrainReplay:
    """`order`: the groups (positions) in the order the trainer receives them, `avail[g]` when,
    `samples[g]` its samples (an empty group: a position no group took), `sizes` the K the trainer
    was told up front per position (plan.py: train_sizes; what assign_groups balances);
    `train_from`: when the trainer starts on the step."""
    c = costs
    owner = assign_groups(sizes, dp)
    events: list[dict] = []
    rank_end, train_busy, wait, n_micro = [], 0.0, 0.0, 0
    for r in range(dp):
        free_at, pending = train_from, []
        remaining = sum(1 for gi in owner if owner[gi] == r)
        first = True
        for gi in order:
            if owner[gi] == r:
                remaining -= 1
                pending += samples[gi]
            while micro_batch_due(len(pending), remaining, micro_batch_size):
                mb, pending = pending[:micro_batch_size], pending[micro_batch_size:]
                ready = avail[gi] + c.handoff_wait_s
                start = max(ready, free_at + (0.0 if first else c.handoff_busy_s))
                if r == 0:
                    wait += max(0.0, ready - (free_at + (0.0 if first else c.handoff_busy_s)))
                lens = [s.prompt + s.response for s in mb]
                width = max(lens)
                tok = len(mb) * width if c.pad else sum(lens)
                attn = len(mb) * width * width if c.pad else sum(x * x for x in lens)
                dur = c.micro_step_s + c.token_s * tok + c.attn_s * attn
                end = start + dur
                if r == 0:
                    train_busy += dur
                    events.append({"step": step, "kind": "train", "lane": "trainer", "start": start, "end": end,
                                   "index": n_micro, "sequences": len(mb),
                                   "tokens": sum(lens), "response_tokens": sum(s.response for s in mb),
                                   "padded_tokens": len(mb) * width, "groups": sorted({s.group for s in mb})})
                    n_micro += 1
                free_at, first = end, False
        rank_end.append(free_at)
    opt_start = max(rank_end)
    opt_end = opt_start + c.optimizer_s
    sync_start = opt_end + c.post_train_s
    sync_end = sync_start + c.sync_s + c.sync_byte_s * weight_bytes
    events.append({"step": step, "kind": "optimizer", "lane": "trainer", "start": opt_start, "end": opt_end})
    events.append({"step": step, "kind": "update_weights", "lane": "trainer", "start": sync_start, "end": sync_end})
    return TrainReplay(opt_start, sync_start, sync_end, train_busy + c.optimizer_s, wait, events)
