"""The plain rollout engine: a Hugging Face transformers model and a KV-cached sampling loop.

For minimal installs and the embedded CPU run. It samples each sequence with its own torch
Generator (seeded by (request seed, k)), so a response does not depend on its batch-mates; it
batches up to `micro_batch_size` sequences (left-padded) and stops each at EOS/stop tokens.
vLLM workers implement the same interface for production.
"""
from __future__ import annotations

import time
from typing import Iterable, Iterator

import torch

from .base import RolloutEngine, RolloutRequest, RolloutResult, sample_seed


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] -> logits with tokens outside top-k / the top-p nucleus set to -inf."""
    if top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # keep the token that crosses top_p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


class HFRolloutEngine(RolloutEngine):
    def __init__(self, model_dir: str, pad_token_id: int, eos_token_id: int | None,
                 micro_batch_size: int = 256, device: str | torch.device = "cpu",
                 attn_implementation: str = "sdpa"):
        from transformers import AutoConfig, AutoModelForCausalLM
        config = AutoConfig.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, config=config, dtype=torch.float32, attn_implementation=attn_implementation).to(device).eval()
        self.device = torch.device(device)
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.micro_batch_size = micro_batch_size
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
    def generate(self, requests: list[RolloutRequest]) -> Iterator[RolloutResult]:
        seqs = [(r, k) for r in requests for k in range(r.n)]
        for start in range(0, len(seqs), self.micro_batch_size):
            yield from self._generate_batch(seqs[start:start + self.micro_batch_size])

    @torch.no_grad()
    def _generate_batch(self, seqs: list[tuple[RolloutRequest, int]]) -> list[RolloutResult]:
        t0 = time.perf_counter()
        b = len(seqs)
        lens = [len(r.prompt_ids) for r, _ in seqs]
        width = max(lens)
        ids = torch.full((b, width), self.pad_token_id, dtype=torch.long)
        attn = torch.zeros((b, width), dtype=torch.long)
        for i, (r, _) in enumerate(seqs):          # left padding: every row ends at column width-1
            ids[i, width - lens[i]:] = torch.tensor(r.prompt_ids)
            attn[i, width - lens[i]:] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        gens = [torch.Generator().manual_seed(sample_seed(r.seed, k)) for r, k in seqs]
        max_new = max(r.sampling.max_new_tokens for r, _ in seqs)
        out_ids: list[list[int]] = [[] for _ in range(b)]
        out_lp: list[list[float]] = [[] for _ in range(b)]
        reason = ["length"] * b
        done = [False] * b
        past = None
        step_ids, step_pos = ids, pos
        for _ in range(max_new):
            out = self.model(input_ids=step_ids, attention_mask=attn, position_ids=step_pos,
                             past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[:, -1, :].float().cpu()             # [b, V]
            next_tok = torch.full((b,), self.pad_token_id, dtype=torch.long)
            for i, (r, _) in enumerate(seqs):
                if done[i]:
                    continue
                sp = r.sampling
                if sp.temperature == 0:
                    tok = int(logits[i].argmax())
                    lp = float(torch.log_softmax(logits[i], -1)[tok])
                else:
                    scaled = logits[i] / sp.temperature
                    probs = _filter_logits(scaled, sp.top_k, sp.top_p).softmax(-1)
                    tok = int(torch.multinomial(probs, 1, generator=gens[i]))
                    lp = float(torch.log_softmax(scaled, -1)[tok])
                out_ids[i].append(tok)
                out_lp[i].append(lp)
                next_tok[i] = tok
                stops = set(sp.stop_token_ids) | ({self.eos_token_id} if self.eos_token_id is not None else set())
                if tok in stops:
                    done[i], reason[i] = True, "stop"
                elif len(out_ids[i]) >= sp.max_new_tokens:
                    done[i] = True
            if all(done):
                break
            step_ids = next_tok[:, None].to(self.device)
            step_pos = step_pos[:, -1:] + 1
            attn = torch.cat([attn, torch.ones((b, 1), dtype=attn.dtype, device=self.device)], dim=1)
        dt = time.perf_counter() - t0
        return [RolloutResult(group_index=r.group_index, sample_index=k, prompt_ids=list(r.prompt_ids),
                              response_ids=out_ids[i], logprobs=out_lp[i], finish_reason=reason[i],
                              policy_version=self.policy_version, timings={"gen_s": dt})
                for i, (r, k) in enumerate(seqs)]
