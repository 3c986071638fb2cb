"""Lowering: (model, cluster, plan) -> Program, the per-rank instruction lists both interpreters run.

`lower()` walks each rank's pipeline schedule (simexec.program.schedules) and, for every action, emits the
layer's sub-blocks with the communication each plan dimension adds, in this order of concerns:

1. pipeline: recv the input of a virtual stage, send its output (activations fwd, gradients bwd);
2. tensor/sequence parallel: Megatron's f/g collectives at sub-block boundaries (`tp_overlap`: a
   column-parallel block's weight gradients after its input gradients' collective, under it);
3. context parallel: K/V all-gather around attention, their gradients reduce-scattered back;
4. expert parallel: all-to-all dispatch and combine around the experts;
5. recompute: forward blocks re-run before their backward (selective: attention core; full: layer);
6. ZeRO-3: per-unit parameter all-gathers (two in flight) and gradient reduce-scatters;
7. data parallel: gradient buckets during the last backward (every backward for ZeRO-2), or
   after it (`grad_overlap=0`), HSDP replicate all-reduce, tied-embedding all-reduce, the loss
   scale's unscaling and the clipping's norm (each a pass over the gradients and a world
   all-reduce of one value), optimizer step (with its fp32 main-gradient copy, `master_grads`),
   parameter all-gather, host offload copies.
Memory markers (alloc/free) track model states, activations and gathered buffers.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

from simexec.program.blocks import Anatomy, Block
from simexec.specs.plan import ResolvedPlan
from simexec.program.groups import rank_groups
from simexec.program.instructions import Instr, Program
from simexec.program.adam import ADAM_FLOPS_PER_PARAM
from simexec.program.dispatch_key import dispatch_key
from simexec.program.schedules import Action, dualpipe_pairs, exchange_groups, pipeline_order

# Megatron's f/g conjugates: (forward op, backward op) without and with sequence parallelism.
_TP_OPS = {
    "attn_in": (("", "allreduce"), ("allgather", "reducescatter")),
    "attn_out": (("allreduce", ""), ("reducescatter", "allgather")),
    "mlp_in": (("", "allreduce"), ("allgather", "reducescatter")),
    "mlp_out": (("allreduce", ""), ("reducescatter", "allgather")),
    "embed_out": (("allreduce", ""), ("reducescatter", "allgather")),
    "head_in": (("", "allreduce"), ("allgather", "reducescatter")),
}
STEP_FLAG_BYTES = 4.0  # the all-reduces before the step: one fp32 overflow flag, or sum of squares
ADAM_BYTES_PER_PARAM = 28.0  # read fp32 master, m, v, bf16 grad; write them back and the bf16 weight


def adam_bytes_per_param(rp: ResolvedPlan) -> float:
    """Memory traffic of the optimizer step per parameter: Adam reads 2 more bytes of a 4-byte
    gradient; the fp32 main-gradient copy (`master_grads`) reads 2 and writes 4 first."""
    extra = rp.grad_bytes - 2.0
    if rp.master_grad_bytes:
        extra += 2.0 + 2.0 * rp.master_grad_bytes
    return ADAM_BYTES_PER_PARAM + extra


def _copy_block(nbytes: float) -> Block:
    """A device copy of `nbytes` of gradients, in the backward: read once, written once."""
    return Block("elementwise", 0.0, 2.0 * nbytes, 0.0, bwd=2.0 * nbytes)


def representatives(rp: ResolvedPlan) -> dict[int, tuple[int, ...]]:
    """One rank per pipeline stage (tp = cp = dp = 0) stands for all ranks of that stage."""
    mesh = rp.mesh
    out: dict[int, list[int]] = {}
    for r in range(rp.world):
        c = mesh.coords(r)
        out.setdefault(mesh.rank(pp=c["pp"]), []).append(r)
    return {k: tuple(v) for k, v in out.items()}


def windowed_layers(rp: ResolvedPlan) -> list[int]:
    """The layers whose attention has a sliding window shorter than the sequence (the executor masks
    their band, which changes the operators its CPU ranks dispatch)."""
    m = rp.model
    return [l for l in range(m.layers) if m.attention_window(l, rp.seq_len) is not None]


def lower(rp: ResolvedPlan, symmetric: bool = True) -> Program:
    """Per-rank programs; in symmetric mode only one representative rank per pipeline stage."""
    anatomy = Anatomy(rp)
    order = pipeline_order(rp.plan.schedule_name, rp.plan.pp, rp.micro_batches, rp.plan.vpp)
    if symmetric:
        reps = representatives(rp)
    else:
        reps = {r: (r,) for r in range(rp.world)}
    ranks = {r: _RankLowering(rp, anatomy, r, order[rp.mesh.coords(r)["pp"]]).build() for r in sorted(reps)}
    meta = {
        "model": rp.model.name, "cluster": rp.cluster.name, "plan": rp.plan.to_string(),
        "seq_len": rp.seq_len, "world": rp.world, "micro_batches": rp.micro_batches,
        "symmetric": symmetric, "dispatch": dispatch_key(rp.model),
    }
    windowed = windowed_layers(rp)
    if windowed:
        meta["windowed_layers"] = windowed
    return Program(meta=meta, ranks=ranks, represents=reps, resolved=rp)


def _segments(instrs: list[Instr]) -> list[list[Instr]]:
    """A pass cut before each compute instruction (and the workspace allocated for it): each piece
    is one compute and what follows it up to the next (its frees, the collectives and sends it
    issues); what comes before the first compute leads the first piece."""
    pieces: list[list[Instr]] = [[]]
    for k, ins in enumerate(instrs):
        starts = ins.kind == "compute" or (
            ins.kind == "memory" and ins.op == "alloc" and k + 1 < len(instrs)
            and instrs[k + 1].kind == "compute" and ins.name == f"mem.alloc.{instrs[k + 1].name}")
        if starts and any(i.kind == "compute" for i in pieces[-1]):
            pieces.append([])
        pieces[-1].append(ins)
    return [p for p in pieces if p]


def _interleave(a: list[list[Instr]], b: list[list[Instr]]) -> list[Instr]:
    """The pieces of two passes merged: a pass goes on until its next compute would wait for a
    collective it issued in the piece just placed, with nothing to run under it; the other pass's
    next piece runs there instead (DualPipe's pairing of one pass's compute with the other's
    communication)."""
    passes, at = (a, b), [0, 0]
    fresh: list[set[str]] = [set(), set()]  # collectives a pass issued with nothing placed after them yet
    out: list[Instr] = []
    cur = 0
    while at[0] < len(a) or at[1] < len(b):
        other = 1 - cur
        if at[cur] == len(passes[cur]):
            cur = other
            continue
        piece = passes[cur][at[cur]]
        waits = next((set(i.deps) for i in piece if i.kind == "compute"), set())
        if waits & fresh[cur] and at[other] < len(passes[other]):
            cur = other  # whose piece, placed next, covers those collectives
            continue
        out.extend(piece)
        at[cur] += 1
        fresh[other].clear()
        fresh[cur] = {i.name for i in piece if i.kind in ("collective", "recv")}
    return out


class _RankLowering:
    """Builds one rank's instruction list."""

    def __init__(self, rp: ResolvedPlan, an: Anatomy, rank: int, actions: list[Action]):
        self.rp, self.an, self.rank, self.actions = rp, an, rank, actions
        p, mesh = rp.plan, rp.mesh
        self.p = p
        self.coords = mesh.coords(rank)
        self.pp_rank = self.coords["pp"]
        self.m = rp.micro_batches
        self.L = rp.model.layers
        self.out: list[Instr] = []
        self.wait: list[str] = []  # collectives the next compute instruction must wait on
        self.received: set[Action] = set()  # actions whose input recv is already issued
        self.sends_to_wait: list[str] = []  # p2p_overlap=0: this group's sends, waited before the next
        self._z2_seen = 0  # ZeRO-2: grad_colls already waited at the end of a micro-batch's backward
        self.grad_dt = rp.grad_bytes
        g = self.groups = rank_groups(rp, rank)
        self.g_tp, self.g_cp, self.g_dp, self.g_ep, self.g_edp = g.tp, g.cp, g.dp, g.ep, g.edp
        self.zero_axis, self.g_zero, self.g_rep, self.g_embed = g.zero_axis, g.zero, g.rep, g.embed
        head = rp.head_pp_rank
        # tied embeddings over a pipeline: the two stages' gradients summed (`bwd.tied`) after the
        # data-parallel all-reduce (Megatron-LM), or under ZeRO-1 before the reduce-scatter, which
        # shards each stage's copy in its own layout (DeepSpeed's pipeline engine: ReduceTiedGrads,
        # then ReduceGrads); `tied_unit` is the unit that holds this stage's copy
        self.tied_unit: Optional[int] = None
        if rp.tied_copy and self.pp_rank in (0, head):
            self.tied_unit = -1 if self.pp_rank == 0 else self.L
        self.tied_first = self.tied_unit is not None and p.zero == 1
        self.tied: Optional[str] = None  # the emitted `bwd.tied` ("" where its group is one rank)
        # gradient buckets: pools keyed by axis, each a list of (unit, bytes)
        self.bucket_bytes = p.bucket_mb * 1e6
        self.pools: dict[str, list[tuple[int, float]]] = {}
        self._z2_alloc: dict[str, Instr] = {}  # ZeRO-2: the open bucket buffer's allocation, per axis
        self.pool_after: dict[str, str] = {}
        self.buckets: list[tuple[str, str, tuple[int, ...], float]] = []  # (name, axis, units, bytes)
        self.sealed: list[tuple[str, list[tuple[int, float]]]] = []  # grad_overlap=0: full buckets, not yet reduced
        self.z3_pending: list[tuple[int, int, int, str]] = []  # grad_overlap=0: ZeRO-3 units (unit, mb, chunk, suffix) to reduce
        self.grad_colls: list[str] = []
        self.gathers: dict[tuple, list[str]] = {}
        # yafsdp: the reduce-scatter still reading each (class, parity) gradient buffer
        self.z3_busy: dict[tuple[str, int], str] = {}
        self.z3_shards: set[int] = set()  # lazy_grad_shards: units whose gradient shard exists this step
        self.lazy_shards = 0.0  # ... and their bytes once all exist (freed after the optimizer step)
        # zero-bubble schedules: a unit's activations live until its weight-gradient pass, which frees
        # them (the frees its input-gradient pass would have made, held per (unit, micro-batch))
        self.split = p.pipeline_schedule.splits_backward
        # tp_overlap: a column-parallel block's weight-gradient pass, held until the tp collective of its
        # input gradients is issued (`column_backward`, `tp`): (its `compute` arguments, what to free after it)
        self.pending_w: Optional[tuple] = None
        self.defer_to: Optional[tuple[int, int]] = None
        self.deferred: dict[tuple[int, int], list[Instr]] = {}

    # --- emit ----------------------------------------------------------------------------------------
    def _emit(self, ins: Instr, at: Optional[int] = None) -> str:
        """Append `ins` to the program, or insert it at index `at`."""
        if at is None:
            self.out.append(ins)
        else:
            self.out.insert(at, ins)
        return ins.name

    def compute(self, phase: str, block: str, layer: int, mb: int, chunk: int, b: Block, suffix: str = "",
                input_only: bool = False) -> str:
        """A compute instruction; a backward one holds its block's gradient buffers (`bwd_workspace`:
        incoming, input and intermediate gradients) while it runs. Under a zero-bubble schedule the
        backward (`bwd`) computes the input gradients and leaves the output gradients the weight
        gradients need (`grad_out`) to the weight-gradient pass (`wgrad`), which frees them; so does a
        backward with `input_only` (tp_overlap's column-parallel blocks)."""
        name = f"{phase}.{block}.L{layer}.m{mb}{suffix}"
        assert self.pending_w is None or phase == "wgrad", f"{name} before the pending weight pass {self.pending_w[0][:3]}"
        deps, self.wait = tuple(dict.fromkeys(self.wait)), []
        if phase == "wgrad":
            flops, nbytes, ws = b.wgrad_flops, b.wgrad_bytes, b.wgrad_tmp
        elif phase == "bwd" and (self.split or input_only):
            flops, nbytes, ws = b.bwd_flops - b.wgrad_flops, b.bwd_bytes - b.wgrad_bytes, b.bwd_workspace - b.wgrad_tmp
        elif phase == "bwd":
            flops, nbytes, ws = b.bwd_flops, b.bwd_bytes, b.bwd_workspace
        else:
            flops, nbytes, ws = b.flops, b.bytes, 0.0
        self.memory("alloc", "activations", ws, name, deps=deps)
        out = self._emit(Instr(
            self.rank, name, "compute", "compute", b.op, phase=phase, block=block, layer=layer, mb=mb,
            chunk=chunk, flops=flops, bytes=nbytes, deps=deps,
        ))
        self.memory("free", "activations", ws, name, deps=(name,), defer=False)
        if phase == "wgrad" or (phase == "bwd" and (self.split or input_only)):
            self.memory("alloc" if phase == "bwd" else "free", "activations", b.grad_out,
                        f"grad_out.{block}.L{layer}.m{mb}{suffix}", deps=(name,), defer=False)
        return out

    def coll(self, name: str, verb: str, axis: str, group: tuple[int, ...], nbytes: float, deps=(), *,
             phase: str = "", block: str = "", layer: int = -1, mb: int = -1, chunk: int = 0,
             items: tuple[int, ...] = (), wait: bool = True) -> Optional[str]:
        """A collective on `comm.<axis>`; skipped for groups of one. `wait`: next compute waits on it."""
        if len(group) <= 1 or nbytes <= 0:
            return None
        ins = Instr(self.rank, name, "collective", f"comm.{axis}", f"{verb}@{axis}", phase=phase, block=block,
                    layer=layer, mb=mb, chunk=chunk, bytes=float(nbytes), deps=tuple(d for d in deps if d),
                    axis=axis, group=group, items=items)
        self._emit(ins)
        if wait:
            self.wait.append(name)
        return name

    def memory(self, op: str, category: str, nbytes: float, tag: str, stream: str = "compute",
               deps: tuple[str, ...] = (), defer: bool = True, at: Optional[int] = None) -> Optional[Instr]:
        """An alloc or free of `nbytes` (none for 0); `at`: where in the program, if not at its end."""
        if nbytes <= 0:
            return None
        ins = Instr(self.rank, f"mem.{op}.{tag}", "memory", stream, op, bytes=float(nbytes), category=category, deps=deps)
        if defer and self.defer_to is not None and op == "free" and category == "activations":
            self.deferred.setdefault(self.defer_to, []).append(ins)
        else:
            self._emit(ins, at)
        return ins

    def last_compute(self) -> Optional[str]:
        for ins in reversed(self.out):
            if ins.kind == "compute":
                return ins.name
        return None

    def tp(self, block: str, phase: str, layer: int, mb: int, chunk: int, nbytes: float) -> None:
        """One of Megatron's f/g collectives (or nothing where that side is the identity)."""
        fwd_op, bwd_op = _TP_OPS[block][1 if self.p.sp else 0]
        verb = bwd_op if phase == "bwd" else fwd_op
        under, self.pending_w = self.pending_w, None
        name = None
        if verb:
            name = self.coll(f"{phase}.{block}.L{layer}.m{mb}", verb, "tp", self.g_tp, nbytes, (self.last_compute(),),
                             phase=phase, block=block, layer=layer, mb=mb, chunk=chunk, wait=under is None)
        if under is not None:  # tp_overlap: the weight-gradient pass runs while the collective is in flight
            args, after = under
            self.compute("wgrad", *args)
            after()
            if name:
                self.wait.append(name)

    def column_backward(self, block: str, layer: int, mb: int, chunk: int, b: Block, again: Optional[str],
                        after: Callable[[], None], wait: bool = True, release: bool = True) -> None:
        """The backward of a column-parallel block whose input gradient the next tp collective sums,
        then `after` (the frees of what the block saved). Under tp_overlap the input gradients alone:
        the weight gradients wait for that collective to be issued (`tp`), as Megatron-LM's
        LinearWithGradAccumulationAndAsyncCommunication issues its all-reduce or reduce-scatter before
        the weight-gradient GEMM, and what that GEMM reads is freed after it."""
        if not (self.p.tp_overlap and b.wgrad_flops):
            self.compute_regathered(block, layer, mb, chunk, b, again, wait, release)
            after()
            return
        self.compute_regathered(block, layer, mb, chunk, b, again, wait, release=False, input_only=True)

        def weights_done() -> None:
            if again and release:
                self.memory("free", "activations", self.an.full_hidden_bytes, again, deps=(self.last_compute(),))
            after()

        self.pending_w = ((block, layer, mb, chunk, b), weights_done)

    # --- the program ---------------------------------------------------------------------------------
    def build(self) -> list[Instr]:
        self.setup()
        # DualPipe's pairs, by position in `self.actions` (dualpipev needs p2p_overlap=1: one action
        # per group, so a group's index is its action's)
        pairs = dualpipe_pairs(self.p.pp, self.pp_rank, self.m) if self.p.dualpipe_overlap else frozenset()
        groups, i = self.comm_groups(), 0
        while i < len(groups):
            if i in pairs:  # a forward, then the other chunk's whole backward (B, W), overlapped
                self.overlapped(self.actions[i], self.actions[i + 1:i + 3])
                i += 3
                continue
            group = groups[i]
            i += 1
            if not self.p.p2p_overlap:
                # Megatron-LM's blocking exchange between groups: it posts the group's receives with
                # the previous group's sends and waits for all of them before the group computes
                self.wait.extend(self.sends_to_wait)
                self.sends_to_wait = []
                for act in group:
                    self.receive_input(act)
            for act in group:
                self.action(act)
        self.finish()
        return self.out

    def action(self, act: Action) -> None:
        if act.kind == "F":
            self.forward(act)
        elif act.kind == "B":
            self.backward(act)
        else:
            self.weight_pass(act)

    def overlapped(self, fwd: Action, bwd: list[Action]) -> None:
        """DualPipe's overlapped pair: the forward and the backward lowered apart (neither waits on
        the other's collectives), then merged kernel by kernel, each compute instruction followed by
        what it issues, so that while one pass's collectives are in flight the other computes."""
        out, self.out = self.out, []  # the waits pending before the pair go to the forward's first compute
        self.action(fwd)
        f_out, f_wait = self.out, self.wait
        self.out, self.wait = [], []
        for act in bwd:
            self.action(act)
        b_out, b_wait = self.out, self.wait
        out.extend(_interleave(_segments(f_out), _segments(b_out)))
        self.out, self.wait = out, f_wait + b_wait

    def comm_groups(self) -> list[list[Action]]:
        """The actions between two blocking pipeline exchanges (`simexec.program.schedules.exchange_groups`);
        one each where sends do not block (they are lowered alike)."""
        if self.p.pp == 1 or self.p.p2p_overlap:
            return [[a] for a in self.actions]
        p = self.p
        return exchange_groups(self.actions, p.schedule_name, p.pp, self.pp_rank, self.m, p.vpp)

    def receive_input(self, act: Action) -> None:
        """The recv (and gather) of an action's input, once: a stage's activations, or the gradient
        of its output."""
        if act in self.received:
            return
        self.received.add(act)
        vs = self.stage(act.chunk)
        if act.kind == "F" and vs > 0 and not self.holds(vs - 1):
            self.recv("act", vs - 1, act.mb)
        elif act.kind == "B" and vs < self.rp.virtual_stages - 1 and not self.holds(vs + 1):
            self.recv("grad", vs + 1, act.mb)

    def stage(self, chunk: int) -> int:
        """The virtual stage of one of this rank's chunks."""
        return self.rp.stage(self.pp_rank, chunk)

    def holds(self, vs: int) -> bool:
        """Whether this rank holds virtual stage vs: a V-shaped schedule's turn from the first chunk to
        the second stays on the last rank, with no message."""
        return self.rp.place(vs)[0] == self.pp_rank

    def units(self, chunk: int) -> list[int]:
        """Parameter units of a virtual stage in forward order: -1 embedding, layers, L the head."""
        vs = self.stage(chunk)
        units = list(self.rp.stage_layers[vs])
        if vs == 0:
            units.insert(0, -1)
        if vs == self.rp.virtual_stages - 1:
            units.append(self.L)
        return units

    def unit_params(self, unit: int) -> tuple[float, float]:
        if unit == -1:
            return self.an.embed_params(), 0.0
        if unit == self.L:
            return self.an.head_params(), 0.0
        return self.an.layer_param_counts(unit)

    def setup(self) -> None:
        states = self.rp.model_state_bytes(self.pp_rank)
        if self.p.lazy_grad_shards and self._zero3():  # made by their first reduce-scatter instead
            self.lazy_shards = sum(self.z3_bytes(u, self.grad_dt, shard=True) for c in range(self.p.vpp)
                                   for u in self.units(c))
            states["grads"] = max(0.0, states["grads"] - self.lazy_shards)
        for cat in ("params", "grads", "optimizer"):
            self.memory("alloc", cat, states[cat], f"{cat}.static")
        self.memory("alloc", "workspace", self.rp.cluster.costs.workspace_bytes, "workspace")
        zero3 = self.p.zero3
        if zero3 is not None and zero3.preallocated_buffers and self.zero_size > 1:
            biggest = max(sum(self.unit_params(u)) for c in range(self.p.vpp) for u in self.units(c))
            self.memory("alloc", "buffers", 2 * biggest * self.rp.dtype_bytes, f"{zero3.name}.params")
            self.memory("alloc", "buffers", 2 * biggest * self.grad_dt, f"{zero3.name}.grads")

    @property
    def zero_size(self) -> int:
        return len(self.g_zero)

    def z3_bytes(self, unit: int, dt: float, shard: bool = False) -> float:
        """A ZeRO-3 unit at `dt` bytes per element, as its gathers and reduce-scatters hold it: whole
        (`shard`: this rank's share), dense and expert; a class whose group is one rank stays out."""
        dense, expert = self.unit_params(unit)
        zs, edp = self.zero_size, len(self.g_edp)
        return dt * (dense * (zs > 1) / (zs if shard else 1) + expert * (edp > 1) / (edp if shard else 1))

    def is_recompute_layer(self, layer: int, chunk: int) -> bool:
        if self.p.recompute == "none":
            return False
        pos = self.rp.stage_layers[self.stage(chunk)].index(layer)
        return self.p.recompute_layers is None or pos < self.p.recompute_layers

    # --- forward -------------------------------------------------------------------------------------
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
            elif unit == self.L:
                self.head_forward(mb, c)
            else:
                full = self.is_recompute_layer(unit, c) and self.p.recompute == "full"
                self.layer_forward(unit, mb, c, "fwd")
                saved = self.an.hidden_bytes if full else sum(b.saved for b in self.an.layer(unit).values())
                self.memory("alloc", "activations", saved, f"act.L{unit}.m{mb}")
            self.release_gather(unit, "fwd", mb)
            self.prefetch_next(units, j, "fwd", mb, c)
        if vs < self.rp.virtual_stages - 1 and not self.holds(vs + 1):
            self.send("act", vs, mb, self.an.hidden_bytes)

    def layer_forward(self, l: int, mb: int, c: int, phase: str) -> None:
        an, blocks = self.an, self.an.layer(l)
        if self.p.sp:
            self.compute(phase, "norm1", l, mb, c, blocks["norm1"])
        self.tp("attn_in", phase, l, mb, c, an.full_hidden_bytes)
        self.compute(phase, "qkv", l, mb, c, blocks["qkv"])
        if self.p.cp > 1 and self.p.cp_impl == "ring":
            self.ring_attention(phase, l, mb, c, blocks["attn"])
        elif self.p.cp > 1 and self.p.cp_impl == "a2a":
            self.heads_exchange("heads_in", phase, l, mb, c)
            self.compute(phase, "attn", l, mb, c, blocks["attn"])
            self.heads_exchange("heads_out", phase, l, mb, c)
        else:
            if self.p.cp > 1:
                self.coll(f"{phase}.kv.L{l}.m{mb}", "allgather", "cp", self.g_cp, an.kv_bytes,
                          (self.last_compute(),), phase=phase, block="kv", layer=l, mb=mb, chunk=c)
            self.compute(phase, "attn", l, mb, c, blocks["attn"])
        self.compute(phase, "proj", l, mb, c, blocks["proj"])
        self.tp("attn_out", phase, l, mb, c, an.full_hidden_bytes)
        if self.p.sp:
            self.compute(phase, "norm2", l, mb, c, blocks["norm2"])
        self.tp("mlp_in", phase, l, mb, c, an.full_hidden_bytes)
        if "fc1" in blocks:
            self.compute(phase, "fc1", l, mb, c, blocks["fc1"])
            self.compute(phase, "fc2", l, mb, c, blocks["fc2"])
        else:
            self.compute(phase, "router", l, mb, c, blocks["router"])
            self.a2a("dispatch", phase, l, mb, c)
            self.compute(phase, "experts", l, mb, c, blocks["experts"])
            self.a2a("combine", phase, l, mb, c)
            self.compute(phase, "moe_out", l, mb, c, blocks["moe_out"])
        self.tp("mlp_out", phase, l, mb, c, an.full_hidden_bytes)

    def ring_attention(self, phase: str, l: int, mb: int, c: int, attn: Block) -> None:
        """Ring attention over the cp group: K/V chunks hop to the next rank while each rank attends
        to the chunk it holds (forward: cp-1 hops). Backward: K/V travel with their partial
        gradients (cp-1 hops), and a last hop brings each dK/dV home."""
        cp, me = self.p.cp, self.coords["cp"]
        chunk = self.an.kv_bytes / cp
        part = Block(attn.op, attn.flops / cp, attn.bytes / cp, 0.0)
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
                self._emit(Instr(self.rank, name, "send", "p2p.send", "send", phase=phase, block="kv", layer=l,
                                 mb=mb, chunk=c, bytes=nbytes, deps=(dep,), peer=nxt))
                if not bwd:
                    self.compute(phase, "attn", l, mb, c, part, suffix=f".r{i}")
                rname = f"{phase}.kv.L{l}.m{mb}.o{(me - 1 - i) % cp}.h{i}"
                self._emit(Instr(self.rank, rname, "recv", "p2p.recv", "recv", phase=phase, block="kv", layer=l,
                                 mb=mb, chunk=c, bytes=nbytes, peer=prv))
                self.wait.append(rname)
            else:
                self.compute(phase, "attn", l, mb, c, part, suffix=f".r{i}")

    def heads_exchange(self, block: str, phase: str, l: int, mb: int, c: int) -> None:
        """cp_impl=a2a (DeepSpeed-Ulysses): `heads_in` turns this rank's q, k and v from its share of
        the sequence for all its heads into the whole sequence for a cp-th of them, `heads_out` turns
        the attention's output back; the backward runs each the other way."""
        nbytes = self.an.heads_exchange_bytes[0 if block == "heads_in" else 1]
        self.coll(f"{phase}.{block}.L{l}.m{mb}", "alltoall", "cp", self.g_cp, nbytes, (self.last_compute(),),
                  phase=phase, block=block, layer=l, mb=mb, chunk=c)

    def a2a(self, block: str, phase: str, l: int, mb: int, c: int) -> None:
        self.coll(f"{phase}.{block}.L{l}.m{mb}", "alltoall", "ep", self.g_ep, self.an.dispatch_bytes,
                  (self.last_compute(),), phase=phase, block=block, layer=l, mb=mb, chunk=c)

    def head_forward(self, mb: int, c: int) -> None:
        an, L = self.an, self.L
        head = an.head
        if self.p.sp:
            self.compute("fwd", "norm", L, mb, c, head["norm"])
        self.tp("head_in", "fwd", L, mb, c, an.full_hidden_bytes)
        self.compute("fwd", "head", L, mb, c, head["head"])
        ce_bytes = 4.0 * an.tokens
        self.coll(f"fwd.ce_max.L{L}.m{mb}", "allreduce", "tp", self.g_tp, ce_bytes, (self.last_compute(),),
                  phase="fwd", block="ce_max", layer=L, mb=mb, chunk=c)
        self.compute("fwd", "xent", L, mb, c, head["xent"])
        self.coll(f"fwd.ce_sum.L{L}.m{mb}", "allreduce", "tp", self.g_tp, 2 * ce_bytes, (self.last_compute(),),
                  phase="fwd", block="ce_sum", layer=L, mb=mb, chunk=c)
        self.compute("fwd", "loss", L, mb, c, head["loss"])
        released = an.logits_released
        self.memory("alloc", "activations", head["head"].saved - released, f"act.L{L}.m{mb}")
        self.memory("alloc", "activations", released, f"act.logits.L{L}.m{mb}")
        if self.p.sp:
            self.memory("alloc", "activations", head["norm"].saved, f"act.norm.L{L}.m{mb}")

    # --- backward ------------------------------------------------------------------------------------
    def backward(self, act: Action) -> None:
        c, mb = act.chunk, act.mb
        vs = self.stage(c)
        self.receive_input(act)
        units = list(reversed(self.units(c)))
        self.prefetch(units, "bwd", mb, c)
        for j, unit in enumerate(units):
            self.wait_gather(unit, "bwd", mb)
            if self.split:
                self.defer_to = (unit, mb)
            if unit == self.L:
                head = self.an.head
                again = self.regather("head", unit, mb, c)
                self.compute("bwd", "loss", unit, mb, c, head["loss"])
                self.compute("bwd", "xent", unit, mb, c, head["xent"])
                released = self.an.logits_released
                self.column_backward("head", unit, mb, c, head["head"], again, lambda: self.memory(
                    "free", "activations", head["head"].saved - released, f"act.L{unit}.m{mb}"))
                self.memory("free", "activations", released, f"act.logits.L{unit}.m{mb}", defer=False)
                self.tp("head_in", "bwd", unit, mb, c, self.an.full_hidden_bytes)
                if self.p.sp:
                    self.compute("bwd", "norm", unit, mb, c, head["norm"])
                    self.memory("free", "activations", head["norm"].saved, f"act.norm.L{unit}.m{mb}")
                    self.norm_grads(unit, mb, c, self.rp.model.final_norm_params())
            elif unit == -1:
                self.tp("embed_out", "bwd", -1, mb, c, self.an.full_hidden_bytes)
                if not self.split:  # its backward is all weight gradient
                    self.compute("bwd", "embed", -1, mb, c, self.an.embed)
            else:
                self.layer_backward(unit, mb, c)
            self.defer_to = None
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

    def reduce_micro_batch(self, mb: int) -> None:
        """After a micro-batch's weight gradients: the reductions the plan makes per micro-batch."""
        for unit, m, ch, suffix in self.z3_pending:  # grad_overlap=0: ZeRO-3 reduce-scatters after the backward
            self.z3_reduce(unit, m, ch, self.last_compute(), suffix)
        self.z3_pending = []
        if self.p.grad_overlap or self.p.zero == 2:
            self.flush_all(final=mb == self.m - 1, hold_tied=True)
        if self.p.zero == 2:
            # ZeRO-2 (DeepSpeed's stage 2 epilogue): a micro-batch's backward ends with its gradient
            # reductions complete, so its full gradients are gone before the next micro-batch computes
            # (the executor waits the same dependency)
            self.wait.extend(n for n in self.grad_colls[self._z2_seen:] if n)
            self._z2_seen = len(self.grad_colls)

    def weight_pass(self, act: Action) -> None:
        """A zero-bubble schedule's W: the weight gradients of a micro-batch's units, in the order of
        their backward, each unit then freeing its activations and reducing its gradients."""
        c, mb = act.chunk, act.mb
        for unit in reversed(self.units(c)):
            if unit == self.L:
                self.compute("wgrad", "head", unit, mb, c, self.an.head["head"])
            elif unit == -1:
                e = self.an.embed
                self.compute("wgrad", "embed", -1, mb, c,
                             replace(e, wgrad_bytes=e.bwd_bytes, wgrad_tmp=e.bwd_workspace))
            else:
                for name, b in reversed(self.an.layer(unit).items()):
                    if b.wgrad_flops:
                        self.compute("wgrad", name, unit, mb, c, b)
            self.tp_partial_grads(unit, mb, c)
            for ins in self.deferred.pop((unit, mb), []):
                self._emit(replace(ins, deps=(self.last_compute(),)))
            self.grads_ready(unit, mb, c)
        self.reduce_micro_batch(mb)

    def partial_params(self, unit: int) -> float:
        """Parameters of a unit that tp replicates but each rank computes a part of the gradient of
        (norms, a router, MLA's latent projections)."""
        m = self.rp.model
        if unit == self.L:
            return m.final_norm_params()
        params = 2 * m.pre_norm_params() + m.qk_norm_params() + m.latent_params()
        return params + (m.hidden * m.moe.experts if m.is_moe_layer(unit) else 0)

    def tp_partial_grads(self, unit: int, mb: int, c: int) -> None:
        """Under a zero-bubble schedule (and tp_overlap without sp), the partial gradients of a unit's
        tp-replicated parameters (`partial_params`) are made after the input-gradient collectives that
        would have carried them: one all-reduce sums them."""
        if unit == -1:
            return
        params = self.partial_params(unit)
        self.coll(f"wgrad.norm_grads.L{unit}.m{mb}", "allreduce", "tp", self.g_tp, params * self.grad_dt,
                  (self.last_compute(),), phase="wgrad", block="norm_grads", layer=unit, mb=mb, chunk=c, wait=False)

    def layer_backward(self, l: int, mb: int, c: int) -> None:
        an, blocks = self.an, self.an.layer(l)
        rc = self.is_recompute_layer(l, c)
        full = rc and self.p.recompute == "full"
        saved = sum(b.saved for b in blocks.values())
        if full:
            self.layer_forward(l, mb, c, "recompute")
            self.memory("alloc", "activations", saved - an.hidden_bytes, f"act.recompute.L{l}.m{mb}")
        self.tp("mlp_out", "bwd", l, mb, c, an.full_hidden_bytes)
        again = self.regather("mlp", l, mb, c)
        if "fc1" in blocks:
            self.compute("bwd", "fc2", l, mb, c, blocks["fc2"])
            self.release_saved(l, mb, "fc2", blocks["fc2"])
            self.column_backward("fc1", l, mb, c, blocks["fc1"], again,
                                 lambda: self.release_saved(l, mb, "fc1", blocks["fc1"]))
        else:
            # the shared experts' GEMMs read the gathered input too: the first block waits for it
            self.compute_regathered("moe_out", l, mb, c, blocks["moe_out"], again, release=False)
            self.release_saved(l, mb, "moe_out", blocks["moe_out"])
            self.a2a("combine", "bwd", l, mb, c)
            self.compute("bwd", "experts", l, mb, c, blocks["experts"])
            self.release_saved(l, mb, "experts", blocks["experts"])
            self.a2a("dispatch", "bwd", l, mb, c)
            self.column_backward("router", l, mb, c, blocks["router"], again,
                                 lambda: self.release_saved(l, mb, "router", blocks["router"]), wait=False)
        self.tp("mlp_in", "bwd", l, mb, c, an.full_hidden_bytes)
        if self.p.sp:
            self.compute("bwd", "norm2", l, mb, c, blocks["norm2"])
            self.release_saved(l, mb, "norm2", blocks["norm2"])
        self.tp("attn_out", "bwd", l, mb, c, an.full_hidden_bytes)
        again = self.regather("attn", l, mb, c)
        self.compute("bwd", "proj", l, mb, c, blocks["proj"])
        self.release_saved(l, mb, "proj", blocks["proj"])
        ring = self.p.cp > 1 and self.p.cp_impl == "ring"
        heads = self.p.cp > 1 and self.p.cp_impl == "a2a"
        if heads:
            self.heads_exchange("heads_out", "bwd", l, mb, c)
        if rc and self.p.recompute == "selective":
            if ring:
                self.ring_attention("recompute", l, mb, c, blocks["attn"])
            else:
                self.compute("recompute", "attn", l, mb, c, blocks["attn"])
        if ring:
            self.ring_attention("bwd", l, mb, c, blocks["attn"])
        else:
            self.compute("bwd", "attn", l, mb, c, blocks["attn"])
        self.release_saved(l, mb, "attn", blocks["attn"])
        if heads:
            self.heads_exchange("heads_in", "bwd", l, mb, c)
        elif self.p.cp > 1 and not ring:
            self.coll(f"bwd.kv.L{l}.m{mb}", "reducescatter", "cp", self.g_cp, an.kv_bytes, (self.last_compute(),),
                      phase="bwd", block="kv", layer=l, mb=mb, chunk=c)
        self.column_backward("qkv", l, mb, c, blocks["qkv"], again, lambda: self.release_saved(l, mb, "qkv", blocks["qkv"]))
        if self.split:
            # the input-gradient pass keeps the layer's graph for the weight pass: what only it read
            # goes at the layer's end, the rest with the weight pass
            early = an.freed_by_input_pass(l)
            kept = (an.hidden_bytes if full else blocks["norm1"].saved) if self.p.sp else 0.0
            self.memory("free", "activations", (an.hidden_bytes if full else saved - early) - kept, f"act.L{l}.m{mb}")
            if full:
                self.memory("free", "activations", saved - an.hidden_bytes - early, f"act.recompute.L{l}.m{mb}")
            self.memory("free", "activations", early, f"act.input_pass.L{l}.m{mb}", defer=False)
        # MLA's latent projections (replicated over tp) hold each tp rank's share of their gradient: it
        # rides the input gradient's all-reduce, or under sp the first norm's all-reduce (a reduce-scatter
        # would carry it in every slot)
        latent = self.rp.model.latent_params()
        self.tp("attn_in", "bwd", l, mb, c, an.full_hidden_bytes + (0 if self.p.sp or self.split or self.p.tp_overlap else latent * self.grad_dt))
        if self.p.sp:
            self.compute("bwd", "norm1", l, mb, c, blocks["norm1"])
            self.release_saved(l, mb, "norm1", blocks["norm1"])
            if self.split:
                self.memory("free", "activations", kept, f"act.input.L{l}.m{mb}")
            # under tp_overlap the weight passes before it made every partial gradient of the layer
            self.norm_grads(l, mb, c, self.partial_params(l) if self.p.tp_overlap else self.rp.model.pre_norm_params() + latent)

    # --- sequence parallelism ------------------------------------------------------------------------
    def regather(self, where: str, layer: int, mb: int, chunk: int) -> Optional[str]:
        """Under sp, the all-gather of a norm's output (saved as this rank's slice) that the
        column-parallel GEMM after it needs whole for its weight gradient (Megatron-LM's
        `LinearWithGradAccumulationAndAsyncCommunication`). Megatron issues it with the GEMM's backward
        and overlaps it with the input gradient; a block's backward here is one instruction, so it is
        issued as the sub-layer's backward starts, beside the blocks before the GEMM. Its buffer
        lives until the GEMM's backward ends."""
        if not self.p.sp:
            return None
        name = f"bwd.{where}_regather.L{layer}.m{mb}"
        got = self.coll(name, "allgather", "tp", self.g_tp, self.an.full_hidden_bytes, (self.last_compute(),),
                        phase="bwd", block=f"{where}_regather", layer=layer, mb=mb, chunk=chunk, wait=False)
        if got:
            self.memory("alloc", "activations", self.an.full_hidden_bytes, name, stream="comm.tp", deps=(name,))
        return got

    def release_saved(self, l: int, mb: int, name: str, b: Block) -> None:
        """After a block's backward autograd lets go of what the block saved (under full recompute, of
        its recomputed copy; the layer's input goes with the block that saved it). Not under a
        zero-bubble schedule, whose input-gradient pass keeps the graph (`layer_backward`)."""
        if not self.split:
            self.memory("free", "activations", b.saved, f"act.L{l}.m{mb}.{name}")

    def compute_regathered(self, block: str, layer: int, mb: int, chunk: int, b: Block, again: Optional[str],
                           wait: bool = True, release: bool = True, input_only: bool = False) -> None:
        """A backward block that reads a re-gathered input (`regather`): it waits for the gather,
        and the last reader frees its buffer."""
        if again and wait:
            self.wait.append(again)
        name = self.compute("bwd", block, layer, mb, chunk, b, input_only=input_only)
        if again and release:
            self.memory("free", "activations", self.an.full_hidden_bytes, again, deps=(name,))

    def norm_grads(self, unit: int, mb: int, chunk: int, params: float) -> None:
        """Under sp a norm's weight gradient is a sum over this rank's slice of the sequence: a
        unit's last norm (the one no later backward collective carries) has it summed over tp here,
        before the unit's gradients are reduced over dp. Megatron-LM all-reduces every
        sequence-parallel norm's gradient once after the backward; per micro-batch, these few bytes
        overlap the backward instead."""
        self.coll(f"bwd.norm_grads.L{unit}.m{mb}", "allreduce", "tp", self.g_tp, params * self.grad_dt,
                  (self.last_compute(),), phase="bwd", block="norm_grads", layer=unit, mb=mb, chunk=chunk,
                  wait=False)

    # --- pipeline ------------------------------------------------------------------------------------
    def _peer(self, vs: int) -> int:
        return self.rp.mesh.rank(**{**self.coords, "pp": self.rp.place(vs)[0]})

    def send(self, what: str, vs: int, mb: int, nbytes: float) -> None:
        """Send the output of virtual stage vs (activations forward, gradients backward): this rank's
        1/`pipeline_slices` of it."""
        dest = vs + 1 if what == "act" else vs - 1
        name = self._emit(Instr(self.rank, f"p2p.{what}.v{vs}.m{mb}", "send", "p2p.send", "send",
                                phase="fwd" if what == "act" else "bwd", block=what, mb=mb, chunk=self.rp.place(vs)[1],
                                bytes=nbytes / self.rp.pipeline_slices, deps=(self.last_compute(),),
                                peer=self._peer(dest)))
        if not self.p.p2p_overlap:  # a blocking send: the next group of actions waits for it
            self.sends_to_wait.append(name)

    def recv(self, what: str, src_vs: int, mb: int) -> None:
        """Receive the input of a virtual stage; sliced over tp, the pieces are then all-gathered
        over tp (`<recv>.gather`, block `act_gather` / `grad_gather`) before the stage computes."""
        name = f"p2p.{what}.v{src_vs}.m{mb}"
        dest = src_vs + 1 if what == "act" else src_vs - 1
        phase, chunk, slices = "fwd" if what == "act" else "bwd", self.rp.place(dest)[1], self.rp.pipeline_slices
        self._emit(Instr(self.rank, name, "recv", "p2p.recv", "recv", phase=phase, block=what, mb=mb, chunk=chunk,
                         bytes=self.an.hidden_bytes / slices, peer=self._peer(src_vs)))
        if slices > 1:
            self.coll(f"{name}.gather", "allgather", "tp", self.g_tp, self.an.hidden_bytes, (name,), phase=phase,
                      block=f"{what}_gather", mb=mb, chunk=chunk)
        else:
            self.wait.append(name)

    # --- ZeRO-3 parameter gathers --------------------------------------------------------------------
    def _zero3(self) -> bool:
        return self.p.zero == 3 and (self.zero_size > 1 or (self.rp.model.moe is not None and len(self.g_edp) > 1))

    def _tied_head(self, unit: int) -> bool:
        """ZeRO-3 with the head on the embedding's rank (no pipeline, or a V): a tied LM head reads the
        embedding's unit, so the head gathers it too, and reduce-scatters the head's share of its
        gradient after the head's backward."""
        return unit == self.L and self.rp.model.tied_embeddings and not self.rp.tied_copy and self._zero3()

    def gather(self, unit: int, phase: str, mb: int, c: int, deps: tuple) -> None:
        names = self._gather_unit(unit, f"{phase}.gather.L{unit}.m{mb}", phase, mb, c, deps)
        if self._tied_head(unit):
            names += self._gather_unit(-1, f"{phase}.gather.L{unit}.m{mb}.tied", phase, mb, c, deps)
        self.gathers[(unit, phase, mb)] = names

    def _gather_unit(self, unit: int, tag: str, phase: str, mb: int, c: int, deps: tuple) -> list[str]:
        dense, expert = self.unit_params(unit)
        dt = self.rp.dtype_bytes
        names = []
        if self.p.offload == "optimizer+params":
            # ZeRO-Infinity: the parameter shard lives in host memory and comes over PCIe first
            shard = (dense / self.zero_size + expert / max(1, len(self.g_edp))) * dt
            deps = (self._emit(Instr(self.rank, f"copy.{tag}", "copy", "copy.h2d", "h2d", phase=phase,
                                     block="params_h2d", layer=unit, mb=mb, chunk=c, bytes=shard,
                                     deps=tuple(d for d in deps if d), items=(unit,))),)
        if not self.p.zero3.preallocated_buffers:
            self.memory("alloc", "buffers", self.z3_bytes(unit, dt), tag, stream=f"comm.{self.zero_axis}", deps=deps)
        n = self.coll(tag, "allgather", self.zero_axis, self.g_zero, dense * dt, deps, phase=phase, block="gather",
                      layer=unit, mb=mb, chunk=c, items=(unit,), wait=False)
        names.append(n)
        n = self.coll(tag + ".experts", "allgather", "edp", self.g_edp, expert * dt, deps, phase=phase,
                      block="gather", layer=unit, mb=mb, chunk=c, items=(unit,), wait=False)
        names.append(n)
        if self.p.zero3.preallocated_buffers and phase == "bwd":
            # the backward accumulates into the parity's gradient buffer: its last reduce-scatter first
            names += [self.z3_busy.pop((cls, unit % 2), None) for cls in ("dense", "expert")]
        return [n for n in names if n]

    def prefetch(self, units: list[int], phase: str, mb: int, c: int) -> None:
        """Gather the first two units of a pass (two buffers in flight, as YaFSDP and FSDP's limit)."""
        if self._zero3():
            for u in units[:2]:
                self.gather(u, phase, mb, c, ())

    def prefetch_next(self, units: list[int], j: int, phase: str, mb: int, c: int) -> None:
        """Once unit j is done with its buffer, gather unit j+2 into it."""
        if self._zero3() and j + 2 < len(units):
            self.gather(units[j + 2], phase, mb, c, (self.last_compute(),))

    def wait_gather(self, unit: int, phase: str, mb: int) -> None:
        self.wait.extend(self.gathers.get((unit, phase, mb), ()))

    def release_gather(self, unit: int, phase: str, mb: int) -> None:
        if self._zero3() and not self.p.zero3.preallocated_buffers:
            tag = f"{phase}.gather.L{unit}.m{mb}"
            for u, t in [(unit, tag)] + ([(-1, tag + ".tied")] if self._tied_head(unit) else []):
                self.memory("free", "buffers", self.z3_bytes(u, self.rp.dtype_bytes), t)

    # --- gradients -----------------------------------------------------------------------------------
    def grads_ready(self, unit: int, mb: int, c: int) -> None:
        """Unit's gradients for micro-batch mb are complete: reduce them as the plan says."""
        dense, expert = self.unit_params(unit)
        last = mb == self.m - 1
        after = self.last_compute()
        gdt = self.grad_dt
        if self.p.zero == 3:
            if not self._zero3():
                return self.bucket_if(last, unit, dense, expert, after)
            for u, suffix in [(unit, "")] + ([(-1, ".tied")] if self._tied_head(unit) else []):
                if not self.p.zero3.preallocated_buffers:
                    self.memory("alloc", "buffers", self.z3_bytes(u, gdt), f"bwd.grads.L{u}.m{mb}{suffix}.unsharded",
                                deps=(after,))
                if self.p.grad_overlap:
                    self.z3_reduce(u, mb, c, after, suffix)
                else:
                    self.z3_pending.append((u, mb, c, suffix))
            return None
        return self.bucket_if(last or self.p.zero == 2, unit, dense, expert, after, final=last)

    def z3_reduce(self, unit: int, mb: int, c: int, after: str, suffix: str = "") -> None:
        """ZeRO-3: reduce-scatter the unit's gradients of micro-batch mb (and HSDP's replicate
        all-reduce after the last), then free its unsharded gradients. `suffix` ".tied": the tied
        head's share of the embedding's gradient, reduced before the embedding's own."""
        dense, expert = self.unit_params(unit)
        gdt = self.grad_dt
        tag = f"bwd.grads.L{unit}.m{mb}{suffix}"
        full, shard = self.z3_bytes(unit, gdt), self.z3_bytes(unit, gdt, shard=True)
        first = self.p.lazy_grad_shards and unit not in self.z3_shards
        if first:  # the first reduce-scatter's output becomes the unit's gradient shard
            self.z3_shards.add(unit)
            self.memory("alloc", "grads", shard, f"grads.shard.L{unit}", deps=(after,))
        else:  # a later one's output is summed into the shard once it lands
            self.memory("alloc", "grads", shard, f"{tag}.out", deps=(after,))
        a = self.coll(tag, "reducescatter", self.zero_axis, self.g_zero, dense * gdt, (after,), phase="bwd",
                      block="grads", layer=unit, mb=mb, chunk=c, items=(unit,), wait=False)
        b = self.coll(tag + ".experts", "reducescatter", "edp", self.g_edp, expert * gdt, (after,), phase="bwd",
                      block="grads", layer=unit, mb=mb, chunk=c, items=(unit,), wait=False)
        self.grad_colls += [n for n in (a, b) if n]
        for cls, n in (("dense", a), ("expert", b)):
            if n and self.p.zero3.preallocated_buffers:
                self.z3_busy[(cls, unit % 2)] = n
        landed = tuple(n for n in (a, b) if n)
        if not self.p.zero3.preallocated_buffers:
            self.memory("free", "buffers", full, f"{tag}.unsharded", stream=f"comm.{self.zero_axis}", deps=landed)
        if not first:
            self.memory("free", "grads", shard, f"{tag}.out", stream=f"comm.{self.zero_axis}", deps=landed)
        if mb == self.m - 1 and self.g_rep and a and not suffix:
            r = self.coll(f"bwd.grads_rep.L{unit}", "allreduce", "dp_replicate", self.g_rep,
                          dense * gdt / self.zero_size, (a,), phase="bwd", block="grads_rep", layer=unit,
                          items=(unit,), wait=False)
            self.grad_colls.append(r)

    def bucket_if(self, now: bool, unit: int, dense: float, expert: float, after: str, final: bool = True) -> None:
        """Add the unit's gradients to the open bucket of each axis; reduce a bucket once it is full."""
        if not now:
            return
        for axis, group, n in ((self.zero_axis, self.g_zero, dense), ("edp", self.g_edp, expert)):
            if len(group) <= 1 or n <= 0:
                continue
            pool = self.pools.setdefault(axis, [])
            if self.p.zero == 2:  # the bucket's buffer holds full gradients until it is reduce-scattered
                self._zero2_buffer(axis, pool, unit, n * self.grad_dt)
            pool.append((unit, n * self.grad_dt))
            self.pool_after[axis] = after
            if sum(b for _, b in pool) >= self.bucket_bytes:
                if self.p.grad_overlap and not self._waits_for_tied(axis, pool):
                    self.flush(axis, group, final)
                else:  # the bucket is full, but its reduction waits for the end of the backward
                    self.sealed.append((axis, pool))
                    self.pools[axis] = []

    def _zero2_buffer(self, axis: str, pool: list, unit: int, nbytes: float) -> None:
        """ZeRO-2's bucket buffer (DeepSpeed's reduce bucket): made with the bucket's first
        gradients, it takes every gradient of the bucket as it comes, so from then on it holds the
        bucket's whole size; one allocation that grows as units join the bucket. It is made as the
        unit's first weight gradient lands: after that backward instruction, before what it read
        (the head's saved activations and logits) is let go."""
        if not pool or axis not in self._z2_alloc:
            self._z2_alloc[axis] = self.memory("alloc", "grads", nbytes, f"grads.{axis}.L{unit}.b{len(self.buckets)}",
                                               at=self._first_weight_gradient(unit))
        else:
            self._z2_alloc[axis].bytes += nbytes

    def _first_weight_gradient(self, unit: int) -> int:
        """Where the unit's first weight gradient lands in the backward (or weight pass) just emitted:
        right after the instruction that makes it and the release of its workspace (the loss and the
        cross entropy make none); the end of the program where none is found."""
        at, mb = len(self.out), None
        for k in range(len(self.out) - 1, -1, -1):
            ins = self.out[k]
            if ins.kind != "compute":
                continue
            if ins.layer != unit or ins.phase not in ("bwd", "wgrad") or (mb is not None and ins.mb != mb):
                break
            mb = ins.mb
            if ins.block not in ("loss", "xent"):
                at = k + 1
                if at < len(self.out) and self.out[at].name == f"mem.free.{ins.name}":
                    at += 1
        return at

    def flush_all(self, final: bool = True, hold_tied: bool = False) -> None:
        """Reduce every bucket not yet reduced: the full ones held back by `grad_overlap=0` (they
        start after the last backward instruction so far), then the open ones. `hold_tied`: keep a
        bucket that waits for the tied sum for the end of the step (`bucket_if`)."""
        after = None if self.p.grad_overlap else self.last_compute()

        def held(axis: str, pool: list) -> bool:
            return hold_tied and self._waits_for_tied(axis, pool)

        kept = [(axis, pool) for axis, pool in self.sealed if held(axis, pool)]
        for axis, pool in self.sealed:
            if not held(axis, pool):
                self.flush(axis, self._group(axis), final, pool, after)
        self.sealed = kept
        for axis in list(self.pools):
            if held(axis, self.pools[axis]):
                self.sealed.append((axis, self.pools[axis]))
                self.pools[axis] = []
            else:
                self.flush(axis, self._group(axis), final, after=after)

    def _waits_for_tied(self, axis: str, pool: list) -> bool:
        """Whether a bucket holds this stage's copy of a tied embedding under ZeRO-1: its reduction
        waits for the tied sum, so it goes after this stage's last sends, which the other stage needs
        before it can join the sum."""
        return self.tied_first and axis == self.zero_axis and any(u == self.tied_unit for u, _ in pool)

    def tied_reduce(self, deps: tuple) -> Optional[str]:
        """`bwd.tied`: sum the tied embedding's gradient over the first and last stages."""
        self.tied = self.coll("bwd.tied", "allreduce", "embed", self.g_embed, self.an.embed_params() * self.grad_dt,
                              deps, phase="bwd", block="tied", wait=False) or ""
        return self.tied or None

    def _group(self, axis: str) -> tuple[int, ...]:
        return self.g_zero if axis == self.zero_axis else self.g_edp

    def flush(self, axis: str, group: tuple[int, ...], final: bool, pool: Optional[list] = None,
              after: Optional[str] = None) -> None:
        own = pool is None
        pool = self.pools.get(axis) if own else pool
        if not pool:
            return
        k = len(self.buckets)
        units = tuple(u for u, _ in pool)
        nbytes = sum(b for _, b in pool)
        verb = "allreduce" if self.p.zero == 0 or self.p.grad_allreduce else "reducescatter"
        name = f"bwd.grads{k}"
        after = after or self.pool_after[axis]
        if self.rp.bucket_copy_bytes and final:  # torch DDP's own buckets: the gradients copied in first
            after = self.compute("bwd", f"bucket_in{k}", -1, -1, 0, _copy_block(nbytes))
        if final and self.tied is None and self._waits_for_tied(axis, pool):
            after = self.tied_reduce((after,))
        self.coll(name, verb, axis, group, nbytes, (after,), phase="bwd", block=f"grads{k}", items=units, wait=False)
        self.grad_colls.append(name)
        if self.p.zero == 2:
            self.memory("free", "grads", nbytes, f"grads.{axis}.b{k}", stream=f"comm.{axis}", deps=(name,))
        if final:
            self.buckets.append((name, axis, units, nbytes))
            if self.g_rep and axis == self.zero_axis:
                r = self.coll(f"bwd.grads_rep{k}", "allreduce", "dp_replicate", self.g_rep, nbytes / len(group),
                              (name,), phase="bwd", block=f"grads_rep{k}", items=units, wait=False)
                self.grad_colls.append(r)
        else:
            self.buckets.append((name, "", units, 0.0))  # numbered, but no parameter gather follows
        if own:
            self.pools[axis] = []

    # --- end of step ---------------------------------------------------------------------------------
    def step_reduction(self, block: str, shard: float, traffic: float, deps: list[str]) -> str:
        """A pass over the rank's final gradients (`traffic` bytes per element) whose one fp32 result
        is all-reduced over the world before the step goes on: `unscale` (loss_scale: divide by the
        scale, flag overflows) and `grad_norm` (clip_grad: sum the squares). Each is a barrier across
        pipeline stages, as in every trainer that scales or clips."""
        self.wait.extend(deps)
        c = self.compute("optim", block, -1, -1, 0, Block("elementwise", 2.0 * shard, shard * traffic, 0.0))
        world = tuple(range(self.rp.world))
        return self.coll(f"optim.{block}", "allreduce", "world", world, STEP_FLAG_BYTES, (c,), phase="optim",
                         block=block, wait=False) or c

    def finish(self) -> None:
        self.wait.extend(self.sends_to_wait)  # p2p_overlap=0: the last sends block before the step
        self.sends_to_wait = []
        self.flush_all()
        deps = list(self.grad_colls)
        if self.tied_unit is not None and self.tied is None:
            deps.append(self.tied_reduce(tuple(deps) + (self.last_compute(),)))
        if self.rp.bucket_copy_bytes:  # ... and the reduced ones copied back to `.grad` once all are done
            copied = sum(nbytes for _, axis, _, nbytes in self.buckets if axis)
            self.wait.extend(d for d in deps if d)
            deps = [self.compute("bwd", "bucket_out", -1, -1, 0, _copy_block(copied))]
        params = self.rp.params_on_pp_rank(self.pp_rank)
        shard = params["dense"] / (self.zero_size if self.p.zero >= 1 else 1)
        shard += params["expert"] / (max(1, len(self.g_edp)) if self.p.zero >= 1 else 1)
        deps = [d for d in deps if d]
        if self.p.loss_scale > 0:  # divide by the scale (read and write), flag overflows
            deps = [self.step_reduction("unscale", shard, 2.0 * self.grad_dt, deps)]
        clip_bytes = 2.0 * self.grad_dt if self.p.clip_grad > 0 else 0.0  # the scaling: each gradient read, written
        if clip_bytes:  # sum the squares (read)
            deps = [self.step_reduction("grad_norm", shard, self.grad_dt, deps)]
        if self.p.offload != "none":
            d2h = self._emit(Instr(self.rank, "copy.grads_d2h", "copy", "copy.d2h", "d2h", phase="optim",
                                   block="grads_d2h", bytes=shard * self.grad_dt, deps=tuple(deps) + (self.last_compute(),)))
            cpu = self._emit(Instr(self.rank, "host.optim", "compute", "host", "cpu_optimizer", phase="optim",
                                   block="cpu_optim", flops=shard, bytes=shard * (ADAM_BYTES_PER_PARAM + clip_bytes),
                                   deps=(d2h,)))
            opt = self._emit(Instr(self.rank, "copy.params_h2d", "copy", "copy.h2d", "h2d", phase="optim",
                                   block="params_h2d", bytes=shard * self.rp.dtype_bytes, deps=(cpu,)))
            read = d2h
        else:
            self.wait.extend(deps)
            # Megatron-LM's optimizer first copies the gradients of its shard to fp32 (`master_grads`);
            # they live until the step is done
            main = shard * self.rp.master_grad_bytes
            self.memory("alloc", "grads", main, "grads.main", deps=tuple(deps))
            opt = self.compute("optim", "optim", -1, -1, 0,
                               Block("optimizer", shard * ADAM_FLOPS_PER_PARAM,
                                     shard * (adam_bytes_per_param(self.rp) + clip_bytes), 0.0))
            self.memory("free", "grads", main, "grads.main")
            read = opt
        # FSDP2's zero_grad(set_to_none) lets the lazily made shards go once the optimizer has read them
        self.memory("free", "grads", self.lazy_shards, "grads.shards", deps=(read,))
        if self.p.zero in (1, 2):
            dt = self.rp.dtype_bytes
            phase, deps = ("fwd", ()) if self.p.param_overlap else ("optim", (opt,))
            for name, axis, units, nbytes in self.buckets:
                if not axis:
                    continue
                k = name.removeprefix("bwd.grads")
                group = self.g_zero if axis == self.zero_axis else self.g_edp
                self.coll(f"{phase}.params{k}", "allgather", axis, group, nbytes / self.grad_dt * dt, deps,
                          phase=phase, block=f"params{k}", items=units, wait=False)
            if self.p.param_overlap:
                self.overlap_param_gathers()

    def overlap_param_gathers(self) -> None:
        """`param_overlap`: the parameter all-gathers the step has just emitted belong to the next
        step's forward (Megatron-LM's --overlap-param-gather). In a step of the steady state they are
        issued as it starts, in the order the forward first needs their buckets, and each unit's first
        forward instruction waits for its bucket."""
        def is_gather(ins: Instr) -> bool:
            return ins.kind == "collective" and ins.phase == "fwd" and ins.block.startswith("params")

        gathers = [i for i in self.out if is_gather(i)]
        rest = [i for i in self.out if not is_gather(i)]
        first: dict[int, int] = {}  # unit -> index in `rest` of its first forward compute
        for j, ins in enumerate(rest):
            if ins.kind == "compute" and ins.phase == "fwd" and ins.layer not in first:
                first[ins.layer] = j
        waits: dict[int, list[str]] = {}
        for g in gathers:
            for u in g.items:
                j = first.get(u)
                if j is not None:
                    waits.setdefault(j, []).append(g.name)
        for j, names in waits.items():
            rest[j].deps = tuple(dict.fromkeys(rest[j].deps + tuple(names)))
        gathers.sort(key=lambda g: min((first.get(u, len(rest)) for u in g.items), default=len(rest)))
        start = next((j for j, ins in enumerate(rest) if ins.kind != "memory"), len(rest))  # after `setup`
        self.out[:] = rest[:start] + gathers + rest[start:]
