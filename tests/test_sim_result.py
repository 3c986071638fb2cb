"""What `simulate` returns: derived figures, JSON, summary text, the predicted trace."""
import json

import pytest

from simexec.specs.model import get_model
from simexec.sim.simulate import simulate


@pytest.fixture(scope="module")
def result():
    return simulate("gpt3-1.3b", "2xdgx-a100-80g", "dp=4,tp=2,pp=2,gbs=16", trace=True)


def test_throughput_and_mfu_follow_from_the_step_time(result):
    m = get_model("gpt3-1.3b")
    tokens = 16 * 2048
    assert result.tokens_per_s == pytest.approx(tokens / result.step_time_s)
    flops = m.training_flops_per_token(2048) * tokens
    assert result.tflops_per_gpu == pytest.approx(flops / 16 / result.step_time_s / 1e12)
    assert result.mfu == pytest.approx(result.tflops_per_gpu * 1e12 / 312e12)


def test_per_rank_peaks_cover_every_real_rank(result):
    assert sorted(result.peak_memory_bytes_per_rank) == list(range(16))
    assert max(result.peak_memory_bytes_per_rank.values()) == result.peak_memory_bytes


def test_json_and_summary(result):
    data = json.loads(json.dumps(result.to_json()))
    assert data["step_time_s"] == result.step_time_s
    assert "trace" not in data
    text = result.format()
    assert "step time" in text and "peak memory" in text and "pipeline_bubble" in text


def test_trace_is_predicted_and_matches_the_program(result):
    t = result.trace
    assert t.kind == "predicted"
    assert t.meta["model"] == "gpt3-1.3b" and t.meta["cluster"] == "2xdgx-a100-80g"
    assert len(t.meta["program"]) == 16
    assert t.summary["step_time_s"] == result.step_time_s
    assert max(e.end_us for e in t.events) == pytest.approx(result.step_time_s * 1e6)
    assert len({e.id for e in t.events}) == len(t.events)
    peaks = t.peak_memory_per_rank()
    assert {0, 8} <= set(peaks)


def test_busy_compute_splits_by_kernel_and_precision():
    """The split of the slowest rank's busy compute adds up to its busy time; under FP8 the linear
    layers' GEMMs run at the FP8 rate, the LM head in bf16, and no class runs above its peak."""
    bf16 = simulate("llama3-8b", "dgx-h100", "tp=2,pp=2,gbs=8", seq_len=2048)
    fp8 = simulate("llama3-8b", "dgx-h100", "tp=2,pp=2,gbs=8,dtype=fp8", seq_len=2048)
    for res in (bf16, fp8):
        busy = sum(v for k, v in res.breakdown_s.items() if k in ("compute", "recompute", "optimizer"))
        assert sum(res.kernels_s.values()) == pytest.approx(busy, rel=1e-6)
    assert set(bf16.kernels_s) == {"attention", "gemm.bf16", "memory-bound"}
    assert {"gemm.fp8", "attention"} <= set(fp8.kernels_s)
    assert fp8.kernels_tflops["gemm.fp8"] > 1.2 * bf16.kernels_tflops["gemm.bf16"]
    assert fp8.kernels_tflops["gemm.fp8"] < 1979 and bf16.kernels_tflops["gemm.bf16"] < 989
    assert "busy by kernel: attention" in fp8.format()
