"""Rule-based GSM8K reward: 1.0 when the response's final answer equals the gold answer, else 0.0.

Equality is decided by math-verify, so "72", "72.0", "$72" and "\\boxed{72}" all match a gold "72".
math-verify's own timeouts use SIGALRM, which only works in a process's main thread; they are
switched off here (`parsing_timeout=None`, `timeout_seconds=None`) and the RewardManager enforces
the time limit instead by killing the worker process.
"""
from __future__ import annotations

import functools
import re
from typing import Any, Optional

from math_verify import parse, verify

from periodic_async.data.gsm8k_task import ANSWER_MARKER, extract_gsm8k_answer, strip_thousands_commas

# A number with optional sign, thousands groups and decimals: "-3", "1,000", "2.5".
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_BOXED = "\\boxed{"


def _last_boxed(text: str) -> Optional[str]:
    """Contents of the last \\boxed{...}, braces balanced; None if absent or never closed."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(_BOXED)
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_final_answer(response: str) -> str:
    """The model's final answer: the first line after the last '####', else the last \\boxed{},
    else the last number in the response; '' when there is none."""
    if ANSWER_MARKER in response:
        after = response.rsplit(ANSWER_MARKER, 1)[1].strip()
        return strip_thousands_commas(after.splitlines()[0].strip() if after else "")
    boxed = _last_boxed(response)
    if boxed is not None:
        return strip_thousands_commas(boxed.strip())
    numbers = _NUMBER.findall(response)
    return strip_thousands_commas(numbers[-1]) if numbers else ""


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str) -> Any:
    """Gold answers repeat across a GRPO group (n responses per prompt), so their parse is cached."""
    return parse(answer, parsing_timeout=None)


def compute_score(response: str, answer: str) -> float:
    """1.0 if the final answer of `response` equals `answer` per math-verify, else 0.0.

    `answer` is the extracted gold ("72"); a raw GSM8K answer field (solution + '#### 72') is
    accepted too, so a jsonl copy of GSM8K scores correctly without preprocessing.
    """
    if ANSWER_MARKER in answer:
        answer = extract_gsm8k_answer(answer)
    predicted = extract_final_answer(response)
    if not predicted:
        return 0.0
    gold = _parse_gold(answer.strip())
    if not gold:  # math-verify found nothing to parse: fall back to exact text
        return float(predicted.strip() == answer.strip())
    target = parse(predicted, parsing_timeout=None)
    return 1.0 if verify(gold, target, timeout_seconds=None) else 0.0
