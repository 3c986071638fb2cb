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

Per-block autograd. A forward block takes detached copies of its inputs that require grad, runs the
block, keeps (inputs, outputs) in a record; its backward calls `torch.autograd.backward(outputs,
grad_outputs)` and hands the inputs' `.grad` on. Activations and their gradients live in two dicts
keyed by (name, layer, micro-batch), named as `simexec.exec.rank.dataflow` tables them.

Gradients are sums: every micro-batch loss is scaled by 1 / (tokens of the global batch), so summing
over micro-batches and ranks gives the gradient of the global mean loss, as the single-process
reference computes it.

The rest of a rank, one module each: `simexec.exec.rank.collectives` (the communication calls and the
handle of an issued one), `simexec.exec.rank.dataflow` (what each block reads and writes),
`simexec.exec.rank.sharding` (parameters and gradients under ZeRO 0-3),
`simexec.exec.rank.ring` (ring context parallelism), `simexec.exec.rank.pipeline_messages` (sends and receives
between pipeline stages), `simexec.exec.rank.optimizer_step` (Adam, loss scaling, clipping, offload
copies), the last four mixins of `_Rank`, and `simexec.exec.measure.live_memory` (peak memory on CPU).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from simexec.exec.nn import data
from simexec.exec.rank.collectives import SendWaiter, TorchComm, _Inflight
from simexec.exec.rank.dataflow import (_BLOCKS, _BLOCKS_SP, _COLLS, _COLLS_SP, _CONSUMED, _GATHERED_LAST,
                                   _PERMUTED_INPUT, _REGATHERED_INPUT, _REGATHERS, _SP_GATHERS, _SP_PARTIAL, _TP_PARTIAL,
                                   _coll_keys, _downstream, _upstream)
from simexec.exec.rank.heads_exchange import HeadsExchange
from simexec.exec.measure.live_memory import _TRACKER, _LiveBytes
from simexec.exec.nn.gpt import GPT, Route
from simexec.exec.nn.param_layout import Layout, holds, init_full, shard, stage_specs
from simexec.exec.rank.optimizer_step import OptimizerStep
from simexec.exec.rank.pipeline_messages import PipelineMessages
from simexec.exec.rank.ring import RingAttention
from simexec.exec.nn.scaler import LossScaler
from simexec.exec.rank.sharding import Sharding
from simexec.exec.nn.weight_grads import DeferredWeights, backward_inputs
from simexec.program.instructions import Instr


def _engine_backward(tensors: tuple, grads: tuple) -> None:
    """torch.autograd.backward(tensors, grads) without its Python-side checks and bookkeeping (the
    interpreter calls it once per backward block, with gradients of matching shapes and dtypes)."""
    _ENGINE.run_backward(tensors, grads, False, False, (), True, True)


def _engine_backward_to(tensors: tuple, grads: tuple, inputs: tuple) -> None:
    """As `_engine_backward`, to `inputs` alone, keeping the graph (a zero-bubble schedule's B)."""
    _ENGINE.run_backward(tensors, grads, True, False, inputs, True, True)


def _autograd_backward_to(tensors: tuple, grads: tuple, inputs: tuple) -> None:
    torch.autograd.backward(tensors, grads, retain_graph=True, inputs=inputs)


try:
    _ENGINE = torch.autograd.Variable._execution_engine
    _run_backward = _engine_backward
    _run_backward_to = _engine_backward_to
    _DEALLOCATE = True
except AttributeError:  # pragma: no cover - a torch without the engine handle
    _run_backward = torch.autograd.backward
    _run_backward_to = _autograd_backward_to
    _DEALLOCATE = False  # torch.autograd.backward checks the outputs' shapes against the gradients'


def _deallocate(t: Any) -> None:
    """Megatron's `deallocate_output_tensor`: a block's recorded output keeps only its autograd node
    (what the backward starts from), not its data. The storage lives on while anything else holds it
    (the next block's input, a tensor autograd saved, the environment until its last reader, a send),
    and is freed with the last of them: a record no longer keeps, say, a row-parallel block's partial
    sum alive until the block's backward once the g-collective has summed it."""
    if isinstance(t, Tensor) and t.grad_fn is not None and t._base is None and t.numel() > 1:
        key = (t.dtype, t.device)
        e = _EMPTY.get(key)
        if e is None:
            e = _EMPTY[key] = torch.empty(0, dtype=t.dtype, device=t.device)
        t.data = e


_EMPTY: dict = {}
_SCALAR: dict = {}


def _shrink_leaf(x: Tensor) -> None:
    """A recorded input leaf whose data nothing needs any more keeps only its shape: a zero-stride
    expansion of one element (autograd accumulates its gradient by the leaf's shape)."""
    if isinstance(x, Tensor) and x.requires_grad and x.grad_fn is None and x.numel() > 1:
        key = (x.dtype, x.device)
        e = _SCALAR.get(key)
        if e is None:
            e = _SCALAR[key] = torch.zeros((), dtype=x.dtype, device=x.device)
        x.data = e.expand(x.shape)


# ---------------------------------------------------------------------------------------------------
# Plans the interpreter cannot run yet
# ---------------------------------------------------------------------------------------------------


def unsupported(rp) -> Optional[str]:
    """None if this interpreter runs the plan; else what is missing, naming the plan feature."""
    m, p = rp.model, rp.plan
    missing = []
    if rp.tied_copy and p.zero >= 2:
        missing.append(f"tied embeddings with pp={p.pp} and zero={p.zero} ({m.name}: the two stages' copies of "
                       "the embedding would be summed before every micro-batch's reduce-scatter; the executor "
                       "runs a tied model over a pipeline with zero=0 or 1, as DeepSpeed's pipeline engine does, or under"
                       " schedule=zb-v or dualpipev, whose first rank holds the head beside the embedding)")
    if m.tied_embeddings and p.zero3 is not None and p.zero3.preallocated_buffers:
        missing.append(f"tied embeddings with zero_impl={p.zero3.name} ({m.name}: the LM head needs the embedding's "
                       "unit and its own gathered at once, which YaFSDP's two alternating buffers cannot hold)")
    if m.moe is not None and m.moe.capacity_factor is not None and p.cp > 1:
        missing.append(f"MoE token dropping (capacity_factor={m.moe.capacity_factor}) with cp={p.cp} (each "
                       "sequence fills the experts' buffers up to their capacity, and cp splits it over ranks)")
    if p.dtype == "fp8":
        missing.append("dtype=fp8")
    if not missing and (p.sp or p.cp > 1):
        missing += _lowering_gaps(rp)
    if not missing:
        return None
    return f"the executor cannot run plan {p.to_string()} on {m.name} yet: " + "; ".join(missing)


def _lowering_gaps(rp) -> list[str]:
    """Communication the math needs that the lowering does not emit (checked on the program of the
    first pipeline stage's representative rank, so that a fixed lowering is picked up by itself)."""
    from simexec.program.lower import lower

    p = rp.plan
    prog = lower(rp, symmetric=True)
    rank = rp.mesh.rank()
    instrs = prog.ranks[rank]
    gaps = []
    if p.sp and p.tp > 1 and not any(i.block == "embed_out" and i.phase == "bwd" for i in instrs):
        gaps.append("sp: no backward embed_out (the vocab-parallel embedding needs the gradient of its whole "
                    "sequence: the all-gather conjugate of the forward reduce-scatter)")
    if p.cp > 1:
        peers = set(rp.mesh.group(rank, "cp"))
        reduces = [i for i in instrs if i.kind == "collective" and i.block.startswith("grads")]
        if not any(peers <= set(i.group) for i in reduces):
            gaps.append("cp: gradients are reduced over dp only; parameters replicated over cp need their "
                        "gradients summed over dp x cp")
    return gaps


# ---------------------------------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------------------------------


class _NullTracer:
    def begin(self, ins, step):
        pass

    def end(self, ins, step):
        pass

    def counter(self, category, nbytes):
        pass


class _Rank(Sharding, RingAttention, HeadsExchange, PipelineMessages, OptimizerStep):
    """One rank's program, run step by step: its loop, the compute blocks and the activation
    collectives; the parameter and gradient storage is `Sharding`'s, ring attention
    `RingAttention`'s, the pipeline messages `PipelineMessages`' and the optimizer step
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
        self.rank = instrs[0].rank
        m, p = rp.model, rp.plan
        self.m, self.plan = m, p
        self.coords = rp.mesh.coords(self.rank)
        self.lay = Layout.of(rp, self.rank)
        self.L = m.layers
        self.step_no = -1
        self.inflight: dict[str, _Inflight] = {}
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
        self.blocks_io = _BLOCKS_SP if p.sp else _BLOCKS
        self.colls = _COLLS_SP if p.sp else _COLLS
        # the backward collective that sums each tp-replicated parameter's partial gradient
        self.partial_by = {n: (s.sp_partial or (_SP_PARTIAL[s.tp_partial] if ".norm" in n else s.tp_partial))
                           if p.sp else s.tp_partial for n, s in self.specs.items() if s.tp_partial}
        # a zero-bubble schedule: blocks' weight gradients wait for the program's `wgrad` instructions,
        # after the input-gradient collectives; one all-reduce per unit sums the partial ones
        self.split = p.pipeline_schedule.splits_backward
        # tp_overlap: the column-parallel blocks' backwards split alike, their `wgrad` right after the
        # input gradient's tp collective is issued
        self.split_blocks = {(i.block, i.layer, i.mb) for i in instrs if i.phase == "wgrad"} if p.tp_overlap else set()
        self.deferred: dict[tuple, DeferredWeights] = {}
        self.split_analyses: dict[tuple, object] = {}  # (block, layer) -> where its parameters join
        if self.split or p.tp_overlap:
            self.partial_by = {n: "norm_grads" for n in self.partial_by}
        full = init_full(m, seed)
        self.p: dict[str, Tensor] = {
            n: shard(s, full[n], self.lay).to(device=device, dtype=self.dtype).requires_grad_()
            for n, s in self.specs.items()
        }
        del full
        self.shapes = {n: t.shape for n, t in self.p.items()}
        self.model = GPT(m, self.lay, self.p, flash=self.plan.flash_attention)
        self.g: dict[str, Tensor] = {}  # gradients moved out of .grad (tp-reduced, zero-0 reduced)
        self.g_pending: dict[str, _Inflight] = {}  # params whose gradient a collective still computes
        self.reduced: dict[str, Tensor] = {}  # ZeRO-0 bucket results: final gradients

        # what the program asks for: recompute, buckets, ZeRO-3 gathers
        self.recomputed = {(i.block, i.layer, i.mb) for i in instrs if i.phase == "recompute" and i.kind == "compute"}
        self.full_recompute_layers = {(i.layer, i.mb) for i in instrs if i.phase == "recompute" and i.block == "qkv"}
        self.layer_end = {}  # (layer, mb) -> index of the layer's last forward instruction
        for k, i in enumerate(instrs):
            if i.phase == "fwd" and 0 <= i.layer < self.L and i.kind in ("compute", "collective"):
                self.layer_end[(i.layer, i.mb)] = k
        self._setup_zero()
        self._setup_grad_buffers()
        self._setup_optimizer()
        self._setup_ring()
        self._setup_heads()
        self._prepare()

    # --- env reads and writes ---------------------------------------------------------------------
    def resolve(self, key: tuple) -> Optional[tuple]:
        """The key that holds `key`'s value: itself, or the name before an absent collective."""
        k = key
        while k is not None and k not in self.env:
            k = _upstream(k)
        return k

    def read(self, key: tuple) -> Any:
        k = self.resolve(key)
        if k is None:
            raise KeyError(f"rank {self.rank}: no value for {key[0]} of layer {key[1]} micro-batch {key[2]}")
        v = self.env[k]
        if isinstance(v, _Inflight):
            v.wait()
            v = self.env[k]
        return v

    def take_grad(self, key: tuple) -> Optional[Tensor]:
        k = key
        while k is not None:
            if k in self.d:
                v = self.d[k]
                if isinstance(v, _Inflight):
                    v.wait()
                return self.d.pop(k)
            k = _downstream(k, self.L)
        return None

    def add_grad(self, key: tuple, t: Tensor) -> None:
        cur = self.d.get(key)
        if isinstance(cur, _Inflight):
            cur.wait()
            cur = self.d.get(key)
        self.d[key] = t if cur is None else cur + t

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
            b = data.Batch(b.tokens.to(self.device), b.targets.to(self.device), self._pos[1])
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
        self._send_release = self._plan_send_release()
        for k, ins in enumerate(self.instrs):
            code = codes.get(ins.kind)
            if code is None:
                continue
            key = (ins.layer, ins.mb)
            drop = key if key in self.full_recompute_layers and self.layer_end.get(key) == k else None
            self._ops.append((ins, code, ins.deps, tuple(self.z3_free_after.get(k, ())), drop))

    def _plan_send_release(self) -> dict[str, list[str]]:
        """Pipeline sends: recv name -> the sends that are certainly complete once it has arrived.

        A gloo send's work never reports completion until waited, and its tensor (a stage's output,
        or an input gradient) lives in it until then. A send is complete once its peer has received
        it, and the peer received it before any later message it sends back to this rank: its recv
        comes at the start of one of its actions (`pipeline_order`), and its sends follow it. So the
        first message the peer sends here from that action on releases the send (it is waited, without
        blocking, when that message is). Sends with no such message end with the step."""
        from simexec.program.schedules import pipeline_order

        p, rp = self.plan, self.rp
        if p.pp == 1:
            return {}
        V, me = rp.virtual_stages, self.coords["pp"]
        order = pipeline_order(p.schedule_name, p.pp, rp.micro_batches, p.vpp)
        out: dict[str, list[str]] = {}
        for ins in self.instrs:
            if ins.kind != "send" or ins.block not in ("act", "grad"):
                continue
            vs = int(ins.name.split(".")[2][1:])
            dest = vs + 1 if ins.block == "act" else vs - 1
            peer, chunk = rp.place(dest)
            acts = order[peer]
            want = ("F" if ins.block == "act" else "B", chunk, ins.mb)
            i = next((k for k, a in enumerate(acts) if (a.kind, a.chunk, a.mb) == want), None)
            if i is None:
                continue
            for a in acts[i:]:
                pvs = rp.stage(peer, a.chunk)
                if a.kind == "F" and pvs < V - 1 and rp.place(pvs + 1)[0] == me:
                    out.setdefault(f"p2p.act.v{pvs}.m{a.mb}", []).append(ins.name)
                    break
                if a.kind == "B" and pvs > 0 and rp.place(pvs - 1)[0] == me:
                    out.setdefault(f"p2p.grad.v{pvs}.m{a.mb}", []).append(ins.name)
                    break
        return out

    def run_step(self, step: int) -> Optional[float]:
        self.step_no = step
        self.env: dict[tuple, Any] = {}
        self.d: dict[tuple, Any] = {}
        self.records: dict[tuple, tuple] = {}
        self._batches: dict[int, data.Batch] = {}
        self._pos: Optional[tuple[Tensor, Tensor]] = None  # this rank's positions (on the CPU, on the device)
        self.loss: Optional[Tensor] = None
        self._attach_grads()
        inflight, tracer, cut = self.inflight, self.tracer, self.cut
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
        self.wait_all()
        return None if self.loss is None else float(self.loss)

    # --- compute ----------------------------------------------------------------------------------
    def compute(self, ins: Instr) -> None:
        if ins.block in ("optim", "cpu_optim"):
            return self.optimizer_step(ins)
        if ins.block == "grad_norm":
            return self.grad_norm(ins)
        if ins.block == "unscale":
            return self.unscale(ins)
        if ins.block.startswith("bucket_in"):
            return self.bucket_in(ins)
        if ins.block == "bucket_out":
            return self.bucket_out(ins)
        if self.z3_pending:
            for cls in ("dense", "expert"):
                w = self.z3_pending.get((cls, ins.layer))
                if w is not None:
                    w.wait()
        record = (ins.phase == "recompute" or not self.recomputed
                  or (ins.block, ins.layer, ins.mb) not in self.recomputed)
        if self.ring and ins.block == "attn":
            hop = self.ring_hop[ins.name]
            return self.ring_backward(ins, hop) if ins.phase == "bwd" else self.ring_forward(ins, hop, record)
        if ins.phase == "bwd":
            return self.backward(ins)
        if ins.phase == "wgrad":
            return self.weight_grads(ins)
        self.forward(ins, record)

    def _run_block(self, block: str, l: int, mb: int, xs: list) -> tuple:
        M = self.model
        if block == "embed":
            b = self.batch(mb)
            return (M.embed(b.tokens, b.pos),)
        if block == "qkv":
            q, kv = M.qkv(l, xs[0], self.batch(mb).pos, self._fetch("xa", l, mb))
            # what a cp collective is the only reader of (kv; q too under cp_impl=a2a) becomes a tensor of
            # its own, freed once sent: a recorded view (MLA's kv, q of the projection's output) would keep
            # its base alive until the backward
            if self.plan.cp > 1 and not self.ring:
                kv = kv.clone() if kv._base is not None else kv
                if self.heads and q._base is not None:
                    q = q.clone()
            return q, kv
        if block == "norm1":
            return (M.norm1(l, xs[0]),)
        if block == "norm2":
            return (M.norm2(l, xs[0]),)
        if block == "norm":
            return (M.final_norm(xs[0]),)
        if block == "attn":
            if self.heads:  # cp_impl=a2a: the whole sequence, in order, for this rank's share of the heads
                return (M.attn(l, xs[0], xs[1], self.heads_pos, self.heads_pos),)
            pos = self.batch(mb).pos
            kpos = self._kpos if xs[1].shape[3] != xs[0].shape[2] else pos
            return (M.attn(l, xs[0], xs[1], pos, kpos),)
        if block == "proj":
            return (M.proj(l, xs[0], xs[1]),)
        if block == "fc1":
            return (M.fc1(l, xs[0], self._fetch("xma", l, mb)),)
        if block == "fc2":
            return (M.fc2(l, xs[0], xs[1]),)
        if block == "router":
            return M.router(l, xs[0], self._fetch("xma", l, mb))
        if block == "experts":
            counts = self.env.get(("rcounts", l, mb))
            if counts is None:  # no dispatch (ep = 1): every routed token is here
                counts = self.read(("route", l, mb)).counts.view(1, -1)
            return (M.experts(l, xs[0], counts),)
        if block == "moe_out":
            return (M.moe_out(l, *xs, self.read(("route", l, mb)), self._fetch("xma", l, mb)),)
        if block == "head":
            return M.head(xs[0], self._fetch("xh", l, mb))
        if block == "xent":
            return (M.xent(xs[0], xs[1], self.batch(mb).targets),)
        if block == "loss":
            return (M.loss(xs[0], self.token_weight),)
        raise ValueError(f"rank {self.rank}: unknown compute block {block!r}")

    def _fetch(self, name: str, l: int, mb: int) -> Optional[Callable[[], Tensor]]:
        """Under sp, how a column-parallel GEMM's backward gets its input whole again: the value of
        the program's re-gather (`*_regather`), which has run by then."""
        if not self.plan.sp:
            return None
        key = (name, l, mb)

        def fetch() -> Tensor:
            v = self.env.get(key)
            if isinstance(v, _Inflight):
                v.wait()
                v = self.env.get(key)
            if v is None:
                raise RuntimeError(f"rank {self.rank}: the backward of layer {l} micro-batch {mb} needs {name} "
                                   "re-gathered, and no re-gather has delivered it")
            return v

        return fetch

    def _release_gathered(self, block: str, l: int, mb: int, vals: list) -> None:
        """Under sp, once the last forward reader of a gathered norm output has run: nothing keeps
        it (the GEMMs saved only the slice, re-gathered in the backward). The environment lets go of
        it, and so do the readers' records, whose inputs become one-element expansions of its shape."""
        name = _GATHERED_LAST[block]
        self.env.pop((name, l, mb), None)
        if not _DEALLOCATE or self.xla:
            return
        leaves = [v for n, v in zip(self.blocks_io[block][0], vals) if n == name]
        if block == "moe_out":
            rec = self.records.get(("router", l, mb))
            if rec is not None:
                leaves += [v for n, v in zip(rec[0], rec[1]) if n == name]
        for v in leaves:
            _shrink_leaf(v)

    @property
    def _kpos(self) -> Tensor:
        """Positions of the K/V gathered over cp, in cp-rank order."""
        return torch.cat([data.cp_positions(self.rp.seq_len, self.plan.cp, r) for r in range(self.plan.cp)]).to(self.device)

    def forward(self, ins: Instr, record: bool) -> None:
        l, mb = ins.layer, ins.mb
        ins_names, out_names = self.blocks_io[ins.block]
        vals = [self.read((n, l, mb)) for n in ins_names]
        if record:
            vals = [v.detach().requires_grad_(v.is_floating_point()) if isinstance(v, Tensor) else v for v in vals]
        with torch.set_grad_enabled(record):
            outs = self._run_block(ins.block, l, mb, vals)
        if ins.block == "loss":
            self.loss = outs[0].detach() if self.loss is None else self.loss + outs[0].detach()
        if not record:
            for n, o in zip(out_names, outs):
                self.env[(n, l, mb)] = o
            if self.plan.sp and ins.block in _GATHERED_LAST:
                self._release_gathered(ins.block, l, mb, [])
            return
        for n, o in zip(out_names, outs):
            self.env[(n, l, mb)] = o.detach() if isinstance(o, Tensor) and o.grad_fn is not None else o
        if _DEALLOCATE and not self.xla:
            for o in outs:
                _deallocate(o)
            if ins.block in _PERMUTED_INPUT:
                name = _PERMUTED_INPUT[ins.block]
                self._free_permuted_input(name, l, mb, vals[ins_names.index(name)])
        self.records[(ins.block, l, mb)] = (ins_names, vals, out_names, outs)
        if self.plan.sp and ins.block in _GATHERED_LAST:
            self._release_gathered(ins.block, l, mb, vals)

    def _free_permuted_input(self, name: str, l: int, mb: int, xr: Tensor) -> None:
        """Tokens as an all-to-all delivered them: once permuted (into expert order for the experts,
        Megatron's sort_chunks_by_idxs; back into token order for the combine, its unpermute), nothing
        needs them: the permutation's backward keeps only the indices, the GEMMs and the routing
        weights save the permuted copy. The record keeps a leaf of the same shape over a single
        element (a zero-stride expansion: autograd accumulates its gradient by the leaf's shape), and
        the environment lets go of the received buffer."""
        k = self.resolve((name, l, mb))
        if k is not None:
            del self.env[k]
        _shrink_leaf(xr)

    def loss_seed(self, loss: Tensor) -> Tensor:
        """The loss's gradient: the loss scale, which overflows to inf where it exceeds the dtype's range
        (as `loss * scale` does), so that the step is skipped rather than the run stopped."""
        return torch.ones_like(loss).mul_(self.scaler.scale)

    def weight_grads(self, ins: Instr) -> None:
        """A zero-bubble schedule's W for one block: the weight gradients its B deferred, or, for a
        block whose backward is all weight gradient (the embedding), that whole backward."""
        deferred = self.deferred.pop((ins.block, ins.layer, ins.mb), None)
        if deferred is None:
            return self.backward(ins, split=False)
        deferred.run()
        if self.plan.sp:  # tp_overlap: the input the weight-gradient GEMM re-read, kept past B for it
            self.env.pop((_REGATHERED_INPUT.get(ins.block, ""), ins.layer, ins.mb), None)

    def backward(self, ins: Instr, split: Optional[bool] = None) -> None:
        l, mb = ins.layer, ins.mb
        rec = self.records.pop((ins.block, l, mb), None)
        if rec is None:
            raise RuntimeError(f"rank {self.rank}: {ins.name} has no forward record (forward not run, or run without grad)")
        ins_names, vals, out_names, outs = rec
        ts, gs = [], []
        for n, o in zip(out_names, outs):
            if isinstance(o, Tensor) and o.requires_grad:
                g = self.loss_seed(o) if ins.block == "loss" else self.take_grad((n, l, mb))
                if g is not None:
                    ts.append(o)
                    gs.append(g)
        if split is None:
            split = self.split or (ins.block, l, mb) in self.split_blocks
        kept = ""  # under sp, a deferred weight-gradient GEMM's re-gathered input, which it reads
        if ts and split:
            inputs = [v for v in vals if isinstance(v, Tensor) and v.requires_grad]
            deferred = backward_inputs(tuple(ts), tuple(gs), inputs, _run_backward_to, _run_backward,
                                       self.split_analyses, (ins.block, l))
            if deferred is not None:
                self.deferred[(ins.block, l, mb)] = deferred
                kept = _REGATHERED_INPUT.get(ins.block, "") if self.plan.sp else ""
        elif ts:
            _run_backward(tuple(ts), tuple(gs))
        for n, v in zip(ins_names, vals):
            if isinstance(v, Tensor) and v.grad is not None:
                self.add_grad((n, l, mb), v.grad)
                v.grad = None  # else the graph a deferred W keeps (which saved v) would keep it too
        for n in ins_names + out_names:  # forward values are no longer needed (records hold their own)
            if (n == "xma" and ins.block == "moe_out" and self.plan.sp) or n == kept:
                continue  # the router's backward reads the re-gathered input after this one
            k = self.resolve((n, l, mb))
            if k is not None:
                del self.env[k]

    def drop_layer(self, l: int, mb: int) -> None:
        """Full recompute: after the layer's forward keep only its input (recompute rebuilds the rest)."""
        keep = {("x", l, mb), ("x", l + 1, mb)}
        if ("x", l + 1, mb) not in self.env and ("y2p", l, mb) in self.env:
            self.env[("x", l + 1, mb)] = self.env[("y2p", l, mb)]  # the next layer reads it
        for key in [k for k in self.env if k[1] == l and k[2] == mb and k not in keep]:
            del self.env[key]

    # --- collectives ------------------------------------------------------------------------------
    def collective(self, ins: Instr) -> None:
        block = ins.block
        verb = ins.collective
        g = self.group(ins)
        if block in self.colls:
            return self.activation_collective(ins, verb, g)
        if block == "norm_grads":
            return self.norm_grads(ins, g)
        if block in ("unscale", "grad_norm"):
            return self.step_reduction(ins, g)
        if block == "grads":
            return self.z3_grads(ins, g)
        if block.startswith("grads_rep"):
            return self.grads_rep(ins, g)
        if block.startswith("grads"):
            return self.grads_bucket(ins, verb, g)
        if block.startswith("params"):
            return self.params_gather(ins, g)
        if block == "gather":
            return self.z3_gather(ins, g)
        if block in ("act_gather", "grad_gather"):
            return self.pipeline_gather(ins, g)
        if block == "tied":
            return self.tied_grads(ins, g)
        raise ValueError(f"rank {self.rank}: {ins.name}: no executor for collective block {block!r}")

    def _issue(self, ins: Instr, works: list, finish: Optional[Callable[[], None]]) -> _Inflight:
        w = _Inflight(self, ins, works, finish, self.send_waiter if ins.kind == "send" else None)
        self.inflight[ins.name] = w
        return w

    def activation_collective(self, ins: Instr, verb: str, g) -> None:
        src, dst = _coll_keys(ins.block, ins.layer, ins.mb, self.colls)
        dim = self.colls[ins.block][2]
        n = len(ins.group)
        backward = ins.phase == "bwd" and ins.block not in _REGATHERS
        # sp: a norm's output gathered for a column-parallel GEMM (forward, or again for its backward)
        gathered_input = self.plan.sp and not backward and (ins.block in _SP_GATHERS or ins.block in _REGATHERS)
        if ins.block in ("dispatch", "combine"):
            return self.alltoall(ins, g, src, dst, backward)
        if ins.block in ("heads_in", "heads_out"):
            return self.heads_exchange(ins, g, backward)
        if backward:
            x = self.take_grad(dst)
            extras = self._tp_partial_grads(ins) if ins.block in _TP_PARTIAL else []
            target = src
        else:
            x = self.read(src).detach()
            extras = []
            target = dst
        if x is None:
            raise RuntimeError(f"rank {self.rank}: {ins.name}: nothing to {verb} (no gradient arrived)")
        x = x.detach()
        shape = x.shape
        flat_extras = [e.reshape(-1) for _, e in extras]

        if verb == "allreduce":
            buf = torch.cat([x.reshape(-1)] + flat_extras) if extras else x.clone()
            op = dist.ReduceOp.MAX if ins.block == "ce_max" else dist.ReduceOp.SUM
            work = self.comm.all_reduce(buf, op=op, group=g, async_op=True)

            def finish():
                self._deliver(target, buf[: x.numel()].view(shape), backward)
                self._deliver_extras(extras, buf[x.numel() :])
        elif verb == "allgather":
            xt = x.movedim(dim, 0).contiguous()
            out = torch.empty((n * xt.shape[0],) + xt.shape[1:], dtype=x.dtype, device=x.device)
            work = self.comm.all_gather(out, xt, group=g, async_op=True)

            def finish():
                t = out.movedim(0, dim)
                if gathered_input:  # Megatron's (s, b, h) gathers are contiguous; a (B, T, C) one is made so
                    t = t.contiguous()
                self._deliver(target, t, backward)
        elif verb == "reducescatter":
            xt = x.movedim(dim, 0).contiguous()
            chunks = xt.chunk(n, dim=0)
            # with extras (replicated params' grads) every slot carries them: each rank gets the full sum
            buf = torch.cat([torch.cat([c.reshape(-1)] + flat_extras) for c in chunks])
            out = torch.empty(buf.numel() // n, dtype=x.dtype, device=x.device)
            work = self.comm.reduce_scatter(out, buf, group=g, async_op=True)
            cshape = chunks[0].shape

            def finish():
                self._deliver(target, out[: chunks[0].numel()].view(cshape).movedim(0, dim), backward)
                self._deliver_extras(extras, out[chunks[0].numel() :])
        else:
            raise ValueError(f"rank {self.rank}: {ins.name}: {verb} is not an activation collective")
        w = self._issue(ins, [work], finish)
        if backward:
            self.d[target] = w
            for name, _ in extras:
                self.g_pending[name] = w
        else:
            self.env[target] = w
            if ins.block in _REGATHERS:
                self.env.pop(src, None)  # the slice's last reader
            else:
                self._consumed(src)

    def norm_grads(self, ins: Instr, g) -> None:
        """Under sp: sum over tp the partial gradients of the norms no activation collective
        carries (`_SP_PARTIAL`)."""
        extras = self._tp_partial_grads(ins)
        if not extras:
            return
        # an earlier micro-batch's sum still in flight (a zero-bubble schedule runs its deferred weight
        # passes back to back) delivers first: `g_pending` tracks only the latest
        for name, _ in extras:
            w = self.g_pending.get(name)
            if w is not None:
                w.wait()
        buf = torch.cat([e.reshape(-1) for _, e in extras])
        work = self.comm.all_reduce(buf, op=dist.ReduceOp.SUM, group=g, async_op=True)
        w = self._issue(ins, [work], lambda: self._deliver_extras(extras, buf))
        for name, _ in extras:
            self.g_pending[name] = w

    def tied_grads(self, ins: Instr, g) -> None:
        """Tied embeddings over a pipeline: sum the gradients of the first stage's embedding and the
        last stage's copy (`stage_specs`), so that both take the same step: data-parallel-reduced
        (ZeRO-0, Megatron-LM), or under ZeRO-1 this rank's own, before its bucket is reduce-scattered
        (DeepSpeed's pipeline engine; the program orders it so), the sum going back where the bucket
        reads it."""
        name = "embed.wte"
        w = self.g_pending.pop(name, None)
        if w is not None:
            w.wait()
        t = self.reduced.pop(name) if name in self.reduced else self.local_grad(name)
        work = self.comm.all_reduce(t, op=dist.ReduceOp.SUM, group=g, async_op=True)
        store = self.g if self.plan.zero >= 1 else self.reduced

        def finish():
            store[name] = t

        self.g_pending[name] = self._issue(ins, [work], finish)

    def _consumed(self, key: tuple) -> None:
        """A forward collective has read `key`, its only reader (a row-parallel partial sum, the
        tokens an all-to-all sends, K/V before their cp all-gather): drop it from the environment, so
        that it lives only as long as the collective (and whatever autograd saved) needs it."""
        if key not in self.env:
            return
        name, l, mb = key
        # the residual stream gathered under sp: the gathered copy is what the blocks read (full
        # recompute re-reads the layer's input, so it stays there)
        if name in _CONSUMED or (name == "x" and (l == self.L or (l, mb) not in self.full_recompute_layers)):
            del self.env[key]

    def _deliver(self, key: tuple, t: Tensor, backward: bool) -> None:
        if backward:
            if self.d.get(key) is not None and isinstance(self.d[key], _Inflight):
                del self.d[key]
            self.add_grad(key, t)
        else:
            self.env[key] = t

    def _tp_partial_grads(self, ins: Instr) -> list[tuple[str, Tensor]]:
        """Gradients of parameters replicated over tp but computed partially (norms, router): taken
        out of .grad here and summed by this collective (zeros where a rank has none yet, so every
        rank sends the same layout)."""
        if len(ins.group) == 1:
            return []
        unit = ins.layer
        out = []
        for n, s in self.specs.items():
            if s.unit == unit and self.partial_by.get(n) == ins.block:
                p = self.p[n]
                g = p.grad if p.grad is not None else torch.zeros(self.shapes[n], dtype=p.dtype, device=self.device)
                p.grad = None
                out.append((n, g))
        return out

    def _deliver_extras(self, extras: list[tuple[str, Tensor]], flat: Tensor) -> None:
        off = 0
        for name, e in extras:
            r = flat[off : off + e.numel()].view(e.shape).to(self.gdtype, copy=True)
            off += e.numel()
            self.g[name] = r if name not in self.g else self.g[name] + r
            if self.g_pending.get(name) is not None and self.g_pending[name].done:
                del self.g_pending[name]

    def alltoall(self, ins: Instr, g, src: tuple, dst: tuple, backward: bool) -> None:
        """MoE dispatch / combine over ep. Dispatch first exchanges the per-expert counts (a small
        blocking all-to-all), so every rank knows how many tokens it receives from each peer."""
        l, mb = ins.layer, ins.mb
        n = len(ins.group)
        if ins.block == "dispatch" and not backward:
            route: Route = self.read(("route", l, mb))
            counts = route.counts.to(torch.int64)
            rc = torch.empty_like(counts)
            self.comm.all_to_all_single(rc, counts, group=g)  # counts for my local experts from each source
            rc = rc.view(n, -1)
            send = counts.view(n, -1).sum(1).tolist()
            recv = rc.sum(1).tolist()
            self.env[("rcounts", l, mb)] = rc
            self.env[("splits", l, mb)] = (send, recv)
        send, recv = self.env[("splits", l, mb)]
        # dispatch fwd and combine bwd move tokens to the experts; the other two move them back
        to_experts = (ins.block == "dispatch") != backward
        in_split, out_split = (send, recv) if to_experts else (recv, send)
        x = (self.take_grad(dst) if backward else self.read(src)).detach().contiguous()
        out = torch.empty((sum(out_split), x.shape[1]), dtype=x.dtype, device=x.device)
        work = self.comm.all_to_all_single(out, x, out_split, in_split, group=g, async_op=True)
        target = src if backward else dst
        w = self._issue(ins, [work], lambda: self._deliver(target, out, backward))
        (self.d if backward else self.env)[target] = w
        if not backward:
            self._consumed(src)

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
            ins = next(i for i in self.instrs if i.block == "gather" and (self._cls(i.axis), i.layer) == key)
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


def run_rank(rp, instrs: list[Instr], *, steps: int, groups, tracer, device: "torch.device", seed: int = 0) -> dict:
    """Run `steps` training steps of this rank's program. Returns {"losses": [float per step] (on the
    rank(s) that compute the loss; others return []), "step_times_s": [...], "params": {name: tensor
    (cpu, this rank's shard)}, "peak_memory_bytes": int}, and under loss_scale "loss_scales" (per
    step) and "skipped_steps" (those whose gradients overflowed on some rank). Peak memory is that of
    the first step (optimizer states exist from the start, so it is the steady state): on CUDA
    `max_memory_allocated`, on CPU the live tensor storages of device memory (not the communication
    backend's temporaries, such as gloo's copy inside reduce-scatter, nor the host copies of an
    offloaded optimizer); there also `largest_alloc_bytes`, the largest single tensor storage the
    interpreter's ops created in that step. On an XLA device the runtime's peak where it reports one
    (TPU, GPU), else 0."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    xla = device.type == "xla"
    comm = None
    if xla:  # the process groups' backend decides how XLA tensors travel (see simexec.exec.rank.xla)
        from simexec.exec.rank import xla as X

        comm = X.comm_for(dist.get_backend() if dist.is_initialized() else "xla")
    r = _Rank(rp, instrs, groups, tracer, device, seed, comm)
    losses, times, cpu, main_cpu = [], [], [], []  # the process's CPU time a step (every thread), this thread's
    peak = largest = 0
    for step in range(steps):
        tracker = None
        if step == 0:
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            elif not xla:  # XLA tensors have no storage to count: the runtime's figure (0 on CPU)
                tracker = _LiveBytes()
                for t in r.host_tensors():  # device memory only: host copies are not the accelerator's
                    tracker.ignore(t)
                held = [r.p, r.shards, r.z3_buffers, r.z3_gbuffers, r.gbuf]
                for t in [t for d in held for t in d.values()] + r.opt.state_tensors():
                    tracker.track(t)
                tracker.__enter__()
                _TRACKER[0] = tracker
        if cuda:
            torch.cuda.synchronize(device)
        t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
        try:
            loss = r.run_step(step)
        finally:
            if tracker is not None:
                tracker.__exit__(None, None, None)
                _TRACKER[0] = None
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        main_cpu.append(time.thread_time() - m0)  # read inside the process's interval: never above it
        cpu.append(time.process_time() - c0)
        if step == 0:
            if xla:
                peak = X.peak_memory(device)
            else:
                peak = int(torch.cuda.max_memory_allocated(device)) if cuda else tracker.peak
                largest = 0 if cuda else tracker.largest
        loss = r.global_loss(loss)
        if loss is not None:
            losses.append(loss)
    out = {"losses": losses, "step_times_s": times, "cpu_times_s": cpu, "main_cpu_times_s": main_cpu,
           "params": r.final_params(), "peak_memory_bytes": peak, "largest_alloc_bytes": largest}
    if rp.plan.loss_scale > 0:
        out.update(loss_scales=r.scaler.scales, skipped_steps=r.scaler.skipped)
    return out
