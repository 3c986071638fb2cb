"""The gradient concern of a rank's lowering: what happens to a unit's gradients once its backward
(or weight pass) has made them. ZeRO-3 reduce-scatters them per unit (`Zero3Lowering`); otherwise
they join buckets, reduced as each fills (or after the backward, `grad_overlap=0`), ZeRO-2's in
buffers that hold them meanwhile; and a tied embedding's two copies are summed across the pipeline."""
from __future__ import annotations

from typing import NamedTuple, Optional

from simexec.program.block import Block
from simexec.program.instructions import Instr
from simexec.program.lowering.zero import Zero3Lowering


class ReducedBucket(NamedTuple):
    """A gradient bucket's reduction (`bwd.grads<k>`): the step's parameter all-gather of the
    bucket follows it where `axis` is set (the last micro-batch's reductions)."""

    name: str
    axis: str  # "" for a bucket of an earlier micro-batch (ZeRO-2): numbered, no gather follows
    units: tuple[int, ...]
    nbytes: float


def gradient_copy_block(nbytes: float) -> Block:
    """A device copy of `nbytes` of gradients, in the backward: read once, written once."""
    return Block("elementwise", 0.0, 2.0 * nbytes, 0.0, bwd=2.0 * nbytes)


class GradientLowering(Zero3Lowering):
    """Gradient buckets and their reductions for `RankLowering`."""

    def init_gradients(self) -> None:
        rp, p = self.rp, self.p
        # tied embeddings over a pipeline: the two stages' gradients summed (`bwd.tied`) after the
        # data-parallel all-reduce (Megatron-LM), or under ZeRO-1 before the reduce-scatter, which
        # shards each stage's copy in its own layout (DeepSpeed's pipeline engine: ReduceTiedGrads,
        # then ReduceGrads); `tied_unit` is the unit that holds this stage's copy
        self.tied_unit: Optional[int] = None
        if rp.tied_copy and self.pp_rank in (0, rp.head_pp_rank):
            self.tied_unit = -1 if self.pp_rank == 0 else self.head_unit
        self.tied_first = self.tied_unit is not None and p.zero == 1
        self.tied: Optional[str] = None  # the emitted `bwd.tied` ("" where its group is one rank)
        self.bucket_bytes = p.bucket_mb * 1e6
        self.pools: dict[str, list[tuple[int, float]]] = {}  # the open bucket per axis: (unit, bytes)
        self.pool_after: dict[str, str] = {}  # the instruction that made the open bucket's last gradients
        self.sealed: list[tuple[str, list[tuple[int, float]]]] = []  # full buckets, not yet reduced: (axis, pool)
        self.buckets: list[ReducedBucket] = []
        self.grad_colls: list[str] = []  # every gradient reduction: the step waits for them
        self.zero2_alloc: dict[str, Instr] = {}  # ZeRO-2: the open bucket buffer's allocation, per axis
        self.zero2_waited = 0  # ZeRO-2: grad_colls already waited at the end of a micro-batch's backward

    def grads_ready(self, unit: int, mb: int, c: int) -> None:
        """Unit's gradients for micro-batch mb are complete: reduce them as the plan says."""
        dense, expert = self.unit_params(unit)
        last = mb == self.micro_batches - 1
        after = self.last_compute()
        if self.p.zero == 3:
            if self.zero3_sharded:
                self.z3_grads_ready(unit, mb, c, after)
            else:
                self.bucket_if(last, unit, dense, expert, after)
            return
        self.bucket_if(last or self.p.zero == 2, unit, dense, expert, after, final=last)

    def reduce_micro_batch(self, mb: int) -> None:
        """After a micro-batch's weight gradients: the reductions the plan makes per micro-batch."""
        self.z3_reduce_pending()
        if self.p.grad_overlap or self.p.zero == 2:
            self.flush_all(final=mb == self.micro_batches - 1, hold_tied=True)
        if self.p.zero == 2:
            # ZeRO-2 (DeepSpeed's stage 2 epilogue): a micro-batch's backward ends with its gradient
            # reductions complete, so its full gradients are gone before the next micro-batch computes
            # (the executor waits the same dependency)
            self.wait.extend(n for n in self.grad_colls[self.zero2_waited:] if n)
            self.zero2_waited = len(self.grad_colls)

    def bucket_group(self, axis: str) -> tuple[int, ...]:
        return self.groups.zero if axis == self.groups.zero_axis else self.groups.edp

    def bucket_if(self, now: bool, unit: int, dense: float, expert: float, after: str, final: bool = True) -> None:
        """Add the unit's gradients to the open bucket of each axis; reduce a bucket once it is full."""
        if not now:
            return
        for axis, group, n in ((self.groups.zero_axis, self.groups.zero, dense), ("edp", self.groups.edp, expert)):
            if len(group) <= 1 or n <= 0:
                continue
            pool = self.pools.setdefault(axis, [])
            if self.p.zero == 2:  # the bucket's buffer holds full gradients until it is reduce-scattered
                self.zero2_buffer(axis, pool, unit, n * self.grad_dt)
            pool.append((unit, n * self.grad_dt))
            self.pool_after[axis] = after
            if sum(b for _, b in pool) >= self.bucket_bytes:
                if self.p.grad_overlap and not self.waits_for_tied(axis, pool):
                    self.flush(axis, group, final)
                else:  # the bucket is full, but its reduction waits for the end of the backward
                    self.sealed.append((axis, pool))
                    self.pools[axis] = []

    def zero2_buffer(self, axis: str, pool: list, unit: int, nbytes: float) -> None:
        """ZeRO-2's bucket buffer (DeepSpeed's reduce bucket): made with the bucket's first
        gradients, it takes every gradient of the bucket as it comes, so from then on it holds the
        bucket's whole size; one allocation that grows as units join the bucket. It is made as the
        unit's first weight gradient lands: after that backward instruction, before what it read
        (the head's saved activations and logits) is let go."""
        if not pool or axis not in self.zero2_alloc:
            self.zero2_alloc[axis] = self.memory("alloc", "grads", nbytes, f"grads.{axis}.L{unit}.b{len(self.buckets)}",
                                                 at=self.first_weight_gradient(unit))
        else:
            self.zero2_alloc[axis].bytes += nbytes

    def first_weight_gradient(self, unit: int) -> int:
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
            return hold_tied and self.waits_for_tied(axis, pool)

        kept = [(axis, pool) for axis, pool in self.sealed if held(axis, pool)]
        for axis, pool in self.sealed:
            if not held(axis, pool):
                self.flush(axis, self.bucket_group(axis), final, pool, after)
        self.sealed = kept
        for axis in list(self.pools):
            if held(axis, self.pools[axis]):
                self.sealed.append((axis, self.pools[axis]))
                self.pools[axis] = []
            else:
                self.flush(axis, self.bucket_group(axis), final, after=after)

    def waits_for_tied(self, axis: str, pool: list) -> bool:
        """Whether a bucket holds this stage's copy of a tied embedding under ZeRO-1: its reduction
        waits for the tied sum, so it goes after this stage's last sends, which the other stage needs
        before it can join the sum."""
        return self.tied_first and axis == self.groups.zero_axis and any(u == self.tied_unit for u, _ in pool)

    def tied_reduce(self, deps: tuple) -> Optional[str]:
        """`bwd.tied`: sum the tied embedding's gradient over the first and last stages."""
        self.tied = self.coll("bwd.tied", "allreduce", "embed", self.groups.embed,
                              self.an.embed_params() * self.grad_dt, deps, phase="bwd", block="tied", wait=False) or ""
        return self.tied or None

    def flush(self, axis: str, group: tuple[int, ...], final: bool, pool: Optional[list] = None,
              after: Optional[str] = None) -> None:
        """Reduce a bucket (`pool`, or the open one of `axis`): all-reduce, or reduce-scatter under
        ZeRO-1/2; a final one (the last micro-batch's) is then gathered back by the step."""
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
            after = self.compute("bwd", f"bucket_in{k}", -1, -1, 0, gradient_copy_block(nbytes))
        if final and self.tied is None and self.waits_for_tied(axis, pool):
            after = self.tied_reduce((after,))
        self.coll(name, verb, axis, group, nbytes, (after,), phase="bwd", block=f"grads{k}", items=units, wait=False)
        self.grad_colls.append(name)
        if self.p.zero == 2:
            self.memory("free", "grads", nbytes, f"grads.{axis}.b{k}", stream=f"comm.{axis}", deps=(name,))
        if final:
            self.buckets.append(ReducedBucket(name, axis, units, nbytes))
            if self.groups.rep and axis == self.groups.zero_axis:
                r = self.coll(f"bwd.grads_rep{k}", "allreduce", "dp_replicate", self.groups.rep, nbytes / len(group),
                              (name,), phase="bwd", block=f"grads_rep{k}", items=units, wait=False)
                self.grad_colls.append(r)
        else:
            self.buckets.append(ReducedBucket(name, "", units, 0.0))
        if own:
            self.pools[axis] = []
