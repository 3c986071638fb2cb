"""The tensor-parallel concern of a rank's lowering: Megatron's f/g conjugates, sequence
parallelism's re-gathers and norm-gradient sums, and tp_overlap's weight-gradient passes under
the tp collective of their input gradients."""
from __future__ import annotations

from typing import Callable, Optional

from simexec.program.block import Block
from simexec.program.layer_order import TP_CONJUGATES
from simexec.program.lowering.emit import PendingWeightPass, RankEmitter


class TensorParallel(RankEmitter):
    """tp/sp collectives for `RankLowering`'s layers; owns `pending_weight_pass` (tp_overlap)."""

    def tp(self, block: str, phase: str, layer: int, mb: int, chunk: int, nbytes: float) -> None:
        """One of Megatron's f/g collectives (or nothing where that side is the identity); under
        tp_overlap the pending weight-gradient pass runs while it is in flight."""
        fwd_op, bwd_op = TP_CONJUGATES[block][1 if self.p.sp else 0]
        verb = bwd_op if phase == "bwd" else fwd_op
        under, self.pending_weight_pass = self.pending_weight_pass, None
        name = None
        if verb and self.p.tp_async and verb in ("allgather", "reducescatter") and under is None:
            self.chunked_tp(verb, block, phase, layer, mb, chunk, nbytes)
            return
        if verb:
            name = self.coll(f"{phase}.{block}.L{layer}.m{mb}", verb, "tp", self.groups.tp, nbytes,
                             (self.last_compute(),), phase=phase, block=block, layer=layer, mb=mb, chunk=chunk,
                             wait=under is None)
        if under is not None:
            self.compute("wgrad", under.block, under.layer, under.mb, under.chunk, under.b)
            under.after()
            if name:
                self.wait.append(name)

    def chunked_tp(self, verb: str, block: str, phase: str, layer: int, mb: int, chunk: int, nbytes: float) -> None:
        """tp_async: a gather before a GEMM, or a reduce-scatter after one, in tp chunks pipelined with the
        GEMM. A gather's first chunk is waited for and the GEMM runs under the rest, which the compute after
        the GEMM waits for; a reduce-scatter's chunks but the last run under the GEMM that makes them (from
        when the compute before it ends), its last after it."""
        tp, group = self.p.tp, self.groups.tp
        first, rest = nbytes / tp, nbytes * (tp - 1) / tp
        tag = f"{phase}.{block}.L{layer}.m{mb}"
        kw = dict(phase=phase, block=block, layer=layer, mb=mb, chunk=chunk)
        if verb == "allgather":
            self.coll(tag, verb, "tp", group, first, (self.last_compute(),), **kw)
            rest_name = self.coll(f"{tag}.rest", verb, "tp", group, rest, (self.last_compute(),), wait=False, **kw)
            self.wait_after_next.append(rest_name)
        else:
            self.coll(f"{tag}.rest", verb, "tp", group, rest, (self.last_compute(1),), **kw)
            self.coll(tag, verb, "tp", group, first, (self.last_compute(),), **kw)

    def column_backward(self, block: str, layer: int, mb: int, chunk: int, b: Block, again: Optional[str],
                        after: Callable[[], None], wait: bool = True, release: bool = True,
                        gathered: Optional[float] = None) -> None:
        """The backward of a column-parallel block whose input gradient the next tp collective sums,
        then `after` (the frees of what the block saved). Under tp_overlap the input gradients alone:
        the weight gradients wait for that collective to be issued (`tp`), as Megatron-LM's
        LinearWithGradAccumulationAndAsyncCommunication issues its all-reduce or reduce-scatter before
        the weight-gradient GEMM, and what that GEMM reads is freed after it. `gathered`: the bytes of
        the re-gathered input (a hidden state's unless given)."""
        gathered = self.an.full_hidden_bytes if gathered is None else gathered
        if not (self.p.tp_overlap and b.wgrad_flops):
            self.compute_regathered(block, layer, mb, chunk, b, again, wait, release, gathered=gathered)
            after()
            return
        self.compute_regathered(block, layer, mb, chunk, b, again, wait, release=False, input_only=True)

        def weights_done() -> None:
            if again and release:
                self.memory("free", "activations", gathered, again, deps=(self.last_compute(),))
            after()

        self.pending_weight_pass = PendingWeightPass(block, layer, mb, chunk, b, weights_done)

    def regather(self, where: str, layer: int, mb: int, chunk: int, nbytes: Optional[float] = None) -> Optional[str]:
        """Under sp, the all-gather of a norm's output (saved as this rank's slice) that the
        column-parallel GEMM after it needs whole for its weight gradient (Megatron-LM's
        `LinearWithGradAccumulationAndAsyncCommunication`). Megatron issues it with the GEMM's backward
        and overlaps it with the input gradient; a block's backward here is one instruction, so it is
        issued as the sub-layer's backward starts, beside the blocks before the GEMM. Its buffer
        lives until the GEMM's backward ends. The compute stream allocates it as it issues the gather
        (`torch.empty` before `all_gather_into_tensor`), so the caching allocator caches it there.
        `nbytes`: the gathered input's bytes (a hidden state's unless given)."""
        if not self.p.sp:
            return None
        nbytes = self.an.full_hidden_bytes if nbytes is None else nbytes
        name = f"bwd.{where}_regather.L{layer}.m{mb}"
        after = self.last_compute()
        if len(self.groups.tp) > 1:
            self.memory("alloc", "activations", nbytes, name)
        return self.coll(name, "allgather", "tp", self.groups.tp, nbytes, (after,),
                         phase="bwd", block=f"{where}_regather", layer=layer, mb=mb, chunk=chunk, wait=False)

    def compute_regathered(self, block: str, layer: int, mb: int, chunk: int, b: Block, again: Optional[str],
                           wait: bool = True, release: bool = True, input_only: bool = False,
                           gathered: Optional[float] = None) -> None:
        """A backward block that reads a re-gathered input (`regather`): it waits for the gather,
        and the last reader frees its buffer."""
        if again and wait:
            self.wait.append(again)
        name = self.compute("bwd", block, layer, mb, chunk, b, input_only=input_only)
        if again and release:
            self.memory("free", "activations", self.an.full_hidden_bytes if gathered is None else gathered, again,
                        deps=(name,))

    def norm_grads(self, unit: int, mb: int, chunk: int, params: float, block: str = "norm_grads") -> None:
        """Under sp a norm's weight gradient is a sum over this rank's slice of the sequence: a
        unit's last norm (the one no later backward collective carries) has it summed over tp here,
        before the unit's gradients are reduced over dp. Megatron-LM all-reduces every
        sequence-parallel norm's gradient once after the backward; per micro-batch, these few bytes
        overlap the backward instead. `block`: another name where the unit has a second such sum (an MTP
        depth's input norms beside its block's first norm)."""
        self.coll(f"bwd.{block}.L{unit}.m{mb}", "allreduce", "tp", self.groups.tp, params * self.grad_dt,
                  (self.last_compute(),), phase="bwd", block=block, layer=unit, mb=mb, chunk=chunk,
                  wait=False)

    def unsurrounded_router_params(self, unit: int) -> float:
        """The router of a MoE layer that no tp collective surrounds (parallel folding over tp without a
        shared expert, `Anatomy.moe_without_tp`): each tp rank routes its own slice of the sequence, so
        its weight gradient is partial over tp with no `mlp_in` backward to carry it; the first norm's
        all-reduce sums it (Megatron-Core all-reduces sequence-parallel parameters' gradients over tp in
        finalize_model_grads)."""
        m = self.rp.model
        return float(m.hidden * m.moe.experts) if self.an.moe_without_tp and m.is_moe_layer(unit) else 0.0

    def partial_params(self, unit: int) -> float:
        """Parameters of a unit that tp replicates but each rank computes a part of the gradient of
        (norms, a router, MLA's latent projections)."""
        m = self.rp.model
        if unit == self.head_unit:
            return m.final_norm_params()
        params = 2 * m.pre_norm_params() + m.qk_norm_params() + m.latent_params()
        if self.is_mtp_unit(unit) and self.p.sp:  # an MTP depth's enorm and hnorm, on sequence slices
            params += 2 * m.pre_norm_params()
        return params + (m.hidden * m.moe.experts if m.is_moe_layer(unit) else 0)

    def tp_partial_grads(self, unit: int, mb: int, c: int) -> None:
        """Under a zero-bubble schedule (and tp_overlap without sp), the partial gradients of a unit's
        tp-replicated parameters (`partial_params`) are made after the input-gradient collectives that
        would have carried them: one all-reduce sums them."""
        if unit == -1:
            return
        params = self.partial_params(unit)
        self.coll(f"wgrad.norm_grads.L{unit}.m{mb}", "allreduce", "tp", self.groups.tp, params * self.grad_dt,
                  (self.last_compute(),), phase="wgrad", block="norm_grads", layer=unit, mb=mb, chunk=c, wait=False)
