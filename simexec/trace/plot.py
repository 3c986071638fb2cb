"""Plots of traces: timelines, memory, op durations, calibration (matplotlib, PNG / SVG / PDF by suffix).

Every function builds a `matplotlib.figure.Figure` directly (no pyplot, no global state: safe in
threads and tests), saves it to `out` when given, and returns it so callers can inspect it.
matplotlib is imported inside the functions, so `import simexec.trace.plot` costs nothing.

Large traces stay fast: a timeline draws one `broken_barh` per lane (rank x stream), not one call
per event, rasterises the bars of big traces in vector output, and shows only the first
`max_ranks` ranks (the title says so).
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Optional, Sequence

from simexec.errors import OutputError, SimexecError
from simexec.outputs import write_atomic
from simexec.trace.schema import Trace

FORMATS = (".png", ".svg", ".pdf")
MAX_RANKS = 8
_RASTER_ABOVE = 5000  # events: above this, vector outputs embed the bars as an image
# Fixed colours for the common op classes (the rest cycle through tab20), so a colour means the
# same thing in every plot.
_FIXED = {
    "gemm": "#1f77b4", "attention": "#ff7f0e", "elementwise": "#2ca02c", "embedding": "#9467bd",
    "loss": "#8c564b", "optimizer": "#e377c2", "cpu_optimizer": "#f7b6d2", "send": "#17becf",
    "recv": "#dbdb8d", "copy": "#7f7f7f",
}
_COLLECTIVES = ("allreduce", "allgather", "reducescatter", "alltoall", "broadcast")
# Communication: reds and purples (tab20b), in the order the classes sort.
_COMM_PALETTE = ("#d62728", "#ff9896", "#7b4173", "#ce6dbd", "#ad494a", "#e7969c", "#a55194", "#843c39",
                 "#de9ed6", "#d6616b")
_STREAM_ORDER = ("compute", "comm", "p2p.send", "p2p.recv", "copy", "host")


# --- helpers ----------------------------------------------------------------------------------------
def _figure(**kw):
    from matplotlib.figure import Figure

    return Figure(**kw)


def check_image_name(out) -> Path:
    """The image's path, if its name says a format matplotlib writes here."""
    path = Path(out)
    if path.suffix.lower() not in FORMATS:
        raise OutputError(f"plot output {out}: use a name ending in {', '.join(FORMATS)}")
    return path


def _save(fig, out) -> None:
    if out is None:
        return
    path = check_image_name(out)
    image = io.BytesIO()
    fig.savefig(image, format=path.suffix.lower()[1:], dpi=120)
    write_atomic(path, image.getvalue())


def _op_class(e) -> str:
    return e.op or e.kind


def _colours(classes: Sequence[str]) -> dict[str, str]:
    """Op class -> colour: fixed for compute classes, reds/purples for collectives, tab20 for the rest."""
    from matplotlib import colormaps

    cycle = [colormaps["tab20"](i) for i in range(1, 20, 2)]  # the light half, after the fixed dark ones
    out, comm, other = {}, 0, 0
    for c in _class_order(classes):
        if c in _FIXED:
            out[c] = _FIXED[c]
        elif c.split("@", 1)[0] in _COLLECTIVES:
            out[c] = _COMM_PALETTE[comm % len(_COMM_PALETTE)]
            comm += 1
        else:
            out[c] = cycle[other % len(cycle)]
            other += 1
    return out


def _class_order(classes) -> list[str]:
    """Compute first (gemm, attention, ...), then collectives, then p2p and copies, then the rest."""
    compute = [c for c in _FIXED if c not in ("send", "recv", "copy")]

    def key(c):
        verb = c.split("@", 1)[0]
        if c in compute:
            return (0, compute.index(c), c)
        if verb in _COLLECTIVES:
            return (1, _COLLECTIVES.index(verb), c)
        if c in ("send", "recv", "copy"):
            return (2, 0, c)
        return (3, 0, c)
    return sorted(set(classes), key=key)


def _stream_key(stream: str):
    for i, prefix in enumerate(_STREAM_ORDER):
        if stream == prefix or stream.startswith(prefix + "."):
            return (i, stream)
    return (len(_STREAM_ORDER), stream)


def _trace_name(trace: Trace, i: int, plan: bool = True) -> str:
    kind = trace.meta.get("kind") or f"trace {i + 1}"
    p = trace.meta.get("plan")
    p = p.get("name", "") if isinstance(p, dict) else (p or "")
    return f"{kind} ({p})" if p and plan else kind


def _mem_unit(peak_bytes: float) -> tuple[float, str]:
    """(divisor, unit) for live-memory axes: GB from half a GB up, else MB or KB."""
    for div, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "KB")):
        if peak_bytes >= 0.5 * div:
            return div, unit
    return 1.0, "bytes"


def _ranks(traces: Sequence[Trace], max_ranks: int) -> tuple[list[int], int]:
    ranks = sorted({e.rank for t in traces for e in t.events} | {c.rank for t in traces for c in t.counters})
    return ranks[:max_ranks], len(ranks)


def _rank_note(shown: list[int], total: int) -> str:
    return f" — first {len(shown)} of {total} ranks" if total > len(shown) else ""


def _ms_axis(ax) -> None:
    ax.set_xlabel("time (ms)")


# --- timeline ---------------------------------------------------------------------------------------
def _draw_timeline(axes, traces: Sequence[Trace], ranks: list[int]) -> dict[str, str]:
    """One Gantt per axis: lanes = (rank, stream) shared by all traces, bars coloured by op class."""
    from matplotlib.patches import Patch

    wanted = set(ranks)
    evs = [[e for e in t.events if e.rank in wanted and e.dur_us > 0 and e.kind != "memory"] for t in traces]
    lanes = sorted({(e.rank, e.stream) for es in evs for e in es}, key=lambda rs: (rs[0], _stream_key(rs[1])))
    row = {lane: i for i, lane in enumerate(lanes)}
    classes = _class_order({_op_class(e) for es in evs for e in es})
    colour = _colours(classes)
    n_events = sum(len(es) for es in evs)
    for ax, es, trace, i in zip(axes, evs, traces, range(len(traces))):
        per_lane: dict[tuple[int, str], tuple[list, list]] = {}
        for e in es:
            bars, cols = per_lane.setdefault((e.rank, e.stream), ([], []))
            bars.append((e.start_us / 1e3, e.dur_us / 1e3))
            cols.append(colour[_op_class(e)])
        for lane, (bars, cols) in per_lane.items():
            coll = ax.broken_barh(bars, (row[lane] - 0.4, 0.8), facecolors=cols, linewidth=0)
            if n_events > _RASTER_ABOVE:
                coll.set_rasterized(True)
        ax.set_yticks(range(len(lanes)))
        ax.set_yticklabels([f"r{r} {s}" for r, s in lanes], fontsize=7 if len(lanes) > 16 else 8)
        ax.set_ylim(len(lanes) - 0.5, -0.5)
        prev = None
        for (r, _), y in row.items():
            if prev is not None and r != prev:
                ax.axhline(y - 0.5, color="0.6", linewidth=0.6)
            prev = r
        ax.set_ylabel("rank / stream")
        ax.grid(axis="x", color="0.9", linewidth=0.6)
        ax.set_axisbelow(True)
        ax.set_title(_trace_name(trace, i), fontsize=10, loc="left")
    if classes:
        handles = [Patch(facecolor=colour[c], label=c) for c in classes]
        axes[0].legend(handles=handles, title="op class", fontsize=7, title_fontsize=8,
                       loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    return colour


def _lanes_count(traces: Sequence[Trace], ranks: list[int]) -> int:
    wanted = set(ranks)
    return len({(e.rank, e.stream) for t in traces for e in t.events
                if e.rank in wanted and e.dur_us > 0 and e.kind != "memory"})


def _predicted_first(traces: Sequence[Trace]) -> list[Trace]:
    order = {"predicted": 0, "measured": 1}
    return sorted(traces, key=lambda t: order.get(t.kind, 2))


def plot_timeline(traces: Sequence[Trace], out=None, *, max_ranks: int = MAX_RANKS, title: Optional[str] = None):
    """Per-rank Gantt, one panel per trace (predicted above measured) on a shared time axis in ms."""
    traces = _predicted_first(traces)
    if not traces:
        raise SimexecError("plot_timeline: no trace given")
    ranks, total = _ranks(traces, max_ranks)
    lanes = max(1, _lanes_count(traces, ranks))
    height = len(traces) * (0.9 + 0.22 * lanes) + 0.8
    fig = _figure(figsize=(12, min(max(height, 3.0), 40)), layout="constrained")
    axes = fig.subplots(len(traces), 1, sharex=True, squeeze=False)[:, 0]
    _draw_timeline(axes, traces, ranks)
    _ms_axis(axes[-1])
    fig.suptitle((title or "timeline") + _rank_note(ranks, total))
    _save(fig, out)
    return fig


# --- memory -----------------------------------------------------------------------------------------
def memory_series(trace: Trace) -> dict[int, tuple[list[float], list[float]]]:
    """rank -> (times in ms, total live bytes), from the counters; without counters, from the
    trace's memory events (alloc adds, free subtracts their bytes). A symmetric prediction's
    representative ranks stand for the ranks they represent."""
    out: dict[int, tuple[list[float], list[float]]] = {}
    if trace.counters:
        live: dict[int, dict[str, float]] = {}
        for c in sorted(trace.counters, key=lambda c: (c.rank, c.ts_us)):
            cats = live.setdefault(c.rank, {})
            cats[c.category] = c.bytes
            ts, ys = out.setdefault(c.rank, ([], []))
            total = sum(cats.values())
            if ts and ts[-1] == c.ts_us / 1e3:
                ys[-1] = total
            else:
                ts.append(c.ts_us / 1e3)
                ys.append(total)
        return _expand_symmetric(trace, out)
    totals: dict[int, float] = {}
    for e in sorted((e for e in trace.events if e.kind == "memory"), key=lambda e: (e.rank, e.start_us)):
        sign = -1.0 if e.op == "free" else 1.0
        totals[e.rank] = totals.get(e.rank, 0.0) + sign * e.bytes
        ts, ys = out.setdefault(e.rank, ([], []))
        ts.append(e.start_us / 1e3)
        ys.append(totals[e.rank])
    return _expand_symmetric(trace, out)


def _has_memory(trace: Trace) -> bool:
    return bool(trace.counters) or any(e.kind == "memory" and e.bytes for e in trace.events)


_LINESTYLES = ("--", "-", ":", "-.")


def _summary_peaks(trace: Trace) -> dict[int, float]:
    """rank -> peak bytes from the summary (for traces without counters, e.g. a measured run)."""
    peaks = trace.summary.get("peak_memory_bytes_per_rank") or {}
    if isinstance(peaks, (list, tuple)):
        peaks = dict(enumerate(peaks))
    out = {int(r): float(b) for r, b in peaks.items() if b is not None}
    return _expand_symmetric(trace, out)


def _expand_symmetric(trace: Trace, per_rank: dict) -> dict:
    """Copy each representative rank's entry to the ranks it stands for (symmetric predictions)."""
    reps = trace.meta.get("represents") or {}
    if not trace.meta.get("symmetric") or not reps:
        return per_rank
    out = dict(per_rank)
    for rep, members in reps.items():
        if int(rep) in per_rank:
            for r in members:
                out.setdefault(int(r), per_rank[int(rep)])
    return dict(sorted(out.items()))


def _draw_memory(ax, traces: Sequence[Trace], ranks: list[int], series: list[dict], by_rank_colour: bool) -> None:
    """Live memory steps; one line per (trace, rank): linestyle per trace (predicted dashed), colour
    per rank (`by_rank_colour`) or per trace. A trace with no memory timeline but a summary peak
    per rank (a measured run without counters) is drawn as a horizontal line at that peak."""
    from matplotlib import colormaps
    from matplotlib.lines import Line2D

    cmap = colormaps["tab10"]
    flat = [_summary_peaks(t) if not ser else {} for t, ser in zip(traces, series)]
    peak = max([max(ser[r][1]) for ser in series for r in ranks if r in ser and ser[r][1]]
               + [f[r] for f in flat for r in ranks if r in f], default=0.0)
    div, unit = _mem_unit(peak)
    for i, (trace, ser) in enumerate(zip(traces, series)):
        name = _trace_name(trace, i, plan=False)
        for j, r in enumerate(ranks):
            colour = cmap(j % 10) if by_rank_colour else cmap(i % 10)
            if r in flat[i]:
                ax.axhline(flat[i][r] / div, linestyle=_LINESTYLES[i % 4], color=colour, linewidth=1.0,
                           label=f"{name} peak r{r}" if by_rank_colour else f"{name} (peak)")
            if r not in ser or not ser[r][0]:
                continue
            ts, ys = ser[r]
            end = max((e.end_us for e in trace.events if e.rank == r), default=ts[-1] * 1e3) / 1e3
            ts, ys = list(ts) + [max(end, ts[-1])], list(ys) + [ys[-1]]
            ax.plot(ts, [y / div for y in ys], drawstyle="steps-post", linestyle=_LINESTYLES[i % 4],
                    color=colour, linewidth=1.2, label=f"{name} r{r}" if by_rank_colour else name)
    ax.set_ylabel(f"live memory ({unit})")
    ax.grid(color="0.9", linewidth=0.6)
    if by_rank_colour:  # compact legend: ranks by colour, traces by line style
        handles = [Line2D([], [], color=cmap(j % 10), label=f"rank {r}") for j, r in enumerate(ranks)
                   if any(r in s for s in series + flat)]
        handles += [Line2D([], [], color="k", linestyle=_LINESTYLES[i % 4],
                           label=_trace_name(t, i, plan=False) + ("" if series[i] else " (peak)"))
                    for i, t in enumerate(traces) if series[i] or flat[i]]
        ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def plot_memory(traces: Sequence[Trace], out=None, *, max_ranks: int = MAX_RANKS, title: Optional[str] = None):
    """Live bytes over time, one panel per rank (GB against ms), each trace a line (predicted dashed)."""
    traces = list(traces)
    series = [memory_series(t) for t in traces]
    ranks = sorted({r for s in series for r in s})
    total = len(ranks)
    ranks = ranks[:max_ranks]
    if not ranks:
        raise SimexecError("plot_memory: no memory counters or memory events in the traces")
    ncols = min(4, len(ranks))
    nrows = -(-len(ranks) // ncols)
    fig = _figure(figsize=(3.6 * ncols + 0.5, 2.8 * nrows + 0.8), layout="constrained")
    axes = fig.subplots(nrows, ncols, sharex=True, squeeze=False).ravel()
    for ax, r in zip(axes, ranks):
        _draw_memory(ax, traces, [r], series, by_rank_colour=False)
        ax.set_title(f"rank {r}", fontsize=10)
        ax.set_xlabel("time (ms)")
    for ax in axes[len(ranks):]:
        fig.delaxes(ax)
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        axes[0].legend(handles, labels, fontsize=8)
    plans = ", ".join(dict.fromkeys(_trace_name(t, i) for i, t in enumerate(traces)))
    fig.suptitle((title or f"live memory per rank: {plans}") + _rank_note(ranks, total))
    _save(fig, out)
    return fig


# --- durations --------------------------------------------------------------------------------------
def plot_durations(predicted: Trace, measured: Trace, out=None, *, title: Optional[str] = None):
    """Predicted against measured duration of every matched instruction, log-log, with y = x."""
    from simexec.trace.compare import error_stats, matched_pairs, timed_pairs

    pairs = [(p, m) for p, m in timed_pairs(matched_pairs(predicted, measured), measured) if p.dur_us > 0]
    if not pairs:
        raise SimexecError("plot_durations: no matched events with a duration in both traces")
    classes = _class_order({_op_class(m) for _, m in pairs})
    colour = _colours(classes)
    fig = _figure(figsize=(7.5, 6), layout="constrained")
    ax = fig.subplots()
    raster = len(pairs) > _RASTER_ABOVE
    for c in classes:
        xs = [p.dur_us for p, m in pairs if _op_class(m) == c]
        ys = [m.dur_us for p, m in pairs if _op_class(m) == c]
        ax.scatter(xs, ys, s=10, color=colour[c], alpha=0.7, linewidths=0, label=f"{c} ({len(xs)})",
                   rasterized=raster)
    lo = min(min(p.dur_us, m.dur_us) for p, m in pairs) / 1.5
    hi = max(max(p.dur_us, m.dur_us) for p, m in pairs) * 1.5
    ax.plot([lo, hi], [lo, hi], color="k", linewidth=1, label="y = x")
    ax.plot([lo, hi], [2 * lo, 2 * hi], color="0.6", linewidth=0.8, linestyle=":", label="2x / 0.5x")
    ax.plot([lo, hi], [lo / 2, hi / 2], color="0.6", linewidth=0.8, linestyle=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_aspect("equal")
    ax.set_xlabel("predicted duration (µs)")
    ax.set_ylabel("measured duration (µs)")
    ax.grid(which="major", color="0.9", linewidth=0.6)
    ax.legend(fontsize=7, loc="upper left", title="op class (events)", title_fontsize=8)
    s = error_stats([(p.dur_us, m.dur_us) for p, m in pairs])
    ax.set_title(title or f"op durations: {s['count']} events, median APE {s['median_ape']:.1%}, "
                          f"p90 {s['p90_ape']:.1%}", fontsize=10)
    _save(fig, out)
    return fig


# --- calibration ------------------------------------------------------------------------------------
def _mape(rows) -> float:
    rows = [(p, m) for _, p, m in rows if m]
    return sum(abs(p - m) / m for p, m in rows) / len(rows) if rows else float("nan")


def plot_calibration(before: Sequence[tuple[str, float, float]], after: Sequence[tuple[str, float, float]],
                     out=None, *, title: Optional[str] = None, heldout: Sequence[str] = ()):
    """Per plan (name, predicted_s, measured_s) before and after calibration: bars of step time
    (measured, predicted before, predicted after) and a predicted-vs-measured scatter with y = x.
    MAPE = mean of |predicted - measured| / measured over the plans; `heldout` names the plans the
    calibration did not see, starred on the axis, with their own MAPE in the title."""
    before, after = list(before), list(after)
    held = set(heldout)
    if not before and not after:
        raise SimexecError("plot_calibration: no plans given")
    names = list(dict.fromkeys([n for n, _, _ in before] + [n for n, _, _ in after]))
    b = {n: (p, m) for n, p, m in before}
    a = {n: (p, m) for n, p, m in after}
    meas = {n: (a.get(n) or b.get(n))[1] for n in names}
    mape_b, mape_a = _mape(before), _mape(after)

    fig = _figure(figsize=(max(8.0, 0.75 * len(names) + 5.5), 4.8), layout="constrained")
    ax_bar, ax_sc = fig.subplots(1, 2, width_ratios=[max(2.0, len(names) / 4), 1.2])
    width = 0.27
    xs = range(len(names))
    ax_bar.bar([x - width for x in xs], [meas[n] * 1e3 for n in names], width, color="0.35", label="measured")
    ax_bar.bar([x for x in xs], [b[n][0] * 1e3 if n in b else 0 for n in names], width, color="#ff7f0e",
               label=f"predicted before (MAPE {mape_b:.1%})")
    ax_bar.bar([x + width for x in xs], [a[n][0] * 1e3 if n in a else 0 for n in names], width, color="#1f77b4",
               label=f"predicted after (MAPE {mape_a:.1%})")
    ax_bar.set_xticks(list(xs))
    ax_bar.set_xticklabels([f"{n}*" if n in held else n for n in names], rotation=35, ha="right", fontsize=8)
    ax_bar.set_xlabel("plan (* held out)" if held else "plan")
    ax_bar.set_ylabel("step time (ms)")
    ax_bar.set_title("step time per plan", fontsize=10)
    ax_bar.legend(fontsize=8)
    ax_bar.grid(axis="y", color="0.9", linewidth=0.6)
    ax_bar.set_axisbelow(True)

    pts = [v for rows in (before, after) for _, p, m in rows for v in (p * 1e3, m * 1e3) if v > 0]
    if before:
        ax_sc.scatter([p * 1e3 for _, p, _ in before], [m * 1e3 for _, _, m in before], marker="o",
                      facecolors="none", edgecolors="#ff7f0e", label="before")
    if after:
        ax_sc.scatter([p * 1e3 for _, p, _ in after], [m * 1e3 for _, _, m in after], marker="o",
                      color="#1f77b4", label="after")
    if pts:
        wide = max(pts) / min(pts) > 20  # log axes only when the plans span decades
        lo, hi = (min(pts) / 1.3, max(pts) * 1.3) if wide else (0.0, max(pts) * 1.1)
        ax_sc.plot([lo, hi], [lo, hi], color="k", linewidth=1, label="y = x")
        if wide:
            ax_sc.set_xscale("log")
            ax_sc.set_yscale("log")
        ax_sc.set_xlim(lo, hi)
        ax_sc.set_ylim(lo, hi)
        ax_sc.set_aspect("equal")
    ax_sc.set_xlabel("predicted step time (ms)")
    ax_sc.set_ylabel("measured step time (ms)")
    ax_sc.set_title("predicted vs measured", fontsize=10)
    ax_sc.legend(fontsize=8)
    ax_sc.grid(color="0.9", linewidth=0.6)
    default = f"calibration: step-time MAPE {mape_b:.1%} before, {mape_a:.1%} after ({len(names)} plans)"
    if held:
        hb, ha = _mape([r for r in before if r[0] in held]), _mape([r for r in after if r[0] in held])
        default += f"; held out ({len(held)}): {hb:.1%} before, {ha:.1%} after"
    fig.suptitle(title or default)
    _save(fig, out)
    return fig


# --- any traces -------------------------------------------------------------------------------------
def plot_traces(paths: Sequence[str], out=None, *, max_ranks: int = MAX_RANKS):
    """What `simexec plot trace.json [other.json] -o out.png` draws: a timeline panel per trace
    (a predicted trace above a measured one), plus a memory panel when the traces have counters."""
    if not paths:
        raise SimexecError("plot: no trace given")
    traces = _predicted_first([Trace.load(p) for p in paths])
    ranks, total = _ranks(traces, max_ranks)
    lanes = max(1, _lanes_count(traces, ranks))
    with_mem = any(_has_memory(t) for t in traces)
    heights = [0.9 + 0.22 * lanes] * len(traces) + ([3.0] if with_mem else [])
    fig = _figure(figsize=(12, min(sum(heights) + 0.8, 40)), layout="constrained")
    axes = fig.subplots(len(heights), 1, sharex=True, squeeze=False, height_ratios=heights)[:, 0]
    _draw_timeline(axes[:len(traces)], traces, ranks)
    if with_mem:
        series = [memory_series(t) for t in traces]
        _draw_memory(axes[-1], traces, ranks, series, by_rank_colour=True)
        axes[-1].set_title("live memory per rank", fontsize=10, loc="left")
    _ms_axis(axes[-1])
    names = ", ".join(dict.fromkeys(Path(p).name for p in paths))
    fig.suptitle(f"{names}{_rank_note(ranks, total)}", fontsize=11)
    _save(fig, out)
    return fig
