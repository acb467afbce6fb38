"""Shared-prompt layout: GRPO groups packed as `[P | R1 | ... | RK]`, and what every backend needs.

Pure torch, device-agnostic; no backend is imported here.

Packing
-------
A group is one prompt P and K responses R1..RK (any K >= 1, any lengths, an empty response is
allowed and simply has no tokens). Each group is laid out contiguously as `[P | R1 | ... | RK]`;
groups are placed first-fit-decreasing into rows of `row_len` tokens (default: the longest group),
so one row may hold several groups; the rest of a row is right padding.

Semantics (the reference is the unshared sequence `[P | Rk]` run on its own):
- a prompt token attends causally to the prompt tokens of its own group;
- a token of response k attends to every prompt token of its group and causally to the earlier
  tokens of response k; never to another response, another group or padding;
- padding tokens attend causally to the padding of their own row only (so no softmax row is
  empty and no NaN appears); nothing real ever attends to padding;
- position ids: prompt 0..P-1, response k's i-th token P+i (RoPE sees exactly the positions of the
  unshared sequence). Every position id is <= its column in the row, so a RoPE table of S rows
  covers them.

Label alignment (logit-row gather)
----------------------------------
In the unshared sequence, logits at position t predict token t+1. In the packed row the first token
of EVERY response is predicted from the same position (the last prompt token), and later tokens
from their own response's previous position. So the loss tables are per response, `[N, L]`
(N = responses in the micro-batch in input order, L = longest response):
`logit_index[n, i]` is the flat index (row * S + column) of the position whose logits predict
`labels[n, i]` = the i-th token of response n; `loss_mask[n, i]` is 1 for real tokens.
The model's logits `[B, S, V]` are gathered as `logits.reshape(B*S, V)[logit_index]` -> `[N, L, V]`;
the last prompt position is gathered K times and its gradient is the sum of the K contributions
(index_select's backward is a scatter-add), exactly as K separate sequences would give.
Prompt tokens and padding are not in the tables at all (they carry no loss).

Mask conventions per backend
----------------------------
- Megatron / this module's `dense_mask()`: bool `[B, 1, S, S]`, True = masked out.
- PyTorch SDPA `attn_mask`: bool, True = ATTEND (the opposite): the sdpa kernels pass `~mask`.
- FlexAttention `mask_mod(b, h, q, kv)`: returns True = attend.
- torch_npu `npu_fusion_attention` `atten_mask`: bool, True = masked out (as Megatron).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

NPU_MAX_SEGMENTS = 1024       # npu_fusion_attention varlen: at most 1K entries in actual_seq_qlen
NPU_COMPRESSED_MASK = 2048    # sparse_mode 2/3/4/7/8 take a compressed 2048 x 2048 causal mask


@dataclass
class SegmentIndex:
    """Gather tables of the segmented SDPA path (flat indices into B*S; padding entries point at a
    real token and are masked or discarded)."""
    prompt_idx: torch.Tensor      # [G, Pmax]  queries = keys of each prompt segment (causal)
    resp_q_idx: torch.Tensor      # [N, Rmax]  queries of each response segment
    resp_kv_idx: torch.Tensor     # [N, Pmax + Rmax]  keys: its prompt (padded to Pmax), then itself
    resp_attend: torch.Tensor     # [N, 1, Rmax, Pmax + Rmax] bool, True = ATTEND (SDPA convention)
    prompt_valid: torch.Tensor    # [G, Pmax] bool, real query rows
    resp_valid: torch.Tensor      # [N, Rmax] bool, real query rows
    out_index: torch.Tensor       # [T] flat positions of prompt_valid then resp_valid query rows


@dataclass
class NpuTndArgs:
    """Arguments of one `torch_npu.npu_fusion_attention(..., input_layout="TND")` call.

    Segments: every prompt (queries = keys = the prompt, causal) and every response k
    (queries = its R_k tokens, keys = [its prompt | itself], P + R_k). With sparse_mode=3
    (rightDownCausal) query i of a segment sees keys 0 .. Skv - Sq + i, which is exactly
    "whole prompt + causal within the response" for response segments and plain causal for
    prompt segments. The prompt's keys/values are gathered once per response (kv_index repeats
    them); the prompt's own queries are computed once.
    """
    q_index: torch.Tensor             # [Tq] flat positions (row * S + col) of the query tokens
    kv_index: torch.Tensor            # [Tkv] flat positions of the key/value tokens
    actual_seq_qlen: list[int]        # CUMULATIVE query lengths per segment (2,2,2 -> 2,4,6)
    actual_seq_kvlen: list[int]       # CUMULATIVE key/value lengths per segment
    atten_mask: torch.Tensor          # [2048, 2048] bool, True = masked (upper triangle)
    sparse_mode: int = 3
    input_layout: str = "TND"


@dataclass
class SharedPromptLayout:
    """Per-micro-batch description of a shared-prompt packing. It travels to the core attention as
    Megatron's `attention_mask` argument (see kernels/shared_prompt/megatron.py); each backend
    derives what it needs from it lazily, once per forward (cached), never per layer."""
    group_ids: torch.Tensor           # [B, S] long: group index in the micro-batch, -1 = padding
    response_ids: torch.Tensor        # [B, S] long: 0 = prompt or padding, k >= 1 = k-th response
    prompt_segments: torch.Tensor     # [G, 3] long (row, start, length), host memory
    response_segments: torch.Tensor   # [N', 5] long (row, prompt_start, prompt_len, start, length)
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def batch_size(self) -> int:
        return self.group_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.group_ids.shape[1]

    @property
    def device(self) -> torch.device:
        return self.group_ids.device

    def to(self, device) -> "SharedPromptLayout":
        device = torch.device(device)
        if device == self.device:
            return self
        return SharedPromptLayout(self.group_ids.to(device), self.response_ids.to(device),
                                  self.prompt_segments, self.response_segments)

    # ------------------------------------------------------------------ dense (SDPA reference)
    def dense_mask(self, device=None) -> torch.Tensor:
        """[B, 1, S, S] bool, True = masked out (Megatron's and torch_npu's convention)."""
        device = torch.device(device) if device is not None else self.device
        key = ("dense", device)
        if key not in self._cache:
            g = self.group_ids.to(device)
            r = self.response_ids.to(device)
            s = self.seq_len
            causal = torch.ones(s, s, dtype=torch.bool, device=device).tril()
            same_group = g[:, :, None] == g[:, None, :]
            same_resp = (r[:, None, :] == 0) | (r[:, None, :] == r[:, :, None])
            self._cache[key] = ~(causal & same_group & same_resp)[:, None]
        return self._cache[key]

    # ------------------------------------------------------------------ FlexAttention (CUDA)
    def mask_mod(self, device=None):
        """FlexAttention mask_mod(b, h, q_idx, kv_idx) -> True = ATTEND, over per-token ids held
        on `device` (indexing tensors only: it traces and compiles)."""
        device = torch.device(device) if device is not None else self.device
        g = self.group_ids.to(device)
        r = self.response_ids.to(device)

        def shared_prompt_mask(b, h, q_idx, kv_idx):
            same_group = g[b, q_idx] == g[b, kv_idx]
            rk = r[b, kv_idx]
            return same_group & (kv_idx <= q_idx) & ((rk == 0) | (rk == r[b, q_idx]))
        return shared_prompt_mask

    # ------------------------------------------------------------------ segmented SDPA (CPU)
    def segment_index(self, device=None) -> SegmentIndex:
        device = torch.device(device) if device is not None else self.device
        key = ("segments", device)
        if key in self._cache:
            return self._cache[key]
        s = self.seq_len
        ps, rs = self.prompt_segments, self.response_segments
        p_max = int(ps[:, 2].max()) if len(ps) else 0
        r_max = int(rs[:, 4].max()) if len(rs) else 0
        ar_p = torch.arange(p_max)
        ar_r = torch.arange(r_max)
        # prompts: [G, Pmax]
        p_base = ps[:, 0] * s + ps[:, 1]
        prompt_valid = ar_p[None] < ps[:, 2:3]
        prompt_idx = torch.where(prompt_valid, p_base[:, None] + ar_p[None], p_base[:, None])
        # responses: queries [N, Rmax]; keys [N, Pmax + Rmax] = prompt (padded) then the response
        rp_base = rs[:, 0] * s + rs[:, 1]
        r_base = rs[:, 0] * s + rs[:, 3]
        resp_valid = ar_r[None] < rs[:, 4:5]
        resp_q_idx = torch.where(resp_valid, r_base[:, None] + ar_r[None], r_base[:, None])
        kv_prompt_valid = ar_p[None] < rs[:, 2:3]
        kv_prompt = torch.where(kv_prompt_valid, rp_base[:, None] + ar_p[None], rp_base[:, None])
        resp_kv_idx = torch.cat([kv_prompt, resp_q_idx], dim=1)
        causal = ar_r[None, :] <= ar_r[:, None]                                   # [Rmax, Rmax]
        attend = torch.cat([kv_prompt_valid[:, None, :].expand(-1, r_max, -1),
                            causal[None].expand(len(rs), -1, -1)], dim=2)         # [N, Rmax, Pmax+Rmax]
        out_index = torch.cat([prompt_idx[prompt_valid], resp_q_idx[resp_valid]])
        idx = SegmentIndex(prompt_idx.to(device), resp_q_idx.to(device), resp_kv_idx.to(device),
                           attend[:, None].to(device), prompt_valid.to(device), resp_valid.to(device),
                           out_index.to(device))
        self._cache[key] = idx
        return idx

    def segmented_pairs(self) -> int:
        """Query-key pairs the segmented SDPA computes (with its per-batch padding)."""
        ps, rs = self.prompt_segments, self.response_segments
        p_max = int(ps[:, 2].max()) if len(ps) else 0
        r_max = int(rs[:, 4].max()) if len(rs) else 0
        return len(ps) * p_max ** 2 + len(rs) * r_max * (p_max + r_max)

    # ------------------------------------------------------------------ NPU TND (varlen)
    def npu_tnd_args(self, device=None, max_segments: int = NPU_MAX_SEGMENTS) -> list[NpuTndArgs]:
        """The arguments of npu_fusion_attention calls in TND layout (one call per at most
        `max_segments` segments; the documented varlen limit is 1K). Segment order: for each group,
        its prompt then its responses; every real token is a query exactly once."""
        device = torch.device(device) if device is not None else self.device
        key = ("npu", device, max_segments)
        if key in self._cache:
            return self._cache[key]
        s = self.seq_len
        segs = []   # (q positions, kv positions), host tensors
        resp_by_prompt: dict[tuple[int, int], list] = {}
        for row, start, plen, rstart, rlen in self.response_segments.tolist():
            resp_by_prompt.setdefault((row, start), []).append((rstart, rlen))
        for row, start, plen in self.prompt_segments.tolist():
            prompt = torch.arange(plen) + row * s + start
            segs.append((prompt, prompt))
            for rstart, rlen in resp_by_prompt.get((row, start), []):
                resp = torch.arange(rlen) + row * s + rstart
                segs.append((resp, torch.cat([prompt, resp])))
        mask = torch.ones(NPU_COMPRESSED_MASK, NPU_COMPRESSED_MASK, dtype=torch.bool).triu(1).to(device)
        calls = []
        for c in range(0, len(segs), max_segments):
            chunk = segs[c:c + max_segments]
            q_len = torch.tensor([len(q) for q, _ in chunk])
            kv_len = torch.tensor([len(kv) for _, kv in chunk])
            calls.append(NpuTndArgs(
                q_index=torch.cat([q for q, _ in chunk]).to(device),
                kv_index=torch.cat([kv for _, kv in chunk]).to(device),
                actual_seq_qlen=q_len.cumsum(0).tolist(), actual_seq_kvlen=kv_len.cumsum(0).tolist(),
                atten_mask=mask))
        self._cache[key] = calls
        return calls

    # ------------------------------------------------------------------ misc
    def cached(self, key, build):
        """Per-layout cache for backend objects (e.g. the FlexAttention BlockMask)."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]


@dataclass
class PackedGroups:
    input_ids: torch.Tensor       # [B, S] long
    position_ids: torch.Tensor    # [B, S] long
    layout: SharedPromptLayout
    logit_index: torch.Tensor     # [N, L] long: flat index (row * S + col) of the predicting position
    labels: torch.Tensor          # [N, L] long: labels[n, i] = i-th token of response n (pad after)
    loss_mask: torch.Tensor       # [N, L] float: 1 for real response tokens
    response_of: list[tuple[int, int]]   # row n of the [N, L] tables -> (group, response) indices


def _place_rows(lengths: list[int], row_len: int) -> list[tuple[int, int]]:
    """First-fit decreasing: (row, offset) per item; items keep their relative order in a row."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    fill: list[int] = []
    place: dict[int, int] = {}
    for i in order:
        for r, used in enumerate(fill):
            if used + lengths[i] <= row_len:
                place[i] = r
                fill[r] += lengths[i]
                break
        else:
            place[i] = len(fill)
            fill.append(lengths[i])
    offsets = [0] * len(fill)
    out = []
    for i in range(len(lengths)):          # input order within a row
        r = place[i]
        out.append((r, offsets[r]))
        offsets[r] += lengths[i]
    return out


def pack_groups(groups: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]], pad_id: int,
                row_len: int | None = None) -> PackedGroups:
    """Pack `groups` = [(prompt_ids, [response_ids, ...]), ...] into rows (see the module doc).
    `row_len` defaults to the longest group; a group longer than `row_len` is an error (split it
    into sub-groups first: each sub-group repeats the prompt, which stays exact)."""
    if not groups:
        raise ValueError("pack_groups: no groups")
    lengths = []
    for gi, (prompt, responses) in enumerate(groups):
        if len(prompt) < 1:
            raise ValueError(f"pack_groups: group {gi} has an empty prompt")
        if len(responses) < 1:
            raise ValueError(f"pack_groups: group {gi} has no responses")
        lengths.append(len(prompt) + sum(len(r) for r in responses))
    width = max(lengths) if row_len is None else row_len
    if max(lengths) > width:
        raise ValueError(f"pack_groups: a group of {max(lengths)} tokens does not fit row_len={width}")
    placement = _place_rows(lengths, width)
    b = max(r for r, _ in placement) + 1
    # built as Python lists, converted once (this runs on the host for every micro-batch)
    ids = [[pad_id] * width for _ in range(b)]
    pos = [[0] * width for _ in range(b)]
    gid = [[-1] * width for _ in range(b)]
    rid = [[0] * width for _ in range(b)]
    l_max = max(1, max(len(r) for _, rs in groups for r in rs))
    logit_index, labels, loss_mask = [], [], []
    prompt_segs, resp_segs, response_of = [], [], []
    for gi, ((prompt, responses), (row, off)) in enumerate(zip(groups, placement)):
        p = len(prompt)
        ids[row][off:off + p] = list(prompt)
        pos[row][off:off + p] = range(p)
        gid[row][off:off + p] = [gi] * p
        prompt_segs.append((row, off, p))
        last_prompt = row * width + off + p - 1
        col = off + p
        for k, resp in enumerate(responses, start=1):
            rl = len(resp)
            response_of.append((gi, k - 1))
            pad = l_max - rl
            labels.append(list(resp) + [pad_id] * pad)
            loss_mask.append([1.0] * rl + [0.0] * pad)
            if rl:
                ids[row][col:col + rl] = list(resp)
                pos[row][col:col + rl] = range(p, p + rl)
                gid[row][col:col + rl] = [gi] * rl
                rid[row][col:col + rl] = [k] * rl
                resp_segs.append((row, off, p, col, rl))
                first = row * width + col
                logit_index.append([last_prompt] + list(range(first, first + rl - 1)) + [0] * pad)
            else:
                logit_index.append([0] * l_max)
            col += rl
    long = dict(dtype=torch.long)
    layout = SharedPromptLayout(torch.tensor(gid, **long), torch.tensor(rid, **long),
                                torch.tensor(prompt_segs, **long).view(-1, 3),
                                torch.tensor(resp_segs, **long).view(-1, 5))
    ids, pos = torch.tensor(ids, **long), torch.tensor(pos, **long)
    logit_index, labels = torch.tensor(logit_index, **long), torch.tensor(labels, **long)
    loss_mask = torch.tensor(loss_mask, dtype=torch.float32)
    return PackedGroups(ids, pos, layout, logit_index, labels, loss_mask, response_of)


# ---------------------------------------------------------------------- cost model


def ideal_token_ratio(prompt_len: int, response_lens: Sequence[int]) -> float:
    """Tokens processed shared / unshared: (P + sum R) / sum(P + R_k) (= (P + K R) / (K (P + R)))."""
    return (prompt_len + sum(response_lens)) / sum(prompt_len + r for r in response_lens)


def attention_flop_ratio(prompt_len: int, response_lens: Sequence[int]) -> float:
    """Causal attention score pairs shared / unshared: prompt pairs P(P+1)/2 once plus, per
    response, R P + R(R+1)/2; unshared, every response pays the full (P+R)(P+R+1)/2."""
    p = prompt_len
    shared = p * (p + 1) / 2 + sum(r * p + r * (r + 1) / 2 for r in response_lens)
    unshared = sum((p + r) * (p + r + 1) / 2 for r in response_lens)
    return shared / unshared
