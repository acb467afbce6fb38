"""One decode step of a Qwen2 / Llama-style model without the transformers forward around it.

The HF engine's decode step (hf_engine.py `_decode`) is one token per row through the model's
`forward`: per call it builds the 4-D attention mask, dispatches the attention interface per layer,
repeats the K / V heads for grouped-query attention and runs q, k, v and gate, up as separate
matmuls. This module runs the same modules' weights directly (issue 30 took that overhead for most
of a small model's step; measured, the two steps are level at 64 rows: docs/performance.md "FLOP/s
account, a lean decode step and chunked rewards"):

- q, k, v as one matmul and gate, up as one: the model's own parameters are made views of one
  fused weight per layer (`fuse_weights`), so the prefill (still the HF forward), weight sync
  (`copy_` into the parameters) and this step all see the same storage - nothing to refresh;
- attention for the one new query per row as two batched matmuls against the KV heads as they are
  ([B, kv, g, d] @ [B, kv, d, W]): no copy of K / V per query head;
- the additive mask from the batch's [B, W] attention row in one op; the KV written in place into
  the engine's roomy cache buffers (hf_engine._RoomyLayer.update).

Equal to the HF forward within float rounding (tests/test_rollout.py: tokens identical, log-probs
within 1e-5); models it does not know (another architecture, sliding-window attention, q / k norms)
keep the HF forward (`supports`).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

_KNOWN = ("qwen2", "llama")


def supports(model) -> bool:
    """Whether `lean_decode_step` computes exactly what `model.forward` does for one decode token."""
    c = model.config
    return (getattr(c, "model_type", None) in _KNOWN and getattr(c, "hidden_act", "silu") == "silu"
            and not getattr(c, "use_sliding_window", False) and not getattr(c, "mlp_bias", False)
            and all(hasattr(layer.self_attn, p) for layer in model.model.layers
                    for p in ("q_proj", "k_proj", "v_proj", "o_proj")))


def fuse_weights(model) -> list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]]:
    """Per layer (qkv weight [q+2kv, H], qkv bias or None, gate_up weight [2F, H]); the layer's
    q / k / v and gate / up parameters become views of them (same values, one storage)."""
    fused = []
    for layer in model.model.layers:
        a, mlp = layer.self_attn, layer.mlp
        qkv = _fuse([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
        bias = (_fuse([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]) if a.q_proj.bias is not None else None)
        gate_up = _fuse([mlp.gate_proj.weight, mlp.up_proj.weight])
        fused.append((qkv, bias, gate_up))
    return fused


def _fuse(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """Concatenate along dim 0 and point each parameter's data at its rows of the result."""
    whole = torch.cat([p.detach() for p in params])
    row = 0
    for p in params:
        p.data = whole[row:row + p.shape[0]]
        row += p.shape[0]
    return whole


@functools.cache
def compiled_lean_decode_step():
    """`lean_decode_step` through torch.compile with dynamic shapes, one per process (the engines
    of a process share its compiled graphs). Equal to the eager step in tokens, log-probs within
    float rounding (tests/test_rollout.py)."""
    return torch.compile(lean_decode_step, dynamic=True)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@torch.no_grad()
def lean_decode_step(model, fused, next_ids: torch.Tensor, pos: torch.Tensor, attn: torch.Tensor,
                     cache_layers) -> torch.Tensor:
    """Logits [B, V] fp32 of one token per row.

    next_ids [B] long: the token to feed; pos [B] long: its position; attn [B, W] long: 1 where a
    cache column (after this token's, the last) holds one of the row's tokens; cache_layers: the
    roomy layers, keys / values [B, kv, W - 1, d] before the call, this token's column written."""
    m, c = model.model, model.config
    b = next_ids.shape[0]
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    d = getattr(c, "head_dim", None) or c.hidden_size // heads
    g = heads // kv_heads
    x = m.embed_tokens(next_ids[:, None])                                  # [B, 1, H]
    cos, sin = m.rotary_emb(x, pos[:, None])                               # [B, 1, d]
    cos, sin = cos[:, None], sin[:, None]                                  # [B, 1, 1, d]
    mask = torch.zeros(attn.shape, dtype=x.dtype, device=x.device).masked_fill_(attn == 0, float("-inf"))
    mask = mask[:, None, None, :]                                          # [B, 1, 1, W]
    for layer, (w_qkv, b_qkv, w_gate_up), cache in zip(m.layers, fused, cache_layers):
        a = layer.self_attn
        qkv = F.linear(layer.input_layernorm(x), w_qkv, b_qkv)            # [B, 1, (heads + 2 kv) d]
        q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        q = q.view(b, 1, heads, d).transpose(1, 2)                         # [B, heads, 1, d]
        k = k.view(b, 1, kv_heads, d).transpose(1, 2)                      # [B, kv, 1, d]
        v = v.view(b, 1, kv_heads, d).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        keys, values = cache.update(k, v)                                  # [B, kv, W, d], in place
        q = q.reshape(b, kv_heads, g, d)                                   # query heads of a KV head together
        scores = torch.matmul(q, keys.transpose(-1, -2)) * a.scaling + mask      # [B, kv, g, W]
        o = torch.matmul(torch.softmax(scores, dim=-1), values)           # [B, kv, g, d]
        x = x + a.o_proj(o.reshape(b, 1, heads * d))
        gate, up = F.linear(layer.post_attention_layernorm(x), w_gate_up).chunk(2, dim=-1)
        x = x + layer.mlp.down_proj(F.silu(gate) * up)
    return model.lm_head(m.norm(x))[:, -1, :].float()
