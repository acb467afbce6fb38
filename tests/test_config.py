"""Config loading and validation: bad input is rejected before any model is built, naming the key."""
import pytest

from periodic_async.config import Config, ConfigError, load_config, parse_override

DEFAULT = "configs/default.yaml"


def test_default_config_loads_and_validates():
    cfg = load_config(DEFAULT).validate(world_size=1)
    assert cfg.backend == "cpu" and cfg.rollout.n == 8 and cfg.data.source == "synthetic"


@pytest.mark.parametrize("path", ["configs/qwen2.5-7b-910b.yaml", "configs/qwen2.5-0.5b-gpu.yaml"])
def test_cluster_configs_load(path):
    cfg = load_config(path)
    # Qwen2.5-7B: 28 heads, 4 kv heads, vocab 152064; Qwen2.5-0.5B: 14 heads, 2 kv heads, vocab 151936.
    dims = {"configs/qwen2.5-7b-910b.yaml": (28, 4, 152064), "configs/qwen2.5-0.5b-gpu.yaml": (14, 2, 151936)}[path]
    tp = cfg.parallel.tensor_model_parallel_size
    cfg.validate(world_size=tp * 4, num_heads=dims[0], num_kv_heads=dims[1], vocab_size=dims[2])


def test_overrides_are_typed():
    cfg = load_config(DEFAULT, ["actor.lr=1e-4", "rollout.n=4", "trainer.run_dir=runs/x", "actor.betas=[0.9, 0.95]"])
    assert cfg.actor.lr == pytest.approx(1e-4) and cfg.rollout.n == 4
    assert cfg.trainer.run_dir == "runs/x" and cfg.actor.betas == (0.9, 0.95)
    assert parse_override("actor.kl_coef=0") == ("actor.kl_coef", 0)


@pytest.mark.parametrize("override, message", [
    ("actor.lrr=1", "actor.lrr: unknown key; allowed under 'actor': "),
    ("bogus=1", "bogus: unknown key"),
    ("actor.lr=fast", "actor.lr: expected a number, got str 'fast'"),
    ("rollout.n=2.5", "rollout.n: expected an integer, got float 2.5"),
    ("trainer.tensorboard=3", "trainer.tensorboard: expected true or false"),
    ("model.tiny=5", "model.tiny: expected a mapping of TinyModelConfig fields"),
])
def test_unknown_keys_and_wrong_types_name_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT, [override])
    assert message in str(e.value)
    assert DEFAULT in str(e.value)   # and the file


def test_unknown_key_in_yaml_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("actor:\n  lr: 1.0e-3\n  clip_ration: 0.2\n")
    with pytest.raises(ConfigError, match=r"c.yaml: actor.clip_ration: unknown key; allowed under 'actor': .*clip_ratio"):
        load_config(str(p))


def test_missing_file_and_bad_override_syntax(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        load_config(str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(None, ["actor.lr"])


@pytest.mark.parametrize("overrides, kwargs, message", [
    (["parallel.tensor_model_parallel_size=3"], dict(num_heads=4, num_kv_heads=4),
     "parallel.tensor_model_parallel_size: 3 does not divide the model's 4 attention heads"),
    (["parallel.tensor_model_parallel_size=4"], dict(num_heads=8, num_kv_heads=2),
     "parallel.tensor_model_parallel_size: 4 exceeds the model's 2 key/value heads"),
    (["parallel.tensor_model_parallel_size=2"], dict(world_size=3),
     "parallel: world size 3 is not divisible by tensor_model_parallel_size * pipeline_model_parallel_size = 2"),
    (["parallel.tensor_model_parallel_size=2"], dict(num_heads=4, num_kv_heads=2, vocab_size=25),
     "does not divide the vocabulary size 25"),
    (["rollout.n=1"], {}, "rollout.n: group size must be >= 2"),
    (["data.train_batch_size=0"], {}, "data.train_batch_size: must be >= 1, got 0"),
    (["backend=tpu"], {}, "backend: 'tpu' is not allowed; allowed: cpu, cuda, npu"),
    (["data.source=jsonl"], {}, "data.path: required when data.source is 'jsonl'"),
    (["reward.name=custom"], {}, "reward.custom_file: required"),
    (["rollout.top_p=0"], {}, "rollout.top_p: must be in (0, 1]"),
    (["actor.kl_type=k9"], {}, "actor.kl_type: 'k9' is not allowed"),
    (["parallel.pipeline_model_parallel_size=3"], dict(world_size=3, num_layers=4),
     "parallel.pipeline_model_parallel_size: 3 does not divide the model's 4 layers"),
    (["data.train_batch_size=6"], dict(world_size=4),
     "data.train_batch_size: 6 prompts cannot be split evenly over 4 data-parallel ranks"),
    (["actor.frozen_dtype=fp8"], {}, "actor.frozen_dtype: 'fp8' is not allowed; allowed: same, bfloat16"),
    (["actor.ppo_epochs=0"], {}, "actor.ppo_epochs: must be >= 1, got 0"),
    (["actor.export_bucket_mb=0"], {}, "actor.export_bucket_mb: must be > 0"),
])
def test_impossible_combinations_rejected(overrides, kwargs, message):
    cfg = load_config(DEFAULT, overrides)
    kwargs.setdefault("world_size", 1)
    with pytest.raises(ConfigError) as e:
        cfg.validate(**kwargs)
    assert message in str(e.value)


def test_cli_reports_config_error_and_builds_nothing(tmp_path, capsys):
    from periodic_async.__main__ import main
    run_dir = tmp_path / "run"
    rc = main(["--config", DEFAULT, "rollout.n=1", f"trainer.run_dir={run_dir}"])
    assert rc == 2
    assert "config error: rollout.n: group size must be >= 2" in capsys.readouterr().err
    assert not run_dir.exists()


def test_dataclass_defaults_validate():
    Config().validate(world_size=1)
