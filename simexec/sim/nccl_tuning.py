"""NCCL's own cost model for choosing a collective's algorithm and protocol, as numbers and rules.

NCCL prices every (algorithm, protocol) pair of a collective as `latency + bytes / bandwidth` and runs
the cheapest (`ncclTopoTuneModel` fills the tables, `ncclTopoGetAlgoTime` and `topoGetAlgoInfo` pick).
This module holds that model's constants and which pairs exist on a topology; `simexec.sim.network`
turns each pair into phases on its links, so that contention between transfers stays real.

Every constant is NCCL's, read at NVIDIA/nccl commit 5067397c2676d5aed50042fc39e5c8ee96eb0027
(NCCL 2.30.7, makefiles/version.mk), file src/graph/tuning.cc unless noted. Latencies there are in
microseconds and bandwidths in GB/s; they are converted to seconds and bytes/s here.

NCCL's "node" is a set of GPUs on one NVLink fabric (a host, or a multi-node NVLink clique such as a
GB200 NVL72 rack): here, an NVLink domain.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Arch = Literal["ampere", "hopper", "blackwell"]
CpuVendor = Literal["intel", "amd", "arm"]

US = 1e-6
GBPS = 1e9

PROTOCOLS = ("LL", "LL128", "Simple")

# ncclTunerConstantsDefaults.baseLatencies, us, per (LL, LL128, Simple).
BASE_LATENCY_US = {
    "tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4),
    "nvls": (0.0, 0.0, 0.0), "nvls_tree": (0.0, 0.0, 0.0), "pat": (8.0, 8.0, 8.0),
}
# ncclTunerConstantsDefaults.hwLatencies, us per hop, per (LL, LL128, Simple): NVLink and network rows.
HW_LATENCY_US = {
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4), "nvls": (0.0, 0.0, 25.0),
               "nvls_tree": (0.0, 0.0, 25.0), "pat": (0.0, 0.0, 4.0),
               "collnet_direct": (0.0, 0.0, 3.7), "collnet_chain": (0.0, 0.0, 2.8)},
    "net": {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0), "nvls": (0.0, 0.0, 18.0),
            "nvls_tree": (0.0, 0.0, 20.9), "pat": (0.0, 0.0, 14.0),
            "collnet_direct": (0.0, 0.0, 31.0), "collnet_chain": (0.0, 0.0, 30.0)},
}
# CollNet (SHARP in the InfiniBand switches): Simple only, base latency 0. CollNet Direct adds "0.4 us
# arity serialization latency" per local rank, is slowed where GPUs outnumber NICs (its bus bandwidth
# divided by f - (f - 1) / 2, f = GPUs per NIC channel) and by 0.85 from compute capability 9.0.
COLLNET_ARITY_US = 0.4
COLLNET_DIRECT_SM90_FACTOR = 0.85
# llMaxBws, GB/s: a cap on LL's bus bandwidth. One node: by GPU generation; several: by host CPU
# (row 0 Intel, row 1 AMD). Columns: 1 node, 2 nodes, more.
_LL_MAX_BW_BY_ARCH = {"ampere": (87.7, 22.5, 19.0), "hopper": (141.0, 45.0, 35.0),
                      "blackwell": (2 * 141.0, 2 * 45.0, 2 * 35.0)}
_LL_MAX_BW_BY_CPU = {"intel": (39.0, 39.0, 20.4), "amd": (87.7, 22.5, 19.0)}
# nvlsEfficiency: the fraction of NVLink bandwidth NVLink SHARP reaches (0: no NVLS before Hopper).
NVLS_EFFICIENCY = {"ampere": 0.0, "hopper": 0.85, "blackwell": 0.74}
# NVLS channels (src/transport/nvls.cc: NVLS_NCHANNELS_SM90 16; SM100 24 inside one NVLink domain,
# 32 across nodes); the model keeps (nChannels - 1) / nChannels of the NVLS bandwidth.
NVLS_CHANNELS = {"hopper": (16, 16), "blackwell": (24, 32)}
# Protocol refinements of the bus bandwidth (ncclTopoTuneModel, "Various model refinements").
RING_LL_FACTOR = 0.5                 # LL: 4 bytes of data per 8-byte line (the other 4 a flag)
RING_LL128_FACTOR = 0.92             # LL128: "120.0/128.0" (one 8-byte flag per 128-byte line), rounded down
TREE_FACTOR = 0.92                   # tree all-reduce, every protocol
TREE_LL_FACTOR = 1.0 / 3.8
TREE_LL128_FACTOR_ONE_NODE = 7.0 / 9.0
TREE_LL128_FACTOR_NODES = 120.0 / 128.0
PAT_FACTOR = 0.75
# treeCorrectionFactor: tree all-reduce bandwidth by message size, powers of two from 64 B.
TREE_CORRECTION = {
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9),
}
# getNetOverhead: per network step of a ring, us (Intel and Arm 1, AMD 2), three times that for Simple.
NET_OVERHEAD_US = {"intel": 1.0, "amd": 2.0, "arm": 1.0}
SIMPLE_NET_OVERHEAD_MULT = 3.0
# ncclTopoGetAlgoTime: "Plateau effect of ring" on multi-node Simple all-reduce once every channel of
# every rank has 64 bytes; the channel count is NCCL's maximum (MAXCHANNELS, src/include/device.h).
RING_PLATEAU_LATENCY_MULT = 1.4      # compute capability >= 80
RING_PLATEAU_BYTES = 64
MAX_CHANNELS = 64


@dataclass(frozen=True)
class Option:
    """One (algorithm, protocol) NCCL would consider: its latency and what it makes of the bandwidth.

    `efficiency` multiplies the links' bandwidth (bytes a link carries per payload byte: 1 / efficiency);
    `cap` bounds the bus bandwidth in bytes/s (LL's llMaxBw), inf where NCCL has none.
    """

    algorithm: str
    protocol: str
    latency_s: float
    efficiency: float
    cap: float = math.inf


def _log2i(x: int) -> int:
    return max(0, int(x).bit_length() - 1)


def ll_max_bw(arch: Arch, cpu: CpuVendor, nodes: int) -> float:
    """llMaxBw in bytes/s: by GPU on one node, by host CPU (AMD or not) across nodes."""
    col = min(nodes, 3) - 1
    row = _LL_MAX_BW_BY_ARCH[arch] if nodes == 1 else _LL_MAX_BW_BY_CPU["amd" if cpu == "amd" else "intel"]
    return row[col] * GBPS


def tree_correction(protocol: str, nbytes: float) -> float:
    """treeCorrectionFactor for an all-reduce of `nbytes` (1 outside the table's 64 B .. 256 MiB)."""
    log_size = _log2i(int(nbytes) >> 6) if nbytes >= 64 else -1
    table = TREE_CORRECTION[protocol]
    return table[log_size] if 0 <= log_size < 23 else 1.0


def nvls_efficiency(arch: Arch, nodes: int) -> float:
    """NVLS's fraction of NVLink bandwidth: nvlsEfficiency x (nChannels - 1) / nChannels."""
    eff = NVLS_EFFICIENCY[arch]
    if eff <= 0:
        return 0.0
    ch = NVLS_CHANNELS[arch][0 if nodes == 1 else 1]
    return eff * (ch - 1) / ch


def collnet_direct_efficiency(arch: Arch, ppn: float, nics: int) -> float:
    """CollNet Direct's share of its bus bandwidth: 1 / (f - (f - 1) / 2) with f GPUs per NIC (NCCL's
    GPU/NIC ratio of ranks per channel, one channel per NIC here), times 0.85 on Hopper and later."""
    f = ppn / max(1, nics)
    f -= (f - 1) / 2
    eff = 1.0 / max(1.0, f)
    return eff * (COLLNET_DIRECT_SM90_FACTOR if arch != "ampere" else 1.0)


def options(verb: str, ranks: int, nodes: int, arch: Arch, cpu: CpuVendor, nvls: bool,
            nbytes: float, collnet: bool = False, nics: int = 0) -> list[Option]:
    """The (algorithm, protocol) pairs NCCL considers for `verb` over `ranks` GPUs on `nodes` NVLink
    domains, with NCCL's latency for each; NVLink inside a domain, NICs between (LL128 enabled, as
    NCCL does on NVLink with NICs under the GPUs' PCIe switch). `collnet`: SHARP in the network with
    NCCL_COLLNET_ENABLE (CollNet Direct and Chain, NVLS across nodes) for all-reduce; CollNet's
    all-gather and reduce-scatter need a plugin with `iallgather` / `ireducescatter` and one NIC per
    GPU, which is not assumed. `nics`: NICs per domain (CollNet Direct's GPU/NIC ratio).
    """
    ppn = ranks / nodes
    if verb == "allreduce":
        nsteps = 2 * (ranks - 1)
    elif verb in ("allgather", "reducescatter"):
        nsteps = ranks - 1
    elif verb == "broadcast":
        nsteps = ranks
    else:
        raise ValueError(f"NCCL tunes no collective {verb!r}")
    intra_hw = HW_LATENCY_US["nvlink"]
    net = HW_LATENCY_US["net"]
    ll_cap = ll_max_bw(arch, cpu, nodes)
    out: list[Option] = []

    def inter_lat(algo: str, p: int) -> float:
        # "With ppn=1 latencies are fully exposed, use the Tree network latency"; IB reports no extra
        # latency (graph->latencyInter 0: src/transport/net_ib/init.cc).
        return net["tree" if ppn == 1 else algo][p]

    for p, proto in enumerate(PROTOCOLS):
        # Ring: every verb.
        if verb == "broadcast":
            # Not sameChannels: "Add some chunk latency", Simple at the tree's per-hop latency.
            hw = intra_hw if nodes == 1 else net
            lat = BASE_LATENCY_US["ring"][p] + nsteps * hw["tree" if proto == "Simple" else "ring"][p]
        else:
            intra = intra_hw["ring"][p]
            if nodes > 1:
                over = NET_OVERHEAD_US[cpu] * (SIMPLE_NET_OVERHEAD_MULT if proto == "Simple" else 1.0)
                intra = max(intra, over)
            inter_steps = 0 if nodes == 1 else (2 if verb == "allreduce" else 1) * (nodes - 1)
            lat = BASE_LATENCY_US["ring"][p] + (nsteps - inter_steps) * intra + inter_steps * inter_lat("ring", p)
            if (verb == "allreduce" and proto == "Simple" and nodes > 1
                    and nbytes / (MAX_CHANNELS * ranks) >= RING_PLATEAU_BYTES):
                lat *= RING_PLATEAU_LATENCY_MULT
        eff = {"LL": RING_LL_FACTOR, "LL128": RING_LL128_FACTOR, "Simple": 1.0}[proto]
        out.append(Option("ring", proto, lat * US, eff, ll_cap if proto == "LL" else math.inf))

        if verb == "allreduce":
            lat = BASE_LATENCY_US["tree"][p] + 2 * ((ppn - 1) * intra_hw["tree"][p] + _log2i(nodes) * inter_lat("tree", p))
            eff = TREE_FACTOR * {"LL": TREE_LL_FACTOR, "Simple": 1.0,
                                 "LL128": TREE_LL128_FACTOR_ONE_NODE if nodes == 1 else TREE_LL128_FACTOR_NODES}[proto]
            corr = tree_correction(proto, nbytes)
            cap = ll_cap * corr if proto == "LL" else math.inf
            out.append(Option("tree", proto, lat * US, eff * corr, cap))

        if proto != "Simple":
            continue
        nv_eff = nvls_efficiency(arch, nodes) if nvls else 0.0
        if collnet and nodes > 1 and verb == "allreduce":
            local = ppn - 1
            lat = 2 * (min(1.0, local) * intra_hw["collnet_direct"][p] + local * COLLNET_ARITY_US)
            out.append(Option("collnet_direct", proto, (lat + inter_lat("collnet_direct", p)) * US,
                              collnet_direct_efficiency(arch, ppn, nics)))
            lat = 2 * local * intra_hw["collnet_chain"][p] + inter_lat("collnet_chain", p)
            out.append(Option("collnet_chain", proto, lat * US, 1.0))
            if nv_eff > 0 and ppn > 1:  # NVLS inside each domain, SHARP between them
                lat = intra_hw["nvls"][p] + inter_lat("nvls", p)
                out.append(Option("nvls", proto, lat * US, nv_eff))
        if nv_eff > 0 and ppn > 1:
            if nodes == 1 and verb in ("allreduce", "allgather", "reducescatter"):
                out.append(Option("nvls", proto, intra_hw["nvls"][p] * US, nv_eff))
            elif nodes > 1 and verb == "allreduce":
                # NVLS inside each domain, a tree between them (NVLS alone across nodes needs CollNet).
                lat = intra_hw["nvls_tree"][p] + 2 * _log2i(nodes) * inter_lat("nvls_tree", p)
                out.append(Option("nvls_tree", proto, lat * US, nv_eff))
        if verb in ("allgather", "reducescatter") and ppn == 1 and nodes > 1:
            # PAT: one GPU per node only (ncclPatEnable), Simple only.
            lat = BASE_LATENCY_US["pat"][p] + _log2i(nodes) * (inter_lat("pat", p) / 3.5) + ranks * 2.8
            out.append(Option("pat", proto, lat * US, PAT_FACTOR))
    return out
