"""Calibrate the simulator's hardware model against this machine: micro-benchmarks or step traces.

Two ways to a hardware profile (`traces/profiles/<name>.json`, read by `simulate --profile` and
`simexec.sim.profile.apply_profile`):

1. `calibrate_from_microbench(cluster, ranks, out_path)`: run `simexec.exec.microbench` on the
   executor's own rank actors and fit each cost parameter to the benchmark that isolates it
   (`fit_microbench`): the per-operator dispatch cost, GEMM / attention / element-wise rates,
   host copies, the collectives' call and hop latencies and loopback bandwidth, the executor's
   per-instruction and per-backward overheads, and the cores the ranks share with each other and
   with the host's background load.
2. `calibrate_from_traces(trace_paths, cluster, out_path)`: fit the same parameters to measured
   step traces with `scipy.optimize.least_squares` (soft-L1 loss on log durations): every event's
   predicted duration comes from simulating the trace's program with the candidate parameters
   (`fit_traces`), so the fit sees exactly the cost functions and contention the simulator uses.

For the `local` cluster the model is `simexec.sim.host` (CPU ranks time-sharing the host's cores):
a profile sets `costs.cores_shared` and `node.cpu_cores` from this machine.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import re
import socket
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence, Union

from simexec.cluster import ClusterSpec, get_cluster
from simexec.errors import SimexecError
from simexec.plan import parse_plan

PathLike = Union[str, os.PathLike]


class CalibrationError(SimexecError):
    """Calibration cannot proceed: bad inputs (traces, cluster, ranks) or a fit that failed."""


# --- profiles --------------------------------------------------------------------------------------
def machine_info() -> dict:
    """Where a profile was measured: host, CPU model, cores, torch version."""
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:  # pragma: no cover - torch is a dependency
        torch_version = ""
    return {"hostname": socket.gethostname(), "cpu": cpu, "cores": cores, "torch": torch_version,
            "python": platform.python_version(), "platform": platform.platform()}


def host_cores() -> int:
    return machine_info()["cores"]


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def make_profile(name: str, method: str, costs: dict, device: Optional[dict] = None, node: Optional[dict] = None,
                 *, machine: Optional[dict] = None, fit: Optional[dict] = None, measured_at: Optional[str] = None) -> dict:
    out = {"name": name, "machine": machine or machine_info(), "measured_at": measured_at or now_iso(),
           "method": method, "costs": costs}
    if device:
        out["device"] = device
    if node:
        out["node"] = node
    if fit:
        out["fit"] = fit
    return out


def save_profile(profile: dict, path: PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(profile, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)
    return path


def load_profile(path: PathLike) -> dict:
    from simexec.sim.profile import load_profile as _load

    return _load(path)


def profiled_cluster(cluster: Union[str, ClusterSpec], profile: Optional[Union[PathLike, dict]]) -> ClusterSpec:
    from simexec.sim.profile import apply_profile

    c = cluster if isinstance(cluster, ClusterSpec) else get_cluster(cluster)
    return apply_profile(c, profile) if profile is not None else c


# --- parameters the fits move --------------------------------------------------------------------
@dataclass(frozen=True)
class Param:
    """One fitted number: where it lives in a profile, its bounds, and whether it is fitted in log space."""

    name: str
    section: str  # costs | device | node
    key: str  # field; `peak_flops` means the fp32 entry (and the others scaled alike)
    lo: float
    hi: float
    log: bool = True
    start: Optional[float] = None  # where a fit starts when the profile leaves the parameter off (0)
    # the least a fit starts from, given the cluster: below it the traces cannot see the parameter
    least: Optional[Callable[[ClusterSpec], float]] = None

    def get(self, c: ClusterSpec, dtype: str = "fp32") -> float:
        if self.key == "peak_flops":
            return c.device.peak_flops.get(dtype) or max(c.device.peak_flops.values())
        return float(getattr(getattr(c, self.section), self.key))


PARAMS: dict[str, Param] = {p.name: p for p in (
    Param("op", "device", "launch_overhead_s", 1e-7, 1e-3),
    Param("instr", "costs", "instr_overhead_s", 1e-7, 1e-2),
    Param("bwd", "costs", "bwd_overhead_s", 1e-7, 1e-2),
    Param("gemm_flops", "device", "peak_flops", 1e8, 1e16),
    Param("attention_eff", "costs", "attention_eff", 1e-3, 1.0),
    Param("memory_bw", "device", "memory_bw", 1e8, 1e13),
    Param("coll_latency", "costs", "collective_latency_s", 1e-7, 1e-1),
    Param("hop_latency", "node", "intra_latency_s", 1e-7, 1e-1),
    Param("intra_bw", "node", "intra_bw", 1e7, 1e12),
    Param("background", "costs", "background_load", 0.0, 64.0, log=False),
    # a thread that wakes beside busy cores waits a share of the slice: the micro-benchmarks, run
    # between barriers, barely see that wait and leave the slice at its floor, where the trace fit's
    # finite differences cannot see it either; the fit starts it at Linux's default instead
    Param("slice", "costs", "sched_slice_s", 1e-5, 2e-2, least=lambda c: linux_slice(c.node.cpu_cores)),
    Param("contention", "costs", "compute_contention", 1.0, 4.0),
    Param("timeslicing", "costs", "timeslice_contention", 1.0, 4.0),
    Param("idle_wake", "costs", "idle_wake_s", 1e-6, 2e-2, start=100e-6),
    # eager PyTorch dispatches an operator in ~5-20 µs of host time (this repo's CPU micro-benchmarks:
    # ~5-8 µs per operator in a warm loop on a 2-core VM)
    Param("dispatch", "costs", "host_dispatch_s", 1e-7, 1e-3, start=1e-5),
)}


def set_params(profile: dict, values: dict[str, float], base: ClusterSpec, dtype: str = "fp32") -> dict:
    """A copy of `profile` with these parameter values (peak FLOP/s of every dtype scaled alike)."""
    out = json.loads(json.dumps(profile))
    for name, v in values.items():
        p = PARAMS[name]
        sec = out.setdefault(p.section, {})
        if p.key == "peak_flops":
            cur = dict(sec.get("peak_flops") or base.device.peak_flops)
            old = cur.get(dtype) or max(cur.values())
            sec["peak_flops"] = {k: float(x * v / old) for k, x in cur.items()}
        else:
            sec[p.key] = float(v)
    return out


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


def summed_mean(ts: Sequence[float]) -> float:
    """What one benchmark sample adds to a step: the mean of its timings. A step sums hundreds of
    instructions, so their means add up, not their medians, and on shared cores the tails are
    heavy (a busy host's 4-byte ping-pong: median 0.14 ms, mean 1.1 ms; a 2-rank compute-then-
    all-reduce loop: median 0.78 ms, mean 1.6 ms). Read at the median, the micro-benchmarks left
    every in-step collective that much too cheap."""
    return statistics.fmean(ts) if ts else float("nan")


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


def _one_rank_tensors(model: str) -> int:
    """Parameter tensors of the model on one rank (what the one-rank step's Adam updates)."""
    from simexec.model import get_model
    from simexec.sim.host import unit_tensor_count

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
    from simexec.sim.host import forwards_without_grad

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
    `<family>/<phase>.<block>` (`simexec.sim.host.cost_family`), and share the per-operator costs.
    The optimizer step (Adam) is its operators, its kernel's pass per tensor at an operator's cost
    (`simexec.sim.host.adam_kernel_passes`) and its bytes at an element-wise cost of its own,
    `optim.optim`, one for every model."""
    import numpy as np
    from scipy.optimize import lsq_linear

    from simexec.program import Instr
    from simexec.model import get_model
    from simexec.sim.host import (ADAM_FLOPS_PER_PARAM, adam_kernel_passes, adam_ops, cost_family, dispatch_key,
                                  dispatch_table, ops_of)

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
        tensors, elements = _one_rank_tensors(model_of(rec)), rec["flops"] / ADAM_FLOPS_PER_PARAM
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
    (`simexec.sim.host`) slow n ranks stepping at once by `slow[n]` against one alone: a grid search
    on log ratios. The background is fitted too unless measured; the time-slicing slowdown only when
    some n exceeds the cores."""
    import numpy as np

    from simexec.sim.host import thread_rate

    ns = sorted(slow)

    def loss(bg: float, cc: float, ts: float) -> float:
        one = thread_rate(1, cores, bg, cc, ts)
        return sum((math.log(one / thread_rate(n, cores, bg, cc, ts)) - math.log(slow[n])) ** 2 for n in ns)

    bgs = [float(background)] if background is not None else list(np.linspace(0.0, cores - 0.1, 40))
    ccs = list(np.linspace(1.0, 3.0, 81))
    tss = list(np.linspace(1.0, 2.0, 41)) if max(ns) > cores else [1.0]
    best = min(((b, c, t) for b in bgs for c in ccs for t in tss), key=lambda x: loss(*x))
    return tuple(float(v) for v in best)


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
    # what the host model's rate says (`simexec.sim.host`): their share of the cores, each core slower
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

    # what a collective costs the cores, measured: CPU per step and the bytes a core copies per second
    comm_cpu = fit_comm_cpu(R.get("collectives") or [], R.get("p2p") or [])
    comm_cpu_s = comm_cpu["comm_cpu"] if comm_cpu else 0.0
    if comm_cpu:
        report["comm_cpu"] = comm_cpu
        if comm_cpu["intra_bw"]:
            fixed["intra_bw"] = comm_cpu["intra_bw"]
    comm_base = apply_profile(base, {"costs": {"compute_contention": contention, "timeslice_contention": timeslicing,
                                               "comm_cpu_s": comm_cpu_s}})
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
        "idle_wake_s": comm["idle_wake"], "comm_cpu_s": comm_cpu_s, "background_load": background,
        "elementwise_cost": elementwise, "nograd_fwd_ratio": nograd,
        "cpu_scheduler": base.costs.cpu_scheduler,
    }
    device = {"peak_flops": peak, "memory_bw": mem_bw, "launch_overhead_s": op_s}
    node = {"cpu_cores": cores, "intra_bw": comm["intra_bw"], "intra_latency_s": comm["hop_latency"],
            "host_link_bw": copy_bw}
    return {"costs": costs, "device": device, "node": node}, report


def _comm_cluster(base: ClusterSpec, coll: float, hop: float, bw: float, slice_s: float, background: float,
                  cores: int, idle_wake: float = 0.0) -> ClusterSpec:
    from simexec.sim.profile import apply_profile

    return apply_profile(base, {"costs": {"collective_latency_s": coll, "intra_bw_eff": 1.0, "cores_shared": True,
                                          "sched_slice_s": slice_s, "background_load": background,
                                          "idle_wake_s": idle_wake},
                                "node": {"intra_latency_s": hop, "intra_bw": bw, "cpu_cores": cores}})


def _bench_instr(verb: str, n: int, nbytes: float):
    """The instruction a micro-benchmark's collective (`p2p`: one message) over n ranks stands for."""
    from simexec.program import Instr

    kind = "send" if verb == "p2p" else "collective"
    return Instr(0, "bench", kind, "comm.x", f"{verb}@x", bytes=float(nbytes), group=tuple(range(n)), peer=1)


def host_comm_time(cluster: ClusterSpec, verb: str, n: int, nbytes: float, busy: int = 0) -> float:
    """Seconds of one collective (`p2p`: one message) over n ranks that all start it at once, on the
    host model of `simexec.sim.host` (`busy` other ranks computing meanwhile)."""
    import simpy

    from simexec.sim.host import Cores, HostCosts

    env = simpy.Environment()
    cores, hc = Cores.of(env, cluster), HostCosts.transfers_only(cluster)
    _occupy(env, cores, busy)
    ins = _bench_instr(verb, n, nbytes)
    out = []
    t0 = env.now
    if verb == "broadcast":
        env.process(_root_of_broadcast(env, cores, hc, ins, lambda: out.append(env.now)))
    else:
        hc.transfer(env, cores, ins, tuple(range(2 if verb == "p2p" else n)), lambda: out.append(env.now))
    env.run(until=t0 + 10.0 if busy else None)
    return out[0] - t0 if out else float("inf")


def _root_of_broadcast(env, cores, hc, ins, done):
    """A broadcast as its root times it (the micro-benchmark's clock runs there): gloo's binomial tree
    has the root send in each of its rounds and wait for nothing but the sends being written, so it
    returns after the call and its own bursts, while the other members still receive. No plan lowers
    a broadcast; this keeps the benchmark from pulling the call latency towards zero."""
    steps, chunk = hc.comm_steps(ins)
    call, burst, _wire = hc.comm_seconds(steps, chunk)
    if call > 0:
        yield env.timeout(call)
    for _ in range(steps):
        yield cores.run((0, "comm"), burst)
    done()


def _occupy(env, cores, busy: int) -> None:
    """`busy` threads computing for ever, already running (past any wake-up) when this returns."""
    for b in range(busy):
        cores.run(100 + b, 1e9)
    if busy:
        env.run(until=env.now + 0.1)


def host_pingpong_time(cluster: ClusterSpec, nbytes: float = 4.0, busy: int = 0, iters: int = 8) -> float:
    """Seconds of one round trip of two ranks sending a message back and forth in a tight loop (the
    micro-benchmark `pingpong`), `busy` other ranks computing meanwhile, on the host model: the
    cores idle only while a message is on the wire."""
    import simpy

    from simexec.program import Instr
    from simexec.sim.host import Cores, HostCosts

    env = simpy.Environment()
    cores, hc = Cores.of(env, cluster), HostCosts.transfers_only(cluster)
    _occupy(env, cores, busy)
    ins = Instr(0, "bench", "send", "comm.x", "p2p@x", bytes=float(nbytes), group=(0, 1), peer=1)
    marks: list[float] = []

    def loop():
        for _ in range(2 * iters):
            marks.append(env.now)
            done = env.event()
            hc.transfer(env, cores, ins, (0, 1), done.succeed)
            yield done
        marks.append(env.now)

    env.process(loop())
    env.run(until=env.now + 10.0 if busy else None)
    skip = 2
    return (marks[-1] - marks[skip]) / ((len(marks) - 1 - skip) / 2)


def host_loop_time(cluster: ClusterSpec, n: int, compute_s: float, nbytes: float, iters: int = 8) -> float:
    """Seconds per iteration of n ranks that each compute `compute_s` CPU-seconds and then all-reduce
    `nbytes` together, in a loop (the micro-benchmark `interleaved`), on the host model."""
    import simpy

    from simexec.program import Instr
    from simexec.sim.host import Cores, HostCosts

    env = simpy.Environment()
    cores, hc = Cores.of(env, cluster), HostCosts.transfers_only(cluster)
    ins = Instr(0, "bench", "collective", "comm.x", "allreduce@x", bytes=float(nbytes), group=tuple(range(n)))
    done = [env.event() for _ in range(iters)]
    arrived = [0] * iters
    marks: list[float] = []

    def rank(r: int):
        for it in range(iters):
            if r == 0:
                marks.append(env.now)
            if compute_s > 0:
                yield cores.run(r, compute_s)
            arrived[it] += 1
            if arrived[it] == n:
                hc.transfer(env, cores, ins, tuple(range(n)), done[it].succeed)
            yield done[it]
        if r == 0:
            marks.append(env.now)

    for r in range(n):
        env.process(rank(r))
    env.run()
    skip = min(2, iters - 1)
    return (marks[-1] - marks[skip]) / (iters - skip)


def linux_slice(cores: int) -> float:
    """Linux's default scheduler slice on `cores` CPUs: 0.75 ms x (1 + log2 cores), cores capped at 8
    (`sysctl_sched_base_slice`, scaled logarithmically)."""
    return 0.75e-3 * (1 + int(math.log2(max(1, min(8, cores)))))


def fit_comm_cpu(colls: list[dict], p2p: list[dict]) -> Optional[dict]:
    """What a collective or message costs a member's cores, from the CPU time the micro-benchmarks
    measured for each (every thread of the process; records without `cpu` are left out): per step
    (`HostCosts.comm_steps`), `comm_cpu` seconds for the hand-offs between gloo's threads and the
    kernel plus the step's bytes at `intra_bw` bytes per second of a core. Least squares on the log
    means, started from the linear fit on relative errors: a relative error counts a time predicted
    half as long as -0.5 and one predicted twice as long as +1, so that fit alone runs low (on 42 of
    the 55 records of the 2026-11-24 09:03 recording, a byte 1.7x too cheap). None without enough
    records."""
    import numpy as np
    from scipy.optimize import least_squares, lsq_linear

    from simexec.sim.host import HostCosts

    rows, ys, names = [], [], []
    recs = [(r["verb"], r["n"], r) for r in colls if r.get("mode", "solo") == "solo"] + [("p2p", 2, r) for r in p2p]
    for verb, n, rec in recs:
        if not rec.get("cpu"):
            continue
        steps, chunk = HostCosts.comm_steps(_bench_instr(verb, n, rec["bytes"]))
        cpu = summed_mean(rec["cpu"])
        if steps <= 0 or cpu <= 0:
            continue
        rows.append([steps, steps * chunk])
        ys.append(cpu)
        names.append(f"{verb}@{n}:{int(rec['bytes'])}")
    if len(rows) < 3:
        return None
    A, y = np.asarray(rows, float), np.asarray(ys, float)
    w = 1.0 / y
    start = lsq_linear(A * w[:, None], y * w, bounds=(0.0, np.inf)).x
    sol = np.exp(least_squares(lambda x: np.log(A @ np.exp(x)) - np.log(y),
                               np.log(np.maximum(start, [1e-7, 1e-12]))).x)
    per_step, per_byte = float(sol[0]), float(sol[1])
    pred = A @ sol
    return {"comm_cpu": max(1e-7, per_step), "intra_bw": 1.0 / per_byte if per_byte > 0 else None,
            "rel_err": {k: float(p / t - 1) for k, p, t in zip(names, pred, y)}}


COMM_PARAMS = ("coll_latency", "hop_latency", "intra_bw", "idle_wake", "slice")


def fit_comm(colls: list[dict], p2p: list[dict], pingpong: list[dict], base: ClusterSpec, *, background: float,
             cores: int, fixed: Optional[dict[str, float]] = None, loops: Sequence[dict] = (),
             gemm_s: Optional[Callable[[float], float]] = None) -> dict:
    """The scheduler slice, the hop latency, the collective call latency, the loopback bandwidth
    (bytes per second of a core) and the wake-up of an idle core, jointly: least squares (soft-L1)
    on log times of every collective and message measured alone (after a barrier: the cores idle),
    of the small ping-pong in a tight loop with and without other ranks computing (the cores idle
    only while a message is on the wire, or never), and of the compute-then-all-reduce loops
    (`loops`, their matmuls priced by `gemm_s(flops)`), each predicted by the host model
    (`host_comm_time`, `host_pingpong_time`, `host_loop_time`, `simexec.sim.host`) with `base`'s
    `comm_cpu_s`. `fixed` holds parameters measured otherwise (`COMM_PARAMS` names): the loops are
    what separates the slice from the hop latency, so without them the slice must be given."""
    import numpy as np
    from scipy.optimize import least_squares

    fixed = dict(fixed or {})
    # (what, ranks, bytes, other ranks computing (loops: CPU-seconds of compute per iteration), seconds)
    obs = [(r["verb"], r["n"], r["bytes"], 0, summed_mean(r["t"])) for r in colls
           if r.get("mode", "solo") == "solo"]
    obs += [("p2p", 2, r["bytes"], 0, summed_mean(r["t"])) for r in p2p]
    obs += [("pingpong", 2, 4.0, int(r.get("busy", 0)), summed_mean(r["t"])) for r in pingpong]  # round trips
    if gemm_s is not None:
        obs += [("loop", r["n"], r["bytes"], r["gemms"] * gemm_s(r["gemm_flops"]), summed_mean(r["t"]))
                for r in loops]
    obs = [o for o in obs if o[4] > 0]
    start = dict(zip(COMM_PARAMS, (base.costs.collective_latency_s or 100e-6, base.node.intra_latency_s or 50e-6,
                                   base.node.intra_bw * base.costs.intra_bw_eff,
                                   getattr(base.costs, "idle_wake_s", 0.0) or 100e-6,
                                   getattr(base.costs, "sched_slice_s", 0.0) or 1.5e-3)))
    bounds = dict(zip(COMM_PARAMS, ((1e-7, 1e-1), (1e-7, 1e-1), (1e6, 1e12), (1e-6, 2e-2), (1e-5, 2e-2))))
    free = [n for n in COMM_PARAMS if n not in fixed]
    if not obs or not free:
        return {**start, **fixed}

    def values(x) -> dict[str, float]:
        return {**fixed, **dict(zip(free, (float(v) for v in np.exp(x))))}

    def pred(x):
        v = values(x)
        c = _comm_cluster(base, v["coll_latency"], v["hop_latency"], v["intra_bw"], v["slice"], background, cores,
                          v["idle_wake"])
        return np.array([host_loop_time(c, n, busy, b) if verb == "loop" else host_pingpong_time(c, b, busy)
                         if verb == "pingpong" else host_comm_time(c, verb, n, b, busy)
                         for verb, n, b, busy, _ in obs])

    y = np.log([o[4] for o in obs])
    lo, hi = (np.log([bounds[n][i] for n in free]) for i in (0, 1))
    x0 = np.clip(np.log([start[n] for n in free]), lo + 1e-6, hi - 1e-6)
    res = least_squares(lambda x: np.log(pred(x)) - y, x0, loss="soft_l1", f_scale=0.2, diff_step=0.01,
                        bounds=(lo, hi))
    p = pred(res.x)
    return {**values(res.x),
            "rel_err": {f"{v}@{n}:{int(b)}{'/busy' + format(busy, '.3g') if busy else ''}": float(pv / t - 1)
                        for (v, n, b, busy, t), pv in zip(obs, p)}}


def calibrate_from_microbench(cluster: Union[str, ClusterSpec] = "local", ranks: int = 4,
                              out_path: Optional[PathLike] = None, *, name: Optional[str] = None,
                              model: str = "gpt-tiny", quick: bool = False, session=None,
                              progress: Optional[Callable[[str], None]] = None,
                              raw_path: Optional[PathLike] = None) -> dict:
    """Run the micro-benchmarks on `ranks` rank actors of this machine, fit, and write the profile.

    session: a `simexec.calibrate_runs.Session` to reuse (else one is started and stopped here).
    progress: told what runs now (a few minutes in all). raw_path: also save the raw timings (JSON)
    there. Returns the profile."""
    from simexec.calibrate_runs import Session

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

    from simexec.exec.microbench import BenchConfig, run_microbench

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
                             "background_sampled": raw["background"], "report": _jsonable(report)})
    if out_path:
        save_profile(prof, out_path)
    return prof


def save_json_plain(data: dict, path: PathLike) -> None:
    from simexec.trace import save_json

    save_json(data, path)


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


# --- trace fit -------------------------------------------------------------------------------------
TRACE_PARAMS = ("op", "instr", "bwd", "gemm_flops", "attention_eff", "coll_latency", "hop_latency", "intra_bw",
                "slice", "contention", "timeslicing", "idle_wake")
# An accelerator's traces: no core sharing to fit, and memory-bound kernels run at the device's own
# bandwidth (on CPU ranks the per-block element-wise costs of the micro-benchmarks stand for it). The
# GEMM rate stays where the datasheet or the kernel micro-benchmarks (scripts/gpu_profile.py) put it:
# a block's time mixes its GEMMs with its memory-bound kernels, and a step trace cannot tell them apart.
ACCELERATOR_TRACE_PARAMS = ("op", "dispatch", "instr", "bwd", "attention_eff", "memory_bw", "coll_latency",
                            "hop_latency", "intra_bw")


@dataclass
class _Case:
    """One measured trace, ready to be re-simulated."""

    path: str
    model: object  # ModelSpec
    plan: str
    seq_len: Optional[int]
    measured: dict[str, float]  # event id -> µs (compute, copies, host steps)
    comm: dict[str, float]  # event id -> µs (collectives, send/recv)
    step_s: float
    peak: dict[int, float]
    background: Optional[float]
    machine: Optional[dict] = None  # where it was measured (executor traces name it)


def steady_step(step_times: Sequence[float], fallback: Optional[float] = None) -> Optional[float]:
    """A run's steady-state step time: the median of its second half of steps. The executor's own
    `step_time_s` (the median after the first step) still carries warm-up: on CPU ranks the steps
    after the first get ~10-20% faster over the next few. The trace holds the step of the second half
    nearest this median (`simexec.exec.tracer.pick_step`)."""
    xs = [float(x) for x in step_times if x]
    if len(xs) >= 4:
        return statistics.median(xs[len(xs) // 2:])
    return fallback


def _case(trace, where: str) -> _Case:
    from simexec.model import ModelSpec, get_model
    from simexec.trace import ends_when_waited

    meta = trace.meta
    if meta.get("kind") != "measured":
        raise CalibrationError(f"{where}: not a measured trace (kind {meta.get('kind')!r}); calibrate from `simexec execute --trace` output")
    m = meta.get("model_spec") or meta.get("model")  # the spec: a model from a file has no preset name
    try:
        model = ModelSpec.model_validate(m) if isinstance(m, dict) else get_model(str(m))
    except Exception as exc:  # noqa: BLE001 - a model we cannot rebuild
        raise CalibrationError(f"{where}: cannot rebuild its model ({type(exc).__name__})") from None
    summary = meta.get("summary") or {}
    step = steady_step(summary.get("step_times_s") or [], summary.get("step_time_s"))
    if not step:
        raise CalibrationError(f"{where}: has no measured step time in its summary")
    # the executor's optimizer step waits for the gradient collectives inside its own time: left out
    comp = {e.id: e.dur_us for e in trace.events
            if e.kind in ("compute", "copy") and e.dur_us > 0 and not e.name.startswith(("optim.", "host."))}
    # a send's measured time runs from isend to the wait at the end of the step: not the transfer's;
    # nor is a gloo reduce-scatter's (its work reports completion only once waited)
    waited = ends_when_waited(meta)
    comm = {e.id: e.dur_us for e in trace.events
            if e.kind in ("collective", "recv") and e.dur_us > 0 and e.op.partition("@")[0] not in waited}
    peak = {int(r): float(b) for r, b in ((meta.get("summary") or {}).get("peak_memory_bytes_per_rank") or {}).items()}
    return _Case(where, model, str(meta.get("plan")), meta.get("seq_len"), comp, comm, float(step), peak,
                 meta.get("background_load"), meta.get("machine"))


def cases_machine(cases: Sequence[_Case]) -> Optional[dict]:
    """The machine the traces were measured on, when they all name the same one."""
    machines = {json.dumps(c.machine, sort_keys=True) for c in cases}
    return json.loads(machines.pop()) if len(machines) == 1 else None


def load_cases(trace_paths: Iterable[PathLike]) -> list[_Case]:
    from simexec.trace import Trace

    paths = [str(p) for p in trace_paths]
    if not paths:
        raise CalibrationError("no traces given")
    return [_case(Trace.load(p), p) for p in paths]


def predict_case(case: _Case, cluster: ClusterSpec, profile: Optional[dict] = None, *, trace: bool = True):
    """Simulate the case's plan (every rank) on the cluster with the profile (and the background load
    measured with the trace, when it was)."""
    from simexec.simulate import simulate

    prof = json.loads(json.dumps(profile)) if profile else {"costs": {}}
    if case.background is not None and getattr(cluster.costs, "cores_shared", False) or \
            (case.background is not None and (prof.get("costs") or {}).get("cores_shared")):
        prof.setdefault("costs", {})["background_load"] = float(case.background)
    return simulate(case.model, cluster, case.plan, case.seq_len, symmetric=False, profile=prof, trace=trace)


def _dominant_dtype(cases: list[_Case]) -> str:
    """The dtype most of the traces ran in: the one whose peak `gemm_flops` stands for (the others
    are scaled with it)."""
    dtypes = [parse_plan(c.plan).dtype for c in cases]
    return max(sorted(set(dtypes)), key=dtypes.count) if dtypes else "fp32"


def fit_traces(cases: list[_Case], base: ClusterSpec, base_profile: dict, *, params: Sequence[str] = TRACE_PARAMS,
               max_nfev: int = 60, event_weight: float = 0.5, comm_weight: float = 0.2, step_weight: float = 3.0,
               prior_weight: float = 0.2, diff_step: float = 0.1, restarts: int = 2,
               progress: Optional[Callable[[int, float], None]] = None) -> tuple[dict, dict]:
    """Least squares (soft-L1 on log durations) of the named parameters to measured traces.

    Residuals: per trace, for each kind of compute instruction (`_event_groups`: the same block and
    phase on every rank, layer and micro-batch) log(summed predicted / summed measured) (weight
    `event_weight` x the square root of its share of the trace's measured time, so each trace counts
    alike), the same for its collectives and messages (`comm_weight`), and its step time's
    (`step_weight`); plus a weak pull of each parameter towards its starting value (`prior_weight` per
    e-fold), which keeps parameters the traces cannot see where they were. Sums, not single events:
    a step adds its instructions up, and on shared cores their times have heavy tails, so a fit to
    each event's log ratio matches the typical event and leaves every sum short."""
    import numpy as np
    from scipy.optimize import least_squares

    start = profiled_cluster(base, base_profile)
    dtype = _dominant_dtype(cases)
    ps = [PARAMS[n] for n in params]
    x0 = np.array([_to_x(p, max(p.get(start, dtype) or p.start or 0.0, p.least(start) if p.least else 0.0))
                   for p in ps])
    lo = np.array([_to_x(p, p.lo) for p in ps])
    hi = np.array([_to_x(p, p.hi) for p in ps])
    x0 = np.clip(x0, lo + 1e-9, hi - 1e-9)
    calls = [0]
    best = [math.inf, None]
    groups = [(_event_groups(c.measured), _event_groups(c.comm)) for c in cases]

    def profile_at(x) -> dict:
        return set_params(base_profile, {p.name: _from_x(p, v) for p, v in zip(ps, x)}, base, dtype)

    def residuals(x):
        prof = profile_at(x)
        out = []
        for case, (comp, comm) in zip(cases, groups):
            try:
                res = predict_case(case, base, prof)
            except SimexecError:
                return np.full(_n_resid(groups, len(ps)), 10.0)
            pred = {e.id: e.dur_us for e in res.trace.events}
            out.extend(_group_residuals(comp, pred, event_weight))
            out.extend(_group_residuals(comm, pred, comm_weight))
            out.append(step_weight * math.log(max(res.step_time_s, 1e-9) / case.step_s))
        out.extend(prior_weight * (x - x0))
        r = np.asarray(out)
        calls[0] += 1
        cost = float(np.sum(np.minimum(r**2, 2 * np.abs(r))))
        if cost < best[0]:
            best[0], best[1] = cost, np.array(x)
        if progress is not None:
            progress(calls[0], cost)
        return r

    t0 = time.perf_counter()
    residuals(x0)

    def solve(x_start, nfev, step=diff_step):
        return least_squares(residuals, x_start, bounds=(lo, hi), loss="soft_l1", f_scale=0.1, diff_step=step,
                             x_scale="jac", max_nfev=nfev, xtol=1e-8, ftol=1e-8, gtol=1e-8)

    # The simulator is a discrete-event model: its cost has small steps where events swap order,
    # on which a gradient method can stall. Coarse differences and restarts from nearby points step
    # over them; a last pass with fine differences then resolves the minimum they found, which can
    # be narrower than the coarse step.
    sol = solve(x0, max_nfev)
    nfev = int(sol.nfev)
    rng = np.random.default_rng(0)
    for _ in range(restarts):
        trial = np.clip(best[1] + rng.normal(0.0, 0.15, size=len(ps)), lo + 1e-9, hi - 1e-9)
        sol = solve(trial, max(10, max_nfev // 2))
        nfev += int(sol.nfev)
    sol = solve(np.array(best[1]), max(10, max_nfev // 2), diff_step / 10)
    nfev += int(sol.nfev)
    x = best[1]
    values = {p.name: _from_x(p, v) for p, v in zip(ps, x)}
    prof = profile_at(x)
    report = {"params": values, "start": {p.name: _from_x(p, v) for p, v in zip(ps, x0)}, "cost": best[0] / 2,
              "nfev": nfev, "status": int(sol.status), "message": str(sol.message),
              "wall_s": time.perf_counter() - t0, "traces": [c.path for c in cases]}
    return prof, report


def _n_resid(groups, nparams: int) -> int:
    return sum(len(comp) + len(comm) + 1 for comp, comm in groups) + nparams


_INDEX = re.compile(r"^(?:L-?\d+|m\d+|v\d+|s\d+|c\d+)$")


def _event_kind(event_id: str) -> str:
    """An event's instruction without its rank, layer, micro-batch, virtual stage or chunk:
    `3:bwd.fc1.L2.m5` -> `bwd.fc1`."""
    name = event_id.split(":", 1)[-1]
    return ".".join(t for t in name.split(".") if not _INDEX.match(t)) or name


def _event_groups(events: dict[str, float]) -> list[tuple[list[str], float, float]]:
    """The events of one trace by kind: (ids, summed measured µs, share of the trace's measured time)."""
    by: dict[str, list[str]] = {}
    for i in events:
        by.setdefault(_event_kind(i), []).append(i)
    total = sum(events.values()) or 1.0
    out = []
    for kind in sorted(by):
        ids = by[kind]
        m = sum(events[i] for i in ids)
        out.append((ids, max(m, 1.0), m / total))
    return out


def _group_residuals(groups, pred: dict[str, float], weight: float) -> list[float]:
    """weight x sqrt(share) x log(summed predicted / summed measured) for each group of events."""
    return [weight * math.sqrt(share) * math.log(max(sum(pred.get(i, 0.0) for i in ids), 1.0) / m)
            for ids, m, share in groups]


def _to_x(p: Param, v: float) -> float:
    return math.log(max(v, 1e-300)) if p.log else float(v)


def _from_x(p: Param, x: float) -> float:
    return float(math.exp(x)) if p.log else float(x)


def calibrate_from_traces(trace_paths: Iterable[PathLike], cluster: Union[str, ClusterSpec] = "local",
                          out_path: Optional[PathLike] = None, base_profile: Optional[Union[PathLike, dict]] = None,
                          *, name: Optional[str] = None, params: Optional[Sequence[str]] = None, max_nfev: int = 60,
                          progress: Optional[Callable[[int, float], None]] = None) -> dict:
    """Fit the cluster's cost parameters to measured step traces; write and return the profile.

    base_profile: where the fit starts (a micro-benchmark profile, typically); without one it starts
    from the cluster's own numbers, with the host model of CPU ranks switched on for `local`."""
    base = cluster if isinstance(cluster, ClusterSpec) else get_cluster(cluster)
    cases = load_cases(trace_paths)
    if params is None:
        params = TRACE_PARAMS if base.sized_to_plan else ACCELERATOR_TRACE_PARAMS
        if not any(c.comm for c in cases):  # nothing in the traces sees the links
            params = tuple(p for p in params if p not in ("coll_latency", "hop_latency", "intra_bw"))
    if base_profile is None:
        start = {"costs": {"cores_shared": bool(base.sized_to_plan)}, "node": {}}
        if base.sized_to_plan:
            start["node"]["cpu_cores"] = host_cores()
            start["costs"].update({"sched_slice_s": 1.5e-3, "instr_overhead_s": 20e-6, "bwd_overhead_s": 50e-6})
    elif isinstance(base_profile, dict):
        start = base_profile
    else:
        start = load_profile(base_profile)
    # the traces' machine; else the starting profile's (a profile of the same machine, typically)
    machine = cases_machine(cases) or start.get("machine")
    start = {k: v for k, v in start.items() if k in ("costs", "device", "node", "network")}
    fitted, report = fit_traces(cases, base, start, params=params, max_nfev=max_nfev, progress=progress)
    prof = make_profile(name or f"{socket.gethostname()}-traces", "traces", fitted.get("costs", {}),
                        fitted.get("device"), fitted.get("node"), machine=machine, fit=_jsonable(report))
    if out_path:
        save_profile(prof, out_path)
    return prof
