"""A trace's critical path: the chain of events, walked back from the last to end, that held the step,
and the share of the step each op class holds on it. Timestamps only, so it runs on a predicted and a
measured trace alike."""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Optional

from simexec.trace.schema import Event, Trace

_TOL_US = 1e-3  # a nanosecond: events closer than this are simultaneous


@dataclass
class CriticalPath:
    """Events on one trace's critical path, first to last, and the time each op class holds it."""

    events: list[Event]
    span_us: float
    share: dict[str, float]  # op class -> fraction of span_us (plus "idle" for gaps)
    time_us: dict[str, float]

    @property
    def ids(self) -> list[str]:
        return [e.id for e in self.events]


def critical_path(trace: Trace) -> CriticalPath:
    """Walk back from the last-ending event, timestamps only (no program needed).

    The *gate* of an event is the event on its rank that ended last at or before it started
    (its own stream preferred on ties). From an event `e`:

    - collective: of its members (events of the same name on other ranks that overlap it in time),
      the one that started last (ties: the one whose gate ended last) is where the step waited, so
      the path goes through that member and on to its gate;
    - recv: the matching send (same name, other rank) is its predecessor when it ended later than
      the recv's gate, else the gate is;
    - anything else: its gate.

    Each path event holds the step from the later of its start and its predecessor's end to its
    end; gaps count as `idle`, so the shares add up to 1.
    """
    timed = [e for e in trace.events if e.dur_us > 0 and e.kind != "memory"]
    if not timed:
        return CriticalPath([], 0.0, {}, {})
    by_rank: dict[int, list[Event]] = {}
    by_stream: dict[tuple[int, str], list[Event]] = {}
    by_name: dict[str, list[Event]] = {}
    for e in timed:
        by_rank.setdefault(e.rank, []).append(e)
        by_stream.setdefault((e.rank, e.stream), []).append(e)
        if e.kind in ("collective", "send", "recv"):
            by_name.setdefault(e.name, []).append(e)
    ends: dict = {}
    for key, evs in list(by_rank.items()) + list(by_stream.items()):
        evs.sort(key=lambda x: x.end_us)
        ends[key] = [x.end_us for x in evs]

    def latest(key, t: float) -> Optional[Event]:
        evs = by_rank.get(key) if isinstance(key, int) else by_stream.get(key)
        i = bisect.bisect_right(ends[key], t + _TOL_US) if evs else 0
        return evs[i - 1] if i else None

    def gate(e: Event) -> Optional[Event]:
        g, same = latest(e.rank, e.start_us), latest((e.rank, e.stream), e.start_us)
        if g is not None and same is not None and same.end_us >= g.end_us - _TOL_US:
            return same
        return g

    def peers(e: Event, kind: str) -> list[Event]:
        return [p for p in by_name.get(e.name, ()) if p.rank != e.rank and p.kind == kind
                and p.start_us <= e.end_us + _TOL_US and p.end_us >= e.start_us - _TOL_US]

    cur: Optional[Event] = max(timed, key=lambda x: (x.end_us, x.start_us))
    path: list[Event] = []
    seen: set[int] = set()
    while cur is not None and id(cur) not in seen:
        if cur.kind == "collective":
            members = [cur] + [p for p in peers(cur, "collective") if id(p) not in seen]
            last = max(m.start_us for m in members)
            late = [m for m in members if m.start_us >= last - _TOL_US]
            cur = max(late, key=lambda m: (g.end_us if (g := gate(m)) is not None else -math.inf, m is cur))
            seen.update(id(m) for m in members)
        seen.add(id(cur))
        path.append(cur)
        pred = gate(cur)
        if cur.kind == "recv":
            sends = [s for s in peers(cur, "send") if s.end_us <= cur.end_us + _TOL_US and id(s) not in seen]
            if sends:
                s = max(sends, key=lambda x: x.end_us)
                if pred is None or s.end_us > pred.end_us + _TOL_US:
                    pred = s
        cur = pred
    path.reverse()
    time_us: dict[str, float] = {}
    origin = min(e.start_us for e in timed)
    prev_end = origin
    for e in path:
        if e.start_us > prev_end + _TOL_US:
            time_us["idle"] = time_us.get("idle", 0.0) + e.start_us - prev_end
        held = e.end_us - max(e.start_us, prev_end)
        if held > 0:
            time_us[e.op or e.kind] = time_us.get(e.op or e.kind, 0.0) + held
        prev_end = max(prev_end, e.end_us)
    span = path[-1].end_us - origin
    share = {k: v / span for k, v in time_us.items()} if span > 0 else {}
    return CriticalPath(path, span, share, time_us)
