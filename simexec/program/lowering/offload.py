"""The activation-offload concern of a rank's lowering (`Plan.offload_layers`): the saved activations
of the first N transformer layers copied to pinned host memory after their forward and back before
their backward, as Transformer Engine's default synchronizer orders it for Megatron-Core's
`cpu_offloading` (NVIDIA/TransformerEngine@d0067d0d transformer_engine/pytorch/cpu_offload.py,
`DefaultOffloadSynchronizer`, `OffloadableLayerState`; Megatron-Core enters its context around each
layer of the block, NVIDIA/Megatron-LM@d98e8a64 megatron/core/transformer/transformer_block.py).

With L layers on the rank and N offloaded, for layer i < N:

- its D2H copy is issued on one offload stream when layer i+1's forward starts (`fwd_step` ->
  `start_offload`), after the compute that saved its tensors (the per-tensor events);
- layer L-N+i's forward waits for that copy (`finish_offload_map`: the compute stream waits
  `finish_offload_event`), and only then is layer i's device memory let go
  (`release_activation_forward_gpu_memory`): the activations held on the device stay L-N layers' worth;
- its H2D reload is issued when layer L-1-N+i's backward starts (`start_reload_map`, in the pre-hook
  of that layer's output gradient), after everything the compute stream had issued
  (`offload_stream.wait_stream`), into device memory allocated then; layer i's backward waits for it
  (`pop_tensor` waits each tensor's reload event).

The copies share the device's host link (`Network.copy`: the `d2h` and `h2d` links an offloaded
optimizer's copies also use). The pinned host buffers are not device memory. Simplification: TE keeps
tensors below 256K elements on the device (norm statistics and such, small beside a layer's saved
activations); here every saved byte moves.
"""
from __future__ import annotations

from simexec.program.instructions import Instr
from simexec.program.lowering.emit import RankEmitter

OFFLOAD_STREAM = "copy.act"  # TE's one offload stream, both directions


class ActivationOffload(RankEmitter):
    """Where the forward and backward passes (`StagePasses`) meet the offload copies, for `RankLowering`;
    reads `LayerLowering.forward_kept` (what a layer's forward leaves allocated)."""

    def offloaded(self, unit: int) -> bool:
        """Whether a unit is a transformer layer whose activations go to the host (pp=1: its index is
        its position among the rank's layers, as TE's synchronizer counts its forwards)."""
        return 0 <= unit < min(self.p.offload_layers, self.head_unit)

    def offload_before_forward(self, unit: int, mb: int) -> None:
        """Before layer `unit`'s forward (TE's `fwd_step`): the previous layer's D2H copy starts, and the
        layer whose copy must be done by now is waited for and let go."""
        n = self.p.offload_layers
        if not n or not 0 <= unit < self.head_unit:
            return
        prev = unit - 1
        if self.offloaded(prev):
            self.emit(Instr(self.rank, f"copy.act_d2h.L{prev}.m{mb}", "copy", OFFLOAD_STREAM, "d2h", phase="fwd",
                            block="act_d2h", layer=prev, mb=mb, bytes=self.forward_kept(prev, 0),
                            deps=tuple(d for d in (self.last_compute(),) if d)))
        done = unit - (self.head_unit - n)
        if self.offloaded(done):
            copy = f"copy.act_d2h.L{done}.m{mb}"
            self.wait.append(copy)
            self.memory("free", "activations", self.forward_kept(done, 0), f"act.offload.L{done}.m{mb}",
                        deps=(copy,))

    def reload_before_backward(self, unit: int, mb: int) -> None:
        """Before layer `unit`'s backward (TE's `bwd_step`): the reload of the layer N+1 below starts into
        newly allocated device memory; if `unit` itself is offloaded its backward waits for its reload."""
        n = self.p.offload_layers
        if not n or not 0 <= unit < self.head_unit:
            return
        back = unit - (self.head_unit - 1 - n)
        if self.offloaded(back):
            nbytes = self.forward_kept(back, 0)
            self.memory("alloc", "activations", nbytes, f"act.reload.L{back}.m{mb}")
            self.emit(Instr(self.rank, f"copy.act_h2d.L{back}.m{mb}", "copy", OFFLOAD_STREAM, "h2d", phase="bwd",
                            block="act_h2d", layer=back, mb=mb, bytes=nbytes,
                            deps=tuple(d for d in (self.last_compute(),) if d)))
        if self.offloaded(unit):
            self.wait.append(f"copy.act_h2d.L{unit}.m{mb}")

    def release_reloaded(self, unit: int, mb: int) -> None:
        """After an offloaded layer's backward its reloaded tensors go at once (TE's `release_all_memory`,
        as the next layer's backward starts or the backward ends), not block by block."""
        if self.offloaded(unit):
            self.memory("free", "activations", self.forward_kept(unit, 0), f"act.reload.L{unit}.m{mb}",
                        deps=tuple(d for d in (self.last_compute(),) if d))
