"""The compute a search's bounds price: each layer's, the embedding's and the head's forward and
backward at full speed (the simulator's `ComputeModel`), with the collectives the compute stream
waits on at their idle-network price, added up per virtual stage and per ZeRO-3 parameter unit."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Optional

from simexec.program.instructions import Instr
from simexec.program.layer_order import TP_CONJUGATES, LayerStep
from simexec.program.param_tensors import unit_tensors
from simexec.specs.zero3_flavours import DEFAULT_ZERO3_FLAVOUR, Zero3Flavour, zero3_flavour
from simexec.search.space import Structure
from simexec.sim.overlap import OverlapShares

if TYPE_CHECKING:
    from simexec.search.bounds import Bounds

# Sequence parallelism's norm blocks (`layer_steps`' norm1, norm2): left out of the bounds, which stay
# below the simulation without them.
UNPRICED_BLOCKS = ("norm1", "norm2")
EP_AXES = ("ep", "ep_net", "ep_domain")  # the ep all-to-alls `moe_a2a_overlap` hides


@dataclass(frozen=True, slots=True)
class LayerCost:
    """One layer's prices on one rank (seconds, bytes). `forward` and `backward` include the
    collectives the compute waits on (`forward_collectives`, `backward_collectives` of them), and
    `backward` the recompute of a recomputed layer."""

    forward: float
    backward: float
    saved_bytes: float  # activations the forward keeps for the backward
    forward_closing: float  # the collective that ends the forward
    backward_closing: float  # what of the collective that ends the backward outlasts its compute
    forward_collectives: float
    backward_collectives: float
    weight_pass: float  # the weight-gradient pass of a zero-bubble schedule (else 0)


@dataclass(frozen=True, slots=True)
class HeadCost:
    """The head's prices on one rank (seconds, bytes), as `LayerCost`'s fields of the same names."""

    forward: float
    backward: float
    saved_bytes: float
    forward_collectives: float
    backward_collectives: float


class UnitCost(NamedTuple):
    """One ZeRO-3 parameter unit's forward or backward, in seconds: the collective that opens it, its
    compute with the collectives inside it, the one that closes it, the all-gather of its parameters
    and the reduce-scatter of its gradients (0 in a forward). A named tuple: the ZeRO-3 replay makes
    many."""

    opening: float
    body: float
    closing: float
    gather: float
    reduce_scatter: float


class StageCosts:
    """Per virtual stage of one structure: forward (F), backward (B) and weight-gradient pass (W)
    seconds, their compute alone (Fx, Bx), the collectives that open (Fh, Bh) and close (Ft, Bt) them,
    and the activation bytes a forward saves and an input-gradient pass keeps for its weight pass."""

    def __init__(self, b: Bounds, st: Structure):
        from simexec.program.blocks import Anatomy

        self.b = b
        self.rp = rp = st.rp
        self.p = p = rp.plan
        self.cm = b.cm(p.dtype, rp.stack)
        self.shares = OverlapShares(b.cluster, p.tp_async)
        self.comm_key, self.comm = b.comm(rp)
        self.an = an = Anatomy(rp)
        self.pp, self.vpp, self.m = p.pp, p.vpp, rp.micro_batches
        self.V = p.pp * p.vpp
        # virtual stage of each (pipeline rank, chunk), and the pipeline rank of each virtual stage
        self.stage = [[rp.stage(r, c) for c in range(p.vpp)] for r in range(p.pp)]
        self.owner = [rp.place(vs)[0] for vs in range(self.V)]
        self.v_shaped = p.pipeline_schedule.v_shaped
        self.L = rp.model.layers
        self.sp = 1 if p.sp else 0
        self.dt, self.gdt = rp.dtype_bytes, rp.grad_bytes  # parameters, gradients
        model = rp.model
        ranks = self.comm.rank_of_stage
        # zero-bubble schedules: B is the input-gradient pass, W the weight-gradient pass
        self.split = p.pipeline_schedule.splits_backward
        self.F, self.B, self.W, self.saved, self.Ft, self.Bt = [], [], [], [], [], []
        self.kept: list[float] = []
        self.Fx, self.Bx = [], []  # the compute alone (F and B less the collectives they wait on)
        self.Fh, self.Bh = [], []  # the collective that opens F and B (it may run before the recv)
        self._k = 0.0
        dense: dict[int, tuple[LayerCost, LayerCost]] = {}
        for vs in range(self.V):
            r = ranks[self.owner[vs]]
            layers = rp.stage_layers[vs]
            n = len(layers)
            n_rc = self.n_recomputed(n)
            # offload_layers (pp = 1): the first layers' saved activations are on the host by the first
            # backward (`simexec.program.lowering.offload`), so they leave the device's held bytes
            n_off = p.offload_layers if self.V == 1 else 0
            if n == 0:  # a stage of the embedding or the head alone (a `layout`)
                f = b_ = w = saved = kf = kb = ft = bt = 0.0
            elif model.moe is None and model.sliding_window is None:  # every layer alike
                pair = dense.get(r)
                if pair is None:
                    pair = dense[r] = (self._layer(layers[0], True, r), self._layer(layers[0], False, r))
                lr, ln = pair
                f = n * ln.forward
                w = n * ln.weight_pass
                b_ = n_rc * lr.backward + (n - n_rc) * ln.backward
                saved = n_rc * lr.saved_bytes + (n - n_rc) * ln.saved_bytes
                saved -= min(n_off, n) * ln.saved_bytes  # offload_layers needs recompute=none: n_rc = 0
                kf = n * ln.forward_collectives
                kb = n_rc * lr.backward_collectives + (n - n_rc) * ln.backward_collectives
                ft, bt = ln.forward_closing, ln.backward_closing
            else:
                f = b_ = w = saved = kf = kb = 0.0
                for pos, l in enumerate(layers):
                    c = self._layer(l, pos < n_rc, r)
                    f += c.forward
                    w += c.weight_pass
                    b_ += c.backward
                    if pos >= n_off:
                        saved += c.saved_bytes
                    kf += c.forward_collectives
                    kb += c.backward_collectives
                ft, bt = c.forward_closing, self._layer(layers[0], 0 < n_rc, r).backward_closing
            if vs == 0:
                ef, eb = self._tp("embed_out", 0, r), self._tp("embed_out", 1, r)
                f += self._fwd(an.embed) + ef
                if self.split:  # the embedding's backward is all weight gradient
                    w += self.cm.time(an.embed.op, an.embed.bwd_flops, an.embed.bwd_bytes, "bwd")
                    b_ += eb
                else:
                    b_ += self._bwd(an.embed) + eb  # eb runs before the embedding's backward compute
                kf += ef
                kb += eb
                bt = 0.0
            # opening collectives: waiting only for the rank's previous compute, they may overlap
            # the wait for the pipeline message
            fh = 0.0 if vs == 0 or n == 0 else self._tp("attn_in", 0, r)
            last_rc = n_rc >= n  # the stage's last layer recomputes (positions < n_rc do)
            bh = self._tp("attn_in", 0, r) if (last_rc and p.recompute == "full") else self._tp("mlp_out", 1, r)
            if n == 0:
                bh = 0.0
            if vs == self.V - 1:
                bh = 0.0
                head = self._head(r)
                w += self._wgrad(an.head["head"])
                f += head.forward
                b_ += head.backward
                saved += head.saved_bytes
                kf += head.forward_collectives
                kb += head.backward_collectives
                ft = 0.0
            self.F.append(f)
            self.B.append(b_)
            self.W.append(w)
            self.Fx.append(f - kf)
            self.Bx.append(b_ - kb)
            self.Fh.append(fh)
            self.Bh.append(bh)
            self.saved.append(saved)
            if self.split:  # the output gradients a stage's input-gradient pass keeps for its weight pass
                kept = sum(sum(b.grad_out for b in an.layer(l).values()) - an.freed_by_input_pass(l) for l in layers)
                head_kept = an.head["head"].grad_out - an.logits_released
                self.kept.append(kept + (head_kept if vs == self.V - 1 else 0.0))
            self.Ft.append(ft)
            self.Bt.append(bt)

    def n_recomputed(self, n: int) -> int:
        """How many of a stage's n layers recompute (the first ones)."""
        p = self.p
        return 0 if p.recompute == "none" else (n if p.recompute_layers is None else min(n, p.recompute_layers))

    # --- prices --------------------------------------------------------------------------------
    def _fwd(self, blk) -> float:
        return self.cm.time(blk.op, blk.flops, blk.bytes, "fwd", blk.keys, blk.gemm_groups)

    def _bwd(self, blk) -> float:
        if self.split:
            return self._input_pass(blk)
        return self.cm.time(blk.op, blk.bwd_flops, blk.bwd_bytes, "bwd", blk.keys, blk.gemm_groups)

    def _input_pass(self, blk) -> float:
        """A block's backward without its weight gradients (`bwd` of a split backward)."""
        return self.cm.time(blk.op, blk.bwd_flops - blk.wgrad_flops, blk.bwd_bytes - blk.wgrad_bytes, "bwd", blk.keys,
                            blk.gemm_groups)

    def _weight_pass(self, blk) -> float:
        """A block's weight gradients alone (`wgrad` of a split backward)."""
        return self.cm.time(blk.op, blk.wgrad_flops, blk.wgrad_bytes, "wgrad", 0.0, blk.gemm_groups)

    def _wgrad(self, blk) -> float:
        """A block's weight-gradient pass (zero-bubble schedules only)."""
        if not (self.split and blk.wgrad_flops):
            return 0.0
        return self._weight_pass(blk)

    def _column_bwd(self, blk, block: str, rank: int) -> float:
        """A column-parallel block's backward and the tp collective of its input gradient after it.
        Under tp_overlap the block's weight-gradient pass runs while that collective is in flight: the
        pair takes at least the input-gradient pass and the longer of the two."""
        c = self._tp(block, 1, rank)
        if not (self.p.tp_overlap and blk.wgrad_flops):
            return self._bwd(blk) + c
        w = self._weight_pass(blk)
        self._k -= min(c, w)  # the collective's seconds under the weight pass are not waited for
        # the weight pass loses a share of its SMs to the collective while both run (`tp_lost`)
        return self._input_pass(blk) + max(w + self._tp_lost(block, rank) * c, c)

    def _closing(self, blk, block: str, rank: int) -> float:
        """What of the tp collective after a column-parallel block's backward outlasts its compute."""
        c = self._tp(block, 1, rank)
        if not (self.p.tp_overlap and blk.wgrad_flops):
            return c
        return max(0.0, c - self._weight_pass(blk) - self._tp_lost(block, rank) * c)

    def _tp_lost(self, block: str, rank: int) -> float:
        """The share of compute a column-parallel block's backward tp collective takes while in flight
        (`simexec.sim.overlap`): the weight pass beside it for c seconds does at least a * c less."""
        verb = TP_CONJUGATES[block][self.sp][1]
        group = self.comm.groups(rank, self.p.ep, self.p.dp_shard, self.p.etp)["tp"]
        ins = Instr(rank, "", "collective", "comm.tp", f"{verb}@tp", axis="tp", block=block, group=group)
        held = self.shares.held(ins)
        return 1.0 - self.shares.rate(held) if held else 0.0

    def _tp(self, block: str, bwd: int, rank: int) -> float:
        if block in ("mlp_in", "mlp_out") and self.an.moe_without_tp:
            return 0.0  # none around a folded MoE layer's MLP (`Anatomy.moe_without_tp`); dense layers' left out too
        verb = TP_CONJUGATES[block][self.sp][bwd]
        t = self._coll(verb, rank, "tp", self.an.full_hidden_bytes)
        if self.p.tp_async and verb in ("allgather", "reducescatter"):
            return t / self.p.tp  # one chunk exposed; the rest under the GEMM beside it (`chunked_tp`)
        return t

    def _coll(self, verb: str, rank: int, axis: str, nbytes: float) -> float:
        """A collective the compute stream waits on (its seconds are also added up in `_k`)."""
        t = self.comm.coll(verb, rank, axis, nbytes, self.p.ep, etp=self.p.etp)
        self._k += t
        return t

    def _exchange(self, step: LayerStep, bwd: int, rank: int) -> float:
        """A cp, ep or etp collective of the layer's walk (`LayerStep`), as its forward or backward verb,
        of the bytes the lowering gives it (`Anatomy.exchange_bytes`). Under `moe_a2a_overlap` the ep
        all-to-alls may run under the paired micro-batch's compute: 0 here."""
        p = self.p
        if p.moe_a2a_overlap and step.axis in EP_AXES and p.moe_dispatcher != "allgather":
            return 0.0
        net_ranks = len(self.comm.groups(rank, p.ep, p.dp_shard, p.etp)["ep_net"]) if step.axis.startswith("ep_") else 1
        return self._coll(step.bwd if bwd else step.fwd, rank, step.axis, self.an.exchange_bytes(step.name, net_ranks))

    def _ring_attention(self, attn, bwd: int) -> float:
        """Ring attention: cp partial attentions between the hops of K/V around the cp group (whose
        messages are left out: they only delay)."""
        p = self.p
        f, by = (attn.bwd_flops, attn.bwd_bytes) if bwd else (attn.flops, attn.bytes)
        return p.cp * self.cm.time(attn.op, f / p.cp, by / p.cp, "bwd" if bwd else "fwd", attn.keys / p.cp)

    def _layer_forward(self, steps: tuple[LayerStep, ...], blocks: dict, rank: int) -> float:
        """A layer's forward: its steps (`layer_steps`) in order, each block's compute and each
        collective the compute stream waits on."""
        t = 0.0
        for step in steps:
            if step.axis == "tp":
                t += self._tp(step.name, 0, rank)
            elif step.axis:
                t += self._exchange(step, 0, rank)
            elif step.name in UNPRICED_BLOCKS:
                continue
            elif step.ring:
                t += self._ring_attention(blocks[step.name], 0)
            else:
                t += self._fwd(blocks[step.name])
        return t

    def _layer_backward(self, steps: tuple[LayerStep, ...], blocks: dict, rank: int, rc: bool) -> float:
        """A layer's backward: its steps in reverse, a column-parallel block with the tp conjugate of
        its input gradient (`_column_bwd`), the attention after its selective recompute."""
        p, t = self.p, 0.0
        for i in range(len(steps) - 1, -1, -1):
            step = steps[i]
            if step.axis == "tp":
                if i + 1 < len(steps) and steps[i + 1].column:
                    continue  # priced with the column-parallel block after it
                t += self._tp(step.name, 1, rank)
            elif step.axis:
                t += self._exchange(step, 1, rank)
            elif step.name in UNPRICED_BLOCKS:
                continue
            elif step.column:
                t += self._column_bwd(blocks[step.name], steps[i - 1].name, rank)
            elif step.name == "attn":
                attn = blocks["attn"]
                if rc and self.an.selective_recomputes_attention:
                    t += self._ring_attention(attn, 0) if step.ring else self._fwd(attn)
                t += self._ring_attention(attn, 1) if step.ring else self._bwd(attn)
            else:
                t += self._bwd(blocks[step.name])
        return t

    def _layer(self, l: int, rc: bool, rank: int) -> LayerCost:
        """Layer l on `rank`, recomputed or not (`rc`); shared by the search's structures through
        `Bounds.layers`, keyed by what the prices depend on."""
        p = self.p
        moe, window = self.rp.model.is_moe_layer(l), self.rp.model.attention_window(l, self.rp.seq_len)
        key = (self.comm_key, p.tp, self.sp, p.cp, p.cp_impl, p.ep, p.etp, p.moe_dispatcher, p.moe_a2a_overlap,
               p.moe_router_skew, p.mbs, p.dtype, p.flash_attention, p.recompute, p.recompute_modules, rc,
               moe, window, rank, self.split, p.tp_overlap, p.tp_async, self.rp.stack.name)
        out = self.b.layers.get(key)
        if out is not None:
            return out
        an = self.an
        blocks, steps = an.layer(l), an.layer_steps(l)
        full = rc and p.recompute == "full"
        self._k = 0.0
        f = self._layer_forward(steps, blocks, rank)
        kf = self._k
        b = f if full else 0.0
        if rc and p.recompute == "op":
            b += sum(self._fwd(x) for x in an.op_recomputed(l).values())
        selective = rc and p.recompute == "selective"
        for step, x in an.selective_recomputed(l) if selective else ():
            b += (self._fwd(x) if x is not None else self._tp(step.name, 0, rank) if step.axis == "tp"
                  else self._exchange(step, 0, rank))
        self._k = kf if full else 0.0
        b += self._layer_backward(steps, blocks, rank, rc)
        saved = an.hidden_bytes if full else sum(x.saved for x in blocks.values())
        if selective:
            saved -= an.selective_discarded(l)
        kb = self._k
        w = sum(self._wgrad(x) for x in blocks.values())
        out = LayerCost(forward=f, backward=b, saved_bytes=saved, forward_closing=self._tp("mlp_out", 0, rank),
                        backward_closing=self._closing(blocks["qkv"], "attn_in", rank), forward_collectives=kf,
                        backward_collectives=kb, weight_pass=w)
        self.b.layers[key] = out
        return out

    def _head(self, rank: int) -> HeadCost:
        """The head (its weight-gradient pass is priced apart, by `_wgrad`)."""
        an = self.an
        h = an.head
        ce = 4.0 * an.tokens
        self._k = 0.0
        f = self._tp("head_in", 0, rank) + self._fwd(h["head"])
        f += self._coll("allreduce", rank, "tp", ce) + self._fwd(h["xent"])
        f += self._coll("allreduce", rank, "tp", 2 * ce) + self._fwd(h["loss"])
        kf, self._k = self._k, 0.0
        b = self._bwd(h["loss"]) + self._bwd(h["xent"]) + self._column_bwd(h["head"], "head_in", rank)
        return HeadCost(forward=f, backward=b, saved_bytes=h["head"].saved, forward_collectives=kf,
                        backward_collectives=self._k)

    # --- parameter units -----------------------------------------------------------------------
    def units(self, r: int, chunk: Optional[int] = None) -> list[int]:
        """Parameter units of pipeline rank r (or of one of its chunks): -1 embedding, L the head; a
        stage may hold no layer. MTP depths are left out: the bounds stay below the simulation."""
        units = []
        for c in range(self.vpp) if chunk is None else (chunk,):
            vs = self.stage[r][c]
            if vs == 0:
                units.append(-1)
            units.extend(self.rp.stage_layers[vs])
            if vs == self.V - 1:
                units.append(self.L)
        return units

    def unit_params(self, unit: int, dense_only: bool = False) -> float:
        """Parameters of one unit (all, or the dense ones: those ZeRO shards over its axis)."""
        if unit == -1:
            return self.an.embed_params()
        if unit == self.L:
            return self.an.head_params()
        counts = self.an.layer_param_counts(unit)
        return counts[0] if dense_only else sum(counts)

    def unit_costs(self, r: int, chunk: int, zshard: int,
                   zero3: Optional[Zero3Flavour] = None) -> tuple[list[UnitCost], list[UnitCost]]:
        """Forward and backward of each unit of one chunk, in the order the lowering runs them, with
        the parameter all-gathers and gradient reduce-scatters over the ZeRO group (ZeRO-3 over dp, or
        over dp_shard groups of size `zshard` when > 0), in the calls the flavour `zero3` issues (the
        lowering's: `Zero3Flavour.gather_calls`, `reduce_calls`)."""
        zero3 = zero3 or zero3_flavour(DEFAULT_ZERO3_FLAVOUR)
        p, an = self.p, self.an
        rank = self.comm.rank_of_stage[r]
        dt, gdt = self.dt, self.gdt
        vs = self.stage[r][chunk]
        layers = self.rp.stage_layers[vs]
        n = len(layers)
        n_rc = self.n_recomputed(n)
        fwd, bwd = [], []
        for u in self.units(r, chunk):
            tensors = unit_tensors(self.rp, u, self.unit_params(u, True))
            g = sum(self.comm.coll("allgather", rank, "zero", e * dt, p.ep, zshard or None, p.etp)
                    for e in zero3.gather_calls(tensors))
            rs = sum(self.comm.coll("reducescatter", rank, "zero", e * gdt, p.ep, zshard or None, p.etp)
                     for e in zero3.reduce_calls(tensors))
            if u == -1:
                fc = self._tp("embed_out", 0, rank)
                fwd.append(UnitCost(0.0, self._fwd(an.embed), fc, g, 0.0))
                bo = self._tp("embed_out", 1, rank)  # before the embedding's backward
                bwd.append(UnitCost(bo, self._bwd(an.embed), 0.0, g, rs))
            elif u == self.L:
                head = self._head(rank)
                fo = self._tp("head_in", 0, rank)
                bc = self._closing(an.head["head"], "head_in", rank)
                fwd.append(UnitCost(fo, head.forward - fo, 0.0, g, 0.0))
                bwd.append(UnitCost(0.0, head.backward - bc, bc, g, rs))
            else:
                pos = layers.index(u)
                rc = pos < n_rc
                c = self._layer(u, rc, rank)
                fo, fc = self._tp("attn_in", 0, rank), c.forward_closing
                fwd.append(UnitCost(fo, c.forward - fo - fc, fc, g, 0.0))
                bo = self._tp("attn_in", 0, rank) if (rc and p.recompute == "full") else self._tp("mlp_out", 1, rank)
                bc = c.backward_closing
                bwd.append(UnitCost(bo, c.backward - bo - bc, bc, g, rs))
        bwd.reverse()
        return fwd, bwd
