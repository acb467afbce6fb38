"""HF <-> Megatron-core conversion and the Megatron GPT model at TP=1 (in-process, cpu backend):
exact weight round trips, logits equal to transformers', the vocab-parallel log-prob math, the
fused-QKV layout helpers, and clear rejection of unsupported configs."""
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


def _mcore_model(path: str):
    arch = arch_from_hf_dir(path)
    model = build_gpt_model(arch)
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


@pytest.mark.parametrize("name", list(ARCHS))
def test_mcore_logits_equal_hf_logits(name, model_dirs, megatron_tp1):
    path = model_dirs[name]
    arch, model = _mcore_model(path)
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
