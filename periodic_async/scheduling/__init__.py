"""What is generated when, between the data loader and the trainer.

plan.py (a batch's requests: K per group, seeds), group_sizing.py (K per group), producer.py (the
producer thread that feeds the rollout workers and hands scored groups over), scorer.py (rewards
and advantages of a complete group), group.py (the unit the queue carries), staleness.py (the one
rule that admits a sample for training). Torch-free except where the rollout types are.
"""
