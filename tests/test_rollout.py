"""The HF rollout engine: greedy equals transformers' generate, the batched engine equals its slow
one-sequence reference, seeded sampling does not depend on batching, rollout log-probs equal the
trainer's, and weight updates take effect."""
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
from periodic_async.rollout import hf_engine
from periodic_async.rollout.hf_engine import HFRolloutEngine
from periodic_async.rollout.sampling import filter_logits, filter_logits_batch, inverse_cdf

from helpers import generate_reference


def _model_dir(path, seed, init=0.3, **arch):
    """A tiny Qwen2 with a large init (logits far from uniform, so greedy has no near-ties)."""
    tok = build_char_tokenizer()
    cfg = tiny_hf_config(TinyModelConfig(**arch), len(tok), tok.eos_token_id, tok.pad_token_id)
    cfg.initializer_range = init
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


@pytest.fixture(scope="module")
def ref_model(tmp_path_factory):
    """Grouped KV heads (4 heads, 2 KV heads). Init 0.1: a padded and an unpadded forward agree to
    ~1e-6 in log-prob (at init 0.3 they differ by up to ~3e-5: summation order in the GEMMs,
    amplified by large activations), and the logits are still far enough from uniform for greedy
    to have no near-ties."""
    return _model_dir(tmp_path_factory.mktemp("ref"), seed=2, init=0.1, num_heads=4, num_kv_heads=2)


MIX_PROMPTS = ["4719=", "12=", "9=", "30571=", "1+2=", "987654321+12345="]


def _mixed_requests(tok, seed=11):
    """Prompts of 2..16 tokens, K from 1 to 4, greedy and sampled with top-k / top-p, different
    max_new_tokens and stop tokens (EOS always stops too)."""
    digit = lambda c: tok(c, add_special_tokens=False).input_ids[0]  # noqa: E731
    sps = [SamplingParams(temperature=0.0, max_new_tokens=7),
           SamplingParams(temperature=1.0, max_new_tokens=9, stop_token_ids=(digit("7"), digit("5"))),
           SamplingParams(temperature=0.7, top_k=4, max_new_tokens=5),
           SamplingParams(temperature=1.2, top_p=0.8, max_new_tokens=12, stop_token_ids=(digit("3"),)),
           SamplingParams(temperature=0.9, top_k=6, top_p=0.9, max_new_tokens=3),
           SamplingParams(temperature=1.0, max_new_tokens=10, stop_token_ids=(digit("1"), digit("8")))]
    return [RolloutRequest(i, tok(p, add_special_tokens=False).input_ids, n, sp, seed + i)
            for i, (p, n, sp) in enumerate(zip(MIX_PROMPTS, [1, 3, 2, 4, 1, 3], sps))]


def _check_equal(got, want, tol=1e-5):
    key = lambda r: (r.group_index, r.sample_index)  # noqa: E731
    got, want = sorted(got, key=key), sorted(want, key=key)
    assert [key(r) for r in got] == [key(r) for r in want]
    for a, b in zip(got, want):
        assert a.response_ids == b.response_ids, key(a)
        assert a.finish_reason == b.finish_reason, key(a)
        assert len(a.logprobs) == len(b.logprobs)
        worst = max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs))
        assert worst < tol, (key(a), worst)


def test_batched_engine_equals_the_one_sequence_reference(ref_model):
    """The batched engine (shared-prompt prefill, refills merged into the running cache, finished
    rows dropped, vectorised sampling) gives the tokens and log-probs of the slow reference: each
    sequence alone, a full forward per token. 14 samples through 5 slots, half of the requests
    arriving while the others decode."""
    path, tok = ref_model
    engine = _engine(path, tok, mbs=5)
    reqs = _mixed_requests(tok)
    arrivals = [reqs[3:], [], []]
    occupancy = []
    got = [r for finished in engine.serve(lambda: arrivals.pop() if arrivals else None, initial=reqs[:3],
                                          on_slots=occupancy.append) for r in finished]
    _check_equal(got, generate_reference(engine, reqs))
    # what the test claims to cover
    stops = {len(r.response_ids) for r in got if r.finish_reason == "stop"}
    assert len(stops) >= 2 and any(r.finish_reason == "length" for r in got), stops
    assert len(got) == 14 and max(occupancy) == 5
    # a sequence holds one slot 0..max_slots-1 while it is active; a slot holds one sequence at a time
    by_slot = {}
    for r in got:
        by_slot.setdefault(r.timings["slot"], []).append((r.timings["start"], r.timings["end"]))
    assert set(by_slot) == set(range(5))
    for spans in by_slot.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans
    assert len({r.timings["start"] for r in got}) > 2          # slots were refilled


def test_lean_decode_equals_the_transformers_decode_step(ref_model):
    """rollout/lean_decode.py (fused q/k/v and gate/up as views of the parameters, attention per KV
    head without repeating K / V, the mask in one op) gives the tokens and log-probs of the
    transformers forward it replaces, through refills, finished rows and a weight update; and it
    is the path taken (the engines above and below run it by default)."""
    path, tok = ref_model
    lean, hf = (HFRolloutEngine(path, tok.pad_token_id, tok.eos_token_id, max_slots=5, decode=d) for d in ("lean", "hf"))
    assert lean._fused is not None and hf._fused is None
    calls = []
    step = hf_engine.lean_decode_step
    hf_engine.lean_decode_step = lambda *a: calls.append(1) or step(*a)
    try:
        reqs = _mixed_requests(tok)
        _check_equal(list(lean.generate(reqs)), list(hf.generate(reqs)))
        assert calls                                                          # the lean step ran
        # q_proj's weight is a view of the fused weight: a weight sync (copy_) reaches both paths
        new = {n: p.detach() * 0.9 for n, p in hf.model.named_parameters()}
        for engine in (lean, hf):
            engine.update_weights(new.items(), version=1)
        assert lean._fused[0][0][:4].data_ptr() == dict(lean.model.named_parameters())[
            "model.layers.0.self_attn.q_proj.weight"].data_ptr()
        _check_equal(list(lean.generate(reqs)), list(hf.generate(reqs)))
    finally:
        hf_engine.lean_decode_step = step
    with pytest.raises(ValueError, match="decode must be 'lean' or 'hf'"):
        HFRolloutEngine(path, tok.pad_token_id, tok.eos_token_id, decode="fast")


def test_compiled_decode_step_equals_the_eager_one(ref_model):
    """rollout.compile_decode: the lean step through torch.compile (dynamic rows and cache width)
    gives the eager step's tokens and log-probs within 1e-5, through refills and finished rows,
    and it is the step taken; an engine without the lean step refuses it."""
    path, tok = ref_model
    eager = HFRolloutEngine(path, tok.pad_token_id, tok.eos_token_id, max_slots=5)
    compiled = HFRolloutEngine(path, tok.pad_token_id, tok.eos_token_id, max_slots=5, compile_decode=True)
    assert compiled._compiled_step is not None and eager._compiled_step is None
    reqs = _mixed_requests(tok)
    calls = []
    step = compiled._compiled_step
    compiled._compiled_step = lambda *a: calls.append(1) or step(*a)
    _check_equal(list(compiled.generate(reqs)), list(eager.generate(reqs)))
    assert calls
    with pytest.raises(ValueError, match="compile_decode needs the lean decode step"):
        HFRolloutEngine(path, tok.pad_token_id, tok.eos_token_id, decode="hf", compile_decode=True)


def test_engine_reports_idle_before_it_hands_out_its_last_results(ref_model):
    """With shared CPU cores (backend.CoreSeat) a worker's idle report is what gives the trainer
    every core: it must come before the batch's last results leave, or the first micro-step,
    started on those results, runs on half the cores."""
    path, tok = ref_model
    engine = _engine(path, tok, mbs=5)
    calls = []
    served = engine.serve(lambda: None, initial=_mixed_requests(tok), on_slots=calls.append)
    for finished in served:
        calls.append(("results", len(finished)))
    last = max(i for i, c in enumerate(calls) if isinstance(c, tuple))
    assert calls[last - 1] == 0, calls[-6:]
    assert all(c != 0 for c in calls[:last - 1] if not isinstance(c, tuple)), calls   # busy until then


def test_a_response_does_not_depend_on_its_batch_mates(ref_model):
    """The same samples, alone, among short greedy prompts, or among longer prompts arriving later
    (other padding, other batch positions, other admission times): the same tokens and log-probs."""
    path, tok = ref_model
    sp = SamplingParams(temperature=1.0, top_k=8, top_p=0.95, max_new_tokens=8, stop_token_ids=(tok.eos_token_id,))
    target = RolloutRequest(0, tok("30571=", add_special_tokens=False).input_ids, 3, sp, 5)
    alone = list(_engine(path, tok, mbs=1).generate([target]))
    short_mates = _requests(tok, SamplingParams(temperature=0.0, max_new_tokens=3), ["9=", "12="], n=2, seed=40)
    long_mates = _mixed_requests(tok, seed=70)[3:]
    for r in short_mates + long_mates:
        r.group_index += 10
    runs = [list(_engine(path, tok).generate(short_mates + [target])),
            list(_engine(path, tok, mbs=4).generate([target] + long_mates))]
    arrivals = [[target], [], long_mates[:1]]
    runs.append([r for fin in _engine(path, tok, mbs=6).serve(lambda: arrivals.pop() if arrivals else None,
                                                              initial=short_mates + long_mates[1:]) for r in fin])
    for run in runs:
        _check_equal([r for r in run if r.group_index == 0], alone)
    assert len({tuple(r.response_ids) for r in alone}) == 3


def test_batched_filter_equals_the_per_row_filter():
    torch.manual_seed(0)
    logits = torch.randn(7, 50) * 3
    logits[3, :10] = 2.0                            # ties at the top-k boundary are all kept
    ks = [-1, 1, 5, 50, 100, 10, 3]
    ps = [1.0, 0.5, 0.9, 0.3, 1.0, 1.0, 0.99]
    want = torch.stack([filter_logits(row, k, p) for row, k, p in zip(logits, ks, ps)])
    got = filter_logits_batch(logits, torch.tensor(ks), torch.tensor(ps))
    assert torch.equal(got, want)
    for k, p in [(5, 1.0), (-1, 0.7), (4, 0.8), (-1, 1.0)]:     # one value for all rows
        want = torch.stack([filter_logits(row, k, p) for row in logits])
        assert torch.equal(filter_logits_batch(logits, k, p), want)
        assert torch.equal(filter_logits_batch(logits, torch.full((7,), k), torch.full((7,), p)), want)


def test_inverse_cdf_sampling():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3, 0.0])
    n = 1000
    u = (torch.arange(n) + 0.5) / n                  # an even grid of uniforms: counts = n * probs
    tok = inverse_cdf(probs.expand(n, -1), u)
    assert torch.bincount(tok, minlength=5).tolist() == [100, 0, 600, 300, 0]
    # the ends: u = 0 is the first token with mass, the largest float32 below 1 the last one
    # (u * total rounds up to total), also for rows of any total
    edge = torch.tensor([0.0, 1 - 2 ** -24])
    for row in (probs, probs * 7.3, torch.tensor([0.0, 0.0, 1e-30, 0.0])):
        nz = row.nonzero()[:, 0]
        assert inverse_cdf(row.expand(2, -1), edge).tolist() == [nz[0].item(), nz[-1].item()]


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


@pytest.mark.parametrize("sync", ["shm", "broadcast"])
def test_publish_returns_while_workers_generate_and_acks_come_per_worker(model, tmp_path, sync):
    """The pool's one weight protocol (rollout/pool_weights.py), for the shared-memory and the
    broadcast sync: `publish` returns at once although the (drained, non-interruptible) worker is
    generating; the worker finishes its responses under version 0, then takes version 1 and
    acknowledges, and only then does `applied_version` advance; what it generates afterwards is
    the new model's (greedy output equal to an engine built from it)."""
    from periodic_async.models.convert import hf_layout
    from periodic_async.rollout.worker import WorkerPool, WorkerSettings
    from periodic_async.scheduling.staleness import StalenessRule
    path, tok = model
    other_path, _ = _model_dir(tmp_path / "other", seed=1)
    other = Qwen2ForCausalLM.from_pretrained(other_path)
    named = [(n, p.detach().clone()) for n, p in other.named_parameters() if n != "lm_head.weight"]
    settings = WorkerSettings("cpu", path, tok.pad_token_id, tok.eos_token_id, 8, weight_sync=sync,
                              bucket_bytes=4096, interruptible=False)
    pool = WorkerPool(settings, [{"device": "cpu", "cores": None}], hf_layout(arch_from_hf_dir(path)),
                      staleness=StalenessRule(1))
    try:
        long = SamplingParams(temperature=1.0, max_new_tokens=400, ignore_eos=True)
        pool.dispatch(_requests(tok, long, prompts=PROMPTS[:1], n=4))
        pool.publish(iter(named), 1)
        assert (pool.version, pool.applied_version) == (1, 0)      # returned while the worker generates
        with pytest.raises(RuntimeError, match="not yet applied"):
            pool.publish(iter(named), 2)
        seen = []                    # (policy version of each result, applied version when it came)
        while len(seen) < 4 or pool.applied_version != 1:
            seen += [(r.policy_version, pool.applied_version) for r in pool.poll(0.2)]
        assert seen == [(0, 0)] * 4      # drained: its responses end under version 0, then it acks
        assert pool.wait_applied(0)
        greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
        pool.dispatch(_requests(tok, greedy))
        got = []
        while len(got) < len(PROMPTS):
            got += pool.poll(0.2)
        want = {r.group_index: r.response_ids for r in _engine(other_path, tok).generate(_requests(tok, greedy))}
        assert {r.group_index: r.response_ids for r in got} == want
        assert {r.policy_version for r in got} == {1}
    finally:
        pool.close()


def test_ignore_eos_runs_every_response_to_max_new_tokens(model):
    """rollout.ignore_eos: the same seeded draws, but EOS no longer ends a response, so each one is
    exactly max_new_tokens long and starts with what the stopping run produced (EOS included)."""
    from periodic_async.rollout.sampling import reference_generate
    path, tok = model
    engine = _engine(path, tok)
    stop = SamplingParams(temperature=1.0, max_new_tokens=40, stop_token_ids=(tok.eos_token_id,))
    free = SamplingParams(temperature=1.0, max_new_tokens=40, ignore_eos=True)
    key = lambda r: (r.group_index, r.sample_index)  # noqa: E731
    stopped = sorted(engine.generate(_requests(tok, stop, n=4)), key=key)
    ran = sorted(engine.generate(_requests(tok, free, n=4)), key=key)
    assert any(r.finish_reason == "stop" for r in stopped)   # EOS does get sampled by this model
    for s, r in zip(stopped, ran):
        assert len(r.response_ids) == 40 and r.finish_reason == "length"
        assert r.response_ids[:len(s.response_ids)] == s.response_ids
    hf = Qwen2ForCausalLM.from_pretrained(path).eval()
    req = _requests(tok, free, n=4)[0]
    ids, _, reason = reference_generate(hf, req, 0, tok.eos_token_id)
    assert reason == "length" and ids == ran[0].response_ids


def test_pool_and_worker_messages_are_frozen_picklable_and_torch_free():
    """rollout/messages.py: what crosses the workers' pipes and the relays' connections."""
    import dataclasses
    import pickle
    import subprocess
    import sys

    from periodic_async.rollout import messages as m
    req = RolloutRequest(3, [1, 2], 2, SamplingParams(max_new_tokens=4), 7)
    for msg in [m.Generate([req]), m.Update(2), m.Stop(), m.Placed(0, {"device": "cpu", "env": {}}), m.Ready(1, 99, 2),
                m.Updated(1, 2), m.Results(0, []), m.Error(0, "boom"), m.Hello("h", 0, 5), m.Reject("full"),
                m.Assign(1, {"any": "settings"}, [("w", (2,))], 0, 29500, "worker1-1")]:
        assert pickle.loads(pickle.dumps(msg)) == msg
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(msg, "x", 1)
    code = "import sys, periodic_async.rollout.messages; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


class _CountingEngine:
    """serve(take): one step per next(), each returning the results of the requests taken so far."""
    policy_version = 0

    def __init__(self, fail_at=None):
        self.steps, self.fail_at = 0, fail_at

    def serve(self, take):
        pending = []
        while True:
            pending += take() or []
            self.steps += 1
            if self.steps == self.fail_at:
                raise RuntimeError("engine failed")
            if not pending:
                return
            yield [pending.pop(0)]


class _OneSampleRequest:
    def samples(self):
        return [self]


def test_colocated_engine_steps_run_on_the_thread_that_serves_them():
    """rollout/colocated.py: the producer thread's poll hands each engine step to the trainer's
    waiting thread (one OpenMP team per process); unserved, a poll gives up after its timeout
    without running the engine, and an engine error is raised in the polling thread."""
    import threading
    from periodic_async.rollout.colocated import ColocatedPool

    engine = _CountingEngine()
    pool = ColocatedPool(engine)
    pool.dispatch([_OneSampleRequest() for _ in range(3)])
    assert pool.poll(0.05) == [] and engine.steps == 0          # nobody serves: withdrawn, not run
    got, errors = [], []

    def producer():
        try:
            while len(got) < 3:
                got.extend(pool.poll(0.05))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    th = threading.Thread(target=producer, name="rollout-producer")
    th.start()
    while th.is_alive():
        pool.serve_handoff(0.01)
    assert not errors and len(got) == 3
    assert pool.engine_threads == {threading.current_thread().name}

    failing = ColocatedPool(_CountingEngine(fail_at=1))
    failing.dispatch([_OneSampleRequest()])
    th = threading.Thread(target=lambda: errors.append(pytest.raises(RuntimeError, failing.poll, 5.0)))
    th.start()
    while th.is_alive():
        failing.serve_handoff(0.01)
    assert len(errors) == 1 and "engine failed" in str(errors[0].value)
