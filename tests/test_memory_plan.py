"""The memory plan (periodic_async/memory_plan.py, tools/memory_plan.py) and the trainer's refusal.

- Model state is exact: the plan's policy / master / grads / optimizer / old / ref bytes equal a
  real TriModelActor's `memory_bytes()` on a tiny model (fp32, bf16 on fp32 main weights, bf16
  without them, bf16 frozen models, offloaded frozen models) in-process, and on every rank of TP=2
  and PP=2 layouts (torchrun, 2 gloo processes: sharding, replicated norms, the tied embedding's
  copy on the last stage).
- The shipped 910B config fits 64 GiB with plausible numbers; TP=1 for the 7B does not, and the
  refusal names the biggest item; a vLLM worker whose share cannot hold its weights is refused.
- The trainer refuses a config that does not fit before it starts or writes anything, when the
  backend reports a device memory (the cpu backend reports none and checks nothing).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from helpers import make_hf_model_dir
from test_tensor_parallel import _run_torchrun

REPO = Path(__file__).resolve().parents[1]
CONFIG_910B = str(REPO / "configs" / "qwen2.5-7b-910b.yaml")
GiB = 1 << 30


def _cfg(dtype: str = "float32", tp: int = 1, pp: int = 1, **actor):
    """kl_coef 0.1 unless given: a reference model is built (kl_coef 0 builds none)."""
    from periodic_async.config import ActorConfig, Config, ModelConfig, ParallelConfig
    actor = {"kl_coef": 0.1, **actor}
    return Config(model=ModelConfig(dtype=dtype), parallel=ParallelConfig(tp, pp), actor=ActorConfig(**actor))


def _planned_state(cfg, arch, stage: int = 0) -> dict[str, int]:
    """The model-state items of the plan's trainer device of `stage`, keyed like memory_bytes()."""
    from periodic_async.memory_plan import MODEL_STATE_KEYS, plan_memory
    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    plan = plan_memory(cfg, arch, world_size=tp * pp)
    return {i.key: i.nbytes for i in plan.devices[stage].items if i.key in MODEL_STATE_KEYS}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("memplan")
    return {"qwen2-tied": make_hf_model_dir(root / "qwen", arch="qwen2", tied=True),
            "llama-untied": make_hf_model_dir(root / "llama", arch="llama", tied=False, seed=1)}


@pytest.mark.parametrize("dtype,actor", [
    ("float32", {}),
    ("float32", {"ppo_epochs": 2, "frozen_dtype": "bfloat16", "old_logp_shortcut": False}),
    ("bfloat16", {}),                                # fp32 main weights (the default)
    ("bfloat16", {"ppo_epochs": 2}),
    ("bfloat16", {"fp32_master_weights": False}),
    ("float32", {"ppo_epochs": 2, "offload_frozen": True}),
    ("float32", {"kl_coef": 0.0}),                   # no reference model
], ids=["fp32", "fp32-old-bf16-frozen", "bf16-master", "bf16-master-old", "bf16-no-master", "fp32-offload",
        "fp32-no-kl"])
@pytest.mark.parametrize("case", ["qwen2-tied", "llama-untied"])
def test_model_state_equals_the_actors_memory_bytes(case, dtype, actor, tiny_dirs, megatron_tp1):
    from periodic_async.actor.tri_model import TriModelActor
    from periodic_async.models.mcore import arch_from_hf_dir
    cfg = _cfg(dtype, **actor)
    arch = arch_from_hf_dir(tiny_dirs[case])
    eng = TriModelActor(cfg.actor, arch, tiny_dirs[case], dtype, with_reference=cfg.actor.uses_reference)
    assert _planned_state(cfg, arch) == eng.memory_bytes()


def test_stage_param_numel_equals_a_built_model(tiny_dirs, megatron_tp1):
    from periodic_async.memory_plan import stage_param_numel
    from periodic_async.models.mcore import arch_from_hf_dir, build_gpt_model
    for case, path in tiny_dirs.items():
        arch = arch_from_hf_dir(path)
        params = list(build_gpt_model(arch, "bfloat16").parameters())
        assert stage_param_numel(arch) == (sum(p.numel() for p in params),
                                           sum(p.numel() for p in params if p.dtype.itemsize == 4)), case


def test_sharded_model_state_equals_every_ranks_memory_bytes(tiny_dirs, tmp_path):
    """TP=2 and PP=2 (bf16 on fp32 main weights, old + reference built): each rank's plan equals
    its actor's memory_bytes(); the tied qwen2 case puts an output-layer copy on the last stage."""
    from periodic_async.models.mcore import arch_from_hf_dir
    out = tmp_path / "bytes.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "tests" / "dist_memory_plan_worker.py"), "--out", str(out)]
    for name, path in tiny_dirs.items():
        cmd += ["--case", name, path]
    _run_torchrun(cmd)
    got = json.loads(out.read_text())
    for layout, (tp, pp) in {"tp2": (2, 1), "pp2": (1, 2)}.items():
        for case, ranks in got[layout].items():
            arch = arch_from_hf_dir(tiny_dirs[case])
            for r in ranks:
                cfg = _cfg("bfloat16", tp, pp, ppo_epochs=2)
                assert _planned_state(cfg, arch, r["stage"]) == r["bytes"], (layout, case, r["stage"])
            assert sorted(r["stage"] for r in ranks) == sorted(range(pp)) * tp


def _load(overrides=()):
    from periodic_async.config import load_config
    from periodic_async.memory_plan import resolve_arch
    cfg = load_config(CONFIG_910B, list(overrides))
    arch, source = resolve_arch(cfg)
    return cfg, arch, source


def test_910b_config_fits_64gib_with_plausible_numbers():
    from periodic_async.memory_plan import plan_memory
    cfg, arch, source = _load()
    if not os.path.isdir(cfg.model.path):
        assert "built-in table" in source and "Qwen2.5-7B-Instruct" in source
    plan = plan_memory(cfg, arch, 64 * GiB, world_size=4)
    assert plan.fits and plan.checked, plan.format()
    trainer, workers = plan.devices
    b = {i.key: i.nbytes for i in trainer.items}
    # 7.62e9 parameters, bf16, sharded 4 ways (the two 152064 x 3584 vocabulary matrices too)
    assert abs(b["policy"] - 7.62e9 * 2 / 4) / b["policy"] < 0.01
    assert b["master"] == pytest.approx(2 * b["policy"], rel=1e-3) and b["optimizer"] == 2 * b["grads"]
    assert b["old"] == 0 and b["ref"] == b["policy"]          # ppo_epochs 1: no old model
    assert 30 * GiB < trainer.peak < 60 * GiB
    w = {i.key: i.nbytes for i in workers.items}
    assert abs(w["rollout_weights"] - 7.62e9 * 2) / w["rollout_weights"] < 0.01
    assert workers.limit == int(0.9 * 64 * GiB) and workers.devices == "npu 4-7"


def test_a_config_that_cannot_fit_is_refused_naming_the_biggest_item():
    from periodic_async.config import ConfigError
    from periodic_async.memory_plan import plan_memory
    cfg, arch, _ = _load(["parallel.tensor_model_parallel_size=1"])
    plan = plan_memory(cfg, arch, 64 * GiB, world_size=1)
    assert not plan.fits
    dev, item = plan.biggest()
    assert item.key == "optimizer" and dev.name == "trainer rank 0"
    with pytest.raises(ConfigError, match=r"does not fit.*biggest item: optimizer state .* 56\.\d\d GiB.*"
                                          r"tensor_model_parallel_size"):
        plan.check()

    # a vLLM worker whose share of the device cannot hold its weights
    cfg, arch, _ = _load(["rollout.gpu_memory_utilization=0.2"])
    with pytest.raises(ConfigError, match=r"rollout workers 0-3.*biggest item: rollout weights"):
        plan_memory(cfg, arch, 64 * GiB, world_size=4).check()


def test_tool_prints_the_table_and_exits_by_the_verdict(capsys):
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import memory_plan as tool
    finally:
        sys.path.pop(0)
    assert tool.main(["--config", CONFIG_910B]) == 0
    text = capsys.readouterr().out
    for want in ("trainer ranks 0-3 (npu 0-3)", "optimizer state", "KV cache", "FITS", "estimate", "64.00"):
        assert want in text, want
    assert tool.main(["--config", CONFIG_910B, "parallel.tensor_model_parallel_size=1", "--nproc", "1"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_trainer_refuses_at_start_up_when_the_device_is_too_small(tmp_path, monkeypatch):
    from periodic_async.backend import Backend, get_backend
    from periodic_async.config import ConfigError, load_config
    from periodic_async.train.trainer import Trainer
    assert get_backend("cpu").device_memory_bytes() is None       # cpu: nothing is checked
    monkeypatch.setattr(Backend, "device_memory_bytes", lambda self, index=0: 1 << 20)
    run_dir = tmp_path / "run"
    cfg = load_config(None, [f"trainer.run_dir={run_dir}", "trainer.mode=sync"])
    with pytest.raises(ConfigError, match=r"memory plan: the config does not fit: trainer rank 0 .*biggest item"):
        Trainer(cfg)
    assert not run_dir.exists()          # refused before anything was written or built


def test_adaptive_group_size_is_planned_at_its_worst_k():
    """Under rollout.group_sizing: sagc a batch may have any candidate K: the shared-prompt
    micro-batch holds the most prompts at the smallest K, and the most micro-batches come at the
    largest, so the plan equals the fixed plans' worst case item by item."""
    from periodic_async.memory_plan import micro_batch_tokens, plan_memory
    cands = "rollout.sagc.candidates=[2,4,16]"
    base = ["actor.shared_prompt=true", "actor.micro_batch_size=4"]
    adaptive, _, _ = _load([*base, "rollout.group_sizing=sagc", cands, "rollout.n=4"])
    at = {k: _load([*base, f"rollout.n={k}"])[0] for k in (2, 4, 16)}
    assert micro_batch_tokens(adaptive) == micro_batch_tokens(at[2]) != micro_batch_tokens(at[16])
    cfg, arch, _ = _load([*base, "rollout.group_sizing=sagc", cands, "rollout.n=4"])
    peak = plan_memory(cfg, arch, 64 * GiB, world_size=4).devices[0].peak
    assert peak >= max(plan_memory(c, arch, 64 * GiB, world_size=4).devices[0].peak for c in at.values())


def test_a_tensor_parallel_rollout_engine_is_planned_per_device():
    """rollout.tensor_parallel_size 2: each of a worker's devices holds half the weights (heads,
    MLP and vocabulary split, norms replicated) and half the KV cache (4 KV heads, 2 per device);
    the workers take num_workers x 2 devices after the trainer's, each with vLLM's share."""
    from periodic_async.memory_plan import plan_memory, stage_param_numel, vllm_shard_numel
    cfg1, arch, _ = _load(["rollout.num_workers=2"])
    cfg2, _, _ = _load(["rollout.num_workers=2", "rollout.tensor_parallel_size=2"])
    assert vllm_shard_numel(arch, 1)[0] == stage_param_numel(arch)[0]      # TP 1: the whole model, as before
    one = plan_memory(cfg1, arch, 64 * GiB, world_size=4).devices[1]
    plan = plan_memory(cfg2, arch, 64 * GiB, world_size=4)
    two = plan.devices[1]
    w1, w2 = ({i.key: i.nbytes for i in d.items} for d in (one, two))
    assert w2["kv_cache"] * 2 == w1["kv_cache"]
    assert w1["rollout_weights"] / 2 < w2["rollout_weights"] < w1["rollout_weights"] / 2 * 1.001   # + replicated norms
    assert (one.devices, one.count) == ("npu 4-5", 2) and (two.devices, two.count) == ("npu 4-7", 4)
    assert two.limit == int(0.9 * 64 * GiB) and "TP 2, 2 devices per worker" in two.name
    assert "8 npu devices on this node (4 trainer + 2 x 2 rollout)" in plan.format()
    # KV heads fewer than TP are replicated (vLLM: at least one per device), not split further
    assert vllm_shard_numel(arch, 8)[1] == arch.head_dim


def test_tensor_parallel_rollout_fits_where_one_device_did_not():
    """Weights that overflow vLLM's share of one device fit once split over two."""
    from periodic_async.memory_plan import plan_memory
    small = ["rollout.gpu_memory_utilization=0.2", "rollout.num_workers=2"]
    cfg, arch, _ = _load(small)
    assert not plan_memory(cfg, arch, 64 * GiB, world_size=4).fits
    cfg, arch, _ = _load([*small, "rollout.tensor_parallel_size=2"])
    plan = plan_memory(cfg, arch, 64 * GiB, world_size=4)
    assert plan.fits, plan.format()
