"""`simulate`: predict one training step of a plan without GPUs.

resolve -> lower -> discrete-event simulation of the program on the cluster's cost model ->
step time, throughput, MFU, peak memory per rank, where the time goes, and (on request) a
predicted trace in the shared schema. Deterministic: the same inputs give bit-identical results.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Optional, Union

from simexec.errors import PlanError
from simexec.specs.cluster import ClusterSpec, GiB, get_cluster
from simexec.specs.model import ModelSpec, get_model
from simexec.specs.plan import Plan, ResolvedPlan, load_plan, resolve
from simexec.specs.stack import StackSpec, get_stack
from simexec.program.instructions import Program
from simexec.sim.goodput import GoodputParams
from simexec.sim.memory import SHRINKS
from simexec.sim.slowdown import Slowdown, parse_slow
from simexec.trace.schema import Counter, Event, Trace

ProfileArg = Union[None, str, os.PathLike, dict]


@dataclass
class SimResult:
    """The prediction for one training step. Memory in bytes, times in seconds."""

    model: str
    cluster: str
    plan: str
    world: int
    symmetric: bool
    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float  # model FLOPs (no recompute) per GPU per second / 1e12
    mfu: float  # over the device's peak for the plan's dtype
    peak_memory_bytes: float  # the largest rank's
    peak_memory_bytes_per_rank: dict[int, float]  # every real rank (symmetric copies expanded)
    # the peak rank's tensors alone, without the runtime's memory and the allocator's waste: what
    # torch.cuda.max_memory_allocated reports for it (`simexec.sim.memory`)
    peak_tensor_bytes: float
    memory_breakdown_bytes: dict[str, float]  # at the peak of the largest rank
    memory_capacity_bytes: float
    fits: bool  # every rank's peak plus `memory_margin_bytes` within the capacity
    peak_tensor_bytes_per_rank: dict[int, float]  # the tensors alone (max_memory_allocated), every real rank
    breakdown_s: dict[str, float]  # on the slowest rank's compute stream; sums to the step time
    slowest_rank: int
    peak_rank: int
    instructions: int
    wall_s: float
    memory_margin_bytes: float = 0.0  # headroom the user keeps free (`--memory-margin`)
    # on GPU clusters: peak_memory_bytes is the caching allocator's reserved peak plus the runtime's
    # workspace (`memory_model` says which allocator); an offline planner's arena, for comparison
    memory_model: str = ""
    planned_peak_bytes: float = 0.0  # the largest rank's
    planned_peak_bytes_per_rank: dict[int, float] = field(default_factory=dict)
    # the slowest rank's busy compute by kernel (`simexec.sim.breakdown.kernel_split`): GEMMs at the
    # plan's dtype and in bf16, attention, memory-bound; and the FLOP/s each reaches while busy (/1e12)
    kernels_s: dict[str, float] = field(default_factory=dict)
    kernels_tflops: dict[str, float] = field(default_factory=dict)
    # on request (`simexec.sim.variation`, `simexec.sim.goodput`): the step with named stragglers,
    # the step over seeds of GPU-to-GPU variation, and the days to train a number of tokens
    stragglers: Optional[object] = None
    variation: Optional[object] = None
    # with `memory_plan`: the program reordered to lower the peak, simulated (`simexec.sim.reordered`)
    reordered: Optional[object] = None
    time_to_train: Optional[object] = None
    trace: Optional[Trace] = field(default=None, repr=False)

    def to_json(self) -> dict:
        """Everything but the trace, JSON-ready (rank keys as strings)."""
        out = {k: v for k, v in self.__dict__.items() if k != "trace"}
        for k in ("stragglers", "variation", "time_to_train", "reordered"):
            if out[k] is None:
                del out[k]
            else:
                out[k] = out[k].to_json()
        out["peak_memory_bytes_per_rank"] = {str(r): b for r, b in self.peak_memory_bytes_per_rank.items()}
        out["peak_tensor_bytes_per_rank"] = {str(r): b for r, b in self.peak_tensor_bytes_per_rank.items()}
        out["planned_peak_bytes_per_rank"] = {str(r): b for r, b in self.planned_peak_bytes_per_rank.items()}
        return out

    def format(self) -> str:
        """A short human-readable summary."""
        mode = "symmetric" if self.symmetric else "every rank"
        lines = [
            f"{self.model} on {self.cluster} ({self.world} ranks), plan {self.plan}",
            f"  step time       {self.step_time_s:.4g} s    {self.tokens_per_s:,.0f} tokens/s    "
            f"{self.tflops_per_gpu:.3g} TFLOP/s per GPU    MFU {100 * self.mfu:.1f}%",
        ]
        over = self.peak_memory_bytes + self.memory_margin_bytes - self.memory_capacity_bytes
        margin = f" with {byte_size(self.memory_margin_bytes)} kept free" if self.memory_margin_bytes else ""
        verdict = f"fits{margin}" if self.fits else f"DOES NOT FIT{margin}: {byte_size(over)} over"
        reserved = f" reserved ({self.memory_model})" if self.memory_model else ""
        lines.append(f"  peak memory     {byte_size(self.peak_memory_bytes)}{reserved} of {byte_size(self.memory_capacity_bytes)}"
                     f" (rank {self.peak_rank}): {verdict}")
        if self.peak_tensor_bytes < 0.995 * self.peak_memory_bytes:
            lines.append(f"    of which tensors {byte_size(self.peak_tensor_bytes)} (what max_memory_allocated reports)")
        if self.planned_peak_bytes:
            lines.append(f"    an offline memory plan needs {byte_size(self.planned_peak_bytes)} (greedy by size, same order)")
        if self.reordered is not None:
            lines.append(self.reordered.format(self))
        parts = [f"{k} {byte_size(v)}" for k, v in self.memory_breakdown_bytes.items() if v]
        lines.append("    " + ", ".join(parts))
        if self.memory_breakdown_bytes:
            largest, size = max(self.memory_breakdown_bytes.items(), key=lambda kv: kv[1])
            if size and largest in SHRINKS:
                lines.append(f"    largest: {largest} ({100 * size / self.peak_memory_bytes:.0f}%): {SHRINKS[largest]}")
        lines.append(f"  time on rank {self.slowest_rank}'s compute stream:")
        total = self.step_time_s or 1.0
        for k, v in sorted(self.breakdown_s.items(), key=lambda kv: -kv[1]):
            lines.append(f"    {k:<18} {v:10.4g} s  {100 * v / total:5.1f}%")
        if self.kernels_s:
            lines.append("    busy by kernel: " + ", ".join(
                f"{k} {v:.4g} s" + (f" ({self.kernels_tflops[k]:.0f} TFLOP/s)" if k in self.kernels_tflops else "")
                for k, v in self.kernels_s.items()))
        for extra in (self.stragglers, self.variation, self.time_to_train):
            if extra is not None:
                lines.append(extra.format())
        lines.append(f"  simulated {self.instructions:,} instructions ({mode}) in {self.wall_s:.2f} s")
        return "\n".join(lines)


def byte_size(n: float) -> str:
    """Bytes in the largest binary unit they reach (GiB, MiB, KiB), two decimals."""
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def simulate(model: Union[str, ModelSpec], cluster: Union[str, ClusterSpec], plan: Union[str, Plan],
             seq_len: Optional[int] = None, *, symmetric: bool = True, profile: ProfileArg = None,
             trace: bool = False, stack: Union[str, StackSpec, None] = None,
             memory_margin_bytes: float = 0.0, memory_plan: bool = False, slow: Union[str, Slowdown, None] = None,
             variation: Optional[float] = None, seeds: int = 16, tokens: Optional[float] = None,
             goodput_params: Optional[GoodputParams] = None, link_variation: Optional[float] = None) -> SimResult:
    """Predict one training step.

    model / cluster / plan: specs or their names (`llama3-70b`, `128xdgx-h100`, `dp=16,tp=8,pp=8`).
    stack: the framework that runs it (`megatron-core`, `torchtitan`, ... or a file; None: the default).
    memory_margin_bytes: device memory to keep free: the plan fits when every rank's peak leaves it.
    symmetric: simulate one rank per pipeline stage (the others behave alike); False: every rank.
    profile: a calibrated profile (path or dict) whose costs replace the cluster's.
    trace: also return the predicted trace (`result.trace`).
    memory_plan: also plan every tensor's offset offline on GPU ranks (`planned_peak_bytes`), and simulate
    the program reordered to lower the peak (`reordered`).
    slow: stragglers (`rank:R:F,node:N:F,nic:N:F` or a `Slowdown`): also the step with them (`stragglers`).
    variation, seeds: per-GPU speed's coefficient of variation: the step over `seeds` draws (`variation`).
    link_variation: per-node NIC bandwidth's coefficient of variation, drawn with the GPUs' (`variation`).
    tokens: also the days to train this many tokens with failures and checkpoints (`time_to_train`).
    """
    t0 = time.perf_counter()
    from simexec.program.lower import lower

    model = model if isinstance(model, ModelSpec) else get_model(model)
    cluster = cluster if isinstance(cluster, ClusterSpec) else get_cluster(cluster)
    plan = plan if isinstance(plan, Plan) else load_plan(plan)
    if profile is not None:
        from simexec.sim.profile import apply_profile

        cluster = apply_profile(cluster, profile)
    stack = stack if isinstance(stack, StackSpec) else get_stack(stack)
    rp = resolve(model, cluster, plan, seq_len, stack)
    if not memory_margin_bytes >= 0:
        raise PlanError(f"memory margin must be >= 0, got {memory_margin_bytes / GiB:g} GiB")
    program = lower(rp, symmetric=symmetric)
    return simulate_program(rp, program, trace=trace, t0=t0, memory_margin_bytes=memory_margin_bytes,
                            memory_plan=memory_plan, slow=slow, variation=variation, seeds=seeds, tokens=tokens,
                            goodput_params=goodput_params, link_variation=link_variation)


def simulate_program(rp: ResolvedPlan, program: Program, *, trace: bool = False,
                     t0: Optional[float] = None, memory_margin_bytes: float = 0.0,
                     memory_plan: bool = False, slow: Union[str, Slowdown, None] = None,
                     variation: Optional[float] = None, seeds: int = 16, tokens: Optional[float] = None,
                     goodput_params: Optional[GoodputParams] = None, reorder: bool = True,
                     link_variation: Optional[float] = None) -> SimResult:
    """Simulate an already lowered program of `rp` (what `simulate` does after lowering). With
    `memory_plan` (and `reorder`), also the program reordered for memory (`SimResult.reordered`)."""
    from simexec.sim.variation import gpu_cv, gpus_per_node

    stragglers = parse_slow(slow, rp.world, gpus_per_node(rp)) if isinstance(slow, str) else slow
    variation = gpu_cv(variation, seeds, link_variation)  # bad input fails before the simulation
    train_tokens = tokens
    if train_tokens is not None and not train_tokens > 0:
        raise PlanError(f"--tokens must be > 0, got {train_tokens:g}")
    from simexec.sim.breakdown import breakdown, kernel_split, slowest_rank
    from simexec.sim.engine import Engine
    from simexec.sim.machine import machine_for
    from simexec.sim.memory import memory_report

    t0 = time.perf_counter() if t0 is None else t0
    cluster = rp.cluster
    eng = Engine(program, machine_for(cluster, program, rp.plan.dtype))
    step = eng.run()

    events, has_workspace = _memory_events(eng)
    gpu = cluster.device.name != "cpu"  # the executor's CPU ranks allocate through the CPU allocator
    mem = memory_report(events, cluster.costs, cluster.device.memory_bytes, keep_timeline=trace,
                        fixed=not has_workspace, runtime_outside_allocator=gpu, caching_allocator=gpu,
                        expandable_segments=rp.stack.expandable_segments, memory_plan=memory_plan)
    peak_rank = max(mem.peak, key=lambda r: (mem.peak[r], -r))
    reps = program.represents or {}
    per_rank = {}
    for r in sorted(mem.peak):
        for x in reps.get(r, (r,)):
            per_rank[x] = mem.peak[r]
    per_rank = dict(sorted(per_rank.items()))
    tensors_per_rank = {x: mem.tensor_peak[r] for r in sorted(mem.tensor_peak) for x in reps.get(r, (r,))}
    planned_per_rank = {x: mem.planned_peak[r] for r in sorted(mem.planned_peak) for x in reps.get(r, (r,))}

    slow = slowest_rank(eng)
    tokens = rp.tokens_per_step
    flops = rp.model.training_flops_per_token(rp.seq_len) * tokens
    tflops = flops / rp.world / step / 1e12 if step > 0 else 0.0
    peak_flops = cluster.device.peak_flops.get(rp.plan.dtype, 0.0)
    result = SimResult(
        model=rp.model.name, cluster=cluster.name, plan=rp.plan.to_string(), world=rp.world,
        symmetric=program.symmetric, step_time_s=step, tokens_per_s=tokens / step if step > 0 else 0.0,
        tflops_per_gpu=tflops, mfu=tflops * 1e12 / peak_flops if peak_flops else 0.0,
        peak_memory_bytes=mem.peak[peak_rank], peak_memory_bytes_per_rank=per_rank,
        peak_tensor_bytes=mem.tensor_peak[peak_rank],
        memory_breakdown_bytes=mem.breakdown[peak_rank], memory_capacity_bytes=mem.capacity,
        fits=mem.fits(memory_margin_bytes), peak_tensor_bytes_per_rank=dict(sorted(tensors_per_rank.items())),
        breakdown_s=breakdown(eng, slow, step), slowest_rank=slow, peak_rank=peak_rank,
        instructions=len(eng.instrs), wall_s=0.0, memory_margin_bytes=memory_margin_bytes,
        memory_model=mem.allocator, planned_peak_bytes=max(mem.planned_peak.values(), default=0.0),
        planned_peak_bytes_per_rank=dict(sorted(planned_per_rank.items())),
    )
    split = kernel_split(eng, slow, rp.plan.dtype)
    result.kernels_s = {k: sec for k, (sec, _) in split.items()}
    result.kernels_tflops = {k: fl / sec / 1e12 for k, (sec, fl) in split.items() if k != "memory-bound" and sec > 0}
    _real_cluster(result, rp, program, stragglers, variation, seeds, train_tokens, goodput_params, link_variation)
    if memory_plan and reorder:
        from simexec.sim.reordered import simulate_reordered

        result.reordered = simulate_reordered(rp, program, memory_margin_bytes)
    if trace:
        result.trace = _trace(eng, program, result, mem)
    result.wall_s = time.perf_counter() - t0
    return result


def _real_cluster(result: SimResult, rp: ResolvedPlan, program: Program, slow: Optional[Slowdown],
                  variation: Optional[float], seeds: int, tokens: Optional[float],
                  params: Optional[GoodputParams], link_variation: Optional[float] = None) -> None:
    """What the step and the run become on real hardware: stragglers, variation, failures."""
    from simexec.sim.goodput import plan_checkpoint, time_to_train
    from simexec.sim.variation import straggler_report, variation_report

    step = result.step_time_s
    if slow:
        result.stragglers = straggler_report(rp, program, slow, step)
    if variation is not None:
        result.variation = variation_report(rp, program, variation, seeds, step, link_variation)
    if tokens is not None:
        params = params or GoodputParams()
        spread = result.variation.median_slowdown if result.variation is not None else 1.0
        straggled = result.stragglers.slowdown if result.stragglers is not None else 1.0
        result.time_to_train = time_to_train(tokens, result.tokens_per_s, result.breakdown_s, rp.world,
                                             plan_checkpoint(rp, params), params, spread, straggled)


def _memory_events(eng) -> tuple[dict[int, list[tuple[float, int, str, float, str]]], bool]:
    """Per rank: (time, program order, category, +alloc / -free bytes, tag[, an allocation's stream]); and
    whether the program allocates the runtime workspace itself (then `workspace_bytes` is not added again)."""
    out: dict[int, list] = {r: [] for r, _ in eng.streams}
    workspace = False
    start, instrs = eng.start, eng.instrs
    for k in eng.memory:
        ins = instrs[k]
        if ins.op == "free":
            out[ins.rank].append((start[k], k, ins.category, -ins.bytes, ins.name[len("mem.free."):]))
        else:
            out[ins.rank].append((start[k], k, ins.category, ins.bytes, ins.name[len("mem.alloc."):], ins.stream))
            workspace = workspace or ins.category == "workspace"
    return out, workspace


def _trace(eng, program: Program, result: SimResult, mem) -> Trace:
    events = []
    for k, ins in enumerate(eng.instrs):
        if ins.kind == "memory":
            continue
        s = eng.start[k]
        events.append(Event(
            id=ins.id, rank=ins.rank, stream=ins.stream, name=ins.name, kind=ins.kind, op=ins.op,
            start_us=s * 1e6, dur_us=(eng.end[k] - s) * 1e6, phase=ins.phase, layer=ins.layer, mb=ins.mb,
            flops=ins.flops, bytes=ins.bytes,
        ))
    counters = [Counter(rank=r, ts_us=t * 1e6, category=cat, bytes=b)
                for r, line in sorted(mem.timeline.items()) for t, cat, b in line]
    summary = {
        "step_time_s": result.step_time_s, "tokens_per_s": result.tokens_per_s, "mfu": result.mfu,
        "peak_memory_bytes": result.peak_memory_bytes,
        "peak_memory_bytes_per_rank": {str(r): b for r, b in sorted(mem.peak.items())},
        # what a measurement of the tensors sees (`simexec.sim.memory`), which `compare` holds against it
        "peak_tensor_bytes_per_rank": {str(r): b for r, b in sorted(mem.tensor_peak.items())},
        "breakdown_s": result.breakdown_s, "fits": result.fits,
    }
    if getattr(eng, "cores", None) is not None:  # CPU ranks on shared cores: each one's CPU time in the step
        summary["cpu_s_per_rank"] = {str(r): c for r, c in sorted(eng.cores.cpu_s.items())}
        summary["main_cpu_s_per_rank"] = {str(r): eng.cores.main_cpu_s.get(r, 0.0) for r, _ in sorted(eng.cores.cpu_s.items())}
    meta = {
        "kind": "predicted", "model": result.model, "cluster": result.cluster, "plan": result.plan,
        "world": result.world, "symmetric": result.symmetric, "program": program.fingerprint(),
        "program_executed": program.executed_fingerprint(),
        "represents": {str(r): list(v) for r, v in sorted((program.represents or {}).items())}
        if program.symmetric else {},
        "summary": summary,
    }
    return Trace(meta=meta, events=events, counters=counters)
