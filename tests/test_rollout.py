"""The HF rollout engine: greedy equals transformers' generate, seeded sampling does not depend on
batching, rollout log-probs equal the trainer's, and weight updates take effect."""
import pytest
import torch
from transformers import Qwen2ForCausalLM

from periodic_async.backend import get_backend
from periodic_async.config import ActorConfig, TinyModelConfig
from periodic_async.actor.tri_model import TriModelActor
from periodic_async.actor.packing import TrainSample, pack_unshared
from periodic_async.models.mcore import arch_from_hf_dir
from periodic_async.models.tiny import tiny_hf_config
from periodic_async.models.tokenizer import build_char_tokenizer, mark_char_tokenizer
from periodic_async.rollout.base import RolloutRequest, SamplingParams
from periodic_async.rollout.hf_engine import HFRolloutEngine


def _model_dir(path, seed):
    """A tiny Qwen2 with a large init (logits far from uniform, so greedy has no near-ties)."""
    tok = build_char_tokenizer()
    cfg = tiny_hf_config(TinyModelConfig(), len(tok), tok.eos_token_id, tok.pad_token_id)
    cfg.initializer_range = 0.3
    torch.manual_seed(seed)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    mark_char_tokenizer(path)
    return str(path), tok


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return _model_dir(tmp_path_factory.mktemp("m"), seed=0)


def _engine(path, tok, mbs=256):
    return HFRolloutEngine(path, tok.pad_token_id, tok.eos_token_id, max_slots=mbs)


PROMPTS = ["4719=", "12=", "9=", "30571="]


def _requests(tok, sp, prompts=PROMPTS, n=1, seed=7):
    return [RolloutRequest(i, tok(p, add_special_tokens=False).input_ids, n, sp, seed + i)
            for i, p in enumerate(prompts)]


def test_greedy_equals_transformers_generate(model):
    path, tok = model
    engine = _engine(path, tok)
    sp = SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=(tok.eos_token_id,))
    results = sorted(engine.generate(_requests(tok, sp)), key=lambda r: r.group_index)
    hf = Qwen2ForCausalLM.from_pretrained(path).eval()
    for r in results:
        ids = torch.tensor([r.prompt_ids])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
        if tok.eos_token_id in ref:
            ref = ref[:ref.index(tok.eos_token_id) + 1]
        assert r.response_ids == ref
        assert r.finish_reason == ("stop" if ref[-1] == tok.eos_token_id else "length")
        assert len(r.logprobs) == len(r.response_ids) and all(lp <= 0 for lp in r.logprobs)


def test_seeded_sampling_does_not_depend_on_batching(model):
    path, tok = model
    sp = SamplingParams(temperature=1.0, max_new_tokens=5, stop_token_ids=(tok.eos_token_id,))
    key = lambda r: (r.group_index, r.sample_index)
    together = {key(r): r.response_ids for r in _engine(path, tok).generate(_requests(tok, sp, n=4))}
    small_batches = {key(r): r.response_ids for r in _engine(path, tok, mbs=3).generate(_requests(tok, sp, n=4))}
    alone = {key(r): r.response_ids for r in _engine(path, tok).generate(_requests(tok, sp, PROMPTS[:1], n=4))}
    assert together == small_batches
    assert {k: v for k, v in together.items() if k[0] == 0} == alone
    assert len({tuple(v) for v in together.values()}) > 4     # samples differ from each other
    other_seed = {key(r): r.response_ids for r in _engine(path, tok).generate(_requests(tok, sp, n=4, seed=99))}
    assert other_seed != together


def test_top_k_one_is_greedy(model):
    path, tok = model
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4)
    topk1 = SamplingParams(temperature=0.7, top_k=1, max_new_tokens=4)
    a = [r.response_ids for r in _engine(path, tok).generate(_requests(tok, greedy))]
    b = [r.response_ids for r in _engine(path, tok).generate(_requests(tok, topk1))]
    assert a == b


def test_rollout_logprobs_equal_trainer_logprobs(model):
    path, tok = model
    get_backend("cpu").init_distributed()
    get_backend("cpu").init_model_parallel(1, 1, seed=1)
    sp = SamplingParams(temperature=0.8, max_new_tokens=5, stop_token_ids=(tok.eos_token_id,))
    results = list(_engine(path, tok).generate(_requests(tok, sp, n=2)))
    actor = TriModelActor(ActorConfig(), arch_from_hf_dir(path), path, temperature=0.8, with_reference=False)
    samples = [TrainSample(r.prompt_ids, r.response_ids, 0.0) for r in results]
    mb = pack_unshared(samples, tok.pad_token_id)
    trainer_lp = actor.compute_logprobs(mb)["policy"]
    for i, r in enumerate(results):
        p = len(r.prompt_ids)
        got = trainer_lp[i, p - 1:p - 1 + len(r.response_ids)]
        assert torch.allclose(got, torch.tensor(r.logprobs), atol=1e-5), (got, r.logprobs)


def test_update_weights_takes_effect_and_checks_names(model, tmp_path):
    path, tok = model
    other_path, _ = _model_dir(tmp_path / "other", seed=1)
    engine = _engine(path, tok)
    sp = SamplingParams(temperature=0.0, max_new_tokens=6)
    before = [r.response_ids for r in engine.generate(_requests(tok, sp))]
    other = Qwen2ForCausalLM.from_pretrained(other_path)
    named = [(n, p.detach().clone()) for n, p in other.named_parameters() if n != "lm_head.weight"]
    engine.update_weights(iter(named), version=3)
    after = list(engine.generate(_requests(tok, sp)))
    expected = [r.response_ids for r in _engine(other_path, tok).generate(_requests(tok, sp))]
    assert [r.response_ids for r in after] == expected != before
    assert {r.policy_version for r in after} == {3}
    with pytest.raises(KeyError, match="no parameter 'model.bogus'"):
        engine.update_weights(iter([("model.bogus", torch.zeros(1))]), version=4)
    with pytest.raises(KeyError, match="no tensor received"):
        engine.update_weights(iter(named[:3]), version=4)


def test_each_worker_process_starts_with_the_visible_devices_of_its_placement(model, tmp_path):
    """The variable a placement asks for (CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES on a
    GPU / NPU node) is in each spawned worker's environment from its first instruction - before
    torch or vLLM is imported - and the parent's environment is left as it was."""
    import os
    from periodic_async.models.convert import hf_layout
    from periodic_async.models.mcore import arch_from_hf_dir
    from periodic_async.rollout.worker import WorkerPool, WorkerSettings
    path, tok = model
    placements = [{"device": "cpu", "cores": None, "env": {"CUDA_VISIBLE_DEVICES": str(i),
                                                            "ASCEND_RT_VISIBLE_DEVICES": str(i + 4)}}
                  for i in (2, 3)]
    before = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES")}
    pool = WorkerPool(WorkerSettings("cpu", path, tok.pad_token_id, tok.eos_token_id, 4), placements,
                      hf_layout(arch_from_hf_dir(path)))
    try:
        assert pool.placed == {0: {"device": "cpu", "env": {"CUDA_VISIBLE_DEVICES": "2", "ASCEND_RT_VISIBLE_DEVICES": "6"}},
                               1: {"device": "cpu", "env": {"CUDA_VISIBLE_DEVICES": "3", "ASCEND_RT_VISIBLE_DEVICES": "7"}}}
    finally:
        pool.close()
    assert {k: os.environ.get(k) for k in before} == before
