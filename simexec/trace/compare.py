"""Compare a predicted trace with a measured one, instruction by instruction.

Both traces come from one program, so their events match one to one by instruction id
(`Event.id`, `<rank>:<name>`). `compare()` refuses traces that do not belong together (different
program fingerprint, plan or model, or no id in common) and reports

- **step time**: signed relative error `(predicted - measured) / measured` of the summary's
  `step_time_s` (or, when a trace has none, the span of its events);
- **op classes, streams and blocks** (`<phase>.<block>`, in the JSON only): for matched events
  with a measured duration > 0 (memory markers take no time and are left out, and so are
  collectives whose measured end is when the executor waited for them,
  `simexec.trace.schema.ends_when_waited`: gloo's reduce-scatters), the absolute percentage error
  `APE = |predicted - measured| / measured` (a measured duration twice the predicted one is
  50%, half of it 100%), its median and 90th percentile, the count, and the median ratio
  predicted / measured (below 1: the simulator is optimistic);
- **critical paths**: each trace's path from the last-ending event backwards (see
  `simexec.trace.critical_path`), the op classes and ids on one path and not the other, the share of the
  step each op class takes on each path;
- **peak memory** per rank: signed relative error of the summary's `peak_memory_bytes_per_rank`
  (or of the counters' peak), and the worst rank;
- **waits for late members** per communication stream (`simexec.trace.late_waits`): how long a
  collective's members wait for the last to call it, per collective and per rank a step, in each
  trace (a simulation whose ranks run in step has none; ranks that drift apart do), and a rank's
  compute plus those waits a step in each: on shared cores what one rank waits the others compute,
  so a simulation that shares the cores evenly computes longer per event and waits for no one,
  and the sums are what should agree;
- **CPU a step** (ranks on shared cores, both traces carrying it): each rank's CPU time in a step,
  every thread of it and its main thread alone, predicted (the host model's cores,
  `simexec.sim.host.cores`) and measured (the process's and the thread's, steady steps), the means over
  ranks and the error, and the cores' worth the ranks kept busy (all their CPU over the step):
  where the simulation fills the cores and the host leaves them idle, the step is waiting on
  something the model does not have;
- **unmatched** ids on either side.

A symmetric predicted trace (meta `symmetric` true: one representative rank per pipeline stage,
`represents` mapping each to the ranks it stands for) is compared with a full measured trace by
mapping every measured rank onto its representative; ids are then compared as
`<representative>:<name>`.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Iterable, Optional

from simexec.errors import TraceError
from simexec.trace.critical_path import critical_path
from simexec.trace.late_waits import collective_groups, late_waits
from simexec.trace.schema import Event, Trace, ends_when_waited


# --- small statistics -------------------------------------------------------------------------------
def _quantile(values: list[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default) of a non-empty list."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def error_stats(pairs: list[tuple[float, float]]) -> dict:
    """{median_ape, p90_ape, count, median_ratio, predicted_us, measured_us} of (predicted, measured) µs pairs."""
    apes = [abs(p - m) / m for p, m in pairs]
    ratios = [p / m for p, m in pairs]
    return {"median_ape": _quantile(apes, 0.5), "p90_ape": _quantile(apes, 0.9), "count": len(pairs),
            "median_ratio": _quantile(ratios, 0.5),
            "predicted_us": sum(p for p, _ in pairs), "measured_us": sum(m for _, m in pairs)}


def _bytes(x: float) -> str:
    for div, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "KB")):
        if abs(x) >= div:
            return f"{x / div:.3f} {unit}"
    return f"{x:.0f} bytes"


def _jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a | b else 1.0


def _rel(pred: float, meas: float) -> Optional[float]:
    return (pred - meas) / meas if meas else None


# --- identity of a trace ----------------------------------------------------------------------------
def _ident(value) -> str:
    """A model/plan/cluster entry of the metadata as a comparable string (a dict by its name)."""
    if isinstance(value, dict):
        return str(value.get("name") or value.get("plan") or sorted(value.items()))
    return "" if value is None else str(value)


def fingerprint(trace: Trace) -> str:
    """The program fingerprint of a trace (meta `program`, or `program_fingerprint`), '' if none."""
    return str(trace.meta.get("program") or trace.meta.get("program_fingerprint") or "")


def _label(trace: Trace, default: str) -> str:
    m = trace.meta
    bits = [m.get("kind") or default]
    for key in ("model", "plan"):
        if m.get(key):
            bits.append(_ident(m[key]))
    if fingerprint(trace):
        bits.append(f"program {fingerprint(trace)}")
    return " ".join(bits)


def rank_map(predicted: Trace, measured: Trace) -> dict[int, int]:
    """Measured rank -> predicted rank (the identity unless the predicted trace is symmetric)."""
    reps = predicted.meta.get("represents") or {}
    if not predicted.meta.get("symmetric") or measured.meta.get("symmetric") or not reps:
        return {}
    out = {}
    for rep, members in reps.items():
        for r in members:
            out[int(r)] = int(rep)
    return out


def _mapped_id(e: Event, rmap: dict[int, int]) -> str:
    if not rmap or e.rank not in rmap or rmap[e.rank] == e.rank:
        return e.id
    return f"{rmap[e.rank]}:{e.id.split(':', 1)[1]}" if ":" in e.id else e.id


def check_pair(predicted: Trace, measured: Trace) -> dict[int, int]:
    """Raise TraceError unless the two traces belong to one program; return `rank_map`. Where both
    name the instructions that run (`program_executed`, traces since 2026-11-27), those decide, so a
    change of the simulator's memory estimates leaves recorded traces comparable; else the whole
    program's fingerprint."""
    a, b = _label(predicted, "predicted"), _label(measured, "measured")
    rmap = rank_map(predicted, measured)
    fp, fm = fingerprint(predicted), fingerprint(measured)
    ep, em = predicted.meta.get("program_executed"), measured.meta.get("program_executed")
    if ep and em:
        fp, fm = ep, em
    if fp and fm and fp != fm and not rmap:
        raise TraceError(f"traces are of different programs: {a} vs {b}")
    for key in ("model", "plan"):
        vp, vm = predicted.meta.get(key), measured.meta.get(key)
        if vp and vm and _ident(vp) != _ident(vm):
            raise TraceError(f"traces are of different {key}s: {a} vs {b}")
    ids_p = {e.id for e in predicted.events if e.id}
    if not any(e.id and _mapped_id(e, rmap) in ids_p for e in measured.events):
        raise TraceError(f"traces share no instruction id: {a} vs {b}")
    return rmap


# --- step time and memory ---------------------------------------------------------------------------
def step_time_s(trace: Trace) -> tuple[float, str]:
    """(seconds, source): the summary's `step_time_s`, else the span of the events."""
    s = trace.summary.get("step_time_s")
    if isinstance(s, (int, float)) and s > 0:
        return float(s), "summary"
    timed = [e for e in trace.events if e.dur_us > 0] or trace.events
    if not timed:
        return 0.0, "none"
    return (max(e.end_us for e in timed) - min(e.start_us for e in timed)) / 1e6, "events"


def peak_memory(trace: Trace, tensors: bool = False) -> tuple[dict[int, float], str]:
    """(rank -> peak bytes, source): the summary's `peak_memory_bytes_per_rank`, else the counters.
    tensors: a prediction's peak of the tensors alone where it has one (`peak_tensor_bytes_per_rank`:
    without the allocator's waste and the runtime's memory outside it), what a run measures."""
    s = trace.summary.get("peak_tensor_bytes_per_rank") if tensors else None
    if isinstance(s, dict) and s:
        return {int(k): float(v) for k, v in s.items() if v is not None}, "summary (tensors)"
    s = trace.summary.get("peak_memory_bytes_per_rank")
    if isinstance(s, dict) and s:
        return {int(k): float(v) for k, v in s.items() if v is not None}, "summary"
    if isinstance(s, (list, tuple)) and s:
        return {i: float(v) for i, v in enumerate(s) if v is not None}, "summary"
    peaks = trace.peak_memory_per_rank()
    return peaks, "counters" if peaks else "none"


# --- the comparison ---------------------------------------------------------------------------------
@dataclass
class Comparison:
    """What `compare` found; `to_json()` for machines, `format()` for people."""

    predicted_label: str
    measured_label: str
    step_time: dict  # predicted_s, measured_s, error, sources
    op_class_errors: dict[str, dict]
    stream_errors: dict[str, dict]
    kind_errors: dict[str, dict]
    block_errors: dict[str, dict]  # per `<phase>.<block>` (the instruction name without layer and micro-batch)
    overall: dict
    critical_path: dict
    memory: dict  # per_rank {rank: {predicted, measured, error}}, worst_rank, error
    unmatched: dict
    worst_events: list[dict] = field(default_factory=list)
    late_waits: dict = field(default_factory=dict)  # stream -> {predicted, measured}: LateWaits.to_json()
    compute_and_waits: dict = field(default_factory=dict)  # predicted/measured {compute_s, waits_s, total_s}, error
    cpu: dict = field(default_factory=dict)  # predicted/measured {per_rank_s, cores_busy, main_thread_s}, error

    @property
    def step_time_error(self) -> Optional[float]:
        return self.step_time["error"]

    @property
    def peak_memory_error(self) -> Optional[float]:
        return self.memory["error"]

    def to_json(self) -> dict:
        return {
            "predicted": self.predicted_label, "measured": self.measured_label,
            "step_time_error": self.step_time["error"], "step_time": self.step_time,
            "peak_memory_error": self.memory["error"], "peak_memory": self.memory,
            "op_class_errors": self.op_class_errors, "stream_errors": self.stream_errors,
            "kind_errors": self.kind_errors, "block_errors": self.block_errors, "overall": self.overall,
            "critical_path": self.critical_path, "unmatched": self.unmatched,
            "worst_events": self.worst_events, "late_waits": self.late_waits,
            "compute_and_waits": self.compute_and_waits, "cpu": self.cpu,
        }

    def format(self, top: int = 12) -> str:
        st = self.step_time
        lines = [f"predicted: {self.predicted_label}", f"measured:  {self.measured_label}", ""]
        if st["error"] is None:
            lines.append("step time: no measured step time")
        else:
            lines.append(f"step time: predicted {st['predicted_s'] * 1e3:.3f} ms, "
                         f"measured {st['measured_s'] * 1e3:.3f} ms, "
                         f"error {st['error']:+.1%}")
        mem = self.memory
        if mem["error"] is None:
            lines.append("peak memory: not in both traces")
        else:
            w = mem["per_rank"][str(mem["worst_rank"])]
            what = " (tensors alone)" if mem.get("predicted_source") == "summary (tensors)" else ""
            lines.append(f"peak memory: worst rank {mem['worst_rank']}: predicted {_bytes(w['predicted'])}{what}, "
                         f"measured {_bytes(w['measured'])}, error {mem['error']:+.1%} "
                         f"({len(mem['per_rank'])} ranks)")
        o = self.overall
        if o:
            lines.append(f"durations: {o['count']} matched events, median APE {o['median_ape']:.1%}, "
                         f"p90 {o['p90_ape']:.1%}, median predicted/measured {o['median_ratio']:.2f}")
        waited = self.unmatched.get("ends_when_waited") or {}
        if waited.get("count"):
            lines.append(f"left out: {waited['count']} {', '.join(waited['ops'])} events, whose measured end "
                         f"is when the executor waited for them (gloo)")
        for title, table in (("op class", self.op_class_errors), ("stream", self.stream_errors)):
            if not table:
                continue
            lines += ["", f"{title:<24}{'count':>7}{'median APE':>12}{'p90 APE':>10}{'pred/meas':>11}"
                          f"{'pred ms':>10}{'meas ms':>10}"]
            for name, s in sorted(table.items(), key=lambda kv: -kv[1]["measured_us"])[:top]:
                lines.append(f"{name:<24}{s['count']:>7}{s['median_ape']:>12.1%}{s['p90_ape']:>10.1%}"
                             f"{s['median_ratio']:>11.2f}{s['predicted_us'] / 1e3:>10.3f}"
                             f"{s['measured_us'] / 1e3:>10.3f}")
            if len(table) > top:
                lines.append(f"... {len(table) - top} more")
        cp = self.critical_path
        if cp.get("predicted", {}).get("events"):
            lines += ["", f"critical path: {cp['predicted']['events']} events predicted, "
                          f"{cp['measured']['events']} measured; "
                          f"{cp['common_ids']} ids on both (Jaccard {cp['jaccard']:.2f}; "
                          f"by name, ranks aside, {cp['name_jaccard']:.2f})"]
            lines.append(f"{'share of step':<24}{'predicted':>10}{'measured':>10}")
            ops = sorted(set(cp["predicted"]["share"]) | set(cp["measured"]["share"]),
                         key=lambda k: -max(cp["predicted"]["share"].get(k, 0), cp["measured"]["share"].get(k, 0)))
            for op in ops[:top]:
                sp, sm = cp["predicted"]["share"].get(op, 0), cp["measured"]["share"].get(op, 0)
                lines.append(f"{op:<24}{sp:>10.1%}{sm:>10.1%}")
            if cp["only_predicted_ops"]:
                lines.append("op classes only on the predicted path: " + ", ".join(cp["only_predicted_ops"]))
            if cp["only_measured_ops"]:
                lines.append("op classes only on the measured path: " + ", ".join(cp["only_measured_ops"]))
            for side in ("predicted", "measured"):
                names = cp[f"only_{side}_names"]
                if names:
                    more = f" ... (+{len(names) - 6})" if len(names) > 6 else ""
                    lines.append(f"only on the {side} path (any rank): {', '.join(names[:6])}{more}")
        if any(w["measured"]["collectives"] or w["predicted"]["collectives"] for w in self.late_waits.values()):
            lines += ["", f"{'waits for late members':<24}{'pred ms/step':>13}{'meas ms/step':>13}"
                          f"{'pred ms each':>13}{'meas ms each':>13}"]
            for stream, w in self.late_waits.items():
                p, m = w["predicted"], w["measured"]
                lines.append(f"{stream:<24}{p['per_rank_step_s'] * 1e3:>13.3f}{m['per_rank_step_s'] * 1e3:>13.3f}"
                             f"{p['per_collective_s'] * 1e3:>13.3f}{m['per_collective_s'] * 1e3:>13.3f}")
            cw = self.compute_and_waits
            if cw:
                p, m = cw["predicted"], cw["measured"]
                lines.append(f"compute + waits a rank: predicted {p['compute_s'] * 1e3:.1f} + {p['waits_s'] * 1e3:.1f} ms, "
                             f"measured {m['compute_s'] * 1e3:.1f} + {m['waits_s'] * 1e3:.1f} ms"
                             + (f", error {cw['error']:+.1%}" if cw["error"] is not None else ""))
        if self.cpu:
            p, m = self.cpu["predicted"], self.cpu["measured"]
            lines += ["", f"CPU a rank a step: predicted {p['per_rank_s'] * 1e3:.1f} ms, measured "
                          f"{m['per_rank_s'] * 1e3:.1f} ms, error {self.cpu['error']:+.1%}; cores busy: "
                          f"predicted {p['cores_busy']:.2f}, measured {m['cores_busy']:.2f}"]
            if "main_thread_s" in p and "main_thread_s" in m:
                lines.append(f"  of it the rank's own thread: predicted {p['main_thread_s'] * 1e3:.1f} ms, measured "
                             f"{m['main_thread_s'] * 1e3:.1f} ms; other threads: predicted "
                             f"{(p['per_rank_s'] - p['main_thread_s']) * 1e3:.1f} ms, measured "
                             f"{(m['per_rank_s'] - m['main_thread_s']) * 1e3:.1f} ms")
        if self.worst_events:
            lines += ["", "largest differences (predicted - measured):"]
            for w in self.worst_events[:5]:
                lines.append(f"  {w['id']:<40} {w['op']:<18} pred {w['predicted_us']:>10.1f} us  meas "
                             f"{w['measured_us']:>10.1f} us")
        u = self.unmatched
        if u["predicted_only_count"] or u["measured_only_count"]:
            lines += ["", f"unmatched: {u['predicted_only_count']} ids only predicted, "
                          f"{u['measured_only_count']} only measured"]
            for side in ("predicted_only", "measured_only"):
                if u[side]:
                    lines.append(f"  {side.replace('_', ' ')}: {', '.join(u[side][:5])}"
                                 + (" ..." if u[f"{side}_count"] > 5 else ""))
        return "\n".join(lines)


def matched_pairs(predicted: Trace, measured: Trace, rmap: Optional[dict[int, int]] = None
                  ) -> list[tuple[Event, Event]]:
    """(predicted, measured) events of one instruction, in measured order; ids mapped by `rank_map`."""
    rmap = rank_map(predicted, measured) if rmap is None else rmap
    pred = predicted.by_id()
    out = []
    for m in measured.events:
        p = pred.get(_mapped_id(m, rmap))
        if p is not None:
            out.append((p, m))
    return out


def _waited(m: Event, ops: tuple[str, ...]) -> bool:
    return m.kind == "collective" and m.op.partition("@")[0] in ops


def timed_pairs(pairs: list[tuple[Event, Event]], measured: Trace) -> list[tuple[Event, Event]]:
    """The matched pairs whose durations compare: measured for some time, not memory markers, and
    not collectives whose measured end is when the executor waited for them (`ends_when_waited`)."""
    ops = ends_when_waited(measured.meta)
    return [(p, m) for p, m in pairs if m.kind != "memory" and m.dur_us > 0 and not _waited(m, ops)]


def _group(pairs: Iterable[tuple[Event, Event]], key) -> dict[str, dict]:
    groups: dict[str, list[tuple[float, float]]] = {}
    for p, m in pairs:
        groups.setdefault(key(p, m), []).append((p.dur_us, m.dur_us))
    return {k: error_stats(v) for k, v in sorted(groups.items())}


def compare(predicted: Trace, measured: Trace, *, max_ids: int = 200) -> Comparison:
    """Match events by instruction id and report the errors (module docstring). `max_ids` caps
    the id lists in the result (counts are always complete)."""
    rmap = check_pair(predicted, measured)
    pairs = matched_pairs(predicted, measured, rmap)
    timed = timed_pairs(pairs, measured)
    waited_ops = ends_when_waited(measured.meta)
    waited = [m for _, m in pairs if _waited(m, waited_ops)]

    sp, src_p = step_time_s(predicted)
    sm, src_m = step_time_s(measured)
    step = {"predicted_s": sp, "measured_s": sm, "error": _rel(sp, sm),
            "predicted_source": src_p, "measured_source": src_m}

    op_errors = _group(timed, lambda p, m: m.op or m.kind)
    stream_errors = _group(timed, lambda p, m: m.stream)
    kind_errors = _group(timed, lambda p, m: m.kind)
    block_errors = _group(timed, lambda p, m: m.name.split(".L", 1)[0])
    overall = error_stats([(p.dur_us, m.dur_us) for p, m in timed]) if timed else {}
    worst = sorted((pm for pm in timed if pm[0].dur_us != pm[1].dur_us),
                   key=lambda pm: -abs(pm[0].dur_us - pm[1].dur_us))[:20]
    worst_events = [{"id": m.id, "op": m.op, "stream": m.stream, "predicted_us": p.dur_us, "measured_us": m.dur_us}
                    for p, m in worst]

    # critical paths
    cp_p, cp_m = critical_path(predicted), critical_path(measured)
    ids_p = cp_p.ids
    ids_m = [_mapped_id(e, rmap) for e in cp_m.events]
    set_p, set_m = set(ids_p), set(ids_m)
    ops_p = {e.op or e.kind for e in cp_p.events}
    ops_m = {e.op or e.kind for e in cp_m.events}
    names_p, names_m = {e.name for e in cp_p.events}, {e.name for e in cp_m.events}
    critical = {
        "predicted": {"events": len(ids_p), "span_us": cp_p.span_us, "share": cp_p.share, "time_us": cp_p.time_us},
        "measured": {"events": len(ids_m), "span_us": cp_m.span_us, "share": cp_m.share, "time_us": cp_m.time_us},
        "common_ids": len(set_p & set_m),
        "jaccard": _jaccard(set_p, set_m),
        "name_jaccard": _jaccard(names_p, names_m),
        "only_predicted_ops": sorted(ops_p - ops_m),
        "only_measured_ops": sorted(ops_m - ops_p),
        "share_diff": {op: cp_m.share.get(op, 0.0) - cp_p.share.get(op, 0.0)
                       for op in sorted(set(cp_p.share) | set(cp_m.share))},
        "only_predicted": [i for i in ids_p if i not in set_m][:max_ids],
        "only_measured": [i for i in ids_m if i not in set_p][:max_ids],
        "only_predicted_count": len(set_p - set_m),
        "only_measured_count": len(set_m - set_p),
        "only_predicted_names": [n for n in dict.fromkeys(e.name for e in cp_p.events) if n not in names_m][:max_ids],
        "only_measured_names": [n for n in dict.fromkeys(e.name for e in cp_m.events) if n not in names_p][:max_ids],
    }

    # peak memory
    mp, src_mp = peak_memory(predicted, tensors=True)  # the measured peak counts tensors only
    mm, src_mm = peak_memory(measured)
    per_rank = {}
    for r in sorted(mm):
        rp = rmap.get(r, r)
        if rp in mp and mm[r] > 0:
            per_rank[str(r)] = {"predicted": mp[rp], "measured": mm[r], "error": _rel(mp[rp], mm[r])}
    worst_rank = max(per_rank, key=lambda r: abs(per_rank[r]["error"]), default=None)
    memory = {"per_rank": per_rank, "worst_rank": int(worst_rank) if worst_rank is not None else None,
              "error": per_rank[worst_rank]["error"] if worst_rank is not None else None,
              "predicted_source": src_mp, "measured_source": src_mm}

    # unmatched ids
    all_p = {e.id for e in predicted.events if e.id}
    all_m = {_mapped_id(e, rmap) for e in measured.events if e.id}
    only_p, only_m = sorted(all_p - all_m), sorted(all_m - all_p)
    unmatched = {"predicted_only": only_p[:max_ids], "measured_only": only_m[:max_ids],
                 "predicted_only_count": len(only_p), "measured_only_count": len(only_m),
                 "matched": len(all_p & all_m),
                 "ends_when_waited": {"count": len(waited), "ops": sorted({m.op for m in waited})}}

    waits = _late_waits(predicted, measured)
    return Comparison(_label(predicted, "predicted"), _label(measured, "measured"), step, op_errors,
                      stream_errors, kind_errors, block_errors, overall, critical, memory, unmatched, worst_events,
                      waits, _compute_and_waits(predicted, measured, waits), _cpu(predicted, measured))


def _late_waits(predicted: Trace, measured: Trace) -> dict:
    """Both traces' waits for late members by stream, their collectives told apart by the measured
    run's program (which the predicted trace shares: `check_pair`); nothing when it cannot be rebuilt."""
    groups = collective_groups(measured)
    if groups is None:
        return {}
    pw, mw = late_waits(predicted, groups), late_waits(measured, groups)
    none = {"collectives": 0, "per_collective_s": 0.0, "per_rank_step_s": 0.0}
    return {stream: {"predicted": pw[stream].to_json() if stream in pw else none,
                     "measured": mw[stream].to_json() if stream in mw else none}
            for stream in sorted(set(pw) | set(mw))}


def _compute_and_waits(predicted: Trace, measured: Trace, waits: dict) -> dict:
    """A rank's compute in the step plus its waits for late members, predicted and measured. Ranks
    that share cores drift apart; the OS scheduler is work-conserving, so what one rank spends
    waiting the others spend computing, and a simulation that shares the cores evenly has its ranks
    compute that time instead: per event the two part, per rank and step they should agree."""
    if "all" not in waits:
        return {}

    def side(trace: Trace, key: str) -> dict:
        ranks = {e.rank for e in trace.events} or {0}
        compute = sum(e.dur_us for e in trace.events if e.kind in ("compute", "copy")) * 1e-6 / len(ranks)
        wait = waits["all"][key]["per_rank_step_s"]
        return {"compute_s": compute, "waits_s": wait, "total_s": compute + wait}

    p, m = side(predicted, "predicted"), side(measured, "measured")
    return {"predicted": p, "measured": m, "error": p["total_s"] / m["total_s"] - 1 if m["total_s"] > 0 else None}


def _cpu(predicted: Trace, measured: Trace) -> dict:
    """Each side's `cpu_of`, and the error of the mean CPU a rank a step; nothing unless both traces
    carry it (a simulation of ranks on shared cores, a run that timed it)."""
    p, m = cpu_of(predicted), cpu_of(measured)
    if p is None or m is None:
        return {}
    if ("main_thread_s" in p) != ("main_thread_s" in m):  # the split only where both sides have it
        for side in (p, m):
            side.pop("main_thread_s", None)
    return {"predicted": p, "measured": m, "error": p["per_rank_s"] / m["per_rank_s"] - 1}


def cpu_of(trace: Trace) -> Optional[dict]:
    """A trace's mean CPU time a rank a step (`per_rank_s`; `main_thread_s`, the rank's own thread's
    share, where the trace has it) and the cores' worth its ranks kept busy over the step
    (`cores_busy`); None where it carries no CPU times. A prediction holds one step per rank
    (`cpu_s_per_rank`, a symmetric rank weighted by the ranks it stands for); a run holds every
    step (`cpu_times_s_per_rank`), read at its steady state as its step time is."""
    from simexec.trace.schema import steady_step

    s = trace.meta.get("summary") or {}
    if s.get("cpu_s_per_rank"):
        reps = trace.meta.get("represents") or {}
        weights = {r: len(reps.get(r) or [r]) for r in s["cpu_s_per_rank"]}  # a symmetric rank stands for its copies

        def mean(per_rank: dict) -> float:
            return sum(per_rank.get(r, 0.0) * w for r, w in weights.items()) / sum(weights.values())

        cpu, main, ranks = s["cpu_s_per_rank"], s.get("main_cpu_s_per_rank"), sum(weights.values())
        step = s.get("step_time_s")
    elif s.get("cpu_times_s_per_rank"):
        def mean(per_rank: dict) -> float:
            return statistics.fmean(steady_step(v, statistics.median(v)) for v in per_rank.values() if v)

        cpu, main, ranks = s["cpu_times_s_per_rank"], s.get("main_cpu_times_s_per_rank"), len(s["cpu_times_s_per_rank"])
        step = steady_step(s.get("step_times_s") or [], s.get("step_time_s"))
    else:
        return None
    if not step:
        return None
    out = {"per_rank_s": mean(cpu), "cores_busy": mean(cpu) * ranks / step}
    if main:  # the rank's own thread; the rest is its communication (and, measured, Ray's) threads
        out["main_thread_s"] = mean(main)
    return out


def compare_files(predicted_path: str, measured_path: str) -> Comparison:
    """`compare` of two trace files (JSON or .json.gz); which is which is read from meta `kind`
    when the two are given the other way round."""
    a, b = Trace.load(predicted_path), Trace.load(measured_path)
    if a.kind == "measured" and b.kind == "predicted":
        a, b = b, a
    return compare(a, b)
