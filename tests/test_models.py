"""HF <-> Megatron-core conversion and the Megatron GPT model at TP=1 (in-process, cpu backend):
exact weight round trips, logits equal to transformers', the training fast paths (SDPA core
attention, RoPE / SwiGLU / RMSNorm autograd functions) equal to Megatron's local spec, the
vocab-parallel log-prob math, the fused-QKV layout helpers, and clear rejection of unsupported
configs."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from helpers import fixed_input_ids, load_hf_model, make_hf_model_dir, megatron_inputs
from periodic_async.models.convert import (SafetensorsReader, export_hf_weights, fuse_qkv, load_hf_checkpoint,
                                           save_hf_checkpoint, split_qkv)
from periodic_async.models.mcore import ModelArch, UnsupportedModel, build_gpt_model, arch_from_hf_dict, arch_from_hf_dir

# qwen2: tied embeddings, QKV bias; llama: untied lm_head, no bias. Both GQA (4 heads, 2 kv heads).
ARCHS = {
    "qwen2-tied": dict(arch="qwen2", tied=True, seed=0),
    "llama-untied": dict(arch="llama", tied=False, seed=1),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {name: make_hf_model_dir(root / name, **kw) for name, kw in ARCHS.items()}


def _source_tensors(path: str) -> dict[str, torch.Tensor]:
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _mcore_model(path: str, core_attention: str = "sdpa"):
    arch = arch_from_hf_dir(path)
    model = build_gpt_model(arch, core_attention=core_attention)
    load_hf_checkpoint(model, arch, path)
    return arch, model


# ---------------------------------------------------------------------- conversion


@pytest.mark.parametrize("name", list(ARCHS))
def test_hf_mcore_hf_round_trip_is_exact(name, model_dirs, megatron_tp1, tmp_path):
    path = model_dirs[name]
    arch, model = _mcore_model(path)
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (4, 2, 32)
    assert arch.tie_word_embeddings == ARCHS[name]["tied"] and arch.qkv_bias == (ARCHS[name]["arch"] == "qwen2")

    source = _source_tensors(path)
    reader = SafetensorsReader(path)
    exported = dict(export_hf_weights(model, arch))
    assert sorted(exported) == sorted(source)             # same names: no tensor lost or invented
    assert ("lm_head.weight" in exported) == (not arch.tie_word_embeddings)
    assert ("model.layers.0.self_attn.q_proj.bias" in exported) == arch.qkv_bias
    for n, t in exported.items():
        ref = reader(n)
        assert t.dtype == ref.dtype and t.shape == ref.shape, n
        assert torch.equal(t, ref), n

    # save_hf_checkpoint writes a directory transformers loads back with identical weights
    out = str(tmp_path / "exported")
    save_hf_checkpoint(export_hf_weights(model, arch), path, out)
    with open(os.path.join(path, "config.json")) as a, open(os.path.join(out, "config.json")) as b:
        assert json.load(a) == json.load(b)
    orig, back = load_hf_model(path), load_hf_model(out)
    back_params = dict(back.named_parameters())
    assert sorted(back_params) == sorted(n for n, _ in orig.named_parameters())
    for n, p in orig.named_parameters():
        assert torch.equal(back_params[n], p), n
    if arch.tie_word_embeddings:
        assert back.lm_head.weight is back.model.embed_tokens.weight
    from periodic_async.models.tokenizer import load_tokenizer
    assert load_tokenizer(out).encode("12+3=") == load_tokenizer(path).encode("12+3=")


@pytest.mark.parametrize("core_attention", ["sdpa", "local"])
@pytest.mark.parametrize("name", list(ARCHS))
def test_mcore_logits_equal_hf_logits(name, core_attention, model_dirs, megatron_tp1):
    path = model_dirs[name]
    arch, model = _mcore_model(path, core_attention)
    ids = fixed_input_ids(arch.vocab_size)
    with torch.no_grad():
        hf = load_hf_model(path)(ids).logits
        mc = model.eval()(ids, *megatron_inputs(ids))
    assert mc.shape == hf.shape == (*ids.shape, arch.vocab_size)
    scale = float(hf.abs().max())
    assert scale > 2.0                                    # far from uniform: a layout error would show
    err = float((mc - hf).abs().max())
    assert err <= 1e-5 * scale, f"max |mcore - hf| = {err:.3g} (logit scale {scale:.3g})"


@pytest.mark.parametrize("extra", [dict(attention_bias=True), dict(mlp_bias=True)], ids=["attention_bias", "mlp_bias"])
def test_llama_linear_biases_are_rejected(extra, megatron_tp1, tmp_path):
    """Megatron is built without linear biases: such a checkpoint must be refused, not loaded with
    its biases silently dropped."""
    path = make_hf_model_dir(tmp_path / "m", arch="llama", tied=False, layers=1, seed=3, **extra)
    with pytest.raises(UnsupportedModel, match=f"{next(iter(extra))}=true .*is not supported; allowed: false"):
        _mcore_model(path)


def test_unused_checkpoint_tensor_is_an_error(megatron_tp1, tmp_path):
    """A checkpoint tensor with no place in the Megatron model stops the load (never dropped)."""
    from safetensors.torch import load_file, save_file
    path = make_hf_model_dir(tmp_path / "m", arch="qwen2", layers=1, seed=3)
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(tensors["model.norm.weight"].shape)
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(KeyError, match="checkpoint tensors with no place in the Megatron model: .*o_proj.bias"):
        _mcore_model(path)


# ---------------------------------------------------------------------- training fast paths


def _padded_micro_batch():
    """Right-padded sequences of different lengths, as pack_unshared builds them (causal mask)."""
    from periodic_async.actor.packing import TrainSample, pack_unshared
    g = torch.Generator().manual_seed(7)
    lengths = [(5, 9), (3, 4), (8, 12), (2, 1)]
    return pack_unshared([TrainSample(torch.randint(2, 24, (p,), generator=g).tolist(),
                                      torch.randint(2, 24, (r,), generator=g).tolist(), a)
                          for (p, r), a in zip(lengths, (1.2, -0.5, 0.3, -1.0))], 0)


def _padding_mask(mb):
    """Causal + 'real tokens never see padding' ([B, 1, S, S], True = masked): not the causal
    mask, so SDPA gets an explicit attn_mask; a pad query still sees itself (no empty row)."""
    real = mb.input_ids != 0
    s = real.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    return (causal[None] | (real[:, :, None] & ~real[:, None, :]))[:, None]


def _logp_and_grads(model, mb, mask):
    from periodic_async.actor.logprobs import logprobs_entropy
    model.zero_grad(set_to_none=True)
    logits = model(mb.input_ids, mb.position_ids, mask)
    logp, _ = logprobs_entropy(logits, mb.labels, 0.8, with_entropy=False)
    (logp * mb.loss_mask * mb.advantages).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mask_kind", ["causal", "none", "padding"])
@pytest.mark.parametrize("name", list(ARCHS))
def test_fast_spec_equals_local_spec(name, mask_kind, model_dirs, megatron_tp1, monkeypatch):
    """build_gpt_model's default spec (SDPA core attention: the causal mask as is_causal, GQA
    without repeated K/V; RotaryFunction; SwiGLUFunction; RMSNorm) gives Megatron's local spec's
    per-token log-probs (1e-5) and gradients in fp32, for pack_unshared's causal mask, no mask
    (causal layers) and an explicit padding mask; so do the shared-prompt model on plain masks
    and SDPA in Megatron's own layers (fast_layers=False)."""
    import megatron.core.transformer.attention as mc_attention
    from kernels.fast_layers.megatron import RMSNorm
    from kernels.shared_prompt.megatron import SDPACoreAttention
    path = model_dirs[name]
    mb = _padded_micro_batch()
    masks = {"causal": mb.attention_mask, "none": None, "padding": _padding_mask(mb)}
    _, local = _mcore_model(path, "local")
    mask = masks[mask_kind]
    want = _logp_and_grads(local, mb, mb.attention_mask if mask is None else mask)   # local needs a tensor
    megatron_rope = mc_attention.apply_rotary_pos_emb
    for core, fast_layers in (("sdpa", True), ("shared_prompt", True), ("sdpa", False)):
        arch = arch_from_hf_dir(path)
        fast = build_gpt_model(arch, core_attention=core, fast_layers=fast_layers)
        load_hf_checkpoint(fast, arch, path)
        layer = fast.decoder.layers[0]
        assert isinstance(layer.self_attention.core_attention, SDPACoreAttention)
        assert (type(layer.mlp).__name__ == "SwiGLUMLP") == fast_layers
        assert isinstance(layer.input_layernorm, RMSNorm) == fast_layers
        assert isinstance(fast.decoder.final_layernorm, RMSNorm) == fast_layers

        def no_megatron_rope(*a, **k):
            raise AssertionError("the fast path ran Megatron's RoPE")
        monkeypatch.setattr(mc_attention, "apply_rotary_pos_emb", no_megatron_rope if fast_layers else megatron_rope)
        logp, grads = _logp_and_grads(fast, mb, mask)
        torch.testing.assert_close(logp, want[0], rtol=1e-5, atol=1e-5)   # fp32 kernel noise differs by torch version (2.7.1: 1.1e-5 on |logp| ~ 6)
        for n, w in want[1].items():
            scale = float(w.abs().max())
            assert scale > 0, n
            torch.testing.assert_close(grads[n], w, rtol=1e-4, atol=2e-5 * scale,   # fp32 sums (as tests/test_tensor_parallel.py)
                                        msg=lambda e: f"{core} {fast_layers} {n}: {e}")


def test_rotary_function_equals_megatron_rope():
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from kernels.fast_layers.autograd import RotaryFunction, rope_tables
    g = torch.Generator().manual_seed(0)
    for batch in (1, 3):      # one table for all rows, and per-token tables (shared prompt)
        f = torch.rand(6, batch, 1, 4, generator=g, dtype=torch.float64) * 5
        freqs = torch.cat([f, f], dim=-1)                              # Megatron's [S, B|1, 1, d] layout
        t = torch.randn(6, 3, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
        cos, sin = rope_tables(freqs, torch.float64)
        assert rope_tables(freqs, torch.float64)[0] is cos            # once per freqs tensor
        torch.testing.assert_close(RotaryFunction.apply(t, cos, sin), _apply_rotary_pos_emb_bshd(t, freqs))
        assert torch.autograd.gradcheck(lambda x: RotaryFunction.apply(x, cos, sin), (t,))
    other = torch.cat([f, f], dim=-1) * 2                               # a new tensor: new tables
    torch.testing.assert_close(rope_tables(other, torch.float64)[0], torch.cos(other))


def test_swiglu_function_equals_autograd():
    import torch.nn.functional as F
    from kernels.fast_layers.autograd import SwiGLUFunction
    g = torch.Generator().manual_seed(0)
    y = torch.randn(5, 3, 16, generator=g, requires_grad=True)
    up = torch.randn(5, 3, 8, generator=g)
    out = SwiGLUFunction.apply(y)
    a, b = y.chunk(2, -1)
    ref = F.silu(a) * (b + 0.0)                                          # Megatron's glu
    assert torch.equal(out, ref)
    assert torch.equal(torch.autograd.grad((out * up).sum(), y)[0], torch.autograd.grad((ref * up).sum(), y)[0])
    y64 = torch.randn(4, 10, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(SwiGLUFunction.apply, (y64,))


def test_rms_norm_function_equals_torch():
    from kernels.fast_layers.autograd import RMSNormFunction
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(5, 3, 16, generator=g)).requires_grad_()
    w = torch.randn(16, generator=g).requires_grad_()
    up = torch.randn(5, 3, 16, generator=g)
    out = RMSNormFunction.apply(x, w, 1e-6)
    ref = torch.nn.functional.rms_norm(x, (16,), w, 1e-6)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    for got, want in zip(torch.autograd.grad((out * up).sum(), (x, w)), torch.autograd.grad((ref * up).sum(), (x, w))):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    x64 = torch.randn(4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w64 = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: RMSNormFunction.apply(a, b, 1e-6), (x64, w64))


def test_is_causal_mask():
    from kernels.shared_prompt.megatron import is_causal_mask
    from periodic_async.actor.packing import causal_mask
    m = causal_mask(7)
    assert is_causal_mask(m) and is_causal_mask(m)                       # checked, then remembered
    assert is_causal_mask(m.expand(3, 1, 7, 7).clone())
    m[0, 0, 5, 2] = True                                                 # changed in place: checked again
    assert not is_causal_mask(m)
    assert not is_causal_mask(causal_mask(7).float())
    assert not is_causal_mask(torch.zeros(1, 1, 7, 7, dtype=torch.bool))


# ---------------------------------------------------------------------- log-prob math


def test_logprobs_entropy_tp1_equals_log_softmax(megatron_tp1):
    from periodic_async.actor.logprobs import logprobs_entropy
    g = torch.Generator().manual_seed(0)
    logits = 4.0 * torch.randn(2, 7, 24, generator=g)
    labels = torch.randint(0, 24, (2, 7), generator=g)
    for temperature in (1.0, 0.7):
        logp, ent = logprobs_entropy(logits, labels, temperature, with_entropy=True)
        ref_all = torch.log_softmax(logits.double() / temperature, dim=-1)
        ref_logp = ref_all.gather(-1, labels[..., None]).squeeze(-1)
        ref_ent = -(ref_all.exp() * ref_all).sum(-1)
        torch.testing.assert_close(logp, ref_logp.float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, ref_ent.float(), rtol=1e-5, atol=1e-5)
    assert logprobs_entropy(logits, labels, 1.0, with_entropy=False)[1] is None


def test_entropy_as_a_metric_has_no_graph(megatron_tp1):
    """entropy_grad=False (entropy_coef 0): the same entropy, without autograd; log-prob gradients
    unchanged. GRPOLoss asks for the gradient only with an entropy term."""
    from periodic_async.actor.logprobs import logprobs_entropy
    from periodic_async.algo import build_policy_loss
    from periodic_async.config import ActorConfig
    g = torch.Generator().manual_seed(0)
    logits = (4.0 * torch.randn(2, 7, 24, generator=g)).requires_grad_()
    labels = torch.randint(0, 24, (2, 7), generator=g)
    logp, ent = logprobs_entropy(logits, labels, 0.7, with_entropy=True)
    logp2, ent2 = logprobs_entropy(logits, labels, 0.7, with_entropy=True, entropy_grad=False)
    assert ent.requires_grad and not ent2.requires_grad
    torch.testing.assert_close(ent2, ent.detach(), rtol=0, atol=1e-6)
    gs = [torch.autograd.grad(lp.sum(), logits)[0] for lp in (logp, logp2)]
    assert torch.equal(gs[0], gs[1])
    assert build_policy_loss("grpo", ActorConfig(entropy_coef=0.0)).entropy_grad is False
    assert build_policy_loss("grpo", ActorConfig(entropy_coef=0.01)).entropy_grad is True


# ---------------------------------------------------------------------- fused QKV layout


def _arch(heads: int, kv_heads: int, head_dim: int) -> ModelArch:
    return ModelArch(arch="qwen2", vocab_size=24, hidden_size=heads * head_dim, ffn_hidden_size=8, num_layers=1,
                     num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rope_theta=1e4,
                     rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=16, qkv_bias=True)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 8), (4, 4, 8), (6, 2, 4), (8, 1, 4), (14, 2, 8)])
def test_fuse_split_qkv_are_inverse_with_megatron_group_layout(heads, kv_heads, head_dim):
    arch = _arch(heads, kv_heads, head_dim)
    g = torch.Generator().manual_seed(heads * 100 + kv_heads)
    q_per_g = heads // kv_heads
    for rest in ((5,), ()):                               # weights [out, H] and biases [out]
        q = torch.randn(heads * head_dim, *rest, generator=g)
        k = torch.randn(kv_heads * head_dim, *rest, generator=g)
        v = torch.randn(kv_heads * head_dim, *rest, generator=g)
        fused = fuse_qkv(q, k, v, arch)
        assert fused.shape == ((heads + 2 * kv_heads) * head_dim, *rest)
        # Megatron's layout: per query group j, [its q heads | k_j | v_j]
        blocks = fused.reshape(kv_heads, q_per_g + 2, head_dim, *rest)
        for j in range(kv_heads):
            qj = q.reshape(heads, head_dim, *rest)[j * q_per_g:(j + 1) * q_per_g]
            assert torch.equal(blocks[j, :q_per_g], qj)
            assert torch.equal(blocks[j, q_per_g], k.reshape(kv_heads, head_dim, *rest)[j])
            assert torch.equal(blocks[j, q_per_g + 1], v.reshape(kv_heads, head_dim, *rest)[j])
        q2, k2, v2 = split_qkv(fused, arch)
        assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)
        assert torch.equal(fuse_qkv(q2, k2, v2, arch), fused)


# ---------------------------------------------------------------------- config parsing


def _hf_config(**over) -> dict:
    c = dict(model_type="qwen2", vocab_size=24, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=True,
             rope_theta=1e6, max_position_embeddings=128, eos_token_id=1)
    c.update(over)
    return c


def test_arch_from_hf_dict_reads_the_architecture(model_dirs):
    s = arch_from_hf_dict(_hf_config())
    assert (s.arch, s.num_heads, s.num_kv_heads, s.head_dim, s.qkv_bias) == ("qwen2", 4, 2, 32, True)
    assert s.rope_theta == 1e6 and s.eos_token_id == 1
    s = arch_from_hf_dict(_hf_config(model_type="llama", head_dim=16, rope_theta=5e5, eos_token_id=[7, 8]))
    assert (s.arch, s.head_dim, s.qkv_bias, s.rope_theta, s.eos_token_id) == ("llama", 16, False, 5e5, 7)
    # transformers v5 writes rope_parameters; our saved dirs round-trip through it
    for name, kw in ARCHS.items():
        s = arch_from_hf_dir(model_dirs[name])
        assert (s.arch, s.rope_theta, s.tie_word_embeddings) == (kw["arch"], 1e6, kw["tied"])


def test_spec_rejects_unsupported_model_type():
    with pytest.raises(UnsupportedModel) as e:
        arch_from_hf_dict(_hf_config(model_type="mistral"), source="/m/config.json")
    msg = str(e.value)
    assert "/m/config.json" in msg and "model_type" in msg and "'mistral'" in msg and "qwen2, llama" in msg


@pytest.mark.parametrize("over, kind", [
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "linear"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "yarn"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}), "llama3"),
])
def test_spec_rejects_rope_scaling(over, kind):
    with pytest.raises(UnsupportedModel) as e:
        arch_from_hf_dict(_hf_config(**over), source="/m/config.json")
    msg = str(e.value)
    assert "/m/config.json" in msg and "rope scaling" in msg and f"'{kind}'" in msg and "default" in msg


def test_tiny_model_has_one_rope_base_in_hf_vllm_and_megatron(tmp_path):
    """transformers 4.x (the Ascend stack's 4.57.1) reads `rope_theta`, 5.x `rope_parameters`: the
    tiny model's config must set the base in the installed version's own key, or HF (and vLLM 0.11,
    which reads `config.rope_theta` from the same AutoConfig) rotate with 1e4 while Megatron uses
    1e6. Run in both environments by ./run.sh test (the second: tests/ascend_stack.txt)."""
    import transformers
    from transformers import AutoConfig
    from periodic_async.config import TinyModelConfig
    from periodic_async.models.tiny import make_tiny_model_dir
    cfg = TinyModelConfig()
    path = make_tiny_model_dir(cfg, str(tmp_path / "tiny"), seed=0)
    arch = arch_from_hf_dir(path)
    assert arch.rope_theta == cfg.rope_theta != 10000.0
    hf_cfg = AutoConfig.from_pretrained(path)
    if int(transformers.__version__.split(".")[0]) >= 5:
        assert hf_cfg.rope_parameters["rope_theta"] == cfg.rope_theta
    else:
        assert hf_cfg.rope_theta == cfg.rope_theta     # what vLLM 0.11's Qwen2 reads
    model = load_hf_model(path)
    inv_freq = model.model.rotary_emb.inv_freq
    dim = 2 * inv_freq.numel()
    want = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    torch.testing.assert_close(inv_freq.double(), want, rtol=1e-6, atol=0)


def test_rope_base_written_twice_must_agree():
    with pytest.raises(UnsupportedModel, match="rope_theta 10000.0 disagrees with rope_parameters.rope_theta 1000000.0"):
        arch_from_hf_dict(_hf_config(rope_theta=10000.0, rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    assert arch_from_hf_dict(_hf_config(rope_parameters={"rope_type": "default", "rope_theta": 1e6})).rope_theta == 1e6
