"""Rewards: manager.py (scoring in worker processes with per-item timeouts), synthetic.py and
gsm8k.py (the built-in reward functions)."""
