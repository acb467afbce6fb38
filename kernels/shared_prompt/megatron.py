"""Megatron-core core-attention modules on torch SDPA: plain masks, and shared-prompt packing.

`SDPACoreAttention` (the unshared training model, `build_gpt_model(..., core_attention="sdpa")`, the
default) and `SharedPromptCoreAttention` (`core_attention="shared_prompt"`) have
DotProductAttention's constructor and forward signature, so they go into the layer spec at
`self_attention.submodules.core_attention` (periodic_async/models/mcore.py). Inputs are Megatron's
query [sq, b, np, hn], key/value [sk, b, ng, hn] with np / ng the heads of THIS tensor-parallel rank
(heads / TP), output [sq, b, np * hn]; attention is per head, so TP needs nothing else.

How the layout reaches it: the `SharedPromptLayout` object is passed as GPTModel's
`attention_mask` argument; Megatron forwards that argument untouched through the TransformerBlock
and every TransformerLayer / SelfAttention down to here (no S x S mask is built for the flex and
npu_fusion paths; the sdpa path builds only per-segment masks). A plain tensor mask (bool,
True = masked out, Megatron's convention) or None (causal) is also accepted, so the same model
runs unshared micro-batches exactly like the local DotProductAttention; the causal mask itself
(`pack_unshared`'s) runs as SDPA's is_causal (`is_causal_mask`).
RoPE is applied before core attention, from position ids: see `PositionRopeGPTModel` in mcore.py.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from . import shared_prompt_attention
from .layout import SharedPromptLayout


_CAUSAL_SEEN: list = [None, -1]      # [weakref(mask), mask._version]: the last mask found causal


def is_causal_mask(mask: torch.Tensor) -> bool:
    """Whether a Megatron-convention bool mask (True = masked out), [1 | B, 1, S, S], is exactly
    the causal one (True strictly above the diagonal) - what `pack_unshared` builds: right padding
    needs no mask (pad positions come after every real token and carry no loss). Checked once per
    mask tensor: every layer of a forward gets the same tensor, and the last one found causal is
    remembered by a weak reference and its version counter (an in-place change re-checks it)."""
    ref, version = _CAUSAL_SEEN
    if ref is not None and ref() is mask and mask._version == version:
        return True
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-1] != mask.shape[-2]:
        return False
    s = mask.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=mask.device).triu(1)
    if not bool((mask == causal).all()):
        return False
    import weakref
    _CAUSAL_SEEN[:] = [weakref.ref(mask), mask._version]
    return True


class SDPACoreAttention(MegatronModule):
    """DotProductAttention's drop-in (constructor and forward signature) on
    torch.nn.functional.scaled_dot_product_attention: query [sq, b, np, hn], key / value
    [sk, b, ng, hn] (np / ng this TP rank's heads), output [sq, b, np * hn].

    attention_mask: None (causal for a causal layer, else none), or a bool tensor, True = masked
    out (Megatron's convention, inverted for SDPA). The causal mask itself runs as `is_causal` (no
    mask tensor, SDPA skips the blocks above the diagonal); GQA runs without repeating K/V. Exact
    attention without dropout (RL uses 0), vanilla softmax, no context parallelism or sliding
    window; anything else is refused at construction."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__(config=config)
        name = type(self).__name__
        if config.context_parallel_size != 1:
            raise ValueError(f"{name} does not support context parallelism")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"{name} is exact attention without dropout; got "
                             f"attention_dropout={dropout} (RL training uses 0)")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"{name} supports softmax_type='vanilla' only, got {config.softmax_type}")
        if getattr(config, "window_size", None) is not None:
            raise ValueError(f"{name} does not support sliding-window attention")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        head_dim = config.kv_channels
        # DotProductAttention divides the scale by layer_number under apply_query_key_layer_scaling
        # and multiplies it back in the softmax: the net scale is the same.
        self.softmax_scale = softmax_scale if softmax_scale is not None else head_dim ** -0.5

    def _check(self, attention_bias, packed_seq_params):
        if packed_seq_params is not None:
            raise ValueError(f"{type(self).__name__} does not take packed_seq_params")
        if attention_bias is not None:
            raise ValueError(f"attention_bias is not supported by {type(self).__name__}")

    def _sdpa(self, q, k, v, attention_mask, attn_mask_type):
        """q [b, np, sq, hn], k / v [b, ng, sk, hn], Megatron-convention mask -> [b, np, sq, hn]."""
        from megatron.core.transformer.enums import AttnMaskType
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        causal = False
        attend = None
        if attention_mask is None:
            causal = mask_type == AttnMaskType.causal and q.shape[2] > 1
        elif q.shape[2] == k.shape[2] and is_causal_mask(attention_mask):
            causal = True
        else:
            attend = ~attention_mask
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attend, is_causal=causal,
                                              scale=self.softmax_scale, enable_gqa=q.shape[1] != k.shape[1])

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        self._check(attention_bias, packed_seq_params)
        sq, b, h, d = query.shape
        out = self._sdpa(query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3),
                         attention_mask, attn_mask_type)
        return out.permute(2, 0, 1, 3).reshape(sq, b, h * d)


class SharedPromptCoreAttention(SDPACoreAttention):
    """SDPACoreAttention whose attention_mask may also be a `SharedPromptLayout` (the shared-prompt
    kernels, `attention_impl`: the backend's name); a plain mask or None runs as SDPACoreAttention,
    so the same model runs unshared micro-batches exactly like the local DotProductAttention."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None, attention_impl: str = "sdpa"):
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout,
                         softmax_scale, cp_comm_type, pg_collection)
        self.attention_impl = attention_impl

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        self._check(attention_bias, packed_seq_params)
        sq, b, h, d = query.shape
        q = query.permute(1, 2, 0, 3)            # [b, np, sq, hn]
        k = key.permute(1, 2, 0, 3)              # [b, ng, sk, hn]
        v = value.permute(1, 2, 0, 3)
        if isinstance(attention_mask, SharedPromptLayout):
            out = shared_prompt_attention(q, k, v, attention_mask, self.attention_impl, scale=self.softmax_scale)
        else:
            out = self._sdpa(q, k, v, attention_mask, attn_mask_type)
        return out.permute(2, 0, 1, 3).reshape(sq, b, h * d)
