"""The actor engine: the trainable policy and the frozen reference on Megatron-core.

`train_micro_step(mb, normaliser)` runs forward + backward for one micro-batch and returns its
share of the batch loss terms; gradients accumulate until `optimizer_step()` all-reduces them over
data-parallel ranks, clips by the global norm (sharded parameters counted once per shard,
replicated ones once) and steps Adam. `export_weights()` streams HF-layout tensors for the rollout
engine. The tri-model engine (policy / old / reference in one micro-step, PP > 1) extends this.

With `actor.shared_prompt: true` the models are built with shared-prompt core attention
(kernels/shared_prompt, the backend's attention_impl) and take `pack_shared` micro-batches as well
as unshared ones; log-probs then come per response, [N, L] (docs/shared-prompt.md).
"""
from __future__ import annotations

import math
from typing import Iterator

import torch
import torch.distributed as dist

from ..algo import grpo
from ..config import ActorConfig
from ..models.convert import export_hf_weights, load_hf_checkpoint
from ..models.mcore import ModelSpec, build_gpt_model
from .batch import MicroBatch
from .logprobs import logprobs_entropy


class Actor:
    def __init__(self, cfg: ActorConfig, spec: ModelSpec, model_dir: str, dtype: str = "float32",
                 device: torch.device | str = "cpu", temperature: float = 1.0, with_reference: bool = True,
                 attention_impl: str | None = None):
        """attention_impl: shared-prompt kernel name; default: the active backend's attention_impl."""
        self.cfg, self.spec, self.device, self.temperature = cfg, spec, torch.device(device), temperature
        model_kwargs = {}
        self.shared_prompt = bool(getattr(cfg, "shared_prompt", False))
        if self.shared_prompt:
            if attention_impl is None:
                from ..backend import active_backend
                attention_impl = active_backend().attention_impl
            model_kwargs = {"core_attention": "shared_prompt", "attention_impl": attention_impl}
        self.policy = build_gpt_model(spec, dtype, **model_kwargs).to(self.device)
        load_hf_checkpoint(self.policy, spec, model_dir)
        self.reference = None
        if with_reference:
            self.reference = build_gpt_model(spec, dtype, **model_kwargs).to(self.device)
            load_hf_checkpoint(self.reference, spec, model_dir)
            self.reference.eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.adam_eps,
                                           weight_decay=cfg.weight_decay)

    # ------------------------------------------------------------------ forward
    def _logprobs(self, model, mb: MicroBatch, with_entropy: bool):
        if mb.logit_index is not None and not self.shared_prompt:
            raise ValueError("a shared-prompt micro-batch (pack_shared) needs actor.shared_prompt: true")
        logits = model(mb.input_ids, mb.position_ids, mb.attention_mask)    # [B, S, V/TP]
        if mb.logit_index is not None:
            # shared prompt: the rows predicting each response token, [N, L, V/TP]; the last prompt
            # row is gathered once per response (its gradient sums the K contributions)
            logits = logits.reshape(-1, logits.shape[-1])[mb.logit_index]
        return logprobs_entropy(logits, mb.labels, self.temperature, with_entropy)

    @torch.no_grad()
    def compute_logprobs(self, mb: MicroBatch) -> dict[str, torch.Tensor]:
        """{'policy': [B, S], 'ref': [B, S] (when a reference exists)} without gradients; shaped
        like mb.labels ([N, L] per response for a shared-prompt micro-batch)."""
        out = {"policy": self._logprobs(self.policy, mb, False)[0]}
        if self.reference is not None:
            out["ref"] = self._logprobs(self.reference, mb, False)[0]
        return out

    def train_micro_step(self, mb: MicroBatch, normaliser: float) -> dict[str, float]:
        """Forward + backward of one micro-batch. Returned values are this micro-batch's shares of
        the batch-level metrics (sum them over micro-batches and DP ranks)."""
        cfg = self.cfg
        mb = mb.to(self.device)
        self.policy.train()
        logp, entropy = self._logprobs(self.policy, mb, with_entropy=True)
        old_logp = logp.detach()   # on-policy: one optimizer step per batch, so old == current
        pg_tok, clipped = grpo.clipped_pg_loss(logp, old_logp, mb.advantages, cfg.clip_ratio)
        pg_loss = grpo.aggregate(pg_tok, mb.loss_mask, cfg.loss_agg_mode, normaliser)
        loss = pg_loss
        metrics = {"actor/pg_loss": pg_loss.item(),
                   "actor/pg_clipfrac": grpo.aggregate(clipped.float(), mb.loss_mask, cfg.loss_agg_mode, normaliser).item()}
        if self.reference is not None:
            with torch.no_grad():
                ref_logp = self._logprobs(self.reference, mb, False)[0]
            kl = grpo.aggregate(grpo.kl_penalty(logp, ref_logp, cfg.kl_type), mb.loss_mask, cfg.loss_agg_mode, normaliser)
            metrics["actor/kl_loss"] = kl.item()
            if cfg.kl_coef:
                loss = loss + cfg.kl_coef * kl
        if cfg.entropy_coef:
            ent = grpo.aggregate(entropy, mb.loss_mask, cfg.loss_agg_mode, normaliser)
            loss = loss - cfg.entropy_coef * ent
        else:   # a metric only: no gradient through it
            ent = grpo.aggregate(entropy.detach(), mb.loss_mask, cfg.loss_agg_mode, normaliser)
        metrics["actor/entropy"] = ent.item()
        metrics["actor/loss"] = loss.item()
        loss.backward()
        return metrics

    # ------------------------------------------------------------------ update
    def optimizer_step(self, grad_scale: float = 1.0) -> dict[str, float]:
        """All-reduce gradients over DP, multiply by `grad_scale` (the batch normaliser's inverse
        when micro-steps ran with normaliser 1), clip by the global norm, step."""
        from megatron.core import parallel_state as ps
        params = [p for p in self.policy.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if ps.get_data_parallel_world_size() > 1:
            grads = [p.grad for p in params]
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=ps.get_data_parallel_group())
            for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)
        if grad_scale != 1.0:
            for p in params:
                p.grad.mul_(grad_scale)
        grad_norm = self.global_grad_norm(params)
        if self.cfg.grad_clip > 0 and math.isfinite(grad_norm) and grad_norm > self.cfg.grad_clip:
            scale = self.cfg.grad_clip / (grad_norm + 1e-6)
            for p in params:
                p.grad.mul_(scale)
        if math.isfinite(grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"actor/grad_norm": grad_norm, "actor/lr": self.optimizer.param_groups[0]["lr"]}

    @staticmethod
    def global_grad_norm(params: list[torch.nn.Parameter]) -> float:
        """L2 norm of the full (unsharded) gradient: TP-sharded parameters' squares are summed over
        the TP group; replicated ones (norms) are counted once."""
        from megatron.core import parallel_state as ps
        sharded = torch.zeros((), dtype=torch.float64)
        replicated = torch.zeros((), dtype=torch.float64)
        for p in params:
            sq = p.grad.detach().double().square().sum().cpu()
            if getattr(p, "tensor_model_parallel", False):
                sharded += sq
            else:
                replicated += sq
        if ps.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(sharded, group=ps.get_tensor_model_parallel_group())
        return float((sharded + replicated).sqrt())

    # ------------------------------------------------------------------ weights
    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-layout (name, tensor) pairs of the policy; all TP ranks must consume the iterator."""
        return export_hf_weights(self.policy, self.spec)
