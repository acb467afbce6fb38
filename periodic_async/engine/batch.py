"""Pack scored responses into padded micro-batches for the training forward.

Unshared layout: each response is its own sequence [prompt | response | pad] (right padding).
Shared-prompt packing (one prompt, K responses) arrives with its own kernel issue and will be a
second packer beside this one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TrainSample:
    prompt_ids: list[int]
    response_ids: list[int]
    advantage: float
    rollout_logprobs: list[float] | None = None
    policy_version: int = 0


@dataclass
class MicroBatch:
    input_ids: torch.Tensor       # [B, S] long
    position_ids: torch.Tensor    # [B, S] long
    attention_mask: torch.Tensor  # [1, 1, S, S] bool, True = masked out (Megatron's convention)
    labels: torch.Tensor          # [B, S] long: labels[:, t] = input_ids[:, t + 1] (pad at the end)
    loss_mask: torch.Tensor       # [B, S] float: 1 where labels[:, t] is a response token
    advantages: torch.Tensor      # [B, S] float: the sequence's advantage on every position

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def to(self, device) -> "MicroBatch":
        return MicroBatch(*(t.to(device) for t in (self.input_ids, self.position_ids, self.attention_mask,
                                                     self.labels, self.loss_mask, self.advantages)))


def causal_mask(seq_len: int) -> torch.Tensor:
    """[1, 1, S, S] bool, True above the diagonal (a token never sees the future). Right padding
    needs no extra mask: pad positions come after every real token and carry no loss."""
    return torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1)[None, None]


def pack_unshared(samples: list[TrainSample], pad_token_id: int) -> MicroBatch:
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    b = len(samples)
    ids = torch.full((b, width), pad_token_id, dtype=torch.long)
    labels = torch.full((b, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.float32)
    adv = torch.zeros((b, width), dtype=torch.float32)
    for i, s in enumerate(samples):
        seq = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
        n, p = len(seq), len(s.prompt_ids)
        ids[i, :n] = seq
        labels[i, :n - 1] = seq[1:]
        mask[i, p - 1:n - 1] = 1.0       # positions p-1 .. n-2 predict the response tokens
        adv[i, :] = s.advantage
    pos = torch.arange(width)[None].expand(b, -1).contiguous()
    return MicroBatch(ids, pos, causal_mask(width), labels, mask, adv)


def split_micro_batches(samples: list[TrainSample], micro_batch_size: int) -> list[list[TrainSample]]:
    return [samples[i:i + micro_batch_size] for i in range(0, len(samples), micro_batch_size)]
