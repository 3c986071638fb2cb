"""An MoE layer's blocks on one rank: how many tokens and rows it routes, what its dispatch and combine
move, and the router's, the routed experts' and the shared experts' FLOPs, bytes and saved activations.

A mixin of `simexec.program.blocks.Anatomy`, apart because the expert MLP is a model of its own beside
the dense layer: routing (top_k, capacity, `Plan.moe_router_skew`), the ep/etp splits and parallel
folding, and the dispatchers' exchanges (`Plan.moe_dispatcher`) change nothing in attention or in a
dense MLP, and none of the dense blocks' arithmetic changes with them. It reads the shared kernel
costs (norms, activation, residual, weight-gradient accumulation, FP8 casts) from `Anatomy`.
"""
from __future__ import annotations

from functools import cached_property

from simexec.program.block import Block, gemm_cost, ln_bytes
from simexec.program.layer_order import destination_domains


class MoEBlocks:
    """`Anatomy`'s MoE sizes and blocks (see the module doc)."""

    @cached_property
    def expert_slots(self) -> float:
        """Rows one rank's tokens fill in the experts' buffers: top_k per token under balanced routing,
        times the capacity factor where buffers are cut or padded to capacity (MoESpec.capacity_factor)."""
        moe = self.rp.model.moe
        return self.tokens * moe.top_k * (moe.capacity_factor or 1.0) if moe else 0.0

    @cached_property
    def routed_tokens(self) -> float:
        """Tokens this rank routes: all of its micro-batch's (each tp rank the same ones, its experts'
        outputs partial over tp); under parallel folding only its own sequence shard (Megatron-Core's
        MoE layer under sp routes the sp slice it holds)."""
        return self.tokens / self.sp_div if self.rp.folded else self.tokens

    @cached_property
    def router_skew(self) -> float:
        """The busiest ep rank's rows over the balanced share (`Plan.moe_router_skew`); 1 where the
        experts' buffers are cut or padded to capacity (`MoESpec.capacity_factor`), whatever the routing."""
        moe = self.rp.model.moe
        return 1.0 if moe is None or moe.capacity_factor is not None else self.rp.plan.moe_router_skew

    @cached_property
    def expert_rows(self) -> float:
        """Rows this rank's experts compute: `expert_slots`; under parallel folding its share of the rows
        its ep group dispatched (what its own tokens fill), times etp after the etp all-gather. Under
        `moe_router_skew` the busiest ep rank's, which every rank waits for in the combine."""
        rows = self.expert_slots if not self.rp.folded else self.expert_slots / self.sp_div * self.etp
        return rows * self.router_skew

    @cached_property
    def local_expert_sort(self) -> float:
        """Bytes of the alltoall dispatcher's second permutation, each way: with more than one local
        expert the received rows arrive grouped by source rank and are sorted by local expert after the
        dispatch, and back before the combine, each a read and a write of the rows (Megatron-Core's
        MoEAlltoAllTokenDispatcher `dispatch_postprocess` / `combine_preprocess`, `sort_chunks_by_idxs`:
        "Permutation 2", NVIDIA/Megatron-LM@d98e8a64 megatron/core/transformer/moe/token_dispatcher.py);
        the backward runs both on the gradients. The allgather and DeepEP dispatchers permute once, on
        the rows a rank keeps or receives, and have none."""
        moe = self.rp.model.moe
        if self.rp.plan.moe_dispatcher != "alltoall" or moe.experts / self.ep <= 1:
            return 0.0
        return 2 * 2 * self.dt * self.expert_rows * self.h

    @cached_property
    def etp_gathered_bytes(self) -> float:
        """A folded plan's etp all-gather of the dispatched rows (and reduce-scatter of the outputs):
        the gathered size."""
        return self.expert_rows * self.h * self.dt

    @cached_property
    def dispatch_bytes(self) -> float:
        """Rows sent to experts by one rank: top_k copies of each of its tokens (capacity-bound); under
        `moe_router_skew` the busiest rank's share, which sets the all-to-all's time."""
        return self.expert_slots * self.h * self.dt / self.sp_div * self.router_skew

    @cached_property
    def gathered_tokens_bytes(self) -> float:
        """moe_dispatcher=allgather: the hidden states of the tokens the ep group routes, gathered whole
        on each of its ranks (each once, whatever its top_k; the ranks keep their experts' rows)."""
        return self.routed_tokens * self.h * self.dt * self.ep

    def deepep_network_bytes(self, domains: int) -> float:
        """moe_dispatcher=deepep: what one rank sends over the network hop: each of its tokens once per
        NVLink domain that holds one of its top_k experts (DeepEP's internode dispatch forwards a token
        to a domain once and fans it out there over NVLink; group-limited routing caps the domains), under
        `moe_router_skew` the busiest rank's. Its
        tokens as `dispatch_bytes` counts them (under sp each tp rank sends its sequence shard's)."""
        moe = self.rp.model.moe
        reached = destination_domains(moe.experts, moe.top_k, domains, moe.router_groups, moe.router_group_topk)
        return self.tokens / self.sp_div * self.h * self.dt * reached * self.router_skew

    @cached_property
    def deepep_domain_bytes(self) -> float:
        """moe_dispatcher=deepep across NVLink domains: what one rank sends over the NVLink hop: the tokens
        the network hop brought it, each once per rank of the domain that holds one of its top_k experts
        (DeepEP's RDMA-and-NVLink forwarder, deepseek-ai/DeepEP@dd758ca csrc/kernels/legacy/internode.cu: a
        rank's several experts of one token take one copy, which the rank permutes to its experts' rows).
        Summed over the domains, each token of the ep group goes once to every ep rank its experts are on:
        `destination_domains` over the ep ranks, each holding a contiguous block of experts. Under
        `moe_router_skew` the busiest rank's share; its tokens as `deepep_network_bytes` counts them."""
        moe = self.rp.model.moe
        reached = destination_domains(moe.experts, moe.top_k, self.ep, moe.router_groups, moe.router_group_topk)
        return self.tokens / self.sp_div * self.h * self.dt * reached * self.router_skew

    @cached_property
    def moe_without_tp(self) -> bool:
        """MoE layers without tp collectives around their MLP: folded experts over tp > 1 (under sp, which
        folding needs there) and no shared expert, whose TP MLP would need the gathered sequence."""
        m = self.rp.model
        return bool(self.rp.folded and self.tp > 1 and m.moe is not None and not m.moe.shared_experts)

    def moe_mlp(self) -> dict[str, Block]:
        """An MoE layer's MLP blocks: under sp the second norm's own block, the router (norm, gate, top-k,
        permute), the routed experts' GEMMs (grouped, one per local expert and GEMM), and `moe_out` (the
        shared experts' GEMMs, the combine's un-permute and weighted sum, the residual add)."""
        m, t, T, dt, h, sp = self.rp.model, self.tp, self.tokens, self.dt, self.h, self.sp_div
        moe = m.moe
        width = moe.expert_ffn * (2 if m.gated else 1)
        R = self.routed_tokens  # the tokens this rank routes
        routed = R * moe.top_k  # token-expert pairs they make
        slots = self.expert_rows  # the rows the experts compute (balanced routing, capacity)
        et = self.etp  # what an expert's width is split by
        local_experts = moe.experts / self.ep
        fr, _ = gemm_cost(R, h, moe.experts, dt)
        fe1, _ = gemm_cost(slots, h, width / et, dt)
        fe2, _ = gemm_cost(slots, moe.expert_ffn / et, h, dt)
        shared_ffn = (moe.shared_expert_ffn or moe.expert_ffn) * moe.shared_experts
        fs1, _ = gemm_cost(T, h, shared_ffn * (2 if m.gated else 1) / t, dt)
        fs2, _ = gemm_cost(T, shared_ffn / t, h, dt)
        # router: norm, fp32 softmax / top-k over the experts, tokens permuted into expert order
        gate = 3 * 4 * R * moe.experts
        permute = 2 * dt * routed * (moe.capacity_factor or 1.0) * h
        norm_f, norm_b = self.opening_norm()
        b_router = norm_f + gate + permute
        bb_router = norm_b + 2 * gate + permute + self.weight_grad_bytes(h * moe.experts)
        ea_f, ea_b = self.activation(moe.expert_ffn / et)
        # expert rows per token of the micro-batch's cp slice
        per_token = slots / T
        ea_f, ea_b = ea_f * per_token, ea_b * per_token
        expert_w = local_experts * (h * width + moe.expert_ffn * h) / et
        sa_f, sa_b = self.activation(shared_ffn / t) if shared_ffn else (0.0, 0.0)
        # combine: un-permute, weight and sum the top_k outputs, then the residual add. It saves the
        # un-permuted outputs and the weights (the weights' gradient); the shared experts' input is
        # the router's norm output, saved once (by the router)
        combine = dt * (routed * (moe.capacity_factor or 1.0) + routed) * h + dt * routed * h
        return {
            **self.sp_norm("norm2"),
            "router": Block("gemm", fr, b_router, (1 if self.sp else 2) * ln_bytes(T, h, dt, sp) + self.opening_stats
                            + R * moe.experts * 4,
                            bb_router, bwd_only=R * moe.experts * 4),
            "experts": self.with_fp8_casts(
                Block("gemm", fe1 + fe2, ea_f + self.local_expert_sort,
                      self.saved_linear_input(slots * h) + slots * width / et * dt
                      + self.saved_linear_input(slots * moe.expert_ffn / et),
                      ea_b + self.local_expert_sort + self.weight_grad_bytes(expert_w), gemm_groups=2 * local_experts),
                (slots, h, width / et, False, local_experts * h * width / et),
                (slots, moe.expert_ffn / et, h, False, local_experts * moe.expert_ffn * h / et)),
            "moe_out": self.with_fp8_casts(Block("gemm", fs1 + fs2, sa_f + combine + self.residual_fwd(),
                             (routed * h + routed + T * shared_ffn * (3 if m.gated else 2) / t) * dt
                             + self.residual_mask,
                             sa_b + 2 * combine + self.residual_bwd(False)
                             + self.weight_grad_bytes(3 * h * shared_ffn / t if m.gated else 2 * h * shared_ffn / t),
                             bwd_only=(routed * h + routed) * dt + self.residual_mask),
                *(((T, h, shared_ffn * (2 if m.gated else 1) / t, True), (T, shared_ffn / t, h)) if shared_ffn else ())),
        }

    def moe_workspaces(self, n_s: float, n: float, opening_norm: float) -> dict[str, float]:
        """The MoE blocks' entries of `Anatomy.bwd_workspaces` (n_s, n and the opening norm's workspace as
        there)."""
        m, T, dt, h, t = self.rp.model, self.tokens, self.dt, self.h, self.tp
        ws: dict[str, float] = {}
        e = m.moe
        routed, slots = self.routed_tokens * e.top_k, self.expert_rows
        width = e.expert_ffn * (2 if m.gated else 1) / self.etp
        shared = (e.shared_expert_ffn or e.expert_ffn) * e.shared_experts * (2 if m.gated else 1) / t
        ws["moe_out"] = n_s + routed * h * dt + T * shared * dt + n + self.wgrad_tmp(h * shared)
        ws["experts"] = n_s + 2 * slots * h * dt + slots * width * dt + self.wgrad_tmp(h * width)
        ws["router"] = max(n_s + slots * h * dt / self.sp_div + n + 2 * T * e.experts * 4
                           + self.wgrad_tmp(h * e.experts), opening_norm)
        return ws

    def moe_weight_passes(self, norm: float) -> dict[str, tuple[float, float]]:
        """The MoE blocks' entries of `Anatomy.weight_passes` (`norm`: the opening norm output's gradient
        the router's weights need, 0 under sp)."""
        m, T, dt, h, t = self.rp.model, self.tokens, self.dt, self.h, self.tp
        out: dict[str, tuple[float, float]] = {}
        e = m.moe
        width = e.expert_ffn * (2 if m.gated else 1) / self.etp
        shared = (e.shared_expert_ffn or e.expert_ffn) * e.shared_experts
        slots = self.expert_rows
        out["router"] = (h * e.experts, self.routed_tokens * e.experts * 4 + norm)
        out["experts"] = (e.experts / self.ep * (h * width + e.expert_ffn * h / self.etp),
                          slots * (width + h) * dt)
        if shared:
            out["moe_out"] = (h * shared * ((3 if m.gated else 2) / t),
                              T * (shared * (2 if m.gated else 1) / t + h) * dt)
        return out
