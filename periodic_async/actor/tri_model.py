"""The tri-model actor: policy, old policy and reference on ONE Megatron-core layout.

GRPO needs three log-probs per response token: the policy's (with gradient), the old policy's
(the policy at the start of the batch, for the PPO ratio) and the reference's (the initial
weights, for the KL term). Here the three models are built with the same TP / PP / DP groups and
the same sharding, so no resharding ever happens between them, and each pipeline stage holds its
layers of all three. One micro-step runs the three forwards and the GRPO loss inside Megatron-core's
pipeline schedule (`get_forward_backward_func`): the three activations travel through the stages
as one tensor, and the backward runs through the policy only.

- Old-policy shortcut: when old == policy (the first optimizer step of a batch; the only one in
  strictly on-policy GRPO with ppo_epochs = 1) the old forward is skipped and the detached policy
  log-probs are used - the same loss and gradients for one forward less. The old model is only
  built when something needs it (ppo_epochs > 1, or the shortcut turned off).
- Memory options for the frozen models: weights in bf16 (`frozen_dtype`), and/or kept in host
  memory and brought to the device only for their forward (`offload_frozen`).
- Data parallelism: each DP rank trains on its share of the groups; `optimizer_step` all-reduces
  the gradients over DP (and the tied embedding's over the first/last pipeline stage), clips by
  the global norm and steps AdamW - on fp32 main weights when the policy is bf16 / fp16
  (actor/optimizer.py).
- Weight export: HF-layout tensors gathered over TP and PP in buckets of bounded size
  (models/convert.py), consumed by the weight sync at batch boundaries.

Shapes: B packed rows, S positions, H hidden, V/TP the vocabulary shard; per-token tensors are
[B, S] (unshared) or [N, L] per response (shared prompt, actor/packing.py).
"""
from __future__ import annotations

import contextlib
import math
from functools import partial
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from ..algo import LossInputs, PolicyLoss, build_policy_loss
from ..algo.variance_control import lr_scale
from ..backend import active_backend
from ..config import ActorConfig
from ..models.convert import export_hf_weights, load_hf_checkpoint
from ..models.mcore import ModelArch, build_gpt_model
from .logprobs import logprobs_entropy
from .optimizer import build_optimizer
from .packing import MicroBatch, TrainSample, pack_micro_batch, padding_micro_batch

MODELS = ("policy", "old", "ref")


class TriModelChunk(torch.nn.Module):
    """This pipeline stage's part of the policy, old and reference models, run by Megatron's
    schedule as one model.

    The active models' activations travel between stages as ONE tensor [S, M*B, H]: their
    [S, B, H] activations concatenated along the batch dimension, policy first, so the schedule
    and its p2p sends stay Megatron's own. The frozen models run under no_grad on detached
    slices, so the backward goes through the policy only (the frozen slices of the gradient
    coming back are zeros). On the last stage the output is the policy's logits followed by the
    frozen models' per-token log-probs (`frozen_logprobs`)."""

    def __init__(self, policy, old, ref, frozen_residency):
        super().__init__()
        self.policy, self.old, self.ref = policy, old, ref
        self.config, self.model_type = policy.config, policy.model_type
        self.pre_process, self.post_process = policy.pre_process, policy.post_process
        self.active: tuple[str, ...] = ("policy",)
        self._resident = frozen_residency      # context manager: a frozen model's weights on the device
        self._input: torch.Tensor | None = None
        # last stage: logits -> per-token log-probs of the current micro-batch, applied to each
        # frozen model's logits right away, so at most one frozen [B, S, V/TP] tensor is alive
        self.frozen_logprobs = None

    def set_input_tensor(self, input_tensor) -> None:
        if isinstance(input_tensor, list):
            input_tensor = input_tensor[0]
        self._input = input_tensor

    def forward(self, input_ids, position_ids, attention_mask):
        m = len(self.active)
        slices = [None] * m if self._input is None else list(self._input.chunk(m, dim=1))   # m x [S, B, H]
        outs = []
        for name, x in zip(self.active, slices):
            model = getattr(self, name)
            if name == "policy":
                model.set_input_tensor(x)
                outs.append(model(input_ids, position_ids, attention_mask))
                continue
            with torch.no_grad(), self._resident(model):
                dtype = model.config.params_dtype
                model.set_input_tensor(None if x is None else x.detach().to(dtype))
                out = model(input_ids, position_ids, attention_mask)
                if self.post_process:
                    out = self.frozen_logprobs(out)                   # [B, S] (or [N, L])
                outs.append(out)
        if self.post_process:
            return outs                    # policy logits [B, S, V/TP], then frozen log-probs
        return torch.cat([o.to(outs[0].dtype) for o in outs], dim=1)  # [S, m*B, H]


class TriModelActor:
    def __init__(self, cfg: ActorConfig, arch: ModelArch, model_dir: str, dtype: str = "float32",
                 device: torch.device | str = "cpu", temperature: float = 1.0, with_reference: bool = True,
                 with_old: bool | None = None, attention_impl: str | None = None, pad_token_id: int = 0,
                 policy_loss: PolicyLoss | None = None, core_attention: str | None = None):
        """attention_impl: shared-prompt kernel name; default: the active backend's attention_impl.
        with_old: build the old-policy model (default: when ppo_epochs > 1 or the shortcut is off).
        pad_token_id: the id `pack` pads with. policy_loss: the objective (default: the one
        registered as `cfg.policy_loss`, algo/losses.py); the actor only calls it.
        core_attention: build_gpt_model's layer spec for the unshared layout - "sdpa" (the training
        fast paths; the default on cpu and cuda) or "local" (Megatron's local spec as is: the
        reference in tests, and the default on npu, where MindSpeed patches those modules with its
        Ascend kernels); actor.shared_prompt always builds "shared_prompt" (on npu with Megatron's
        own RoPE / GLU / norm modules)."""
        from megatron.core import parallel_state as ps
        self.cfg, self.arch, self.device, self.temperature = cfg, arch, torch.device(device), temperature
        self.pad_token_id = pad_token_id
        self.objective = policy_loss if policy_loss is not None else build_policy_loss(cfg.policy_loss, cfg)
        self.shared_prompt = bool(cfg.shared_prompt)
        mindspeed = active_backend().name == "npu"
        model_kwargs = {"core_attention": core_attention or ("local" if mindspeed else "sdpa")}
        if self.shared_prompt:
            if core_attention not in (None, "shared_prompt"):
                raise ValueError(f"actor.shared_prompt needs core_attention 'shared_prompt', got '{core_attention}'")
            if attention_impl is None:
                attention_impl = active_backend().attention_impl
            model_kwargs = {"core_attention": "shared_prompt", "attention_impl": attention_impl,
                            "fast_layers": not mindspeed}
        if with_old is None:
            with_old = cfg.ppo_epochs > 1 or not cfg.old_logp_shortcut
        frozen_dtype = dtype if cfg.frozen_dtype == "same" else cfg.frozen_dtype
        self.offload = cfg.offload_frozen     # on the cpu backend host == device: same path, no saving
        self._host: dict[int, torch.Tensor] = {}     # id(param) -> host copy of a frozen weight

        def build(dt: str, frozen: bool):
            model = build_gpt_model(arch, dt, **model_kwargs)
            load_hf_checkpoint(model, arch, model_dir)
            model.to(self.device)
            if frozen:
                model.eval().requires_grad_(False)
                if self.offload:
                    self._offload(model)
            return model

        self.policy = build(dtype, frozen=False)
        self.old = build(frozen_dtype, frozen=True) if with_old else None
        self.reference = build(frozen_dtype, frozen=True) if with_reference else None
        self.chunk = TriModelChunk(self.policy, self.old, self.reference, self._resident)
        self.old_is_current = True     # the old model holds the policy of the current batch's start
        self.pp = ps.get_pipeline_model_parallel_world_size()
        # AdamW; with a bf16 / fp16 policy on fp32 main weights (actor/optimizer.py)
        self.optimizer = build_optimizer(self.policy.parameters(), cfg)
        self._lr_scale = 1.0     # the next optimizer step's lr multiplier (actor.vcpo_lr_scale)

    # ------------------------------------------------------------------ frozen-model residency
    def _offload(self, model) -> None:
        """Keep a frozen model's weights in (pinned) host memory; the device copy is dropped."""
        for p in model.parameters():
            host = self._host.get(id(p))
            if host is None:
                host = active_backend().host_buffer(p.shape, p.dtype)
                self._host[id(p)] = host
            host.copy_(p.data)
            p.data = host

    @contextlib.contextmanager
    def _resident(self, model):
        """The model's weights on the device for the duration (a no-op unless offload_frozen)."""
        if not self.offload:
            yield
            return
        for p in model.parameters():
            # a copy even when host == device (cpu), so the cpu tests exercise the same swap
            p.data = self._host[id(p)].to(self.device, non_blocking=True, copy=True)
        try:
            yield
        finally:
            for p in model.parameters():   # frozen: the host copy is still exact
                p.data = self._host[id(p)]

    def refresh_old(self) -> None:
        """old <- policy (same sharding, local copies); call at the start of every batch. Until the
        next optimizer step the policy is the one that generated the batch."""
        if self.old is None or self.old_is_current:
            self.old_is_current = True
            return
        with torch.no_grad():
            for po, pp in zip(self.old.parameters(), self.policy.parameters()):
                if self.offload:
                    self._host[id(po)].copy_(pp)
                else:
                    po.copy_(pp)
        self.old_is_current = True

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of model state on this rank's device: policy weights, fp32 main weights ('master',
        0 for an fp32 policy), the gradients the optimizer steps with, AdamW's moments, and the
        frozen models' weights while resident (0 between uses when offloaded)."""
        def nbytes(ps):
            return sum(p.numel() * p.element_size() for p in ps)
        out = {"policy": nbytes(self.policy.parameters()), **self.optimizer.state_bytes()}
        for name, model in (("old", self.old), ("ref", self.reference)):
            out[name] = 0 if model is None or self.offload else nbytes(model.parameters())
        return out

    # ------------------------------------------------------------------ packing
    def pack(self, samples: list[TrainSample]) -> MicroBatch:
        """One micro-batch of consecutive samples in this actor's layout: [prompt | response] rows,
        or, with actor.shared_prompt, one [prompt | r1 | ... | rK] sequence per group (a group cut
        by the micro-batch boundary is a smaller group, still exact)."""
        return pack_micro_batch(samples, self.pad_token_id, self.shared_prompt)

    def pack_padding(self) -> MicroBatch:
        """A micro-batch without loss (packing.padding_micro_batch) in this actor's layout."""
        return padding_micro_batch(self.pad_token_id, self.shared_prompt)

    def skip_step(self) -> dict[str, float]:
        """No update (a batch with no sample to train on): the accumulated gradients, all zero,
        are dropped; the weights and AdamW's moments stay as they are."""
        self.optimizer.zero_grad()
        self._lr_scale = 1.0
        return {"actor/grad_norm": 0.0, "actor/lr": self.optimizer.lr, "actor/step_skipped": 0.0}

    # ------------------------------------------------------------------ forward / loss
    def _logprobs(self, logits: torch.Tensor, mb: MicroBatch, with_entropy: bool, entropy_grad: bool = False):
        if mb.logit_index is not None:
            # shared prompt: the rows predicting each response token, [N, L, V/TP]; the last prompt
            # row is gathered once per response (its gradient sums the K contributions)
            logits = logits.reshape(-1, logits.shape[-1])[mb.logit_index]
        return logprobs_entropy(logits, mb.labels, self.temperature, with_entropy, entropy_grad)

    def _check(self, mb: MicroBatch) -> MicroBatch:
        if mb.logit_index is not None and not self.shared_prompt:
            raise ValueError("a shared-prompt micro-batch (pack_shared) needs actor.shared_prompt: true")
        return mb.to(self.device)

    def _loss(self, mb: MicroBatch, normaliser: float, pre: dict, outputs: list[torch.Tensor]):
        """Last stage: the objective of one micro-batch from the policy's logits and the frozen
        models' log-probs (run here, or given in `pre`: the separate-passes design)."""
        outs = dict(zip(self.chunk.active, outputs))   # policy: logits; frozen: log-probs (the chunk)
        # the entropy is a metric unless the objective differentiates it (an entropy bonus)
        logp, entropy = self._logprobs(outs["policy"], mb, with_entropy=True,
                                       entropy_grad=getattr(self.objective, "entropy_grad", True))   # [B, S]
        for name in ("old", "ref"):
            if name in outs:
                pre[name] = outs[name]
        loss, m = self.objective(LossInputs(
            logp=logp, entropy=entropy, old_logp=pre["old"] if "old" in pre else logp.detach(),
            ref_logp=pre.get("ref"), rollout_logp=mb.rollout_logp, advantages=mb.advantages, mask=mb.loss_mask,
            normaliser=normaliser, rewards=mb.rewards, group_ids=mb.group_ids))
        if mb.rollout_logp is not None and self.old_is_current:
            # the policy here is the one that generated: its probabilities should equal the engine's
            diff = (logp.detach().exp() - mb.rollout_logp.exp()).abs() * mb.loss_mask
            m["diff_sum"], m["diff_max"], m["diff_count"] = diff.sum(), diff.max(), mb.loss_mask.sum()
        num_tokens = torch.tensor(mb.num_tokens, dtype=torch.int)
        return loss, num_tokens, m

    def _forward_step(self, normaliser: float, data_iterator, chunk):
        mb, pre = next(data_iterator)
        mb = self._check(mb)
        pre = {k: v.to(self.device) for k, v in pre.items()}
        chunk.frozen_logprobs = lambda logits: self._logprobs(logits, mb, False)[0]
        out = chunk(mb.input_ids, mb.position_ids, mb.attention_mask)
        return out, partial(self._loss, mb, normaliser, pre)

    def _schedule(self, forward_step, micro_batches: Iterator[MicroBatch], num_micro_batches: int,
                  forward_only: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=micro_batches, model=[self.chunk],
            num_microbatches=num_micro_batches, seq_length=1, micro_batch_size=1,   # shapes travel (variable_seq_lengths)
            forward_only=forward_only)

    def forward_backward(self, micro_batches: Iterable[MicroBatch], num_micro_batches: int,
                         use_old: bool = False, normaliser: float = 1.0,
                         precomputed: list[dict[str, torch.Tensor]] | None = None) -> dict[str, float]:
        """Forward + backward of `num_micro_batches` micro-batches drawn from `micro_batches` (an
        iterator may block: the trainer feeds groups as they finish). use_old: take the old
        log-probs from the old model (needed once the policy moved within the batch); otherwise
        the shortcut (old = detached policy) applies. Gradients accumulate until optimizer_step.
        Returns the objective's metric sums (its metric_keys, over micro-batches and DP ranks; divide by the
        normaliser when micro-batches ran with normaliser 1) and the rollout/trainer probability
        check `training/rollout_probs_diff_mean` / `_max` (when the policy is the generating one).

        precomputed: per micro-batch {'old': logp, 'ref': logp} from earlier forward-only passes
        (`forward_logprobs`); only the policy then runs here - the usual separate-passes design,
        kept for comparison (tools/bench_tri_model.py)."""
        if precomputed is not None:
            self.chunk.active = ("policy",)
            self.policy.train()
            pairs = zip(micro_batches, precomputed)
            return self._reduce_metrics(self._schedule(partial(self._forward_step, normaliser), pairs,
                                                       num_micro_batches, False))
        if use_old and self.old is None:
            raise RuntimeError("use_old needs the old-policy model (actor.ppo_epochs > 1 or "
                               "actor.old_logp_shortcut: false)")
        use_old = use_old or (self.old is not None and not self.cfg.old_logp_shortcut)
        self.chunk.active = ("policy",) + (("old",) if use_old else ()) + (("ref",) if self.reference is not None else ())
        self.policy.train()
        pairs = ((mb, {}) for mb in micro_batches)
        store = self._schedule(partial(self._forward_step, normaliser), pairs, num_micro_batches, False)
        return self._reduce_metrics(store)

    def train_micro_step(self, mb: MicroBatch, normaliser: float, use_old: bool = False) -> dict[str, float]:
        """One micro-batch: forward + backward (a schedule of one micro-batch)."""
        return self.forward_backward([mb], 1, use_old, normaliser)

    def _reduce_metrics(self, store: list[dict]) -> dict[str, float]:
        """Sum the last stage's per-micro-batch metrics over micro-batches, then over the whole job
        (TP ranks of the last stage hold identical values, other stages none). A key of the
        objective that no micro-batch reported is left out."""
        from megatron.core import parallel_state as ps
        keys = self.objective.metric_keys
        max_keys = getattr(self.objective, "max_metric_keys", ())    # reduced by max, after the diff max
        n = len(keys)
        # [sum of each key, how many micro-batches reported it, diff sum, diff count], summed here
        # in Python floats and reduced as one fp32 tensor on the device: legal on NCCL and HCCL
        # (no CPU tensors, no float64 there)
        sums = [0.0] * (2 * n + 2)
        mx = 0.0
        maxes = [-math.inf] * len(max_keys)
        for m in store:
            for i, k in enumerate(keys):
                if k in m:
                    sums[i] += float(m[k])
                    sums[n + i] += 1
            if "diff_sum" in m:
                sums[-2] += float(m["diff_sum"])
                sums[-1] += float(m["diff_count"])
                mx = max(mx, float(m["diff_max"]))
            for j, k in enumerate(max_keys):
                if k in m:
                    maxes[j] = max(maxes[j], float(m[k]))
        if dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.tensor(sums + [mx] + maxes, dtype=torch.float32, device=self.device)
            dist.all_reduce(t[:len(sums)])
            dist.all_reduce(t[len(sums):], op=dist.ReduceOp.MAX)
            reduced = t.tolist()
            sums = (t[:len(sums)] / ps.get_tensor_model_parallel_world_size()).tolist()
            mx, maxes = float(reduced[len(sums)]), reduced[len(sums) + 1:]
        out = {k: sums[i] for i, k in enumerate(keys) if sums[n + i] > 0}
        if sums[-1] > 0:
            out["training/rollout_probs_diff_mean"] = float(sums[-2] / sums[-1])
            out["training/rollout_probs_diff_max"] = float(mx)
        if max_keys:
            out.update({k: v for k, v in zip(max_keys, maxes) if v > -math.inf})
        finalize = getattr(self.objective, "finalize_metrics", None)
        if finalize is not None:
            out = finalize(out)
        if getattr(self.cfg, "vcpo_lr_scale", False):
            # VCPO: the next optimizer step's learning rate is scaled with this batch's ESS / N
            self._lr_scale = lr_scale(out.get("vcpo/ess_ratio", 1.0), self.cfg.vcpo_lr_scale_min,
                                      self.cfg.vcpo_lr_scale_rule, self.cfg.vcpo_lr_scale_base)
            out["vcpo/lr_scale"] = self._lr_scale
        return out

    @torch.no_grad()
    def forward_logprobs(self, micro_batches: list[MicroBatch], models: tuple[str, ...] | None = None
                         ) -> list[dict[str, torch.Tensor]]:
        """Forward-only pass (schedule, no gradients) of `models` (default: every model built) over
        the micro-batches: per micro-batch {model: per-token log-probs shaped like mb.labels}.
        Every rank gets them (broadcast from the last pipeline stage)."""
        from megatron.core import parallel_state as ps
        built = ("policy",) + (("old",) if self.old is not None else ()) + (("ref",) if self.reference is not None else ())
        names = models or built
        if any(n not in built for n in names) or list(names) != [n for n in MODELS if n in names]:
            raise ValueError(f"models {names}: allowed a sub-sequence of {built}")
        self.chunk.active = tuple(names)

        def collect(mb, outputs):
            lps = torch.stack([self._logprobs(o, mb, False)[0] if name == "policy" else o
                               for name, o in zip(names, outputs)])                 # [M, B, S]
            return torch.zeros(()), torch.tensor(0, dtype=torch.int), lps

        def step(data_iterator, chunk):
            mb = self._check(next(data_iterator))
            chunk.frozen_logprobs = lambda logits: self._logprobs(logits, mb, False)[0]
            return chunk(mb.input_ids, mb.position_ids, mb.attention_mask), partial(collect, mb)
        was_training = self.policy.training
        self.policy.eval()
        store = self._schedule(step, iter(micro_batches), len(micro_batches), True)
        self.policy.train(was_training)
        out = []
        for i, mb in enumerate(micro_batches):
            lps = store[i] if store else torch.empty((len(names),) + tuple(mb.labels.shape), device=self.device)
            if self.pp > 1:
                group = ps.get_pipeline_model_parallel_group()
                dist.broadcast(lps, src=dist.get_global_rank(group, self.pp - 1), group=group)
            out.append(dict(zip(names, lps.unbind(0))))
        return out

    def compute_logprobs(self, mb: MicroBatch) -> dict[str, torch.Tensor]:
        """{'policy', 'old' (when built), 'ref' (when built)} for one micro-batch, from one
        tri-model forward."""
        return self.forward_logprobs([mb])[0]

    # ------------------------------------------------------------------ update
    def finalize_grads(self, grad_scale: float = 1.0) -> None:
        """Make every rank's gradient the batch's full gradient: all-reduce the tied embedding's
        between the first and last pipeline stage and everything over DP, then multiply by
        `grad_scale` (the batch normaliser's inverse when micro-steps ran with normaliser 1).
        Not Megatron's finalize_model_grads: it drives DDP-wrapped chunks (`finish_grad_sync`,
        main_grad buffers), and the policy here is a plain module with `.grad`s."""
        from megatron.core import parallel_state as ps
        grads = self.optimizer.grads()      # fp32 main gradients with a bf16 / fp16 policy
        if self.pp > 1 and self.arch.tie_word_embeddings and (self.policy.pre_process or self.policy.post_process):
            # the first stage's embedding and the last stage's output layer are one weight
            w = self.policy.shared_embedding_or_output_weight()
            dist.all_reduce(self.optimizer.grad_of(w), group=ps.get_embedding_group())
        if ps.get_data_parallel_world_size() > 1:
            # one flat all-reduce, in fp32 or (actor.grad_reduce_in_fp32: false) the model's dtype
            dtype = torch.float32 if self.cfg.grad_reduce_in_fp32 else self.policy.config.params_dtype
            flat = torch.cat([g.reshape(-1).to(dtype) for g in grads])
            dist.all_reduce(flat, group=ps.get_data_parallel_group())
            for g, synced in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(synced.view_as(g))
        if grad_scale != 1.0:
            for g in grads:
                g.mul_(grad_scale)

    def step_finalized(self) -> dict[str, float]:
        """Clip the finalized gradient by its global norm and step AdamW; the old model is stale
        afterwards (refresh_old at the next batch)."""
        params = self.optimizer.model_params
        grad_norm = self.global_grad_norm(self._unique_params(params), self.optimizer.grad_of)
        if self.cfg.grad_clip > 0 and math.isfinite(grad_norm) and grad_norm > self.cfg.grad_clip:
            scale = self.cfg.grad_clip / (grad_norm + 1e-6)
            for g in self.optimizer.grads():
                g.mul_(scale)
        # a non-finite norm (a NaN / inf loss or gradient anywhere: the norm is global) skips the
        # update on every rank alike; the trainer counts such steps
        finite = math.isfinite(grad_norm)
        if finite:
            if self._lr_scale != 1.0:
                self.optimizer.step(lr_scale=self._lr_scale)    # VCPO (actor.vcpo_lr_scale): this step only
            else:
                self.optimizer.step()
            self.old_is_current = False
        self._lr_scale = 1.0
        self.optimizer.zero_grad()
        return {"actor/grad_norm": grad_norm, "actor/lr": self.optimizer.lr,
                "actor/step_skipped": 0.0 if finite else 1.0}

    def optimizer_step(self, grad_scale: float = 1.0) -> dict[str, float]:
        """finalize_grads(grad_scale), then step_finalized()."""
        self.finalize_grads(grad_scale)
        return self.step_finalized()

    def _unique_params(self, params):
        """Parameters counted once in the norm: the last stage's copy of a tied embedding is not."""
        if self.pp > 1 and self.arch.tie_word_embeddings and self.policy.post_process and not self.policy.pre_process:
            dup = self.policy.shared_embedding_or_output_weight()
            return [p for p in params if p is not dup]
        return params

    @staticmethod
    def global_grad_norm(params: list[torch.nn.Parameter], grad_of=lambda p: p.grad) -> float:
        """L2 norm of the full (unsharded) gradient (`grad_of(p)`: the optimizer's gradient of
        model parameter p): Megatron's get_grad_norm_fp32 over the model-parallel (TP x PP) group,
        replicated parameters (norms) counted on one TP rank only.
        (Clipping stays ours: Megatron's clip_grad_by_total_norm_fp32 asserts CUDA tensors.)"""
        from megatron.core import parallel_state as ps
        from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        grads = [grad_of(p) for p in params if param_is_not_tensor_parallel_duplicate(p)]
        return float(get_grad_norm_fp32(grads, grad_stats_parallel_group=ps.get_model_parallel_group()))

    # ------------------------------------------------------------------ checkpoint
    def sharded_state_dict(self, with_optimizer: bool = True) -> dict:
        """Megatron-core distributed-checkpoint state of this rank: the policy's weights and the
        optimizer (fp32 main weights, AdamW moments), each tensor with its global shape and this
        rank's slice, so that dist_checkpointing.load reshards it to another TP / PP / DP layout.
        The reference is its checkpoint's; the old model is the policy at a batch start, which is
        where checkpoints are taken - neither is saved."""
        policy = self.policy.sharded_state_dict(prefix="policy.")
        state = {"policy": policy}
        if with_optimizer:
            state["optimizer"] = self.optimizer.sharded_state_dict(policy)
        return state

    @torch.no_grad()
    def load_sharded_state_dict(self, loaded: dict, with_optimizer: bool = True) -> None:
        """Install dist_checkpointing.load's result for `sharded_state_dict(with_optimizer)`'s
        structure (the result also carries the checkpoint's common, non-tensor entries)."""
        weights = {k.removeprefix("policy."): v for k, v in loaded["policy"].items() if not k.endswith("_extra_state")}
        self.policy.load_state_dict(weights, strict=False)   # strict=False: the _extra_state entries
        if with_optimizer:
            self.optimizer.load_sharded_state_dict(loaded["optimizer"])
        self.old_is_current = False
        self.refresh_old()

    # ------------------------------------------------------------------ weights
    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-layout (name, tensor) pairs of the policy, gathered over TP and PP in buckets of
        actor.export_bucket_mb; every rank must consume the iterator (collectives)."""
        return export_hf_weights(self.policy, self.arch, int(self.cfg.export_bucket_mb * (1 << 20)))
