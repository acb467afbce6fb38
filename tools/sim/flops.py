"""Model shape and FLOPs, for tools/profile_run.py (achieved FLOP/s, MFU) and the hardware
projection (projection.py).

A forward over S tokens is 2 N S + 2 L d S (S + 1) (N: matmul parameters incl. the LM head, L
layers, d = heads x head_dim; causal attention, QK^T and AV); generating a response of R tokens
after a prompt of P runs the model over P + R - 1 tokens; training a sample runs 3 forwards' worth
(forward + backward) of the policy over its P + R tokens, plus one forward of the reference (and
of the old policy when ppo_epochs > 1) per epoch.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool = True
    qkv_bias: bool = True

    @classmethod
    def from_hf_config(cls, c: dict) -> "ModelShape":
        heads = c["num_attention_heads"]
        return cls(hidden=c["hidden_size"], layers=c["num_hidden_layers"], heads=heads,
                   kv_heads=c.get("num_key_value_heads") or heads,
                   head_dim=c.get("head_dim") or c["hidden_size"] // heads, ffn=c["intermediate_size"],
                   vocab=c["vocab_size"], tied=bool(c.get("tie_word_embeddings", False)),
                   qkv_bias=c.get("model_type", "qwen2") == "qwen2")

    @property
    def attn_dim(self) -> int:
        return self.heads * self.head_dim

    def _layer_matmul(self) -> int:
        h, q, kv = self.hidden, self.attn_dim, self.kv_heads * self.head_dim
        return h * (q + 2 * kv) + q * h + 3 * h * self.ffn

    @property
    def matmul_params(self) -> int:
        """Parameters that multiply every token: the layers' linear weights and the LM head."""
        return self.layers * self._layer_matmul() + self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        bias = (self.attn_dim + 2 * self.kv_heads * self.head_dim) if self.qkv_bias else 0
        layer = self._layer_matmul() + bias + 2 * self.hidden
        return self.layers * layer + self.hidden + self.vocab * self.hidden * (1 if self.tied else 2)

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


def forward_flops(shape: ModelShape, tokens: int) -> float:
    """One causal forward over `tokens` positions: 2 N S (matmuls) + 2 L d S (S + 1) (attention)."""
    s = max(0, tokens)
    return 2.0 * shape.matmul_params * s + 2.0 * shape.layers * shape.attn_dim * s * (s + 1)


def generation_flops(shape: ModelShape, prompt: int, response: int) -> float:
    """Prefill of the prompt and decode of the response: the model runs over P + R - 1 tokens
    (the last sampled token is never fed back)."""
    return forward_flops(shape, prompt + response - 1)


def training_flops(shape: ModelShape, prompt: int, response: int, ppo_epochs: int = 1, reference: bool = True,
                   old_shortcut: bool = True) -> float:
    """The tri-model step over one sample of P + R tokens: per epoch the policy's forward and
    backward (3 forwards' worth) and the reference's forward; the old policy's forward in epochs
    2.. (and in epoch 1 too without the shortcut)."""
    f = forward_flops(shape, prompt + response)
    old = ppo_epochs - 1 if old_shortcut else ppo_epochs
    return f * (3 * ppo_epochs + (ppo_epochs if reference else 0) + old)
