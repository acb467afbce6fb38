"""The metrics logger: one JSONL record per step, TensorBoard when installed, a console line;
trainer.logger picks the backends by name (telemetry/tracking_backends.py adds wandb / mlflow)."""
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
                 resume_after_step: Optional[int] = None, loggers: Optional[list] = None,
                 project: Optional[str] = None, experiment: Optional[str] = None,
                 config: Optional[dict] = None, wandb_mode: str = "offline",
                 mlflow_tracking_uri: Optional[str] = None):
        """loggers: trainer.logger's names; None is today's set (console, jsonl, tensorboard when
        `tensorboard` and installed). resume_after_step: a resumed run keeps the records of steps up to this one (the
        checkpoint's) and drops later ones, which the resumed run writes again."""
        self.enabled = enabled
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._backends = []
        self._console = loggers is None or "console" in loggers
        self._jsonl = loggers is None or "jsonl" in loggers
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
        from .tracking_backends import BACKENDS
        if loggers is None:
            if tensorboard:
                try:
                    self._backends.append(BACKENDS["tensorboard"](run_dir, None, None, {}))
                except ImportError:   # tensorboard is an optional extra
                    pass
            return
        abs_dir = os.path.abspath(run_dir)
        project = project or os.path.basename(os.path.dirname(abs_dir)) or "periodic-async"
        experiment = experiment or os.path.basename(abs_dir)
        uri = mlflow_tracking_uri or "file://" + os.path.join(abs_dir, "mlruns")
        try:
            for name in loggers:
                if name in BACKENDS:
                    self._backends.append(BACKENDS[name](run_dir, project, experiment, config or {},
                                                         mode=wandb_mode, tracking_uri=uri))
        except BaseException:
            self.close()      # the backends already started (a wandb service process) end too
            raise

    def log(self, step: int, metrics: dict) -> Optional[str]:
        """Write the record; returns the console line (the caller prints it beside its progress bar)."""
        if not self.enabled:
            return None
        record = {"step": step, **{k: (v if isinstance(v, (int, float)) and math.isfinite(v) else str(v))
                                   for k, v in metrics.items()}}
        if self._jsonl:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        for backend in self._backends:
            backend.log(step, scalars)
        return format_console(step, metrics) if self._console else None

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            backends, self._backends = self._backends, []
            for backend in backends:
                backend.close()


def read_metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]
