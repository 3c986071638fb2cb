"""The ZeRO-3 concern of a rank's lowering: per-unit parameter all-gathers (`prefetch_depth` units
in flight, each unit's in the calls its flavour issues) and the release of their buffers, gradient
reduce-scatters, the device copies around them, lazily made gradient shards, and the preallocated
buffers of the flavours that keep them (`Zero3Flavour.preallocated_buffers`)."""
from __future__ import annotations

from typing import NamedTuple

from simexec.program.block import Block
from simexec.program.instructions import Instr
from simexec.program.lowering.emit import ZERO3_COPY_BLOCKS, RankEmitter
from simexec.program.param_tensors import unit_tensors
from simexec.specs.zero3_flavours import LIST_VIEW_S


def copy_block(nbytes: float, passes: int) -> Block:
    """`passes` device copies of `nbytes`: each reads and writes them once."""
    return Block("elementwise", 0.0, 2.0 * passes * nbytes, 0.0, bwd=2.0 * passes * nbytes)


class Zero3Reduction(NamedTuple):
    """grad_overlap=0: a unit's gradients of a micro-batch, reduce-scattered after the backward."""

    unit: int
    mb: int
    chunk: int
    suffix: str  # ".tied": the tied head's share of the embedding's gradient


class HeldGather(NamedTuple):
    """A unit's gathered parameters while they stay gathered: their buffers' tags (unit, tag), freed
    together, and the gathers that filled them."""

    buffers: tuple[tuple[int, str], ...]
    names: list[str]


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
        self.z3_held: dict[int, HeldGather] = {}  # units gathered now: a later pass finds them gathered
        # under a pipeline (`Zero3Flavour.pipeline_defers_reduction`): units stay gathered and their
        # unsharded gradients accumulate until the stage's last backward of the step
        self.z3_defer = bool(self.zero3_sharded and self.p.pp > 1 and self.p.zero3.pipeline_defers_reduction)
        self.z3_unsharded: dict[tuple[int, str], str] = {}  # (unit, suffix) -> its unsharded gradients' tag

    def z3_bytes(self, unit: int, dt: float, shard: bool = False) -> float:
        """A ZeRO-3 unit at `dt` bytes per element, as its gathers and reduce-scatters hold it: whole
        (`shard`: this rank's share), dense and expert; a class whose group is one rank stays out."""
        dense, expert = self.unit_params(unit)
        zs, edp = self.zero_size, len(self.groups.edp)
        return dt * (dense * (zs > 1) / (zs if shard else 1) + expert * (edp > 1) / (edp if shard else 1))

    def z3_gather_calls(self, unit: int) -> list[float]:
        """Dense elements of each all-gather of the unit, as the flavour issues them."""
        dense, _ = self.unit_params(unit)
        return self.p.zero3.gather_calls(unit_tensors(self.rp, unit, dense)) if dense > 0 else []

    def z3_reduce_calls(self, unit: int) -> list[float]:
        """Dense elements of each reduce-scatter of the unit's gradients."""
        dense, _ = self.unit_params(unit)
        return self.p.zero3.reduce_calls(unit_tensors(self.rp, unit, dense)) if dense > 0 else []

    def z3_gathered_bytes(self, unit: int, dt: float) -> float:
        """A unit's gathered parameters at `dt` bytes per element: its persisted tensors stay out."""
        _, expert = self.unit_params(unit)
        dense = sum(self.z3_gather_calls(unit))
        return dt * (dense * (self.zero_size > 1) + expert * (len(self.groups.edp) > 1))

    def z3_copy(self, phase: str, block: str, unit: int, mb: int, c: int, nbytes: float, passes: int,
                deps: tuple, tag: str) -> tuple:
        """A flavour's device copy around a collective, on the compute stream; `deps` then, or the copy.
        None on CPU ranks: simexec's executor gathers into its flat buffers itself, and the host model
        prices its operators."""
        if passes <= 0 or nbytes <= 0 or self.an.eager_kernels:
            return deps
        b = copy_block(nbytes, passes)
        name = self.emit(Instr(self.rank, f"{phase}.{block}.{tag}", "compute", "compute", b.op, phase=phase,
                               block=block, layer=unit, mb=mb, chunk=c, bytes=b.bytes,
                               deps=tuple(d for d in deps if d)))
        return (name,)

    def z3_list_views(self, verb: str, phase: str, unit: int, mb: int, c: int, nbytes: float, deps: tuple,
                      tag: str) -> tuple:
        """A list collective's (`Zero3Flavour.list_collectives`) per-rank work before it: the host makes
        a view per rank and launches one copy per rank out of (into) NCCL's flat buffer, the copies
        moving the call's bytes once each way. A gather's runs on the compute stream: DeepSpeed 0.3's
        prefetch synchronizes the device before each parameter's gather and issues the module's compute
        only after it. A reduce-scatter's runs on its own stream: the gradient hook builds it while the
        module's backward kernels already issued run. `deps` then, or this instruction; none on CPU
        ranks or where the flavour has no list collectives."""
        ranks = self.zero_size
        if not self.p.zero3.list_collectives or ranks <= 1 or nbytes <= 0 or self.an.eager_kernels:
            return deps
        host_s = ranks * (LIST_VIEW_S[verb] + self.rp.cluster.device.launch_overhead_s)
        block = "gather_list" if verb == "allgather" else "grads_list"
        stream = "compute" if verb == "allgather" else f"comm.{self.groups.zero_axis}"
        name = self.emit(Instr(self.rank, f"{phase}.{block}.{tag}", "compute", stream, "elementwise",
                               phase=phase, block=block, layer=unit, mb=mb, chunk=c, bytes=2.0 * nbytes,
                               host_s=host_s, deps=tuple(d for d in deps if d)))
        return (name,)

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
        """Gather the unit for a pass, unless it is still gathered from an earlier one (then its
        compute, on the same stream as that pass's, has nothing to wait for)."""
        if unit in self.z3_held:
            self.z3_gathers[(unit, phase, mb)] = []
            return
        tag = f"{phase}.gather.L{unit}.m{mb}"
        names = self.gather_unit(unit, tag, phase, mb, c, deps)
        buffers = [(unit, tag)]
        if self.tied_head_gathers_embedding(unit):
            names += self.gather_unit(-1, tag + ".tied", phase, mb, c, deps)
            buffers.append((-1, tag + ".tied"))
        for extra in self.mtp_reads(unit):
            holder = next((u for u, h in self.z3_held.items() if any(b[0] == extra for b in h.buffers)), None)
            if holder is None:  # FSDP's pre-forward (pre-backward) unshard of a module called again
                names += self.gather_unit(extra, f"{tag}.mtp{extra}", phase, mb, c, deps)
                buffers.append((extra, f"{tag}.mtp{extra}"))
                continue
            # still gathered (for itself or an earlier depth): used as it is, and where that use would let
            # it go first, let go after this depth's instead
            held = self.z3_held[holder]
            names += held.names
            if self.reshards_after(phase, mb) and not self.root_kept(extra):
                buffers += [b for b in held.buffers if b[0] == extra]
                self.z3_held[holder] = held._replace(buffers=tuple(b for b in held.buffers if b[0] != extra))
        self.z3_gathers[(unit, phase, mb)] = names
        self.z3_held[unit] = HeldGather(tuple(buffers), names)

    def mtp_reads(self, unit: int) -> tuple[int, ...]:
        """The units an MTP depth reads besides its own (Megatron-Core's MultiTokenPredictionLayer calls
        the shared embedding and output layer): the embedding's (over a pipeline the head unit's copy
        of it, `ResolvedPlan.tied_copy`) and the head's, which ZeRO-3 gathers beside the depth's, and
        whose gradient shares the depth's backward makes are reduce-scattered after it (`z3_grads_ready`)."""
        if not (self.zero3_sharded and self.is_mtp_unit(unit)):
            return ()
        embed = -1 if -1 in self.all_stage_units() else self.head_unit
        return tuple(dict.fromkeys((embed, self.head_unit)))

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
        zero_axis, zero3 = self.groups.zero_axis, self.p.zero3
        if not zero3.preallocated_buffers:
            self.memory("alloc", "buffers", self.z3_gathered_bytes(unit, dt), tag, stream=f"comm.{zero_axis}",
                        deps=deps)
        calls = self.z3_gather_calls(unit) if self.zero_size > 1 else []
        cdeps = self.z3_copy(phase, "gather_in", unit, mb, c, sum(calls) * dt / self.zero_size,
                             zero3.gather_copy_in, deps, tag.removeprefix(f"{phase}.gather."))
        for k, elems in enumerate(calls):
            call = tag + (f".c{k}" if k else "")
            ldeps = self.z3_list_views("allgather", phase, unit, mb, c, elems * dt, cdeps,
                                       call.removeprefix(f"{phase}.gather."))
            names.append(self.coll(call, "allgather", zero_axis, self.groups.zero,
                                   elems * dt, ldeps, phase=phase, block="gather", layer=unit, mb=mb, chunk=c,
                                   items=(unit,), wait=False))
        n = self.coll(tag + ".experts", "allgather", "edp", self.groups.edp, expert * dt, deps, phase=phase,
                      block="gather", layer=unit, mb=mb, chunk=c, items=(unit,), wait=False)
        names.append(n)
        if self.p.zero3.preallocated_buffers and phase == "bwd":
            # the backward accumulates into the parity's gradient buffer: its last reduce-scatter first
            names += [self.z3_busy.pop((cls, unit % 2), None) for cls in ("dense", "expert")]
        return [n for n in names if n]

    def prefetch(self, units: list[int], phase: str, mb: int, c: int) -> None:
        """Gather the first `prefetch_depth` units of a pass (the flavour's gathers in flight)."""
        if self.zero3_sharded:
            for u in units[:self.p.zero3.prefetch_depth]:
                self.gather(u, phase, mb, c, ())

    def prefetch_next(self, units: list[int], j: int, phase: str, mb: int, c: int) -> None:
        """Once unit j is done with its buffer, gather unit j+depth into it."""
        depth = self.p.zero3.prefetch_depth if self.zero3_sharded else 0
        if depth and j + depth < len(units):
            self.gather(units[j + depth], phase, mb, c, (self.last_compute(),))

    def wait_gather(self, unit: int, phase: str, mb: int) -> None:
        """The unit's compute waits for its gathers (and the flavour's copy-out of them)."""
        names = self.z3_gathers.get((unit, phase, mb), ())
        passes = self.p.zero3.gather_copy_out if self.zero3_sharded else 0
        if names and passes:
            dense_bytes = sum(self.z3_gather_calls(unit)) * self.rp.param_gather_bytes * (self.zero_size > 1)
            self.z3_copy(phase, "gather_out", unit, mb, 0, dense_bytes, passes, tuple(names),
                         f"L{unit}.m{mb}")
        self.wait.extend(names)

    def reshards_after(self, phase: str, mb: int) -> bool:
        """Whether a unit's pass ends by freeing its gathered parameters: a forward unless the plan
        keeps them for the backward (`reshard_after_forward=0`), a backward unless a pipeline keeps
        them for the step's later micro-batches (all but the last)."""
        if phase == "fwd":
            return self.p.reshard_after_forward
        return not self.z3_defer or mb == self.micro_batches - 1

    def root_kept(self, unit: int) -> bool:
        """Whether `unit` is the root's (embedding or head) and the flavour keeps the root gathered from
        its forward to the end of the backward (`root_kept_through_backward`): on a rank that holds both
        (no pipeline) and an untied head (a tied one gathers the embedding's parameters itself). Not on
        CPU ranks: simexec's executor reshards the root like any unit, as it gathers its flat buffers
        itself (as `z3_copy`)."""
        return (self.p.zero3.root_kept_through_backward and unit in (-1, self.head_unit)
                and self.rp.virtual_stages == 1 and not self.rp.model.tied_embeddings
                and not self.an.eager_kernels)

    def release_gather(self, unit: int, phase: str, mb: int) -> None:
        if not self.zero3_sharded or not self.reshards_after(phase, mb):
            return
        if self.root_kept(unit):
            if phase == "fwd" or unit != -1:
                return  # kept for the backward; released with the embedding's, the backward's last unit
            self.release_units((self.head_unit, -1))
            return
        self.release_units((unit,))

    def release_units(self, units: tuple[int, ...]) -> None:
        for unit in units:
            held = self.z3_held.pop(unit, None)
            if held is not None and not self.p.zero3.preallocated_buffers:
                for u, t in held.buffers:
                    self.memory("free", "buffers", self.z3_gathered_bytes(u, self.rp.param_gather_bytes), t)

    # --- gradient reduce-scatters --------------------------------------------------------------------
    def z3_grads_ready(self, unit: int, mb: int, c: int, after: str) -> None:
        """A unit's unsharded gradients of micro-batch mb are complete: reduce-scatter them now, or
        after the backward (grad_overlap=0)."""
        shares = [(-1, ".tied")] if self.tied_head_gathers_embedding(unit) else []
        if not self.z3_defer:  # (deferred: the units' own reductions take their accumulated gradients)
            shares += [(u, f".mtp{unit}") for u in self.mtp_reads(unit)]
        for u, suffix in [(unit, "")] + shares:
            if not self.p.zero3.preallocated_buffers and (u, suffix) not in self.z3_unsharded:
                tag = f"bwd.grads.L{u}.m{mb}{suffix}.unsharded"
                self.memory("alloc", "buffers", self.z3_bytes(u, self.grad_dt), tag, deps=(after,))
                self.z3_unsharded[(u, suffix)] = tag
            if self.z3_defer and mb < self.micro_batches - 1:
                continue  # accumulated into until the stage's last backward
            if self.z3_defer:  # the last backward's post_backward: after the stage's whole backward
                self.z3_pending.append(Zero3Reduction(u, mb, c, suffix))
            elif self.p.grad_overlap:
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
        out_stream = f"comm.{zero_axis}" if self.p.zero3.grad_shards_on_reduce_stream else "compute"
        if first:  # the first reduce-scatter's output becomes the unit's gradient shard
            self.z3_shards.add(unit)
            self.memory("alloc", "grads", shard, f"grads.shard.L{unit}", stream=out_stream, deps=(after,))
        else:  # a later one's output is summed into the shard once it lands
            self.memory("alloc", "grads", shard, f"{tag}.out", stream=out_stream, deps=(after,))
        calls = self.z3_reduce_calls(unit) if self.zero_size > 1 else []
        cdeps = self.z3_copy("bwd", "grads_in", unit, mb, c, dense * gdt * (self.zero_size > 1),
                             self.p.zero3.reduce_copy_in, (after,), f"L{unit}.m{mb}{suffix}")
        dense_calls = []
        for k, elems in enumerate(calls):
            call = tag + (f".c{k}" if k else "")
            ldeps = self.z3_list_views("reducescatter", "bwd", unit, mb, c, elems * gdt, cdeps,
                                       call.removeprefix("bwd.grads."))
            dense_calls.append(self.coll(call, "reducescatter", zero_axis, self.groups.zero, elems * gdt, ldeps,
                                         phase="bwd", block="grads", layer=unit, mb=mb, chunk=c, items=(unit,),
                                         wait=False))
        a = dense_calls[-1] if dense_calls else None  # the unit's last: the stream runs them in order
        b = self.coll(tag + ".experts", "reducescatter", "edp", self.groups.edp, expert * gdt, (after,), phase="bwd",
                      block="grads", layer=unit, mb=mb, chunk=c, items=(unit,), wait=False)
        self.grad_colls += [n for n in dense_calls + [b] if n]
        for cls, n in (("dense", a), ("expert", b)):
            if n and self.p.zero3.preallocated_buffers:
                self.z3_busy[(cls, unit % 2)] = n
        landed = tuple(n for n in dense_calls + [b] if n)
        unsharded = self.z3_unsharded.pop((unit, suffix), None)
        if unsharded is not None:
            self.memory("free", "buffers", full, unsharded, stream=f"comm.{zero_axis}", deps=landed)
        if not first:
            self.memory("free", "grads", shard, f"{tag}.out", stream=f"comm.{zero_axis}", deps=landed)
        if mb == self.micro_batches - 1 and self.groups.rep and a and not suffix:
            r = self.coll(f"bwd.grads_rep.L{unit}", "allreduce", "dp_replicate", self.groups.rep,
                          dense * gdt / self.zero_size, (a,), phase="bwd", block="grads_rep", layer=unit,
                          items=(unit,), wait=False)
            self.grad_colls.append(r)
