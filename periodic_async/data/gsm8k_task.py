"""GSM8K helpers: gold-answer extraction, prompt formatting and the path of the shipped sample.

The module is named `gsm8k_task` rather than `gsm8k` because the data folder next to it is called
`gsm8k/`: a folder without `__init__.py` loses to a module of the same name today, but gaining an
`__init__.py` later would silently shadow the module, and tools that look the name up as a
resource package would see the folder instead.
"""
from __future__ import annotations

import os
import re

ANSWER_MARKER = "####"
PROMPT_SUFFIX = "\nLet's think step by step and output the final answer after \"####\"."
# data.prompt_template's value for source gsm8k when it is null (data/prompts.py)
PROMPT_TEMPLATE = "{prompt}" + PROMPT_SUFFIX

# A comma between digits groups thousands ("1,000"); any other comma is left alone.
_THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def strip_thousands_commas(text: str) -> str:
    """'1,234,567' -> '1234567' so that the number is read as one value, not a tuple."""
    return _THOUSANDS_COMMA.sub("", text)


def extract_gsm8k_answer(answer_field: str) -> str:
    """The gold answer of a GSM8K `answer` field: the text after the last '####', stripped.

    GSM8K writes its worked solution first and the final number after '####'; a row without the
    marker is malformed, so it raises ValueError rather than guessing.
    """
    if ANSWER_MARKER not in answer_field:
        raise ValueError(f"GSM8K answer has no '{ANSWER_MARKER}' marker: {answer_field[-80:]!r}")
    return strip_thousands_commas(answer_field.rsplit(ANSWER_MARKER, 1)[1].strip())


def format_gsm8k_prompt(question: str) -> str:
    """The question followed by the instruction that makes the model end with '#### <answer>'."""
    return PROMPT_TEMPLATE.format(prompt=question)


def sample_path() -> str:
    """Path of the shipped 200-row sample, found next to this file so it works from any cwd."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "gsm8k", "sample.jsonl")
