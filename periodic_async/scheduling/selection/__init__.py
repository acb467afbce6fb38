"""Selection rules (`rollout.selection`): which prompts of a step get how many rollouts, and which
of their groups are trained. One registered name per rule, one file per rule:

- `none`: the planner's plain batch, every prompt one group of K, every group trained (no rule
  object: scheduling/plan.py `BatchPlanner.plan`);
- `pilot` (pilot.py): pilot-commit allocation, its settings in `rollout.pilot`;
- `backfill` (backfill.py): in-batch replacement of zero-variance groups, settings in
  `rollout.backfill`.

A rule is built by the function registered under its name, `factory(rollout_cfg, batch_size,
group_size, num_prompts)`, and the producer core calls it through the batch's plan
(plan.py: `AllocatedPlan`), the same way in every mode; its contract is the allocator's
(allocation.py, "The producer's contract"):

    batch_size: int                                  training positions per step (B)
    begin_step(step, draw, group_size) -> [AllocRequest]   draw() -> Candidate | None: the loader's next prompt
    on_group(step, slot, phase, rewards) -> Outcome  more requests, groups ready to train, done
    end_step(step) -> {metric: value}
    state_dict() -> JSON-able dict; load_state_dict(state)    saved in checkpoints, between steps

Its state is keyed by step (`step` names the batch every call belongs to). A new rule is one new
file that calls `register_selection("name")` and is imported before the trainer is built (the
built-in ones are imported here); tests/test_matrix.py registers one inside the test and runs it
in every mode.
"""
from __future__ import annotations

from . import backfill, pilot  # noqa: F401 - the built-in rules register themselves
from .registry import SELECTIONS, build_selection, check_selection, register_selection  # noqa: F401
