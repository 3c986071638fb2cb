"""Hardware profiles: what calibration writes and the simulator reads, and the parameters a fit moves.

A profile (`traces/profiles/<name>.json`, read by `simulate --profile` and
`simexec.sim.profile.apply_profile`) holds the cost parameters fitted to one machine, where and how
they were measured. Two calibrations write one, each in its own module: `simexec.calibrate.micro`
(micro-benchmarks on the executor's own rank actors) and `simexec.calibrate.traces` (measured step
traces, re-simulated). This module is what they share: the profile's file, the parameters they fit
(`PARAMS`, with the profile field each moves) and `CalibrationError`.

For the `local` cluster the model is `simexec.sim.host.model` (CPU ranks time-sharing the host's cores):
a profile sets `costs.cores_shared` and `node.cpu_cores` from this machine.
"""
from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import math
import os
import platform
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

from simexec.specs.cluster import ClusterSpec, get_cluster
from simexec.errors import SimexecError
from simexec.outputs import write_atomic

PathLike = Union[str, os.PathLike]


class CalibrationError(SimexecError):
    """Calibration cannot proceed: bad inputs (traces, cluster, ranks) or a fit that failed."""


# --- profiles --------------------------------------------------------------------------------------
def machine_info() -> dict:
    """Where a profile was measured: host, CPU model, cores, torch and ray versions, kernel."""
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
    try:  # read from the installed metadata: importing ray costs seconds
        ray_version = importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - ray is a dependency
        ray_version = ""
    return {"hostname": socket.gethostname(), "cpu": cpu, "cores": cores, "torch": torch_version,
            "ray": ray_version, "python": platform.python_version(), "platform": platform.platform()}


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
    return write_atomic(path, (json.dumps(profile, indent=2, sort_keys=False) + "\n").encode())


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
    # the host's Adam over an offloaded optimizer, whole node (DeepSpeed's CPU Adam on every core)
    Param("cpu_adam", "node", "cpu_optimizer_params_per_s", 1e6, 1e12),
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


def linux_slice(cores: int) -> float:
    """Linux's default scheduler slice on `cores` CPUs: 0.75 ms x (1 + log2 cores), cores capped at 8
    (`sysctl_sched_base_slice`, scaled logarithmically)."""
    return 0.75e-3 * (1 + int(math.log2(max(1, min(8, cores)))))


def save_json_plain(data: dict, path: PathLike) -> None:
    from simexec.trace.schema import save_json

    save_json(data, path)


def jsonable(x):
    """`x` with string keys, lists for tuples and None for non-finite floats: strict JSON."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
