"""Failures and checkpoints -> the wall-clock time a training run takes (torch-free).

A synchronous job stops at any rank's failure and restarts from its last durable checkpoint.

- Failure rate: Llama 3 405B's pre-training, 16,384 H100 80GB GPUs over a 54-day snapshot: 466
  interruptions, 47 planned (maintenance) and 419 unexpected, by cause in Table 5 of "The Llama 3
  Herd of Models" (Meta, arXiv:2407.21783, section 3.3.4; the table's counts as reported in
  https://direct.datacenterdynamics.com/en/news/meta-report-details-hundreds-of-gpu-and-hbm3-related-interruptions-to-llama-3-training-run
  and https://neosmart.ai/unforeseen-issues-metas-cluster-16384-gpus-failure-every-3-hours).
  Every cause is charged per GPU-hour (419 / (16,384 x 54 x 24) = 1.97e-5), so a job's mean time
  between failures is 1 / (rate x GPUs): failures of hosts, switches and software scale with the
  job's size too.
- Checkpoint: the model states (weights + Adam's fp32 master and moments) written once across the
  job (torch.distributed.checkpoint dedups replicas). Asynchronous saving (DCP `async_save`) blocks
  training only for the device-to-host copy of each rank's states over its PCIe link; the write to
  storage runs behind training, so the newest durable checkpoint lags by the write time, which a
  failure loses too. Synchronous saving blocks for copy and write.
- Storage write bandwidth per node: Llama 3's Tectonic file system sustains 2 TB/s (7 TB/s peak)
  for the 16K-GPU job (paper section 3.1.2), 2 TB/s / 2,048 nodes = 0.98 GB/s per node.
- Restart: detection, rescheduling, re-initialising NCCL and loading the checkpoint. Default 11
  minutes: the median automatic retry interval measured on a 63-node B200 production cluster
  ("Operational analysis of a 504-GPU B200 cluster", SKT/Upstage/Lablup/NVIDIA/VAST, 2025; median
  retry interval 11 min, IQR 10-11); plus reading the checkpoint back at the write bandwidth.
- Interval: Young (1974), "A first order approximation to the optimum checkpoint interval", CACM
  17(9): tau = sqrt(2 delta M); Daly (2006), "A higher order estimate of the optimum checkpoint
  interval for restart dumps", FGCS 22(3): tau = sqrt(2 delta M) [1 + (1/3) sqrt(delta / 2M) +
  (1/9) (delta / 2M)] - delta for delta < 2M, else M; and the expected wall time to do T_s of work,
  T_w = M e^{R/M} (e^{(tau + delta)/M} - 1) T_s / tau.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from simexec.errors import SpecError

HOUR = 3600.0
DAY = 86400.0
GB = 1e9

# "The Llama 3 Herd of Models", Table 5: root causes of the 419 unexpected interruptions in the
# 54-day snapshot of Llama 3 405B pre-training on 16,384 H100s.
LLAMA3_INTERRUPTIONS = {
    "faulty GPU": 148, "GPU HBM3 memory": 72, "software bug": 54, "network switch/cable": 35,
    "host maintenance": 32, "GPU SRAM memory": 19, "GPU system processor": 17, "NIC": 7,
    "NCCL watchdog timeouts": 7, "silent data corruption": 6, "GPU thermal interface + sensor": 6,
    "SSD": 3, "power supply": 3, "server chassis": 2, "IO expansion board": 2, "dependency": 2,
    "CPU": 2, "system memory": 2,
}
LLAMA3_GPUS = 16384
LLAMA3_DAYS = 54
LLAMA3_PLANNED = 47  # automated maintenance (firmware upgrades, operator config or dataset updates)
LLAMA3_GPU_HOURS = LLAMA3_GPUS * LLAMA3_DAYS * 24
FAILURES_PER_GPU_HOUR = {cause: n / LLAMA3_GPU_HOURS for cause, n in LLAMA3_INTERRUPTIONS.items()}

# Other fleets' measured interruption rates per GPU-hour, for `--failure-rate` (the default stays Llama 3's).
# OPT-175B on 1,024 A100 80GB (128 nodes, a public cloud, Nov 2021-Jan 2022): "~2 machines go down every
# day" (metaseq, projects/OPT/chronicles/final_update.md, commit f2cd36798793604cf51ab8b8a2cb167c964f9667).
OPT175B_GPUS = 1024
OPT175B_MACHINE_FAILURES_PER_DAY = 2
MEASURED_FAILURES_PER_GPU_HOUR = {
    "llama3-405b (16,384 H100, 2024)": sum(LLAMA3_INTERRUPTIONS.values()) / LLAMA3_GPU_HOURS,
    "opt-175b (1,024 A100, cloud, 2021)": OPT175B_MACHINE_FAILURES_PER_DAY / (OPT175B_GPUS * 24),
}

# Tectonic: 2 TB/s sustained for the 16K-GPU job (Llama 3 paper, section 3.1.2), per 8-GPU node.
STORAGE_WRITE_BW_PER_NODE = 2e12 / (LLAMA3_GPUS / 8)
RESTART_S = 11 * 60.0  # median automatic retry interval, 504-GPU B200 cluster report (2025)


def failure_rate_per_gpu_hour(causes: Optional[dict[str, float]] = None) -> float:
    return sum((causes or FAILURES_PER_GPU_HOUR).values())


def young_interval(delta_s: float, mtbf_s: float) -> float:
    """Young 1974: the checkpoint interval (seconds of work) that minimises lost time."""
    return math.sqrt(2.0 * delta_s * mtbf_s)


def daly_interval(delta_s: float, mtbf_s: float) -> float:
    """Daly 2006's higher-order optimum (eq. 37): Young's with corrections, M where delta >= 2M."""
    if delta_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = delta_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * delta_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - delta_s


def daly_wall_time(solve_s: float, tau_s: float, delta_s: float, mtbf_s: float, restart_s: float) -> float:
    """Daly 2006: expected wall time to do `solve_s` of work, checkpointing every `tau_s` of work
    (each blocking `delta_s`), failures exponential with mean `mtbf_s`, each costing `restart_s`."""
    m = mtbf_s
    return m * math.exp(restart_s / m) * math.expm1((tau_s + delta_s) / m) * solve_s / tau_s


def lost_per_failure(tau_s: float, delta_s: float, mtbf_s: float, restart_s: float) -> float:
    """What one failure costs in Daly's model: the wall time `daly_wall_time` adds over a failure-free
    run, divided by the expected failures (T_w / M): M - (tau + delta) / (e^{R/M} (e^{(tau + delta)/M} - 1)).
    For M much longer than an interval it is R + (tau + delta) / 2: the restart and, on average, half
    an interval of work redone."""
    x = (tau_s + delta_s) / mtbf_s
    return mtbf_s - (tau_s + delta_s) / (math.exp(restart_s / mtbf_s) * math.expm1(x))


@dataclass(frozen=True)
class GoodputParams:
    """The knobs of the failure and checkpoint model, each with its sourced default."""

    failures_per_gpu_hour: float = failure_rate_per_gpu_hour()
    storage_write_bw_per_node: float = STORAGE_WRITE_BW_PER_NODE  # bytes/s
    restart_s: float = RESTART_S
    async_checkpoint: bool = True

    def check(self) -> None:
        if not self.failures_per_gpu_hour >= 0:
            raise SpecError(f"failure rate must be >= 0 per GPU-hour, got {self.failures_per_gpu_hour}")
        if not self.storage_write_bw_per_node > 0:
            raise SpecError(f"storage write bandwidth must be > 0, got {self.storage_write_bw_per_node}")
        if not self.restart_s >= 0:
            raise SpecError(f"restart time must be >= 0 s, got {self.restart_s}")


@dataclass
class Checkpoint:
    """One checkpoint of a plan: what it writes and what it costs."""

    total_bytes: float  # written once across the job
    rank_bytes: float  # the largest rank's states copied device-to-host
    blocking_s: float  # training stops this long per checkpoint
    write_s: float  # storage write, all nodes in parallel
    load_s: float  # reading it back at restart


def checkpoint_cost(total_bytes: float, rank_bytes: float, nodes: int, pcie_bw: float,
                    params: GoodputParams) -> Checkpoint:
    copy_s = rank_bytes / pcie_bw if pcie_bw > 0 else 0.0
    write_s = total_bytes / (max(1, nodes) * params.storage_write_bw_per_node)
    blocking = copy_s if params.async_checkpoint else copy_s + write_s
    return Checkpoint(total_bytes, rank_bytes, blocking, write_s, write_s)


@dataclass
class Goodput:
    """Expected time to train `solve_s` seconds of step time on `gpus` GPUs, by where it goes."""

    gpus: int
    mtbf_s: float
    failures: float  # expected over the run
    checkpoint: Checkpoint
    interval_s: float  # work between checkpoints (Daly)
    young_interval_s: float
    restart_s: float  # per failure: restart + load (+ the async write's lag)
    solve_s: float
    wall_s: float
    checkpoint_s: float  # blocking time of all checkpoints
    failure_s: float  # lost work and restarts
    goodput: float  # solve_s / wall_s

    def to_json(self) -> dict:
        out = dict(self.__dict__)
        out["checkpoint"] = dict(self.checkpoint.__dict__)
        return out


def goodput(solve_s: float, gpus: int, ckpt: Checkpoint, params: GoodputParams = GoodputParams()) -> Goodput:
    """Daly's expected wall time with his optimal interval; the async write's lag joins the restart."""
    params.check()
    rate = params.failures_per_gpu_hour * gpus / HOUR  # failures per second of wall time
    restart = params.restart_s + ckpt.load_s + (ckpt.write_s if params.async_checkpoint else 0.0)
    if rate <= 0 or solve_s <= 0:
        ck = 0.0
        return Goodput(gpus, math.inf, 0.0, ckpt, math.inf, math.inf, restart, solve_s, solve_s, ck, 0.0, 1.0)
    m = 1.0 / rate
    delta = max(ckpt.blocking_s, 1e-9)
    tau = daly_interval(delta, m)
    if params.async_checkpoint:
        tau = max(tau, ckpt.write_s)  # the next save waits for the last one's write
    wall = daly_wall_time(solve_s, tau, ckpt.blocking_s, m, restart)
    ck = solve_s / tau * ckpt.blocking_s
    return Goodput(gpus, m, wall * rate, ckpt, tau, young_interval(delta, m), restart, solve_s, wall, ck,
                   wall - solve_s - ck, solve_s / wall)


@dataclass
class TimeToTrain:
    """Days to train `tokens`, by where the time goes."""

    tokens: float
    days: float
    breakdown_days: dict[str, float] = field(default_factory=dict)
    goodput: Optional[Goodput] = None

    def to_json(self) -> dict:
        return {"tokens": self.tokens, "days": self.days, "breakdown_days": self.breakdown_days,
                "goodput": self.goodput.to_json() if self.goodput else None}

    def format(self) -> str:
        lines = [f"  time to train   {self.tokens:.3g} tokens: {self.days:.1f} days"]
        for k, v in self.breakdown_days.items():
            lines.append(f"    {k:<26} {v:8.2f} days  {100 * v / self.days if self.days else 0:5.1f}%")
        g = self.goodput
        if g is not None:
            lines.append(f"    MTBF {g.mtbf_s / HOUR:.2f} h, {g.failures:.0f} failures expected; checkpoint "
                         f"{g.checkpoint.total_bytes / 1e12:.2f} TB every {g.interval_s / 60:.1f} min "
                         f"(blocks {g.checkpoint.blocking_s:.2f} s, writes {g.checkpoint.write_s:.1f} s); "
                         f"goodput {100 * g.goodput:.1f}%")
        return "\n".join(lines)


STEP_PARTS = {"compute": ("compute", "recompute", "optimizer"), "pipeline bubbles": ("pipeline_bubble",)}


def time_to_train(tokens: float, tokens_per_s: float, breakdown_s: dict[str, float], gpus: int, ckpt: Checkpoint,
                  params: GoodputParams = GoodputParams(), variation_slowdown: float = 1.0,
                  straggler_slowdown: float = 1.0) -> TimeToTrain:
    """Days to train: the step's parts scaled to the run, stragglers, variation, then failures and
    checkpoints. `straggler_slowdown` is the straggled step over the healthy one (`--slow`, a
    straggler for the whole run); variation multiplies on top of it (its median slowdown was
    measured without the stragglers: the two compound where they fall on different groups)."""
    if not tokens > 0:
        raise SpecError(f"--tokens must be > 0, got {tokens:g}")
    if not tokens_per_s > 0:
        raise SpecError("the step processes no tokens: no time to train")
    ideal = tokens / tokens_per_s
    step = sum(breakdown_s.values()) or 1.0
    parts: dict[str, float] = {}
    for name, keys in STEP_PARTS.items():
        parts[name] = ideal * sum(breakdown_s.get(k, 0.0) for k in keys) / step
    comm = sum(v for k, v in breakdown_s.items() if k.startswith("comm.") or k == "sync")
    parts["exposed communication"] = ideal * comm / step
    parts["other (idle, offload)"] = ideal - sum(parts.values())
    straggled = ideal * max(1.0, straggler_slowdown)
    if straggled != ideal:
        parts["stragglers"] = straggled - ideal
    solve = straggled * max(1.0, variation_slowdown)
    if solve != straggled:
        parts["GPU variation"] = solve - straggled
    g = goodput(solve, gpus, ckpt, params)
    parts["failures (lost + restart)"] = g.failure_s
    parts["checkpoints"] = g.checkpoint_s
    days = {k: v / DAY for k, v in parts.items() if abs(v) > 0}
    return TimeToTrain(tokens, g.wall_s / DAY, days, g)


def plan_checkpoint(rp, params: GoodputParams = GoodputParams()) -> Checkpoint:
    """A ResolvedPlan's checkpoint: the model's weights and optimizer states once
    (`ModelSpec.params` + MTP, at the plan's weight bytes + Adam's 12), the largest rank's
    `model_state_bytes` (params + optimizer) copied over its PCIe link."""
    p, c = rp.plan, rp.cluster
    w = rp.dtype_bytes if p.dtype != "fp8" else 2
    k = 12 if p.dtype != "fp32" else 8
    n = rp.model.params + rp.model.mtp_params
    per_rank = max(s["params"] + s["optimizer"]
                   for s in (rp.model_state_bytes(pp) for pp in range(p.pp)))
    pcie = c.node.host_link_bw * c.costs.host_link_eff
    nodes = max(1, -(-rp.world // (c.node.gpus_per_node or rp.world)))
    return checkpoint_cost(n * (w + k), per_rank, nodes, pcie, params)
