"""The optimizer every run uses: Adam (Kingma & Ba 2015), the update of torch.optim.Adam's
single-tensor path, written out (ten lines) rather than wrapped, because

- its states exist from construction, so the memory measured in the first step is the steady state
  (torch.optim.Adam creates them lazily inside the first `step()`);
- it takes the gradients as arguments: a ZeRO shard's gradient is a slice of a reduce-scattered flat
  buffer, an offloaded one a host copy, neither of them some tensor's `.grad`.

The update is element-wise, so a ZeRO shard of a flat buffer is updated bit for bit as the same
elements of the unsharded parameters are. eps is 1e-6 rather than 1e-8 so that a gradient that is
zero up to rounding (summation orders differ between plans) cannot be amplified into a full step.
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch
from torch import Tensor

LR = 1e-3
BETAS = (0.9, 0.95)
EPS = 1e-6


class Adam:
    """Adam over `params` (updated in place), no weight decay."""

    def __init__(self, params: Iterable[Tensor], lr: float = LR, betas: tuple[float, float] = BETAS, eps: float = EPS):
        self.params = list(params)
        self.lr, self.betas, self.eps = lr, betas, eps
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.steps = 0

    @torch.no_grad()
    def step(self, grads: Sequence[Tensor]) -> None:
        b1, b2 = self.betas
        self.steps += 1
        c1, c2 = 1 - b1**self.steps, 1 - b2**self.steps
        for p, g, m, v in zip(self.params, grads, self.m, self.v, strict=True):
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            p.addcdiv_(m, (v.sqrt() / math.sqrt(c2)).add_(self.eps), value=-self.lr / c1)

    def state_tensors(self) -> list[Tensor]:
        return self.m + self.v
