"""The multi-token-prediction concern of a rank's lowering (DeepSeek-V3 §2.2; Megatron-Core's
MultiTokenPredictionLayer): a depth's input (the shifted tokens' embedding, the two norms, eh_proj)
with its tensor-parallel collectives, its transformer block and the shared head and loss again, on
the stage that holds the head."""
from __future__ import annotations

from dataclasses import replace

from simexec.program.lowering.layers import LayerLowering


class MtpLowering(LayerLowering):
    """An MTP depth's passes, unit `ModelSpec.mtp_block(d)`; its use of the head is named after
    `mtp_head` so that its instructions and activations stay apart from the block's.

    Its tp collectives are Megatron-Core's (megatron/core/transformer/multi_token_prediction.py,
    `_get_embeddings` and `_concat_embeddings`): the vocabulary-parallel embedding's sum
    (`mtp_embed_out`: all-reduce, under sp reduce-scatter), eh_proj's column-parallel input
    (`mtp_eh_in`: the gradient's all-reduce, under sp the input's all-gather and the gradient's
    reduce-scatter, and the input re-gathered for the weight gradient) and its output gathered over
    the hidden dimension (`mtp_eh_out`: an all-gather, whose backward is a split; under sp then split
    over the sequence, whose backward all-gathers the gradient)."""

    def mtp_head(self, unit: int) -> int:
        return unit + self.rp.model.mtp_layers

    def mtp_forward(self, unit: int, mb: int, c: int) -> None:
        an, full = self.an, self.an.full_hidden_bytes
        blocks = an.mtp
        self.compute("fwd", "mtp_embed", unit, mb, c, blocks["mtp_embed"])
        self.tp("mtp_embed_out", "fwd", unit, mb, c, full)
        self.compute("fwd", "mtp_norm", unit, mb, c, blocks["mtp_norm"])
        self.memory("alloc", "activations", blocks["mtp_norm"].saved, f"act.mtp_norm.L{unit}.m{mb}")
        self.tp("mtp_eh_in", "fwd", unit, mb, c, 2 * full)
        self.compute("fwd", "mtp_in", unit, mb, c, blocks["mtp_in"])
        self.memory("alloc", "activations", blocks["mtp_in"].saved, f"act.mtp_in.L{unit}.m{mb}")
        self.tp("mtp_eh_out", "fwd", unit, mb, c, full)
        self.layer_forward(unit, mb, c, "fwd")
        self.memory("alloc", "activations", self.forward_kept(unit, c), f"act.L{unit}.m{mb}")
        self.head_forward(mb, c, unit=self.mtp_head(unit))

    def mtp_backward(self, unit: int, mb: int, c: int) -> None:
        an, full = self.an, self.an.full_hidden_bytes
        blocks = an.mtp
        self.head_backward(mb, c, unit=self.mtp_head(unit))
        self.layer_backward(unit, mb, c)
        self.tp("mtp_eh_out", "bwd", unit, mb, c, full)
        again = self.regather("mtp_eh", unit, mb, c, 2 * full)
        self.column_backward("mtp_in", unit, mb, c, blocks["mtp_in"], again, lambda: self.memory(
            "free", "activations", blocks["mtp_in"].saved, f"act.mtp_in.L{unit}.m{mb}"), gathered=2 * full)
        self.tp("mtp_eh_in", "bwd", unit, mb, c, 2 * full)
        self.compute("bwd", "mtp_norm", unit, mb, c, blocks["mtp_norm"])
        self.memory("free", "activations", blocks["mtp_norm"].saved, f"act.mtp_norm.L{unit}.m{mb}")
        if self.p.sp and not self.split:  # enorm's and hnorm's gradients, each over its rank's slice of the
            # sequence (split: made by the weight pass, summed with the unit's `tp_partial_grads`)
            self.norm_grads(unit, mb, c, 2 * self.rp.model.pre_norm_params(), block="mtp_norm_grads")
        self.tp("mtp_embed_out", "bwd", unit, mb, c, full)
        if not self.split:  # its backward is all weight gradient (the weight pass runs it)
            self.compute("bwd", "mtp_embed", unit, mb, c, blocks["mtp_embed"])

    def mtp_weight_pass(self, unit: int, mb: int, c: int) -> None:
        blocks = self.an.mtp
        self.compute("wgrad", "head", self.mtp_head(unit), mb, c, self.an.head["head"])
        for name, b in reversed(self.an.layer(unit).items()):
            if b.wgrad_flops:
                self.compute("wgrad", name, unit, mb, c, b)
        self.compute("wgrad", "mtp_in", unit, mb, c, blocks["mtp_in"])
        self.compute("wgrad", "mtp_norm", unit, mb, c, blocks["mtp_norm"])  # enorm's and hnorm's weights
        e = blocks["mtp_embed"]
        self.compute("wgrad", "mtp_embed", unit, mb, c, replace(e, wgrad_bytes=e.bwd_bytes, wgrad_tmp=e.bwd_workspace))
