"""The metrics logger: one JSONL record per step, TensorBoard when installed, a console line."""
from __future__ import annotations

import json
import math
import os
from typing import Optional

# The console line shows these, in this order, when present.
CONSOLE_KEYS = [
    ("critic/score/mean", "score", "{:.3f}"),
    ("actor/pg_loss", "pg", "{:+.4f}"),
    ("actor/kl_loss", "kl", "{:.4f}"),
    ("actor/entropy", "ent", "{:.3f}"),
    ("actor/grad_norm", "gnorm", "{:.3f}"),
    ("response_length/mean", "len", "{:.2f}"),
    ("timing_s/step", "step_s", "{:.2f}"),
    ("perf/throughput", "tok/s/dev", "{:.0f}"),
]


def format_console(step: int, metrics: dict) -> str:
    parts = [f"step {step:4d}"]
    for key, short, fmt in CONSOLE_KEYS:
        if key in metrics:
            parts.append(f"{short} {fmt.format(metrics[key])}")
    return " | ".join(parts)


class MetricsLogger:
    def __init__(self, run_dir: str, tensorboard: bool = True, enabled: bool = True,
                 resume_after_step: Optional[int] = None):
        """resume_after_step: a resumed run keeps the records of steps up to this one (the
        checkpoint's) and drops later ones, which the resumed run writes again."""
        self.enabled = enabled
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._tb = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        kept = []
        if resume_after_step is not None and os.path.exists(self.path):
            with open(self.path) as f:
                for line in f:
                    try:
                        if json.loads(line)["step"] <= resume_after_step:
                            kept.append(line if line.endswith("\n") else line + "\n")
                    except (ValueError, KeyError):
                        break          # a line cut by the kill: everything after it is gone too
        self._file = open(self.path, "w")
        self._file.writelines(kept)
        self._file.flush()
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
            except ImportError:   # tensorboard is an optional extra
                self._tb = None

    def log(self, step: int, metrics: dict) -> Optional[str]:
        """Write the record; returns the console line (the caller prints it beside its progress bar)."""
        if not self.enabled:
            return None
        record = {"step": step, **{k: (v if isinstance(v, (int, float)) and math.isfinite(v) else str(v))
                                   for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)
        return format_console(step, metrics)

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            if self._tb is not None:
                self._tb.close()


def read_metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]
