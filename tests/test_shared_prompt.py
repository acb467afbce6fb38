"""Shared-prompt attention (kernels/shared_prompt): one prompt, K responses, one packed sequence.

Against the unshared computation (each response its own sequence [P | Rk], pack_unshared + the
local Megatron DotProductAttention), in fp32 on CPU: per-token log-probs (policy and reference),
the GRPO loss terms (clipped PG, KL to a DIFFERENT reference, entropy bonus) and every parameter
gradient, for K in {1, 2, 8}, mixed response lengths, responses and prompts of length 1, padding and
several groups per micro-batch (and per row). The TP=2 version runs under torchrun
(tests/dist_shared_prompt_worker.py). The kernels are also checked one by one against attention
run per response; the NPU path runs end to end on CPU with the documented semantics of
npu_fusion_attention standing in for torch_npu (only the Ascend kernel itself is not run here).
"""
from __future__ import annotations

import json
import os
import sys
import types

import pytest
import torch

from kernels.shared_prompt import attention_flop_ratio, ideal_token_ratio, pack_groups, shared_prompt_attention
from kernels.shared_prompt.npu import reference_npu_fusion_attention
from periodic_async.config import ActorConfig
from periodic_async.actor.tri_model import TriModelActor
from periodic_async.actor.packing import TrainSample, group_by_prompt, pack_micro_batch, pack_shared, pack_unshared
from periodic_async.models.convert import load_hf_checkpoint
from periodic_async.models.mcore import arch_from_hf_dir

from helpers import make_hf_model_dir

VOCAB = 24
PAD = 0
NORMALISER = 23.0
LOGP_TOL = dict(rtol=1e-5, atol=2e-5)
METRIC_TOL = dict(rtol=1e-5, atol=1e-6)
GRAD_RTOL, GRAD_ATOL_REL = 1e-4, 2e-5   # atol relative to each tensor's largest entry (fp32 sums)

# (prompt length, [response lengths]) per group
CASES = {
    "k1": [(5, [7]), (3, [4])],
    "k2_len1": [(6, [1, 9]), (1, [3, 5]), (1, [1, 1])],
    "k8_mixed_several_groups": [(4, [2, 7, 1, 5, 3, 8, 1, 6]), (9, [3, 2]), (1, [1, 4, 2])],
}


def make_groups(spec, seed=0):
    g = torch.Generator().manual_seed(seed)
    groups = []
    for p, rs in spec:
        prompt = torch.randint(1, VOCAB, (p,), generator=g).tolist()
        groups.append([TrainSample(prompt, torch.randint(1, VOCAB, (r,), generator=g).tolist(),
                                   float(torch.randn((), generator=g))) for r in rs])
    return groups


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared_prompt")
    kw = dict(hidden=64, heads=4, kv_heads=2, layers=2, ffn=128, vocab=VOCAB)
    return (make_hf_model_dir(root / "policy", seed=0, **kw), make_hf_model_dir(root / "ref", seed=1, **kw))


@pytest.fixture
def fake_torch_npu(monkeypatch):
    """torch_npu stand-in: the documented semantics of npu_fusion_attention (TND, sparse_mode 3)."""
    monkeypatch.setitem(sys.modules, "torch_npu",
                        types.SimpleNamespace(npu_fusion_attention=reference_npu_fusion_attention))


def _actor(dirs, shared: bool, impl: str = "sdpa", **cfg):
    policy_dir, ref_dir = dirs
    spec = arch_from_hf_dir(policy_dir)
    acfg = ActorConfig(kl_coef=0.1, entropy_coef=0.01, shared_prompt=shared, **cfg)
    # the unshared reference is Megatron's local spec (DotProductAttention), as the docstring says
    actor = TriModelActor(acfg, spec, policy_dir, temperature=0.8, with_reference=True,
                          attention_impl=impl if shared else None, core_attention=None if shared else "local")
    load_hf_checkpoint(actor.reference, spec, ref_dir)       # KL (and its gradient) non-zero
    return actor


def _per_response(values, mb):
    return [v[m > 0] for v, m in zip(values, mb.loss_mask)]


def _assert_grads_close(got: dict, want: dict, what: str):
    bad = []
    for n, w in want.items():
        g = got[n]
        scale = float(w.abs().max())
        assert scale > 0, f"{what}: {n} has an all-zero gradient"
        if not torch.allclose(g, w, rtol=GRAD_RTOL, atol=GRAD_ATOL_REL * scale):
            bad.append(f"{n}: max|diff|={float((g - w).abs().max()):.3g} max|grad|={scale:.3g}")
    assert not bad, f"{what}: gradients differ:\n" + "\n".join(bad)


def _grads(actor):
    return {n: p.grad.detach().clone() for n, p in actor.policy.named_parameters()}


# ---------------------------------------------------------------------- layout: a known small case


def test_layout_known_case():
    # one group: prompt [5, 6, 7], responses [8, 9] and [10]; row of 8 -> 2 padding tokens
    pk = pack_groups([([5, 6, 7], [[8, 9], [10]])], pad_id=PAD, row_len=8)
    assert pk.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, PAD, PAD]]
    assert pk.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 0, 0]]
    assert pk.layout.group_ids.tolist() == [[0, 0, 0, 0, 0, 0, -1, -1]]
    assert pk.layout.response_ids.tolist() == [[0, 0, 0, 1, 1, 2, 0, 0]]
    # both first response tokens are predicted from the last prompt position (2)
    assert pk.logit_index.tolist() == [[2, 3], [2, 0]]
    assert pk.labels.tolist() == [[8, 9], [10, PAD]]
    assert pk.loss_mask.tolist() == [[1, 1], [1, 0]]
    attend = [  # 1 = may attend (the documented mask is its negation: True = masked out)
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],   # r1[0]: prompt + itself
        [1, 1, 1, 1, 1, 0, 0, 0],   # r1[1]
        [1, 1, 1, 0, 0, 1, 0, 0],   # r2[0]: prompt + itself, never r1
        [0, 0, 0, 0, 0, 0, 1, 0],   # padding: only its own row's padding, causally
        [0, 0, 0, 0, 0, 0, 1, 1],
    ]
    mask = pk.layout.dense_mask()
    assert mask.shape == (1, 1, 8, 8) and mask.dtype == torch.bool
    assert (~mask[0, 0]).int().tolist() == attend


def test_npu_tnd_args_known_case():
    """The documented NPU arguments: segments [prompt], [r1 | prompt+r1], [r2 | prompt+r2] with
    CUMULATIVE lengths, the compressed 2048 x 2048 causal mask (True = masked), sparse_mode 3."""
    pk = pack_groups([([5, 6, 7], [[8, 9], [10]])], pad_id=PAD, row_len=8)
    (args,) = pk.layout.npu_tnd_args()
    assert args.input_layout == "TND" and args.sparse_mode == 3
    assert args.q_index.tolist() == [0, 1, 2, 3, 4, 5]                     # padding 6, 7 is in no segment
    assert args.kv_index.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 5]
    assert args.actual_seq_qlen == [3, 5, 6]                               # lengths 3, 2, 1
    assert args.actual_seq_kvlen == [3, 8, 12]                             # lengths 3, 5, 4
    assert args.atten_mask.dtype == torch.bool and args.atten_mask.shape == (2048, 2048)
    assert torch.equal(args.atten_mask, torch.ones(2048, 2048, dtype=torch.bool).triu(1))
    # two rows, 5 segments [p1] [r1] [r2] [p2] [r3], chunked to at most 2 segments per call
    pk2 = pack_groups([([1], [[2], [3]]), ([4, 5], [[6]])], pad_id=PAD, row_len=3)
    calls = pk2.layout.npu_tnd_args(max_segments=2)
    assert [c.actual_seq_qlen for c in calls] == [[1, 2], [1, 3], [1]]
    assert [c.actual_seq_kvlen for c in calls] == [[1, 3], [2, 4], [3]]
    assert [c.q_index.tolist() for c in calls] == [[0, 1], [2, 3, 4], [5]]   # row 1 starts at 3
    assert [c.kv_index.tolist() for c in calls] == [[0, 0, 1], [0, 2, 3, 4], [3, 4, 5]]


def test_cost_model():
    assert ideal_token_ratio(4, [16] * 8) == pytest.approx((4 + 8 * 16) / (8 * 20))
    assert attention_flop_ratio(4, [4]) == pytest.approx(1.0)
    assert attention_flop_ratio(16, [1] * 8) == pytest.approx((16 * 17 / 2 + 8 * (16 + 1)) / (8 * 17 * 18 / 2))


# ---------------------------------------------------------------------- kernels one by one


def _per_response_reference(q, k, v, packed, groups):
    """Attention of each [P | Rk] run on its own (plain causal softmax), scattered to the packed
    positions: the unshared semantics at kernel level."""
    b, h, s, d = q.shape
    rep = h // k.shape[1]
    flat = lambda t: t.transpose(1, 2).reshape(b * s, t.shape[1], d)
    qf, kf, vf = flat(q), flat(k), flat(v)
    out = torch.zeros(b * s, h, d)
    lay = packed.layout
    prompts = {(r, st): (r * s + st, p) for r, st, p in lay.prompt_segments.tolist()}
    seqs = [torch.arange(p) + base for base, p in prompts.values()]
    seqs += [torch.cat([torch.arange(p) + r * s + ps, torch.arange(rl) + r * s + st])
             for r, ps, p, st, rl in lay.response_segments.tolist()]
    for idx in seqs:
        qs, ks, vs = qf[idx].transpose(0, 1), kf[idx].transpose(0, 1), vf[idx].transpose(0, 1)
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        sc = (qs @ ks.transpose(1, 2)) / d ** 0.5
        sc = sc.masked_fill(torch.ones(len(idx), len(idx), dtype=torch.bool).triu(1), float("-inf"))
        out[idx] = (sc.softmax(-1) @ vs).transpose(0, 1)
    return out.view(b, s, h, d).transpose(1, 2)


@pytest.mark.parametrize("impl", ["sdpa", "sdpa_dense", "sdpa_segmented", "npu_fusion", "flex"])
def test_kernels_equal_per_response_attention(impl, fake_torch_npu):
    torch.manual_seed(0)
    spec = [(4, [2, 7, 1, 5]), (1, [3, 1]), (6, [1]), (2, [4, 4, 4])]
    groups = [(list(range(1, p + 1)), [[1] * r for r in rs]) for p, rs in spec]
    packed = pack_groups(groups, PAD, row_len=24)          # several groups per row + padding
    b, s = packed.input_ids.shape
    assert b >= 2 and (packed.layout.group_ids < 0).any()
    h, hkv, d = 4, 2, 8                                     # GQA
    q, k, v = (torch.randn(b, n, s, d, requires_grad=True) for n in (h, hkv, hkv))
    real = (packed.layout.group_ids >= 0)[:, None, :, None]
    want = _per_response_reference(q, k, v, packed, groups)
    if impl == "flex":      # FlexAttention: forward only on CPU (torch 2.13 has no CPU backward)
        with torch.no_grad():
            got = shared_prompt_attention(q.detach(), k.detach(), v.detach(), packed.layout, impl)
        torch.testing.assert_close(got * real, want.detach() * real, rtol=1e-5, atol=1e-5)
        return
    got = shared_prompt_attention(q, k, v, packed.layout, impl)
    torch.testing.assert_close(got * real, want * real, rtol=1e-5, atol=1e-5)
    w = torch.randn_like(want) * real                      # padding carries no loss
    g_got = torch.autograd.grad((got * w).sum(), (q, k, v))
    g_want = torch.autograd.grad((want * w).sum(), (q, k, v))
    for name, a, e in zip("qkv", g_got, g_want):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5, msg=lambda m: f"d{name}: {m}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (FlexAttention compiled path)")
def test_flex_cuda_forward_backward_equals_sdpa():
    torch.manual_seed(0)
    groups = [(list(range(1, 40)), [[1] * r for r in (17, 3, 60, 1)]), (list(range(1, 9)), [[2] * 30] * 5)]
    packed = pack_groups(groups, PAD, row_len=300)
    b, s = packed.input_ids.shape
    dev = torch.device("cuda")
    lay = packed.layout.to(dev)
    q, k, v = (torch.randn(b, n, s, 64, device=dev, requires_grad=True) for n in (8, 2, 2))
    real = (lay.group_ids >= 0)[:, None, :, None]
    got = shared_prompt_attention(q, k, v, lay, "flex")
    want = shared_prompt_attention(q, k, v, lay, "sdpa_dense")
    torch.testing.assert_close(got * real, want * real, rtol=1e-4, atol=1e-4)
    w = torch.randn_like(want) * real
    for a, e in zip(torch.autograd.grad((got * w).sum(), (q, k, v)), torch.autograd.grad((want * w).sum(), (q, k, v))):
        torch.testing.assert_close(a, e, rtol=1e-3, atol=1e-3)


# ---------------------------------------------------------------------- the model: shared == unshared


def _compare(dirs, spec, impl, loss_agg_mode="token-mean", seed=0):
    groups = make_groups(spec, seed)
    samples = [s for g in groups for s in g]
    unshared = _actor(dirs, False, loss_agg_mode=loss_agg_mode)
    shared = _actor(dirs, True, impl, loss_agg_mode=loss_agg_mode)
    mb_u = pack_unshared(samples, PAD)
    mb_s = pack_shared(groups, PAD)
    assert mb_s.input_ids.numel() < mb_u.input_ids.numel() or len(spec[0][1]) == 1

    # per-token log-probs, policy and reference
    lp_u, lp_s = unshared.compute_logprobs(mb_u), shared.compute_logprobs(mb_s)
    for key in ("policy", "ref"):
        for i, (a, e) in enumerate(zip(_per_response(lp_s[key], mb_s), _per_response(lp_u[key], mb_u))):
            assert a.shape == e.shape == (len(samples[i].response_ids),)
            torch.testing.assert_close(a, e, **LOGP_TOL, msg=lambda m: f"{key} logp, response {i}: {m}")

    # the GRPO loss terms and every gradient
    m_u = unshared.train_micro_step(mb_u, NORMALISER)
    m_s = shared.train_micro_step(mb_s, NORMALISER)
    assert set(m_s) == set(m_u)
    for key in m_u:
        assert m_s[key] == pytest.approx(m_u[key], rel=METRIC_TOL["rtol"], abs=METRIC_TOL["atol"]), key
    assert abs(m_u["actor/kl_loss"]) > 1e-3 and abs(m_u["actor/entropy"]) > 1e-3
    _assert_grads_close(_grads(shared), _grads(unshared), f"{impl} shared vs unshared")


@pytest.mark.parametrize("case", list(CASES))
def test_shared_equals_unshared(case, dirs, megatron_tp1):
    _compare(dirs, CASES[case], "sdpa")


@pytest.mark.parametrize("impl", ["sdpa_dense", "sdpa_segmented", "npu_fusion"])
def test_shared_equals_unshared_other_kernels(impl, dirs, megatron_tp1, fake_torch_npu):
    _compare(dirs, CASES["k8_mixed_several_groups"], impl, seed=3)


def test_shared_equals_unshared_seq_mean_token_mean(dirs, megatron_tp1):
    _compare(dirs, CASES["k2_len1"], "sdpa", loss_agg_mode="seq-mean-token-mean", seed=5)


def test_micro_batch_boundary_cuts_a_group(dirs, megatron_tp1):
    """The trainer's micro-batches are consecutive samples: a group cut by the boundary becomes two
    smaller groups sharing the prompt; accumulated gradients still equal the unshared ones."""
    groups = make_groups([(5, [3, 1, 4, 2, 6]), (2, [2, 2, 5])], seed=7)
    samples = [s for g in groups for s in g]
    unshared, shared = _actor(dirs, False), _actor(dirs, True)
    for chunk in (samples[:3], samples[3:6], samples[6:]):
        m_u = unshared.train_micro_step(pack_micro_batch(chunk, PAD, shared_prompt=False), NORMALISER)
        mb = pack_micro_batch(chunk, PAD, shared_prompt=True)
        assert mb.shared_prompt and len(group_by_prompt(chunk)) in (1, 2)
        m_s = shared.train_micro_step(mb, NORMALISER)
        assert m_s["actor/loss"] == pytest.approx(m_u["actor/loss"], rel=1e-5, abs=1e-6)
    _assert_grads_close(_grads(shared), _grads(unshared), "cut groups")


def test_shared_model_runs_plain_micro_batches(dirs, megatron_tp1):
    """The shared-prompt model (RoPE from position ids, SDPA core attention) gives the local model's
    results on an unshared micro-batch too."""
    samples = [s for g in make_groups(CASES["k1"], seed=2) for s in g]
    mb = pack_unshared(samples, PAD)
    a, b = _actor(dirs, False), _actor(dirs, True)
    torch.testing.assert_close(b.compute_logprobs(mb)["policy"], a.compute_logprobs(mb)["policy"], **LOGP_TOL)
    with pytest.raises(ValueError, match="needs actor.shared_prompt"):
        a.compute_logprobs(pack_micro_batch(samples, PAD, shared_prompt=True))


def test_pack_shared_rejects_mixed_prompts():
    with pytest.raises(ValueError, match="do not share one prompt"):
        pack_shared([[TrainSample([1, 2], [3], 0.0), TrainSample([1], [3], 0.0)]], PAD)
    with pytest.raises(ValueError, match="empty prompt"):
        pack_groups([([], [[1]])], PAD)


# ---------------------------------------------------------------------- TP = 2 (torchrun)


def test_tp2_shared_equals_unshared(dirs, tmp_path):
    worker = os.path.join(os.path.dirname(__file__), "dist_shared_prompt_worker.py")
    out = tmp_path / "tp2.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           worker, "--out", str(out), dirs[0], dirs[1]]
    from test_tensor_parallel import _run_torchrun   # files, not pipes; no rank outlives a timeout
    _run_torchrun(cmd, timeout=240)
    for rank in range(2):
        res = json.loads((tmp_path / f"tp2.json.rank{rank}").read_text())
        assert res["tp"] == 2
        assert not res["failures"], "\n".join(res["failures"])
        assert res["checked_params"] > 0
