"""The plain rollout engine: a Hugging Face transformers model and a continuously batched,
KV-cached sampling loop.

For minimal installs and the embedded CPU run; vLLM workers implement the same interface for
production. Scheduling: up to `max_slots` sequences decode together, in one left-padded KV cache
(a transformers DynamicCache whose layers keep keys / values [rows, kv_heads, width, head_dim] as
views of buffers with room for the tokens still to come, so a decode step writes its column in
place instead of copying the cache).
- A finished sequence leaves the batch at once: its rows of the cache, the attention mask and the
  per-row state are dropped, and leading cache columns that are padding for every remaining row
  are trimmed.
- Free slots are refilled at once from the waiting requests (no waiting for the slowest sequence
  of a wave). Only the newly admitted sequences are prefilled, each distinct prompt once, its KV
  rows repeated for the samples that share it; they join the running cache, padded on the left to
  a common width.
- One vectorised sampling step per decode step for the whole batch, each sequence with its own
  uniforms drawn at admission (sampling.py: the filters, the inverse-CDF draw, the log-probs), so
  a response depends only on its request, its k and its own logits.

Interruptible: new weights may arrive from inside `poll()` while sequences are in flight (the
`async` training mode). The engine then recomputes the KV cache of every in-flight sequence (its
prompt and the tokens sampled so far, under the new weights) before the next decode step, and
records per token the version that sampled it, so each logprob is the one of the weights that
produced its token.

The slow, simple path the engine is tested against is sampling.py's `reference_generate`.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicLayer

from .base import RolloutEngine, RolloutRequest, RolloutResult
from .lean_decode import compiled_lean_decode_step, fuse_weights, lean_decode_step, supports
from .sampling import RowParams, sample_batch, sequence_uniforms


# ---------------------------------------------------------------------- the batch
@dataclass
class _Seq:
    """One sequence being generated: sample `k` of `request`."""
    request: RolloutRequest
    k: int
    slot: int = -1
    out_ids: list[int] = field(default_factory=list)
    out_lp: list[float] = field(default_factory=list)
    out_versions: list[int] = field(default_factory=list)   # the weights' version of each token
    t_start: float = 0.0
    reason: str = "length"
    stops: frozenset = frozenset()      # stop tokens and EOS


class _RoomyLayer(DynamicLayer):
    """A DynamicLayer whose keys / values [B, kv_heads, n, head_dim] are views of buffers with room
    for more columns: a decode step writes its column in place, where DynamicLayer concatenates
    (a copy of the whole layer per step). Trimming leading columns moves the view's start."""

    def __init__(self, kbuf: torch.Tensor, vbuf: torch.Tensor, n: int):
        """kbuf, vbuf [B, kv_heads, capacity, head_dim]; their first n columns hold the cache."""
        super().__init__()
        self.kbuf, self.vbuf, self.lo, self.hi = kbuf, vbuf, 0, n
        self.dtype, self.device, self.is_initialized = kbuf.dtype, kbuf.device, True
        self._view()

    def _view(self) -> None:
        self.keys, self.values = self.kbuf[:, :, self.lo:self.hi], self.vbuf[:, :, self.lo:self.hi]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        q = key_states.shape[-2]
        if self.hi + q > self.kbuf.shape[-2]:      # out of room (capacities are sized not to be)
            grow = lambda b: F.pad(b, (0, 0, 0, max(q, b.shape[-2])))  # noqa: E731
            self.kbuf, self.vbuf = grow(self.kbuf), grow(self.vbuf)
        self.kbuf[:, :, self.hi:self.hi + q] = key_states
        self.vbuf[:, :, self.hi:self.hi + q] = value_states
        self.hi += q
        self._view()
        return self.keys, self.values

    def trim(self, n: int) -> None:
        self.lo += n
        self._view()

    def select(self, idx: torch.Tensor) -> _RoomyLayer:
        """Rows idx, with the room this layer had (one copy)."""
        return _RoomyLayer(self.kbuf[:, :, self.lo:].index_select(0, idx),
                           self.vbuf[:, :, self.lo:].index_select(0, idx), self.hi - self.lo)

    @staticmethod
    def stack(parts: list[torch.Tensor], width: int, room: int) -> torch.Tensor:
        """[b_i, kv_heads, w_i, head_dim] tensors -> one buffer [sum b_i, kv_heads, width + room,
        head_dim], each part right-aligned in the first `width` columns (zeros on its left)."""
        _, h, _, d = parts[0].shape
        buf = parts[0].new_zeros(sum(p.shape[0] for p in parts), h, width + room, d)
        row = 0
        for p in parts:
            buf[row:row + p.shape[0], :, width - p.shape[2]:width] = p
            row += p.shape[0]
        return buf


def _roomy_cache(layers: list[_RoomyLayer]):
    from transformers import DynamicCache
    cache = DynamicCache()
    cache.layers = layers
    return cache


def _room(rows: list[_Seq]) -> int:
    """Cache columns the rows can still add (one per decode step) = their most tokens to come."""
    return max(max(1, s.request.sampling.max_new_tokens) - len(s.out_ids) for s in rows)


class _Batch:
    """The active sequences, row i of every tensor and of the cache being `rows[i]`.

    cache: DynamicCache of _RoomyLayer, each layer's keys / values [B, kv_heads, W, head_dim],
        left-padded (padding columns are zeros, masked)
    attn [B, W] long: 1 where the cache column holds one of the row's tokens
    next_ids [B] long: the last sampled token (not yet in the cache), fed at position pos [B]
    step [B] long: tokens sampled so far = the index into unif [B, T] of the next uniform
    """

    def __init__(self, rows: list[_Seq], cache, attn: torch.Tensor, pos: torch.Tensor, unif: torch.Tensor):
        self.rows: list[_Seq] = rows
        self.cache, self.attn, self.pos, self.unif = cache, attn, pos, unif
        self.step = torch.zeros(len(rows), dtype=torch.long, device=attn.device)
        self.next_ids = torch.zeros(len(rows), dtype=torch.long, device=attn.device)
        self.params: RowParams | None = None

    def select(self, idx: torch.Tensor) -> None:
        """Keep rows idx (a list of row numbers as a tensor), then trim the leading columns that
        are padding for all of them."""
        self.rows = [self.rows[i] for i in idx.tolist()]
        idx = idx.to(self.attn.device)
        self.cache = _roomy_cache([layer.select(idx) for layer in self.cache.layers])
        for name in ("attn", "pos", "unif", "step", "next_ids"):
            setattr(self, name, getattr(self, name).index_select(0, idx))
        first = int(self.attn.any(0).int().argmax())
        if first > 0:
            for layer in self.cache.layers:
                layer.trim(first)
            self.attn = self.attn[:, first:]
        self.params = None

    def extend(self, other: _Batch) -> None:
        """Append other's rows: one new cache, both parts padded on the left to the wider one."""
        w, room = max(self.attn.shape[1], other.attn.shape[1]), _room(self.rows + other.rows)
        self.cache = _roomy_cache([_RoomyLayer(_RoomyLayer.stack([a.keys, b.keys], w, room),
                                               _RoomyLayer.stack([a.values, b.values], w, room), w)
                                   for a, b in zip(self.cache.layers, other.cache.layers)])
        self.attn = torch.cat([F.pad(x, (w - x.shape[1], 0)) for x in (self.attn, other.attn)])
        t = max(self.unif.shape[1], other.unif.shape[1])
        self.unif = torch.cat([F.pad(self.unif, (0, t - self.unif.shape[1])),
                               F.pad(other.unif, (0, t - other.unif.shape[1]))])
        for name in ("pos", "step", "next_ids"):
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))
        self.rows = self.rows + other.rows
        self.params = None


class HFRolloutEngine(RolloutEngine):
    interruptible = True

    def __init__(self, model_dir: str, pad_token_id: int, eos_token_id: int | None,
                 max_slots: int = 256, device: str | torch.device = "cpu",
                 attn_implementation: str = "sdpa", decode: str = "lean", compile_decode: bool = False):
        """decode: "lean" runs decode steps through lean_decode.py where the architecture allows
        (else, and with "hf", the transformers forward); prefill is always the transformers forward.
        compile_decode: the lean step through torch.compile with dynamic shapes (rows and cache
        width change every step; compiled on the first decode, tens of seconds on a CPU)."""
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()   # a 'Loading weights' bar per worker at start-up
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation=attn_implementation).to(device).eval()
        self.device = torch.device(device)
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.max_slots = max_slots
        self.policy_version = 0
        self._cache_stale = False       # weights changed under in-flight sequences
        if decode not in ("lean", "hf"):
            raise ValueError(f"HFRolloutEngine: decode must be 'lean' or 'hf', got {decode!r}")
        # per layer (qkv, bias, gate_up): the parameters are views of these (weight sync included)
        self._fused = fuse_weights(self.model) if decode == "lean" and supports(self.model) else None
        if compile_decode and self._fused is None:
            raise ValueError("HFRolloutEngine: compile_decode needs the lean decode step "
                             f"(decode 'lean' and a qwen2 / llama model; got decode {decode!r}, "
                             f"model type {getattr(self.model.config, 'model_type', None)!r})")
        self._compiled_step = compiled_lean_decode_step() if compile_decode else None
        # Seconds by phase, summed over the engine's life (tools/bench_generation.py's FLOP/s
        # account). Host clock around each call: exact on the CPU; on an accelerator the kernels run
        # asynchronously and their time shows where the host waits (the sampled tokens' copy).
        self.phase_s = {"prefill": 0.0, "decode": 0.0}

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        params = dict(self.model.named_parameters())
        seen = set()
        for name, t in named_tensors:
            if name not in params:
                raise KeyError(f"rollout weight sync: model has no parameter '{name}'")
            params[name].copy_(t.to(params[name].dtype))
            seen.add(name)
        tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
        missing = set(params) - seen - tied
        if missing:
            raise KeyError(f"rollout weight sync: no tensor received for {sorted(missing)[:5]}")
        self.policy_version = version
        self._cache_stale = True

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def serve(self, poll: Callable[[], list[RolloutRequest] | None], initial: list[RolloutRequest] = (),
              on_slots: Callable[[int], None] | None = None) -> Iterator[list[RolloutResult]]:
        """Continuously batched generation, yielding the results finished at each decode step (a
        list, so a worker sends one message per step, not per sequence). `poll()` is called between
        decode steps and returns newly arrived requests (or None/[]); the iterator ends when nothing
        is pending, nothing is active, and `poll()` returns None. `on_slots(n_active)` reports
        occupancy (for idle metrics)."""
        pending: deque[_Seq] = deque()
        eos = {self.eos_token_id} if self.eos_token_id is not None else set()

        def admit(reqs):
            for r in reqs or ():
                stops = frozenset(r.sampling.stop_token_ids) | (frozenset() if r.sampling.ignore_eos else eos)
                for k in r.samples():
                    pending.append(_Seq(r, k, stops=stops))

        admit(initial)
        free_slots = list(range(self.max_slots - 1, -1, -1))   # a stack: lowest slot number first
        batch: _Batch | None = None
        self._cache_stale = False
        while True:
            new = poll()
            admit(new)
            if self._cache_stale:       # new weights under in-flight sequences (interruptible)
                if batch is not None:
                    self._recompute_cache(batch)
                self._cache_stale = False
            joining: list[_Seq] = []
            if pending and free_slots:
                now = time.perf_counter()
                while pending and free_slots:
                    seq = pending.popleft()
                    seq.slot, seq.t_start = free_slots.pop(), now
                    joining.append(seq)
            n_active = (len(batch.rows) if batch else 0) + len(joining)
            if n_active == 0:
                if new is None and not pending:
                    return
                if on_slots:
                    on_slots(0)
                time.sleep(0.001)
                continue
            if on_slots:
                on_slots(n_active)
            logits = []
            if batch is not None:
                t0 = time.perf_counter()
                logits.append(self._decode(batch))
                self.phase_s["decode"] += time.perf_counter() - t0
            if joining:
                t0 = time.perf_counter()
                joined, new_logits = self._prefill(joining)
                self.phase_s["prefill"] += time.perf_counter() - t0
                logits.append(new_logits)
                if batch is None:
                    batch = joined
                else:
                    batch.extend(joined)
            logits = torch.cat(logits) if len(logits) > 1 else logits[0]
            if batch.params is None:
                batch.params = RowParams.of([s.request.sampling for s in batch.rows], self.device)
            u = batch.unif.gather(1, batch.step[:, None])[:, 0]
            tok, lp = sample_batch(logits, batch.params, u)
            batch.next_ids = tok
            batch.step += 1
            host = torch.stack([tok.double(), lp.double()]).cpu()     # one device -> host copy per step
            finished, keep = [], []
            for i, (seq, t, l) in enumerate(zip(batch.rows, host[0].long().tolist(), host[1].tolist())):
                seq.out_ids.append(t)
                seq.out_lp.append(l)
                seq.out_versions.append(self.policy_version)
                if t in seq.stops:
                    seq.reason = "stop"
                    finished.append(seq)
                elif len(seq.out_ids) >= seq.request.sampling.max_new_tokens:
                    finished.append(seq)
                else:
                    keep.append(i)
            if not finished:
                continue
            t_end = time.perf_counter()
            for seq in finished:
                free_slots.append(seq.slot)
            free_slots.sort(reverse=True)
            if keep:
                batch.select(torch.tensor(keep, dtype=torch.long))
            else:
                batch = None
            if on_slots and batch is None and not pending:
                on_slots(0)     # idle before the results go out (their receiver may want the cores)
            yield [self._result(seq, t_end) for seq in finished]

    def _decode(self, b: _Batch) -> torch.Tensor:
        """One token for every row of b (its next_ids at pos); returns their logits [B, V] fp32."""
        b.attn = torch.cat([b.attn, torch.ones_like(b.attn[:, :1])], dim=1)
        if self._fused is not None:
            step = self._compiled_step or lean_decode_step
            logits = step(self.model, self._fused, b.next_ids, b.pos, b.attn, b.cache.layers)
            b.pos = b.pos + 1
            return logits
        out = self.model(input_ids=b.next_ids[:, None], attention_mask=b.attn, position_ids=b.pos[:, None],
                         past_key_values=b.cache, use_cache=True)
        b.cache = out.past_key_values
        b.pos = b.pos + 1
        return out.logits[:, -1, :].float()

    def _recompute_cache(self, b: _Batch) -> None:
        """Rebuild b's KV cache under the current weights: each row's prompt and its sampled tokens
        except the last (which is next_ids, fed by the next decode step), left-padded. Positions,
        uniforms, steps and next_ids are unchanged, so sampling continues where it stopped."""
        attn, out = self._forward_left_padded([list(s.request.prompt_ids) + s.out_ids[:-1] for s in b.rows])
        width, room = attn.shape[1], _room(b.rows)
        b.cache = _roomy_cache([_RoomyLayer(_RoomyLayer.stack([layer.keys], width, room),
                                            _RoomyLayer.stack([layer.values], width, room), width)
                                for layer in out.past_key_values.layers])
        b.attn = attn
        # b.pos (each row's next position = its cached length) is unchanged

    def _forward_left_padded(self, token_lists: list) -> tuple[torch.Tensor, object]:
        """One forward of the token lists, left-padded to the longest: (attn [n, width] long, the
        model's output with a full-length cache and the last position's logits)."""
        lens = [len(x) for x in token_lists]
        width = max(lens)
        ids = torch.full((len(token_lists), width), self.pad_token_id, dtype=torch.long)
        attn = torch.zeros((len(token_lists), width), dtype=torch.long)
        for i, x in enumerate(token_lists):
            ids[i, width - lens[i]:] = torch.tensor(x)
            attn[i, width - lens[i]:] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        from transformers import DynamicCache
        # a config-less DynamicCache: plain full-length layers (then copied into _RoomyLayers).
        # Logits of the last position only: all of them would be [b, width, V] fp32 (74 GiB for 256
        # rows of 512 tokens of a Qwen2.5 vocabulary)
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, past_key_values=DynamicCache(),
                         use_cache=True, logits_to_keep=1)
        return attn, out

    def _prefill(self, seqs: list[_Seq]) -> tuple[_Batch, torch.Tensor]:
        """Prefill the distinct prompts of `seqs` once (left-padded) and repeat their KV rows to one
        per sequence; returns the new sequences' batch and their next-token logits [n, V] fp32."""
        distinct: dict[tuple[int, ...], int] = {}
        rep = [distinct.setdefault(tuple(s.request.prompt_ids), len(distinct)) for s in seqs]
        prompts = list(distinct)
        lens = [len(p) for p in prompts]
        attn, out = self._forward_left_padded(prompts)
        width = attn.shape[1]
        logits = out.logits[:, -1, :].float()
        shared = rep != list(range(len(prompts)))   # samples sharing a prompt: repeat its rows
        idx = torch.tensor(rep, device=self.device)
        room, layers = _room(seqs), []
        for layer in out.past_key_values.layers:
            kv = [t.index_select(0, idx) if shared else t for t in (layer.keys, layer.values)]
            layers.append(_RoomyLayer(*(_RoomyLayer.stack([t], width, room) for t in kv), width))
        cache = _roomy_cache(layers)
        if shared:
            attn, logits = attn.index_select(0, idx), logits.index_select(0, idx)
        plen = torch.tensor([lens[i] for i in rep], device=self.device)
        t = max(1, *(s.request.sampling.max_new_tokens for s in seqs))
        unif = torch.stack([F.pad(sequence_uniforms(s.request.seed, s.k, s.request.sampling.max_new_tokens),
                                  (0, t - max(1, s.request.sampling.max_new_tokens))) for s in seqs])
        return _Batch(seqs, cache, attn, plen, unif.to(self.device)), logits

    def _result(self, seq: _Seq, t_end: float) -> RolloutResult:
        r = seq.request
        versions = seq.out_versions
        mixed = len(set(versions)) > 1
        return RolloutResult(group_index=r.group_index, sample_index=seq.k, prompt_ids=list(r.prompt_ids),
                             response_ids=seq.out_ids, logprobs=seq.out_lp, finish_reason=seq.reason,
                             policy_version=versions[0] if versions else self.policy_version,
                             timings={"start": seq.t_start, "end": t_end, "slot": seq.slot},
                             token_versions=list(versions) if mixed else None)
