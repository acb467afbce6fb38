"""The scheduling simulator behind tools/simulate.py (and the FLOP formulas and run readers of
tools/profile_run.py): a torch-free replay of a training step's scheduling with stage costs
instead of models, calibrated on measured runs or derived from hardware assumptions.

Not part of the runtime (periodic_async never imports it); it imports the runtime's torch-free
rules and plug-ins where the runtime has one: rollout/dispatch.py (which worker gets a request),
scheduling/dp_assignment.py (which DP rank trains a group, when it packs a micro-batch),
scheduling/staleness.py and mode.py (when a batch may be dispatched, when groups are released),
scheduling/group_sizing.py (SAGC) and scheduling/allocation.py (pilot-commit, backfill).
Imported as `sim` with tools/ on sys.path, as the scripts in tools/ have it.

flops.py        model shape and FLOPs of generation and training
lengths.py      response / prompt length distributions (--lengths specs)
costs.py        the cost model (GenCosts, Costs), the cluster and the workload
engine.py       one engine's continuous batching (the incremental engine model), steppable (LiveEngine)
engine_reprefill.py  the retired reprefill engine model (hf_engine.py up to bc37220)
pipeline.py     the event-driven producer replay over batches (dispatch by the staleness rule, polls,
                one reward call per poll, release, the trainer, weights)
planner.py      batch plans with the runtime's plug-ins (group sizer, allocator), simulated prompts
trainer.py      the trainer's side of a step (DP ranks, micro-batches, optimizer, weight sync)
replay.py       replay_step (one batch), simulate() (every mode, async and the plug-ins)
runs.py         run-file I/O: timeline.jsonl, metrics.jsonl, config.yaml, the model's shape
nnls.py         non-negative least squares
calibration.py  costs fitted on measured runs, predictions from a calibration
projection.py   costs from hardware assumptions (Hardware, costs_from_hardware)
"""
