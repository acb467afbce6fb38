"""Config loading and validation: bad input is rejected before any model is built, naming the key."""
import subprocess
import sys

import pytest

from periodic_async.config import Config, ConfigError, config_to_dict, load_config, parse_override

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


def test_algo_section_and_policy_loss_load_typed():
    cfg = load_config(DEFAULT, ["algo.adv_estimator=rloo", "algo.norm_adv_by_std_in_grpo=false",
                                "algo.adv_eps=1e-8", "actor.policy_loss=grpo"]).validate(world_size=1)
    assert cfg.algo.adv_estimator == "rloo" and cfg.algo.norm_adv_by_std_in_grpo is False
    assert cfg.algo.adv_eps == pytest.approx(1e-8) and cfg.actor.policy_loss == "grpo"
    assert config_to_dict(cfg)["algo"] == {"adv_estimator": "rloo", "norm_adv_by_std_in_grpo": False,
                                           "adv_eps": pytest.approx(1e-8)}


def test_a_registered_name_is_allowed():
    """The allowed names are the algo registries' keys at validation time, not a fixed list."""
    from periodic_async import algo
    name = "test_config_mean_only"
    algo.register_adv_estimator(name)(lambda rewards, cfg=None: [0.0 for _ in rewards])
    try:
        assert load_config(DEFAULT, [f"algo.adv_estimator={name}"]).validate(world_size=1).algo.adv_estimator == name
    finally:
        del algo.ADV_ESTIMATORS[name]


def test_importing_the_config_is_cheap():
    """`import periodic_async.config` pulls in neither torch nor megatron (checked in a fresh interpreter)."""
    code = ("import sys, periodic_async.config; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_overrides_are_typed():
    cfg = load_config(DEFAULT, ["actor.lr=1e-4", "rollout.n=4", "trainer.run_dir=runs/x", "actor.betas=[0.9, 0.95]"])
    assert cfg.actor.lr == pytest.approx(1e-4) and cfg.rollout.n == 4
    assert cfg.trainer.run_dir == "runs/x" and cfg.actor.betas == (0.9, 0.95)
    assert parse_override("actor.kl_coef=0") == ("actor.kl_coef", 0)
    assert parse_override("actor.lr=1e-3") == ("actor.lr", 1e-3)      # YAML 1.1 alone reads a string
    assert parse_override("model.path=null") == ("model.path", None)
    assert load_config(DEFAULT, ["actor.lr=1"]).actor.lr == 1.0 and isinstance(load_config(DEFAULT).actor.lr, float)


@pytest.mark.parametrize("override, message", [
    ("actor.lrr=1", "actor.lrr: unknown key; allowed under 'actor': "),
    ("bogus=1", "bogus: unknown key"),
    ("actor.lr=fast", "actor.lr: expected a number, got str 'fast'"),
    ("rollout.n=2.5", "rollout.n: expected an integer, got float 2.5"),
    ("trainer.tensorboard=3", "trainer.tensorboard: expected true or false"),
    ("model.tiny=5", "model.tiny: expected a mapping of TinyModelConfig fields"),
    ("actor.betas=0.9", "actor.betas: expected a list of 2 numbers, got float 0.9"),
    ("actor.betas=[0.9, 0.95, 0.99]", "actor.betas: expected a list of 2 numbers"),
    ("actor.betas=[0.9, fast]", "actor.betas[1]: expected a number, got str 'fast'"),
    ("model.path=3", "model.path: expected a string or null, got int 3"),
    ("actor.lr=true", "actor.lr: expected a number, got bool True"),
    ("algo.adv_eps=small", "algo.adv_eps: expected a number"),
    ("algo.norm_adv_by_std_in_grpo=1", "algo.norm_adv_by_std_in_grpo: expected true or false"),
    ("algo.baseline=mean", "algo.baseline: unknown key; allowed under 'algo': adv_eps, adv_estimator, "
     "norm_adv_by_std_in_grpo"),
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
    (["algo.adv_estimator=gae"], {}, "algo.adv_estimator: 'gae' is not allowed; allowed: grpo, rloo"),
    (["actor.policy_loss=dpo"], {}, "actor.policy_loss: 'dpo' is not allowed; allowed: cispo, decoupled_ppo, grpo, gspo"),
    (["algo.adv_eps=0"], {}, "algo.adv_eps: must be > 0, got 0.0"),
    (["rollout.remote_workers=2"], {}, "rollout.remote_workers: workers on other nodes share no memory with the "
                                        "trainer; set rollout.weight_sync: broadcast"),
    (["rollout.remote_workers=1", "rollout.weight_sync=broadcast", "rollout.remote_address=trainer0"], {},
     "rollout.remote_address: expected HOST:PORT, got 'trainer0'"),
    (["rollout.remote_workers=1", "rollout.weight_sync=broadcast", "trainer.mode=sync"], {},
     "rollout.remote_workers: mode 'sync' generates in the trainer process"),
    (["rollout.num_workers=0"], {}, "needs at least one rollout worker (local, or rollout.remote_workers"),
    (["rollout.gpu_memory_utilization=1.5"], {}, "rollout.gpu_memory_utilization: must be in (0, 1], got 1.5"),
])
def test_impossible_combinations_rejected(overrides, kwargs, message):
    cfg = load_config(DEFAULT, overrides)
    kwargs.setdefault("world_size", 1)
    with pytest.raises(ConfigError) as e:
        cfg.validate(**kwargs)
    assert message in str(e.value)


def test_bf16_frozen_old_model_with_the_shortcut_is_refused():
    """frozen_dtype bf16 with ppo_epochs > 1: epoch 1's shortcut would use the policy as old, epochs
    2.. the bf16 copy; allowed once every epoch uses the frozen old model."""
    base = ["actor.frozen_dtype=bfloat16", "actor.ppo_epochs=2"]
    with pytest.raises(ConfigError, match="actor.frozen_dtype: 'bfloat16' with actor.ppo_epochs > 1 needs "
                                          "actor.old_logp_shortcut: false"):
        load_config(DEFAULT, base).validate(world_size=1)
    load_config(DEFAULT, base + ["actor.old_logp_shortcut=false"]).validate(world_size=1)
    load_config(DEFAULT, ["actor.frozen_dtype=bfloat16"]).validate(world_size=1)


def test_cli_reports_config_error_and_builds_nothing(tmp_path, capsys):
    from periodic_async.__main__ import main
    run_dir = tmp_path / "run"
    rc = main(["--config", DEFAULT, "rollout.n=1", f"trainer.run_dir={run_dir}"])
    assert rc == 2
    # the Trainer validates (against the model's dimensions) before it starts or writes anything
    assert "config error: rollout.n: group size must be >= 2" in capsys.readouterr().err
    assert not run_dir.exists()


def test_dataclass_defaults_validate():
    Config().validate(world_size=1)


def test_rollout_ignore_eos_loads_typed():
    assert load_config(DEFAULT).rollout.ignore_eos is False
    assert load_config(DEFAULT, ["rollout.ignore_eos=true"]).validate(world_size=1).rollout.ignore_eos is True



_VLLM_GPU = ["backend=cuda", "rollout.engine=vllm"]


@pytest.mark.parametrize("overrides, kwargs, message", [
    (["rollout.tensor_parallel_size=0"], {}, "rollout.tensor_parallel_size: must be an integer >= 1, got 0"),
    (["backend=cuda", "rollout.tensor_parallel_size=2"], {},
     "rollout.tensor_parallel_size: 2 needs rollout.engine: vllm"),
    (["rollout.engine=vllm", "rollout.tensor_parallel_size=2"], {},
     "rollout.tensor_parallel_size: 2 > 1 needs backend cuda or npu"),
    ([*_VLLM_GPU, "rollout.tensor_parallel_size=2", "rollout.weight_sync=broadcast"], {},
     "rollout.tensor_parallel_size: 2 > 1 needs rollout.weight_sync: shm"),
    ([*_VLLM_GPU, "rollout.tensor_parallel_size=2", "rollout.weight_sync=broadcast", "rollout.remote_workers=1"], {},
     "rollout.tensor_parallel_size: 2 > 1 is not supported with rollout.remote_workers"),
    ([*_VLLM_GPU, "rollout.tensor_parallel_size=3"], dict(num_heads=12, num_kv_heads=2),
     "rollout.tensor_parallel_size: 3 and the model's 2 key/value heads must divide one another"),
    ([*_VLLM_GPU, "rollout.tensor_parallel_size=8"], dict(num_heads=28, num_kv_heads=4),
     "rollout.tensor_parallel_size: 8 does not divide the model's 28 attention heads"),
])
def test_rollout_tensor_parallel_size_is_checked(overrides, kwargs, message):
    cfg = load_config(DEFAULT, overrides)
    with pytest.raises(ConfigError) as e:
        cfg.validate(world_size=1, **kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_rollout_tensor_parallel_and_enforce_eager_load_typed():
    cfg = load_config(DEFAULT)
    assert cfg.rollout.tensor_parallel_size == 1 and cfg.rollout.enforce_eager is None   # null: by backend
    cfg = load_config(DEFAULT, [*_VLLM_GPU, "rollout.tensor_parallel_size=4", "rollout.enforce_eager=false"])
    cfg.validate(world_size=1, num_heads=28, num_kv_heads=4)       # e.g. Qwen2.5-7B: 4 KV heads, one per device
    assert cfg.rollout.tensor_parallel_size == 4 and cfg.rollout.enforce_eager is False
    load_config(DEFAULT, [*_VLLM_GPU, "rollout.tensor_parallel_size=8"]).validate(
        world_size=1, num_heads=64, num_kv_heads=8)               # a 72B-like model: 64 heads, 8 KV heads
    with pytest.raises(ConfigError, match="rollout.enforce_eager: expected true or false or null, got str 'yes please'"):
        load_config(DEFAULT, ["rollout.enforce_eager=yes please"])
    with pytest.raises(ConfigError, match="rollout.tensor_parallel_size: expected an integer, got float 1.5"):
        load_config(DEFAULT, ["rollout.tensor_parallel_size=1.5"])


@pytest.mark.parametrize("override, message", [
    ("data.synthetic.num_digits=0", "data.synthetic.num_digits: must be >= 1, got 0"),
    ("data.synthetic.size=0", "data.synthetic.size: must be >= 1, got 0"),
])
def test_synthetic_task_sizes_are_validated(override, message):
    """data/synthetic.py refuses them too, but only once the records are built: the config check
    stops the run first, naming the key."""
    with pytest.raises(ConfigError, match=message):
        load_config("configs/default.yaml", [override]).validate(world_size=1)


def test_compile_decode_is_refused_where_it_cannot_run():
    with pytest.raises(ConfigError, match="rollout.compile_decode: compiles the hf engine's decode step; rollout.engine is 'vllm'"):
        load_config(DEFAULT, ["rollout.compile_decode=true", "rollout.engine=vllm"]).validate(world_size=1)
    with pytest.raises(ConfigError, match="rollout.compile_decode: not on npu"):
        load_config(DEFAULT, ["rollout.compile_decode=true", "backend=npu"]).validate(world_size=1)
    load_config(DEFAULT, ["rollout.compile_decode=true"]).validate(world_size=1)
