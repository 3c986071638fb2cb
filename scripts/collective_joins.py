#!/usr/bin/env python
"""How long a step's collectives take once their last member has joined, read from recorded traces,
beside what the micro-benchmarks measured for the same collective after a barrier.

    python scripts/collective_joins.py [traces/local] [--stream comm.dp] [--kinds bwd.grads]

For each plan of a recording (`manifest.json`, as `scripts/record_traces.py` writes it) and each
collective of the chosen stream whose name starts with one of `--kinds`: the time from the last
member's issue to each member's end (the median over the members), every round listed. Then the
median over all of them, and the recording's micro-benchmark for that verb, group size and the
nearest size, after a barrier (`traces/local/microbench.json.gz`; median and mean of its samples).
A member that arrives early waits for the last; after the last joins, only the collective itself
is left, so the two numbers measure the same work in a step and alone.
"""
from __future__ import annotations

import argparse
import collections
import math
import statistics
import sys
from pathlib import Path
from typing import Optional


def joins(events: list, stream: str, kinds: tuple[str, ...],
          groups: Optional[dict] = None) -> list[tuple[str, str, int, int, float]]:
    """(name, verb, members, bytes, ms from the last member's issue to the members' median end) per
    collective of `stream` whose name starts with one of `kinds`; `groups`
    (`simexec.trace.late_waits.collective_groups`) tells apart the groups that call it under one name."""
    by_call: dict[tuple, list] = collections.defaultdict(list)
    for e in events:
        if e.stream == stream and e.name.startswith(kinds):
            by_call[(e.name, (groups or {}).get((e.rank, e.name)))].append(e)
    out = []
    for (name, _), es in sorted(by_call.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        last = max(e.start_us for e in es)
        out.append((name, es[0].op.partition("@")[0], len(es), int(es[0].bytes),
                    statistics.median((e.end_us - last) / 1e3 for e in es)))
    return out


def bench_alone(recording: Path, verb: str, ranks: int, nbytes: int) -> tuple[float, float, int] | None:
    """(median ms, mean ms, bytes) of the micro-benchmark's `verb` over `ranks` ranks after a barrier,
    at the benchmarked size nearest `nbytes` (in ratio); None without one."""
    from simexec.calibrate.micro import merge_results
    from simexec.trace.schema import load_json

    path = recording / "microbench.json.gz"
    if not path.exists():
        return None
    recs = [r for r in merge_results(load_json(path, "micro-benchmarks")["extras"]).get("collectives", [])
            if r.get("verb") == verb and r.get("n") == ranks and r.get("mode", "solo") == "solo" and r.get("t")]
    if not recs:
        return None
    rec = min(recs, key=lambda r: abs(math.log(r["bytes"] / max(1, nbytes))))
    return statistics.median(rec["t"]) * 1e3, statistics.fmean(rec["t"]) * 1e3, int(rec["bytes"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recording", nargs="?", default="traces/local")
    ap.add_argument("--stream", default="comm.dp", help="the collectives' stream (comm.dp, comm.tp, ...)")
    ap.add_argument("--kinds", default="bwd.grads", help="comma-separated name prefixes of the collectives")
    args = ap.parse_args(argv)
    from simexec.errors import SimexecError
    from simexec.trace.late_waits import collective_groups
    from simexec.trace.schema import Trace, load_json

    root = Path(args.recording)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    try:
        manifest = load_json(root / "manifest.json", "recording manifest")
    except SimexecError as exc:
        print(f"collective_joins: error: {exc}", file=sys.stderr)
        return 2
    rows: dict[tuple, list[float]] = collections.defaultdict(list)
    for run in manifest.get("runs", []):
        try:
            trace = Trace.load(root / str(run.get("file")))
        except (OSError, SimexecError) as exc:
            print(f"collective_joins: error: {exc}", file=sys.stderr)
            return 2
        world = int(trace.meta.get("world") or 0)
        for name, verb, members, nbytes, ms in joins(trace.events, args.stream, kinds, collective_groups(trace)):
            rows[(run.get("name"), verb, members, nbytes, world)].append(ms)
    if not rows:
        print(f"collective_joins: error: no {args.stream} collectives named {','.join(kinds)}* in {root}",
              file=sys.stderr)
        return 2
    print(f"{'plan':14s} {'verb':14s} {'ranks':>5s} {'bytes':>9s}  ms after the last member joined")
    pooled: dict[tuple, list[float]] = collections.defaultdict(list)
    for (plan, verb, members, nbytes, _world), ms in rows.items():
        print(f"{plan:14s} {verb:14s} {members:5d} {nbytes:9d}  " + ", ".join(f"{m:.1f}" for m in ms))
        pooled[(verb, members, nbytes)].extend(ms)
    print()
    for (verb, members, nbytes), ms in sorted(pooled.items()):
        # the executor runs a CPU reduce-scatter as an all-reduce of the whole tensor
        bench_verb = "allreduce" if verb == "reducescatter" else verb
        alone = bench_alone(root, bench_verb, members, nbytes)
        line = (f"{verb} over {members} ranks, {nbytes} B: median {statistics.median(ms):.2f} ms in steps "
                f"({len(ms)} collectives, {min(ms):.1f}-{max(ms):.1f})")
        if alone:
            line += f"; {bench_verb} of {alone[2]} B after a barrier: median {alone[0]:.2f} ms, mean {alone[1]:.2f}"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
