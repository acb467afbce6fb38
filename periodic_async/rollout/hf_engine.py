"""The plain rollout engine: a Hugging Face transformers model and a continuously batched,
KV-cached sampling loop.

For minimal installs and the embedded CPU run; vLLM workers implement the same interface for
production. Scheduling: up to `max_slots` sequences decode together. When sequences finish and
requests are waiting, the free slots are refilled at once (no waiting for the slowest sequence of
a wave): the active set is re-prefilled together (prompt + tokens so far, left-padded) and decoding
continues with the new KV cache. Each sequence samples with its own torch Generator seeded by
(request seed, k), so a response does not depend on its batch-mates or on when it was admitted.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch

from .base import RolloutEngine, RolloutRequest, RolloutResult, sample_seed


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] -> logits with tokens outside top-k / the top-p nucleus set to -inf."""
    if top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p  # keep the token that crosses top_p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


@dataclass
class _Seq:
    """One sequence being generated: sample `k` of `request`."""
    request: RolloutRequest
    k: int
    generator: torch.Generator
    slot: int = -1
    out_ids: list[int] = field(default_factory=list)
    out_lp: list[float] = field(default_factory=list)
    t_start: float = 0.0
    done: bool = False
    reason: str = "length"

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt_ids + self.out_ids


class HFRolloutEngine(RolloutEngine):
    def __init__(self, model_dir: str, pad_token_id: int, eos_token_id: int | None,
                 max_slots: int = 256, device: str | torch.device = "cpu",
                 attn_implementation: str = "sdpa"):
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation=attn_implementation).to(device).eval()
        self.device = torch.device(device)
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.max_slots = max_slots
        self.policy_version = 0

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

        def admit(reqs):
            for r in reqs or ():
                for k in r.samples():
                    pending.append(_Seq(r, k, torch.Generator().manual_seed(sample_seed(r.seed, k))))

        admit(initial)
        slots: list[_Seq | None] = [None] * self.max_slots
        past = None                       # KV cache of the active rows, in `rows` order
        rows: list[_Seq] = []
        attn = pos = next_ids = None
        while True:
            new = poll()
            admit(new)
            free = [i for i, s in enumerate(slots) if s is None]
            if pending and free:
                now = time.perf_counter()
                for i in free:
                    if not pending:
                        break
                    seq = pending.popleft()
                    seq.slot, seq.t_start = i, now
                    slots[i] = seq
                past = None               # re-prefill the new active set
            rows_now = [s for s in slots if s is not None]
            if not rows_now:
                if new is None and not pending:
                    return
                if on_slots:
                    on_slots(0)
                time.sleep(0.001)
                continue
            if on_slots:
                on_slots(len(rows_now))
            if past is None:
                rows = rows_now
                logits, past, attn, pos = self._prefill(rows)
            else:
                out = self.model(input_ids=next_ids, attention_mask=attn, position_ids=pos, past_key_values=past,
                                 use_cache=True)
                past, logits = out.past_key_values, out.logits[:, -1, :].float().cpu()
            next_tok = torch.full((len(rows),), self.pad_token_id, dtype=torch.long)
            finished = []
            for i, seq in enumerate(rows):
                if seq.done:
                    continue
                tok = self._sample(seq, logits[i])
                next_tok[i] = tok
                sp = seq.request.sampling
                if tok in sp.stop_token_ids or tok == self.eos_token_id:
                    seq.done, seq.reason = True, "stop"
                elif len(seq.out_ids) >= sp.max_new_tokens:
                    seq.done = True
                if seq.done:
                    finished.append(seq)
            t_end = time.perf_counter()
            for seq in finished:
                slots[seq.slot] = None
            if finished:
                yield [self._result(seq, t_end) for seq in finished]
            if all(s.done for s in rows):
                past = None
                continue
            next_ids = next_tok[:, None].to(self.device)
            pos = pos[:, -1:] + 1
            attn = torch.cat([attn, torch.ones((len(rows), 1), dtype=attn.dtype, device=self.device)], dim=1)

    def _prefill(self, rows: list[_Seq]):
        """Left-padded forward over each row's tokens so far; returns last-position logits [b, V]."""
        lens = [len(s.tokens) for s in rows]
        width = max(lens)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        for i, s in enumerate(rows):
            ids[i, width - lens[i]:] = torch.tensor(s.tokens)
            attn[i, width - lens[i]:] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        # logits of the last position only: all of them would be [b, width, V] fp32 (74 GiB for 256
        # rows of 512 tokens of a Qwen2.5 vocabulary)
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :].float().cpu(), out.past_key_values, attn, pos

    @staticmethod
    def _sample(seq: _Seq, logits: torch.Tensor) -> int:
        sp = seq.request.sampling
        if sp.temperature == 0:
            tok = int(logits.argmax())
            lp = float(torch.log_softmax(logits, -1)[tok])
        else:
            scaled = logits / sp.temperature
            probs = _filter_logits(scaled, sp.top_k, sp.top_p).softmax(-1)
            tok = int(torch.multinomial(probs, 1, generator=seq.generator))
            lp = float(torch.log_softmax(scaled, -1)[tok])
        seq.out_ids.append(tok)
        seq.out_lp.append(lp)
        return tok

    def _result(self, seq: _Seq, t_end: float) -> RolloutResult:
        r = seq.request
        return RolloutResult(group_index=r.group_index, sample_index=seq.k, prompt_ids=list(r.prompt_ids),
                             response_ids=seq.out_ids, logprobs=seq.out_lp, finish_reason=seq.reason,
                             policy_version=self.policy_version,
                             timings={"start": seq.t_start, "end": t_end, "slot": seq.slot})
