"""The collective instructions of a rank: each dispatched by block, and those that move activations
or their gradients (tp's f / g conjugates, sp's gathers and reduce-scatters, cp's K/V gather, MoE's
all-to-alls) run here, with the partial gradients of tp-replicated parameters riding along.

The gradient and parameter collectives are `simexec.exec.rank.sharding`'s, the step's reductions
`simexec.exec.rank.optimizer_step`'s, cp_impl=a2a's exchanges `simexec.exec.rank.heads_exchange`'s and the
pipeline's tp gathers `simexec.exec.rank.pipeline_messages`'. Which name each collective reads and
writes is `simexec.exec.rank.dataflow`'s table.
"""
from __future__ import annotations

from functools import cached_property

import torch
import torch.distributed as dist
from torch import Tensor

from simexec.exec.nn.gpt import Route
from simexec.exec.nn.param_layout import split_range
from simexec.exec.rank.dataflow import (CONSUMED_BY_COLLECTIVE, SP_GATHERS, SP_REGATHERS, TP_PARTIAL_COLLECTIVES,
                                        collective_keys)
from simexec.program.groups import rank_groups
from simexec.program.instructions import Instr

# moe_dispatcher=deepep across NVLink domains: the network hop and the NVLink hop, each way
TWO_HOP_BLOCKS = ("dispatch_net", "dispatch", "combine", "combine_net")


class ActivationCollectives:
    """The collective instructions of `RankInterpreter` (`simexec.exec.rank.interpreter`), a mixin:
    `collective` dispatches one by block; the activation collectives, the norms' partial gradients
    under sp (`norm_grads`), the tied embedding's gradient sum and MoE's all-to-alls run here.

    Reads of the rank: `rp`, `rank`, `plan`, `L`, `D`, `model`, `comm`, `two_hops`, `colls`, `specs`, `shapes`, `p`,
    `device`, `gdtype`, `partial_by`, `partial_layer`, `full_recompute_layers`, `group`, `read`, `take_grad`, `issue`,
    `deliver`, `local_grad`, and the other mixins' collectives. Shares with it: `env`, `d`, `g`, `g_pending`,
    `reduced`."""

    def collective(self, ins: Instr) -> None:
        block = ins.block
        verb = ins.collective
        g = self.group(ins)
        if block in self.colls:
            return self.activation_collective(ins, verb, g)
        if block in ("norm_grads", "mtp_norm_grads"):
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

    def activation_collective(self, ins: Instr, verb: str, g) -> None:
        src, dst = collective_keys(ins.block, ins.layer, ins.mb, self.colls, self.L, self.D)
        dim = self.colls[ins.block][2]
        n = len(ins.group)
        backward = ins.phase == "bwd" and ins.block not in SP_REGATHERS
        # sp: a norm's output gathered for a column-parallel GEMM (forward, or again for its backward)
        gathered_input = self.plan.sp and not backward and (ins.block in SP_GATHERS or ins.block in SP_REGATHERS)
        if self.two_hops and ins.block in TWO_HOP_BLOCKS:
            return self.deepep_hop(ins, g, src, dst, backward)
        if ins.block in ("dispatch", "combine") and verb == "alltoall":
            return self.alltoall(ins, g, src, dst, backward)
        if ins.block in ("etp_in", "etp_out") and not self.gathered_dispatch:
            return self.etp_exchange(ins, g, src, dst, backward)
        if ins.block in ("dispatch", "etp_in") and not backward:  # moe_dispatcher=allgather
            self.gather_routes(ins, g)
        if ins.block in ("heads_in", "heads_out"):
            return self.heads_exchange(ins, g, backward)
        if ins.block == "mtp_eh_out":
            return self.mtp_eh_out(ins, g, src, dst, backward)
        if backward:
            x = self.take_grad(dst)
            extras = self._tp_partial_grads(ins) if ins.block in TP_PARTIAL_COLLECTIVES else []
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
                self.deliver(target, buf[: x.numel()].view(shape), backward)
                self._deliver_extras(extras, buf[x.numel() :])
        elif verb == "allgather":
            xt = x.movedim(dim, 0).contiguous()
            out = torch.empty((n * xt.shape[0],) + xt.shape[1:], dtype=x.dtype, device=x.device)
            work = self.comm.all_gather(out, xt, group=g, async_op=True)

            def finish():
                t = out.movedim(0, dim)
                if gathered_input:  # Megatron's (s, b, h) gathers are contiguous; a (B, T, C) one is made so
                    t = t.contiguous()
                self.deliver(target, t, backward)
        elif verb == "reducescatter":
            xt = x.movedim(dim, 0).contiguous()
            chunks = xt.chunk(n, dim=0)
            # with extras (replicated params' grads) every slot carries them: each rank gets the full sum
            buf = torch.cat([torch.cat([c.reshape(-1)] + flat_extras) for c in chunks])
            out = torch.empty(buf.numel() // n, dtype=x.dtype, device=x.device)
            work = self.comm.reduce_scatter(out, buf, group=g, async_op=True)
            cshape = chunks[0].shape

            def finish():
                self.deliver(target, out[: chunks[0].numel()].view(cshape).movedim(0, dim), backward)
                self._deliver_extras(extras, out[chunks[0].numel() :])
        else:
            raise ValueError(f"rank {self.rank}: {ins.name}: {verb} is not an activation collective")
        held = self.d.pop(target, None) if backward else None
        if isinstance(held, Tensor):  # a gradient that arrived whole there already (an MTP depth's, `mtp_aliases`)
            summed = finish

            def finish():
                summed()
                self.add_grad(target, held)
        w = self.issue(ins, [work], finish)
        if backward:
            self.d[target] = w
            for name, _ in extras:
                self.g_pending[name] = w
        else:
            self.env[target] = w
            if ins.block in SP_REGATHERS:
                self.env.pop(src, None)  # the slice's last reader
            else:
                self.drop_consumed(src)

    def mtp_eh_out(self, ins: Instr, g, src: tuple, dst: tuple, backward: bool) -> None:
        """An MTP depth's eh_proj output, column-parallel (B, T, C/tp), gathered over the hidden dimension
        (Megatron-Core's gather_from_tensor_model_parallel_region) and under sp split over the sequence
        (scatter_to_sequence_parallel_region): each rank keeps its slice (B, T/tp, C). The backward
        exists under sp only: the gradient's slices gathered over the sequence, each rank keeping its
        hidden columns (without sp that split is `BlockCompute.backward`'s)."""
        n, me = len(ins.group), ins.group.index(self.rank)
        dim = 1 if backward else 2
        x = (self.take_grad(dst) if backward else self.read(src)).detach()
        xt = x.movedim(dim, 0).contiguous()
        out = torch.empty((n * xt.shape[0],) + xt.shape[1:], dtype=x.dtype, device=x.device)
        work = self.comm.all_gather(out, xt, group=g, async_op=True)
        target = src if backward else dst

        def finish():
            t = out.movedim(0, dim)
            if backward:
                t = t[..., self.model.hlo : self.model.hhi]
            elif self.plan.sp:
                t = t.chunk(n, dim=1)[me]
            self.deliver(target, t.contiguous(), backward)

        w = self.issue(ins, [work], finish)
        (self.d if backward else self.env)[target] = w
        if not backward:
            self.drop_consumed(src)

    def norm_grads(self, ins: Instr, g) -> None:
        """Under sp: sum over tp the partial gradients of the norms no activation collective
        carries (`SP_PARTIAL_BY`)."""
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
        w = self.issue(ins, [work], lambda: self._deliver_extras(extras, buf))
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

        self.g_pending[name] = self.issue(ins, [work], finish)

    def drop_consumed(self, key: tuple) -> None:
        """A forward collective has read `key`, its only reader (a row-parallel partial sum, the
        tokens an all-to-all sends, K/V before their cp all-gather): drop it from the environment, so
        that it lives only as long as the collective (and whatever autograd saved) needs it."""
        # no etp exchange (or DeepEP's NVLink hop): what dispatch or experts wrote
        if key not in self.env and key[0] in ("xd", "yd", "yn"):
            key = self.resolve(key) or key
        if key not in self.env:
            return
        name, l, mb = key
        # the residual stream gathered under sp: the gathered copy is what the blocks read (full
        # recompute re-reads the layer's input, so it stays there)
        if name in CONSUMED_BY_COLLECTIVE or (name == "x" and (l == self.L or (l, mb) not in self.full_recompute_layers)):
            del self.env[key]

    def _tp_partial_grads(self, ins: Instr) -> list[tuple[str, Tensor]]:
        """Gradients of parameters replicated over tp but computed partially (norms, router): taken
        out of .grad here and summed by this collective (zeros where a rank has none yet, so every
        rank sends the same layout)."""
        if len(ins.group) == 1:
            return []
        unit = ins.layer
        out = []
        for n, s in self.specs.items():
            if self.partial_by.get(n) == ins.block and self.partial_layer[n] == unit:
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

    def gather_routes(self, ins: Instr, g) -> None:
        """moe_dispatcher=allgather: before the tokens, every ep rank's routing (the expert of each
        assignment, a small blocking all-gather), so the experts know which gathered rows are theirs."""
        l, mb = ins.layer, ins.mb
        mine = self.env.get(("gathered_experts", l, mb)) if ins.block == "etp_in" else None
        mine = (self.read(("route", l, mb)).experts if mine is None else mine).contiguous()
        out = torch.empty((len(ins.group) * mine.shape[0],) + mine.shape[1:], dtype=mine.dtype, device=mine.device)
        self.comm.all_gather(out, mine, group=g)
        self.env[("gathered_experts", l, mb)] = out

    def etp_exchange(self, ins: Instr, g, src: tuple, dst: tuple, backward: bool) -> None:
        """Parallel folding with etp > 1 after an all-to-all dispatch (Megatron-Core's
        MoEAlltoAllTokenDispatcher over its expert tp group): `etp_in` gathers the rows each etp rank
        received (their counts first, a small blocking all-gather, since the ranks receive different
        numbers of rows) so that every etp rank runs its shard of the experts on all of them; `etp_out`
        sums the partial outputs over etp and hands each rank its own rows. A gather of uneven pieces
        is a gather of pieces padded to the largest; a reduce-scatter of them an all-reduce, each rank
        keeping its piece."""
        l, mb = ins.layer, ins.mb
        n = len(ins.group)
        if ins.block == "etp_in" and not backward:
            rc = self.env[("rcounts", l, mb)]
            every = torch.empty((n * rc.shape[0], rc.shape[1]), dtype=rc.dtype, device=rc.device)
            self.comm.all_gather(every, rc.contiguous(), group=g)
            self.env[("rcounts", l, mb)] = every  # in arrival order: etp rank, then source
            rows = every.reshape(n, -1).sum(1).tolist()
            me = ins.group.index(self.rank)
            self.env[("etp_rows", l, mb)] = (rows, sum(rows[:me]))
        rows, offset = self.env[("etp_rows", l, mb)]
        mine = rows[ins.group.index(self.rank)]
        gathers = (ins.block == "etp_in") != backward
        x = (self.take_grad(dst) if backward else self.read(src)).detach().contiguous()
        target = src if backward else dst
        if gathers:
            pad = max(rows)
            piece = torch.zeros((pad,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
            piece[:mine] = x
            out = torch.empty((n * pad,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
            work = self.comm.all_gather(out, piece, group=g, async_op=True)

            def finish():
                self.deliver(target, torch.cat([out[i * pad : i * pad + r] for i, r in enumerate(rows)]), backward)
        else:
            buf = x.clone()
            work = self.comm.all_reduce(buf, op=dist.ReduceOp.SUM, group=g, async_op=True)

            def finish():
                self.deliver(target, buf[offset : offset + mine].clone(), backward)
        w = self.issue(ins, [work], finish)
        (self.d if backward else self.env)[target] = w
        if not backward:
            self.drop_consumed(src)

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
        w = self.issue(ins, [work], lambda: self.deliver(target, out, backward))
        (self.d if backward else self.env)[target] = w
        if not backward:
            self.drop_consumed(src)

    def deepep_hop(self, ins: Instr, g, src: tuple, dst: tuple, backward: bool) -> None:
        """moe_dispatcher=deepep across NVLink domains, as DeepEP's internode kernels move tokens
        (deepseek-ai/DeepEP@dd758ca csrc/kernels/legacy/internode.cu: dispatch's kRDMASender and
        kRDMAAndNVLForwarder, combine's kNVLAndRDMAForwarder and kRDMAReceiver). The router packs each
        token once with its routing weights (`GPT.router_gathered`). `dispatch_net` sends it once to each
        NVLink domain that holds one of its experts, to the ep rank at the sender's place there
        (`RankGroups.ep_net`); `dispatch` forwards what arrived once to each rank of the domain holding
        one of its experts (`ep_domain`), with the expert of each assignment (`GPT.experts_gathered`
        computes a rank's weighted share). `combine` sums a token's shares at the forwarder, before the
        network, and `combine_net` the domains' sums at the source. Each hop is a row selection and an
        all-to-all (`hop_plan`); the combine hops run its transpose (the all-to-all back and a
        scatter-add), and the backward of each the other one, so every gradient is the exact conjugate."""
        l, mb = ins.layer, ins.mb
        net = ins.block.endswith("_net")
        if ins.block.startswith("dispatch") and not backward:
            self.hop_plan(ins, g, net)
        sel, send, recv, rows = self.env[("hop_net" if net else "hop_domain", l, mb)]
        x = (self.take_grad(dst) if backward else self.read(src)).detach()
        target = src if backward else dst
        if ins.block.startswith("dispatch") != backward:  # copies out: dispatch, and the combine's backward
            out = torch.empty((sum(recv),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
            work = self.comm.all_to_all_single(out, x.index_select(0, sel), recv, send, group=g, async_op=True)

            def finish():
                self.deliver(target, out, backward)
        else:  # sums back: the combine, and the dispatch's backward
            back = torch.empty((sum(send),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
            work = self.comm.all_to_all_single(back, x.contiguous(), send, recv, group=g, async_op=True)

            def finish():
                summed = torch.zeros((rows,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
                self.deliver(target, summed.index_add_(0, sel, back), backward)
        w = self.issue(ins, [work], finish)
        (self.d if backward else self.env)[target] = w
        if not backward:
            self.drop_consumed(src)

    def hop_plan(self, ins: Instr, g, net: bool) -> None:
        """Which rows one DeepEP hop sends to each member of its group (`sel`, grouped by member, and
        `send`, their counts), what arrives (`recv`) and how many rows it leaves (`rows`, for the
        transpose's scatter-add), in the environment for the hop's other three uses; the experts of the
        rows that arrive travel beside them (small blocking all-to-alls: the counts, then the experts):
        the NVLink hop's input, and what the experts pick their assignments by (`gathered_experts`; a
        domain with one rank of the ep group has no NVLink hop, the network hop reaching the experts).
        A row goes to a member if one of its experts (-1: dropped, none) is held in the member's domain
        (the network hop) or by the member itself (the NVLink hop)."""
        l, mb = ins.layer, ins.mb
        experts = (self.read(("route", l, mb)).experts if net else self.env[("gathered_experts", l, mb)]).to(torch.int64)
        owner = self.expert_owner.to(experts.device)[experts.clamp(min=0)]  # (rows, k) the rank holding each
        members = torch.tensor(ins.group, dtype=torch.int64, device=experts.device)
        if net:
            domain = self.rp.cluster.nvlink_domain or self.rp.world
            owner, members = owner // domain, members // domain
        hit = ((owner.unsqueeze(-1) == members) & (experts >= 0).unsqueeze(-1)).any(1)  # (rows, members)
        per_member = [hit[:, j].nonzero().squeeze(1) for j in range(len(ins.group))]
        sel = torch.cat(per_member)
        counts = torch.tensor([len(t) for t in per_member], dtype=torch.int64, device=experts.device)
        rc = torch.empty_like(counts)
        self.comm.all_to_all_single(rc, counts, group=g)
        send, recv = counts.tolist(), rc.tolist()
        arrived = torch.empty((sum(recv), experts.shape[1]), dtype=torch.int64, device=experts.device)
        self.comm.all_to_all_single(arrived, experts.index_select(0, sel), recv, send, group=g)
        self.env[("gathered_experts", l, mb)] = arrived  # the NVLink hop's input, or (absent) the experts'
        self.env[("hop_net" if net else "hop_domain", l, mb)] = (sel, send, recv, experts.shape[0])

    @cached_property
    def expert_owner(self) -> Tensor:
        """The rank that holds each routed expert: contiguous blocks over this rank's ep group in its
        order (`local_experts`)."""
        ep, experts = rank_groups(self.rp, self.rank).ep, self.m.moe.experts
        owner = torch.empty(experts, dtype=torch.int64)
        for j, r in enumerate(ep):
            lo, hi = split_range(experts, len(ep), j)
            owner[lo:hi] = r
        return owner
