"""Predicted collective times, algorithm and bandwidths on a cluster, to hold against nccl-tests.

    python scripts/collectives.py --cluster dgx-h100 --ranks 8,16,64,1024
    python scripts/collectives.py --cluster dgx-a100-80g --ranks 8,128 --verbs allgather --sizes 1M,1G --json

For each collective, rank count and size: the algorithm/protocol simexec's network picks (NCCL's own
cost model on NVIDIA devices, simexec.sim.nccl_tuning), the idle-network time (with the cluster's
per-call latency), and nccl-tests' algbw = size / time and busbw = algbw x 2(n-1)/n (allreduce),
(n-1)/n (allgather, reducescatter, alltoall), 1 (broadcast). Sizes are nccl-tests' sizes: the whole
buffer (an all-gather's output, a reduce-scatter's input). The cluster is grown to as many nodes as
the largest rank count needs; ranks are consecutive (whole nodes first).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simexec.errors import SpecError  # noqa: E402
from simexec.sim.network import Network  # noqa: E402
from simexec.specs.cluster import ClusterSpec, get_cluster  # noqa: E402

VERBS = ("allreduce", "allgather", "reducescatter", "broadcast", "alltoall")
UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


class OneLineParser(argparse.ArgumentParser):
    """A bad flag is one line on stderr and exit 2 (no usage dump)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"collectives.py: error: {message}\n")
        raise SystemExit(2)


def parse_size(text: str) -> int:
    """`1M`, `16M`, `1G`, `4096`: bytes, binary units as nccl-tests prints them."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B") if text.strip().upper() != "B" else ""
    unit = t[-1:] if t[-1:] in UNITS else ""
    num = t[: len(t) - len(unit)]
    try:
        value = float(num) * UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (e.g. 1M, 256M, 1G)") from None
    if not value >= 1 or value != value or value == math.inf:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: must be at least 1 byte")
    return int(value)


def parse_list(kind: str, parse):
    def inner(text: str) -> list:
        items = [x for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"empty {kind} list")
        return [parse(x) for x in items]
    return inner


def parse_rank(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad rank count {text!r}") from None
    if n < 2:
        raise argparse.ArgumentTypeError(f"rank count {n} must be at least 2")
    return n


def parse_verb(text: str) -> str:
    v = text.strip().lower().replace("_", "").replace("-", "")
    if v not in VERBS:
        raise argparse.ArgumentTypeError(f"unknown collective {text!r} (one of {', '.join(VERBS)})")
    return v


def bus_factor(verb: str, n: int) -> float:
    """nccl-tests' busbw / algbw (doc/PERFORMANCE.md)."""
    if verb == "allreduce":
        return 2 * (n - 1) / n
    if verb in ("allgather", "reducescatter", "alltoall"):
        return (n - 1) / n
    return 1.0


def sized_for(cluster: ClusterSpec, ranks: int) -> ClusterSpec:
    """The cluster with nodes enough for `ranks` (whole NVLink domains), one host if sized to the plan."""
    if cluster.sized_to_plan:
        return cluster.with_world_size(ranks)
    per = cluster.nvlink_domain
    nodes_per_domain = per // cluster.node.gpus_per_node
    nodes = math.ceil(ranks / per) * nodes_per_domain
    return cluster.model_copy(update={"nodes": max(cluster.nodes, nodes)})


def rows(cluster: ClusterSpec, ranks: list[int], verbs: list[str], sizes: list[int]) -> list[dict]:
    out = []
    for n in ranks:
        c = sized_for(cluster, n)
        group = tuple(range(n))
        net = Network(c, group, {})
        for verb in verbs:
            for size in sizes:
                t = net.estimate(net.collective(verb, group, float(size)))
                algbw = size / t / 1e9
                out.append(dict(collective=verb, ranks=n, bytes=size, algorithm=net.algorithm(verb, group, float(size)),
                                time_us=t * 1e6, algbw_gbps=algbw, busbw_gbps=algbw * bus_factor(verb, n)))
    return out


def human(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def main(argv: Optional[list[str]] = None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", required=True, help="a preset (dgx-h100), N nodes of one (4xdgx-h100), or a file")
    ap.add_argument("--ranks", required=True, type=parse_list("rank", parse_rank), help="e.g. 8,16,64,1024")
    ap.add_argument("--verbs", type=parse_list("collective", parse_verb), default=list(VERBS[:3]),
                    help=f"comma-separated, of {', '.join(VERBS)} (default allreduce,allgather,reducescatter)")
    ap.add_argument("--sizes", type=parse_list("size", parse_size), default=[1 << 20, 16 << 20, 256 << 20, 1 << 30],
                    help="bytes per collective, nccl-tests' size (default 1M,16M,256M,1G)")
    ap.add_argument("--sharp", action="store_true",
                    help="SHARP in the InfiniBand switches with NCCL's CollNet enabled (network.sharp)")
    ap.add_argument("--json", action="store_true", help="a JSON list on stdout instead of a table")
    args = ap.parse_args(argv)
    try:
        cluster = get_cluster(args.cluster)
        if args.sharp:
            cluster = cluster.model_copy(update={"network": cluster.network.model_copy(update={"sharp": True})})
        table = rows(cluster, args.ranks, args.verbs, args.sizes)
    except SpecError as e:
        sys.stderr.write(f"collectives.py: error: {e}\n")
        return 2
    if args.json:
        print(json.dumps(table, indent=1))
        return 0
    print(f"{cluster.name}: predicted idle-network collectives (busbw as nccl-tests defines it)")
    print(f"{'collective':<14}{'ranks':>6}{'size':>7}  {'algorithm':<18}{'time us':>11}{'algbw GB/s':>12}{'busbw GB/s':>12}")
    for r in table:
        print(f"{r['collective']:<14}{r['ranks']:>6}{human(r['bytes']):>7}  {r['algorithm']:<18}"
              f"{r['time_us']:>11.1f}{r['algbw_gbps']:>12.2f}{r['busbw_gbps']:>12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
