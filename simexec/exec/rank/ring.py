"""Ring context parallelism (cp_impl=ring): attention one K/V chunk per hop, as the lowering emits it
(docs/program.md, `simexec.program.lowering.layers.LayerLowering.ring_attention`).

Partial results are merged by log-sum-exp. Forward, hop i of cp: send the K/V chunk held (from cp
rank me - i) to the next cp rank, attend to it (`attn.r{i}`: `attn_partial`, merged into the running
output by log-sum-exp), receive the next chunk from the previous rank. The last hop's partial writes
`o`; a recorded forward keeps (q, o, lse) for the backward. Backward, hop i: `bwd.attn.r{i}` is
flash attention's backward of the chunk held, from the saved (o, lse) and dO (no per-chunk forward
state), adding to dQ and to the chunk's travelling dK/dV; then (K, V, dK, dV) go to the next rank.
The last hop sends only dK/dV, which thereby arrive at the rank that owns them: they are the
gradient of `kv` that the qkv backward reads.
"""
from __future__ import annotations

import math
import zlib

import torch
from torch import Tensor

from simexec.exec.nn import data
from simexec.exec.rank.collectives import InflightComm
from simexec.exec.nn.attention import attn_merge, attn_partial, attn_partial_bwd, split_kv
from simexec.program.instructions import Instr


class RingAttention:
    """Ring attention's compute and messages for `RankInterpreter` (`simexec.exec.rank.interpreter`), a mixin.

    Reads of the rank: `rank`, `instrs`, `rp`, `m`, `plan`, `coords`, `device`, `dtype`, `comm`,
    `read`, `take_grad`, `add_grad`, `issue`, `deliver`. Shares with it: `env`, `d` (activations
    and gradients), `records` (a recorded forward's (q, o, lse)). Its own: `ring` (whether the plan
    runs it), `cp_rank`, `ring_hop`, `ring_msg`, `ring_mask`, `ring_scale`, `ring_fwd`, `ring_bwd`."""

    def setup_ring(self) -> None:
        p = self.plan
        self.ring = p.cp > 1 and p.cp_impl == "ring"
        if not self.ring:
            return
        cp, me = p.cp, self.coords["cp"]
        self.cp_rank = me
        self.ring_hop: dict[str, int] = {}  # attn compute name -> hop
        self.ring_msg: dict[str, tuple[int, int]] = {}  # kv send/recv name -> (origin cp rank, hop)
        for i in self.instrs:
            if i.block == "attn" and i.kind == "compute":
                self.ring_hop[i.name] = int(i.name.rsplit(".r", 1)[1])
            elif i.block == "kv" and i.kind in ("send", "recv"):
                o, h = i.name.rsplit(".", 2)[1:]
                self.ring_msg[i.name] = (int(o[1:]), int(h[1:]))
        pos = [data.cp_positions(self.rp.seq_len, cp, j).to(self.device) for j in range(cp)]
        self.ring_mask = [pos[j][None, :] <= pos[me][:, None] if self.m.causal else None for j in range(cp)]
        self.ring_scale = 1.0 / math.sqrt(self.m.qk_head_dim)
        self.ring_fwd: dict[tuple, dict] = {}  # (layer, mb) -> state of a forward ring in progress
        self.ring_bwd: dict[tuple, dict] = {}  # (layer, mb) -> state of a backward ring in progress

    def _ring_state(self, table: dict, l: int, mb: int) -> dict:
        st = table.get((l, mb))
        if st is None:  # opened by the first hop's send or compute, whichever comes first
            kv = self.read(("kvf", l, mb)).detach()  # no kv collective: this rank's own K/V
            st = table[(l, mb)] = {"chunks": {self.cp_rank: kv}}
            if table is self.ring_bwd:
                st["dkv"] = {self.cp_rank: torch.zeros_like(kv)}
        return st

    def _ring_chunk(self, st: dict, origin: int) -> Tensor:
        c = st["chunks"][origin]
        if isinstance(c, InflightComm):
            c.wait()
            c = st["chunks"][origin]
        return c

    def ring_forward(self, ins: Instr, hop: int, record: bool) -> None:
        l, mb = ins.layer, ins.mb
        st = self._ring_state(self.ring_fwd, l, mb)
        if "q" not in st:
            st["q"] = self.read(("q", l, mb)).detach()
        origin = (self.cp_rank - hop) % self.plan.cp
        kv = self._ring_chunk(st, origin)
        del st["chunks"][origin]  # attended to here, and (in program order) already sent on
        q = st["q"]
        k, v = split_kv(kv, q.shape[-1])
        with torch.no_grad():
            o, lse = attn_partial(q.float(), k.float(), v.float(), self.ring_mask[origin], self.ring_scale)
            if "o" in st:
                o, lse = attn_merge(st["o"], st["lse"], o, lse)
        if hop < self.plan.cp - 1:
            st["o"], st["lse"] = o, lse
            return
        del self.ring_fwd[(l, mb)]
        B, nh, T, _ = q.shape
        self.env[("o", l, mb)] = o.to(q.dtype).transpose(1, 2).reshape(B, T, -1)
        if record:
            self.records[("attn", l, mb)] = (q, o, lse)

    def ring_backward(self, ins: Instr, hop: int) -> None:
        l, mb = ins.layer, ins.mb
        cp = self.plan.cp
        st = self._ring_state(self.ring_bwd, l, mb)
        if "lse" not in st:
            rec = self.records.pop(("attn", l, mb), None)
            if rec is None:
                raise RuntimeError(f"rank {self.rank}: {ins.name} has no forward record (forward not run, or run without grad)")
            q, o, lse = rec
            B, nh, T, vd = o.shape
            do = self.take_grad(("o", l, mb)).float().view(B, T, nh, vd).transpose(1, 2)
            st.update(q=q, lse=lse, do=do, delta=(do * o).sum(-1), dq=torch.zeros_like(q, dtype=o.dtype))
        origin = (self.cp_rank - hop) % cp
        kv = self._ring_chunk(st, origin)
        dkv = st["dkv"][origin]
        q = st["q"]
        (k, v), (dk_acc, dv_acc) = split_kv(kv, q.shape[-1]), split_kv(dkv, q.shape[-1])
        with torch.no_grad():
            dq, dk, dv = attn_partial_bwd(q.float(), k.float(), v.float(), self.ring_mask[origin],
                                          self.ring_scale, st["lse"], st["do"], st["delta"])
            st["dq"] += dq
            dk_acc += dk.to(dkv.dtype)
            dv_acc += dv.to(dkv.dtype)
        if hop == cp - 1:
            self.add_grad(("q", l, mb), st["dq"].to(q.dtype))
            for key in (("q", l, mb), ("o", l, mb)):
                if key in self.env:
                    del self.env[key]

    def ring_p2p(self, ins: Instr) -> None:
        """A K/V hop (forward, recompute) or a K/V + dK/dV hop (backward) of the ring."""
        l, mb = ins.layer, ins.mb
        origin, hop = self.ring_msg[ins.name]
        bwd = ins.phase == "bwd"
        home = bwd and hop == self.plan.cp - 1  # the backward's last hop: dK/dV only
        tag = zlib.crc32(ins.name.encode()) & 0x7FFFFFFF
        if ins.kind == "send":
            st = self._ring_state(self.ring_bwd if bwd else self.ring_fwd, l, mb)
            kv = self._ring_chunk(st, origin)
            if not bwd:
                t = kv  # the forward's compute of this hop reads it next
            else:
                st["chunks"].pop(origin)
                dkv = st["dkv"].pop(origin)
                t = dkv if home else torch.cat([kv, dkv])
                if home:
                    del self.ring_bwd[(l, mb)]
            self.issue(ins, [self.comm.isend(t.contiguous(), ins.peer, tag=tag)], None)
            return
        shape = self.read(("kvf", l, mb)).shape  # (2, B, nkv, T, hd) (`split_kv`): every chunk has this rank's shape
        if home:  # this rank's own dK/dV, complete: the gradient of `kv` that the qkv backward reads
            buf = torch.empty(shape, dtype=self.dtype, device=self.device)
            key = ("kv", l, mb)
            self.d[key] = self.issue(ins, [self.comm.irecv(buf, ins.peer, tag=tag)], lambda: self.deliver(key, buf, True))
            return
        st = self._ring_state(self.ring_bwd if bwd else self.ring_fwd, l, mb)
        n = shape[0]
        buf = torch.empty((2 * n if bwd else n,) + tuple(shape[1:]), dtype=self.dtype, device=self.device)

        def finish():
            if bwd:
                st["chunks"][origin], st["dkv"][origin] = buf[:n], buf[n:]
            else:
                st["chunks"][origin] = buf

        st["chunks"][origin] = self.issue(ins, [self.comm.irecv(buf, ins.peer, tag=tag)], finish)
