"""Architectures of a few public checkpoints, for planning without the checkpoint on this machine.

The memory plan (periodic_async/memory_plan.py) of a cluster config is usually made where
`model.path` (e.g. /data/Qwen2.5-7B-Instruct) does not exist; the directory's basename then picks
the architecture here. Only the config.json fields that `arch_from_hf_dict` reads, copied from the
checkpoints' Hugging Face config.json files. Never used when the directory exists: its own
config.json wins.
"""
from __future__ import annotations

import os


def _qwen2(hidden: int, ffn: int, layers: int, heads: int, kv_heads: int, vocab: int, tied: bool) -> dict:
    return {"model_type": "qwen2", "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "vocab_size": vocab,
            "tie_word_embeddings": tied, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-06, "eos_token_id": 151645, "use_sliding_window": False}


KNOWN_HF_CONFIGS: dict[str, dict] = {
    # Qwen2.5 instruct: the small two tie the output layer to the embedding, the others do not
    "Qwen2.5-0.5B-Instruct": _qwen2(896, 4864, 24, 14, 2, 151936, tied=True),
    "Qwen2.5-1.5B-Instruct": _qwen2(1536, 8960, 28, 12, 2, 151936, tied=True),
    "Qwen2.5-7B-Instruct": _qwen2(3584, 18944, 28, 28, 4, 152064, tied=False),
    "Qwen2.5-14B-Instruct": _qwen2(5120, 13824, 48, 40, 8, 152064, tied=False),
}


def known_hf_config(path: str) -> tuple[str, dict] | None:
    """(name, config dict) of the known checkpoint named by `path`'s basename (case-insensitive),
    or None."""
    base = os.path.basename(os.path.normpath(path)).lower()
    for name, cfg in KNOWN_HF_CONFIGS.items():
        if name.lower() == base:
            return name, dict(cfg)
    return None
