"""The optimizer step of a rank: Adam on its parameters or ZeRO shards, and what comes before it.

Before the step, as the program orders it: offloaded gradients copied to the host (`grads_d2h`),
the fp16 loss scale's unscaling and overflow check (`unscale`) and the gradient norm for clipping
(`grad_norm`), each followed by an all-reduce of one value over the world (`step_reduction`). The
step is skipped when any rank overflowed, and its gradients are scaled by min(1, clip / norm). Under
offload the step runs on host copies and the updated parameters go back (`params_h2d`).
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from simexec.exec.nn.clipping import ClipWeights, clip_coefficient
from simexec.exec.measure.live_memory import LIVE_TRACKER
from simexec.exec.nn.optim import Adam
from simexec.program.instructions import Instr


class OptimizerStep:
    """Adam, loss scaling, clipping and offload copies for `RankInterpreter` (`simexec.exec.rank.interpreter`), a mixin.

    Reads of the rank: `rp`, `rank`, `plan`, `specs`, `shapes`, `device`, `scaler`, `comm`, `p`,
    `buckets`, `shards`, `z3`, `local_grad`, `wait_but_sends`, `issue`. Shares with it: `gshard`
    and `reduced` (the final gradients, consumed by the step). Its own: `opt`, `opt_keys`,
    `opt_tensors`, `offload`, `host`, `host_grads`, `clip`, `step_grads`, `norm_sq`, `found_inf`."""

    def setup_optimizer(self) -> None:
        """Adam over: bucket / unit shards (ZeRO), and every parameter no shard covers."""
        sharded = [fl for k, fl in self.buckets.items() if k in self.shards] + list(self.z3.values())
        covered = {n for fl in sharded for n in fl.names}
        self.opt_keys: list = list(self.shards) + [n for n in self.p if n not in covered]
        tensors = [self.shards[k] if isinstance(k, tuple) else self.p[k].detach() for k in self.opt_keys]
        self.offload = self.plan.offload != "none"
        if self.offload:  # host copies: the optimizer's parameters and states live in host memory
            self.host = [t.detach().to("cpu", copy=True) for t in tensors]
            self.host_grads = [torch.empty_like(h, dtype=self.gdtype) for h in self.host]
            self.opt = Adam(self.host)
        else:
            self.opt = Adam(tensors, master_grads=self.plan.master_grads)
        self.opt_tensors = tensors
        self.clip = None  # clip_grad: each optimizer tensor's share of the global norm
        if self.plan.clip_grad > 0:
            flats = {k: self.buckets.get(k) or self.z3.get(k) for k in self.shards}
            numel = {n: math.prod(self.shapes[n]) for n in self.opt_keys if not isinstance(n, tuple)}
            self.clip = ClipWeights.of(self.rp, self.rank, self.specs, self.opt_keys, flats, numel)
        self.step_grads: Optional[list[Tensor]] = None  # the step's gradients, once gathered
        self.norm_sq: Optional[Tensor] = None  # this rank's share of the squared norm, then (reduced) the whole
        self.found_inf: Optional[Tensor] = None  # loss_scale: overflowed gradients here, then (reduced) anywhere

    def optimizer_step(self, ins: Instr) -> None:
        """`optim`: Adam on this rank's parameters / shards. `cpu_optim` (offload): on the host copies,
        whose gradients `grads_d2h` brought."""
        if ins.block == "cpu_optim":
            tracker = LIVE_TRACKER[0]
            if tracker is not None:
                tracker.on_host += 1
            threads = torch.get_num_threads()
            torch.set_num_threads(self._host_threads())
            try:
                self._update(self.host_grads)
            finally:
                torch.set_num_threads(threads)
                if tracker is not None:
                    tracker.on_host -= 1
            return
        self.wait_but_sends(ins)
        self._update(self._optimizer_grads())

    def _update(self, grads: list[Tensor]) -> None:
        """Adam on the step's gradients: skipped if any rank's overflowed (loss_scale, whose scale then
        moves if dynamic), scaled first by min(1, clip_grad / norm), the norm the world's all-reduce
        summed (clip_grad)."""
        found, self.found_inf = self.found_inf, None
        norm_sq, self.norm_sq = self.norm_sq, None
        if found is not None:
            overflow = bool(found.item() > 0)
            self.scaler.update(overflow)
            if overflow:
                return
        if norm_sq is not None and grads:
            coef = clip_coefficient(norm_sq, self.plan.clip_grad).reshape(())
            torch._foreach_mul_(grads, coef.to(grads[0].device))
        self.opt.step(grads)

    def _host_threads(self) -> int:
        """Threads for the offloaded optimizer step: on an accelerator's host, this rank's share of the
        host's cores (DeepSpeed's CPU Adam runs on every core its process may use); a CPU rank keeps the
        one thread it computes with, its cores being shared with the other ranks already."""
        if self.device.type == "cpu":
            return torch.get_num_threads()
        per_host = min(self.rp.world, self.rp.cluster.node.gpus_per_node or self.rp.world)
        return max(1, (os.cpu_count() or 1) // max(1, per_host))

    def host_tensors(self) -> list[Tensor]:
        """What stands for host memory (offload: parameters, gradients and Adam states on the host)."""
        return self.host + self.host_grads + self.opt.state_tensors() if self.offload else []

    def unscale(self, ins: Instr) -> None:
        """`unscale` (loss_scale): divide the final gradients by the loss scale and flag any that is not
        finite; the `unscale` all-reduce after it tells every rank whether any rank overflowed."""
        self.wait_but_sends(ins)
        grads = self._step_grads()
        self.found_inf = torch.zeros(1, dtype=torch.float32, device=self.device)
        if grads:
            inv = torch.full((1,), 1.0 / self.scaler.scale, dtype=torch.float32, device=self.device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, self.found_inf, inv)

    def grad_norm(self, ins: Instr) -> None:
        """`grad_norm` (clip_grad): this rank's share of the squared norm of the final gradients, which
        the `grad_norm` all-reduce after it sums over the world."""
        self.wait_but_sends(ins)
        self.norm_sq = self.clip.squared_norm(self._step_grads()).to(self.device)

    def step_reduction(self, ins: Instr, g) -> None:
        """The all-reduce of `unscale`'s overflow flag or `grad_norm`'s sum of squares."""
        t = self.found_inf if ins.block == "unscale" else self.norm_sq
        work = self.comm.all_reduce(t, op=dist.ReduceOp.SUM, group=g, async_op=True)
        self.issue(ins, [work], None)

    def _step_grads(self) -> list[Tensor]:
        """The step's final gradients, gathered once for the instructions before the step that read them."""
        if self.step_grads is None:
            self.step_grads = self._optimizer_grads()
        return self.step_grads

    def _optimizer_grads(self) -> list[Tensor]:
        if self.step_grads is not None:
            out, self.step_grads = self.step_grads, None
            return out
        out = []
        for k in self.opt_keys:
            if isinstance(k, tuple):
                g = self.gshard.get(k)
                if g is None:
                    g = torch.zeros_like(self.shards[k], dtype=self.gdtype)
                out.append(g)
            else:
                out.append(self.reduced.pop(k) if k in self.reduced else self.local_grad(k))
        if not self.held_gshards:  # (a held partition stays, zeroed as the next step starts)
            self.gshard = {}
        self.reduced = {}
        return out

    def copy(self, ins: Instr) -> None:
        """Offload: gradients to host buffers (d2h), updated parameters back to device (h2d)."""
        if ins.block in ("act_d2h", "act_h2d"):  # offload_layers (`simexec.exec.rank.activation_offload`)
            moved = self.act_offload.copy(ins)
            if ins.block == "act_d2h":
                self.release_offloaded_inputs(ins, moved)
            else:
                self.env.update(self.act_offload.unstash(ins.layer, ins.mb))
        elif ins.block == "grads_d2h":
            self.wait_but_sends(ins)
            for h, gdev in zip(self.host_grads, self._optimizer_grads()):
                h.copy_(gdev)
        elif ins.block == "params_h2d":  # all updated parameters, or (ZeRO-Infinity) one unit's before its gather
            with torch.no_grad():
                for k, t, h in zip(self.opt_keys, self.opt_tensors, self.host):
                    if not ins.items or (isinstance(k, tuple) and isinstance(k[1], int) and k[1] in ins.items):
                        t.copy_(h)
        else:
            raise ValueError(f"rank {self.rank}: {ins.name}: unknown copy {ins.block!r}")
