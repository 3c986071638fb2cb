"""Calibrate the simulator's hardware model against this machine from micro-benchmarks.

`calibrate_from_microbench(cluster, ranks, out_path)`: run `simexec.calibrate.microbench` on the
executor's own rank actors and fit each cost parameter to the benchmark that isolates it
(`fit_microbench`): the per-operator dispatch cost, GEMM / attention / element-wise rates, host
copies, the collectives' call and hop latencies and loopback bandwidth (`simexec.calibrate.comm`),
the executor's per-instruction and per-backward overheads, and the cores the ranks share with each
other and with the host's background load. The result is a profile (`simexec.calibrate.profiles`) that
`simexec.calibrate.traces` typically starts its fit from.
"""
from __future__ import annotations

import json
import math
import socket
import statistics
import time
from typing import Callable, Optional, Sequence, Union

from simexec.calibrate.profiles import (
    CalibrationError, PathLike, jsonable, host_cores, linux_slice, make_profile, save_json_plain, save_profile,
)
from simexec.calibrate.comm import fit_comm, fit_comm_cpu, summed_mean
from simexec.specs.cluster import ClusterSpec, get_cluster


# --- statistics ------------------------------------------------------------------------------------
def kernel_mean(ts: Sequence[float]) -> float:
    """A compute benchmark's mean without its stalls: samples over 10x the median are the vCPU taken
    away for milliseconds, not the kernel (one such stall in the 200 one-operator adds once put the
    dispatch cost at 26 µs instead of 5, and every fit after it went wrong: the demo's micro-benchmark
    profile predicted its plans 3-10x too slow). The tail below that stays in, as `summed_mean` keeps it."""
    if not ts:
        return float("nan")
    cut = 10.0 * statistics.median(ts)
    return statistics.fmean([t for t in ts if t <= cut])


def _linfit(xs: Sequence[float], ys: Sequence[float], weights: Optional[Sequence[float]] = None) -> tuple[float, float]:
    """Least squares y = a + b x (weighted); returns (a, b)."""
    import numpy as np

    x, y = np.asarray(xs, float), np.asarray(ys, float)
    w = np.ones_like(x) if weights is None else np.asarray(weights, float)
    A = np.stack([np.ones_like(x), x], 1) * w[:, None]
    sol, *_ = np.linalg.lstsq(A, y * w, rcond=None)
    return float(sol[0]), float(sol[1])


def _rel_weights(ys: Sequence[float]) -> list[float]:
    """Weights for relative (not absolute) errors in a linear fit."""
    return [1.0 / max(y, 1e-12) for y in ys]


# --- micro-benchmark fit ---------------------------------------------------------------------------
def merge_results(extras: dict) -> dict[str, list[dict]]:
    """Every rank's benchmark records, by kind (a rank reports the benchmarks it led)."""
    out: dict[str, list[dict]] = {}
    for rank in sorted(extras, key=lambda r: int(r)):
        ex = extras[rank]
        for kind, recs in (ex.get("results") or {}).items():
            for rec in recs:
                out.setdefault(kind, []).append({**rec, "rank": int(rank)})
    return out


_SAMPLES = ("t", "cpu")  # a benchmark record's timings; its other fields say what was measured


def _identity(rec: dict) -> tuple:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in rec.items() if k not in _SAMPLES))


def pool_microbench(raws: Sequence[dict]) -> dict:
    """Several micro-benchmark runs of the same configuration (raw timings: `{"extras", "background"}`)
    as one: each benchmark's timings from every run together, each run's sharing rounds kept apart
    (their steps are aligned within a run). A host whose speed drifts over minutes is then measured
    across them, as the plans that the profile predicts are."""
    if len(raws) == 1:
        return raws[0]
    extras: dict[str, dict] = {}
    index: dict[tuple, dict] = {}  # (rank, kind, what a record measured) -> its pooled record
    for i, raw in enumerate(raws):
        for rank, ex in raw["extras"].items():
            out = extras.setdefault(str(rank), {**ex, "results": {}})["results"]
            for kind, recs in (ex.get("results") or {}).items():
                pooled = out.setdefault(kind, [])
                for rec in recs:
                    if kind == "sharing":
                        pooled.append({**rec, "round": 1000 * i + rec.get("round", 0)})
                        continue
                    nested = "records" if kind == "blocks" else None
                    key = (str(rank), kind, _identity({k: v for k, v in rec.items() if k != nested}))
                    same = index.get(key)
                    if same is None:
                        same = index[key] = json.loads(json.dumps(rec))
                        pooled.append(same)
                    elif nested:
                        by_name = {r["name"]: r for r in same[nested]}
                        for r in rec[nested]:
                            if r["name"] in by_name:
                                by_name[r["name"]]["t"] = by_name[r["name"]]["t"] + r["t"]
                    else:
                        for k in _SAMPLES:
                            if k in rec:
                                same[k] = same.get(k, []) + rec[k]
    bgs = [raw.get("background") for raw in raws]
    return {"extras": extras, "background": None if None in bgs else statistics.fmean(bgs), "runs": len(raws)}


# The one-rank step has one optimizer step against ~150 block instructions: its rows weigh this
# much more, so that its memory traffic (the fused Adam streams every parameter's states) is priced.
OPTIM_WEIGHT = 5.0
# Adam's element-wise cost, one for every model: the kernel is the same whatever the layers are (on a
# CPU core its square roots and divisions cost more than the bytes it streams)
OPTIM_KEY = "optim.optim"


def one_rank_tensors(model: str) -> int:
    """Parameter tensors of the model on one rank (what the one-rank step's Adam updates)."""
    from simexec.specs.model import get_model
    from simexec.sim.host.tensors import unit_tensor_count

    m = get_model(model)
    return sum(unit_tensor_count(m, unit) for unit in range(-1, m.layers + 1))


def sharing_steps(records: Sequence[dict]) -> dict[int, list[float]]:
    """Step times of the `sharing` benchmark by number of ranks running at once: per run, only steps
    that every rank of the run ran within a common window (after every rank's first step, before
    any rank's last ended); the ranks' first steps differ in length (memory tracking, caches), so a
    rank's later steps would otherwise partly run alone. Records without step spans: every step
    after the first."""
    runs: dict[tuple, list[dict]] = {}
    for r in records:
        runs.setdefault((r["active"], r.get("round", 0)), []).append(r)
    out: dict[int, list[float]] = {}
    for (n, _), rs in runs.items():
        if not all(r.get("spans") for r in rs):
            for r in rs:
                steps = r.get("steps") or []
                out.setdefault(n, []).extend(steps[1:] or steps)
            continue
        lo = max(r["spans"][0][1] for r in rs)
        hi = min(r["spans"][-1][1] for r in rs)
        for r in rs:
            out.setdefault(n, []).extend(b - a for a, b in r["spans"][1:] if a >= lo and b <= hi)
    return {n: xs for n, xs in out.items() if xs}


def nograd_forward_ratio(blocks: Sequence[dict]) -> float:
    """What a recomputed layer's first forward costs against the same forward with autograd, from
    the one-rank step run both ways (`blocks` records without and with `recompute="full"`, micro-batch
    1, the benchmark's own model): summed means of the forward instructions that the recompute run
    repeats later (`recompute.<block>...`), which it runs without recording a graph or saving
    tensors. 1 when either run is missing."""
    plain = next((b for b in blocks if b.get("recompute", "none") == "none" and b.get("mbs") == 1
                  and not b.get("model")), None)
    full = next((b for b in blocks if b.get("recompute") == "full"), None)
    if plain is None or full is None:
        return 1.0
    from simexec.sim.host.model import forwards_without_grad

    first = forwards_without_grad(r["name"] for r in full["records"])
    with_grad = {r["name"]: kernel_mean(r["t"]) for r in plain["records"]}
    no_grad = {r["name"]: kernel_mean(r["t"]) for r in full["records"] if r["name"] in first and r["name"] in with_grad}
    if not no_grad:
        return 1.0
    ratio = sum(no_grad.values()) / sum(with_grad[n] for n in no_grad)
    return float(min(1.0, max(0.2, ratio)))


def fit_blocks(records: Sequence[dict], model: str, *, flop_seconds: Callable[[str, float], float],
               mem_bw: float, dtype: str = "fp32", op_floor: float = 0.0) -> Optional[dict]:
    """What the executor's instructions cost a core, from one-rank steps at several micro-batch sizes:
    time = instr (+ bwd) + ops x op + flop_seconds(op, flops) + bytes / mem_bw x elementwise[phase.block].

    The per-instruction, per-backward and per-operator costs are shared by every block; each block's
    element-wise cost per byte is its own (a streaming add is 1; GELU-tanh, softmax, layer norm and
    the loss's log-softmax cost several times more per byte on a CPU core). Linear least squares on
    relative errors with non-negative coefficients; the operator cost here is the one inside a real
    step (a tiny operator in a warm loop runs ~2x cheaper). A record may name another `model` than
    `model` (the micro-benchmarks also step moe-tiny): its blocks get keys of their own,
    `<family>/<phase>.<block>` (`simexec.sim.host.operators.cost_family`), and share the per-operator costs.
    The optimizer step (Adam) is its operators, its kernel's pass per tensor at an operator's cost
    (`simexec.sim.host.operators.adam_kernel_passes`) and its bytes at an element-wise cost of its own,
    `optim.optim`, one for every model."""
    import numpy as np
    from scipy.optimize import lsq_linear

    from simexec.program.instructions import Instr
    from simexec.specs.model import get_model
    from simexec.program.adam import ADAM_FLOPS_PER_PARAM
    from simexec.program.dispatch_key import dispatch_key
    from simexec.sim.host.operators import adam_kernel_passes, adam_ops, cost_family, dispatch_table, ops_of

    def model_of(rec: dict) -> str:
        return rec.get("model") or model

    specs = {m: get_model(m) for m in {model_of(r) for r in records}}
    tables = {m: dispatch_table(dispatch_key(spec)) for m, spec in specs.items()}
    prefix = {m: "" if m == model else f"{cost_family(spec)}/" for m, spec in specs.items()}

    def key_of(rec: dict) -> str:
        return f"{prefix[model_of(rec)]}{rec['phase']}.{rec['block']}"

    recs = [r for r in records if r["block"] not in ("optim", "cpu_optim") and r["phase"] in ("fwd", "bwd")]
    optim = [r for r in records if r["block"] == "optim" and r["bytes"] > 0]
    keys = sorted({key_of(r) for r in recs if r["bytes"] > 0} | ({OPTIM_KEY} if optim else set()))
    col = {k: 3 + i for i, k in enumerate(keys)}
    rows, ys, ts = [], [], []
    for rec in recs:
        ins = Instr(0, rec["name"], "compute", "compute", rec["op"], phase=rec["phase"], block=rec["block"])
        t = kernel_mean(rec["t"])
        flop_t = flop_seconds(rec["op"], rec["flops"]) if rec["op"] in ("gemm", "attention") else 0.0
        row = [0.0] * (3 + len(keys))
        row[0], row[1] = 1.0, 1.0 if rec["phase"] == "bwd" else 0.0
        row[2] = ops_of(ins, tables[model_of(rec)])
        if rec["bytes"] > 0:
            row[col[key_of(rec)]] = rec["bytes"] / mem_bw
        rows.append(row)
        ys.append(t - flop_t)
        ts.append(t)
    if len(rows) < 4 + len(keys):
        return None
    weights = [1.0] * len(rows)
    for rec in optim:  # Adam: the operators, the kernel's pass per tensor, its element-wise traffic
        t = kernel_mean(rec["t"])
        row = [0.0] * (3 + len(keys))
        tensors, elements = one_rank_tensors(model_of(rec)), rec["flops"] / ADAM_FLOPS_PER_PARAM
        row[0], row[2] = 1.0, adam_ops(tensors, dtype, elements) + adam_kernel_passes(tensors, dtype, elements)
        row[col[OPTIM_KEY]] = rec["bytes"] / mem_bw
        rows.append(row)
        ys.append(t)
        ts.append(t)
        weights.append(OPTIM_WEIGHT)
    A, y, w = np.asarray(rows), np.asarray(ys), np.asarray(weights) / np.asarray(ts)
    lo = np.zeros(A.shape[1])
    lo[2] = op_floor  # an operator inside a step costs at least what it costs in a warm loop
    lo[3:] = 1.0  # nothing runs faster than a streaming add
    sol = lsq_linear(A * w[:, None], y * w, bounds=(lo, np.inf)).x
    pred = A @ sol
    return {"instr_s": max(1e-7, float(sol[0])), "bwd_s": float(sol[1]), "op_s": max(1e-8, op_floor, float(sol[2])),
            "elementwise": {k: float(sol[col[k]]) for k in keys},
            "rel_err": float(np.median(np.abs((pred - y) / np.asarray(ts)))), "records": len(rows)}


def fit_sharing(slow: dict[int, float], cores: int, background: Optional[float] = None) -> tuple[float, float, float]:
    """(background_load, compute_contention, timeslice_contention) that make the host model's rate
    (`simexec.sim.host.model`) slow n ranks stepping at once by `slow[n]` against one alone: a grid search
    on log ratios. The background is fitted too unless measured; the time-slicing slowdown only when
    some n exceeds the cores."""
    import numpy as np

    from simexec.sim.host.cores import thread_rate

    ns = sorted(slow)

    def loss(bg: float, cc: float, ts: float) -> float:
        one = thread_rate(1, cores, bg, cc, ts)
        return sum((math.log(one / thread_rate(n, cores, bg, cc, ts)) - math.log(slow[n])) ** 2 for n in ns)

    bgs = [float(background)] if background is not None else list(np.linspace(0.0, cores - 0.1, 40))
    ccs = list(np.linspace(1.0, 3.0, 81))
    tss = list(np.linspace(1.0, 2.0, 41)) if max(ns) > cores else [1.0]
    best = min(((b, c, t) for b in bgs for c in ccs for t in tss), key=lambda x: loss(*x))
    return tuple(float(v) for v in best)


def gloo_loops_idle(extras: dict) -> bool:
    """Whether every rank ran the benchmarks with gloo's event loops at `SCHED_IDLE` (`run_microbench`
    counts them); runs recorded before it counted ran them as gloo starts them."""
    return bool(extras) and all((ex.get("gloo_loops_idled") or 0) > 0 for ex in extras.values())


def fit_microbench(extras: dict, base: ClusterSpec, *, cores: Optional[int] = None, model: str = "gpt-tiny",
                   measured_background: Optional[float] = None) -> tuple[dict, dict]:
    """Cost parameters from micro-benchmark results (`run_microbench`'s `extra` of every rank).

    measured_background: the cores the host's other users took while the benchmarks ran (the
    session's CPU meter); without it, the background is fitted to the sharing benchmark.
    Returns (profile sections {costs, device, node}, a report of each fit with its residuals)."""
    R = merge_results(extras)
    need = ("ops", "gemm", "elementwise", "collectives", "blocks", "sharing")
    missing = [k for k in need if not R.get(k)]
    if missing:
        raise CalibrationError(f"micro-benchmark results lack {', '.join(missing)}")
    cores = cores or host_cores()
    report: dict = {}

    # dispatch cost of one operator
    op_s = kernel_mean(next(r for r in R["ops"] if r["what"] == "op")["t"])
    report["op_s"] = op_s

    # GEMM: t - op = (f + half) / rate  ->  linear in f
    g = R["gemm"]
    ts = [kernel_mean(r["t"]) - op_s for r in g]
    fl = [r["flops"] for r in g]
    a, b = _linfit(fl, ts, _rel_weights(ts))
    rate = 1.0 / b if b > 0 else max(f / t for f, t in zip(fl, ts))
    half = max(0.0, a * rate)
    report["gemm"] = {"rate": rate, "half_flops": half,
                      "rel_err": [((f + half) / rate - t) / t for f, t in zip(fl, ts)]}

    # element-wise: t - op = bytes / bw
    e = R["elementwise"]
    ts_e = [kernel_mean(r["t"]) for r in e]
    by = [r["bytes"] for r in e]
    a_e, b_e = _linfit(by, ts_e, _rel_weights(ts_e))  # t = fixed + bytes / bw
    mem_bw = 1.0 / b_e if b_e > 0 else statistics.median(x / t for x, t in zip(by, ts_e))
    report["memory_bw"] = mem_bw

    # attention: t - op*ops - bytes/bw = (f + half) / (rate * eff)
    att = R.get("attention") or []
    if att:
        ta = [max(1e-9, kernel_mean(r["t"]) - op_s * (3 if r["phase"] == "fwd" else 6) - r["bytes"] / mem_bw)
              for r in att]
        fa = [r["flops"] for r in att]
        a2, b2 = _linfit(fa, ta, _rel_weights(ta))
        arate = 1.0 / b2 if b2 > 0 else max(f / t for f, t in zip(fa, ta))
        att_eff = min(1.0, max(1e-3, arate / rate))
        att_half = max(0.0, a2 * arate)
    else:
        att_eff, att_half = base.costs.attention_eff, base.costs.attention_half_flops
    report["attention"] = {"eff": att_eff, "half_flops": att_half}

    # host copies
    cp = R.get("copies") or []
    if len(cp) >= 2:
        tc = [kernel_mean(r["t"]) for r in cp]
        _, b_c = _linfit([r["bytes"] for r in cp], tc, _rel_weights(tc))
        copy_bw = 1.0 / b_c if b_c > 0 else base.node.host_link_bw
    else:
        copy_bw = base.node.host_link_bw
    report["copy_bw"] = copy_bw

    # the executor's instructions, one rank alone, at several micro-batch sizes
    def flop_seconds(op: str, flops: float) -> float:
        eff, h = (att_eff, att_half) if op == "attention" else (1.0, half)
        return flops / (rate * eff * flops / (flops + h)) if flops > 0 else 0.0

    plain = [b for b in R["blocks"] if b.get("recompute", "none") == "none"]
    blocks = fit_blocks([dict(r, model=b.get("model", model)) for b in plain for r in b["records"]], model,
                        flop_seconds=flop_seconds,
                        mem_bw=mem_bw, op_floor=op_s)
    nograd = nograd_forward_ratio(R["blocks"])
    report["nograd_fwd_ratio"] = nograd
    if blocks is not None:
        op_s, instr_s, bwd_s, elementwise = blocks["op_s"], blocks["instr_s"], blocks["bwd_s"], blocks["elementwise"]
        report["blocks"] = blocks
    else:
        instr_s, bwd_s, elementwise = 10e-6, 0.0, {}
    report["op_s"], report["instr_s"], report["bwd_s"] = op_s, instr_s, bwd_s

    # cores shared: n ranks running the same one-rank step at once take longer than one alone by
    # what the host model's rate says (`simexec.sim.host.model`): their share of the cores, each core slower
    # while the others are busy too (compute_contention), and slower again while it alternates
    # between ranks (timeslice_contention: 3 and 4 ranks on 2 cores against 2)
    share = sharing_steps(R["sharing"])
    t1 = summed_mean(share[1]) if 1 in share else None
    background = float(measured_background) if measured_background is not None else 0.0
    contention, timeslicing = 1.0, 1.0
    if t1:
        slow = {n: summed_mean(share[n]) / t1 for n in sorted(share)}
        background, contention, timeslicing = fit_sharing(slow, cores, measured_background)
        report["sharing"] = {"slowdown": slow, "background": background, "contention": contention,
                             "timeslicing": timeslicing}

    # the scheduler's slice and the hop latency, from the ping-pong; then the collectives
    if measured_background is not None:
        background = float(measured_background)
    # The scheduler's slice is Linux's (`linux_slice`): between barriers the benchmarks barely wait
    # for a core, and a fit left free to move it finds them no better explained anywhere from 1.5 to
    # 20 ms (its bound), where it then stalls every woken rank of a plan. The trace fit moves it.
    loops = R.get("interleaved") or []
    fixed = {"slice": linux_slice(cores)}

    def gemm_s(flops: float) -> float:
        return op_s + flops / (rate * flops / (flops + half))

    from simexec.sim.profile import apply_profile

    # the calling thread's share of a collective's call, where the benchmarks timed it (else the base's)
    issue = [c for r in R.get("issue") or [] for c in r["cpu"]]
    issue_s = float(statistics.median(issue)) if issue else base.costs.collective_issue_s
    report["issue_s"] = issue_s
    # what a collective costs the cores, measured: CPU per step and the bytes a core copies per second
    comm_cpu = fit_comm_cpu(R.get("collectives") or [], R.get("p2p") or [], issue_s)
    comm_cpu_s = comm_cpu["comm_cpu"] if comm_cpu else 0.0
    if comm_cpu:
        report["comm_cpu"] = comm_cpu
        if comm_cpu["intra_bw"]:
            fixed["intra_bw"] = comm_cpu["intra_bw"]
    loops_idle = gloo_loops_idle(extras)
    report["gloo_loops_idle"] = loops_idle
    comm_base = apply_profile(base, {"costs": {"compute_contention": contention, "timeslice_contention": timeslicing,
                                               "comm_cpu_s": comm_cpu_s, "gloo_loops_idle": loops_idle,
                                               "collective_issue_s": issue_s}})
    comm = fit_comm(R.get("collectives") or [], R.get("p2p") or [], R.get("pingpong") or [], comm_base,
                    background=background, cores=cores, fixed=fixed, loops=loops, gemm_s=gemm_s)
    slice_s = comm["slice"]
    report["comm"] = comm

    peak = dict(base.device.peak_flops)
    old = peak.get("fp32") or max(peak.values())
    peak = {k: float(v * rate / old) for k, v in peak.items()}
    costs = {
        "cores_shared": True, "gemm_eff": 1.0, "gemm_half_flops": half, "attention_eff": att_eff,
        "attention_half_flops": att_half, "memory_eff": 1.0, "intra_bw_eff": 1.0, "host_link_eff": 1.0,
        "collective_latency_s": comm["coll_latency"], "overlap_slowdown": 1.0, "compute_contention": contention,
        "timeslice_contention": timeslicing,
        "instr_overhead_s": instr_s, "bwd_overhead_s": bwd_s, "sched_slice_s": slice_s,
        "idle_wake_s": comm["idle_wake"], "comm_cpu_s": comm_cpu_s, "collective_issue_s": issue_s,
        "background_load": background,
        "elementwise_cost": elementwise, "nograd_fwd_ratio": nograd,
        "cpu_scheduler": base.costs.cpu_scheduler, "gloo_loops_idle": loops_idle,
    }
    device = {"peak_flops": peak, "memory_bw": mem_bw, "launch_overhead_s": op_s}
    node = {"cpu_cores": cores, "intra_bw": comm["intra_bw"], "intra_latency_s": comm["hop_latency"],
            "host_link_bw": copy_bw}
    return {"costs": costs, "device": device, "node": node}, report


def calibrate_from_microbench(cluster: Union[str, ClusterSpec] = "local", ranks: int = 4,
                              out_path: Optional[PathLike] = None, *, name: Optional[str] = None,
                              model: str = "gpt-tiny", quick: bool = False, session=None,
                              progress: Optional[Callable[[str], None]] = None,
                              raw_path: Optional[PathLike] = None) -> dict:
    """Run the micro-benchmarks on `ranks` rank actors of this machine, fit, and write the profile.

    session: a `simexec.calibrate.runs.Session` to reuse (else one is started and stopped here).
    progress: told what runs now (a few minutes in all). raw_path: also save the raw timings (JSON)
    there. Returns the profile."""
    from simexec.calibrate.runs import Session

    tell = progress or (lambda msg: None)
    base = _microbench_cluster(cluster, ranks)
    t0 = time.perf_counter()
    own = session is None
    if own:
        tell("starting Ray")
    sess = session or Session()
    if own:
        sess.__enter__()
    try:
        tell(f"running the micro-benchmarks on {ranks} ranks")
        raw = measure_microbench(sess, ranks, model=model, quick=quick)
    finally:
        if own:
            sess.__exit__(None, None, None)
    tell("fitting")
    return microbench_profile([raw], base, out_path, name=name, model=model, quick=quick, raw_path=raw_path,
                              wall_s=time.perf_counter() - t0)


def _microbench_cluster(cluster: Union[str, ClusterSpec], ranks: int) -> ClusterSpec:
    base = cluster if isinstance(cluster, ClusterSpec) else get_cluster(cluster)
    if not base.sized_to_plan:
        raise CalibrationError(f"cluster {base.name}: micro-benchmarks run on this machine's CPU ranks; "
                               "use the `local` cluster (or a file based on it)")
    if not isinstance(ranks, int) or ranks < 2:
        raise CalibrationError(f"ranks must be an integer >= 2 (groups of 2 and of all ranks), got {ranks!r}")
    return base


def measure_microbench(session, ranks: int = 4, *, model: str = "gpt-tiny", quick: bool = False) -> dict:
    """One run of the micro-benchmarks on the session's `ranks` rank actors: the raw timings of every
    rank and the host's background load meanwhile (`{"extras", "background"}`)."""
    import functools

    from simexec.calibrate.microbench import BenchConfig, run_microbench

    cfg = BenchConfig.quick(model) if quick else BenchConfig(model=model)
    runner = functools.partial(run_microbench, config=cfg)
    m = session.execute(model, f"dp={ranks},gbs={ranks},dtype=fp32", steps=1, runner=runner, timeout_s=600.0)
    return {"extras": {str(k): v for k, v in m.result.extra.items()}, "background": m.background}


def microbench_profile(raws: Sequence[dict], cluster: Union[str, ClusterSpec] = "local",
                       out_path: Optional[PathLike] = None, *, name: Optional[str] = None, model: str = "gpt-tiny",
                       quick: bool = False, raw_path: Optional[PathLike] = None, wall_s: float = 0.0) -> dict:
    """The profile fitted to one or more runs of the micro-benchmarks (`measure_microbench`, pooled by
    `pool_microbench`); the pooled timings saved at raw_path, the profile at out_path."""
    raw = pool_microbench(raws)
    ranks = len(raw["extras"])
    base = _microbench_cluster(cluster, ranks)
    if raw_path:
        save_json_plain(raw, raw_path)
    sections, report = fit_microbench(raw["extras"], base, model=model, measured_background=raw["background"])
    prof = make_profile(name or f"{socket.gethostname()}-microbench", "microbench", sections["costs"],
                        sections["device"], sections["node"],
                        fit={"ranks": ranks, "quick": quick, "runs": len(raws), "wall_s": wall_s,
                             "background_sampled": raw["background"], "report": jsonable(report)})
    if out_path:
        save_profile(prof, out_path)
    return prof
