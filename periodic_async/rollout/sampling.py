"""Token sampling of the HF rollout engine (hf_engine.py), and its one-sequence reference.

One vectorised sampling step per decode step for the whole batch (`sample_batch`): temperature,
top-k / top-p filtering (per row, `filter_logits_batch`), then inverse-CDF sampling
(`inverse_cdf`) with each sequence's own uniform for its current position. The uniforms
(`sequence_uniforms`) are drawn once, at admission, from a generator seeded by (request seed, k),
so a response depends only on its request, its k and its own logits: not on its batch-mates or on
when it was admitted. Temperature 0 is argmax. Log-probs are those of the full (unfiltered)
distribution at the sampling temperature, which the trainer recomputes (temperature 0: at
temperature 1).

`reference_generate` is the slow, simple path the engine is tested against: one sequence alone,
a full forward over its tokens so far at every step, the per-sequence filter (`filter_logits`),
the same uniforms.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import RolloutRequest, SamplingParams, sample_seed

NEG_INF = float("-inf")


def sequence_uniforms(request_seed: int, sample_index: int, max_new_tokens: int) -> torch.Tensor:
    """The uniforms in [0, 1) sample k of a request uses, one per response position
    [max(1, max_new_tokens)] float32 (at least one token is always generated)."""
    g = torch.Generator().manual_seed(sample_seed(request_seed, sample_index))
    return torch.rand(max(1, max_new_tokens), generator=g)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] -> logits with tokens outside top-k / the top-p nucleus set to -inf (the
    per-sequence reference of `filter_logits_batch`)."""
    if top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, NEG_INF)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p  # keep the token that crosses top_p
        logits = logits.clone()
        logits[order[drop]] = NEG_INF
    return logits


def filter_logits_batch(logits: torch.Tensor, top_k: int | torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> the same with each row's tokens outside its top-k / top-p nucleus at -inf.
    top_k / top_p: one value for all rows, or per row [B] (top_k <= 0 or >= V, top_p >= 1: off)."""
    V = logits.shape[-1]
    if isinstance(top_k, torch.Tensor):
        on = (top_k > 0) & (top_k < V)
        if bool(on.any()):
            kmax = int(top_k[on].max())
            vals = torch.topk(logits, kmax, dim=-1).values                          # [B, kmax]
            kth = vals.gather(-1, (top_k.clamp(1, kmax) - 1)[:, None])              # [B, 1]
            kth = kth.masked_fill(~on[:, None], NEG_INF)                            # rows without top-k keep all
            logits = logits.masked_fill(logits < kth, NEG_INF)
    elif 0 < top_k < V:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, NEG_INF)
    if isinstance(top_p, torch.Tensor):
        on_p = top_p < 1.0
        if not bool(on_p.any()):
            return logits
        p = top_p[:, None]
    elif top_p < 1.0:
        on_p, p = None, top_p
    else:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    drop = probs.cumsum(-1) - probs >= p                    # [B, V] sorted order; keeps the token crossing p
    if on_p is not None:
        drop &= on_p[:, None]                               # top_p = 1 rows: cumsum rounding must not cut a tail
    return logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), NEG_INF)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [B, V] (non-negative, any positive row sum), u [B] in [0, 1) -> tokens [B]: per row
    the first index whose cumulative probability exceeds u * (row sum). A zero-probability token
    is never chosen (its cumulative probability equals its predecessor's)."""
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    # u * total can round up to total: stay strictly below it, so some index exceeds it
    x = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True)[:, 0]


@dataclass
class RowParams:
    """Sampling parameters of the batch rows, each one value for all rows where they agree (the
    common case: cheaper ops, no per-row tensors) or a tensor [B] where they differ."""
    temperature: float | torch.Tensor     # [B, 1] if per row; greedy rows: 1 (log-probs at temperature 1)
    greedy: bool | torch.Tensor           # True / False for all rows, or a mask [B]
    top_k: int | torch.Tensor
    top_p: float | torch.Tensor

    @classmethod
    def of(cls, params: list[SamplingParams], device) -> RowParams:
        def one_or_per_row(values, dtype):
            return values[0] if len(set(values)) == 1 else torch.tensor(values, dtype=dtype, device=device)
        temps = [p.temperature for p in params]
        t = one_or_per_row(temps, torch.float32)
        if isinstance(t, torch.Tensor):
            greedy = t == 0
            t = torch.where(greedy, 1.0, t)[:, None]
        else:
            greedy, t = t == 0, 1.0 if t == 0 else float(t)
        return cls(t, greedy, one_or_per_row([p.top_k for p in params], torch.long),
                   one_or_per_row([float(p.top_p) for p in params], torch.float32))


def sample_batch(logits: torch.Tensor, rp: RowParams, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] fp32, u [B] (each row's uniform for its position) -> (tokens [B], log-probs
    [B]): log_softmax(logits / T) at the token, unfiltered."""
    scaled = logits / rp.temperature
    if rp.greedy is True:
        tok = logits.argmax(-1)
    else:
        probs = filter_logits_batch(scaled, rp.top_k, rp.top_p).softmax(-1)
        tok = inverse_cdf(probs, u)
        if isinstance(rp.greedy, torch.Tensor):
            tok = torch.where(rp.greedy, logits.argmax(-1), tok)
    lp = torch.log_softmax(scaled, -1).gather(-1, tok[:, None])[:, 0]
    return tok, lp


@torch.no_grad()
def reference_generate(model, request: RolloutRequest, k: int,
                       eos_token_id: int | None) -> tuple[list[int], list[float], str]:
    """Sample k of `request`, generated the slow, simple way: alone, with a full forward over the
    tokens so far at every step (no cache, no padding, no batch-mates) and the per-sequence
    filter; the same uniforms as the engine. Returns (response ids, log-probs, finish reason)."""
    sp = request.sampling
    u = sequence_uniforms(request.seed, k, sp.max_new_tokens)
    stops = set(sp.stop_token_ids) | ({eos_token_id} if eos_token_id is not None and not sp.ignore_eos else set())
    device = next(model.parameters()).device
    ids: list[int] = []
    lps: list[float] = []
    while True:
        x = torch.tensor([list(request.prompt_ids) + ids], device=device)
        logits = model(input_ids=x).logits[0, -1].float().cpu()
        if sp.temperature == 0:
            tok = int(logits.argmax())
            lp = float(torch.log_softmax(logits, -1)[tok])
        else:
            scaled = logits / sp.temperature
            cdf = filter_logits(scaled, sp.top_k, sp.top_p).softmax(-1).cumsum(-1)
            target = torch.minimum(u[len(ids)] * cdf[-1], torch.nextafter(cdf[-1], torch.zeros(())))
            tok = int((cdf <= target).sum())              # the first index whose cdf exceeds target
            lp = float(torch.log_softmax(scaled, -1)[tok])
        ids.append(tok)
        lps.append(lp)
        if tok in stops:
            return ids, lps, "stop"
        if len(ids) >= sp.max_new_tokens:
            return ids, lps, "length"
