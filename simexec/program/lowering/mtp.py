"""The multi-token-prediction concern of a rank's lowering (DeepSeek-V3 §2.2; Megatron-Core's
MultiTokenPredictionLayer): a depth's input projection, its transformer block and the shared head
and loss again, on the stage that holds the head."""
from __future__ import annotations

from simexec.program.lowering.layers import LayerLowering


class MtpLowering(LayerLowering):
    """An MTP depth's passes, unit `ModelSpec.mtp_block(d)`; its use of the head is named after
    `mtp_head` so that its instructions and activations stay apart from the block's."""

    def mtp_head(self, unit: int) -> int:
        return unit + self.rp.model.mtp_layers

    def mtp_forward(self, unit: int, mb: int, c: int) -> None:
        mtp_in = self.an.mtp_in
        self.compute("fwd", "mtp_in", unit, mb, c, mtp_in)
        self.memory("alloc", "activations", mtp_in.saved, f"act.mtp_in.L{unit}.m{mb}")
        self.layer_forward(unit, mb, c, "fwd")
        self.memory("alloc", "activations", self.forward_kept(unit, c), f"act.L{unit}.m{mb}")
        self.head_forward(mb, c, unit=self.mtp_head(unit))

    def mtp_backward(self, unit: int, mb: int, c: int) -> None:
        self.head_backward(mb, c, unit=self.mtp_head(unit))
        self.layer_backward(unit, mb, c)
        self.compute("bwd", "mtp_in", unit, mb, c, self.an.mtp_in)
        self.memory("free", "activations", self.an.mtp_in.saved, f"act.mtp_in.L{unit}.m{mb}")

    def mtp_weight_pass(self, unit: int, mb: int, c: int) -> None:
        self.compute("wgrad", "head", self.mtp_head(unit), mb, c, self.an.head["head"])
        for name, b in reversed(self.an.layer(unit).items()):
            if b.wgrad_flops:
                self.compute("wgrad", name, unit, mb, c, b)
        self.compute("wgrad", "mtp_in", unit, mb, c, self.an.mtp_in)
