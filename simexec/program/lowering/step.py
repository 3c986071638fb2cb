"""The step's edges in a rank's lowering: the model states allocated before the first action, and
after the last the step's end: the remaining gradient reductions, the loss scale's unscaling and
the clipping's norm, the optimizer step (on the device, or on the host with its offload copies) and
ZeRO-1/2's parameter all-gathers (under `param_overlap`, the next step's forward's)."""
from __future__ import annotations

from simexec.program.adam import ADAM_BYTES_PER_PARAM, ADAM_FLOPS_PER_PARAM, adam_bytes_per_param
from simexec.program.block import Block
from simexec.program.instructions import Instr
from simexec.program.lowering.gradients import GradientLowering, gradient_copy_block

STEP_FLAG_BYTES = 4.0  # the all-reduces before the step: one fp32 overflow flag, or sum of squares


class StepLowering(GradientLowering):
    """The step's start and end for `RankLowering`."""

    def allocate_model_states(self) -> None:
        """Parameters, gradients, optimizer states and the workspace, held all step (less the
        gradient shards `lazy_grad_shards` makes later), and the flavour's ZeRO-3 buffers."""
        states = self.rp.model_state_bytes(self.pp_rank)
        if self.p.lazy_grad_shards and self.zero3_sharded:  # made by their first reduce-scatter instead
            states["grads"] = max(0.0, states["grads"] - self.reserve_lazy_shards())
        for cat in ("params", "grads", "optimizer"):
            self.memory("alloc", cat, states[cat], f"{cat}.static")
        self.memory("alloc", "workspace", self.rp.cluster.costs.workspace_bytes, "workspace")
        self.allocate_zero3_buffers()

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
        self.wait.extend(self.blocking_sends)  # p2p_overlap=0: the last sends block before the step
        self.blocking_sends = []
        self.flush_all()
        deps = list(self.grad_colls)
        if self.tied_unit is not None and self.tied is None:
            deps.append(self.tied_reduce(tuple(deps) + (self.last_compute(),)))
        if self.rp.bucket_copy_bytes:  # ... and the reduced ones copied back to `.grad` once all are done
            copied = sum(b.nbytes for b in self.buckets if b.axis)
            self.wait.extend(d for d in deps if d)
            deps = [self.compute("bwd", "bucket_out", -1, -1, 0, gradient_copy_block(copied))]
        params = self.rp.params_on_pp_rank(self.pp_rank)
        shard = params["dense"] / (self.zero_size if self.p.zero >= 1 else 1)
        shard += params["expert"] / (max(1, len(self.groups.edp)) if self.p.zero >= 1 else 1)
        deps = [d for d in deps if d]
        if self.p.loss_scale > 0:  # divide by the scale (read and write), flag overflows
            deps = [self.step_reduction("unscale", shard, 2.0 * self.grad_dt, deps)]
        clip_bytes = 2.0 * self.grad_dt if self.p.clip_grad > 0 else 0.0  # the scaling: each gradient read, written
        if clip_bytes:  # sum the squares (read)
            deps = [self.step_reduction("grad_norm", shard, self.grad_dt, deps)]
        if self.p.offload != "none":
            d2h = self.emit(Instr(self.rank, "copy.grads_d2h", "copy", "copy.d2h", "d2h", phase="optim",
                                  block="grads_d2h", bytes=shard * self.grad_dt,
                                  deps=tuple(deps) + (self.last_compute(),)))
            cpu = self.emit(Instr(self.rank, "host.optim", "compute", "host", "cpu_optimizer", phase="optim",
                                  block="cpu_optim", flops=shard, bytes=shard * (ADAM_BYTES_PER_PARAM + clip_bytes),
                                  deps=(d2h,)))
            opt = self.emit(Instr(self.rank, "copy.params_h2d", "copy", "copy.h2d", "h2d", phase="optim",
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
        self.memory("free", "grads", self.z3_lazy_shard_bytes, "grads.shards", deps=(read,))
        if self.p.zero in (1, 2):
            self.gather_params(opt)

    def gather_params(self, opt: str) -> None:
        """ZeRO-1/2: each final bucket's updated parameters all-gathered over its group, after the
        optimizer step (`opt`), or under `param_overlap` by the next step's forward."""
        dt = self.rp.param_gather_bytes
        phase, deps = ("fwd", ()) if self.p.param_overlap else ("optim", (opt,))
        for bucket in self.buckets:
            if not bucket.axis:
                continue
            k = bucket.name.removeprefix("bwd.grads")
            self.coll(f"{phase}.params{k}", "allgather", bucket.axis, self.bucket_group(bucket.axis),
                      bucket.nbytes / self.grad_dt * dt, deps, phase=phase, block=f"params{k}", items=bucket.units,
                      wait=False)
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
        # after the model states' allocations
        start = next((j for j, ins in enumerate(rest) if ins.kind != "memory"), len(rest))
        self.out[:] = rest[:start] + gathers + rest[start:]
