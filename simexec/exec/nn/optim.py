"""The optimizer every run uses: Adam (Kingma & Ba 2015), torch's Adam update driven by states of our
own rather than through torch.optim.Adam, because

- its states exist from construction, so the memory measured in the first step is the steady state
  (torch.optim.Adam creates them lazily inside the first `step()`);
- it takes the gradients as arguments: a ZeRO shard's gradient is a slice of a reduce-scattered flat
  buffer, an offloaded one a host copy, neither of them some tensor's `.grad`;
- 16-bit parameters get fp32 masters and moments held by the optimizer itself, which updates a ZeRO
  shard's slice of a flat buffer in place.

The update is element-wise, so a ZeRO shard of a flat buffer is updated bit for bit as the same
elements of the unsharded parameters are; and so is a piece of a tensor, which is how 16-bit
gradients reach the fp32 kernel: cast `PIECE` elements at a time, as a GPU's fused Adam reads 16-bit
gradients straight into its registers, unless the plan keeps Megatron-LM's fp32 copy of every
gradient through the step (`master_grads`). eps is 1e-6 rather than 1e-8 so that a gradient that is
zero up to rounding (summation orders differ between plans) cannot be amplified into a full step.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import torch
from torch import Tensor
from torch.optim.adam import adam

from simexec.program.adam import ADAM_PIECE

PIECE = ADAM_PIECE["cpu"]

LR = 1e-3
BETAS = (0.9, 0.95)
EPS = 1e-6


def pieces(sizes: Sequence[int], piece: int = PIECE) -> list[list[tuple[int, int, int]]]:
    """Tensors of `sizes` elements cut into fused calls of at most `piece` elements each: per call,
    (tensor, start, end) ranges in order, a tensor split where a call fills up."""
    calls, cur, room = [], [], piece
    for i, n in enumerate(sizes):
        lo = 0
        while lo < n:
            take = min(room, n - lo)
            cur.append((i, lo, lo + take))
            lo, room = lo + take, room - take
            if room == 0:
                calls.append(cur)
                cur, room = [], piece
    if cur:
        calls.append(cur)
    return calls


class Adam:
    """Adam over `params` (updated in place), no weight decay.

    A parameter held in 16 bits gets an fp32 master copy and fp32 moments (mixed-precision training,
    Micikevicius et al. 2018, as Megatron-LM's and DeepSpeed's optimizers keep them: 12 bytes per
    parameter beside the 16-bit weight and gradient): the update is computed on the master and rounded
    into the parameter, so that steps below the 16-bit spacing accumulate instead of vanishing.
    On CPU and CUDA the update is torch's fused multi-tensor Adam kernel (one pass over parameters,
    gradients and moments, like Apex's FusedAdam on GPUs and DeepSpeed's CPU Adam on an offloaded
    host); elsewhere (XLA) the same formula tensor by tensor.
    """

    def __init__(self, params: Iterable[Tensor], lr: float = LR, betas: tuple[float, float] = BETAS, eps: float = EPS,
                 master_grads: bool = False, piece: Optional[int] = None):
        self.params = list(params)
        self.lr, self.betas, self.eps = lr, betas, eps
        self.master = [p.detach().float() if p.dtype != torch.float32 else p for p in self.params]
        self.m = [torch.zeros_like(w) for w in self.master]
        self.v = [torch.zeros_like(w) for w in self.master]
        self.steps = 0
        self._fused = all(w.device.type in ("cpu", "cuda") for w in self.master)
        # 16-bit parameters without master_grads: the fused kernel runs piece by piece (`pieces`), the
        # pieces of the masters and moments are views made once; each piece keeps its own step count
        half = any(w is not p for p, w in zip(self.params, self.master))
        if piece is None:
            piece = ADAM_PIECE["cpu" if all(w.device.type == "cpu" for w in self.master) else "accelerator"]
        self._calls = pieces([w.numel() for w in self.master], piece) if half and self._fused and not master_grads else None
        if self._calls is not None:
            flat = [(w.view(-1), m.view(-1), v.view(-1)) for w, m, v in zip(self.master, self.m, self.v)]
            self._views = [([flat[i][0][lo:hi] for i, lo, hi in call], [flat[i][1][lo:hi] for i, lo, hi in call],
                            [flat[i][2][lo:hi] for i, lo, hi in call]) for call in self._calls]
            self._step_counts = [[torch.zeros((), dtype=torch.float32, device=self.master[i].device) for i, _, _ in call]
                                 for call in self._calls]
        else:
            self._step_counts = [torch.zeros((), dtype=torch.float32, device=w.device) for w in self.master]

    @torch.no_grad()
    def step(self, grads: Sequence[Tensor]) -> None:
        b1, b2 = self.betas
        self.steps += 1
        if self._calls is not None:
            flat = [g.reshape(-1) for g in grads]
            for call, (ws, ms, vs), counts in zip(self._calls, self._views, self._step_counts):
                gs = [flat[i][lo:hi].float() for i, lo, hi in call]
                adam(ws, gs, ms, vs, [], counts, fused=True, amsgrad=False, beta1=b1, beta2=b2, lr=self.lr,
                     weight_decay=0.0, eps=self.eps, maximize=False)
            for p, w in zip(self.params, self.master):
                if w is not p:
                    p.copy_(w)
            return
        grads = [g if g.dtype == w.dtype else g.float() for g, w in zip(grads, self.master, strict=True)]
        if self._fused:
            adam(self.master, grads, self.m, self.v, [], self._step_counts, fused=True, amsgrad=False, beta1=b1,
                 beta2=b2, lr=self.lr, weight_decay=0.0, eps=self.eps, maximize=False)
        else:
            c1, c2 = 1 - b1**self.steps, 1 - b2**self.steps
            for w, g, m, v in zip(self.master, grads, self.m, self.v):
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                w.addcdiv_(m, (v.sqrt() / math.sqrt(c2)).add_(self.eps), value=-self.lr / c1)
        for p, w in zip(self.params, self.master):
            if w is not p:
                p.copy_(w)

    def named_state(self) -> dict[str, Tensor]:
        """Everything a step changes, by name, for a checkpoint: the parameters it updates, fp32
        masters, moments and the fused kernel's step counts (`steps` is the Python counter beside)."""
        out: dict[str, Tensor] = {}
        for i, (p, w, m, v) in enumerate(zip(self.params, self.master, self.m, self.v)):
            out[f"param/{i}"] = p.detach()
            if w is not p:
                out[f"master/{i}"] = w
            out[f"m/{i}"], out[f"v/{i}"] = m, v
        counts = self._step_counts if self._calls is None else [c for call in self._step_counts for c in call]
        out.update({f"count/{i}": c for i, c in enumerate(counts)})
        return out

    def state_tensors(self) -> list[Tensor]:
        """Moments and fp32 masters: what the optimizer holds beyond the parameters."""
        return self.m + self.v + [w for p, w in zip(self.params, self.master) if w is not p]
