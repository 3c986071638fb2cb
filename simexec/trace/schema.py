"""The one trace schema for predicted and measured runs: Chrome Trace Event JSON (Perfetto opens it).

`traceEvents` holds complete events (`ph: X`, `pid` = rank, `tid` = stream, `ts`/`dur` in µs,
`args` with the instruction id, layer, micro-batch, FLOPs or bytes) and memory counters
(`ph: C`, one series per category). The top-level `metadata` object carries the model, cluster,
plan, the kind of trace (predicted or measured), the program fingerprint and the summary.
"""
from __future__ import annotations

import gzip
import json
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from simexec.errors import TraceError
from simexec.outputs import write_atomic

SCHEMA_VERSION = 1


@dataclass(slots=True)
class Event:
    """One executed (or predicted) instruction."""

    id: str
    rank: int
    stream: str
    name: str
    kind: str
    op: str
    start_us: float
    dur_us: float
    phase: str = ""
    layer: int = -1
    mb: int = -1
    flops: float = 0.0
    bytes: float = 0.0

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


@dataclass(slots=True)
class Counter:
    """Live bytes of one category on one rank from `ts_us` on."""

    rank: int
    ts_us: float
    category: str
    bytes: float


@dataclass
class Trace:
    meta: dict
    events: list[Event] = field(default_factory=list)
    counters: list[Counter] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return self.meta.get("kind", "")

    @property
    def summary(self) -> dict:
        return self.meta.get("summary", {})

    def by_id(self) -> dict[str, Event]:
        return {e.id: e for e in self.events}

    def to_chrome(self) -> dict:
        out = []
        streams: dict[tuple[int, str], int] = {}
        for e in self.events:
            tid = streams.setdefault((e.rank, e.stream), len(streams))
            args = {"id": e.id, "kind": e.kind, "op": e.op, "phase": e.phase, "layer": e.layer, "mb": e.mb}
            if e.flops:
                args["flops"] = e.flops
            if e.bytes:
                args["bytes"] = e.bytes
            out.append({"ph": "X", "name": e.name, "cat": e.kind, "pid": e.rank, "tid": tid,
                        "ts": e.start_us, "dur": e.dur_us, "args": args})
        for c in self.counters:
            out.append({"ph": "C", "name": f"memory.{c.category}", "pid": c.rank, "ts": c.ts_us,
                        "args": {"bytes": c.bytes}})
        meta_events = []
        for rank in sorted({e.rank for e in self.events} | {c.rank for c in self.counters}):
            meta_events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        for (rank, stream), tid in streams.items():
            meta_events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": stream}})
        return {"traceEvents": meta_events + out, "displayTimeUnit": "ms",
                "metadata": {"schema": SCHEMA_VERSION, **self.meta}}

    @staticmethod
    def from_chrome(data: dict, where: str = "trace") -> "Trace":
        if not isinstance(data, dict) or "traceEvents" not in data:
            raise TraceError(f"{where}: not a Chrome trace (no traceEvents)")
        meta = dict(data.get("metadata") or {})
        names: dict[tuple[int, int], str] = {}
        for ev in data["traceEvents"]:
            if ev.get("ph") == "M" and ev.get("name") == "thread_name":
                names[(ev["pid"], ev["tid"])] = ev["args"]["name"]
        events, counters = [], []
        try:
            for ev in data["traceEvents"]:
                ph = ev.get("ph")
                if ph == "X":
                    a = ev.get("args", {})
                    events.append(Event(
                        id=a.get("id", ""), rank=int(ev["pid"]),
                        stream=names.get((ev["pid"], ev.get("tid")), str(ev.get("tid"))),
                        name=ev.get("name", ""), kind=a.get("kind", ev.get("cat", "")), op=a.get("op", ""),
                        start_us=float(ev["ts"]), dur_us=float(ev.get("dur", 0.0)), phase=a.get("phase", ""),
                        layer=int(a.get("layer", -1)), mb=int(a.get("mb", -1)),
                        flops=float(a.get("flops", 0.0)), bytes=float(a.get("bytes", 0.0)),
                    ))
                elif ph == "C" and str(ev.get("name", "")).startswith("memory."):
                    counters.append(Counter(rank=int(ev["pid"]), ts_us=float(ev["ts"]),
                                            category=ev["name"].split(".", 1)[1],
                                            bytes=float(ev["args"]["bytes"])))
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceError(f"{where}: malformed event ({type(exc).__name__}: {exc})") from None
        return Trace(meta=meta, events=events, counters=counters)

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically (a temp file renamed into place), gzip-compressed when the name ends in .gz."""
        save_json(self.to_chrome(), path)

    @staticmethod
    def load(path: str | os.PathLike) -> "Trace":
        return Trace.from_chrome(load_json(path, "trace"), where=str(path))

    def peak_memory_per_rank(self) -> dict[int, float]:
        """Largest total of live bytes per rank, from the counters."""
        live: dict[int, dict[str, float]] = {}
        peak: dict[int, float] = {}
        for c in sorted(self.counters, key=lambda c: (c.rank, c.ts_us)):
            cats = live.setdefault(c.rank, {})
            cats[c.category] = c.bytes
            peak[c.rank] = max(peak.get(c.rank, 0.0), sum(cats.values()))
        return peak


def ends_when_waited(meta: dict) -> tuple[str, ...]:
    """Collectives whose measured end (in a trace the executor recorded) is when it waited for them,
    not when they finished: gloo, on CPU ranks, runs a reduce-scatter as an all-reduce on a worker
    thread and copies the slice out in `wait()`; until then its work does not report completion
    (`scripts/probe_host.py gloo-threads`). Their measured durations say nothing about the transfer.

    The executor runs a CPU reduce-scatter as an all-reduce itself, which completes when it ends
    (`simexec.exec.rank.collectives.reduce_scatter_by_all_reduce`), and says so in its traces
    (`meta["ends_when_waited"]`, empty); a measured CPU trace without that key comes from an
    executor that used gloo's own."""
    if "ends_when_waited" in meta:
        return tuple(meta["ends_when_waited"])
    if meta.get("kind") == "measured" and (meta.get("machine") or {}).get("device") == "cpu":
        return ("reducescatter",)
    return ()


def save_json(data: dict, path: str | os.PathLike) -> None:
    """Write `data` whole or not at all; a `.gz` name compresses it."""
    text = json.dumps(data, separators=(",", ":"), default=_jsonable).encode()
    if Path(path).suffix == ".gz":
        text = gzip.compress(text, mtime=0)
    write_atomic(path, text)


def load_json(path: str | os.PathLike, what: str) -> dict:
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{what} file not found: {path}")
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        return json.loads(raw)
    except (OSError, ValueError) as exc:
        raise TraceError(f"{what} file {path} is not valid JSON: {str(exc).splitlines()[0]}") from None


def _jsonable(obj):
    if hasattr(obj, "model_dump"):
        return obj.model_dump()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def steady_step(step_times: Sequence[float], fallback: Optional[float] = None) -> Optional[float]:
    """A run's steady-state step time: the median of its second half of steps. The executor's own
    `step_time_s` (the median after the first step) still carries warm-up: on CPU ranks the steps
    after the first get ~10-20% faster over the next few. The trace holds the step of the second half
    nearest this median (`simexec.exec.measure.tracer.pick_step`)."""
    xs = [float(x) for x in step_times if x]
    if len(xs) >= 4:
        return statistics.median(xs[len(xs) // 2:])
    return fallback
