"""Cost of one compute instruction.

A compute instruction is a chain of kernels (simexec.program.blocks): tensor-core GEMMs doing `flops` and
memory-bound kernels (norms, bias, activation, dropout, residual, softmax, copies) moving `bytes`.
They run one after the other on the device, each bound by its own resource, so for the FLOP-bound
op classes (gemm, attention)

    time = flops / (peak[dtype] * eff(op, flops)) + bytes / (memory_bw * memory_eff) + launch overhead,

with eff(f) = max_eff * f / (f + half_flops): small GEMMs run below peak. The saturating curve is the
usual one for GEMM efficiency against size (NVIDIA "GEMM performance" guide, fig. "tile
quantization" / "wave quantization"); a GEMM's own operand traffic is inside eff. Taking the max of
the two terms instead (one roofline over the whole chain) would hide the memory-bound kernels behind
the GEMMs, which they never overlap (validation against Megatron-LM, docs/validation.md).
Memory-bound classes (one streaming kernel) keep the roofline: max(flops / peak, bytes / bandwidth).
The two parameters per op class are what calibration fits. Everything hardware-specific comes from
`ClusterSpec` (Calculon's split: algorithms hold no constants).
"""
from __future__ import annotations

from simexec.specs.cluster import ClusterSpec

# Op classes whose time is set by their FLOPs (tensor cores); the rest are memory-bound.
FLOP_BOUND = ("gemm", "attention")
MEMORY_BOUND = ("elementwise", "embedding", "loss", "optimizer", "norm", "softmax")


class ComputeModel:
    """Seconds of one compute instruction on one device, cached by (op, flops, bytes)."""

    __slots__ = ("peak", "eff", "mem_bw", "launch", "contention", "cpu_rate", "_cache")

    def __init__(self, cluster: ClusterSpec, dtype: str):
        c, d = cluster.costs, cluster.device
        # fp8 training keeps bf16 for everything but the GEMMs; a dtype the device lacks falls back to fp32.
        self.peak = d.peak_flops.get(dtype) or d.peak_flops.get("fp32") or max(d.peak_flops.values())
        self.eff = {
            "gemm": (c.gemm_eff, c.gemm_half_flops),
            "attention": (c.attention_eff, c.attention_half_flops),
        }
        self.mem_bw = d.memory_bw * c.memory_eff
        self.launch = d.launch_overhead_s
        self.contention = c.compute_contention
        self.cpu_rate = cluster.node.cpu_optimizer_params_per_s
        self._cache: dict[tuple[str, float, float], float] = {}

    def efficiency(self, op: str, flops: float) -> float:
        """Fraction of peak reached by a kernel of `flops` FLOPs of class `op`."""
        max_eff, half = self.eff.get(op, self.eff["gemm"])
        return max_eff * flops / (flops + half)

    def time(self, op: str, flops: float, nbytes: float) -> float:
        """Seconds on an idle device (before overlap slowdown)."""
        key = (op, flops, nbytes)
        t = self._cache.get(key)
        if t is None:
            t = self._cache[key] = self._time(op, flops, nbytes)
        return t

    def _time(self, op: str, flops: float, nbytes: float) -> float:
        t_mem = nbytes / self.mem_bw
        if op in MEMORY_BOUND or flops <= 0:
            return (max(flops / self.peak, t_mem) + self.launch) * self.contention
        # gemm, attention, and any unknown op that carries FLOPs: GEMMs, then the memory-bound kernels
        t_flop = flops / (self.peak * self.efficiency(op, flops))
        return (t_flop + t_mem + self.launch) * self.contention

    def cpu_optimizer_params(self, flops: float, nbytes: float) -> float:
        """Parameters a `cpu_optimizer` step updates: its `flops` field, else bytes / 16 (Adam states)."""
        return flops if flops > 0 else nbytes / 16.0
