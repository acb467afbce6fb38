"""The policy's optimizer: AdamW, with fp32 main parameters when the model is bf16 / fp16.

The principle is Megatron's (`Float16OptimizerWithFloat16Params`, `main_grad` buffers):
- every low-precision model parameter has an fp32 main copy; the optimizer steps the main copy
  and keeps its moments in fp32, then the model's weight is the main weight rounded to bf16;
- the gradient of a low-precision parameter is accumulated into an fp32 buffer after each
  backward (a post-accumulate hook moves it off the parameter), so many micro-batches sum in fp32;
- fp32 parameters (Megatron keeps RMSNorm weights in fp32 even in a bf16 model) are their own
  main parameters and accumulate in `.grad` as usual.
A bf16 update of lr ~1e-6 is far below bf16's spacing at |w| ~ 0.02 (~1e-4): stepping the bf16
weights directly rounds most updates away, while the fp32 main weights accumulate them until the
rounded copy moves.

Why not Megatron's own `get_megatron_optimizer` + DDP: it needs the model wrapped in Megatron's
DDP (contiguous grad buffers driving `finish_grad_sync`) and allocates on `device='cuda'`, which
fails on the cpu backend where every feature is tested; the actor's gradient path (finalize_grads)
stays one code path on all backends. The distributed optimizer (state sharded over DP) is the step
beyond this, not taken yet.
"""
from __future__ import annotations

import torch

from ..config import ActorConfig


class MixedPrecisionAdamW:
    """AdamW over main parameters. `grad_of(p)` is the gradient the step will use for model
    parameter `p` (fp32 for every parameter when main weights are kept); finalize it (all-reduce,
    scale, clip) before `step()`."""

    def __init__(self, params: list[torch.nn.Parameter], cfg: ActorConfig):
        self.model_params = [p for p in params if p.requires_grad]
        self.keeps_master = bool(cfg.fp32_master_weights)
        self._main: dict[int, torch.Tensor] = {}       # id(model param) -> its fp32 main param
        main_params = []
        for p in self.model_params:
            if self.keeps_master and p.dtype != torch.float32:
                main = torch.nn.Parameter(p.detach().float())
                main.grad = torch.zeros_like(main)      # the fp32 accumulation buffer
                self._main[id(p)] = main
                p.register_post_accumulate_grad_hook(self._accumulate)
                main_params.append(main)
            else:
                main_params.append(p)
        self.inner = torch.optim.AdamW(main_params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.adam_eps,
                                       weight_decay=cfg.weight_decay)

    def _accumulate(self, p: torch.Tensor) -> None:
        # after each backward: main.grad += p.grad in fp32, and the bf16 gradient is freed
        self._main[id(p)].grad.add_(p.grad)
        p.grad = None

    def grad_of(self, p: torch.nn.Parameter) -> torch.Tensor:
        main = self._main.get(id(p))
        if main is not None:
            return main.grad
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return p.grad

    def grads(self) -> list[torch.Tensor]:
        """The step's gradients, aligned with model_params."""
        return [self.grad_of(p) for p in self.model_params]

    @torch.no_grad()
    def step(self, lr_scale: float = 1.0) -> None:
        """One AdamW step; lr_scale != 1: this step runs at lr * lr_scale in every param group
        (VCPO's ESS-scaled step) and the groups' lr are restored afterwards, so a schedule that
        sets them stays in charge."""
        if lr_scale != 1.0:
            saved = [group["lr"] for group in self.inner.param_groups]
            for group, lr in zip(self.inner.param_groups, saved):
                group["lr"] = lr * lr_scale
            try:
                self.inner.step()
            finally:
                for group, lr in zip(self.inner.param_groups, saved):
                    group["lr"] = lr
        else:
            self.inner.step()
        for p in self.model_params:
            main = self._main.get(id(p))
            if main is not None:
                p.copy_(main)          # round to the model's dtype

    def zero_grad(self) -> None:
        for p in self.model_params:
            p.grad = None
            main = self._main.get(id(p))
            if main is not None:
                main.grad.zero_()

    # ------------------------------------------------------------------ checkpoint
    # Megatron-core's distributed checkpoint: each fp32 main weight and AdamW moment is saved with
    # the sharding of its model parameter (Megatron's dist_checkpointing.optimizer helpers), so a
    # checkpoint of one TP / PP / DP layout loads into another.
    _MOMENTS = ("exp_avg", "exp_avg_sq")

    def _main_of(self, p: torch.nn.Parameter) -> torch.Tensor:
        return self._main.get(id(p), p)

    def sharded_state_dict(self, model_sharded_state_dict: dict) -> dict:
        """{"main": {i: ShardedTensor}, "exp_avg" / "exp_avg_sq": {i: ShardedTensor}, "step": int}
        for model parameter i; `model_sharded_state_dict`: the model's (its tensors are the
        parameters themselves). Before the first step the moments are zeros (a template to load into)."""
        from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                                make_sharded_optimizer_tensor)
        sharded = get_param_id_to_sharded_param_map(model_sharded_state_dict, self.model_params)
        if len(sharded) != len(self.model_params):
            raise ValueError(f"{len(self.model_params) - len(sharded)} optimized parameters are not in the model's "
                             "sharded state dict")
        out: dict = {"main": {}, **{k: {} for k in self._MOMENTS}}
        steps = set()
        for i, p in enumerate(self.model_params):
            main = self._main_of(p)
            if id(p) in self._main:
                out["main"][i] = make_sharded_optimizer_tensor(sharded[i], main.detach(), "optimizer.main")
            state = self.inner.state.get(main, {})
            steps.add(int(state["step"]) if "step" in state else 0)
            for k in self._MOMENTS:
                moment = state[k] if k in state else torch.zeros_like(main)
                out[k][i] = make_sharded_optimizer_tensor(sharded[i], moment, f"optimizer.state.{k}")
        if len(steps) != 1:
            raise ValueError(f"parameters were stepped different numbers of times: {sorted(steps)}")
        out["step"] = steps.pop()
        return out

    @torch.no_grad()
    def load_sharded_state_dict(self, loaded: dict) -> None:
        """Install what dist_checkpointing.load returned for `sharded_state_dict`'s structure."""
        step = int(loaded["step"])
        for i, p in enumerate(self.model_params):
            main = self._main_of(p)
            if id(p) in self._main:
                main.copy_(loaded["main"][i])
                p.copy_(main)                   # the model weight: the main weight rounded
            if step > 0:
                self.inner.state[main] = {"step": torch.tensor(float(step)),
                                          **{k: loaded[k][i].to(main.dtype).clone() for k in self._MOMENTS}}
            else:
                self.inner.state.pop(main, None)

    @property
    def lr(self) -> float:
        return self.inner.param_groups[0]["lr"]

    def state_bytes(self) -> dict[str, int]:
        """Bytes on the device: the fp32 main copies ('master'), the gradients the step uses
        ('grads') and AdamW's two moments per main parameter ('optimizer', allocated at the first
        step)."""
        def nbytes(t):
            return t.numel() * t.element_size()
        master = sum(nbytes(m) for m in self._main.values())
        grads = sum(nbytes(self._main[id(p)]) if id(p) in self._main else nbytes(p) for p in self.model_params)
        mains = [self._main.get(id(p), p) for p in self.model_params]
        return {"master": master, "grads": grads, "optimizer": 2 * sum(nbytes(m) for m in mains)}


def build_optimizer(params, cfg: ActorConfig) -> MixedPrecisionAdamW:
    return MixedPrecisionAdamW(list(params), cfg)
