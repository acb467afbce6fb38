"""CUDA path: FlexAttention with a block mask built on the device.

The BlockMask is built once per micro-batch (cached on the layout, shared by every layer) with
`create_block_mask(..., device=q.device)` - its default device is "cuda" - from the layout's
`mask_mod` (True = ATTEND). Blocks that no query of a tile may see (other responses, other
groups, padding) are skipped, so the kernel does close to the shared-prompt ideal work without
an S x S mask. On CUDA both the block-mask construction and flex_attention are compiled
(forward and backward). On CPU (tests only) flex_attention runs eagerly, forward only: torch 2.13
has no CPU backward for it.
"""
from __future__ import annotations

import torch

from .layout import SharedPromptLayout

_COMPILED = None


def _compiled_flex():
    global _COMPILED
    if _COMPILED is None:
        from torch.nn.attention.flex_attention import flex_attention
        _COMPILED = torch.compile(flex_attention)
    return _COMPILED


def block_mask(layout: SharedPromptLayout, device, block_size: int = 128):
    from torch.nn.attention.flex_attention import create_block_mask
    device = torch.device(device)

    def build():
        return create_block_mask(layout.mask_mod(device), layout.batch_size, None, layout.seq_len,
                                 layout.seq_len, device=device, BLOCK_SIZE=block_size,
                                 _compile=device.type != "cpu")
    return layout.cached(("flex_block_mask", device, block_size), build)


def flex_shared_prompt(q, k, v, layout: SharedPromptLayout, scale: float | None = None) -> torch.Tensor:
    """q [B, Hq, S, D], k/v [B, Hkv, S, D] -> [B, Hq, S, D]."""
    from torch.nn.attention.flex_attention import flex_attention
    bm = block_mask(layout, q.device)
    gqa = q.shape[1] != k.shape[1]
    if q.device.type == "cpu":       # eager, forward only (tests); silence the "not compiled" warning
        import warnings
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            return flex_attention(q, k, v, block_mask=bm, scale=scale, enable_gqa=gqa)
    return _compiled_flex()(q, k, v, block_mask=bm, scale=scale, enable_gqa=gqa)
