"""The compute instructions of a rank: one block of `simexec.exec.nn.gpt.GPT` forward, recomputed or
backward, dispatched by block (the optimizer's blocks go to `simexec.exec.rank.optimizer_step`, ring
attention's to `simexec.exec.rank.ring`).

Per-block autograd. A forward block takes detached copies of its inputs that require grad, runs the
block, keeps (inputs, outputs) in a record; its backward hands the outputs' gradients straight to the
autograd engine and the inputs' `.grad` on. A recorded output keeps only its autograd node
(`_deallocate`), and a recorded input nothing reads any more only its shape (`_shrink_leaf`), so that
a record does not keep alive what the backward does not read.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, get_gradient_edge

from simexec.exec.nn import data
from simexec.exec.nn.weight_grads import backward_inputs
from simexec.exec.rank.collectives import InflightComm
from simexec.exec.rank.dataflow import (LAST_READER_OF_GATHERED, PERMUTED_INPUT, REGATHERED_INPUT, SP_REGATHERS,
                                        collective_keys, upstream)
from simexec.program.instructions import Instr
from simexec.program.lowering.emit import ZERO3_COPY_BLOCKS


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



class BlockCompute:
    """The compute instructions of `RankInterpreter` (`simexec.exec.rank.interpreter`), a mixin:
    `compute` dispatches one, `forward` / `backward` / `weight_grads` run a block of the model, and
    `drop_layer` is full recompute's drop after a layer's forward.

    Reads of the rank: `rp`, `plan`, `model`, `device`, `rank`, `xla`, `blocks_io`, `gathered_dispatch`, `token_weight`,
    `scaler`, `recomputed`, `split`, `split_blocks`, `split_analyses`, `z3_pending`, `z3_units`, `ring`,
    `ring_hop`, `heads`, `heads_pos`, `read`, `resolve`, `take_grad`, `add_grad`, `batch`, and the
    other mixins' compute (`optimizer_step`, `grad_norm`, `unscale`, `bucket_in`, `bucket_out`,
    `ring_forward`, `ring_backward`), under offload_layers `act_offload`, `act_last_read`, `act_copy_pos`
    and `act_reload_done` (`plan_offload_releases`'). Shares with it: `env`, `records`, `deferred`, `loss`,
    `act_release_after`."""

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
        if ins.block in ZERO3_COPY_BLOCKS:  # priced by the simulator; the flat buffers' copies are in z3_*
            return None
        if self.z3_pending:
            for unit in self.z3_units(ins.layer):
                for cls in ("dense", "expert"):
                    w = self.z3_pending.get((cls, unit))
                    if w is not None:
                        w.wait()
        record = (ins.phase == "recompute" or not self.recomputed
                  or (ins.block, ins.layer, ins.mb) not in self.recomputed)
        if self.act_offload is not None and self.act_offload.covers(ins):  # offload_layers: saved via the host
            with self.act_offload.hooks(ins.layer, ins.mb, {t.untyped_storage().data_ptr() for t in self.p.values()}):
                return self.block_pass(ins, record)
        return self.block_pass(ins, record)

    def block_pass(self, ins: Instr, record: bool) -> None:
        """A model block's forward, recompute, backward or weight pass."""
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
        if block == "norm":  # the main head's final norm, or an MTP depth's (its head: layer `mtp_head`)
            d = l - self.L - 1 - self.m.mtp_layers
            return (M.final_norm(xs[0], M.mtp_norm(d)),)
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
            if self.gathered_dispatch:
                return M.router_gathered(l, xs[0], self._fetch("xma", l, mb))
            return M.router(l, xs[0], self._fetch("xma", l, mb))
        if block == "experts" and self.gathered_dispatch:
            experts = self.env.get(("gathered_experts", l, mb))
            if experts is None:  # no dispatch (ep = 1): the tokens are this rank's own
                experts = self.read(("route", l, mb)).experts
            return (M.experts_gathered(l, xs[0], experts),)
        if block == "experts":
            counts = self.env.get(("rcounts", l, mb))
            if counts is None:  # no dispatch (ep = 1): every routed token is here
                counts = self.read(("route", l, mb)).counts.view(1, -1)
            return (M.experts(l, xs[0], counts),)
        if block == "moe_out" and self.gathered_dispatch:
            return (M.moe_out_weighted(l, *xs, self._fetch("xma", l, mb)),)
        if block == "moe_out":
            return (M.moe_out(l, *xs, self.read(("route", l, mb)), self._fetch("xma", l, mb)),)
        if block == "mtp_embed":
            sh = self.batch(mb).mtp[l - self.L - 1]
            return (M.embed(sh.tokens, sh.pos),)
        if block == "mtp_norm":
            return (M.mtp_norms(l - self.L - 1, xs[0], xs[1]),)
        if block == "mtp_in":
            return (M.mtp_proj(l - self.L - 1, xs[0], self._fetch("eha", l, mb)),)
        d = l - self.L - 1 - self.m.mtp_layers  # an MTP depth's use of the head: layer `mtp_head`
        if block == "head":
            return M.head(xs[0], self._fetch("xh", l, mb), M.mtp_norm(d), normed=len(self.blocks_io["head"][1]) > 2)
        if block == "xent":
            return (M.xent(xs[0], xs[1], self.batch(mb).mtp[d].targets if d >= 0 else self.batch(mb).targets),)
        if block == "loss" and d >= 0:
            tokens = self.plan.gbs * (self.rp.seq_len - d - 1)  # the global batch's tokens depth d predicts
            return (M.loss(xs[0], M.mtp_scale(d, tokens), self.batch(mb).mtp[d].mask),)
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
            if isinstance(v, InflightComm):
                v.wait()
                v = self.env.get(key)
            if v is None:
                raise RuntimeError(f"rank {self.rank}: the backward of layer {l} micro-batch {mb} needs {name} "
                                   "re-gathered, and no re-gather has delivered it")
            return v

        return fetch

    def _reads_slice(self, block: str) -> bool:
        """A MoE layer no tp collective surrounds (`GPT.moe_on_slice`): moe_out reads the second norm's
        slice itself, which the router's matmul saved, so there is no gathered copy to let go of."""
        return block == "moe_out" and self.model.moe_on_slice

    def plan_offload_releases(self) -> tuple[dict[tuple, tuple[int, str]], dict[str, int], dict[str, tuple[int, int]]]:
        """offload_layers, once per run: (activation key -> (index, name) of its last forward reader in
        the program, act_d2h copy name -> its index, the last backward compute of each offloaded layer
        -> (layer, micro-batch)). A key counts as read by an instruction that reads it or a name it
        stands for where a collective is absent (`upstream`), so the table errs late."""
        last: dict[tuple, tuple[int, str]] = {}
        copies: dict[str, int] = {}
        done: dict[tuple[int, int], str] = {}
        if self.act_offload is None:
            return last, copies, {}
        p = self.plan
        for k, ins in enumerate(self.instrs):
            if ins.block == "act_d2h":
                copies[ins.name] = k
            if ins.kind == "compute" and ins.phase in ("bwd", "wgrad") and 0 <= ins.layer < self.act_offload.layers:
                done[(ins.layer, ins.mb)] = ins.name
            if ins.phase != "fwd":
                continue
            if ins.kind == "compute" and ins.block in self.blocks_io:
                reads = [(n, ins.layer, ins.mb) for n in self.blocks_io[ins.block][0]]
            elif ins.kind == "collective" and ins.block in self.colls:
                reads = [collective_keys(ins.block, ins.layer, ins.mb, self.colls, self.L, self.D)[0]]
            else:
                continue
            for key in reads:
                key = self.alias(key)
                while key is not None:
                    last[key] = (k, ins.name)
                    key = upstream(key, p.sp, self.L, self.D, self.two_hops)
        return last, copies, {name: lm for lm, name in done.items()}

    def release_offloaded_inputs(self, ins: Instr, moved: set[int]) -> None:
        """offload_layers: once a layer's saved tensors are on the host (`copy.act_d2h`), nothing on the
        interpreter's side keeps their device storages (`moved`), as TE's release lets them die: the
        layer's blocks' records turn the inputs among them into one-element expansions of their shape,
        and the environment lets go of each activation on them now if its last forward reader has run,
        else right after that reader (`release_after_reader`)."""
        if not _DEALLOCATE or self.xla:
            return
        l, mb = ins.layer, ins.mb
        here = self.act_copy_pos[ins.name]
        if self.plan.sp:  # the norm slices the backward re-gathers go to the host with the saved tensors
            keys = [(src, l, mb) for src, _, _ in SP_REGATHERS.values()]
            items = [(k, self.env.pop(k)) for k in keys if isinstance(self.env.get(k), Tensor)
                     and self.act_last_read.get(k, (-1, ""))[0] < here]
            if items:
                self.act_offload.stash(l, mb, items)
        for rk, rec in list(self.records.items()):
            block, bl, bmb = rk
            if bl == l and bmb == mb:
                for v in rec[1]:
                    if isinstance(v, Tensor) and v.untyped_storage().data_ptr() in moved:
                        _shrink_leaf(v)
                if not self.split and rk not in self.split_blocks:
                    # a view output (q of the projection, the attention's merged heads) keeps its base
                    # alive, where `_deallocate` empties the others: its gradient edge is what the
                    # backward starts from
                    outs = tuple(get_gradient_edge(o) if isinstance(o, Tensor) and o._base is not None
                                 and o.grad_fn is not None and o.untyped_storage().data_ptr() in moved else o
                                 for o in rec[3])
                    self.records[rk] = (*rec[:3], outs)
        for key, v in list(self.env.items()):
            if not (isinstance(v, Tensor) and v.untyped_storage().data_ptr() in moved):
                continue
            k, reader = self.act_last_read.get(key, (-1, ""))
            if k < here:
                del self.env[key]
            else:
                self.act_release_after.setdefault(reader, []).append(key)

    def release_after_reader(self, name: str) -> None:
        """offload_layers: the environment's offloaded activations whose last forward reader `name` was;
        after an offloaded layer's backward, its reloaded tensors, all together (TE's
        `release_all_memory`, the lowering's `release_reloaded`)."""
        for key in self.act_release_after.pop(name):
            self.env.pop(key, None)
        done = self.act_reload_done.get(name)
        if done is not None:
            self.act_offload.release(*done)

    def _release_gathered(self, block: str, l: int, mb: int, vals: list) -> None:
        """Under sp, once the last forward reader of a gathered norm output has run: nothing keeps
        it (the GEMMs saved only the slice, re-gathered in the backward). The environment lets go of
        it, and so do the readers' records, whose inputs become one-element expansions of its shape."""
        name = LAST_READER_OF_GATHERED[block]
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
            if self.plan.sp and ins.block in LAST_READER_OF_GATHERED and not self._reads_slice(ins.block):
                self._release_gathered(ins.block, l, mb, [])
            return
        for n, o in zip(out_names, outs):
            self.env[(n, l, mb)] = o.detach() if isinstance(o, Tensor) and o.grad_fn is not None else o
        if _DEALLOCATE and not self.xla:
            for o in outs:
                _deallocate(o)
            if ins.block in PERMUTED_INPUT:
                name = PERMUTED_INPUT[ins.block]
                self._free_permuted_input(name, l, mb, vals[ins_names.index(name)])
        self.records[(ins.block, l, mb)] = (ins_names, vals, out_names, outs)
        if self.plan.sp and ins.block in LAST_READER_OF_GATHERED and not self._reads_slice(ins.block):
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
            self.env.pop((REGATHERED_INPUT.get(ins.block, ""), ins.layer, ins.mb), None)

    def backward(self, ins: Instr, split: Optional[bool] = None) -> None:
        l, mb = ins.layer, ins.mb
        rec = self.records.pop((ins.block, l, mb), None)
        if rec is None:
            raise RuntimeError(f"rank {self.rank}: {ins.name} has no forward record (forward not run, or run without grad)")
        ins_names, vals, out_names, outs = rec
        ts, gs = [], []
        for n, o in zip(out_names, outs):
            if (isinstance(o, Tensor) and o.requires_grad) or isinstance(o, GradientEdge):  # (offloaded view)
                g = self.loss_seed(o) if ins.block == "loss" else self.take_grad((n, l, mb))
                if g is not None and ins.block == "mtp_in" and self.plan.tp > 1 and not self.plan.sp:
                    # without sp the output gather's backward is a split: this rank's hidden columns
                    g = g[..., self.model.hlo : self.model.hhi].contiguous()
                if g is not None and n == "hn" and self.plan.tp > 1:
                    # the next MTP depth's gradient of the normed hidden state, whole: head_in's backward
                    # sums this block's input and norm gradients over tp, so each rank takes its 1/tp
                    g = g / self.plan.tp
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
                kept = REGATHERED_INPUT.get(ins.block, "") if self.plan.sp else ""
        elif ts:
            _run_backward(tuple(ts), tuple(gs))
        for n, v in zip(ins_names, vals):
            if isinstance(v, Tensor) and v.grad is not None:
                self.add_grad((n, l, mb), v.grad)
                v.grad = None  # else the graph a deferred W keeps (which saved v) would keep it too
        for n in ins_names + out_names:  # forward values are no longer needed (records hold their own)
            # the router's backward reads the re-gathered input after this one; under sp an MTP depth's
            # hprev is the head's norm output, which the head's re-gather reads after this
            if (n in ("xma", "hprev") and ins.block in ("moe_out", "mtp_norm") and self.plan.sp) or n == kept:
                continue
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

