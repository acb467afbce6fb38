"""Experiment-tracking backends for trainer.logger, by name (verl's `trainer.logger` list).

console and jsonl are handled by MetricsLogger itself (the console line is returned to the
caller, metrics.jsonl is the run's record); this registry holds the ones that write elsewhere.
Each backend: __init__(run_dir, project, experiment, config: dict), log(step, scalars), close().
"""
from __future__ import annotations

import importlib.util
import os

from ..errors import ConfigError

LOGGER_NAMES = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
# backend name -> the module it needs (and the extra that installs it)
REQUIRED_MODULE = {"wandb": "wandb", "mlflow": "mlflow"}


def missing_extra(name: str) -> bool:
    module = REQUIRED_MODULE.get(name)
    return module is not None and importlib.util.find_spec(module) is None


def flatten(d: dict, prefix: str = "") -> dict:
    """Nested config dict -> {'a.b.c': value} (wandb config / mlflow params are flat)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


class TensorBoardBackend:
    def __init__(self, run_dir, project, experiment, config, mode=None, tracking_uri=None):
        from torch.utils.tensorboard import SummaryWriter
        self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))

    def log(self, step, scalars):
        for k, v in scalars.items():
            self._tb.add_scalar(k, v, step)

    def close(self):
        self._tb.close()


class WandbBackend:
    def __init__(self, run_dir, project, experiment, config, mode="offline", tracking_uri=None):
        import wandb
        self._run = wandb.init(project=project, name=experiment, dir=run_dir, mode=mode,
                               config=flatten(config), reinit=True)

    def log(self, step, scalars):
        self._run.log(scalars, step=step)

    def close(self):
        import wandb
        self._run.finish()
        # finish() returns before wandb-core has written the run file; teardown waits for the
        # service to flush and exit (the next init starts a new one), so the run is complete on
        # disk and no wandb process outlives the trainer
        wandb.teardown()


class MlflowBackend:
    """An mlflow run (experiment `project`, run name `experiment`) in `tracking_uri` (MetricsLogger's
    default: a file store in run_dir/mlruns): the flattened config as params, every scalar as a metric at its step.
    One log_batch call per step (the file store writes a file per call)."""
    _BATCH = 100     # mlflow's cap on params per log_batch (metrics: 1000)

    def __init__(self, run_dir, project, experiment, config, mode=None, tracking_uri=None):
        if str(tracking_uri).startswith("file:"):
            # mlflow 3 refuses its file store unless asked (maintenance mode, a database or a server
            # preferred); it is the one store mlflow-skinny has offline (sqlite needs SQLAlchemy)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient
        from mlflow.entities import Param
        self._client = MlflowClient(tracking_uri)
        exp = self._client.get_experiment_by_name(project)
        exp_id = exp.experiment_id if exp is not None else self._client.create_experiment(project)
        self.run_id = self._client.create_run(exp_id, run_name=experiment).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in flatten(config).items()]   # mlflow caps a value at 6000
        for i in range(0, len(params), self._BATCH):
            self._client.log_batch(self.run_id, params=params[i:i + self._BATCH])

    def log(self, step, scalars):
        import time
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), 1000):
            self._client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def close(self):
        self._client.set_terminated(self.run_id)


BACKENDS = {"tensorboard": TensorBoardBackend, "wandb": WandbBackend, "mlflow": MlflowBackend}


def check_loggers(t) -> None:
    """trainer.logger (checked by the Trainer: config/ is below this layer): known names, the extras they need installed, no clash with trainer.tensorboard."""
    if t.logger is None:
        return
    for name in t.logger:
        if name not in LOGGER_NAMES:
            raise ConfigError(f"trainer.logger: unknown logger '{name}'; allowed: {', '.join(LOGGER_NAMES)}")
        if missing_extra(name):
            how = f"pip install periodic-async[{name}]"
            raise ConfigError(f"trainer.logger: '{name}' is not installed; {how}")
    if "tensorboard" in t.logger and not t.tensorboard:
        raise ConfigError("trainer.tensorboard: false contradicts 'tensorboard' in trainer.logger")
    if t.wandb_mode not in ("offline", "online", "disabled"):
        raise ConfigError(f"trainer.wandb_mode: expected offline | online | disabled, got '{t.wandb_mode}'")
