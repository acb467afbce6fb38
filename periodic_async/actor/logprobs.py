"""Per-token log-probs and entropy from vocab-parallel logits (TP shards the vocabulary).

The slow reference (`logprobs_entropy_full`) gathers nothing and works on full logits; the TP path
never materialises the full vocabulary: it all-reduces the max (no grad), the partition function
and the target logit. Megatron's `reduce_from_tensor_model_parallel_region` is used for the
differentiable sums because its backward is the identity: every TP rank computes the same loss, so
the gradient must not be summed over ranks again.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def logprobs_entropy_full(logits: torch.Tensor, labels: torch.Tensor, with_entropy: bool = True):
    """logits [B, S, V], labels [B, S] -> (log p(label) [B, S], entropy [B, S] or None)."""
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    logp = logp_all.gather(-1, labels[..., None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
    return logp, ent


def logprobs_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                     with_entropy: bool = True):
    """Vocab-parallel version: logits [B, S, V/TP] on each TP rank -> (logp [B, S], entropy [B, S])."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1:
        return logprobs_entropy_full(logits, labels, with_entropy)
    vp = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * vp
    m = logits.detach().amax(-1)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    z = logits - m[..., None]                                              # [B, S, V/TP]
    ez = z.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(ez.sum(-1))          # [B, S]
    log_z = sum_exp.log()
    local = labels - start
    in_shard = (local >= 0) & (local < vp)
    tgt = z.gather(-1, local.clamp(0, vp - 1)[..., None]).squeeze(-1) * in_shard
    logp = reduce_from_tensor_model_parallel_region(tgt) - log_z
    ent = None
    if with_entropy:
        ent = log_z - reduce_from_tensor_model_parallel_region((ez * z).sum(-1)) / sum_exp
    return logp, ent
