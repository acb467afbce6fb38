"""The built-in verifiable task for the embedded CPU run.

It has to be learnable by RL from random initialisation within a few minutes on 2 cores (`a+b=`
is not: a tiny random-init model only learns its format in 300 GRPO steps), so the answer is a
simple function of ONE visible prompt token:

- next_digit: prompt "4719=" -> answer "0" (the last digit plus one, mod 10).
- copy_last:  prompt "4719=" -> answer "9".
- sum_mod10:  prompt "4719=" -> answer "1" ((4+7+1+9) mod 10; harder, for longer runs).

Rewards (reward/synthetic.py) give partial credit for a digit, so the format is
learnt first and the mapping after it.
"""
from __future__ import annotations

import numpy as np

from ..config import SyntheticTaskConfig
from .records import PromptRecord

TASKS = ("next_digit", "copy_last", "sum_mod10")


def answer_for(task: str, digits: str) -> str:
    if task == "next_digit":
        return str((int(digits[-1]) + 1) % 10)
    if task == "copy_last":
        return digits[-1]
    if task == "sum_mod10":
        return str(sum(int(c) for c in digits) % 10)
    raise ValueError(f"data.synthetic.task: unknown '{task}'; allowed: {', '.join(TASKS)}")


def make_records(cfg: SyntheticTaskConfig, seed: int):
    """`cfg.size` prompts of `cfg.num_digits` random digits each, deterministic in `seed`."""
    if cfg.task not in TASKS:
        raise ValueError(f"data.synthetic.task: unknown '{cfg.task}'; allowed: {', '.join(TASKS)}")
    if cfg.num_digits < 1 or cfg.size < 1:
        raise ValueError("data.synthetic: num_digits and size must be >= 1")
    rng = np.random.default_rng(seed)
    digits = rng.integers(0, 10, size=(cfg.size, cfg.num_digits))
    records = []
    for i, row in enumerate(digits):
        s = "".join(str(d) for d in row)
        records.append(PromptRecord(prompt=s + "=", answer=answer_for(cfg.task, s), index=i))
    return records
