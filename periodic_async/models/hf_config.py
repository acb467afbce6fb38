"""A Hugging Face model directory's config.json, read and checked in one place (torch-free).

`read_hf_config(path)` is what every reader of a model's config.json calls (models/mcore.py for
the architecture, rollout/vllm_engine.py for the context length): a missing directory or file,
an unreadable one or invalid JSON raises CheckpointError naming the file and the line.
"""
from __future__ import annotations

import json
import os

from ..errors import InputError


class CheckpointError(InputError):
    """A model directory that is missing or cannot be read; the message names the file."""


def read_hf_config(path: str) -> tuple[dict, str]:
    """(the parsed config.json of the model directory `path`, the file's path)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"model.path: {path} is not a directory (expected a Hugging Face model directory)")
    cfg_file = os.path.join(path, "config.json")
    if not os.path.exists(cfg_file):
        raise CheckpointError(f"model.path: {path} has no config.json (expected a Hugging Face model directory)")
    try:
        with open(cfg_file) as f:
            c = json.load(f)
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_file}: cannot be read ({e})") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(c, dict):
        raise CheckpointError(f"{cfg_file}: expected a JSON object, got {type(c).__name__}")
    return c, cfg_file
