"""Pipeline messages: the activation sent to the next stage and its gradient sent back.

`isend` is issued eagerly and `irecv` posted when the recv instruction comes; both are waited like
collectives. Without sequence parallelism every tp rank holds the whole boundary tensor, so each
sends only its 1/tp piece (`ResolvedPlan.pipeline_slices`) and the receiver's `act_gather` /
`grad_gather` all-gathers the pieces over tp, Megatron-LM's scatter-gather of pipeline messages.
"""
from __future__ import annotations

import math
import zlib

import torch

from simexec.program.instructions import Instr


class PipelineMessages:
    """The sends, receives and tp gathers at pipeline-stage boundaries for `_Rank`
    (`simexec.exec.rank.interpreter`), a mixin.

    Reads of the rank: `rp`, `m`, `plan`, `coords`, `device`, `dtype`, `tokens_res`, `comm`,
    `_send_release`, `read`, `take_grad`, `resolve`, `wait_name`, `_issue`, `_deliver`, `ring_p2p`.
    Shares with it: `env`, `d` (activations and gradients)."""

    def _boundary(self, ins: Instr) -> int:
        """The layer whose input crosses this send/recv (or the gather after it): a virtual stage's
        first layer, or the one after its last (L = the head's input)."""
        stage = self.rp.stage(self.coords["pp"], ins.chunk)
        layers = self.rp.stage_layers[stage]
        what = ins.block.removesuffix("_gather")
        outgoing = (ins.kind == "send") == (what == "act")  # act sent / grad received: stage output
        return layers[-1] + 1 if outgoing else layers[0]

    @property
    def _message_shape(self) -> tuple[int, int, int]:
        """A pipeline message's whole tensor: this rank's activation at a stage boundary."""
        return (self.plan.mbs, self.tokens_res, self.m.hidden)

    def p2p(self, ins: Instr) -> None:
        if ins.block == "kv":
            return self.ring_p2p(ins)
        key = ("x", self._boundary(ins), ins.mb)
        tag = zlib.crc32(ins.name.encode()) & 0x7FFFFFFF  # same name on both ends; crc32 is stable across processes
        slices = self.rp.pipeline_slices
        if ins.kind == "send":
            t = (self.read(key) if ins.block == "act" else self.take_grad(key)).detach()
            if slices > 1:  # every tp rank holds the whole tensor: send this rank's piece
                t = t.reshape(-1).chunk(slices)[self.coords["tp"]]
            t = t.contiguous()
            self._issue(ins, [self.comm.isend(t, ins.peer, tag=tag)], None)  # t stays alive in the work until sent
            if ins.block == "act":
                k = self.resolve(key)
                if k is not None:
                    del self.env[k]
        else:
            grad = ins.block == "grad"
            if slices > 1:  # a piece, all-gathered over tp by the next instruction (`pipeline_gather`)
                buf = torch.empty(math.prod(self._message_shape) // slices, dtype=self.dtype, device=self.device)
                key, grad = ("piece",) + key[1:], False
            else:
                buf = torch.empty(self._message_shape, dtype=self.dtype, device=self.device)
            work = self.comm.irecv(buf, ins.peer, tag=tag)
            sent = self._send_release.get(ins.name, ())

            def finish():
                self._deliver(key, buf, grad)
                for name in sent:  # complete by now (see _plan_send_release): drop their tensors
                    self.wait_name(name)

            w = self._issue(ins, [work], finish)
            (self.d if grad else self.env)[key] = w

    def pipeline_gather(self, ins: Instr, g) -> None:
        """The pieces of a pipeline message, all-gathered over tp into the whole tensor (a tp group
        lists its ranks in tp order, so the pieces land in the order they were cut)."""
        b = self._boundary(ins)
        piece = self.read(("piece", b, ins.mb))
        del self.env[("piece", b, ins.mb)]
        out = torch.empty(len(ins.group) * piece.numel(), dtype=piece.dtype, device=piece.device)
        work = self.comm.all_gather(out, piece, group=g, async_op=True)
        key, grad = ("x", b, ins.mb), ins.block == "grad_gather"

        def finish():
            self._deliver(key, out.view(self._message_shape), grad)

        w = self._issue(ins, [work], finish)
        (self.d if grad else self.env)[key] = w
