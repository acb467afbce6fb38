"""Training: trainer.py (build, loop, weight sync, logging), step.py (one batch: micro-batch
stream, PPO epochs, normaliser), feed.py (groups from rank 0 to every rank, DP assignment)."""
