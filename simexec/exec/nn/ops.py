"""The model's operators with backward passes of their own: each keeps for the backward only what
Megatron-LM's fused kernel keeps (autograd's composed versions keep more), and under a split backward
(`weight_grads.SplitPass`) each pass computes only its own gradient."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from simexec.exec.nn.weight_grads import SplitPass


def rope_tables(pos: Tensor, hd: int, dtype: torch.dtype, base: float = 10000.0) -> tuple[Tensor, Tensor]:
    """cos and sin (T, hd) of the rotary embedding at positions pos (T,), rotate-half layout."""
    inv = 1.0 / base ** (torch.arange(0, hd, 2, device=pos.device, dtype=torch.float32) / hd)
    ang = pos.to(torch.float32)[:, None] * inv[None, :]  # (T, hd/2)
    return torch.cat([ang.cos(), ang.cos()], -1).to(dtype), torch.cat([ang.sin(), ang.sin()], -1).to(dtype)


def _rotate_half(x: Tensor, sign: int) -> Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1) if sign > 0 else torch.cat([x[..., h:], -x[..., :h]], -1)


class _Rope(torch.autograd.Function):
    """Rotary embedding that saves only the tables it was given (Megatron computes them once per
    forward pass and hands the same to every layer's fused RoPE): autograd's version keeps its own
    cos / sin per call."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        return x * cos + _rotate_half(x, 1) * sin

    @staticmethod
    def backward(ctx, g: Tensor):
        cos, sin = ctx.saved_tensors
        return g * cos + _rotate_half(g * sin, -1), None, None


def rope(x: Tensor, tables: tuple[Tensor, Tensor]) -> Tensor:
    """Rotary embedding (Su et al. 2021, rotate-half form) of x (B, nh, T, hd) with `rope_tables`."""
    return _Rope.apply(x, *tables)


class _RMSNorm(torch.autograd.Function):
    """RMSNorm saving its input and 1/rms only (Megatron's fused RMSNorm): torch's CPU `rms_norm`
    is composed of operators and also keeps the normalised input for the weight's gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, eps: float) -> Tensor:
        xo = _opmath(x)
        rstd = torch.rsqrt(xo.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, w)
        return (xo * rstd).to(x.dtype) * w

    @staticmethod
    def backward(ctx, g: Tensor):
        # in place where it can be, with the operators of the plain formula (the dispatch tables,
        # simexec.sim.host.model, count them): at most three input-sized buffers beside g, as near as
        # eager operators come to a fused kernel's none; a split backward's input pass computes no
        # weight gradient, its weight pass no input gradient
        x, rstd, w = ctx.saved_tensors
        want_x = ctx.needs_input_grad[0] and SplitPass.now != "weight"
        want_w = ctx.needs_input_grad[1] and SplitPass.now != "input"
        xhat = _opmath(x) * rstd
        gw = dx = None
        if want_w:
            gw = (_opmath(g) * xhat).reshape(-1, x.shape[-1]).sum(0).to(w.dtype)
        if want_x:
            gx = torch.mul(_opmath(g), _opmath(w))
            dot = (gx * xhat).mean(-1, keepdim=True)
            dx = gx.sub_(xhat.mul_(dot)).mul_(rstd).to(x.dtype)
        return dx, gw, None


def _opmath(t: Tensor) -> Tensor:
    """16-bit values are normalised in fp32 (as torch's and Megatron's norms do)."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def rms_norm(x: Tensor, w: Tensor, eps: float = 1e-5) -> Tensor:
    return _RMSNorm.apply(x, w, eps)


class GatheredLinear(torch.autograd.Function):
    """x @ w where x is a norm's output all-gathered over the sequence (sp), saving w but not x:
    the weight gradient reads x whole, which the backward gets from `fetch` (the interpreter's
    re-gather of the slice each rank kept), as Megatron-LM's column-parallel linear does under
    sequence parallelism."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, fetch) -> Tensor:
        ctx.save_for_backward(w)
        ctx.fetch = fetch
        return x @ w

    @staticmethod
    def backward(ctx, gy: Tensor):
        (w,) = ctx.saved_tensors
        # a split backward's input pass computes no weight gradient, its weight pass no input gradient
        gx = gy @ w.t() if ctx.needs_input_grad[0] and SplitPass.now != "weight" else None
        gw = None
        if ctx.needs_input_grad[1] and SplitPass.now != "input":
            x = ctx.fetch()
            gw = x.reshape(-1, x.shape[-1]).t() @ gy.reshape(-1, gy.shape[-1])
        return gx, gw, None


class VocabParallelXent(torch.autograd.Function):
    """exp(logits - gmax) in place on the logits, saved once; see GPT.xent."""

    @staticmethod
    def forward(ctx, logits: Tensor, gmax: Tensor, targets: Tensor, vlo: int) -> Tensor:
        z = logits.detach()  # the same storage: overwritten (no other reader, see GPT.xent)
        z.sub_(gmax.unsqueeze(-1))
        V = z.shape[-1]
        mine = (targets >= vlo) & (targets < vlo + V)
        idx = (targets - vlo).clamp(0, V - 1).unsqueeze(-1)
        at = z.gather(-1, idx).squeeze(-1) * mine
        z.exp_()
        ctx.z, ctx.idx, ctx.mine = z, idx, mine  # not save_for_backward: the backward reuses z's storage
        return torch.stack([z.sum(-1), at])

    @staticmethod
    def backward(ctx, g: Tensor):
        z, idx, mine = ctx.z, ctx.idx, ctx.mine
        del ctx.z, ctx.idx, ctx.mine
        dz = z.mul_(g[0].unsqueeze(-1).to(z.dtype))  # d sum(exp z) / dz = exp z, in place
        dz.scatter_add_(-1, idx, (g[1] * mine).unsqueeze(-1).to(z.dtype))  # d z_target / dz
        return dz, None, None, None


class SwiGLU(torch.autograd.Function):
    """silu(gate) * up saving only its inputs, silu recomputed in the backward (Megatron's fused
    bias-SwiGLU): autograd's unfused version would also keep silu(gate)."""

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, g: Tensor):
        # d up = g silu(gate); d gate = g up s (1 + gate (1 - s)), s = sigmoid(gate): in place where
        # it can be, with as many operators as the plain formula (the dispatch tables count them), so
        # that one buffer beside the two gradients is all it holds (a fused kernel holds none)
        gate, up = ctx.saved_tensors
        s = torch.sigmoid(gate)
        dgate = g * up
        dgate.mul_(s)
        silu = s.mul_(gate)
        dup = g * silu
        t = silu.neg_().add_(gate).add_(1)  # 1 + gate - silu(gate)
        dgate.mul_(t)
        return dgate, dup
