"""Roofline cost of compute instructions."""
import pytest

from simexec.specs.cluster import get_cluster
from simexec.sim.compute import ComputeModel

C = get_cluster("dgx-a100-80g")
M = ComputeModel(C, "bf16")
PEAK, BW, LAUNCH = 312e12, C.device.memory_bw * C.costs.memory_eff, C.device.launch_overhead_s


def test_large_gemm_runs_near_its_max_efficiency():
    f = 1e15
    eff = C.costs.gemm_eff * f / (f + C.costs.gemm_half_flops)
    assert M.time("gemm", f, 0.0) == pytest.approx(f / (PEAK * eff) + LAUNCH)


def test_small_gemm_runs_at_half_efficiency_at_half_flops():
    f = C.costs.gemm_half_flops
    assert M.efficiency("gemm", f) == pytest.approx(C.costs.gemm_eff / 2)


def test_gemm_block_adds_its_memory_bound_kernels():
    """A gemm-class instruction is GEMMs then memory-bound kernels (norm, bias, dropout, residual...):
    their times add. (Was a max(): one roofline over the chain hid those kernels behind the GEMMs and
    over-predicted Megatron-LM's throughput by 30-80%; see docs/validation.md.)"""
    f, b = 1e12, 1e10
    eff = C.costs.gemm_eff * f / (f + C.costs.gemm_half_flops)
    assert M.time("gemm", f, b) == pytest.approx(f / (PEAK * eff) + b / BW + LAUNCH)
    assert M.time("gemm", 1e6, 1e10) == pytest.approx(1e10 / BW + LAUNCH, rel=1e-3)  # bytes dominate


def test_elementwise_is_memory_bound():
    assert M.time("elementwise", 1e9, 4e9) == pytest.approx(4e9 / BW + LAUNCH)
    assert M.time("optimizer", 12e9, 28e9) == pytest.approx(28e9 / BW + LAUNCH)


def test_cpu_ranks_sharing_cores_slow_down():
    local = get_cluster("local")
    shared = local.model_copy(update={"costs": local.costs.model_copy(update={"compute_contention": 2.0})})
    assert ComputeModel(shared, "fp32").time("gemm", 1e9, 0.0) == pytest.approx(
        2 * ComputeModel(local, "fp32").time("gemm", 1e9, 0.0))
