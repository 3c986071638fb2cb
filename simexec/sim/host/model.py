"""CPU ranks sharing one host's cores: what an instruction costs a core, and how the OS shares the cores.

On the `local` cluster every rank is a Python process running PyTorch on the CPU with one thread,
and `node.cpu_cores` cores serve them all (4 ranks on 2 cores on the machine this was written on).
Pretending each rank owns a device gets such a machine badly wrong: compute of N busy ranks runs
about N/C slower, a rank waiting in a collective gives its core away, and a rank whose collective
has completed must wait for a core before it runs again. This module models that, and the machine
of such a cluster (`simexec.sim.machine.SharedCoresMachine`, for a cluster whose `costs.cores_shared`
is set: a calibrated `local` profile; the preset's placeholders leave it off) prices every compute,
copy and host-optimizer instruction with it. The operator counts it prices are
`simexec.sim.host.operators`, the parameter tensors `simexec.sim.host.tensors`.

**What an instruction costs a core** (`HostCosts.cpu_seconds`), in CPU-seconds on one core:

    instr_overhead_s                       the interpreter's Python around the instruction
  + ops x device.launch_overhead_s         eager PyTorch dispatch, per aten op the block runs
  + bwd_overhead_s (backward only)         autograd engine set-up of `torch.autograd.backward`
  + flops / (peak[dtype] x eff(op, flops)) GEMMs and attention (the saturating efficiency curve of
                                           `simexec.sim.compute`)
  + bytes / (memory_bw x memory_eff)       memory traffic, each byte weighted by the block's
    x elementwise_cost[phase.block]        measured element-wise cost (on a CPU core GELU-tanh,
                                           softmax and normalisation cost several times an add's)

`ops` is how many aten operators the executor's block dispatches: counted (`DISPATCH`, refreshed
by `simexec.calibrate.microbench.count_dispatch`, checked against the executor by the tests), and for the
optimizer torch's fused Adam (`simexec.exec.nn.optim`): two operators for the whole step, plus two per
tensor under 16-bit types (the gradient's fp32 copy, the rounded copy back into the parameter), the
tensors being the rank's parameters (ZeRO 0), its flat buckets (ZeRO 1-2) or its gathered units
(ZeRO 3). On a CPU core the fused kernel also sets up a pass per tensor, priced as an operator
(`adam_kernel_passes`), and its bytes cost an element-wise factor of their own (`optim.optim`:
square roots and divisions), fitted to the one-rank step's optimizer.

A collective or message costs the rank's own thread too, besides the transfer (`issue_seconds`):
the interpreter's Python around it, `instr_overhead_s` (a collective's twice: at its call and
once it is waited for), a collective's call into torch.distributed (`collective_issue_s`, measured
by the micro-benchmarks' `issue`: about 60 µs of an idle core on the 2-core VM, where an operator
takes 5), and the operators that prepare its tensors and put the result in place
(`simexec.sim.host.issue`). A collective of parameter units makes passes over their tensors one tensor
at a time (`tensor_passes`), each a tensor view or copy and the Python around it, about two
operators' dispatch a tensor (`ISSUE_OPS_PER_TENSOR`): a gradient bucket puts each gradient into
its flat buffer before the call and, all-reduced, views each result out once waited; a ZeRO-1/2
bucket is reduce-scattered and its parameters gathered in place, whole (ZeRO-2's hooks copy each
gradient into its bucket as autograd makes it); ZeRO-3 flattens a unit's gradients before their
reduce-scatter and views a gathered unit into its parameters. An activation collective of tp, sp,
cp or ep dispatches a handful of operators on each side (`activation_ops`: a copy or a
concatenation before, slices and views after), and a few more for each partial gradient of a
replicated norm or router it sums (`partial_gradients`). What the thread does before
the call joins the compute instruction before the collective in program order, what it does once
waited the compute instruction after it.
`scripts/probe_host.py issue-cost` times both sides per kind of collective in real steps, beside the model.

**How the cores are shared** is `simexec.sim.host.cores`: processor sharing with a wait for a woken
thread (`Cores`, the default), or whole slices in turn (`SlicedCores`).
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, Optional

from simexec.specs.cluster import ClusterSpec
from simexec.program.instructions import Instr, Program
from simexec.sim.host.cores import Cores
from simexec.sim.host.launches import launch_clock
from simexec.sim.host.issue import ISSUE_OPS_PER_TENSOR, activation_ops, is_activation_collective, partial_gradients, tensor_passes
from simexec.program.adam import ADAM_FLOPS_PER_PARAM, ADAM_PIECE
from simexec.program.dispatch_key import dispatch_key
from simexec.program.instructions import exchanges_counts
from simexec.sim.host.lowered_from import expert_parallel_size, model_of, plan_of
from simexec.sim.host.operators import (CLIP_SCALE_OPS, COLUMN_BLOCKS, DEFAULT_TABLE, GRAD_NORM_OPS, HOST_SYNC_BLOCKS,
                                        MAIN_GRAD_OPS, OVERFLOW_CHECK_OPS, UNSCALE_OPS, WINDOW_OPS, adam_kernel_passes,
                                        adam_ops, cost_family, dispatch_table, ops_of, split_backward_table,
                                        weight_pass_calls)
from simexec.sim.host.tensors import grad_tensors, optimizer_tensors, unit_tensor_count

FLOP_BOUND = ("gemm", "attention")
# The share of a collective step's bytes that gloo's TCP event loop copies: every read (a pair's
# `handleReadWrite` reads on the loop thread), the sends being written by the calling thread when the
# receiver was ready first (`Pair::send` -> `sendUnboundBuffer`). Each member sends and receives one
# chunk a step, so half of the step's bytes.
LOOP_SHARE_OF_BYTES = 0.5


def forwards_without_grad(names: Iterable[str]) -> frozenset:
    """Of a rank's instruction names, the forwards the executor runs without autograd (no graph
    recorded, nothing saved): those a `recompute.*` instruction repeats later."""
    return frozenset("fwd." + n[len("recompute."):] for n in names if n.startswith("recompute."))


def shares_cores(cluster: ClusterSpec) -> bool:
    """Whether the cluster's ranks are CPU processes sharing the host's cores (simexec.sim.host.model)."""
    return bool(getattr(cluster.costs, "cores_shared", False))


def dispatch_clock(cluster: ClusterSpec, program: Program) -> Optional[tuple[list[float], list[bool]]]:
    """An accelerator driven by an eager host (`costs.host_dispatch_s` > 0):
    per instruction of the program (flattened in rank order), the host thread's seconds to issue it
    (`instr_overhead_s` + operators x `host_dispatch_s` (+ `bwd_overhead_s`)) and whether it waits
    for the device first. The device runs an instruction no earlier than the host has issued it,
    and ends it no earlier than the host has issued its last operator; the host runs ahead
    otherwise, so small kernels leave the device idle (launch-bound) and large ones hide the host.
    Without `host_dispatch_s`, a GPU rank's host issues its stack's kernels
    (`simexec.sim.host.launches.launch_clock`, `StackSpec.host`); None where the host keeps ahead."""
    if getattr(cluster.costs, "host_dispatch_s", 0.0) <= 0:
        return None if cluster.device.name == "cpu" else launch_clock(program)
    hc = HostCosts(cluster, program)
    per_op, c = cluster.costs.host_dispatch_s, cluster.costs
    issue, sync = [], []
    for rank in sorted(program.ranks):
        for ins in program.ranks[rank]:
            if ins.kind != "compute" or ins.stream == "host" or ins.op == "cpu_optimizer":
                issue.append(0.0)
                sync.append(False)
                continue
            t = c.instr_overhead_s + hc.ops(ins) * per_op + c.bwd_overhead_s * hc.engine_calls(ins)
            issue.append(t)
            sync.append(ins.block in HOST_SYNC_BLOCKS and ins.phase != "bwd")
    return issue, sync


# --- what an instruction costs ------------------------------------------------------------------------
class HostCosts:
    """CPU-seconds of an instruction on one core of the host, and the cores' scheduler for a run."""

    def __init__(self, cluster: ClusterSpec, program: Program, dtype: Optional[str] = None):
        c, d, node = cluster.costs, cluster.device, cluster.node
        self.cluster = cluster
        self.program = program
        plan = plan_of(program)
        dtype = dtype or (plan.dtype if plan is not None else "bf16")
        self.dtype = dtype
        self.peak = d.peak_flops.get(dtype) or d.peak_flops.get("fp32") or max(d.peak_flops.values())
        self.eff = {"gemm": (c.gemm_eff, c.gemm_half_flops), "attention": (c.attention_eff, c.attention_half_flops)}
        self.mem_bw = d.memory_bw * c.memory_eff
        self.copy_bw = node.host_link_bw * c.host_link_eff
        self.op_s = d.launch_overhead_s
        self.instr_s = getattr(c, "instr_overhead_s", 0.0)
        self.issue_s = getattr(c, "collective_issue_s", 0.0)
        self.bwd_s = getattr(c, "bwd_overhead_s", 0.0)
        self.cores = node.cpu_cores
        self.slice_s = getattr(c, "sched_slice_s", 0.0)
        self.background = getattr(c, "background_load", 0.0)
        self.contention = c.compute_contention  # slowdown of a thread when every core is busy
        self.model = model_of(program)
        key = program.meta.get("dispatch") or (dispatch_key(self.model) if self.model is not None else DEFAULT_TABLE)
        self.table = dispatch_table(key, max(1, plan.ep), plan.cp, plan.cp_impl, dtype, plan.sp,
                                    plan.flash_attention) if plan is not None else dispatch_table(key, dtype=dtype)
        split = plan is not None and plan.pipeline_schedule.splits_backward
        if split:
            self.table = split_backward_table(self.table, key.split("/")[0], dtype=dtype)
        elif plan is not None and plan.tp_overlap:
            self.table = split_backward_table(self.table, key.split("/")[0], COLUMN_BLOCKS, sp=plan.sp, dtype=dtype)
        self.master_grads = bool(plan.master_grads) if plan is not None else False
        # main gradients: which phase makes the weight gradients, and each block's count of them
        self.main_grads = plan is not None and bool(plan.grad_fp32) and dtype != "fp32"
        self.grads_phase = "wgrad" if split else "bwd"
        self.wgrad_blocks = COLUMN_BLOCKS if plan is not None and plan.tp_overlap else ()
        self._grad_tensors: dict[str, int] = {}
        self._grad_args = (bool(plan.sp), plan.tp, max(1, plan.ep)) if plan is not None else (False, 1, 1)
        # layers whose attention masks a sliding window's band (`simexec.program.lower.windowed_layers`)
        self.windowed = frozenset(program.meta.get("windowed_layers", ()))
        self.window_ops = 0
        if plan is not None:
            self.window_ops = WINDOW_OPS["cp" if plan.cp > 1 else "fused" if plan.flash_attention else "unfused"]
        self.zero = plan.zero if plan is not None else 0
        self.zero3 = plan.zero3 if plan is not None else None
        self.sp = bool(plan.sp) if plan is not None else False
        self.step_ops = 0  # what loss scaling and clipping add to the step
        if plan is not None:
            self.step_ops = (OVERFLOW_CHECK_OPS if plan.loss_scale > 0 else 0) + (CLIP_SCALE_OPS if plan.clip_grad > 0 else 0)
        self.elementwise = dict(getattr(c, "elementwise_cost", None) or {})
        self.family = cost_family(self.model) if self.model is not None else ""
        self._tensors: dict[int, int] = {}
        self.nograd = getattr(c, "nograd_fwd_ratio", 1.0)
        self._nograd_names: dict[int, frozenset] = {}

    @classmethod
    def transfers_only(cls, cluster: ClusterSpec) -> "HostCosts":
        """Just the communication half (`transfer`), for pricing single collectives without a program."""
        hc = cls.__new__(cls)
        hc.cluster, hc.op_s = cluster, cluster.device.launch_overhead_s
        hc.issue_s = getattr(cluster.costs, "collective_issue_s", 0.0)
        return hc

    def efficiency(self, op: str, flops: float) -> float:
        max_eff, half = self.eff.get(op, self.eff["gemm"])
        return max_eff * flops / (flops + half)

    def roofline(self, op: str, flops: float, nbytes: float) -> float:
        """Seconds of the arithmetic and memory traffic on one core (the two add: small CPU kernels
        do not overlap them)."""
        t = nbytes / self.mem_bw if nbytes > 0 else 0.0
        if op in FLOP_BOUND and flops > 0:
            t += flops / (self.peak * self.efficiency(op, flops))
        return t

    def tensors(self, rank: int) -> int:
        n = self._tensors.get(rank)
        if n is None:
            n = self._tensors[rank] = optimizer_tensors(self.program, rank, self.model, expert_parallel_size(self.program))
        return n

    def _adam(self, ins: Instr) -> Optional[tuple[bool, float, bool]]:
        """For an Adam step (on the device or the host's): (run by the host, its elements, the fp32
        gradient copy); None for any other instruction."""
        if not (ins.op in ("optimizer", "cpu_optimizer") or ins.block in ("optim", "cpu_optim")):
            return None
        host = ins.op == "cpu_optimizer" or ins.block == "cpu_optim"  # its FLOPs are its elements
        return host, ins.flops if host else ins.flops / ADAM_FLOPS_PER_PARAM, self.master_grads and not host

    def ops(self, ins: Instr) -> int:
        """Aten operators of one instruction (compute, host optimizer or offload copy)."""
        if ins.kind == "copy":
            return self.tensors(ins.rank)  # one copy_ per tensor
        adam = self._adam(ins)
        if adam is not None:
            host, elements, master = adam
            piece = ADAM_PIECE["cpu" if host or self.cluster.device.name == "cpu" else "accelerator"]
            return adam_ops(self.tensors(ins.rank), self.dtype, elements, master, piece) + self.step_ops
        if ins.block in ("unscale", "grad_norm"):
            return UNSCALE_OPS if ins.block == "unscale" else GRAD_NORM_OPS
        n = ops_of(ins, self.table)
        if ins.block == "attn" and ins.phase != "bwd" and ins.layer in self.windowed:
            n += self.window_ops
        if self.main_grads and ins.phase == ("wgrad" if ins.block in self.wgrad_blocks else self.grads_phase):
            k = self._grad_tensors.get(ins.block)
            if k is None:
                k = self._grad_tensors[ins.block] = grad_tensors(ins.block, self.model, *self._grad_args)
            n += MAIN_GRAD_OPS * k
        return n

    def engine_calls(self, ins: Instr) -> int:
        """Calls into the autograd engine: one per backward instruction, one per batch of a weight pass."""
        if ins.phase == "bwd":
            return 1
        return weight_pass_calls(ins.block, self.model, self.sp) if ins.phase == "wgrad" else 0

    def kernel_passes(self, ins: Instr) -> int:
        """Per-tensor passes of an Adam step run on a CPU core (`adam_kernel_passes`), priced as
        operators; none for other instructions, nor for an accelerator's Adam (one fused launch per
        chunk of tensors)."""
        adam = self._adam(ins)
        if adam is None or not (adam[0] or self.cluster.device.name == "cpu"):
            return 0
        _, elements, master = adam
        return adam_kernel_passes(self.tensors(ins.rank), self.dtype, elements, master)

    def cpu_seconds(self, ins: Instr) -> float:
        """CPU-seconds of a compute, copy or host-optimizer instruction on one idle core."""
        t = self.instr_s + (self.ops(ins) + self.kernel_passes(ins)) * self.op_s
        if ins.kind == "copy":
            return t + (ins.bytes / self.copy_bw if ins.bytes > 0 else 0.0)
        t += self.bwd_s * self.engine_calls(ins)
        op = "optimizer" if ins.op == "cpu_optimizer" else ins.op
        t += self.roofline(op, ins.flops, ins.bytes * self.elementwise_factor(ins))
        if self.nograd != 1.0 and ins.phase == "fwd" and ins.name in self.without_grad(ins.rank):
            t *= self.nograd
        return t

    def issue_seconds(self, ins: Instr) -> float:
        """CPU-seconds the rank's own thread spends on a collective or message, apart from the
        transfer: both sides of `issue_split`."""
        return sum(self.issue_split(ins))

    def issue_split(self, ins: Instr) -> tuple[float, float]:
        """(before the call, once waited): CPU-seconds of the rank's thread around a collective or
        message. Before: the interpreter's Python (`instr_overhead_s`), a collective's call
        (`collective_issue_s`: torch.distributed's Python and the backend's work queued, which
        `transfer` takes out of the call's latency) and the operators that prepare its tensors:
        for a collective that carries parameter units the passes over their tensors that
        `tensor_passes` counts, at `ISSUE_OPS_PER_TENSOR` operators a tensor; for an activation
        collective those of `activation_ops`. Once waited, a collective's Python again (the wait, its
        result recorded: `scripts/probe_host.py issue-cost`'s `finish`) and the operators that put the result in
        place."""
        call = self.issue_s if ins.kind == "collective" else 0.0
        if is_activation_collective(ins):
            partial = partial_gradients(self.model, ins, self.sp)
            before, after = activation_ops(ins, partial)
            return self.instr_s + call + before * self.op_s, self.instr_s + after * self.op_s
        before, after = tensor_passes(ins, self.zero, self.zero3)
        per_pass = 0.0
        if (before or after) and self.model is not None:
            part = "expert" if ins.axis == "edp" else "dense"
            ep = expert_parallel_size(self.program) if part == "expert" else 1
            tensors = sum(unit_tensor_count(self.model, u, ep, part) for u in ins.items)
            per_pass = ISSUE_OPS_PER_TENSOR * tensors * self.op_s
        waited = self.instr_s if ins.kind == "collective" else 0.0
        return self.instr_s + call + before * per_pass, waited + after * per_pass

    def without_grad(self, rank: int) -> frozenset:
        """The forward instructions of this rank that run without autograd: those a `recompute.*`
        instruction repeats later (full recompute's layers, selective recompute's attention)."""
        names = self._nograd_names.get(rank)
        if names is None:
            names = self._nograd_names[rank] = forwards_without_grad(i.name for i in self.program.ranks.get(rank, ()))
        return names

    def cost_block(self, ins: Instr) -> str:
        """The block whose measured element-wise cost prices `ins`: a norm split out under sp keeps
        that of the block it opens without sp (the block fits measure the norm inside it)."""
        if ins.block == "cpu_optim":
            return "optim"  # the same fused Adam kernel on a core of the same host
        if ins.block == "norm1":
            return "qkv"
        if ins.block == "norm2":
            moe = self.model is not None and self.model.is_moe_layer(ins.layer)
            return "router" if moe else "fc1"
        return "head" if ins.block == "norm" else ins.block

    def elementwise_factor(self, ins: Instr) -> float:
        """Cost of a byte of this instruction's element-wise traffic relative to a streaming add."""
        if not self.elementwise or ins.kind != "compute":
            return 1.0
        key = f"{'fwd' if ins.phase == 'recompute' else ins.phase}.{self.cost_block(ins)}"
        own = self.elementwise.get(f"{self.family}/{key}")  # measured on this model's family
        return own if own is not None else self.elementwise.get(key, 1.0)

    # --- communication over loopback: steps whose members each need a core -----------------------
    @staticmethod
    def comm_steps(ins: Instr) -> tuple[int, float]:
        """(steps, bytes each member moves per step) of a collective or message with gloo's algorithms:
        ring all-reduce 2(n-1) steps of S/n; all-gather n-1 of S/n; all-to-all one step of (n-1)S/n
        (gloo posts every send and receive at once, then waits for them all); reduce-scatter as an
        all-reduce (gloo reduces the whole tensor, then keeps its slice); broadcast a tree of
        ceil(log2 n) steps of S; send/recv one step of S."""
        S = float(ins.bytes)
        if ins.kind in ("send", "recv"):
            return 1, S
        n = max(1, len(ins.group))
        if n <= 1:
            return 0, 0.0
        verb = ins.collective
        if verb in ("allreduce", "reducescatter"):
            return 2 * (n - 1), S / n
        if verb == "alltoall":
            return 1, (n - 1) * S / n
        if verb == "allgather":
            return n - 1, S / n
        if verb == "broadcast":
            return max(1, math.ceil(math.log2(n))), S
        return n - 1, S / n

    def comm_seconds(self, steps: int, chunk: float) -> tuple[float, float, float]:
        """(call latency, CPU per step per member, latency per step) on an idle host. A step costs each
        member CPU: `comm_cpu_s` for handing the message between gloo's threads and the kernel (each
        hand-off a thread wake-up and syscalls, dear on a VM: `scripts/probe_host.py comm-cpu` measures it),
        and its bytes at `intra_bw` (x `intra_bw_eff`) bytes per second of a core, since loopback TCP
        copies them through the kernel. Only its latency is free."""
        c, node = self.cluster.costs, self.cluster.node
        return c.collective_latency_s, (c.comm_cpu_s or self.op_s) + self._copy_seconds(chunk), node.intra_latency_s

    def _copy_seconds(self, chunk: float) -> float:
        """A core's time to copy a step's bytes through loopback TCP (`intra_bw` x `intra_bw_eff`)."""
        return chunk / (self.cluster.node.intra_bw * self.cluster.costs.intra_bw_eff) if chunk > 0 else 0.0

    def loop_seconds(self, chunk: float) -> float:
        """The part of a step's burst that gloo's event loop copies, where the loops run at `SCHED_IDLE`
        (`costs.gloo_loops_idle`); else 0 (the loop's work is the burst's like the rest)."""
        return LOOP_SHARE_OF_BYTES * self._copy_seconds(chunk) if self.cluster.costs.gloo_loops_idle else 0.0

    def transfer(self, env, cores: "Cores", ins: Instr, ranks, done: Callable[[], None]) -> None:
        """Run a collective / message on the host: the call's latency, then per step every member's
        communication thread needs `burst` of CPU (waiting for a core if none is free) and the data
        `wire` seconds on the loopback, two steps on the wire at most (gloo's rings send the next
        piece while the previous two are in flight: `gloo/allreduce.cc`, `gloo/allgather.cc`), so
        a step's latency overlaps the next one's CPU; `done()` when the last step is over. Where gloo's
        event loops run at `SCHED_IDLE`, the part of the burst they copy (`loop_seconds`) runs after
        the rest on the cores the other threads leave idle. A forward MoE dispatch is two all-to-alls,
        the token counts' first (`exchanges_counts`)."""
        steps, chunk = self.comm_steps(ins)
        call, burst, wire = self.comm_seconds(steps, chunk)
        if ins.kind == "collective":  # the calling thread's share of the call it has paid (`issue_split`)
            call = max(0.0, call - self.issue_s)
        loop = self.loop_seconds(chunk)
        calls = [(steps, call, burst - loop, wire, loop)]
        if exchanges_counts(ins):
            calls.insert(0, (steps, *self.comm_seconds(steps, 0.0), 0.0))
        members = tuple(ranks) or (ins.rank,)
        env.process(self._comm(env, cores, members, calls, done))

    @staticmethod
    def _comm(env, cores, members, calls, done):
        for steps, call, burst, wire, loop in calls:
            if call > 0:
                yield env.timeout(call)
            flying = []
            for _ in range(steps):
                if len(flying) >= 2:
                    yield flying.pop(0)
                yield env.all_of([cores.run((r, "comm"), burst) for r in members])
                if loop > 0:
                    yield env.all_of([cores.run((r, "loop"), loop) for r in members])
                if wire > 0:
                    flying.append(env.timeout(wire))
            for w in flying:
                yield w
        done()

    def cores_for(self, env) -> "Cores":
        weights = {r: len(v) for r, v in (self.program.represents or {}).items() if len(v) > 1}
        return Cores.of(env, self.cluster, weights)

