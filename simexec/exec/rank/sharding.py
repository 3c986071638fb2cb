"""Where a rank's parameters and gradients live under ZeRO 0-3, and the collectives that move them.

Parameter storage per plan: plain tensors (ZeRO 0); plus one flat shard per gradient bucket, updated
by Adam and all-gathered back (ZeRO 1-2); or one flat shard per unit (embedding, layer, head) and
class (dense, expert), all-gathered into a buffer before each use (ZeRO-3: `fsdp`, `deepspeed` allocate it on
demand and frees it after the unit's last use; `yafsdp` uses two buffers preallocated at start,
even units in one and odd units in the other). Gradients: one flat buffer per bucket whose views are
the parameters' `.grad` (ZeRO 0-1); under ZeRO-2 a bucket's buffer made at its first gradient of a
micro-batch and freed once reduce-scattered; under ZeRO-3 a unit's gradients flattened on demand
(`fsdp`, `deepspeed`) or into one of two preallocated buffers (`yafsdp`), then reduce-scattered;
the shard is the first reduce-scatter's output, later ones summed into it, and is let go after the
optimizer step (`fsdp`, `yafsdp`), or every unit's shard allocated at start, summed into and
zeroed as each step starts (`deepspeed`). A `_Flat` is the layout of one bucket or unit.

Under `grad_fp32` with 16-bit parameters (Megatron-LM's `main_grad`) every gradient store above is
fp32: autograd still makes each 16-bit gradient, and a hook adds it into the parameter's fp32
gradient as it lands and lets it go (`_setup_grad_hooks`), so micro-batches accumulate, and
buckets reduce, in fp32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from simexec.exec.rank.collectives import InflightComm
from simexec.program.instructions import Instr
from simexec.program.lowering.emit import ZERO3_COPY_BLOCKS


@dataclass
class _Flat:
    """Parameters laid end to end, padded to a multiple of the group size; this rank owns one shard."""

    names: list[str]
    numels: list[int]
    shapes: list[torch.Size]
    group_size: int
    index: int  # this rank's position in the group
    total: int = 0
    shard: int = 0

    def __post_init__(self):
        self.total = sum(self.numels)
        self.shard = -(-self.total // self.group_size) if self.total else 0

    @property
    def padded(self) -> int:
        return self.shard * self.group_size

    def flatten(self, tensors: list[Tensor]) -> Tensor:
        flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0)
        return torch.nn.functional.pad(flat, (0, self.padded - self.total))

    def views(self, flat: Tensor) -> list[Tensor]:
        out, off = [], 0
        for n, s in zip(self.numels, self.shapes):
            out.append(flat[off : off + n].view(s))
            off += n
        return out

    def my_slice(self, flat: Tensor) -> Tensor:
        return flat[self.index * self.shard : (self.index + 1) * self.shard]


class Sharding:
    """The parameter and gradient storage of `RankInterpreter` (`simexec.exec.rank.interpreter`), a mixin: set up
    once (`setup_zero`, `setup_grad_buffers`), then the program's gradient and parameter
    collectives (`grads<k>`, `grads_rep<k>`, `params<k>`, ZeRO-3's `gather` and `grads`).

    Reads of the rank: `rank`, `instrs`, `specs`, `shapes`, `plan`, `device`, `dtype`, `xla`,
    `zero3` (the ZeRO-3 flavour's policy), `comm`, `issue` (an issued collective as an `InflightComm`).
    Shares with it: `p` (parameters by name; their `.data` and `.grad` are set here), `g` and
    `g_pending` (gradients moved out of `.grad`, and the collectives still summing them),
    `reduced` (ZeRO-0 bucket results). Its own: `buckets`, `pbuf`, `shards`, `gshard`,
    `gshard_pending`, `gbuf`, `gview`, `z2buf`, `z2_of`, `z2views`, `z3`, `z3_pending`,
    `z3_free_after`, `z3_buffers`, `z3_gbuffers`, `z3_gbusy`, `z3_gview`, `z3_live`.

    `gdtype` is the gradients' dtype: the parameters' own, or fp32 where `main_grads` (grad_fp32
    under a 16-bit dtype) keeps them apart from `.grad`, in `g`."""

    # --- parameters per unit and class ------------------------------------------------------------
    def unit_names(self, unit: int, cls: str) -> list[str]:
        return [n for n, s in self.specs.items() if s.unit == unit and (s.expert is not None) == (cls == "expert")]

    @staticmethod
    def param_class(axis: str) -> str:
        return "expert" if axis == "edp" else "dense"

    def _flat(self, names: list[str], group: tuple[int, ...]) -> _Flat:
        shapes = [self.shapes[n] for n in names]
        return _Flat(names, [math.prod(s) for s in shapes], shapes, len(group), group.index(self.rank))

    def setup_zero(self) -> None:
        """ZeRO-1/2: a flat shard per parameter bucket (`params<k>`); ZeRO-3: per gathered unit.

        ZeRO-1/2 keep a bucket's parameters as views of one flat buffer whose slice is this rank's
        shard (Megatron's distributed optimizer, DeepSpeed's flat groups): Adam updates the shard in
        place and `params<k>` all-gathers in place, so neither a copy of the shard nor a gathered
        buffer exists besides the parameters."""
        self.buckets: dict[tuple, _Flat] = {}  # (cls, items) -> layout; master shards in self.shards
        self.pbuf: dict[tuple, Tensor] = {}  # ZeRO-1/2: (cls, items) -> the bucket's flat parameters
        self.shards: dict[tuple, Tensor] = {}
        self.gshard: dict[tuple, Tensor] = {}  # reduce-scattered gradient shards
        self.gshard_pending: dict[tuple, InflightComm] = {}
        self.z3: dict[tuple, _Flat] = {}  # (cls, unit) -> layout
        self.z3_tied_head = False  # a tied LM head gathers the embedding's unit beside its own (`.tied`)
        self.z3_pending: dict[tuple, InflightComm] = {}
        self.z3_free_after: dict[int, list[tuple]] = {}
        self.z3_buffers: dict[tuple, Tensor] = {}  # yafsdp: (cls, parity) -> preallocated parameter buffer
        self.z3_gbuffers: dict[tuple, Tensor] = {}  # yafsdp: (cls, parity) -> preallocated gradient buffer
        self.z3_gbusy: dict[tuple, InflightComm] = {}  # yafsdp: the reduce-scatter still reading a gradient buffer
        self.z3_live: dict[tuple, Tensor] = {}  # fsdp: (cls, unit) -> gathered buffer in use
        self.z3_gview: dict[str, Tensor] = {}  # yafsdp: each parameter's view of its unit's gradient buffer
        for i in self.instrs:
            if i.kind == "collective" and i.block.startswith("params"):
                key = (self.param_class(i.axis), tuple(i.items))
                names = [n for u in i.items for n in self.unit_names(u, key[0])]
                self.buckets[key] = fl = self._flat(names, i.group)
                flat = fl.flatten([self.p[n].detach() for n in names])
                if self.xla:  # no aliasing views on XLA: a separate shard, gathered into a new buffer
                    self.shards[key] = fl.my_slice(flat).clone()
                    continue
                self.pbuf[key] = flat
                for n, v in zip(names, fl.views(flat)):
                    self.p[n].data = v
                self.shards[key] = fl.my_slice(flat)
            if i.kind == "collective" and i.block == "gather":
                key = (self.param_class(i.axis), i.layer)
                if key not in self.z3:
                    names = self.unit_names(i.layer, key[0])
                    self.z3[key] = fl = self._flat(names, i.group)
                    self.shards[key] = fl.my_slice(fl.flatten([self.p[n].detach() for n in names])).clone()
        if self.held_gshards:  # DeepSpeed's gradient partition (stage 2: per bucket; stage 3: per unit)
            for key, fl in {**self.buckets, **self.z3}.items():
                self.gshard[key] = torch.zeros(fl.shard, device=self.device, dtype=self.gdtype)
        if self.z3:
            empty = torch.empty(0, device=self.device, dtype=self.dtype)
            for (cls, unit), fl in self.z3.items():
                for n in fl.names:
                    self.p[n].data = empty  # parameters live as shards until gathered
            if self.zero3.preallocated_buffers:
                for cls in {c for c, _ in self.z3}:
                    size = max(fl.padded for (c, _), fl in self.z3.items() if c == cls)
                    for parity in (0, 1):
                        self.z3_buffers[(cls, parity)] = torch.empty(size, device=self.device, dtype=self.dtype)
                        self.z3_gbuffers[(cls, parity)] = torch.empty(size, device=self.device, dtype=self.gdtype)
            # a unit's buffer is released after its last compute before its next gather; a tied LM head
            # reads the embedding's unit too, where the program gathers it for the head (`.tied`), and
            # an MTP depth the embedding's and the head's (`z3_units`)
            last: dict[tuple, Optional[int]] = {}
            self.z3_tied_head = any(i.block == "gather" and i.layer == -1 and i.name.endswith(".tied")
                                    for i in self.instrs)

            def uses(i: Instr, unit: int) -> bool:
                return unit in self.z3_units(i.layer)

            def close(key):
                if last.get(key) is not None:
                    self.z3_free_after.setdefault(last[key], []).append(key)

            for k, i in enumerate(self.instrs):
                if i.kind == "collective" and i.block == "gather":
                    key = (self.param_class(i.axis), i.layer)
                    close(key)
                    last[key] = None
                elif i.kind == "compute" and i.block not in ("optim", "cpu_optim", *ZERO3_COPY_BLOCKS):
                    for key in last:
                        if uses(i, key[1]):
                            last[key] = k
            for key in last:
                close(key)

    def z3_units(self, layer: int) -> tuple[int, ...]:
        """The ZeRO-3 units a compute instruction of `layer` reads: its own; a tied LM head also the
        embedding's; an MTP depth's (its block and its head, layer + depths) also the embedding's and the
        head's (over a pipeline the head's unit holds the embedding's copy), its head also the depth's
        (its final norm)."""
        L, D = self.m.layers, self.m.mtp_layers
        if D and layer > L:
            return (layer - D if layer > L + D else layer, -1, L)
        if layer == L and self.z3_tied_head:
            return (L, -1)
        return (layer,)

    def setup_grad_buffers(self) -> None:
        """One flat gradient buffer per bucket (`grads<k>`), each parameter's `.grad` a view into it:
        autograd accumulates in place and the bucket's collective runs on the buffer without a copy
        (Megatron's contiguous gradient buffer; DDP's gradient_as_bucket_view). Not for ZeRO-2, whose
        point is that full gradients are freed once reduce-scattered: there `.grad` is allocated by
        autograd and moved into its bucket's flat buffer one gradient at a time, and the buffer is
        freed once reduce-scattered."""
        self.gbuf: dict[tuple, Tensor] = {}
        self.gview: dict[str, Tensor] = {}
        self.z2buf: dict[tuple, Tensor] = {}  # ZeRO-2: this micro-batch's bucket buffers, until reduce-scattered
        self._setup_grad_hooks()
        self.bucket_keys: dict[str, tuple] = {}  # grad_bucket_view=0: bucket number -> bucket
        if self.plan.zero >= 2 or self.xla:  # XLA: no aliasing .grad views; buckets are flattened copies
            return
        covered: set[str] = set()
        for i in self.instrs:
            if not (i.kind == "collective" and i.block.startswith("grads") and i.block[5:].isdigit()):
                continue
            key = (self.param_class(i.axis), tuple(i.items))
            self.bucket_keys.setdefault(i.block[5:], key)
            names = [n for u in i.items for n in self.unit_names(u, key[0])]
            if key in self.gbuf or any(n in covered for n in names):
                continue  # the same bucket on another micro-batch (or another grouping: copied then)
            fl = self.buckets.get(key) or self._flat(names, i.group)
            self.buckets.setdefault(key, fl)
            self.gbuf[key] = buf = torch.zeros(fl.padded, dtype=self.gdtype, device=self.device)
            covered.update(names)
            if self.plan.grad_bucket_view:
                for n, v in zip(names, fl.views(buf)):
                    self.gview[n] = v
        # parameters no bucket covers (dp = 1): Megatron's DDP wrapper allocates their main_grad
        # buffer all the same, at construction, so gradients are resident from the start
        rest = [n for n in self.p if n not in covered]
        if rest:
            key = ("local", ())
            fl = self.buckets[key] = self._flat(rest, (self.rank,))
            self.gbuf[key] = buf = torch.zeros(fl.padded, dtype=self.gdtype, device=self.device)
            for n, v in zip(rest, fl.views(buf)):
                self.gview[n] = v

    def _setup_grad_hooks(self) -> None:
        """Hooks that move each gradient where it is kept as autograd accumulates it.

        ZeRO-2: into its bucket's buffer (DeepSpeed's reduce buckets), so a bucket's gradients never
        exist twice; the buffer is made at the bucket's first gradient of a micro-batch and freed once
        reduce-scattered. Main gradients (grad_fp32 under a 16-bit dtype, Megatron-LM's `main_grad`):
        each 16-bit gradient is added into the parameter's fp32 gradient (its bucket's view, ZeRO-2's
        buffer, YaFSDP's gradient buffer, or its own) and let go. A parameter whose partial gradient a
        tensor-parallel collective sums (`partial_by`) keeps it in `.grad` for that collective, whose
        sum lands in `g` in fp32."""
        self.z2_of: dict[str, tuple] = {}
        self.z2views: dict[tuple, dict[str, Tensor]] = {}
        if self.plan.zero == 2 and not self.xla:
            for i in self.instrs:
                if i.kind == "collective" and i.block.startswith("grads") and i.block[5:].isdigit():
                    key = (self.param_class(i.axis), tuple(i.items))
                    for n in (n for u in i.items for n in self.unit_names(u, key[0])):
                        self.z2_of.setdefault(n, key)
        if self.main_grads:
            hooked = [n for n in self.p if not (self.plan.tp > 1 and n in self.partial_by)]
        else:
            hooked = list(self.z2_of)
        name_of = {id(self.p[n]): n for n in hooked}

        def hook(param: Tensor) -> None:
            n = name_of[id(param)]
            if not self.main_grads:  # `.grad` becomes the view: later micro-batches accumulate in place
                v = self._grad_home(n)
                if param.grad is not None and param.grad.data_ptr() != v.data_ptr():
                    v.copy_(param.grad)
                    param.grad = v
                return
            g, param.grad = param.grad, None
            main = self.g.get(n)
            if main is None:
                home = self._grad_home(n)
                if home is None:
                    self.g[n] = g.to(self.gdtype)
                    return
                main = self.g[n] = home
            main.add_(g)

        for n in hooked:
            self.p[n].register_post_accumulate_grad_hook(hook)

    def _grad_home(self, name: str) -> Optional[Tensor]:
        """Where a parameter's gradient accumulates, if somewhere is set aside for it: its view of a
        bucket's buffer (ZeRO-2's made here at the bucket's first gradient) or of YaFSDP's buffer."""
        key = self.z2_of.get(name)
        if key is None:
            v = self.gview.get(name)
            return v if v is not None else self.z3_gview.get(name)
        views = self.z2views.get(key)
        if key not in self.z2buf:
            fl = self.buckets[key]
            buf = self.z2buf[key] = torch.zeros(fl.padded, dtype=self.gdtype, device=self.device)
            views = self.z2views[key] = dict(zip(fl.names, fl.views(buf)))
        return views[name]

    def attach_grads(self, key: Optional[tuple] = None) -> None:
        """Zero the gradient buffer(s) and make them the parameters' `.grad` again."""
        if key is None and self.held_gshards:
            for shard in self.gshard.values():
                shard.zero_()
        for k, buf in self.gbuf.items():
            if key is None or k == key:
                buf.zero_()
                if self.main_grads:  # (the hook adds into the views)
                    continue
                for n in self.buckets[k].names:
                    if self.p[n].grad is None and n in self.gview:  # (not torch DDP's own buckets)
                        self.p[n].grad = self.gview[n]


    # --- gradients --------------------------------------------------------------------------------
    def local_grad(self, name: str) -> Tensor:
        """This rank's gradient of `name` so far (moved out of .grad), zeros if none."""
        w = self.g_pending.pop(name, None)
        if w is not None:
            w.wait()
        p = self.p[name]
        g = self.g.pop(name, None)
        if p.grad is not None:
            g = p.grad if g is None else g + p.grad
            p.grad = None
        if g is None:
            return torch.zeros(self.shapes[name], dtype=self.gdtype, device=self.device)
        return g if g.dtype == self.gdtype else g.to(self.gdtype)

    def grads_bucket(self, ins: Instr, verb: str, g) -> None:
        """`grads<k>`: flatten the gradients of the bucket's units; all-reduce (ZeRO-0) or
        reduce-scatter into the bucket's shard (ZeRO-1/2, accumulated over micro-batches)."""
        cls = self.param_class(ins.axis)
        key = (cls, tuple(ins.items))
        names = [n for u in ins.items for n in self.unit_names(u, cls)]
        fl = self.buckets.get(key) or self._flat(names, ins.group)
        flat = self.gbuf.get(key)
        if flat is None and key in self.z2buf:  # ZeRO-2: the gradients are in the bucket's buffer already
            flat = self.z2buf.pop(key)
            self.z2views.pop(key, None)
            for n, v in zip(names, fl.views(flat)):
                gr = self.local_grad(n)  # (moved out of the buffer where tp-reduced: copied back)
                if gr.data_ptr() != v.data_ptr():
                    v.copy_(gr)
        elif flat is None:  # XLA (no aliasing views): each gradient is dropped as soon as it is in the bucket
            for n in names:  # the previous micro-batch's bucket first: its buffer goes before this one comes
                w = self.g_pending.pop(n, None)
                if w is not None:
                    w.wait()
            flat = torch.empty(fl.padded, dtype=self.gdtype, device=self.device)
            flat[fl.total :].zero_()
            for n, v in zip(names, fl.views(flat)):
                v.copy_(self.local_grad(n))
        elif self.plan.grad_bucket_view:  # gradients are in the buffer already, but for those moved out
            for n, v in zip(names, fl.views(flat)):  # (tp-reduced, see local_grad)
                gr = self.local_grad(n)
                if gr.data_ptr() != v.data_ptr():
                    v.copy_(gr)
        if verb == "allreduce" and key in self.shards:
            # ZeRO-1 under `grad_allreduce` (DeepSpeed's BF16_Optimizer): every rank gets the whole sum
            # and keeps its slice of it for the optimizer
            work = self.comm.all_reduce(flat, group=g, async_op=True)
            finish = self._accumulate_shard(key, fl.my_slice(flat))
        elif verb == "allreduce":
            work = self.comm.all_reduce(flat, group=g, async_op=True)

            def finish():
                for n, v in zip(names, fl.views(flat)):
                    self.reduced[n] = v
        elif verb == "reducescatter":
            # ZeRO-1 reduces its gradient buffer once per step, in place into this rank's slice (the
            # buffer is zeroed when the next step starts); ZeRO-2 into a new shard, summed over
            # micro-batches
            in_place = key in self.gbuf and not self.xla
            out = fl.my_slice(flat) if in_place else torch.empty(fl.shard, dtype=flat.dtype, device=flat.device)
            work = self.comm.reduce_scatter(out, flat, group=g, async_op=True)

            if key not in self.shards:
                raise RuntimeError(f"rank {self.rank}: {ins.name}: reduce-scattered bucket {key} has no params<k> gather")
            finish = self._accumulate_shard(key, out)
        else:
            raise ValueError(f"rank {self.rank}: {ins.name}: gradient bucket with {verb}")
        w = self.issue(ins, [work], finish)
        for n in names:
            self.g_pending[n] = w
        if key in self.shards:
            self.gshard_pending[key] = w

    def bucket_in(self, ins: Instr) -> None:
        """`bucket_in<k>` (grad_bucket_view=0): torch DDP copies the bucket's gradients into its own
        buffer for the all-reduce; `.grad` keeps its copy (main gradients: `g`)."""
        key = self.bucket_keys.get(ins.block.removeprefix("bucket_in"))
        if key is None or key not in self.gbuf:
            return  # no buffer of its own (XLA; a grouping met before): the bucket's collective flattens a copy
        for n, v in zip(self.buckets[key].names, self.buckets[key].views(self.gbuf[key])):
            gr = self.local_grad(n)
            v.copy_(gr)
            if self.main_grads:
                self.g[n] = gr
            else:
                self.p[n].grad = gr

    def bucket_out(self, ins: Instr) -> None:
        """`bucket_out` (grad_bucket_view=0): once every bucket is all-reduced, the sums are copied back
        into `.grad`, which the optimizer step then reads (and the step lets go of)."""
        for key, buf in self.gbuf.items():
            if key not in self.buckets or not key[1]:
                continue
            for n, v in zip(self.buckets[key].names, self.buckets[key].views(buf)):
                w = self.g_pending.pop(n, None)
                if w is not None:
                    w.wait()
                g = self.g.get(n) if self.main_grads else self.p[n].grad
                if g is None or n not in self.reduced:
                    continue
                g.copy_(self.reduced[n])
                self.reduced[n], self.p[n].grad = g, None
                self.g.pop(n, None)

    def _accumulate_shard(self, key: tuple, out: Tensor) -> Callable[[], None]:
        def finish():
            prev = self.gshard.get(key)
            if prev is None:
                self.gshard[key] = out
            elif self.held_gshards:
                prev.add_(out)
            else:
                self.gshard[key] = prev + out
        return finish

    def grads_rep(self, ins: Instr, g) -> None:
        """HSDP: all-reduce a gradient shard across the replicate groups (`grads_rep<k>` a bucket's,
        `grads_rep` a ZeRO-3 unit's)."""
        # the lowering replicates only dense gradients (experts are sharded over edp, not dp_shard)
        key = ("dense", ins.layer) if ins.block == "grads_rep" else ("dense", tuple(ins.items))
        w = self.gshard_pending.pop(key, None)
        if w is not None:
            w.wait()
        buf = self.gshard[key]
        self.issue(ins, [self.comm.all_reduce(buf, group=g, async_op=True)], None)

    # --- ZeRO-3 -----------------------------------------------------------------------------------
    def z3_gather(self, ins: Instr, g) -> None:
        key = (self.param_class(ins.axis), ins.layer)
        fl = self.z3[key]
        parity = (key[0], ins.layer % 2)
        preallocated = self.zero3.preallocated_buffers
        if preallocated:
            out = self.z3_buffers[parity][: fl.padded]
        else:
            out = self.z3_live.get(key)
            if out is None:
                out = torch.empty(fl.padded, dtype=self.dtype, device=self.device)  # allocated on demand
        work = self.comm.all_gather(out, self.shards[key], group=g, async_op=True)

        def finish():
            self.z3_live[key] = out
            for n, v in zip(fl.names, fl.views(out)):
                self.p[n].data = v
            if preallocated and ins.phase == "bwd":  # autograd accumulates straight into the gradient buffer
                busy = self.z3_gbusy.pop(parity, None)
                if busy is not None:
                    busy.wait()
                gbuf = self.z3_gbuffers[parity][: fl.padded]
                gbuf.zero_()
                for n, v in zip(fl.names, fl.views(gbuf)):
                    if self.main_grads:  # (the hook adds into it)
                        self.z3_gview[n] = v
                    else:
                        self.p[n].grad = v

        self.z3_pending[key] = self.issue(ins, [work], finish)

    def z3_grads(self, ins: Instr, g) -> None:
        """ZeRO-3: reduce-scatter the unit's gradients (this micro-batch's) into its shard."""
        key = (self.param_class(ins.axis), ins.layer)
        fl = self.z3[key]
        if self.zero3.preallocated_buffers:  # the unit's gradients are (mostly) in its buffer already
            parity = (key[0], ins.layer % 2)
            flat = self.z3_gbuffers[parity][: fl.padded]
            for n, v in zip(fl.names, fl.views(flat)):
                self.z3_gview.pop(n, None)
                gr = self.local_grad(n)
                if gr.data_ptr() != v.data_ptr():
                    v.copy_(gr)
        else:  # allocated on demand; each gradient let go once copied in (FSDP2's reduce-scatter input)
            flat = torch.empty(fl.padded, dtype=self.gdtype, device=self.device)
            flat[fl.total :].zero_()
            for n, v in zip(fl.names, fl.views(flat)):
                v.copy_(self.local_grad(n))
        out = torch.empty(fl.shard, dtype=flat.dtype, device=flat.device)
        earlier = self.gshard_pending.get(key)
        if earlier is not None:  # summed into the shard before this one (HSDP's all-reduce reads the last)
            earlier.wait()
        work = self.comm.reduce_scatter(out, flat, group=g, async_op=True)
        w = self.issue(ins, [work], self._accumulate_shard(key, out))
        self.gshard_pending[key] = w
        if self.zero3.preallocated_buffers:
            self.z3_gbusy[parity] = w

    def z3_release(self, key: tuple) -> None:
        """fsdp: the unit's gathered buffer is freed after its last use (yafsdp keeps its two)."""
        w = self.z3_pending.pop(key, None)
        if w is not None:
            w.wait()
        if self.zero3.preallocated_buffers:
            return
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        for n in self.z3[key].names:
            self.p[n].data = empty
        self.z3_live.pop(key, None)


    # --- ZeRO-1/2 ---------------------------------------------------------------------------------
    def params_gather(self, ins: Instr, g) -> None:
        """ZeRO-1/2: all-gather the updated shards of bucket k back into the parameters."""
        key = (self.param_class(ins.axis), tuple(ins.items))
        fl = self.buckets[key]
        buf = self.pbuf.get(key)
        if buf is not None:  # in place: the shard is this rank's slice of the parameters' buffer
            self.issue(ins, [self.comm.all_gather(buf, self.shards[key], group=g, async_op=True)], None)
            return
        out = torch.empty(fl.padded, dtype=self.dtype, device=self.device)
        work = self.comm.all_gather(out, self.shards[key], group=g, async_op=True)

        def finish():
            with torch.no_grad():
                for n, v in zip(fl.names, fl.views(out)):
                    self.p[n].copy_(v)

        self.issue(ins, [work], finish)
