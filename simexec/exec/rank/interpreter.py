"""The executor's interpreter: one rank runs its program, instruction by instruction, with real tensors.

The loop is torch pipelining's `_step_microbatches` in spirit: walk this rank's instructions in program
order and dispatch on the kind. Every instruction is one call:

- compute: one block of `simexec.exec.nn.gpt.GPT` (forward, recompute or backward) or the optimizer;
- collective: issued with `async_op=True` on the real process group of its axis, waited on by the
  instructions that name it in `deps` or that read what it produces;
- send / recv: `isend` eagerly, `irecv` posted when the recv comes, waited on like collectives;
  without sp a tp rank sends its 1/tp piece of the tensor and the receiver's `act_gather` /
  `grad_gather` all-gathers the pieces (`ResolvedPlan.pipeline_slices`);
- copy: offload copies between separate device and host buffers; memory: markers, skipped (their
  deps are not waited: a marker is accounting, and waiting would hold the compute stream back).

The loop is lean: what it does per instruction besides dispatching (deps, ZeRO-3 releases, full
recompute's drops) is decided once per run (`_prepare`), name look-ups are dicts, a backward block
goes straight to the autograd engine, and the only per-instruction allocations are the tensors.
On an XLA device (`simexec.exec.rank.xla`) every compute instruction ends with a graph cut, so it is one
lazy XLA graph, executed and timed on its own; collectives go through `comm` (torch.distributed,
or gloo on host copies on the XLA CPU runtime).

Activations and their gradients live in two dicts keyed by (name, layer, micro-batch), named as
`simexec.exec.rank.dataflow` tables them.

Gradients are sums: every micro-batch loss is scaled by 1 / (tokens of the global batch), so summing
over micro-batches and ranks gives the gradient of the global mean loss, as the single-process
reference computes it.

The rest of a rank, one module each: `simexec.exec.rank.block_compute` (the compute blocks, with
per-block autograd), `simexec.exec.rank.activation_collectives` (the collectives' dispatch and those
that move activations), `simexec.exec.rank.sharding` (parameters and gradients under ZeRO 0-3),
`simexec.exec.rank.ring` (ring context parallelism), `simexec.exec.rank.heads_exchange` (cp_impl=a2a),
`simexec.exec.rank.pipeline_messages` (sends and receives between pipeline stages),
`simexec.exec.rank.optimizer_step` (Adam, loss scaling, clipping, offload copies): the mixins of
`RankInterpreter`. Beside them: `simexec.exec.rank.collectives` (the communication calls and the
handle of an issued one), `simexec.exec.rank.dataflow` (what each block reads and writes),
`simexec.exec.rank.unsupported_plans` (plans the interpreter cannot run yet) and
`simexec.exec.measure.live_memory` (peak memory on CPU).
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from simexec.exec.measure.live_memory import LIVE_TRACKER, LiveBytes
from simexec.exec.nn import data
from simexec.exec.nn.gpt import GPT
from simexec.exec.nn.param_layout import Layout, holds, init_full, shard, stage_specs
from simexec.exec.nn.scaler import LossScaler
from simexec.exec.nn.weight_grads import DeferredWeights
from simexec.exec.rank.activation_collectives import ActivationCollectives
from simexec.exec.rank.activation_offload import ActivationOffloader
from simexec.exec.rank.block_compute import BlockCompute
from simexec.exec.rank.collectives import InflightComm, SendWaiter, TorchComm
from simexec.exec.rank.dataflow import (BLOCK_IO, BLOCK_IO_SP, COLLECTIVE_IO, COLLECTIVE_IO_SP, SP_PARTIAL_BY,
                                        MTP_HEAD_IO, downstream, gathered_dispatch_io, mtp_aliases, two_hop_io,
                                        upstream)
from simexec.exec.rank.heads_exchange import HeadsExchange
from simexec.exec.rank.optimizer_step import OptimizerStep
from simexec.exec.rank.pipeline_messages import PipelineMessages
from simexec.exec.rank import checkpoint
from simexec.exec.rank.ring import RingAttention
from simexec.exec.rank.run_control import KILL_RECORD, KILLED_EXIT_CODE, RunControl, checkpoint_path
from simexec.exec.rank.sharding import Sharding
from simexec.program.groups import deepep_two_hops
from simexec.program.instructions import Instr


class _NullTracer:
    def begin(self, ins, step):
        pass

    def end(self, ins, step):
        pass

    def counter(self, category, nbytes):
        pass


class RankInterpreter(BlockCompute, ActivationCollectives, Sharding, RingAttention, HeadsExchange, PipelineMessages,
                      OptimizerStep):
    """One rank's program, run step by step: its state, its loop, and the reads and writes of its
    activations and of the collectives in flight; the compute blocks are `BlockCompute`'s, the
    collectives' dispatch and the activation collectives `ActivationCollectives`', the parameter and
    gradient storage `Sharding`'s, ring attention `RingAttention`'s, cp_impl=a2a's exchanges
    `HeadsExchange`'s, the pipeline messages `PipelineMessages`' and the optimizer step
    `OptimizerStep`'s."""

    def __init__(self, rp, instrs: list[Instr], groups, tracer, device: torch.device, seed: int, comm=None):
        self.rp, self.instrs, self.groups, self.device, self.seed = rp, instrs, groups, device, seed
        self.comm = comm if comm is not None else TorchComm
        self.xla = device.type == "xla"
        self.cut: Optional[Callable[[], None]] = None  # XLA: end the lazy graph after each compute instruction
        if self.xla:
            from simexec.exec.rank.xla import cut

            self.cut = cut
        self.tracer = tracer if tracer is not None else _NullTracer()
        # offload_layers: the saved activations of the first layers go through host memory
        self.act_offload = ActivationOffloader(rp.plan.offload_layers, device) if rp.plan.offload_layers else None
        self.rank = instrs[0].rank
        m, p = rp.model, rp.plan
        self.m, self.plan = m, p
        self.coords = rp.mesh.coords(self.rank)
        self.lay = Layout.of(rp, self.rank)
        self.L = m.layers
        self.D = m.mtp_layers
        self.aliases = mtp_aliases(m.layers, m.mtp_layers, p.sp, p.tp)  # the MTP depths' reads (empty without)
        self.step_no = -1
        self.slow_factor = 1.0  # a straggler's compute slowdown (`slowed_compute`)
        self.inflight: dict[str, InflightComm] = {}
        # gloo's sends complete only when waited on (`SendWaiter`); NCCL's and XLA's host sends do not need it
        self.send_waiter = SendWaiter.shared() if device.type == "cpu" and self.comm is TorchComm else None
        self.token_weight = 1.0 / (p.gbs * rp.seq_len)  # each token's share of the global mean loss
        self.scaler = LossScaler.of(p)  # loss_scale: where the backward starts, and how that moves
        self.zero3 = p.zero3  # the ZeRO-3 flavour's policy; None unless zero=3
        # gradient shards held from the start, summed into and zeroed as each step starts (DeepSpeed's
        # partitions: ZeRO-2's, and ZeRO-3's under zero_impl=deepspeed), where FSDP2 makes each at its
        # first reduce-scatter and drops it after the step; ZeRO-1's is a slice of its gradient buffer
        self.held_gshards = p.zero == 2 or (p.zero3 is not None and p.zero3.holds_grad_shards)
        self.tokens_res = rp.seq_len // p.cp // (p.tp if p.sp else 1)  # residual-stream tokens per rank
        self.dtype = torch.float32 if p.dtype == "fp32" else torch.bfloat16 if p.dtype == "bf16" else torch.float16
        # Megatron-LM's main_grad: gradients accumulated and reduced in fp32 beside 16-bit parameters
        self.main_grads = bool(p.grad_fp32) and self.dtype != torch.float32
        self.gdtype = torch.float32 if self.main_grads else self.dtype

        self.specs = {s.name: s for s in stage_specs(rp, self.coords["pp"]) if holds(s, m, self.lay)}
        self.blocks_io = BLOCK_IO_SP if p.sp else {**BLOCK_IO, **(MTP_HEAD_IO if m.mtp_layers else {})}
        # moe_dispatcher=deepep across NVLink domains: DeepEP's two hops carry each token once with its
        # routing weights, as the allgather dispatcher's gather does (`ActivationCollectives.deepep_hop`)
        self.two_hops = deepep_two_hops(rp)
        self.gathered_dispatch = p.moe_dispatcher == "allgather" or self.two_hops
        if self.gathered_dispatch:
            self.blocks_io = gathered_dispatch_io(self.blocks_io)
        self.colls = COLLECTIVE_IO_SP if p.sp else COLLECTIVE_IO
        if self.two_hops:
            self.colls = two_hop_io(self.colls)
        # the backward collective that sums each tp-replicated parameter's partial gradient
        self.partial_by = {n: (s.sp_partial or (SP_PARTIAL_BY[s.tp_partial] if ".norm" in n else s.tp_partial))
                           if p.sp else s.tp_partial for n, s in self.specs.items()
                           if s.tp_partial or (p.sp and s.sp_partial)}
        if p.etp is not None and p.tp > 1 and m.moe is not None and not m.moe.shared_experts:
            # parallel folding without a shared expert: no mlp_in around the MoE layer, so the router's
            # partial gradient (each tp rank routed its own slice) rides the first norm's all-reduce
            self.partial_by.update({n: "norm_grads" for n in self.partial_by if n.endswith(".moe.router")})
        # a zero-bubble schedule: blocks' weight gradients wait for the program's `wgrad` instructions,
        # after the input-gradient collectives; one all-reduce per unit sums the partial ones
        self.split = p.pipeline_schedule.splits_backward
        # tp_overlap: the column-parallel blocks' backwards split alike, their `wgrad` right after the
        # input gradient's tp collective is issued
        self.split_blocks = {(i.block, i.layer, i.mb) for i in instrs if i.phase == "wgrad"} if p.tp_overlap else set()
        self.deferred: dict[tuple, DeferredWeights] = {}
        self.split_analyses: dict[tuple, object] = {}  # (block, layer) -> where its parameters join
        if self.split or p.tp_overlap:
            # (tp_overlap alone leaves an MTP depth's input norms to their own sum after their backward)
            self.partial_by = {n: v if v == "mtp_norm_grads" and not self.split else "norm_grads"
                               for n, v in self.partial_by.items()}
        # the layer of the collective that sums each: its unit's, but an MTP depth's final norm is its
        # head's (layer unit + depths, the lowering's `mtp_head`), whose head_in or norm_grads carries it
        self.partial_layer = {n: self.specs[n].unit + (self.D if self.specs[n].tp_partial == "head_in"
                                                        and self.specs[n].unit > self.L and not self.split
                                                        and not p.tp_overlap else 0)
                              for n in self.partial_by}
        full = init_full(m, seed)
        self.p: dict[str, Tensor] = {
            n: shard(s, full[n], self.lay).to(device=device, dtype=self.dtype).requires_grad_()
            for n, s in self.specs.items()
        }
        del full
        self.shapes = {n: t.shape for n, t in self.p.items()}
        self.model = GPT(m, self.lay, self.p, flash=self.plan.flash_attention)
        self.g: dict[str, Tensor] = {}  # gradients moved out of .grad (tp-reduced, zero-0 reduced)
        self.g_pending: dict[str, InflightComm] = {}  # params whose gradient a collective still computes
        self.reduced: dict[str, Tensor] = {}  # ZeRO-0 bucket results: final gradients

        # what the program asks for: recompute, buckets, ZeRO-3 gathers
        self.recomputed = {(i.block, i.layer, i.mb) for i in instrs if i.phase == "recompute" and i.kind == "compute"}
        self.full_recompute_layers = {(i.layer, i.mb) for i in instrs if i.phase == "recompute" and i.block == "qkv"}
        self.layer_end = {}  # (layer, mb) -> index of the layer's last forward instruction
        for k, i in enumerate(instrs):
            if i.phase == "fwd" and 0 <= i.layer < self.L and i.kind in ("compute", "collective"):
                self.layer_end[(i.layer, i.mb)] = k
        self.setup_zero()
        self.setup_grad_buffers()
        self.setup_optimizer()
        self.setup_ring()
        self.setup_heads()
        self._prepare()

    # --- env reads and writes ---------------------------------------------------------------------
    def alias(self, key: tuple) -> tuple:
        """`key`, or under MTP the name it reads (`mtp_aliases`)."""
        if not self.aliases:
            return key
        a = self.aliases.get(key[:2])
        return key if a is None else (*a, key[2])

    def resolve(self, key: tuple) -> Optional[tuple]:
        """The key that holds `key`'s value: itself, or the name before an absent collective."""
        k = self.alias(key)
        while k is not None and k not in self.env:
            k = upstream(k, self.plan.sp, self.L, self.D, self.two_hops)
        return k

    def read(self, key: tuple) -> Any:
        k = self.resolve(key)
        if k is None:
            raise KeyError(f"rank {self.rank}: no value for {key[0]} of layer {key[1]} micro-batch {key[2]}")
        v = self.env[k]
        if isinstance(v, InflightComm):
            v.wait()
            v = self.env[k]
        return v

    def take_grad(self, key: tuple) -> Optional[Tensor]:
        k = key
        while k is not None:
            if k in self.d:
                v = self.d[k]
                if isinstance(v, InflightComm):
                    v.wait()
                return self.d.pop(k)
            k = downstream(k, self.L, self.plan.sp, self.D, self.two_hops)
        return None

    def add_grad(self, key: tuple, t: Tensor) -> None:
        key = self.alias(key)
        cur = self.d.get(key)
        if isinstance(cur, InflightComm):
            cur.wait()
            cur = self.d.get(key)
        self.d[key] = t if cur is None else cur + t

    def deliver(self, key: tuple, t: Tensor, backward: bool) -> None:
        if backward:
            if self.d.get(key) is not None and isinstance(self.d[key], InflightComm):
                del self.d[key]
            self.add_grad(key, t)
        else:
            self.env[key] = t

    def issue(self, ins: Instr, works: list, finish: Optional[Callable[[], None]]) -> InflightComm:
        w = InflightComm(self, ins, works, finish, self.send_waiter if ins.kind == "send" else None)
        self.inflight[ins.name] = w
        return w

    def wait_name(self, name: str) -> None:
        w = self.inflight.get(name)
        if w is not None:
            w.wait()

    def reap(self) -> None:
        """Finish what has completed without blocking, so its event ends near when it did (not at the
        instruction that happens to wait for it; an eager send is waited by nobody until the step
        ends), and its buffers go."""
        for w in list(self.inflight.values()):
            if w.completed():
                w.wait()

    def wait_all(self) -> None:
        for w in list(self.inflight.values()):
            w.wait()

    def wait_but_sends(self, ins: Instr) -> None:
        """Before the optimizer step (or the gradients' copy to the host): wait for everything issued
        except the eager sends `ins` does not depend on. A send carries an activation or its gradient,
        not a parameter, and the program lets the step go on while it is in flight (`p2p_overlap`);
        the end of the step waits for it."""
        deps = set(ins.deps)
        for w in list(self.inflight.values()):
            if w.ins.kind != "send" or w.ins.name in deps:
                w.wait()

    def group(self, ins: Instr):
        return self.groups.get(ins.axis, ins.group)

    def batch(self, mb: int) -> data.Batch:
        b = self._batches.get(mb)
        if b is None:
            b = data.micro_batch(self.rp, self.seed, self.step_no, self.coords["dp"], mb, self.coords["cp"])
            if self._pos is None or not torch.equal(self._pos[0], b.pos):
                self._pos = (b.pos, b.pos.to(self.device))
            # one positions tensor for the step: the model builds its rotary tables once for it
            b = b.to(self.device, self._pos[1])
            self._batches[mb] = b
        return b

    # --- the step ---------------------------------------------------------------------------------
    def _prepare(self) -> None:
        """Decide once, per instruction, what the loop does besides dispatching it: the step loop
        then does no set or dict look-ups of its own. Memory instructions are left out: they are the
        simulator's accounting (zero time, not traced), and waiting on their deps (a free after a
        collective, on that collective's stream) would only hold the compute stream back."""
        codes = {"compute": 0, "collective": 1, "send": 2, "recv": 2, "copy": 3}
        self._ops = []
        self.send_release = self.plan_send_release()
        self.act_last_read, self.act_copy_pos, self.act_reload_done = self.plan_offload_releases()
        for k, ins in enumerate(self.instrs):
            code = codes.get(ins.kind)
            if code is None:
                continue
            key = (ins.layer, ins.mb)
            drop = key if key in self.full_recompute_layers and self.layer_end.get(key) == k else None
            self._ops.append((ins, code, ins.deps, tuple(self.z3_free_after.get(k, ())), drop))

    def run_step(self, step: int) -> Optional[float]:
        self.step_no = step
        self.env: dict[tuple, Any] = {}
        self.d: dict[tuple, Any] = {}
        self.records: dict[tuple, tuple] = {}
        self._batches: dict[int, data.Batch] = {}
        self._pos: Optional[tuple[Tensor, Tensor]] = None  # this rank's positions (on the CPU, on the device)
        self.loss: Optional[Tensor] = None
        self.attach_grads()
        if self.act_offload is not None:
            self.act_offload.reset()
        # offload_layers: instruction -> the activations it lets go of (`release_after_reader`)
        self.act_release_after: dict[str, list[tuple]] = {name: [] for name in self.act_reload_done}
        release = self.act_release_after
        inflight, tracer, cut = self.inflight, self.tracer, self.cut
        slow = self.slow_factor > 1.0
        begin, end = tracer.begin, tracer.end
        for ins, code, deps, free, drop in self._ops:
            for dep in deps:
                w = inflight.get(dep)
                if w is not None:
                    w.wait()
            if code == 0:  # compute
                if inflight:
                    self.reap()
                begin(ins, step)
                if slow:
                    self.slowed_compute(ins)
                else:
                    self.compute(ins)
                    if cut is not None:
                        cut()
                end(ins, step)
                for key in free:
                    self.z3_release(key)
            elif code == 1:  # collective: ends when waited
                begin(ins, step)
                self.collective(ins)
            elif code == 2:  # send / recv: end when waited
                begin(ins, step)
                self.p2p(ins)
            else:  # copy
                begin(ins, step)
                self.copy(ins)
                end(ins, step)
            if drop is not None:
                self.drop_layer(*drop)
            if release and ins.name in release:
                self.release_after_reader(ins.name)
        self.wait_all()
        return None if self.loss is None else float(self.loss)

    def slowed_compute(self, ins: Instr) -> None:
        """A straggler's compute (`--slow`): the instruction, then (F - 1) times its measured time more,
        so the rank's compute takes F times as long. On a CPU rank the time is the thread's CPU time
        (the rank computes on this one thread) and the extra is CPU work, a spin until the thread has
        used that much more: the rank's core does F times the work, as a slower core would, and on
        cores shared with other processes both the work and the extra wait their turn alike (a sleep
        would wake up late there, and wall time would double whatever preempted the instruction). On
        a GPU the device is synchronized around the instruction and the extra is wall time."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            clock = time.perf_counter
        else:
            clock = time.thread_time
        t0 = clock()
        self.compute(ins)
        if self.cut is not None:
            self.cut()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t1 = clock()
        until = t1 + (self.slow_factor - 1.0) * (t1 - t0)
        while clock() < until:
            pass

    # --- results ----------------------------------------------------------------------------------
    def final_params(self) -> dict[str, Tensor]:
        """This rank's tensor-/expert-parallel shard of every parameter it holds. ZeRO-3 shards are
        all-gathered once more (after the last step, outside the program) so that every plan returns
        the same shapes, and so are ZeRO-1/2's under `param_overlap`, whose gathers the program
        leaves to the next step's forward."""
        if self.plan.param_overlap:
            for ins in self.instrs:
                if ins.kind == "collective" and ins.block.startswith("params"):
                    self.params_gather(ins, self.group(ins))
            self.wait_all()
        for key, fl in self.z3.items():
            ins = next(i for i in self.instrs if i.block == "gather" and (self.param_class(i.axis), i.layer) == key)
            out = torch.empty(fl.padded, dtype=self.dtype, device=self.device)
            self.comm.all_gather(out, self.shards[key], group=self.group(ins))
            for n, v in zip(fl.names, fl.views(out)):
                self.p[n].data = v.clone()
        return {n: t.detach().to("cpu", copy=True) for n, t in self.p.items()}

    def global_loss(self, loss: Optional[float]) -> Optional[float]:
        """The step's loss summed over data- and context-parallel ranks (outside the program): every
        rank that computes the loss reports the loss of the whole global batch."""
        if loss is None:
            return None
        t = torch.tensor([loss], dtype=torch.float64)
        for axis in ("dp", "cp"):
            grp = self.rp.mesh.group(self.rank, axis)
            if len(grp) > 1:
                dist.all_reduce(t, group=self.groups.get(axis, grp))
        return float(t.item())


# ---------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------


def run_rank(rp, instrs: list[Instr], *, steps: int, groups, tracer, device: "torch.device", seed: int = 0,
             control: Optional[RunControl] = None, progress: Optional[list] = None) -> dict:
    """Run training steps `control.start_step` (0 unless resuming) to `steps` - 1 of this rank's
    program. Returns {"losses": [float per step] (on the rank(s) that compute the loss; others
    return []), "step_times_s": [...], "params": {name: tensor (cpu, this rank's shard)},
    "peak_memory_bytes": int}, and under loss_scale "loss_scales" (per step) and "skipped_steps"
    (those whose gradients overflowed on some rank). Peak memory is that of the first step run
    (optimizer states exist from the start, so it is the steady state): on CUDA
    `max_memory_allocated`, on CPU the live tensor storages of device memory (not the communication
    backend's temporaries, such as gloo's copy inside reduce-scatter, nor the host copies of an
    offloaded optimizer); there also `largest_alloc_bytes`, the largest single tensor storage the
    interpreter's ops created in that step. On an XLA device the runtime's peak where it reports one
    (TPU, GPU), else 0.

    control (`simexec.exec.rank.run_control`): this rank's slowdown, checkpoints (saved after steps
    K, 2K, ...: "checkpoints" [(steps done, seconds)]), the checkpoint to resume from ("load_s"), a
    kill. progress: a list this appends [step, wall-clock begin, end, loss] to as each step ends,
    which the actor reports while the run goes on (so a failed run's progress is known)."""
    control = control or RunControl()
    device = torch.device(device)
    cuda = device.type == "cuda"
    xla = device.type == "xla"
    comm = None
    if xla:  # the process groups' backend decides how XLA tensors travel (see simexec.exec.rank.xla)
        from simexec.exec.rank import xla as X

        comm = X.comm_for(dist.get_backend() if dist.is_initialized() else "xla")
    r = RankInterpreter(rp, instrs, groups, tracer, device, seed, comm)
    r.slow_factor = control.slow_factor(r.rank)
    saved: list[tuple[int, float]] = []
    load_s = checkpoint.load(r, control.resume_from) if control.resume_from else None
    progress = progress if progress is not None else []
    losses, times, cpu, main_cpu = [], [], [], []  # the process's CPU time a step (every thread), this thread's
    peak = largest = 0
    first = control.start_step
    for step in range(first, steps):
        if control.kills(r.rank, step):
            die(control, r.rank, step)
        tracker = None
        if step == first:
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            elif not xla:  # XLA tensors have no storage to count: the runtime's figure (0 on CPU)
                tracker = LiveBytes()
                for t in r.host_tensors():  # device memory only: host copies are not the accelerator's
                    tracker.ignore(t)
                held = [r.p, r.shards, r.z3_buffers, r.z3_gbuffers, r.gbuf]
                for t in [t for d in held for t in d.values()] + r.opt.state_tensors():
                    tracker.track(t)
                tracker.__enter__()
                LIVE_TRACKER[0] = tracker
        if cuda:
            torch.cuda.synchronize(device)
        wall0 = time.time()
        t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
        try:
            loss = r.run_step(step)
        finally:
            if tracker is not None:
                tracker.__exit__(None, None, None)
                LIVE_TRACKER[0] = None
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        main_cpu.append(time.thread_time() - m0)  # read inside the process's interval: never above it
        cpu.append(time.process_time() - c0)
        wall1 = time.time()
        if step == first:
            if xla:
                peak = X.peak_memory(device)
            else:
                peak = int(torch.cuda.max_memory_allocated(device)) if cuda else tracker.peak
                largest = 0 if cuda else tracker.largest
        loss = r.global_loss(loss)
        if loss is not None:
            losses.append(loss)
        progress.append([step, wall0, wall1, loss])
        if control.saves_after(step + 1):
            saved.append((step + 1, checkpoint.save(r, checkpoint_path(control.checkpoint_dir, step + 1))))
    out = {"losses": losses, "step_times_s": times, "cpu_times_s": cpu, "main_cpu_times_s": main_cpu,
           "params": r.final_params(), "peak_memory_bytes": peak, "largest_alloc_bytes": largest,
           "progress": [list(p) for p in progress], "checkpoints": saved, "load_s": load_s}
    if rp.plan.loss_scale > 0:
        scales, skipped = r.scaler.scales, r.scaler.skipped
        out.update(loss_scales=scales[first:], skipped_steps=[s for s in skipped if s >= first])
    return out


def die(control: RunControl, rank: int, step: int) -> None:
    """`--kill`: note which rank stops and when (wall clock), then leave at once, as a crash does:
    no cleanup, no goodbye to the process group."""
    record = {"rank": rank, "step": step, "wall_s": time.time()}
    with open(os.path.join(control.checkpoint_dir, KILL_RECORD), "w") as fh:
        json.dump(record, fh)
    os._exit(KILLED_EXIT_CODE)
