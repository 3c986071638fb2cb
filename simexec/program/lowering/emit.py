"""The instruction emitter of one rank's lowering, and the rank's state every concern reads.

Every concern of the lowering (pipeline, layers, ZeRO-3, gradients, the step's end) appends to one
instruction list through these few calls, so names, dependencies and memory markers are made one way.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

from simexec.program.block import Block
from simexec.program.blocks import Anatomy
from simexec.program.groups import rank_groups
from simexec.program.instructions import Instr
from simexec.program.schedules import Action
from simexec.specs.plan import ResolvedPlan

# the device copies around ZeRO-3's collectives (`Zero3Flavour.gather_copy_in` ...): compute-stream
# memory traffic the simulator prices, never what a later instruction waits on as "the last compute";
# the executor's flat buffers make their own
ZERO3_COPY_BLOCKS = ("gather_in", "gather_out", "grads_in", "gather_list", "grads_list")


class PendingWeightPass(NamedTuple):
    """tp_overlap: a column-parallel block's weight-gradient pass, held until the tp collective of its
    input gradients is issued (`TensorParallel.tp`), and what to free after it."""

    block: str
    layer: int
    mb: int
    chunk: int
    b: Block
    after: Callable[[], None]


class RankEmitter:
    """One rank's instruction list and the calls that append to it; the base of `RankLowering`'s
    concerns, which all read the plan (`p`, `rp`), the block anatomy (`an`), the rank's coordinates
    and process groups (`groups`: `simexec.program.groups.RankGroups`)."""

    def __init__(self, rp: ResolvedPlan, an: Anatomy, rank: int, actions: list[Action]):
        self.rp, self.an, self.rank, self.actions = rp, an, rank, actions
        self.p = rp.plan
        self.coords = rp.mesh.coords(rank)
        self.pp_rank = self.coords["pp"]
        self.micro_batches = rp.micro_batches
        self.head_unit = rp.model.layers  # the head's unit (and layer number); -1 is the embedding's
        self.grad_dt = rp.grad_bytes
        self.groups = rank_groups(rp, rank)
        self.out: list[Instr] = []
        self.wait: list[str] = []  # collectives the next compute instruction must wait on
        self.wait_after_next: list[str] = []  # and those the compute after it must (tp_async's rest of a gather)
        # zero-bubble schedules: a backward computes the input gradients only, a weight pass the rest
        self.split = self.p.pipeline_schedule.splits_backward
        self.pending_weight_pass: Optional[PendingWeightPass] = None
        # zero-bubble schedules: a unit's activations live until its weight-gradient pass, which frees
        # them (the frees its input-gradient pass would have made, held per (unit, micro-batch))
        self.defer_frees_to: Optional[tuple[int, int]] = None
        self.deferred_frees: dict[tuple[int, int], list[Instr]] = {}

    # --- emit ----------------------------------------------------------------------------------------
    def emit(self, ins: Instr, at: Optional[int] = None) -> str:
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
        pending = self.pending_weight_pass
        assert pending is None or phase == "wgrad", f"{name} before the pending weight pass of {pending.block}"
        deps, self.wait = tuple(dict.fromkeys(self.wait)), self.wait_after_next
        self.wait_after_next = []
        if phase == "wgrad":
            flops, nbytes, ws = b.wgrad_flops, b.wgrad_bytes, b.wgrad_tmp
        elif phase == "bwd" and (self.split or input_only):
            flops, nbytes, ws = b.bwd_flops - b.wgrad_flops, b.bwd_bytes - b.wgrad_bytes, b.bwd_workspace - b.wgrad_tmp
        elif phase == "bwd":
            flops, nbytes, ws = b.bwd_flops, b.bwd_bytes, b.bwd_workspace
        else:
            flops, nbytes, ws = b.flops, b.bytes, 0.0
        self.memory("alloc", "activations", ws, name, deps=deps)
        out = self.emit(Instr(
            self.rank, name, "compute", "compute", b.op, phase=phase, block=block, layer=layer, mb=mb,
            chunk=chunk, flops=flops, bytes=nbytes, deps=deps, keys=b.keys, gemm_groups=b.gemm_groups,
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
        self.emit(ins)
        if wait:
            self.wait.append(name)
        return name

    def memory(self, op: str, category: str, nbytes: float, tag: str, stream: str = "compute",
               deps: tuple[str, ...] = (), defer: bool = True, at: Optional[int] = None) -> Optional[Instr]:
        """An alloc or free of `nbytes` (none for 0); `at`: where in the program, if not at its end.
        A free of activations while a unit's frees are deferred (`defer_frees_to`) waits for its
        weight pass."""
        if nbytes <= 0:
            return None
        ins = Instr(self.rank, f"mem.{op}.{tag}", "memory", stream, op, bytes=float(nbytes), category=category,
                    deps=deps)
        if defer and self.defer_frees_to is not None and op == "free" and category == "activations":
            self.deferred_frees.setdefault(self.defer_frees_to, []).append(ins)
        else:
            self.emit(ins, at)
        return ins

    def last_compute(self, back: int = 0) -> Optional[str]:
        """The last compute instruction emitted (ZeRO-3's copies aside), or the one `back` before it."""
        for ins in reversed(self.out):
            if ins.kind == "compute" and ins.block not in ZERO3_COPY_BLOCKS:
                if not back:
                    return ins.name
                back -= 1
        return None

    # --- the rank's share of the model ---------------------------------------------------------------
    def stage(self, chunk: int) -> int:
        """The virtual stage of one of this rank's chunks."""
        return self.rp.stage(self.pp_rank, chunk)

    def holds(self, vs: int) -> bool:
        """Whether this rank holds virtual stage vs: a V-shaped schedule's turn from the first chunk to
        the second stays on the last rank, with no message."""
        return self.rp.place(vs)[0] == self.pp_rank

    def units(self, chunk: int) -> list[int]:
        """Parameter units of a virtual stage in forward order: -1 embedding, layers, the head, the
        MTP depths (`ModelSpec.mtp_block`, beside the head). A stage may hold no layer."""
        vs = self.stage(chunk)
        units = list(self.rp.stage_layers[vs])
        if vs == 0:
            units.insert(0, -1)
        if vs == self.rp.virtual_stages - 1:
            m = self.rp.model
            units.append(self.head_unit)
            units.extend(m.mtp_block(d) for d in range(m.mtp_layers))
        return units

    def is_mtp_unit(self, unit: int) -> bool:
        return unit > self.head_unit

    def unit_params(self, unit: int) -> tuple[float, float]:
        """A unit's (dense, expert) parameters on this rank; an MTP depth's are its own (the head and
        embedding it uses are the head unit's)."""
        if unit == -1:
            return self.an.embed_params(), 0.0
        if unit == self.head_unit:
            return self.an.head_params(), 0.0
        dense, expert = self.an.layer_param_counts(unit)
        if self.is_mtp_unit(unit):
            dense += self.an.mtp_in_params()
        return dense, expert

    def is_recompute_layer(self, layer: int, chunk: int) -> bool:
        if self.p.recompute == "none":
            return False
        if self.is_mtp_unit(layer):
            return False  # MTP blocks keep their activations (Megatron's recompute covers the decoder)
        pos = self.rp.stage_layers[self.stage(chunk)].index(layer)
        return self.p.recompute_layers is None or pos < self.p.recompute_layers
