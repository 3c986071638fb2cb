"""Pipeline bubbles against the closed forms, with uniform stages and free communication."""
import pytest

from simexec.specs.cluster import get_cluster
from simexec.specs.model import ModelSpec
from simexec.sim.simulate import simulate

# Free communication: unbounded links, no latency, no launch cost, no overlap penalty.
_LOCAL = get_cluster("local")
FREE = _LOCAL.model_copy(update={
    "device": _LOCAL.device.model_copy(update={"launch_overhead_s": 0.0}),
    "node": _LOCAL.node.model_copy(update={"intra_bw": 1e20, "intra_latency_s": 0.0}),
    "costs": _LOCAL.costs.model_copy(update={"collective_latency_s": 0.0, "overlap_slowdown": 1.0}),
})
# 16 identical layers; a vocabulary of 64 makes the embedding and head negligible.
UNIFORM = ModelSpec(name="uniform", layers=16, hidden=1024, heads=8, kv_heads=8, head_dim=128, ffn=4096,
                    gated=False, vocab=64, seq_len=1024)


def bubble(plan: str) -> tuple[float, float]:
    """Seconds of pipeline bubble, and its fraction of bubble + compute, on the slowest rank."""
    b = simulate(UNIFORM, FREE, plan).breakdown_s
    idle = b.get("pipeline_bubble", 0.0)
    return idle, idle / (idle + b["compute"])


def bubble_fraction(plan: str) -> float:
    return bubble(plan)[1]


def pass_times(plan: str, m: int) -> tuple[float, float, float]:
    """Seconds of a micro-batch's forward, input-gradient and weight-gradient passes on the first
    rank (all its chunks), from the simulated trace."""
    per_mb = {"fwd": 0.0, "bwd": 0.0, "wgrad": 0.0}
    for e in simulate(UNIFORM, FREE, plan, trace=True).trace.events:
        if e.rank == 0 and e.kind == "compute" and e.phase in per_mb:
            per_mb[e.phase] += e.dur_us / 1e6 / m
    return per_mb["fwd"], per_mb["bwd"], per_mb["wgrad"]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4)])
def test_bubble_is_p_minus_1_over_m_plus_p_minus_1(schedule, p, m):
    """GPipe and 1F1B idle (p-1)/(m+p-1) of the time (Huang et al. 2019; Narayanan et al. 2021)."""
    assert bubble_fraction(f"pp={p},gbs={m},schedule={schedule}") == pytest.approx((p - 1) / (m + p - 1), rel=0.02)


@pytest.mark.parametrize("v", [2, 4])
def test_interleaving_shrinks_the_bubble_by_vpp(v):
    """Interleaved 1F1B with v chunks per rank: bubble (p-1)/(v m + p - 1) (Megatron-LM SC'21 §2.2.2)."""
    p, m = 4, 8
    seconds, fraction = bubble(f"pp={p},vpp={v},gbs={m}")
    assert fraction == pytest.approx((p - 1) / (v * m + p - 1), rel=0.02)
    assert seconds == pytest.approx(bubble(f"pp={p},gbs={m}")[0] / v, rel=0.03)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16)])
def test_zero_bubble_h1_idles_p_minus_1_times_f_plus_b_minus_w(p, m):
    """ZB-H1 (Qi et al. 2024, Table 1): bubble (p-1)(T_F + T_B - T_W), B the input-gradient pass and W
    the weight-gradient pass, against 1F1B's (p-1)(T_F + T_B + T_W); the passes' times taken from the
    simulated trace."""
    f, b, w = pass_times(f"pp={p},gbs={m},schedule=zb-h1", m)
    assert w > 0.5 * b  # a weight-gradient GEMM per input-gradient GEMM
    assert bubble(f"pp={p},gbs={m},schedule=zb-h1")[0] == pytest.approx((p - 1) * (f + b - w), rel=0.03)
    assert bubble(f"pp={p},gbs={m}")[0] == pytest.approx((p - 1) * (f + b + w), rel=0.03)


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4)])
def test_interleaved_zero_bubble_idles_a_vth_of_zb_h1(p, m, v):
    """Interleaved zero bubble: ZB-H1's bubble over v virtual stages, (p-1)(T_F + T_B - T_W)/v, the
    passes' times those of a whole stage's (v chunks') forward, input and weight passes."""
    f, b, w = pass_times(f"pp={p},vpp={v},gbs={m},schedule=interleaved-zb", m)
    idle = bubble(f"pp={p},vpp={v},gbs={m},schedule=interleaved-zb")[0]
    assert idle == pytest.approx((p - 1) * (f + b - w) / v, rel=0.04)
    assert idle < bubble(f"pp={p},vpp={v},gbs={m}")[0] / 2


def _list_schedule_span(schedule: str, p: int, m: int, v: int, f: float, b: float, w: float) -> float:
    """Seconds until the last rank's last action ends when every action of `pipeline_order` starts as
    soon as its rank is free and its input is there (a forward after the previous stage's, a backward
    after the next stage's, a weight pass after its backward), messages free: the schedule alone."""
    from simexec.program.schedules import pipeline_order, stage_of

    order, V = pipeline_order(schedule, p, m, v), p * v
    end, ptr, free = {}, [0] * p, [0.0] * p
    while any(ptr[r] < len(order[r]) for r in range(p)):
        for r in range(p):
            while ptr[r] < len(order[r]):
                c, kind, mb = order[r][ptr[r]]
                vs = stage_of(schedule, p, r, c)
                dep = {"F": ("F", vs - 1) if vs > 0 else None,
                       "B": ("B", vs + 1) if vs < V - 1 else ("F", vs),
                       "W": ("B", vs)}[kind]
                if dep is not None and dep + (mb,) not in end:
                    break
                start = max(free[r], end[dep + (mb,)] if dep else 0.0)
                free[r] = end[(kind, vs, mb)] = start + {"F": f, "B": b, "W": w}[kind]
                ptr[r] += 1
    return max(free)


def _passes_end(plan: str) -> float:
    """Seconds until the last rank's passes end: the step less the optimizer after them."""
    r = simulate(UNIFORM, FREE, plan)
    return r.step_time_s - r.breakdown_s["optimizer"]


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16)])
def test_dualpipev_runs_its_order(p, m):
    """DualPipeV, its pairs run one after the other: the simulated passes end when its order, replayed
    with the chunks' pass times and free messages, ends."""
    plan = f"pp={p},vpp=2,gbs={m},schedule=dualpipev"
    f, b, w = pass_times(plan, m)
    assert _passes_end(plan) == pytest.approx(_list_schedule_span("dualpipev", p, m, 2, f / 2, b / 2, w / 2), rel=0.005)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16)])
def test_zb_v_runs_its_order_without_a_turn_message_and_idles_least(p, m):
    """ZB-V (two chunks per rank in a V): the simulated passes end when the schedule, replayed with the
    chunks' pass times and free messages (the turn on the last rank sends nothing anyway), ends, and its
    bubble is smaller than interleaved zero bubble's over the same two chunks and half ZB-H1's."""
    plan = f"pp={p},vpp=2,gbs={m},schedule=zb-v"
    f, b, w = pass_times(plan, m)  # both chunks of the first rank: each chunk is half
    assert _passes_end(plan) == pytest.approx(_list_schedule_span("zb-v", p, m, 2, f / 2, b / 2, w / 2), rel=0.005)
    idle = bubble(plan)[0]
    assert idle < bubble(f"pp={p},vpp=2,gbs={m},schedule=interleaved-zb")[0]
    assert idle < bubble(f"pp={p},gbs={m},schedule=zb-h1")[0] / 2


def test_dualpipe_overlap_hides_expert_all_to_alls_under_the_other_pass():
    """DeepSeek's DualPipe: with each pair's forward and backward merged kernel by kernel, one pass's
    all-to-alls run under the other's compute; the same instructions, less exposed communication."""
    plan = "ep=8,pp=2,vpp=2,gbs=32,schedule=dualpipev,rank_order=pp-tp-cp-dp"  # ep spans both nodes
    apart = simulate("mixtral-8x7b", "2xdgx-h100", plan)
    merged = simulate("mixtral-8x7b", "2xdgx-h100", plan + ",dualpipe_overlap=1")
    assert merged.breakdown_s["comm.ep"] < 0.8 * apart.breakdown_s["comm.ep"]
    assert merged.step_time_s < 0.97 * apart.step_time_s


@pytest.mark.parametrize("plan", ["tp=8,gbs=8", "tp=8,sp=1,gbs=8", "tp=8,gbs=8,recompute=full"])
def test_tp_overlap_hides_input_gradient_collectives_under_weight_gradients(plan):
    """Megatron-LM's asynchronous tp gradient communication: the all-reduce (reduce-scatter under sp)
    after each column-parallel GEMM's input gradients runs under its weight gradients. The step
    saves about what the rank no longer waits for, at most those collectives' time, and none of it
    where nothing runs under them."""
    apart = simulate("llama3-8b", "dgx-h100", plan)
    under = simulate("llama3-8b", "dgx-h100", plan + ",tp_overlap=1", trace=True)
    hidden = ("attn_in", "mlp_in", "head_in")
    coll_s = sum(e.dur_us for e in under.trace.events if e.rank == 0 and e.kind == "collective" and e.phase == "bwd"
                 and e.name.split(".")[1] in hidden) / 1e6
    saved = apart.breakdown_s["comm.tp"] - under.breakdown_s["comm.tp"]
    assert 0.1 * coll_s < saved < coll_s
    assert apart.step_time_s - under.step_time_s == pytest.approx(saved, rel=0.25)
    assert under.peak_memory_bytes == pytest.approx(apart.peak_memory_bytes, rel=0.01)


def test_zb_v_balances_peak_memory_over_the_ranks():
    """Every rank of a V holds the same number of layers' activations at its peak (Qi et al. 2024, §6),
    where 1F1B's first rank holds p micro-batches and its last one: about 1F1B's largest peak, on
    every rank."""
    peaks = {s: list(simulate(UNIFORM, FREE, f"pp=4,{s},gbs=8").peak_memory_bytes_per_rank.values())
             for s in ("schedule=1f1b", "schedule=zb-h1", "vpp=2,schedule=zb-v")}
    spread = {s: max(v) / min(v) - 1 for s, v in peaks.items()}
    assert spread["vpp=2,schedule=zb-v"] < 0.03 < spread["schedule=zb-h1"] < spread["schedule=1f1b"]
    assert max(peaks["vpp=2,schedule=zb-v"]) == pytest.approx(max(peaks["schedule=1f1b"]), rel=0.05)


def test_breakdown_adds_up_to_the_step_time():
    r = simulate("gpt3-125m", "2xdgx-a100-80g", "dp=4,tp=2,pp=2,gbs=16")
    assert sum(r.breakdown_s.values()) == pytest.approx(r.step_time_s, rel=1e-9)
    assert {"compute", "comm.tp", "pipeline_bubble"} <= set(r.breakdown_s)
