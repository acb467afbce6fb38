"""Shared-prompt attention: one prompt, K responses, one packed sequence, exact gradients.

`shared_prompt_attention(q, k, v, layout, impl)` is the one entry point; `impl` is the backend's
`attention_impl` name (periodic_async/backend.py): "sdpa" (CPU: dense-mask or segmented SDPA,
chosen per micro-batch), "flex" (CUDA), "npu_fusion" (Ascend); "sdpa_dense" and
"sdpa_segmented" force one SDPA variant. q [B, Hq, S, D], k/v [B, Hkv, S, D]
(Hq a multiple of Hkv), result [B, Hq, S, D]. The layout (packing, masks per backend, label
gather) is in layout.py; the Megatron core-attention module in megatron.py; see
docs/shared-prompt.md.
"""
from __future__ import annotations

from .layout import (PackedGroups, SharedPromptLayout, attention_flop_ratio, ideal_token_ratio,
                     pack_groups)

IMPLS = ("sdpa", "sdpa_dense", "sdpa_segmented", "flex", "npu_fusion")


def shared_prompt_attention(q, k, v, layout: SharedPromptLayout, impl: str, scale: float | None = None):
    if impl == "sdpa":
        from .sdpa import sdpa_auto
        return sdpa_auto(q, k, v, layout, scale)
    if impl == "sdpa_segmented":
        from .sdpa import sdpa_segmented
        return sdpa_segmented(q, k, v, layout, scale)
    if impl == "sdpa_dense":
        from .sdpa import sdpa_dense
        return sdpa_dense(q, k, v, layout, scale)
    if impl == "flex":
        from .flex import flex_shared_prompt
        return flex_shared_prompt(q, k, v, layout, scale)
    if impl == "npu_fusion":
        from .npu import npu_shared_prompt
        return npu_shared_prompt(q, k, v, layout, scale)
    raise ValueError(f"shared_prompt_attention: unknown impl '{impl}'; allowed: {', '.join(IMPLS)}")


__all__ = ["shared_prompt_attention", "SharedPromptLayout", "PackedGroups", "pack_groups",
           "ideal_token_ratio", "attention_flop_ratio", "IMPLS"]
