"""Autograd functions of the training fast paths: SwiGLU, RoPE and RMSNorm in fewer passes.

Pure torch, device-agnostic; the Megatron modules that run them are in megatron.py.

Megatron's local spec is written for CUDA with fused kernels; its unfused fallbacks (what runs on
CPU, and without TransformerEngine) cost extra full passes over the activations: the GLU's chunk
views go through silu / mul and come back through a cat, `x_linear + glu_linear_offset` adds 0.0,
RoPE recomputes cos / sin for every layer and tensor, builds the rotated half with neg + cat and
copies the result once more (`cat((t, t_pass))` with an empty t_pass). `SwiGLUFunction` and
`RotaryFunction` compute the same values with the same elementwise kernels (bit-equal for SwiGLU;
RoPE to one rounding of its two products' sum) in fewer passes; `rope_tables` makes RoPE's cos / sin
once per forward. `RMSNormFunction` is a hand-written backward for fp32 RMSNorm (its docstring says
what it saves). Equal to Megatron's local spec: tests/test_models.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class SwiGLUFunction(torch.autograd.Function):
    """silu(y1) * y2 for y = [y1 | y2] on the last dim (the GLU of a fused gate / up projection).
    Saves y and silu(y1), like autograd would; the backward writes both halves of the input
    gradient straight into one tensor (no cat), with autograd's own kernels (silu_backward, mul)."""

    @staticmethod
    def forward(ctx, y):
        a, b = y.chunk(2, dim=-1)
        s = F.silu(a)
        ctx.save_for_backward(y, s)
        return s * b

    @staticmethod
    def backward(ctx, g):
        y, s = ctx.saved_tensors
        a, b = y.chunk(2, dim=-1)
        grad = torch.empty_like(y)
        ga, gb = grad.chunk(2, dim=-1)
        torch.mul(g, s, out=gb)
        torch.mul(g, b, out=ga)
        torch.ops.aten.silu_backward.grad_input(ga, a, grad_input=ga)
        return grad


class RotaryFunction(torch.autograd.Function):
    """Rotary embedding t * cos + rotate_half(t) * sin (the non-interleaved layout Megatron and HF
    use: rotate_half([t1 | t2]) = [-t2 | t1]) from precomputed cos / sin tables broadcastable to t
    (t [S, B, heads, d], tables [S, B|1, 1, d]). Three passes, no cat; only the tables are saved.
    Backward: the transposed rotation, g * cos + [g2 * sin2 | -g1 * sin1]."""

    @staticmethod
    def forward(ctx, t, cos, sin):
        h = t.shape[-1] // 2
        out = t * cos
        out[..., :h].addcmul_(t[..., h:], sin[..., :h], value=-1)
        out[..., h:].addcmul_(t[..., :h], sin[..., h:])
        ctx.save_for_backward(cos, sin)
        return out

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        h = g.shape[-1] // 2
        grad = g * cos
        grad[..., :h].addcmul_(g[..., h:], sin[..., h:])
        grad[..., h:].addcmul_(g[..., :h], sin[..., :h], value=-1)
        return grad, None, None


class RMSNormFunction(torch.autograd.Function):
    """weight * x * rsqrt(mean(x^2) + eps) over the last dim, fp32. Forward: one reduction and two
    elementwise passes; saves x_hat = x * rstd and rstd. Backward: rstd * (g*w - x_hat *
    mean(g*w * x_hat)) and the weight gradient sum(g * x_hat), in about half the passes and a
    third of the kernels of autograd through torch's composite rms_norm."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        h = x.shape[-1]
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        rstd = norm.square_().div_(h).add_(eps).rsqrt_()
        x_hat = x * rstd
        ctx.save_for_backward(x_hat, weight, rstd)
        return x_hat * weight

    @staticmethod
    def backward(ctx, g):
        x_hat, weight, rstd = ctx.saved_tensors
        h = x_hat.shape[-1]
        grad_w = (g * x_hat).reshape(-1, h).sum(0) if ctx.needs_input_grad[1] else None
        gw = g * weight
        dot = torch.linalg.vecdot(gw, x_hat, dim=-1).div_(h).unsqueeze(-1)
        grad_x = torch.addcmul(gw, x_hat, dot, value=-1).mul_(rstd) if ctx.needs_input_grad[0] else None
        return grad_x, grad_w, None


_ROPE_TABLES: list = [None, None, None, None]    # [weakref(freqs), dtype, cos, sin]: the last table


def rope_tables(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of a RoPE frequency tensor in `dtype`, computed as Megatron's unfused RoPE does
    (fp32 freqs, then cast). Every layer of a forward gets the same freqs tensor (GPTModel computes
    it once; its rotary module even caches it per length), so the tables are computed once per
    forward: the last one is kept, keyed by the freqs tensor itself (a weak reference, so a new
    tensor at a recycled address is never mistaken for it)."""
    import weakref
    ref, dt, cos, sin = _ROPE_TABLES
    if ref is not None and ref() is freqs and dt == dtype:
        return cos, sin
    with torch.no_grad():
        cos, sin = torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)
    if not torch.is_inference_mode_enabled():     # inference tensors cannot be saved for a backward
        _ROPE_TABLES[:] = [weakref.ref(freqs), dtype, cos, sin]
    return cos, sin
