"""Lowering: (model, cluster, plan) -> Program, the per-rank instruction lists both interpreters run.

`lower()` has a `simexec.program.lowering.rank.RankLowering` walk each rank's pipeline schedule
(simexec.program.schedules) and, for every action, emit the layer's sub-blocks
(`simexec.program.layer_order`) with the communication each plan dimension adds, in this order of
concerns (a module of `simexec.program.lowering` each):

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

from simexec.program.blocks import Anatomy
from simexec.program.dispatch_key import dispatch_key
from simexec.program.instructions import Program
from simexec.program.lowering.rank import RankLowering
from simexec.program.schedules import pipeline_order
from simexec.specs.plan import ResolvedPlan


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
    ranks = {r: RankLowering(rp, anatomy, r, order[rp.mesh.coords(r)["pp"]]).build() for r in sorted(reps)}
    meta = {
        "model": rp.model.name, "cluster": rp.cluster.name, "plan": rp.plan.to_string(),
        "seq_len": rp.seq_len, "world": rp.world, "micro_batches": rp.micro_batches,
        "symmetric": symmetric, "dispatch": dispatch_key(rp.model),
    }
    windowed = windowed_layers(rp)
    if windowed:
        meta["windowed_layers"] = windowed
    return Program(meta=meta, ranks=ranks, represents=reps, resolved=rp)
