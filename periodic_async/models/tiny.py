"""Build the tiny Qwen2-architecture model + char tokenizer as a local Hugging Face directory.

The embedded CPU run then loads it through exactly the path a real checkpoint takes
(HF directory -> Megatron-core), so the conversion code is exercised on every run.
"""
from __future__ import annotations

import os

import torch

from ..config import TinyModelConfig
from .tokenizer import build_char_tokenizer, mark_char_tokenizer


def tiny_hf_config(cfg: TinyModelConfig, vocab_size: int, eos_id: int, pad_id: int):
    from transformers import Qwen2Config
    return Qwen2Config(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_word_embeddings, rms_norm_eps=1e-6,
        eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None, architectures=["Qwen2ForCausalLM"])


def make_tiny_model_dir(cfg: TinyModelConfig, out_dir: str, seed: int) -> str:
    """Write config.json, model.safetensors and the tokenizer to `out_dir` (random init, seeded)."""
    from transformers import Qwen2ForCausalLM
    tok = build_char_tokenizer()
    hf_cfg = tiny_hf_config(cfg, len(tok), tok.eos_token_id, tok.pad_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(hf_cfg)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    mark_char_tokenizer(out_dir)
    return out_dir
