"""What a state variant (zero, zero_impl, dp_shard, offload, reshard_after_forward) of a structure
costs its pipeline ranks:
the model states' and buffers' memory, the last gradient reduction, optimizer step and parameter
gather after the last backward, and the work of the ZeRO axis' stream."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from simexec.program.adam import ADAM_FLOPS_PER_PARAM, adam_bytes_per_param
from simexec.program.param_tensors import unit_tensors
from simexec.specs.plan import ResolvedPlan

if TYPE_CHECKING:
    from simexec.search.bounds import Bounds
    from simexec.search.stage_costs import StageCosts


@dataclass(frozen=True)
class RankParams:
    """Parameters of one pipeline rank, as ZeRO shards and gathers them."""

    dense: float
    expert: float
    biggest: float  # the largest unit (all its parameters)
    last_dense: float  # the dense parameters of the unit whose gradients the last backward makes last
    chunks: list[list[float]]  # each chunk's units' dense parameters
    tensors: list[list[list[float]]]  # ... and their tensors (`simexec.program.param_tensors.unit_tensors`)


@dataclass(frozen=True, slots=True)
class RankMemory:
    """One pipeline rank's memory under a state variant (bytes), and its optimizer's shard."""

    model_states: float  # `ResolvedPlan.model_state_bytes`: parameters, gradients, optimizer states
    early_model_states: float  # those held before the first backward (no lazily made ZeRO-3 gradient shards)
    buffers: float  # YaFSDP's preallocated buffers
    shard_params: float  # parameters the rank's optimizer steps
    main_grads: float  # the fp32 main-gradient copy of the optimizer step
    # ZeRO-3 parameters still gathered as the first backward starts (reshard_after_forward=0, one
    # chunk per rank: every unit kept since its forward), beside the activations
    gathered_at_backward: float = 0.0
    # FSDP2 under a pipeline (`Zero3Flavour.pipeline_defers_reduction`, one chunk per rank): after the
    # stage's first backward every unit is gathered and its unsharded gradients accumulate, where the
    # step has several micro-batches (the bound checks; with one, that backward is the last)
    held_after_backward: float = 0.0


@dataclass(frozen=True, slots=True)
class RankState:
    """One pipeline rank's costs under a state variant: its memory, the seconds after its last
    backward, and the busy time of its ZeRO axis' stream."""

    memory: RankMemory
    last_reduction: float  # the last gradient reduction (every bucket's, when they wait for the backward)
    after_reduction: float  # the optimizer step (or its offload round trip) and the parameter all-gather
    stream_fixed: float  # the ZeRO stream's seconds per step
    stream_per_micro_batch: float  # and per micro-batch
    grad_traffic: float  # seconds of the whole gradient reduction, for the ordering estimate


class _MemoParams:
    """A ResolvedPlan whose `params_on_pp_rank` answers from the search's cache, so that
    `ResolvedPlan.model_state_bytes` (called unbound on it) costs a few multiplications."""

    def __init__(self, rp: ResolvedPlan, params: list[RankParams]):
        self._rp, self._params = rp, params

    def __getattr__(self, name: str):
        return getattr(self._rp, name)

    def params_on_pp_rank(self, pp_rank: int) -> dict[str, float]:
        prm = self._params[pp_rank]
        return {"dense": prm.dense, "expert": prm.expert, "total": prm.dense + prm.expert}


class StateCosts:
    """Per state variant of one structure, per pipeline rank: `RankState`s, shared by the search's
    structures through `Bounds`' caches, keyed by what they depend on."""

    def __init__(self, b: Bounds, stages: StageCosts):
        self.b, self.stages = b, stages
        self.rp, self.p = stages.rp, stages.p
        self.comm_key, self.comm, self.cm = stages.comm_key, stages.comm, stages.cm
        self.dt, self.gdt = stages.dt, stages.gdt
        self.v_shaped = stages.v_shaped

    def params(self) -> list[RankParams]:
        """Per pipeline rank: its parameters (see `RankParams`)."""
        p, s = self.p, self.stages
        key = (p.tp, p.pp, p.vpp, p.ep, p.etp, p.stages, self.v_shaped)
        out = self.b.params.get(key)
        if out is None:
            out = []
            for r in range(p.pp):
                prm = self.rp.params_on_pp_rank(r)
                units = s.units(r)
                biggest = max(s.unit_params(u) for u in units)
                last_unit = -1 if r == 0 else self.rp.stage_layers[r][0]
                chunks = [[s.unit_params(u, True) for u in s.units(r, c)] for c in range(p.vpp)]
                tensors = [[unit_tensors(self.rp, u, s.unit_params(u, True)) for u in s.units(r, c)]
                           for c in range(p.vpp)]
                out.append(RankParams(dense=prm["dense"], expert=prm["expert"], biggest=biggest,
                                      last_dense=s.unit_params(last_unit, True), chunks=chunks, tensors=tensors))
            self.b.params[key] = out
        return out

    def _variant(self, state: tuple) -> ResolvedPlan:
        """The structure's resolved plan with `state`'s model-state knobs."""
        p = self.p
        zero, zero_impl, dp_shard, offload, raf = state
        return self.rp if (p.zero, p.zero_impl, p.dp_shard, p.offload, p.reshard_after_forward) == state else replace(
            self.rp, plan=p.model_copy(update=dict(zero=zero, zero_impl=zero_impl, dp_shard=dp_shard, offload=offload,
                                                   reshard_after_forward=raf)))

    def memory(self, state: tuple) -> list[RankMemory]:
        """Per pipeline rank: its memory under `state` (see `RankMemory`)."""
        p, rp = self.p, self.rp
        key = (p.tp, p.pp, p.vpp, p.ep, p.etp, p.stages, self.v_shaped, rp.dp, p.cp, p.dtype, p.grad_fp32,
               p.master_grads, p.grad_bucket_view, state)
        out = self.b.memory.get(key)
        if out is not None:
            return out
        zero, zero_impl, dp_shard, offload, raf = state
        vrp = self._variant(state)
        groups = self.comm.groups(self.comm.rank_of_stage[0], p.ep, dp_shard, p.etp)
        zero_size = len(groups["zero"])
        edp = max(1, len(groups["edp"]))
        gdt = self.gdt
        preallocated = vrp.plan.zero3 is not None and vrp.plan.zero3.preallocated_buffers and zero_size > 1
        lazy = zero == 3 and vrp.plan.lazy_grad_shards and (zero_size > 1 or edp > 1)
        one_chunk = p.vpp == 1 and not self.v_shaped
        defer = zero == 3 and p.pp > 1 and one_chunk and vrp.plan.zero3.pipeline_defers_reduction
        out = []
        params = self.params()
        memo = _MemoParams(vrp, params)
        for r, prm in enumerate(params):
            ms = ResolvedPlan.model_state_bytes(memo, r)
            static = ms["params"] + ms["grads"] + ms["optimizer"]
            made = gdt * (prm.dense / zero_size * (zero_size > 1) + prm.expert / edp * (edp > 1)) if lazy else 0.0
            big = prm.biggest
            shard = prm.dense / (zero_size if zero >= 1 else 1) + prm.expert / (edp if zero >= 1 else 1)
            whole = prm.dense * (zero_size > 1) + prm.expert * (edp > 1)  # what ZeRO-3 gathers
            out.append(RankMemory(model_states=static, early_model_states=static - min(made, ms["grads"]),
                                  buffers=2 * big * vrp.param_gather_bytes + 2 * big * gdt if preallocated else 0.0,
                                  shard_params=shard, main_grads=shard * vrp.master_grad_bytes,
                                  gathered_at_backward=whole * vrp.param_gather_bytes
                                  if zero == 3 and not raf and one_chunk else 0.0,
                                  held_after_backward=whole * (vrp.param_gather_bytes + gdt) if defer else 0.0))
        self.b.memory[key] = out
        return out

    def state(self, state: tuple) -> list[RankState]:
        """Per pipeline rank: its costs under `state` (see `RankState`)."""
        p = self.p
        key = (self.comm_key, p.tp, p.pp, p.vpp, p.ep, p.etp, p.dtype, p.stages, self.v_shaped, p.grad_fp32, p.master_grads,
               p.grad_overlap, p.grad_bucket_view, p.grad_allreduce, p.param_overlap, state)
        out = self.b.states.get(key)
        if out is not None:
            return out
        zero, zero_impl, dp_shard, offload, raf = state
        memory = self.memory(state)
        vrp = self._variant(state)
        dt, gdt, pg = self.dt, self.gdt, vrp.param_gather_bytes
        comm, cm = self.comm, self.cm
        verb = "allreduce" if zero == 0 or (zero == 1 and p.grad_allreduce) else "reducescatter"

        def zc(verb: str, rank: int, nbytes: float, axis: str = "zero") -> float:
            return comm.coll(verb, rank, axis, nbytes, p.ep, dp_shard, p.etp)

        out = []
        for r, prm in enumerate(self.params()):
            rank = comm.rank_of_stage[r]
            shard = memory[r].shard_params
            if offload != "none":
                opt = comm.copy(rank, "d2h", shard * gdt) + comm.cpu(rank, shard) + comm.copy(rank, "h2d", shard * dt)
            else:
                opt = cm.time("optimizer", shard * ADAM_FLOPS_PER_PARAM, shard * adam_bytes_per_param(vrp))
            # the last unit's gradients are reduced after the last backward, before the optimizer
            red = zc(verb, rank, prm.last_dense * gdt)
            gather = 0.0
            if zero in (1, 2) and not p.param_overlap:  # parameters all-gathered after the step
                gather = zc("allgather", rank, prm.dense * pg)
                if prm.expert > 0:
                    gather = max(gather, zc("allgather", rank, prm.expert * pg, "edp"))
            # The ZeRO axis' stream runs its collectives one after another. Buckets split a
            # reduction in parts, and an idle-network collective costs at least as much in parts
            # as whole (affine in bytes per algorithm, the fastest taken: concave, so subadditive).
            total = zc(verb, rank, prm.dense * gdt)
            if not p.grad_overlap and zero in (0, 1):  # every bucket waits for the last backward
                red = max(red, total)
            if zero == 3:
                z3 = vrp.plan.zero3  # each unit's calls as the flavour issues them (the lowering's)
                # a unit gathered for its forward and again for its backward, unless kept between
                # (reshard_after_forward=0); under a pipeline FSDP2 keeps it over the step's
                # micro-batches and reduce-scatters once, so at least once a step
                gathers = 1 + bool(raf)
                z = sum(gathers * sum(zc("allgather", rank, e * pg) for e in z3.gather_calls(t))
                        + sum(zc(verb, rank, e * gdt) for e in z3.reduce_calls(t)) for ch in prm.tensors for t in ch)
                fixed, per_mb = (z, 0.0) if p.pp > 1 and z3.pipeline_defers_reduction else (0.0, z)
            elif zero == 2:
                z = sum(zc(verb, rank, sum(ch) * gdt) for ch in prm.chunks)
                fixed, per_mb = zc("allgather", rank, prm.dense * pg), z
            elif zero == 1:
                fixed, per_mb = total + zc("allgather", rank, prm.dense * pg), 0.0
            else:
                fixed, per_mb = total, 0.0
            out.append(RankState(memory=memory[r], last_reduction=red, after_reduction=opt + gather,
                                 stream_fixed=fixed, stream_per_micro_batch=per_mb, grad_traffic=total))
        self.b.states[key] = out
        return out
