"""The executor's model pieces in one process: parameter counts against the spec and the simulator's
per-rank accounting, tensor-parallel shards that add up to the full model (collectives emulated by
sums and concatenations), expert parallelism by hand-made dispatch, ring attention's chunked forward
and backward, the data split, and refusals."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from simexec.specs.cluster import get_cluster
from simexec.exec.nn import data
from simexec.exec.nn.gpt import GPT
from simexec.exec.nn.param_layout import Layout, holds, init_full, param_specs, shard
from simexec.exec.nn.reference import reference
from simexec.specs.model import ModelSpec, MoESpec, get_model
from simexec.specs.plan import parse_plan, resolve

torch.set_num_threads(1)
DATA = Path(__file__).resolve().parent / "data"

# A third model for the pieces the presets leave out: GQA, RoPE, RMSNorm, SwiGLU, q/k/v biases only.
GQA = ModelSpec(name="gqa-test", layers=2, hidden=64, heads=8, kv_heads=2, head_dim=8, ffn=96, gated=True,
                vocab=256, seq_len=32, norm="rmsnorm", qkv_bias=True)
MOE_BIAS = ModelSpec(name="moe-bias-test", layers=2, hidden=32, heads=4, kv_heads=4, head_dim=8, ffn=64,
                     gated=False, vocab=128, seq_len=16, bias=True, learned_pos=True,
                     moe=MoESpec(experts=4, top_k=2, expert_ffn=32, shared_experts=1, first_dense_layers=1))
MLA_MOE = get_model(str(Path(__file__).resolve().parent / "data" / "mla-moe-tiny.yaml"))  # DeepSeek-V3's layout
MODELS = [get_model("gpt-tiny"), get_model("moe-tiny"), GQA, MOE_BIAS, MLA_MOE]


def _rp(m: ModelSpec, plan: str):
    return resolve(m, get_cluster("local"), parse_plan(plan + ",dtype=fp32"), 16)


@pytest.mark.parametrize("m", MODELS, ids=lambda m: m.name)
def test_param_specs_count_what_the_model_spec_counts(m):
    assert sum(torch.Size(s.shape).numel() for s in param_specs(m)) == m.params


@pytest.mark.parametrize("plan", ["tp=2,pp=2", "tp=4", "dp=4,ep=2,tp=2", "dp=2,ep=2,pp=2"])
@pytest.mark.parametrize("m", MODELS, ids=lambda m: m.name)
def test_shards_hold_what_the_simulator_counts_per_rank(m, plan):
    if m.moe is None and "ep=" in plan:
        pytest.skip("ep on a dense model")
    if "tp=4" in plan and m.kv_heads % 4:
        pytest.skip("kv heads not divisible by tp")
    rp = _rp(m, plan)
    for pp_rank in range(rp.plan.pp):
        rank = rp.mesh.rank(pp=pp_rank, dp=rp.plan.ep - 1, tp=rp.plan.tp - 1)
        lay = Layout.of(rp, rank)
        units = set(rp.layers_of_pp_rank(pp_rank)) | ({-1} if pp_rank == 0 else set()) | (
            {m.layers} if pp_rank == rp.plan.pp - 1 else set())
        n = {"dense": 0, "expert": 0}
        for s in param_specs(m):
            if s.unit in units and holds(s, m, lay):
                numel = torch.Size(s.shape).numel() // (rp.plan.tp if s.tp_dim is not None else 1)
                n["expert" if s.expert is not None else "dense"] += numel
        want = rp.params_on_pp_rank(pp_rank)
        assert n["dense"] == want["dense"] and n["expert"] == want["expert"]


def test_init_is_deterministic_and_seeded():
    m = get_model("gpt-tiny")
    a, b, c = init_full(m, 0), init_full(m, 0), init_full(m, 1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.attn.wq"], c["layers.0.attn.wq"])


def _tp_forward(m: ModelSpec, tp: int, tokens, targets, pos) -> torch.Tensor:
    """The blocks of `tp` shards, with every collective done by hand (no sp): the mean loss."""
    full = init_full(m, 0)
    def layout(r: int) -> Layout:  # without folding a routed expert is split over tp as well
        return Layout(tp=tp, tp_rank=r, etp=tp, etp_rank=r)

    ranks = [GPT(m, layout(r), {s.name: shard(s, full[s.name], layout(r)) for s in param_specs(m)})
             for r in range(tp)]
    x = sum(g.embed(tokens, pos) for g in ranks)  # embed_out: all-reduce
    for l in range(m.layers):
        y = 0
        for g in ranks:
            q, kv = g.qkv(l, x, pos)
            y = y + g.proj(l, g.attn(l, q, kv, pos, pos), x)
        x = y  # attn_out: all-reduce
        if m.is_moe_layer(l):
            y = 0
            for g in ranks:
                h, w, xs, route = g.router(l, x)
                y = y + g.moe_out(l, x, h, w, g.experts(l, xs, route.counts.view(1, -1)), route)
        else:
            y = sum(g.fc2(l, g.fc1(l, x), x) for g in ranks)
        x = y  # mlp_out: all-reduce
    heads = [g.head(x) for g in ranks]
    gmax = torch.stack([mx for _, mx in heads]).amax(0)  # ce_max
    ce = sum(g.xent(lg, gmax, targets) for g, (lg, _) in zip(ranks, heads))  # ce_sum
    return GPT.loss(ce, 1.0 / targets.numel())


def test_capacity_factor_drops_and_pads_per_sequence():
    """capacity_factor=1: each expert holds ceil(T*k/E) rows per sequence, padded with zeros where
    fewer come, the later assignments of a busier expert dropped; a sequence's drops do not depend
    on the other sequences of its batch."""
    m = get_model(str(DATA / "moe-cap-tiny.yaml"))
    g = GPT(m, Layout(), init_full(m, 0))
    x = torch.randn(3, 32, m.hidden)
    h, w, xs, route = g.router(0, x)
    cap = 32 * m.moe.top_k // m.moe.experts
    assert route.counts.tolist() == [3 * cap] * m.moe.experts and xs.shape[0] == 3 * cap * m.moe.experts
    kept = route.rows >= 0
    assert 0 < int((~kept).sum()) and len(set(route.rows[kept].tolist())) == int(kept.sum())
    padded = torch.ones(xs.shape[0], dtype=torch.bool)
    padded[route.rows[kept]] = False
    assert int(padded.sum()) == int((~kept).sum()) and not xs[padded].any()  # as many pads as drops
    _, _, _, alone = g.router(0, x[1:2])
    dropped_alone = (alone.rows < 0).tolist()
    assert dropped_alone == (route.rows < 0).view(3, -1)[1].tolist()


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("m", MODELS, ids=lambda m: m.name)
def test_tensor_parallel_shards_add_up_to_the_full_model(m, tp):
    if m.kv_heads % tp:
        pytest.skip("kv heads not divisible")
    b = data.whole_batch(_rp(m, "dp=1,gbs=2"), 0, 0)
    full = GPT(m, Layout(), init_full(m, 0)).forward(b.tokens, b.targets, b.pos)
    assert _tp_forward(m, tp, b.tokens, b.targets, b.pos).item() == pytest.approx(full.item(), rel=1e-5)


@pytest.mark.parametrize("m", [get_model("moe-tiny"), MOE_BIAS], ids=lambda m: m.name)
def test_expert_parallel_dispatch_by_hand(m):
    """Two ep ranks route their own tokens; dispatch and combine done by slicing: same outputs."""
    full = init_full(m, 0)
    l = m.layers - 1
    one = GPT(m, Layout(), full)
    eps = [GPT(m, Layout(ep=2, ep_rank=r), {s.name: full[s.name] for s in param_specs(m)
                                             if holds(s, m, Layout(ep=2, ep_rank=r))}) for r in range(2)]
    x = [torch.randn(1, 8, m.hidden, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    routed = [eps[r].router(l, x[r]) for r in range(2)]  # (h, w, xs, route) per source rank
    half = m.moe.experts // 2
    # dispatch: source s sends to rank d the rows of experts [d*half, (d+1)*half)
    pieces = {}
    for s, (_, _, xs, route) in enumerate(routed):
        sizes = route.counts.view(2, half).sum(1).tolist()
        for d, part in enumerate(xs.split(sizes)):
            pieces[(s, d)] = part
    outs = {}
    for d in range(2):
        counts = torch.stack([routed[s][3].counts.view(2, half)[d] for s in range(2)])  # (sources, local)
        y = eps[d].experts(l, torch.cat([pieces[(s, d)] for s in range(2)]), counts)
        for s, part in enumerate(y.split(counts.sum(1).tolist())):
            outs[(s, d)] = part
    for s in range(2):  # combine, then compare with the unsharded layer
        h, w, xs, route = routed[s]
        got = eps[s].moe_out(l, x[s], h, w, torch.cat([outs[(s, d)] for d in range(2)]), route)
        h1, w1, xs1, r1 = one.router(l, x[s])
        want = one.moe_out(l, x[s], h1, w1, one.experts(l, xs1, r1.counts.view(1, -1)), r1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_micro_batches_partition_the_global_batch():
    rp = _rp(get_model("gpt-tiny"), "dp=2,cp=2,gbs=8")
    x, y = data.global_batch(512, 8, 16, 0, 3)
    for d in range(2):
        for mb in range(rp.micro_batches):
            for c in range(2):
                b = data.micro_batch(rp, 0, 3, d, mb, c)
                rows = slice(d * 4 + mb, d * 4 + mb + 1)
                assert torch.equal(b.tokens, x[rows][:, b.pos]) and torch.equal(b.targets, y[rows][:, b.pos])
    pos = torch.cat([data.cp_positions(16, 2, c) for c in range(2)])
    assert sorted(pos.tolist()) == list(range(16))
    assert data.cp_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]  # chunks 0 and 3


def test_reference_trains():
    rp = _rp(get_model("gpt-tiny"), "dp=1,gbs=4")
    a, b = reference(rp, 3), reference(rp, 3)
    assert a["losses"] == b["losses"]
    assert a["losses"][-1] != a["losses"][0]
    assert not torch.equal(a["params"]["layers.0.attn.wq"], init_full(rp.model, 0)["layers.0.attn.wq"])


def test_unsupported_names_what_is_missing():
    from simexec.exec.rank.unsupported_plans import unsupported

    assert unsupported(_rp(get_model("gpt-tiny"), "dp=2,tp=2,pp=2")) is None
    assert unsupported(_rp(get_model("moe-tiny"), "dp=2,ep=2")) is None
    assert unsupported(resolve(get_model("deepseek-v3"), get_cluster("local"), parse_plan("dp=1,dtype=fp32"), 16)) is None
    dropping = get_model("moe-tiny").model_copy(update={"moe": get_model("moe-tiny").moe.model_copy(update={"capacity_factor": 1.25})})
    assert unsupported(_rp(dropping, "dp=2,ep=2")) is None
    msg = unsupported(_rp(dropping, "dp=2,ep=2,cp=2"))
    assert msg and "MoE token dropping (capacity_factor=1.25) with cp=2" in msg and "moe-tiny" in msg
    assert unsupported(_rp(get_model("gpt-tiny"), "cp=2,cp_impl=ring")) is None


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("m", [get_model("gpt-tiny"), GQA], ids=lambda m: m.name)
def test_ring_attention_pieces_match_sdpa(m, cp):
    """Every cp rank's queries (load-balanced chunks) against the K/V chunks in ring order (its own
    first), merged by log-sum-exp, then the flash-style backward per chunk: output and dQ/dK/dV equal
    causal SDPA of the whole sequence (fp64). The first chunks hide some query rows completely."""
    import math

    from simexec.exec.nn.attention import attn_merge, attn_partial, attn_partial_bwd

    g = torch.Generator().manual_seed(0)
    B, T, hd, nh, nkv = 2, 16, m.head_dim, m.heads, m.kv_heads
    q = torch.randn(B, nh, T, hd, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, nkv, T, hd, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, nkv, T, hd, generator=g, dtype=torch.float64, requires_grad=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nh != nkv)
    do = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    ref.backward(do)
    pos = [data.cp_positions(T, cp, r) for r in range(cp)]
    scale = 1 / math.sqrt(hd)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for me in range(cp):
        qp = q.detach()[:, :, pos[me]]
        order = [(me - i) % cp for i in range(cp)]  # the chunk held at hop i
        o = lse = None
        for j in order:
            mask = pos[j][None, :] <= pos[me][:, None]
            oj, lj = attn_partial(qp, k.detach()[:, :, pos[j]], v.detach()[:, :, pos[j]], mask, scale)
            o, lse = (oj, lj) if o is None else attn_merge(o, lse, oj, lj)
        torch.testing.assert_close(o, ref.detach()[:, :, pos[me]], rtol=1e-10, atol=1e-12)
        dop = do[:, :, pos[me]]
        delta = (dop * o).sum(-1)
        dq = torch.zeros_like(qp)
        for j in order:
            mask = pos[j][None, :] <= pos[me][:, None]
            a, b, c = attn_partial_bwd(qp, k.detach()[:, :, pos[j]], v.detach()[:, :, pos[j]], mask, scale, lse,
                                       dop, delta)
            dq += a
            dk[:, :, pos[j]] += b
            dv[:, :, pos[j]] += c
        torch.testing.assert_close(dq, q.grad[:, :, pos[me]], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dk, k.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dv, v.grad, rtol=1e-10, atol=1e-12)


def test_unfused_attention_equals_the_fused_kernel_with_grouped_heads():
    """flash_attention=0 runs Q.K^T, softmax and P.V as separate ops; forward and gradients agree with
    SDPA's, causal and with query heads sharing kv heads."""
    torch.manual_seed(0)
    B, T, hd = 2, 16, GQA.head_dim
    pos = torch.arange(T)
    outs = []
    for flash in (True, False):
        model = GPT(GQA, Layout(), {}, flash=flash)
        q = torch.randn(B, GQA.heads, T, hd, generator=torch.Generator().manual_seed(1), requires_grad=True)
        kv = torch.randn(2, B, GQA.kv_heads, T, hd, generator=torch.Generator().manual_seed(2), requires_grad=True)
        o = model.attn(0, q, kv, pos, pos)
        o.pow(2).sum().backward()
        outs.append((o.detach(), q.grad, kv.grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _windowed_attention_by_hand(q, kv, qpos, kpos, window):
    """Each query, one at a time, against the keys at its own position and the window - 1 before it."""
    k, v = kv[0], kv[1]
    rep = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for i, p in enumerate(qpos.tolist()):
        seen = [j for j, kp in enumerate(kpos.tolist()) if p - window < kp <= p]
        kk, vv = k[:, :, seen].repeat_interleave(rep, 1), v[:, :, seen].repeat_interleave(rep, 1)
        w = torch.softmax(q[:, :, i:i + 1] @ kk.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        out[:, :, i:i + 1] = w @ vv
    B, nh, T, hd = q.shape
    return out.transpose(1, 2).reshape(B, T, nh * hd)


@pytest.mark.parametrize("flash", [True, False])
def test_sliding_window_attends_to_the_band_alone(flash):
    """A windowed layer's query at position p attends to keys p - w + 1 .. p, as computed query by
    query; the layer every `full_attention_every` attends causally to all. Under context parallelism's
    all-gather (queries at a rank's positions against all keys) the same holds."""
    spec = get_model(str(Path(__file__).resolve().parent / "data" / "window-tiny.yaml"))
    w, T, hd = spec.sliding_window, spec.seq_len, spec.head_dim
    model = GPT(spec, Layout(), {}, flash=flash)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, spec.heads, T, hd, generator=g, dtype=torch.float64)
    kv = torch.randn(2, 2, spec.kv_heads, T, hd, generator=g, dtype=torch.float64)
    pos = torch.arange(T)
    torch.testing.assert_close(model.attn(0, q, kv, pos, pos), _windowed_attention_by_hand(q, kv, pos, pos, w))
    torch.testing.assert_close(model.attn(1, q, kv, pos, pos), _windowed_attention_by_hand(q, kv, pos, pos, T))
    mine = torch.cat([torch.arange(0, 8), torch.arange(24, 32)])  # cp rank 0 of 2: chunks 0 and 3
    torch.testing.assert_close(model.attn(0, q[:, :, mine], kv, mine, pos),
                               _windowed_attention_by_hand(q[:, :, mine], kv, mine, pos, w))


def test_tied_embeddings_have_no_head_weight():
    """A tied model's parameters are the untied ones less the head's (V x C), as the spec counts them."""
    from pathlib import Path

    tied = get_model(str(Path(__file__).resolve().parent / "data" / "gpt-tiny-tied.yaml"))
    names = {s.name for s in param_specs(tied)}
    assert "head.w" not in names and "embed.wte" in names
    assert sum(torch.Size(s.shape).numel() for s in param_specs(tied)) == tied.params
