"""The record every prompt source yields, and the error every reader raises."""
from __future__ import annotations

from dataclasses import dataclass

from periodic_async.errors import InputError


class DatasetError(InputError):
    """A dataset that cannot be read; the message names the file and the line or row at fault."""


@dataclass
class PromptRecord:
    prompt: str
    answer: str
    index: int  # 0-based position of the row in its source
    max_new_tokens: int | None = None   # this prompt's own generation budget (data.max_new_tokens_key)
