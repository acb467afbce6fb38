"""Per-token log-probs and entropy from vocab-parallel logits (TP shards the vocabulary).

The slow reference (`logprobs_entropy_full`) gathers nothing and works on full logits; the TP path
never materialises the full vocabulary: it all-reduces the max (no grad), the partition function
and the target logit. Megatron's `reduce_from_tensor_model_parallel_region` is used for the
differentiable sums because its backward is the identity: every TP rank computes the same loss, so
the gradient must not be summed over ranks again.

`logprobs_entropy` (what the actor runs) never writes a [.., V] log-softmax: log p(label) is the
label's logit minus logsumexp (one reduction; its backward is softmax - onehot). The entropy is
only a metric unless the loss has an entropy term (`entropy_grad`): then it is computed without
autograd (no graph through a [.., V] product, nothing saved for backward).
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


def _entropy(logits: torch.Tensor, log_z: torch.Tensor) -> torch.Tensor:
    """H = -sum_v p_v log p_v with log p = x - log Z (not log Z - sum p x: that difference of two
    large terms loses the digits of a small entropy)."""
    logp = logits - log_z[..., None]
    return -torch.linalg.vecdot(logp.exp(), logp, dim=-1)


def logprobs_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                     with_entropy: bool = True, entropy_grad: bool = True):
    """Vocab-parallel version: logits [B, S, V/TP] on each TP rank -> (logp [B, S], entropy [B, S]
    or None). entropy_grad=False: the entropy is returned without a gradient (a metric)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1:
        log_z = torch.logsumexp(logits, dim=-1)                                  # [B, S]
        logp = logits.gather(-1, labels[..., None]).squeeze(-1) - log_z
        ent = None
        if with_entropy:
            if entropy_grad:
                ent = _entropy(logits, log_z)
            else:
                with torch.no_grad():
                    ent = _entropy(logits.detach(), log_z.detach())
        return logp, ent
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
        if entropy_grad:
            ent = log_z - reduce_from_tensor_model_parallel_region((ez * z).sum(-1)) / sum_exp
        else:
            with torch.no_grad():
                ez, z, sum_exp = ez.detach(), z.detach(), sum_exp.detach()
                dot = torch.linalg.vecdot(ez, z, dim=-1)
                dist.all_reduce(dot, group=ps.get_tensor_model_parallel_group())
                ent = log_z.detach() - dot / sum_exp
    return logp, ent
