"""Cost of one compute instruction.

A compute instruction is a chain of kernels (simexec.program.blocks): tensor-core GEMMs doing `flops` and
memory-bound kernels (norms, bias, activation, dropout, residual, softmax, copies, FP8 casts) moving
`bytes`. They run one after the other on the device, each bound by its own resource, so for the
FLOP-bound op classes (gemm, attention)

    time = flops / (peak[dtype] * eff(op, flops)) + bytes / (memory_bw * memory_eff) + launch overhead,

with eff(f) = max_eff * f / (f + half_flops): small GEMMs run below peak. The saturating curve is the
usual one for GEMM efficiency against size (NVIDIA "GEMM performance" guide, fig. "tile
quantization" / "wave quantization"); a GEMM's own operand traffic is inside eff. Taking the max of
the two terms instead (one roofline over the whole chain) would hide the memory-bound kernels behind
the GEMMs, which they never overlap (validation against Megatron-LM, docs/validation.md).
Memory-bound classes (one streaming kernel) keep the roofline: max(flops / peak, bytes / bandwidth).

Which peak a class runs at follows the stacks' FP8 recipes (simexec.specs.stack): under `dtype=fp8`
the linear layers' GEMMs (`gemm`) run at the FP8 peak with the FP8 efficiency, while the LM head
(`gemm_bf16`) and fused attention stay at the bf16 peak. Fused attention has its own forward and
backward efficiencies. Everything hardware-specific comes from `ClusterSpec` (Calculon's split:
algorithms hold no constants).
"""
from __future__ import annotations

from typing import Optional

from simexec.specs.cluster import ClusterSpec, CostParams
from simexec.specs.kernel_tables import ATTENTION_KERNELS
from simexec.specs.stack import StackSpec

# Op classes whose time is set by their FLOPs (tensor cores); the rest are memory-bound.
FLOP_BOUND = ("gemm", "gemm_bf16", "attention")
MEMORY_BOUND = ("elementwise", "embedding", "loss", "optimizer", "norm", "softmax")
BACKWARD_PHASES = ("bwd", "wgrad")
# kernel names of the published tables that are the same code as a stack's kernel: torch SDPA's
# flash backend is FlashAttention-2
KERNEL_ALIASES = {"fa2": ("fa2", "torch-sdpa-flash"), "fa3": ("fa3",), "cudnn": ("cudnn",)}


def device_family(device_name: str) -> str:
    """The kernel tables' device key of a device (`H100-SXM5-80GB` -> `h100`)."""
    return device_name.split("-")[0].lower()


def attention_efficiency(costs: CostParams, device_name: str, kernel: Optional[str]
                         ) -> tuple[float, float, Optional[float]]:
    """(forward, backward, half_keys) of causal fused attention: the cluster's fields for the kernel they
    describe; for another kernel, its published micro-benchmark figures on this device where the tables
    have them (times their causal ratio: decoders train causal), else the cluster's fields."""
    own = (costs.attention_eff, costs.attention_bwd_eff or costs.attention_eff, costs.attention_half_keys)
    if kernel is None or kernel == costs.attention_kernel:
        return own
    family = device_family(device_name)
    for k in ATTENTION_KERNELS:
        if k.device == family and k.dtype == "bf16" and k.name in KERNEL_ALIASES.get(kernel, (kernel,)):
            return k.fwd_eff * k.causal_ratio, k.bwd_eff * k.causal_ratio, k.half_keys
    return own


class ComputeModel:
    """Seconds of one compute instruction on one device, cached by (op, flops, bytes, phase)."""

    __slots__ = ("peak", "peaks", "eff", "half_keys", "mem_bw", "launch", "contention", "cpu_rate", "_cache")

    def __init__(self, cluster: ClusterSpec, dtype: str, stack: Optional[StackSpec] = None):
        c, d = cluster.costs, cluster.device

        def peak_of(dt: str) -> float:  # a dtype the device lacks falls back to fp32
            return d.peak_flops.get(dt) or d.peak_flops.get("fp32") or max(d.peak_flops.values())

        self.peak = peak_of(dtype)
        high = "bf16" if dtype == "fp8" else dtype  # what an FP8 recipe leaves in higher precision
        fp8_attention = dtype == "fp8" and stack is not None and stack.fp8_attention
        self.peaks = {"gemm": self.peak, "gemm_bf16": peak_of(high),
                      "attention": self.peak if fp8_attention else peak_of(high)}
        gemm = (c.gemm_eff, c.gemm_half_flops)
        if dtype == "fp8" and c.fp8_gemm_eff is not None:
            gemm = (c.fp8_gemm_eff, c.gemm_half_flops if c.fp8_gemm_half_flops is None else c.fp8_gemm_half_flops)
        fwd, bwd, self.half_keys = attention_efficiency(c, d.name, stack.attention_kernel_on(d) if stack else None)
        self.eff = {
            "gemm": gemm,
            "gemm_bf16": (c.gemm_eff, c.gemm_half_flops),
            "attention": (fwd, c.attention_half_flops),
            "attention.bwd": (bwd, c.attention_half_flops),
        }
        self.mem_bw = d.memory_bw * c.memory_eff
        self.launch = d.launch_overhead_s
        self.contention = c.compute_contention
        self.cpu_rate = cluster.node.cpu_optimizer_params_per_s
        self._cache: dict[tuple[str, float, float, str, float, float], float] = {}

    def efficiency(self, op: str, flops: float, phase: str = "", keys: float = 0.0, groups: float = 0.0) -> float:
        """Fraction of peak reached by a kernel of `flops` FLOPs of class `op` in `phase`; a fused
        attention kernel whose queries attend to `keys` keys each, by keys where the cluster says how; a
        grouped GEMM of `groups` equal GEMMs (cutlass grouped GEMM, Transformer Engine's GroupedLinear:
        each expert's GEMM fills its own tiles and waves) at the efficiency of one of them."""
        key = op + ".bwd" if phase in BACKWARD_PHASES and op + ".bwd" in self.eff else op
        max_eff, half = self.eff.get(key, self.eff["gemm"])
        if keys > 0 and self.half_keys is not None and op == "attention":
            return max_eff * keys / (keys + self.half_keys)
        each = flops / groups if groups > 1 else flops
        return max_eff * each / (each + half)

    def time(self, op: str, flops: float, nbytes: float, phase: str = "", keys: float = 0.0,
             groups: float = 0.0) -> float:
        """Seconds on an idle device (before overlap slowdown)."""
        key = (op, flops, nbytes, phase, keys, groups)
        t = self._cache.get(key)
        if t is None:
            t = self._cache[key] = self._time(op, flops, nbytes, phase, keys, groups)
        return t

    def _time(self, op: str, flops: float, nbytes: float, phase: str, keys: float, groups: float) -> float:
        t_mem = nbytes / self.mem_bw
        peak = self.peaks.get(op, self.peak)
        if op in MEMORY_BOUND or flops <= 0:
            return (max(flops / peak, t_mem) + self.launch) * self.contention
        # gemm, attention, and any unknown op that carries FLOPs: GEMMs, then the memory-bound kernels
        t_flop = flops / (peak * self.efficiency(op, flops, phase, keys, groups))
        return (t_flop + t_mem + self.launch) * self.contention

    def cpu_optimizer_params(self, flops: float, nbytes: float) -> float:
        """Parameters a `cpu_optimizer` step updates: its `flops` field, else bytes / 16 (Adam states)."""
        return flops if flops > 0 else nbytes / 16.0
