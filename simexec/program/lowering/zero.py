"""The ZeRO-3 concern of a rank's lowering: per-unit parameter all-gathers (two in flight) and the
release of their buffers, gradient reduce-scatters, lazily made gradient shards, and the
preallocated buffers of the flavours that keep them (`Zero3Flavour.preallocated_buffers`)."""
from __future__ import annotations

from typing import NamedTuple

from simexec.program.instructions import Instr
from simexec.program.lowering.emit import RankEmitter


class Zero3Reduction(NamedTuple):
    """grad_overlap=0: a unit's gradients of a micro-batch, reduce-scattered after the backward."""

    unit: int
    mb: int
    chunk: int
    suffix: str  # ".tied": the tied head's share of the embedding's gradient


class Zero3Lowering(RankEmitter):
    """ZeRO-3's gathers and reduce-scatters for `RankLowering`; owns the `z3_*` state. Its
    reductions join `grad_colls` (`GradientLowering`'s), which the step waits for."""

    def init_zero3(self) -> None:
        zero_size = len(self.groups.zero)
        self.zero_size = zero_size
        # ZeRO-3 with a group to shard over: dense parameters over `groups.zero`, or experts over `groups.edp`
        self.zero3_sharded = self.p.zero == 3 and (
            zero_size > 1 or (self.rp.model.moe is not None and len(self.groups.edp) > 1))
        self.z3_gathers: dict[tuple, list[str]] = {}  # (unit, phase, mb) -> the gathers its compute waits on
        # preallocated buffers: the reduce-scatter still reading each (class, parity) gradient buffer
        self.z3_busy: dict[tuple[str, int], str] = {}
        self.z3_pending: list[Zero3Reduction] = []  # grad_overlap=0: reductions after the backward
        self.z3_shards: set[int] = set()  # lazy_grad_shards: units whose gradient shard exists this step
        self.z3_lazy_shard_bytes = 0.0  # ... and their bytes once all exist (freed after the optimizer step)

    def z3_bytes(self, unit: int, dt: float, shard: bool = False) -> float:
        """A ZeRO-3 unit at `dt` bytes per element, as its gathers and reduce-scatters hold it: whole
        (`shard`: this rank's share), dense and expert; a class whose group is one rank stays out."""
        dense, expert = self.unit_params(unit)
        zs, edp = self.zero_size, len(self.groups.edp)
        return dt * (dense * (zs > 1) / (zs if shard else 1) + expert * (edp > 1) / (edp if shard else 1))

    def tied_head_gathers_embedding(self, unit: int) -> bool:
        """ZeRO-3 with the head on the embedding's rank (no pipeline, or a V): a tied LM head reads the
        embedding's unit, so the head gathers it too, and reduce-scatters the head's share of its
        gradient after the head's backward."""
        return (unit == self.head_unit and self.rp.model.tied_embeddings and not self.rp.tied_copy
                and self.zero3_sharded)

    def all_stage_units(self) -> list[int]:
        return [u for c in range(self.p.vpp) for u in self.units(c)]

    def reserve_lazy_shards(self) -> float:
        """lazy_grad_shards: the bytes of the gradient shards their first reduce-scatters make, which
        the static gradients leave out (freed after the optimizer step)."""
        if self.p.lazy_grad_shards and self.zero3_sharded:
            self.z3_lazy_shard_bytes = sum(self.z3_bytes(u, self.grad_dt, shard=True) for u in self.all_stage_units())
        return self.z3_lazy_shard_bytes

    def allocate_zero3_buffers(self) -> None:
        """The flavour's preallocated parameter and gradient buffers: two of the biggest unit each."""
        zero3 = self.p.zero3
        if zero3 is not None and zero3.preallocated_buffers and self.zero_size > 1:
            biggest = max(sum(self.unit_params(u)) for u in self.all_stage_units())
            self.memory("alloc", "buffers", 2 * biggest * self.rp.param_gather_bytes, f"{zero3.name}.params")
            self.memory("alloc", "buffers", 2 * biggest * self.grad_dt, f"{zero3.name}.grads")

    # --- parameter gathers ---------------------------------------------------------------------------
    def gather(self, unit: int, phase: str, mb: int, c: int, deps: tuple) -> None:
        names = self.gather_unit(unit, f"{phase}.gather.L{unit}.m{mb}", phase, mb, c, deps)
        if self.tied_head_gathers_embedding(unit):
            names += self.gather_unit(-1, f"{phase}.gather.L{unit}.m{mb}.tied", phase, mb, c, deps)
        self.z3_gathers[(unit, phase, mb)] = names

    def gather_unit(self, unit: int, tag: str, phase: str, mb: int, c: int, deps: tuple) -> list[str]:
        dense, expert = self.unit_params(unit)
        dt = self.rp.param_gather_bytes
        names = []
        if self.p.offload == "optimizer+params":
            # ZeRO-Infinity: the parameter shard lives in host memory and comes over PCIe first
            shard = (dense / self.zero_size + expert / max(1, len(self.groups.edp))) * self.rp.dtype_bytes
            deps = (self.emit(Instr(self.rank, f"copy.{tag}", "copy", "copy.h2d", "h2d", phase=phase,
                                    block="params_h2d", layer=unit, mb=mb, chunk=c, bytes=shard,
                                    deps=tuple(d for d in deps if d), items=(unit,))),)
        zero_axis = self.groups.zero_axis
        if not self.p.zero3.preallocated_buffers:
            self.memory("alloc", "buffers", self.z3_bytes(unit, dt), tag, stream=f"comm.{zero_axis}", deps=deps)
        n = self.coll(tag, "allgather", zero_axis, self.groups.zero, dense * dt, deps, phase=phase, block="gather",
                      layer=unit, mb=mb, chunk=c, items=(unit,), wait=False)
        names.append(n)
        n = self.coll(tag + ".experts", "allgather", "edp", self.groups.edp, expert * dt, deps, phase=phase,
                      block="gather", layer=unit, mb=mb, chunk=c, items=(unit,), wait=False)
        names.append(n)
        if self.p.zero3.preallocated_buffers and phase == "bwd":
            # the backward accumulates into the parity's gradient buffer: its last reduce-scatter first
            names += [self.z3_busy.pop((cls, unit % 2), None) for cls in ("dense", "expert")]
        return [n for n in names if n]

    def prefetch(self, units: list[int], phase: str, mb: int, c: int) -> None:
        """Gather the first two units of a pass (two buffers in flight, as YaFSDP and FSDP's limit)."""
        if self.zero3_sharded:
            for u in units[:2]:
                self.gather(u, phase, mb, c, ())

    def prefetch_next(self, units: list[int], j: int, phase: str, mb: int, c: int) -> None:
        """Once unit j is done with its buffer, gather unit j+2 into it."""
        if self.zero3_sharded and j + 2 < len(units):
            self.gather(units[j + 2], phase, mb, c, (self.last_compute(),))

    def wait_gather(self, unit: int, phase: str, mb: int) -> None:
        self.wait.extend(self.z3_gathers.get((unit, phase, mb), ()))

    def release_gather(self, unit: int, phase: str, mb: int) -> None:
        if self.zero3_sharded and not self.p.zero3.preallocated_buffers:
            tag = f"{phase}.gather.L{unit}.m{mb}"
            for u, t in [(unit, tag)] + ([(-1, tag + ".tied")] if self.tied_head_gathers_embedding(unit) else []):
                self.memory("free", "buffers", self.z3_bytes(u, self.rp.param_gather_bytes), t)

    # --- gradient reduce-scatters --------------------------------------------------------------------
    def z3_grads_ready(self, unit: int, mb: int, c: int, after: str) -> None:
        """A unit's unsharded gradients of micro-batch mb are complete: reduce-scatter them now, or
        after the backward (grad_overlap=0)."""
        for u, suffix in [(unit, "")] + ([(-1, ".tied")] if self.tied_head_gathers_embedding(unit) else []):
            if not self.p.zero3.preallocated_buffers:
                self.memory("alloc", "buffers", self.z3_bytes(u, self.grad_dt),
                            f"bwd.grads.L{u}.m{mb}{suffix}.unsharded", deps=(after,))
            if self.p.grad_overlap:
                self.z3_reduce(u, mb, c, after, suffix)
            else:
                self.z3_pending.append(Zero3Reduction(u, mb, c, suffix))

    def z3_reduce_pending(self) -> None:
        """grad_overlap=0: the reduce-scatters held back to the end of the micro-batch's backward."""
        for r in self.z3_pending:
            self.z3_reduce(r.unit, r.mb, r.chunk, self.last_compute(), r.suffix)
        self.z3_pending = []

    def z3_reduce(self, unit: int, mb: int, c: int, after: str, suffix: str = "") -> None:
        """ZeRO-3: reduce-scatter the unit's gradients of micro-batch mb (and HSDP's replicate
        all-reduce after the last), then free its unsharded gradients. `suffix` ".tied": the tied
        head's share of the embedding's gradient, reduced before the embedding's own."""
        dense, expert = self.unit_params(unit)
        gdt = self.grad_dt
        zero_axis = self.groups.zero_axis
        tag = f"bwd.grads.L{unit}.m{mb}{suffix}"
        full, shard = self.z3_bytes(unit, gdt), self.z3_bytes(unit, gdt, shard=True)
        first = self.p.lazy_grad_shards and unit not in self.z3_shards
        if first:  # the first reduce-scatter's output becomes the unit's gradient shard
            self.z3_shards.add(unit)
            self.memory("alloc", "grads", shard, f"grads.shard.L{unit}", deps=(after,))
        else:  # a later one's output is summed into the shard once it lands
            self.memory("alloc", "grads", shard, f"{tag}.out", deps=(after,))
        a = self.coll(tag, "reducescatter", zero_axis, self.groups.zero, dense * gdt, (after,), phase="bwd",
                      block="grads", layer=unit, mb=mb, chunk=c, items=(unit,), wait=False)
        b = self.coll(tag + ".experts", "reducescatter", "edp", self.groups.edp, expert * gdt, (after,), phase="bwd",
                      block="grads", layer=unit, mb=mb, chunk=c, items=(unit,), wait=False)
        self.grad_colls += [n for n in (a, b) if n]
        for cls, n in (("dense", a), ("expert", b)):
            if n and self.p.zero3.preallocated_buffers:
                self.z3_busy[(cls, unit % 2)] = n
        landed = tuple(n for n in (a, b) if n)
        if not self.p.zero3.preallocated_buffers:
            self.memory("free", "buffers", full, f"{tag}.unsharded", stream=f"comm.{zero_axis}", deps=landed)
        if not first:
            self.memory("free", "grads", shard, f"{tag}.out", stream=f"comm.{zero_axis}", deps=landed)
        if mb == self.micro_batches - 1 and self.groups.rep and a and not suffix:
            r = self.coll(f"bwd.grads_rep.L{unit}", "allreduce", "dp_replicate", self.groups.rep,
                          dense * gdt / self.zero_size, (a,), phase="bwd", block="grads_rep", layer=unit,
                          items=(unit,), wait=False)
            self.grad_colls.append(r)
