"""Between rollout and trainer: groups (this issue) and, later, the temporary data generator."""
