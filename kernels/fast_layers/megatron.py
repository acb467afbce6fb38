"""Megatron-core modules of the training fast paths, for the local layer spec
(`fast_layer_spec` / `fast_block_spec` in periodic_async/models/mcore.py put them in):
`RopeSelfAttention` (RoPE from cos / sin tables computed once per forward, `RotaryFunction`),
`SwiGLUMLP` (`SwiGLUFunction`) and `RMSNorm` (`RMSNormFunction`; the autograd functions are in
autograd.py). Each takes its Megatron counterpart's constructor, parameters and state dict, and
falls back to Megatron's (or torch's) own forward outside the plain training case it covers.
Imports megatron.core: import this module only where Megatron is wanted (mcore.py does so on first
use).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP

from .autograd import RMSNormFunction, RotaryFunction, SwiGLUFunction, rope_tables


class RMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm (what Megatron's WrappedTorchNorm builds: same parameter, same state dict)
    built from Megatron's norm arguments; fp32 runs `RMSNormFunction`, other dtypes torch's."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        if config.normalization != "RMSNorm" or config.sequence_parallel or config.layernorm_zero_centered_gamma:
            raise ValueError("RMSNorm: normalization RMSNorm without sequence parallelism or zero-centered gamma only")
        super().__init__(normalized_shape=hidden_size, eps=eps)

    def forward(self, x):
        if x.dtype != torch.float32 or self.weight.dtype != torch.float32:
            return super().forward(x)
        return RMSNormFunction.apply(x, self.weight, self.eps)


class SwiGLUMLP(MLP):
    """Megatron's MLP; with SwiGLU (gated, silu, no clamp / offset / TE activation / fusion) the
    activation is `SwiGLUFunction`. Anything else runs Megatron's forward."""

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        c = self.config
        if (per_token_scale is not None or not c.gated_linear_unit or c.activation_func is not F.silu
                or c.use_te_activation_func or c.bias_activation_fusion
                or getattr(c, "activation_func_clamp_value", None) is not None
                or getattr(c, "glu_linear_offset", 0.0) != 0.0):
            return super().forward(hidden_states, per_token_scale, **kwargs)
        y, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            y = y + bias
        return self.linear_fc2(SwiGLUFunction.apply(y))


class RopeSelfAttention(SelfAttention):
    """Megatron's SelfAttention; the training / plain forward path (no inference context, no
    packed sequences, no cross attention, bias, output gate, offloading or recompute, full
    non-interleaved RoPE without scaling) applies RoPE with `RotaryFunction` from tables made
    once per forward (`rope_tables`) and calls the core attention and the output projection
    exactly as Megatron does. Any other case runs Megatron's forward."""

    def _plain(self, key_value_states, inference_context, rotary_pos_emb, rotary_pos_cos,
               rotary_pos_sin, rotary_pos_cos_sin, attention_bias, packed_seq_params, sequence_len_offset,
               inference_params) -> bool:
        c = self.config
        if (key_value_states is not None or inference_context is not None or inference_params is not None
                or rotary_pos_cos is not None or rotary_pos_sin is not None or rotary_pos_cos_sin is not None
                or attention_bias is not None or packed_seq_params is not None
                or sequence_len_offset is not None):
            return False
        if (c.attention_output_gate or c.no_rope_freq or c.rotary_interleaved or c.multi_latent_attention
                or c.apply_rope_fusion or c.fused_single_qkv_rope or c.flash_decode or c.test_mode
                or getattr(c, "yarn_rotary_scaling_factor", None) is not None):
            return False
        if (getattr(self, "checkpoint_core_attention", False) and self.training) or any(
                getattr(self, f, False) for f in ("offload_qkv_linear", "offload_core_attention",
                                                  "offload_attn_proj")):
            return False
        if rotary_pos_emb is not None:
            embs = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,)
            if any(e is not None and e.shape[-1] != self.hidden_size_per_attention_head for e in embs):
                return False      # partial rotary
        return True

    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *,
                inference_params=None):
        if not self._plain(key_value_states, inference_context, rotary_pos_emb, rotary_pos_cos,
                           rotary_pos_sin, rotary_pos_cos_sin, attention_bias, packed_seq_params,
                           sequence_len_offset, inference_params):
            return super().forward(
                hidden_states, attention_mask, key_value_states=key_value_states,
                inference_context=inference_context, rotary_pos_emb=rotary_pos_emb,
                rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
                rotary_pos_cos_sin=rotary_pos_cos_sin, attention_bias=attention_bias,
                packed_seq_params=packed_seq_params, sequence_len_offset=sequence_len_offset,
                inference_params=inference_params)
        query, key, value = self.get_query_key_value_tensors(hidden_states, None)   # [sq, b, heads, hn]
        if rotary_pos_emb is not None:
            q_emb, k_emb = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
            if q_emb is not None:
                query = RotaryFunction.apply(query, *rope_tables(q_emb, query.dtype))
            if k_emb is not None:
                key = RotaryFunction.apply(key, *rope_tables(k_emb, key.dtype))
        core_attn_out = self.core_attention(query, key, value, attention_mask,
                                            attn_mask_type=self.attn_mask_type, attention_bias=None,
                                            packed_seq_params=None)
        return self.linear_proj(core_attn_out)
