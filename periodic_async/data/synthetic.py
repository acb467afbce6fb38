"""The built-in verifiable task for the embedded CPU run.

It has to be learnable by RL from random initialisation within a few minutes on 2 cores (`a+b=`
is not: a tiny random-init model only learns its format in 300 GRPO steps), so the answer is a
simple function of ONE visible prompt token:

- next_digit: prompt "4719=" -> answer "0" (the last digit plus one, mod 10).
- copy_last:  prompt "4719=" -> answer "9".
- sum_mod10:  prompt "4719=" -> answer "1" ((4+7+1+9) mod 10; harder, for longer runs).
- long_tail:  prompt "***:7=" -> answer "777" (the digit, once per star). Long-tailed answer
  lengths, for benchmarks where response lengths matter (stragglers, pilot selection): the star
  count n is drawn from a truncated power law, P(n) ~ n ** -long_tail_alpha on 1..long_tail_max
  (defaults 1.5 and 40: p50 2, p90 ~13, p99 ~35 tokens, mean ~5; `long_tail_length_pmf`). The
  digit is the easy part (the token just before "=", as in copy_last); stopping after exactly n
  digits means comparing two counts, which is easy for n = 1, 2 and hard for n = 30, so per-prompt
  success rates spread out and a policy that has not learnt to stop runs long. num_digits is not
  used; prompts are n + 3 characters long, so data.max_prompt_length must be >= long_tail_max + 3.
- countdown:  prompt "c-g=" -> answer "gfedc" (the alphabet backwards from the letter before "="
  down to the first one). The answer length n = first - second + 1 is drawn from the same truncated power law
  (long_tail_max <= 26), so lengths are long-tailed and set by the prompt; every step is one local
  rule (the first letter is the one before "=", as in copy_last; then the previous letter minus one)
  and the stop is one comparison with the prompt's first letter,
  and the rules of short answers are the ends of the long ones, so short prompts are solved first
  and teach the long ones: difficulty grows with n. For the allocation and group-sizing
  benchmarks, with the binary reward `reward.name: exact` (configs/countdown.yaml). Its letters
  extend the tiny model's alphabet (`tiny_alphabet`).
- reverse:    prompt "qzbk=" -> answer "kbzq" (the prompt's letters backwards). n distinct random
  letters, n from the same truncated power law (long_tail_max <= 26), so lengths are long-tailed
  and set by the prompt. Unlike countdown (351 distinct prompts, the one-letter ones never seen when
  held out), prompts are almost never repeated, so held-out accuracy measures the rule: copy the
  letter n - i positions back from "=" - one attention pattern, exact for short runs and harder as
  n grows. For the allocation benchmarks from a warm start (configs/reverse_warm.yaml), with
  `reward.name: exact`.

Rewards (reward/synthetic.py) give partial credit for a digit, so the format is
learnt first and the mapping after it (long_tail: also for the share of the answer matched).
"""
from __future__ import annotations

import numpy as np

from ..config import SyntheticTaskConfig
from ..config.validation import SYNTHETIC_TASKS
from ..models.tokenizer import DEFAULT_ALPHABET
from .records import PromptRecord

TASKS = SYNTHETIC_TASKS     # the names data.synthetic.task accepts; each is implemented below
LETTERS = "abcdefghijklmnopqrstuvwxyz"
LETTER_TASKS = ("countdown", "reverse")    # answers of letters: the tiny model's alphabet adds them


def tiny_alphabet(data_cfg) -> str:
    """The tiny model's tokenizer alphabet for this data: the default one, plus the letters for
    the countdown task (the other tasks keep today's vocabulary, hence today's models)."""
    if data_cfg.source == "synthetic" and data_cfg.synthetic.task in LETTER_TASKS:
        return DEFAULT_ALPHABET + LETTERS
    return DEFAULT_ALPHABET


def answer_for(task: str, digits: str) -> str:
    """The answer to the prompt `digits` + "=" (long_tail: `digits` is the prompt body, "***:7")."""
    if task == "long_tail":
        return digits[-1] * digits.count("*")
    if task == "countdown":          # "c-g": from g (just before "=") down to c
        last, first = LETTERS.index(digits[0]), LETTERS.index(digits[-1])
        return "".join(LETTERS[i] for i in range(first, last - 1, -1))
    if task == "reverse":            # "qzbk" -> "kbzq"
        return digits[::-1]
    if task == "next_digit":
        return str((int(digits[-1]) + 1) % 10)
    if task == "copy_last":
        return digits[-1]
    if task == "sum_mod10":
        return str(sum(int(c) for c in digits) % 10)
    raise ValueError(f"data.synthetic.task: unknown '{task}'; allowed: {', '.join(TASKS)}")


def long_tail_length_pmf(max_len: int, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """The long_tail task's answer lengths 1..max_len and their probabilities, P(n) ~ n ** -alpha."""
    if max_len < 1 or not alpha >= 0:
        raise ValueError(f"data.synthetic: long_tail_max must be >= 1 and long_tail_alpha >= 0, "
                         f"got {max_len} and {alpha}")
    lengths = np.arange(1, max_len + 1)
    weights = lengths.astype(np.float64) ** -float(alpha)
    return lengths, weights / weights.sum()


def _long_tail_records(cfg: SyntheticTaskConfig, seed: int) -> list[PromptRecord]:
    lengths, probs = long_tail_length_pmf(cfg.long_tail_max, cfg.long_tail_alpha)
    rng = np.random.default_rng(seed)
    digits = rng.integers(0, 10, size=cfg.size)
    counts = rng.choice(lengths, size=cfg.size, p=probs)
    records = []
    for i, (d, n) in enumerate(zip(digits, counts)):
        body = "*" * int(n) + f":{d}"
        records.append(PromptRecord(prompt=body + "=", answer=answer_for("long_tail", body), index=i))
    return records


def _prompt_set_records(cfg: SyntheticTaskConfig, seed: int, task: str, body_of_length) -> list[PromptRecord]:
    """Records whose answer length n is drawn from the long_tail power law and whose prompt body
    is `body_of_length(rng, n)` (countdown, reverse)."""
    lengths, probs = long_tail_length_pmf(cfg.long_tail_max, cfg.long_tail_alpha)
    rng = np.random.default_rng(seed)
    counts = rng.choice(lengths, size=cfg.size, p=probs)
    records = []
    for i, n in enumerate(counts):
        body = body_of_length(rng, int(n))
        records.append(PromptRecord(prompt=body + "=", answer=answer_for(task, body), index=i))
    return records


def _countdown_body(rng, n: int) -> str:        # "c-g": n = 5 letters, from g down to c
    last = int(rng.integers(0, len(LETTERS) - n + 1))
    return f"{LETTERS[last]}-{LETTERS[last + n - 1]}"


def _reverse_body(rng, n: int) -> str:          # n distinct letters in random order
    return "".join(LETTERS[j] for j in rng.permutation(len(LETTERS))[:n])


def make_records(cfg: SyntheticTaskConfig, seed: int):
    """`cfg.size` prompts of `cfg.num_digits` random digits each (long_tail: one digit and its
    star count), deterministic in `seed`."""
    if cfg.task not in TASKS:
        raise ValueError(f"data.synthetic.task: unknown '{cfg.task}'; allowed: {', '.join(TASKS)}")
    if cfg.num_digits < 1 or cfg.size < 1:
        raise ValueError("data.synthetic: num_digits and size must be >= 1")
    if cfg.task == "long_tail":
        return _long_tail_records(cfg, seed)
    if cfg.task == "countdown":
        return _prompt_set_records(cfg, seed, "countdown", _countdown_body)
    if cfg.task == "reverse":
        return _prompt_set_records(cfg, seed, "reverse", _reverse_body)
    rng = np.random.default_rng(seed)
    digits = rng.integers(0, 10, size=(cfg.size, cfg.num_digits))
    records = []
    for i, row in enumerate(digits):
        s = "".join(str(d) for d in row)
        records.append(PromptRecord(prompt=s + "=", answer=answer_for(cfg.task, s), index=i))
    return records
