"""The layers concern of a rank's lowering: a layer's forward and backward, the head's and the
embedding's, in the order `simexec.program.layer_order.layer_steps` gives, with the cp and ep
exchanges between blocks, recompute, and the zero-bubble split of a backward into its input and
weight passes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from simexec.program.block import Block
from simexec.program.instructions import Instr
from simexec.program.layer_order import LayerStep
from simexec.program.lowering.tensor_parallel import TensorParallel


@dataclass
class LayerBackward:
    """What the steps of one layer's backward share."""

    layer: int
    mb: int
    chunk: int
    blocks: dict[str, Block]
    recompute: bool  # the layer's forward (selective: its attention core) is recomputed
    full: bool  # full recompute: the layer's whole forward
    saved: float  # the activations its forward saved
    kept: float  # zero-bubble under sp: the first norm's saved input, kept for its backward
    kept_forward: float  # what its forward left allocated: `saved`, or under recompute what the policy keeps
    regathered: Optional[str] = None  # the sub-layer's re-gathered input (sp), once issued
    regather_waited: bool = False  # a block before the column-parallel one already waited for it


class LayerLowering(TensorParallel):
    """A layer's, the head's and the embedding's compute and the collectives between their blocks,
    for `RankLowering`."""

    # --- forward -------------------------------------------------------------------------------------
    def layer_forward(self, l: int, mb: int, c: int, phase: str) -> None:
        """Layer l's forward (`phase` "fwd", or "recompute" before its backward)."""
        an = self.an
        blocks = an.layer(l)
        for step in an.layer_steps(l):
            if step.ring:
                self.ring_attention(phase, l, mb, c, blocks[step.name])
            elif not step.axis:
                self.compute(phase, step.name, l, mb, c, blocks[step.name])
            elif step.axis == "tp":
                self.tp(step.name, phase, l, mb, c, an.full_hidden_bytes)
            else:
                self.exchange(step, phase, l, mb, c)

    def head_forward(self, mb: int, c: int, unit: Optional[int] = None) -> None:
        """The head and loss: the model's, or (`unit`) an MTP depth's use of the shared head."""
        an, L = self.an, self.head_unit if unit is None else unit
        head = an.head
        if self.p.sp:
            self.compute("fwd", "norm", L, mb, c, head["norm"])
        self.tp("head_in", "fwd", L, mb, c, an.full_hidden_bytes)
        transient = an.loss_fwd_transient  # the logits (and a copy) the loss frees once it has saved its own
        self.memory("alloc", "activations", transient, f"act.logits_fwd.L{L}.m{mb}")
        self.compute("fwd", "head", L, mb, c, head["head"])
        ce_bytes = 4.0 * an.tokens
        self.coll(f"fwd.ce_max.L{L}.m{mb}", "allreduce", "tp", self.groups.tp, ce_bytes, (self.last_compute(),),
                  phase="fwd", block="ce_max", layer=L, mb=mb, chunk=c)
        self.compute("fwd", "xent", L, mb, c, head["xent"])
        self.coll(f"fwd.ce_sum.L{L}.m{mb}", "allreduce", "tp", self.groups.tp, 2 * ce_bytes, (self.last_compute(),),
                  phase="fwd", block="ce_sum", layer=L, mb=mb, chunk=c)
        self.compute("fwd", "loss", L, mb, c, head["loss"])
        released = an.logits_released
        self.memory("alloc", "activations", head["head"].saved - released, f"act.L{L}.m{mb}")
        self.memory("alloc", "activations", released, f"act.logits.L{L}.m{mb}")
        if self.p.sp:
            self.memory("alloc", "activations", head["norm"].saved, f"act.norm.L{L}.m{mb}")
        self.memory("free", "activations", transient, f"act.logits_fwd.L{L}.m{mb}")

    # --- the exchanges between blocks ----------------------------------------------------------------
    def exchange(self, step: LayerStep, phase: str, l: int, mb: int, c: int) -> None:
        """A cp or ep collective between two blocks (`step`, issued as its `bwd` verb in the backward):
        K/V all-gathered over cp (their gradients reduce-scattered back); cp_impl=a2a's heads exchange
        (DeepSpeed-Ulysses: `heads_in` turns this rank's q, k and v from its share of the sequence for
        all its heads into the whole sequence for a cp-th of them, `heads_out` turns the attention's
        output back); the experts' dispatch and combine over ep (`moe_dispatcher`'s collectives); under
        parallel folding with etp > 1 the dispatched rows' all-gather over etp and the outputs' reduce-scatter."""
        nbytes = self.an.exchange_bytes(step.name, len(self.groups.ep_net))
        # an exchange right after another (dispatch then etp_in, etp_out then combine, DeepEP's two hops)
        # moves what that one delivered: it waits for it, not only for the compute before both
        prev = self.out[-1] if self.out else None
        chained = (prev.name,) if (prev is not None and prev.kind == "collective" and prev.layer == l
                                   and prev.mb == mb and prev.phase == phase) else ()
        g = self.groups
        group = {"cp": g.cp, "ep": g.ep, "etp": g.etp, "ep_domain": g.ep_domain, "ep_net": g.ep_net}[step.axis]
        axis = "ep" if step.axis.startswith("ep_") else step.axis  # DeepEP's two hops: one comm stream
        self.coll(f"{phase}.{step.name}.L{l}.m{mb}", step.bwd if phase == "bwd" else step.fwd, axis, group,
                  nbytes, (self.last_compute(), *chained), phase=phase, block=step.name, layer=l, mb=mb, chunk=c)

    def ring_attention(self, phase: str, l: int, mb: int, c: int, attn: Block) -> None:
        """Ring attention over the cp group: K/V chunks hop to the next rank while each rank attends
        to the chunk it holds (forward: cp-1 hops). Backward: K/V travel with their partial
        gradients (cp-1 hops), and a last hop brings each dK/dV home."""
        cp, me = self.p.cp, self.coords["cp"]
        chunk = self.an.kv_bytes / cp
        part = Block(attn.op, attn.flops / cp, attn.bytes / cp, 0.0, bwd_flop_ratio=attn.bwd_flop_ratio, keys=attn.keys / cp)
        nxt = self.rp.mesh.rank(**{**self.coords, "cp": (me + 1) % cp})
        prv = self.rp.mesh.rank(**{**self.coords, "cp": (me - 1) % cp})
        bwd = phase == "bwd"
        hops = cp if bwd else cp - 1
        for i in range(cp):
            if i < hops:
                nbytes = chunk if (bwd and i == cp - 1) else chunk * (2 if bwd else 1)
                name = f"{phase}.kv.L{l}.m{mb}.o{(me - i) % cp}.h{i}"
                dep = self.last_compute() if i == 0 else self.out[-1].name
                if i > 0 and not bwd:
                    dep = f"{phase}.kv.L{l}.m{mb}.o{(me - i) % cp}.h{i - 1}"
                if bwd:
                    self.compute(phase, "attn", l, mb, c, part, suffix=f".r{i}")
                    dep = self.last_compute()
                self.emit(Instr(self.rank, name, "send", "p2p.send", "send", phase=phase, block="kv", layer=l,
                                mb=mb, chunk=c, bytes=nbytes, deps=(dep,), peer=nxt))
                if not bwd:
                    self.compute(phase, "attn", l, mb, c, part, suffix=f".r{i}")
                rname = f"{phase}.kv.L{l}.m{mb}.o{(me - 1 - i) % cp}.h{i}"
                self.emit(Instr(self.rank, rname, "recv", "p2p.recv", "recv", phase=phase, block="kv", layer=l,
                                mb=mb, chunk=c, bytes=nbytes, peer=prv))
                self.wait.append(rname)
            else:
                self.compute(phase, "attn", l, mb, c, part, suffix=f".r{i}")

    # --- backward ------------------------------------------------------------------------------------
    def layer_backward(self, l: int, mb: int, c: int) -> None:
        """Layer l's backward: its forward's steps in reverse, after the full recompute of its forward."""
        lb = self.start_layer_backward(l, mb, c)
        for step in reversed(self.an.layer_steps(l)):
            if step.name == "attn_in":
                self.release_after_input_pass(lb)
            if step.axis == "tp":
                self.tp_backward(step, lb)
            elif step.axis:
                self.exchange(step, "bwd", l, mb, c)
            elif step.name == "attn":
                self.attention_backward(step, lb)
            else:
                self.block_backward(step, lb)

    def forward_kept(self, l: int, c: int) -> float:
        """What layer l's forward leaves allocated for its backward: what its blocks save; under full
        recompute its input alone; under `recompute=op` what the policy keeps (`op_kept`)."""
        rc = self.is_recompute_layer(l, c)
        if rc and self.p.recompute == "full":
            return self.an.hidden_bytes
        if rc and self.p.recompute == "op":
            return self.an.op_kept(l)
        saved = sum(b.saved for b in self.an.layer(l).values())
        if rc and self.p.recompute == "selective":
            return saved - self.an.selective_discarded(l)
        return saved

    def start_layer_backward(self, l: int, mb: int, c: int) -> LayerBackward:
        """Recompute before the backward: under full, the layer's forward again; under op, the blocks its
        policy did not keep (the region's first saved tensor the backward reads recomputes them). Either
        way the activations beyond what the forward kept are held again."""
        an, blocks = self.an, self.an.layer(l)
        rc = self.is_recompute_layer(l, c)
        full = rc and self.p.recompute == "full"
        op = rc and self.p.recompute == "op"
        modules = an.selective_recomputed(l) if rc and self.p.recompute == "selective" else ()
        saved = sum(b.saved for b in blocks.values())
        kept = (an.hidden_bytes if full or op else blocks["norm1"].saved) if self.p.sp else 0.0
        kept_forward = self.forward_kept(l, c)
        if full:
            self.layer_forward(l, mb, c, "recompute")
        elif op:
            for name, b in an.op_recomputed(l).items():
                self.compute("recompute", name, l, mb, c, b)
        for step, b in modules:  # selective recompute's modules other than the attention core
            if b is not None:
                self.compute("recompute", step.name, l, mb, c, b)
            elif step.axis == "tp":
                self.tp(step.name, "recompute", l, mb, c, an.full_hidden_bytes)
            else:
                self.exchange(step, "recompute", l, mb, c)
        if full or op or (modules and saved > kept_forward):
            self.memory("alloc", "activations", saved - kept_forward, f"act.recompute.L{l}.m{mb}")
        return LayerBackward(l, mb, c, blocks, rc, full, saved, kept, kept_forward)

    def tp_backward(self, step: LayerStep, lb: LayerBackward) -> None:
        """A tp conjugate's backward. After a sub-layer's output (`*_out`) the sub-layer's backward
        starts, and under sp its input is re-gathered (`regather`). The layer's opening one
        (`attn_in`) also carries MLA's latent projections' gradient shares (replicated over tp, each
        tp rank holds its share of their gradient): it rides the input gradient's all-reduce, or
        under sp the first norm's all-reduce (a reduce-scatter would carry it in every slot)."""
        nbytes = self.an.full_hidden_bytes
        if step.name == "attn_in" and not (self.p.sp or self.split or self.p.tp_overlap):
            nbytes += self.rp.model.latent_params() * self.grad_dt
        self.tp(step.name, "bwd", lb.layer, lb.mb, lb.chunk, nbytes)
        if step.name.endswith("_out"):
            lb.regathered = self.regather(step.name.removesuffix("_out"), lb.layer, lb.mb, lb.chunk)
            lb.regather_waited = False

    def block_backward(self, step: LayerStep, lb: LayerBackward) -> None:
        """A block's backward, then the release of what it saved. A column-parallel block reads the
        re-gathered input and its input gradient goes to the tp conjugate next (`column_backward`);
        so do the shared experts' GEMMs in `moe_out`, the first block of the MoE's backward, which
        waits for the gather. After the first norm, its gradient's tp sum (`norm_grads`), with the router's
        where no tp collective surrounds the MoE layer (`unsurrounded_router_params`)."""
        l, mb, c = lb.layer, lb.mb, lb.chunk
        name, b = step.name, lb.blocks[step.name]
        if step.column:
            self.column_backward(name, l, mb, c, b, lb.regathered, lambda: self.release_saved(l, mb, name, b),
                                 wait=not lb.regather_waited)
            return
        if name == "moe_out":
            self.compute_regathered(name, l, mb, c, b, lb.regathered, release=False)
            lb.regather_waited = True
        else:
            self.compute("bwd", name, l, mb, c, b)
        self.release_saved(l, mb, name, b)
        if name == "norm1":
            if self.split:
                self.memory("free", "activations", lb.kept, f"act.input.L{l}.m{mb}")
            # under tp_overlap the weight passes before it made every partial gradient of the layer
            m = self.rp.model
            self.norm_grads(l, mb, c, self.partial_params(l) if self.p.tp_overlap
                            else m.pre_norm_params() + m.latent_params() + self.unsurrounded_router_params(l))

    def attention_backward(self, step: LayerStep, lb: LayerBackward) -> None:
        """The attention core's backward (in cp parts under ring attention), after its selective
        recompute."""
        l, mb, c, attn = lb.layer, lb.mb, lb.chunk, lb.blocks["attn"]
        if lb.recompute and self.an.selective_recomputes_attention:
            if step.ring:
                self.ring_attention("recompute", l, mb, c, attn)
            else:
                self.compute("recompute", "attn", l, mb, c, attn)
        if step.ring:
            self.ring_attention("bwd", l, mb, c, attn)
        else:
            self.compute("bwd", "attn", l, mb, c, attn)
        self.release_saved(l, mb, "attn", attn)

    def release_saved(self, l: int, mb: int, name: str, b: Block) -> None:
        """After a block's backward autograd lets go of what the block saved (under full recompute, of
        its recomputed copy; the layer's input goes with the block that saved it). Not under a
        zero-bubble schedule, whose input-gradient pass keeps the graph (`release_after_input_pass`)."""
        if not self.split and not self.offloaded(l):  # a reloaded layer's go together (`release_reloaded`)
            self.memory("free", "activations", b.saved, f"act.L{l}.m{mb}.{name}")

    def release_after_input_pass(self, lb: LayerBackward) -> None:
        """Zero-bubble: the input-gradient pass keeps the layer's graph for the weight pass; what only
        it read goes at the layer's end, the rest with the weight pass (`defer_frees_to`)."""
        if not self.split:
            return
        an, l, mb = self.an, lb.layer, lb.mb
        early = an.freed_by_input_pass(l)
        recomputed = lb.kept_forward < lb.saved
        self.memory("free", "activations", (lb.kept_forward if recomputed else lb.saved - early) - lb.kept,
                    f"act.L{l}.m{mb}")
        if recomputed:
            self.memory("free", "activations", lb.saved - lb.kept_forward - early, f"act.recompute.L{l}.m{mb}")
        self.memory("free", "activations", early, f"act.input_pass.L{l}.m{mb}", defer=False)

    def head_backward(self, mb: int, c: int, unit: Optional[int] = None) -> None:
        unit, head = self.head_unit if unit is None else unit, self.an.head
        again = self.regather("head", unit, mb, c)
        first = self.an.loss_grad_first  # the loss backward's first gradient, the rest is the head's workspace
        self.memory("alloc", "activations", first, f"act.loss_grad.L{unit}.m{mb}")
        self.compute("bwd", "loss", unit, mb, c, head["loss"])
        self.compute("bwd", "xent", unit, mb, c, head["xent"])
        released = self.an.logits_released
        self.column_backward("head", unit, mb, c, head["head"], again, lambda: self.memory(
            "free", "activations", head["head"].saved - released, f"act.L{unit}.m{mb}"))
        self.memory("free", "activations", first, f"act.loss_grad.L{unit}.m{mb}", defer=False)
        self.memory("free", "activations", released, f"act.logits.L{unit}.m{mb}", defer=False)
        self.tp("head_in", "bwd", unit, mb, c, self.an.full_hidden_bytes)
        if self.p.sp:
            self.compute("bwd", "norm", unit, mb, c, head["norm"])
            self.memory("free", "activations", head["norm"].saved, f"act.norm.L{unit}.m{mb}")
            self.norm_grads(unit, mb, c, self.rp.model.final_norm_params())

    def embed_backward(self, mb: int, c: int) -> None:
        self.tp("embed_out", "bwd", -1, mb, c, self.an.full_hidden_bytes)
        if not self.split:  # its backward is all weight gradient
            self.compute("bwd", "embed", -1, mb, c, self.an.embed)
