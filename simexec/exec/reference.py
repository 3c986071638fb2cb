"""The ground truth: the same model, data and seed in one process, plain autograd, no parallelism.

`reference(rp, steps)` trains the unsharded model on the whole global batch at once (all micro-batches
of all data-parallel ranks) with the same Adam, the loss scaled and the gradients unscaled under
`loss_scale` (a step with an overflowed gradient is skipped), torch's `clip_grad_norm_` under
`clip_grad`; it returns the loss of every step and the final parameters. Every plan's losses and
parameters must match these (fp32: relative 1e-4).
"""
from __future__ import annotations

import torch

from simexec.exec import data
from simexec.exec.model import GPT, Layout, init_full
from simexec.exec.optim import Adam


def reference(rp, steps: int, seed: int = 0) -> dict:
    """{"losses": [float per step], "params": {name: full tensor}}."""
    params = {k: v.requires_grad_() for k, v in init_full(rp.model, seed).items()}
    model = GPT(rp.model, Layout(), params)
    opt = Adam(params.values())
    losses = []
    for step in range(steps):
        b = data.whole_batch(rp, seed, step)
        loss = model.forward(b.tokens, b.targets, b.pos)
        scale = rp.plan.loss_scale or 1.0
        (loss * scale).backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params.values()]
        if rp.plan.loss_scale > 0:
            torch._foreach_div_(grads, scale)
        if all(bool(g.isfinite().all()) for g in grads):  # an overflow skips the step
            if rp.plan.clip_grad > 0:
                torch.nn.utils.clip_grad_norm_(list(params.values()), rp.plan.clip_grad)
            opt.step(grads)
        for p in params.values():
            p.grad = None
        losses.append(loss.item())
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in params.items()}}
