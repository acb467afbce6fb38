"""Ascend NPU path: torch_npu.npu_fusion_attention in TND (varlen) layout, sparse_mode=3.

Why TND rather than BNSD with a per-group mask: BNSD needs a [B, 1, S, S] boolean mask (S = the
packed row) and computes every S x S score; in TND each attention segment is its own variable-length
sequence, so nothing outside the shared-prompt structure is computed and no S x S mask exists.
Segments (built by `SharedPromptLayout.npu_tnd_args`, unit-tested on CPU):
- each prompt: queries = keys = the prompt (Sq = Skv = P);
- each response k: queries = its R_k tokens, keys/values = [its prompt | itself] (Skv = P + R_k).
`actual_seq_qlen` / `actual_seq_kvlen` are the CUMULATIVE lengths of these segments (lengths
2, 2, 2 are passed as 2, 4, 6). `sparse_mode=3` (rightDownCausal) with the compressed
2048 x 2048 upper-triangular `atten_mask` (True = masked out) lets query i of a segment see keys
0 .. Skv - Sq + i: plain causal for a prompt, "all of the prompt + causal within the response"
for a response. Skv >= Sq everywhere, so no row is fully masked (the varlen constraint).
The price: each response gathers its prompt's K/V once more (memory K * P * Hkv * D per layer);
queries, scores and the prompt's own attention are computed once.

The call itself only runs on an Ascend NPU with torch_npu (never imported elsewhere); GQA is
native (Nq / Nkv integer), fp32/bf16/fp16 are accepted. Padding tokens are in no segment and get a
zero output.
"""
from __future__ import annotations

import torch

from .layout import SharedPromptLayout


def npu_shared_prompt(q, k, v, layout: SharedPromptLayout, scale: float | None = None) -> torch.Tensor:
    """q [B, Hq, S, D], k/v [B, Hkv, S, D] -> [B, Hq, S, D]."""
    import torch_npu  # only on Ascend; see backend.py / docs/running-on-910b.md

    b, h, s, d = q.shape
    hkv = k.shape[1]
    if scale is None:
        scale = d ** -0.5
    qf = q.transpose(1, 2).reshape(b * s, h, d)
    kf = k.transpose(1, 2).reshape(b * s, hkv, d)
    vf = v.transpose(1, 2).reshape(b * s, hkv, d)
    outs, where = [], []
    for args in layout.npu_tnd_args(q.device):
        out = torch_npu.npu_fusion_attention(
            qf.index_select(0, args.q_index), kf.index_select(0, args.kv_index),
            vf.index_select(0, args.kv_index), h, args.input_layout,
            atten_mask=args.atten_mask, scale=scale, keep_prob=1.0,
            actual_seq_qlen=args.actual_seq_qlen, actual_seq_kvlen=args.actual_seq_kvlen,
            sparse_mode=args.sparse_mode)[0]                                  # [Tq, H, D]
        outs.append(out)
        where.append(args.q_index)
    full = qf.new_zeros(b * s, h, d).index_copy(0, torch.cat(where), torch.cat(outs))
    return full.view(b, s, h, d).transpose(1, 2)
