"""DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13; verl's reward_model.overlong_buffer):
a length-aware penalty added to a response's reward, so that responses near the generation limit
are discouraged smoothly instead of being cut and scored as if complete."""
from __future__ import annotations


def overlong_penalty(length: int, max_new_tokens: int, buffer_len: int, penalty_factor: float = 1.0) -> float:
    """0 for length <= L - buffer; (L - buffer - length) / buffer * penalty_factor inside the buffer
    (from 0 down to -penalty_factor at length = L); -penalty_factor beyond L (cannot happen when
    the engine stops at L). L = max_new_tokens; buffer_len 0: no penalty."""
    if buffer_len <= 0:
        return 0.0
    start = max_new_tokens - buffer_len
    if length <= start:
        return 0.0
    return max(-1.0, (start - length) / buffer_len) * penalty_factor
