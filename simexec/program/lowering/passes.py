"""An action's pass over its virtual stage's units (forward, backward, a zero-bubble schedule's
weight pass): where the layers meet the ZeRO-3 gathers before each unit, the gradient reductions
after it and the pipeline's messages around the stage."""
from __future__ import annotations

from dataclasses import replace

from simexec.program.lowering.mtp import MtpLowering
from simexec.program.schedules import Action


class StagePasses(MtpLowering):
    """The passes of `RankLowering`'s actions; the gathers, reductions and messages they call are
    `Zero3Lowering`'s, `GradientLowering`'s and `PipelineLowering`'s."""

    def forward(self, act: Action) -> None:
        c, mb = act.chunk, act.mb
        vs = self.stage(c)
        self.receive_input(act)
        units = self.units(c)
        self.prefetch(units, "fwd", mb, c)
        for j, unit in enumerate(units):
            self.wait_gather(unit, "fwd", mb)
            if unit == -1:
                self.compute("fwd", "embed", -1, mb, c, self.an.embed)
                self.tp("embed_out", "fwd", -1, mb, c, self.an.full_hidden_bytes)
            elif unit == self.head_unit:
                self.head_forward(mb, c)
            elif self.is_mtp_unit(unit):
                self.mtp_forward(unit, mb, c)
            else:
                self.offload_before_forward(unit, mb)
                self.layer_forward(unit, mb, c, "fwd")
                self.memory("alloc", "activations", self.forward_kept(unit, c), f"act.L{unit}.m{mb}")
            self.release_gather(unit, "fwd", mb)
            self.prefetch_next(units, j, "fwd", mb, c)
        if vs < self.rp.virtual_stages - 1 and not self.holds(vs + 1):
            self.send("act", vs, mb, self.an.hidden_bytes)

    def backward(self, act: Action) -> None:
        c, mb = act.chunk, act.mb
        vs = self.stage(c)
        self.receive_input(act)
        units = list(reversed(self.units(c)))
        self.prefetch(units, "bwd", mb, c)
        for j, unit in enumerate(units):
            self.wait_gather(unit, "bwd", mb)
            if self.split:
                self.defer_frees_to = (unit, mb)
            if unit == self.head_unit:
                self.head_backward(mb, c)
            elif self.is_mtp_unit(unit):
                self.mtp_backward(unit, mb, c)
            elif unit == -1:
                self.embed_backward(mb, c)
            else:
                self.reload_before_backward(unit, mb)
                self.layer_backward(unit, mb, c)
                self.release_reloaded(unit, mb)
            self.defer_frees_to = None
            if not self.split:
                if self.p.tp_overlap and not self.p.sp:
                    # the partial gradients the weight passes made after the tp collectives (under sp
                    # the unit's last norm's all-reduce, after them, carries them)
                    self.tp_partial_grads(unit, mb, c)
                self.grads_ready(unit, mb, c)
            self.release_gather(unit, "bwd", mb)
            self.prefetch_next(units, j, "bwd", mb, c)
        if not self.split:  # else after the weight pass
            self.reduce_micro_batch(mb)
        if vs > 0 and not self.holds(vs - 1):
            self.send("grad", vs, mb, self.an.hidden_bytes)

    def weight_pass(self, act: Action) -> None:
        """A zero-bubble schedule's W: the weight gradients of a micro-batch's units, in the order of
        their backward, each unit then freeing its activations and reducing its gradients."""
        c, mb = act.chunk, act.mb
        for unit in reversed(self.units(c)):
            if unit == self.head_unit:
                self.compute("wgrad", "head", unit, mb, c, self.an.head["head"])
            elif self.is_mtp_unit(unit):
                self.mtp_weight_pass(unit, mb, c)
            elif unit == -1:
                e = self.an.embed
                self.compute("wgrad", "embed", -1, mb, c,
                             replace(e, wgrad_bytes=e.bwd_bytes, wgrad_tmp=e.bwd_workspace))
            else:
                for name, b in reversed(self.an.layer(unit).items()):
                    if b.wgrad_flops:
                        self.compute("wgrad", name, unit, mb, c, b)
            self.tp_partial_grads(unit, mb, c)
            for ins in self.deferred_frees.pop((unit, mb), []):
                self.emit(replace(ins, deps=(self.last_compute(),)))
            self.grads_ready(unit, mb, c)
        self.reduce_micro_batch(mb)
