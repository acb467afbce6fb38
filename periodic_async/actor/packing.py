"""Pack scored responses into padded micro-batches for the training forward.

Unshared layout (`pack_unshared`): each response is its own sequence [prompt | response | pad]
(right padding); per-token tensors are [B, S] and position t predicts labels[:, t].
Shared-prompt layout (`pack_shared`, actor.shared_prompt: true): each group is one packed sequence
[prompt | r1 | ... | rK] (kernels/shared_prompt, docs/shared-prompt.md); the attention mask is a
`SharedPromptLayout`, and the per-token tensors are per RESPONSE, [N, L]: `logit_index[n, i]` is the
flat position (row * S + col) whose logits predict labels[n, i] = the i-th token of response n.
The tri-model engine consumes both through the same API; `pack_micro_batch` packs either for the trainer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from kernels.shared_prompt.layout import SharedPromptLayout, pack_groups


@dataclass
class TrainSample:
    prompt_ids: list[int]
    response_ids: list[int]
    advantage: float
    rollout_logprobs: list[float] | None = None
    policy_version: int = 0
    # set together for an estimator that re-centres rewards on importance ratios at training time
    # (algo.adv_estimator vcpo_baseline): the sample's reward and its group (a micro-batch then
    # holds whole groups)
    reward: float | None = None
    group: int | None = None
    # False: the sample is packed (its tokens still shape the micro-batch) but carries no loss
    # (loss mask 0): actor.overlong_filter drops truncated responses this way
    in_loss: bool = True


@dataclass
class MicroBatch:
    input_ids: torch.Tensor       # [B, S] long
    position_ids: torch.Tensor    # [B, S] long
    # unshared: [1, 1, S, S] bool, True = masked out (Megatron's convention);
    # shared: the SharedPromptLayout (travels to the core attention as Megatron's attention_mask)
    attention_mask: Union[torch.Tensor, SharedPromptLayout]
    labels: torch.Tensor          # unshared [B, S]: labels[:, t] = input_ids[:, t + 1]; shared [N, L]
    loss_mask: torch.Tensor       # same shape as labels, float: 1 where labels is a response token
    advantages: torch.Tensor      # same shape as labels: the sequence's advantage everywhere
    # shared only: [N, L] long, flat index into the B*S logits rows predicting labels[n, i]
    logit_index: Optional[torch.Tensor] = None
    # same shape as labels, float: the rollout engine's log-prob of each response token (0 where
    # none was reported); the trainer compares it with its own to catch a broken weight sync
    rollout_logp: Optional[torch.Tensor] = None
    # [rows] (one per response, in both layouts): each response's reward (float) and group (long),
    # when the samples carry them (TrainSample.reward / .group); else None
    rewards: Optional[torch.Tensor] = None
    group_ids: Optional[torch.Tensor] = None

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def shared_prompt(self) -> bool:
        return self.logit_index is not None

    def to(self, device) -> "MicroBatch":
        opt = lambda t: None if t is None else t.to(device)
        return MicroBatch(*(t.to(device) for t in (self.input_ids, self.position_ids, self.attention_mask,
                                                     self.labels, self.loss_mask, self.advantages)),
                          logit_index=opt(self.logit_index), rollout_logp=opt(self.rollout_logp),
                          rewards=opt(self.rewards), group_ids=opt(self.group_ids))


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
    rollout_logp = torch.zeros((b, width), dtype=torch.float32)
    for i, s in enumerate(samples):
        seq = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
        n, p = len(seq), len(s.prompt_ids)
        ids[i, :n] = seq
        labels[i, :n - 1] = seq[1:]
        mask[i, p - 1:n - 1] = float(s.in_loss)   # positions p-1 .. n-2 predict the response tokens
        adv[i, :] = s.advantage
        if s.rollout_logprobs:
            rollout_logp[i, p - 1:p - 1 + len(s.rollout_logprobs)] = torch.tensor(s.rollout_logprobs)
    pos = torch.arange(width)[None].expand(b, -1).contiguous()
    return MicroBatch(ids, pos, causal_mask(width), labels, mask, adv, rollout_logp=rollout_logp,
                      **_rewards_and_groups(samples))


def _rewards_and_groups(samples: list[TrainSample]) -> dict:
    """MicroBatch.rewards / group_ids [rows] of samples in row order, when every sample has them."""
    if not samples or any(s.group is None for s in samples):
        return {}
    return {"rewards": torch.tensor([float(s.reward) for s in samples], dtype=torch.float32),
            "group_ids": torch.tensor([s.group for s in samples], dtype=torch.long)}


# ---------------------------------------------------------------------- shared-prompt packing


def group_by_prompt(samples: list[TrainSample]) -> list[list[TrainSample]]:
    """Consecutive samples with identical prompt_ids form one group (the trainer emits a group's
    samples together). Merging two groups that happen to have the same prompt is still exact."""
    groups: list[list[TrainSample]] = []
    for s in samples:
        if groups and groups[-1][0].prompt_ids == s.prompt_ids:
            groups[-1].append(s)
        else:
            groups.append([s])
    return groups


def pack_shared(groups: list[list[TrainSample]], pad_token_id: int, row_len: Optional[int] = None) -> MicroBatch:
    """Each group (samples sharing one prompt) becomes [prompt | r1 | ... | rK]; several groups may
    share a row (first-fit, `row_len` defaults to the longest group). labels / loss_mask /
    advantages / logit_index are [N, L]: one row per sample, in the order of the input samples."""
    prompts_responses = []
    for gi, g in enumerate(groups):
        if not g:
            raise ValueError(f"pack_shared: group {gi} is empty")
        prompt = g[0].prompt_ids
        if any(s.prompt_ids != prompt for s in g):
            raise ValueError(f"pack_shared: the samples of group {gi} do not share one prompt")
        prompts_responses.append((prompt, [s.response_ids for s in g]))
    packed = pack_groups(prompts_responses, pad_token_id, row_len)
    adv = torch.tensor([s.advantage for g in groups for s in g], dtype=torch.float32)
    advantages = adv[:, None].expand_as(packed.loss_mask).contiguous()
    rollout_logp = torch.zeros_like(packed.loss_mask)
    for n, s in enumerate(s for g in groups for s in g):
        if not s.in_loss:
            packed.loss_mask[n] = 0.0
        if s.rollout_logprobs:
            rollout_logp[n, :len(s.rollout_logprobs)] = torch.tensor(s.rollout_logprobs)
    return MicroBatch(packed.input_ids, packed.position_ids, packed.layout, packed.labels,
                      packed.loss_mask, advantages, logit_index=packed.logit_index, rollout_logp=rollout_logp,
                      **_rewards_and_groups([s for g in groups for s in g]))



def pack_micro_batch(samples: list[TrainSample], pad_token_id: int, shared_prompt: bool = False) -> MicroBatch:
    """One micro-batch of consecutive samples: pack_unshared, or pack_shared over their groups
    (group_by_prompt; a group cut by the micro-batch boundary is a smaller group, still exact)."""
    if shared_prompt:
        return pack_shared(group_by_prompt(samples), pad_token_id)
    return pack_unshared(samples, pad_token_id)


def padding_micro_batch(pad_token_id: int, shared_prompt: bool = False) -> MicroBatch:
    """A micro-batch that carries no loss: one two-token row of padding, loss mask all zero. A DP
    rank whose groups came up short of the batch's plan (an allocator trained fewer groups than
    its positions) runs these so that every rank still runs the micro-batch count its pipeline
    schedule was started with; they add nothing to the gradient or the metric sums."""
    mb = pack_micro_batch([TrainSample([pad_token_id], [pad_token_id], 0.0)], pad_token_id, shared_prompt)
    mb.loss_mask.zero_()
    return mb
