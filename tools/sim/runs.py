"""Run-file I/O: a run directory's timeline.jsonl, metrics.jsonl and config.yaml, its model's shape,
its events by step."""
from __future__ import annotations

import json
import os

from .flops import ModelShape


def read_timeline(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "timeline.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no timeline (run with trainer.record_timeline=true)")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_config(run_dir: str) -> dict:
    import yaml
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return yaml.safe_load(f) or {}


def model_shape_of_run(run_dir: str, config: dict | None = None) -> tuple[ModelShape | None, str]:
    """The run's model: config.json of model.path, of run_dir/model_init (the tiny model), or
    the built-in table (models/known.py) by model.path's name."""
    config = read_config(run_dir) if config is None else config
    path = (config.get("model") or {}).get("path")
    for d in ([path] if path else []) + [os.path.join(run_dir, "model_init")]:
        cj = os.path.join(d, "config.json")
        if os.path.exists(cj):
            with open(cj) as f:
                return ModelShape.from_hf_config(json.load(f)), cj
    if path:
        from periodic_async.models.known import known_hf_config
        known = known_hf_config(path)
        if known is not None:
            return ModelShape.from_hf_config(known[1]), f"built-in {known[0]}"
    return None, "unknown (no config.json found)"


def steps_of(events: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for e in events:
        out.setdefault(e["step"], []).append(e)
    return out


def load_run(run_dir: str) -> dict:
    return {"dir": run_dir, "config": read_config(run_dir), "events": read_timeline(run_dir),
            "metrics": read_metrics(run_dir)}
