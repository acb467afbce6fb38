"""Megatron-core core-attention module for shared-prompt packing.

`SharedPromptCoreAttention` has DotProductAttention's constructor and forward signature, so it goes
into the layer spec at `self_attention.submodules.core_attention` (periodic_async/models/mcore.py,
`build_gpt_model(..., core_attention="shared_prompt")`). Inputs are Megatron's
query [sq, b, np, hn], key/value [sk, b, ng, hn] with np / ng the heads of THIS tensor-parallel rank
(heads / TP), output [sq, b, np * hn]; attention is per head, so TP needs nothing else.

How the layout reaches it: the `SharedPromptLayout` object is passed as GPTModel's
`attention_mask` argument; Megatron forwards that argument untouched through the TransformerBlock
and every TransformerLayer / SelfAttention down to here (no S x S mask is built for the flex and
npu_fusion paths; the sdpa path builds only per-segment masks). A plain tensor mask (bool,
True = masked out, Megatron's convention) or None (causal) is also accepted, so the same model
runs unshared micro-batches exactly like the local DotProductAttention.
RoPE is applied before core attention, from position ids: see `PositionRopeGPTModel` in mcore.py.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from . import shared_prompt_attention
from .layout import SharedPromptLayout


class SharedPromptCoreAttention(MegatronModule):
    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None, attention_impl: str = "sdpa"):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("shared-prompt attention does not support context parallelism")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"shared-prompt attention is exact attention without dropout; got "
                             f"attention_dropout={dropout} (RL training uses 0)")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"shared-prompt attention supports softmax_type='vanilla' only, got {config.softmax_type}")
        if getattr(config, "window_size", None) is not None:
            raise ValueError("shared-prompt attention does not support sliding-window attention")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.attention_impl = attention_impl
        head_dim = config.kv_channels
        # DotProductAttention divides the scale by layer_number under apply_query_key_layer_scaling
        # and multiplies it back in the softmax: the net scale is the same.
        self.softmax_scale = softmax_scale if softmax_scale is not None else head_dim ** -0.5

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None:
            raise ValueError("shared-prompt attention takes its layout through attention_mask, not packed_seq_params")
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by shared-prompt attention")
        sq, b, h, d = query.shape
        q = query.permute(1, 2, 0, 3)            # [b, np, sq, hn]
        k = key.permute(1, 2, 0, 3)              # [b, ng, sk, hn]
        v = value.permute(1, 2, 0, 3)
        if isinstance(attention_mask, SharedPromptLayout):
            out = shared_prompt_attention(q, k, v, attention_mask, self.attention_impl, scale=self.softmax_scale)
        else:
            attend = None if attention_mask is None else ~attention_mask
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attend, is_causal=attention_mask is None,
                                                 scale=self.softmax_scale, enable_gqa=h != k.shape[1])
        return out.permute(2, 0, 1, 3).reshape(sq, b, h * d)
