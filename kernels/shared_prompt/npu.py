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


def reference_npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None,
                                   atten_mask=None, scale=1.0, keep_prob=1.0, pre_tockens=2147483647,
                                   next_tockens=2147483647, inner_precise=0, prefix=None,
                                   actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                                   gen_mask_parallel=True, sync=False):
    """A plain-torch model of the documented npu_fusion_attention semantics for the case used
    above (TND, sparse_mode=3, compressed causal mask, no dropout), checking the documented
    argument constraints. Tests install it as a fake `torch_npu` so the whole NPU path except the
    kernel runs on CPU. Returns the 7-tuple with only the output filled in. Differentiable."""
    if input_layout != "TND" or sparse_mode != 3:
        raise NotImplementedError(f"reference covers TND + sparse_mode 3 only, got {input_layout}, {sparse_mode}")
    if pse is not None or padding_mask is not None or prefix is not None or keep_prob != 1.0:
        raise ValueError("pse / padding_mask / prefix / dropout are not used by shared-prompt attention")
    tq, n, d = query.shape
    tkv, nkv, _ = key.shape
    if n != head_num or n % nkv or value.shape != key.shape or key.shape[2] != d:
        raise ValueError(f"bad TND shapes q {tuple(query.shape)} k {tuple(key.shape)} head_num {head_num}")
    if (atten_mask is None or atten_mask.dtype != torch.bool or tuple(atten_mask.shape) != (2048, 2048)
            or not torch.equal(atten_mask.cpu(), torch.ones(2048, 2048, dtype=torch.bool).triu(1))):
        raise ValueError("sparse_mode 3 needs the compressed 2048 x 2048 upper-triangular bool mask")
    cq, ckv = list(actual_seq_qlen), list(actual_seq_kvlen)
    if not (1 <= len(cq) == len(ckv) <= 1024) or not all(isinstance(x, int) for x in cq + ckv):
        raise ValueError("actual_seq_qlen / actual_seq_kvlen: int lists of equal length 1..1024")
    if cq[-1] != tq or ckv[-1] != tkv or any(b < a for a, b in zip([0] + cq, cq)) or any(
            b < a for a, b in zip([0] + ckv, ckv)):
        raise ValueError("actual_seq_qlen / actual_seq_kvlen must be CUMULATIVE and end at T")
    outs = []
    for q0, q1, k0, k1 in zip([0] + cq[:-1], cq, [0] + ckv[:-1], ckv):
        sq, skv = q1 - q0, k1 - k0
        if sq == 0:
            continue
        if skv < sq:
            raise ValueError("a segment with Skv < Sq would have fully masked rows")
        qs = query[q0:q1].transpose(0, 1)                                    # [N, sq, D]
        ks = key[k0:k1].transpose(0, 1).repeat_interleave(n // nkv, 0)       # [N, skv, D]
        vs = value[k0:k1].transpose(0, 1).repeat_interleave(n // nkv, 0)
        scores = (qs @ ks.transpose(1, 2)) * scale
        allowed = torch.arange(skv)[None, :] <= (skv - sq) + torch.arange(sq)[:, None]   # rightDownCausal
        scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
        outs.append((scores.softmax(-1) @ vs).transpose(0, 1))
    return torch.cat(outs), None, None, None, 0, 0, 0
