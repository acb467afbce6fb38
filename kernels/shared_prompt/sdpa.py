"""CPU path: PyTorch scaled_dot_product_attention (FlexAttention has no CPU backward in torch 2.13).

Two variants over the same layout, both exact, forward and backward:
- `sdpa_segmented` (impl "sdpa", the default on CPU): gathers each prompt into a causal batch and
  each response into a batch whose keys are [its prompt | itself], so the attention work is
  P^2/2 + sum_k R_k (P + R_k/2) per group - the shared-prompt ideal - and no S x S mask exists.
  Padding tokens get a zero attention output (they carry no loss and nothing attends to them).
- `sdpa_dense` (impl "sdpa_dense"): one SDPA call over the packed rows with the dense
  [B, 1, S, S] mask; simple, used as a cross-check; its cost grows with (P + sum R)^2.

SDPA's boolean attn_mask means True = ATTEND, the opposite of Megatron's convention, so the dense
Megatron-style mask is inverted here. (transformers' "eager" attention silently mishandles boolean
4D masks - see the platform notes; this module never goes through HF attention.)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .layout import SharedPromptLayout


def sdpa_dense(q, k, v, layout: SharedPromptLayout, scale: float | None = None) -> torch.Tensor:
    """q [B, Hq, S, D], k/v [B, Hkv, S, D] -> [B, Hq, S, D]."""
    attend = ~layout.dense_mask(q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attend, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def sdpa_segmented(q, k, v, layout: SharedPromptLayout, scale: float | None = None) -> torch.Tensor:
    """q [B, Hq, S, D], k/v [B, Hkv, S, D] -> [B, Hq, S, D] (zeros at padding positions)."""
    b, h, s, d = q.shape
    hkv = k.shape[1]
    gqa = h != hkv
    idx = layout.segment_index(q.device)
    qf = q.transpose(1, 2).reshape(b * s, h, d)
    kf = k.transpose(1, 2).reshape(b * s, hkv, d)
    vf = v.transpose(1, 2).reshape(b * s, hkv, d)
    outs = []
    if idx.prompt_idx.numel():
        qp, kp, vp = (t[idx.prompt_idx].transpose(1, 2) for t in (qf, kf, vf))       # [G, H, Pmax, D]
        op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=gqa)
        outs.append(op.transpose(1, 2)[idx.prompt_valid])
    if idx.resp_q_idx.numel():
        qr = qf[idx.resp_q_idx].transpose(1, 2)                                         # [N, H, Rmax, D]
        kr = kf[idx.resp_kv_idx].transpose(1, 2)                                        # [N, Hkv, Pmax+Rmax, D]
        vr = vf[idx.resp_kv_idx].transpose(1, 2)
        orr = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=idx.resp_attend, scale=scale,
                                             enable_gqa=gqa)
        outs.append(orr.transpose(1, 2)[idx.resp_valid])
    out = qf.new_zeros(b * s, h, d).index_copy(0, idx.out_index, torch.cat(outs))
    return out.view(b, s, h, d).transpose(1, 2)
