"""Build the tiny Qwen2-architecture model + char tokenizer as a local Hugging Face directory.

The embedded CPU run then loads it through exactly the path a real checkpoint takes
(HF directory -> Megatron-core), so the conversion code is exercised on every run.
"""
from __future__ import annotations

import os
from typing import Protocol

import torch

from .tokenizer import DEFAULT_ALPHABET, build_char_tokenizer, mark_char_tokenizer


class TinyShape(Protocol):
    """The tiny model's dimensions, as model.tiny (config.sections.TinyModelConfig) holds them;
    any object with these attributes will do (this layer does not import the config)."""
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    max_position_embeddings: int
    rope_theta: float
    tie_word_embeddings: bool


def rope_config_kwargs(theta: float) -> dict:
    """The Qwen2Config / LlamaConfig keyword that sets the RoPE base in the installed transformers.

    transformers 5 reads `rope_parameters`; 4.x (4.57.1 on the Ascend stack) keeps an unknown
    `rope_parameters` as a plain attribute and builds its rotary tables from `rope_theta`
    (default 1e4), so passing the 5.x form there silently gives HF and vLLM a different RoPE than
    Megatron's."""
    import transformers
    if int(transformers.__version__.split(".")[0]) >= 5:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    return {"rope_theta": theta}


def tiny_hf_config(cfg: TinyShape, vocab_size: int, eos_id: int, pad_id: int):
    from transformers import Qwen2Config
    return Qwen2Config(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=cfg.max_position_embeddings,
        **rope_config_kwargs(cfg.rope_theta),
        tie_word_embeddings=cfg.tie_word_embeddings, rms_norm_eps=1e-6,
        eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None, architectures=["Qwen2ForCausalLM"])


def make_tiny_model_dir(cfg: TinyShape, out_dir: str, seed: int, alphabet: str = DEFAULT_ALPHABET) -> str:
    """Write config.json, model.safetensors and the tokenizer (of `alphabet`) to `out_dir` (random
    init, seeded)."""
    from transformers import Qwen2ForCausalLM
    tok = build_char_tokenizer(alphabet)
    hf_cfg = tiny_hf_config(cfg, len(tok), tok.eos_token_id, tok.pad_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(hf_cfg)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    mark_char_tokenizer(out_dir)
    return out_dir


def make_random_model_dir(out_dir: str, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int,
                          vocab: int, seed: int = 0, max_positions: int = 4096, eos_token_id: int | None = 1) -> str:
    """A random-init Qwen2 checkpoint of any size, without a tokenizer (benchmarks feed token ids;
    eos_token_id None: no EOS, so generation lengths are fixed)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                      **rope_config_kwargs(1.0e6), tie_word_embeddings=True,
                      eos_token_id=eos_token_id, pad_token_id=0, bos_token_id=None,
                      architectures=["Qwen2ForCausalLM"])
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        Qwen2ForCausalLM(cfg).save_pretrained(out_dir)
    return out_dir


def tiny_arch(cfg: TinyShape, alphabet: str = DEFAULT_ALPHABET):
    """The ModelArch the tiny model will have, known before its directory is written."""
    from .mcore import arch_from_hf_dict
    tok = build_char_tokenizer(alphabet)
    return arch_from_hf_dict(tiny_hf_config(cfg, len(tok), tok.eos_token_id, tok.pad_token_id).to_dict(),
                             source="model.tiny")
