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
    """The sends, receives and tp gathers at pipeline-stage boundaries for `RankInterpreter`
    (`simexec.exec.rank.interpreter`), a mixin.

    Reads of the rank: `rp`, `m`, `plan`, `coords`, `instrs`, `device`, `dtype`, `tokens_res`, `comm`,
    `send_release` (`plan_send_release`'s, made once per run), `read`, `take_grad`, `resolve`,
    `wait_name`, `issue`, `deliver`, `ring_p2p`.
    Shares with it: `env`, `d` (activations and gradients)."""

    def _boundary(self, ins: Instr) -> int:
        """The layer whose input crosses this send/recv (or the gather after it): a virtual stage's
        first layer, or the one after its last (L = the head's input). A stage without transformer
        layers (only the embedding, or only the head) passes on the input it takes: the layer after
        the stages before it."""
        stage = self.rp.stage(self.coords["pp"], ins.chunk)
        first = sum(len(self.rp.stage_layers[s]) for s in range(stage))
        what = ins.block.removesuffix("_gather")
        outgoing = (ins.kind == "send") == (what == "act")  # act sent / grad received: stage output
        return first + len(self.rp.stage_layers[stage]) if outgoing else first

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
            self.issue(ins, [self.comm.isend(t, ins.peer, tag=tag)], None)  # t stays alive in the work until sent
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
            sent = self.send_release.get(ins.name, ())

            def finish():
                self.deliver(key, buf, grad)
                for name in sent:  # complete by now (see plan_send_release): drop their tensors
                    self.wait_name(name)

            w = self.issue(ins, [work], finish)
            (self.d if grad else self.env)[key] = w

    def plan_send_release(self) -> dict[str, list[str]]:
        """Pipeline sends: recv name -> the sends that are certainly complete once it has arrived.

        A gloo send's work never reports completion until waited, and its tensor (a stage's output,
        or an input gradient) lives in it until then. A send is complete once its peer has received
        it, and the peer received it before any later message it sends back to this rank: its recv
        comes at the start of one of its actions (`pipeline_order`), and its sends follow it. So the
        first message the peer sends here from that action on releases the send (it is waited, without
        blocking, when that message is). Sends with no such message end with the step."""
        from simexec.program.schedules import pipeline_order

        p, rp = self.plan, self.rp
        if p.pp == 1:
            return {}
        V, me = rp.virtual_stages, self.coords["pp"]
        order = pipeline_order(p.schedule_name, p.pp, rp.micro_batches, p.vpp)
        out: dict[str, list[str]] = {}
        for ins in self.instrs:
            if ins.kind != "send" or ins.block not in ("act", "grad"):
                continue
            vs = int(ins.name.split(".")[2][1:])
            dest = vs + 1 if ins.block == "act" else vs - 1
            peer, chunk = rp.place(dest)
            acts = order[peer]
            want = ("F" if ins.block == "act" else "B", chunk, ins.mb)
            i = next((k for k, a in enumerate(acts) if (a.kind, a.chunk, a.mb) == want), None)
            if i is None:
                continue
            for a in acts[i:]:
                pvs = rp.stage(peer, a.chunk)
                if a.kind == "F" and pvs < V - 1 and rp.place(pvs + 1)[0] == me:
                    out.setdefault(f"p2p.act.v{pvs}.m{a.mb}", []).append(ins.name)
                    break
                if a.kind == "B" and pvs > 0 and rp.place(pvs - 1)[0] == me:
                    out.setdefault(f"p2p.grad.v{pvs}.m{a.mb}", []).append(ins.name)
                    break
        return out

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
            self.deliver(key, out.view(self._message_shape), grad)

        w = self.issue(ins, [work], finish)
        (self.d if grad else self.env)[key] = w
