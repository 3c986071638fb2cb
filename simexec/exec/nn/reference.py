"""The ground truth: the same model, data and seed in one process, plain autograd, no parallelism.

`reference(rp, steps)` trains the unsharded model on the whole global batch at once (all micro-batches
of all data-parallel ranks) with the same Adam, the loss scaled and the gradients unscaled under
`loss_scale` (a step with an overflowed gradient is skipped, and a dynamic scale moves), torch's
`clip_grad_norm_` under `clip_grad`; it returns the loss of every step (with MTP depths, the main loss
plus their scaled losses) and the final parameters.
Every plan's losses and parameters must match these (fp32: relative 1e-4).
"""
from __future__ import annotations

import torch

from simexec.exec.nn import data
from simexec.exec.nn.gpt import GPT
from simexec.exec.nn.param_layout import Layout, init_full
from simexec.exec.nn.optim import Adam
from simexec.exec.nn.scaler import LossScaler


def reference(rp, steps: int, seed: int = 0) -> dict:
    """{"losses": [float per step], "params": {name: full tensor}}; under loss_scale also
    "loss_scales" (per step) and "skipped_steps" (those whose gradients overflowed)."""
    params = {k: v.requires_grad_() for k, v in init_full(rp.model, seed).items()}
    model = GPT(rp.model, Layout(), params)
    opt = Adam(params.values())
    scaler = LossScaler.of(rp.plan)
    losses = []
    for step in range(steps):
        b = data.whole_batch(rp, seed, step)
        loss = model.forward(b.tokens, b.targets, b.pos, b.mtp)
        (loss * scaler.scale).backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params.values()]
        if rp.plan.loss_scale > 0:
            torch._foreach_div_(grads, scaler.scale)
        overflow = not all(bool(g.isfinite().all()) for g in grads)
        scaler.update(overflow)
        if not overflow:  # an overflow skips the step
            if rp.plan.clip_grad > 0:
                torch.nn.utils.clip_grad_norm_(list(params.values()), rp.plan.clip_grad)
            opt.step(grads)
        for p in params.values():
            p.grad = None
        losses.append(loss.item())
    out = {"losses": losses, "params": {k: v.detach().clone() for k, v in params.items()}}
    if rp.plan.loss_scale > 0:
        out.update(loss_scales=scaler.scales, skipped_steps=scaler.skipped)
    return out
