"""trainer.logger: the backend list, its validation, and that the default keeps today's files."""
import importlib.util
import os

import pytest

from periodic_async.config.sections import Config
from periodic_async.telemetry.tracking_backends import check_loggers as _validate_logger
from periodic_async.errors import ConfigError
from periodic_async.telemetry.logger import MetricsLogger, read_metrics
from periodic_async.telemetry.tracking_backends import flatten

HAS_TB = importlib.util.find_spec("tensorboard") is not None


def test_default_logger_list_writes_todays_files(tmp_path):
    log = MetricsLogger(str(tmp_path), tensorboard=True)
    line = log.log(3, {"actor/pg_loss": 0.5, "note": "x"})
    log.close()
    assert line == "step    3 | pg +0.5000"
    assert read_metrics(str(tmp_path)) == [{"step": 3, "actor/pg_loss": 0.5, "note": "x"}]
    expected = {"metrics.jsonl"} | ({"tensorboard"} if HAS_TB else set())
    assert set(os.listdir(tmp_path)) == expected


def test_explicit_list_without_console_or_tensorboard(tmp_path):
    log = MetricsLogger(str(tmp_path), tensorboard=True, loggers=["jsonl"])
    assert log.log(1, {"actor/pg_loss": 0.25}) is None          # no console line
    log.close()
    assert set(os.listdir(tmp_path)) == {"metrics.jsonl"}
    assert read_metrics(str(tmp_path)) == [{"step": 1, "actor/pg_loss": 0.25}]


def test_unknown_logger_name_is_refused_with_the_key():
    t = Config().trainer
    t.logger = ["console", "neptune"]
    with pytest.raises(ConfigError, match=r"^trainer\.logger: unknown logger 'neptune'; allowed: console, jsonl"):
        _validate_logger(t)


@pytest.mark.parametrize("name, how", [("wandb", r"pip install periodic-async\[wandb\]"),
                                       ("mlflow", r"pip install periodic-async\[mlflow\]")])
def test_missing_extra_names_the_pip_extra(name, how, monkeypatch):
    # both extras are installed in the test venv: hide the one under test
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m == name else real(m, *a))
    t = Config().trainer
    t.logger = ["console", name]
    with pytest.raises(ConfigError, match=rf"trainer.logger: '{name}' is not installed; {how}"):
        _validate_logger(t)


def test_tensorboard_contradiction_names_the_key():
    t = Config().trainer
    t.logger, t.tensorboard = ["tensorboard"], False
    with pytest.raises(ConfigError, match=r"^trainer\.tensorboard:"):
        _validate_logger(t)


def test_flatten_nested_config():
    assert flatten({"a": {"b": 1, "c": {"d": "x"}}, "e": [1, 2]}) == {"a.b": 1, "a.c.d": "x", "e": [1, 2]}


def test_logger_key_loads_from_a_config_dict():
    from periodic_async.config.loading import config_from_dict
    assert config_from_dict({"trainer": {"logger": ["console", "jsonl"]}}).trainer.logger == ("console", "jsonl")
    assert config_from_dict({}).trainer.logger is None


def test_wandb_offline_run_holds_the_jsonl_metrics_and_the_config(tmp_path):
    # no importorskip: run.sh installs the wandb extra into the test venv, so CI runs this.
    import glob
    import json
    from wandb_records import history_and_config
    log = MetricsLogger(str(tmp_path / "proj" / "exp1"), loggers=["jsonl", "wandb"],
                        config={"actor": {"lr": 0.001}}, wandb_mode="offline")
    log.log(1, {"actor/pg_loss": 0.5, "note": "x"})
    log.log(2, {"actor/pg_loss": 0.25})
    log.close()
    run_dir = tmp_path / "proj" / "exp1"
    [path] = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    history, config = history_and_config(path)
    jsonl = read_metrics(str(run_dir))
    assert [(int(h["_step"]), float(h["actor/pg_loss"])) for h in history] == \
        [(r["step"], r["actor/pg_loss"]) for r in jsonl] == [(1, 0.5), (2, 0.25)]
    assert json.loads(config["actor.lr"]) == 0.001


def _mlflow_run(store):
    """The one mlflow run in a file store, read back by mlflow's own client."""
    from mlflow.tracking import MlflowClient
    client = MlflowClient("file://" + str(store))
    [exp] = [e for e in client.search_experiments() if e.name != "Default"]
    [run] = client.search_runs([exp.experiment_id])
    return client, exp, run


def test_mlflow_file_store_holds_the_jsonl_metrics_and_the_config(tmp_path):
    # no importorskip: run.sh installs the mlflow extra into the test venv, so CI runs this.
    run_dir = tmp_path / "proj" / "exp1"
    log = MetricsLogger(str(run_dir), loggers=["jsonl", "mlflow"],
                        config={"actor": {"lr": 0.001}, "trainer": {"logger": ["jsonl", "mlflow"]}})
    log.log(1, {"actor/pg_loss": 0.5, "note": "x"})
    log.log(2, {"actor/pg_loss": 0.25})
    log.close()
    client, exp, run = _mlflow_run(run_dir / "mlruns")
    assert exp.name == "proj" and run.info.run_name == "exp1" and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "actor/pg_loss")
    assert [(m.step, m.value) for m in history] == \
        [(r["step"], r["actor/pg_loss"]) for r in read_metrics(str(run_dir))] == [(1, 0.5), (2, 0.25)]
    assert "note" not in run.data.metrics        # strings are not metrics
    assert run.data.params["actor.lr"] == "0.001"


def test_a_training_run_with_wandb_logs_every_step_and_leaves_no_process(tmp_path):
    """Through the Trainer (sync, 2 steps), wandb and mlflow together: the offline wandb run and the
    mlflow file store hold each step's critic/score/mean as metrics.jsonl has it and the resolved
    config; no wandb process outlives the run."""
    import glob
    import subprocess
    from wandb_records import history_and_config
    from periodic_async.config import load_config
    from periodic_async.train.trainer import Trainer
    run_dir = tmp_path / "run"
    Trainer(load_config("configs/default.yaml", [
        f"trainer.run_dir={run_dir}", "trainer.mode=sync", "trainer.total_steps=2", "trainer.progress_bar=false",
        "trainer.save_final=false", "trainer.logger=[console, jsonl, wandb, mlflow]"])).fit()
    [path] = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    history, config = history_and_config(path)
    jsonl = read_metrics(str(run_dir))
    assert [float(h["critic/score/mean"]) for h in history] == [r["critic/score/mean"] for r in jsonl]
    assert len(jsonl) == 2 and "actor.lr" in config
    client, _, run = _mlflow_run(run_dir / "mlruns")
    scores = client.get_metric_history(run.info.run_id, "critic/score/mean")
    assert [(m.step, m.value) for m in scores] == [(r["step"], r["critic/score/mean"]) for r in jsonl]
    assert set(run.data.metrics) == {k for r in jsonl for k, v in r.items()
                                     if k != "step" and isinstance(v, (int, float))}
    assert run.data.params["actor.lr"] == "0.001"
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(run_dir) not in ps
