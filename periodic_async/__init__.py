"""periodic-async: RL post-training (GRPO) with periodic asynchrony, strictly on-policy."""
__version__ = "0.1.0"
