"""Published kernel micro-benchmark efficiencies: large GEMMs per dtype, fused attention per kernel.

Why: a GEMM's and an attention kernel's fraction of peak depend on the kernel and its size, not on one
number per device. Attention runs at `peak[dtype] * eff_pass * L / (L + half_keys)`, times
`causal_ratio` under a causal mask, with L the mean keys each query attends to (seq for no mask,
(seq + 1) / 2 causal) and head dim 128. FLOPs are counted as the sources count them: forward
4 * b * h * d * (keys attended summed over queries) (causal halves it), backward 2.5x forward.
Fitted only to kernel micro-benchmarks; the fits and their residuals are in kernel_report.md.
GEMMs run at `peak[dtype] * max_eff * f / (f + half_flops)`; max_eff is the best-shape figure at the
boost clock (mamf-finder), before any derating for sustained clocks under a training load.
"""
from dataclasses import dataclass
from typing import Optional

FA3_PAPER = "Shah et al. 2024, FlashAttention-3, arXiv 2407.08608, Figs. 5-6 (H100 SXM5, b*s=16k, 2048 hidden)"
CUDNN_FE_H200 = ("NVIDIA/cudnn-frontend benchmark/sdpa_benchmark_training/results/h200_919_only_cudnn/"
                 "llama3.1_20260227_034703.csv (cuDNN 9.19, 64 q / 8 kv heads, b=1, s=2k-32k)")
CUDNN_FE_H200_2024 = ("NVIDIA/cudnn-frontend benchmark/benchmark_results.csv @7606332 (cuDNN 9.1 vs torch SDPA "
                      "flash, H200, 16 heads, s=4k-64k, clocks locked at 1980 MHz)")
CUDNN_FE_GB200 = ("NVIDIA/cudnn-frontend benchmark/sdpa_benchmark_training/results/llama3.1/gb200/"
                  "llama3.1_20260424_100750.csv (cuDNN 9.22, 64 q / 8 kv heads, b=2, s=2k-32k)")
CUDNN_FE_B200 = ("NVIDIA/cudnn-frontend benchmark/sdpa_benchmark_training/artifacts/"
                 "sdpa_bf16_benchmark_results_NVIDIA_B200.csv @b372d39 (causal, 128 q / 8 kv heads, b=1)")
MAMF = ("stas00/ml-engineering compute/accelerator/README.md, 'Maximum Achievable Matmul FLOPS comparison "
        "table' @744d01e (mamf-finder best shape, torch matmul)")


@dataclass(frozen=True)
class AttentionKernel:
    """One fused-attention kernel on one device: fraction of dense peak[dtype] per pass."""

    name: str  # "fa2", "fa3", "cudnn", "torch-sdpa-flash"
    device: str
    dtype: str
    fwd_eff: float  # forward fraction of peak at long sequences, no mask
    bwd_eff: float  # backward fraction of peak at long sequences, no mask
    half_keys: float  # keys per query at which half of fwd_eff / bwd_eff is reached
    causal_ratio: float  # efficiency under a causal mask relative to no mask at the same keys per query
    head_dim_ref: int
    source: str


@dataclass(frozen=True)
class GemmEfficiency:
    """Large-GEMM fraction of dense peak[dtype] and the size (FLOPs) at half of it."""

    device: str
    dtype: str
    max_eff: float
    half_flops: Optional[float]  # None: no published size sweep for this device
    source: str


ATTENTION_KERNELS: tuple[AttentionKernel, ...] = (
    # H100 SXM (989 bf16): FA3 paper figures, FA2/cuDNN/FA3 side by side; joint fit rms 4.2% / 5.6% / 3.7%.
    AttentionKernel(name="fa3", device="h100", dtype="bf16", fwd_eff=0.708, bwd_eff=0.565, half_keys=309,
                    causal_ratio=0.94, head_dim_ref=128, source=FA3_PAPER),
    AttentionKernel(name="cudnn", device="h100", dtype="bf16", fwd_eff=0.659, bwd_eff=0.504, half_keys=215,
                    causal_ratio=0.876, head_dim_ref=128, source=FA3_PAPER + " (cuDNN 9.x bars)"),
    AttentionKernel(name="fa2", device="h100", dtype="bf16", fwd_eff=0.399, bwd_eff=0.319, half_keys=196,
                    causal_ratio=0.883, head_dim_ref=128, source=FA3_PAPER + " (FlashAttention-2 bars)"),
    # H200 (989 bf16 / 1979 fp8 dense, same SMs as H100); rms 3.3% bf16, 0.7% fp8 (fp8 bwd: no-mask rows only,
    # the causal fp8 backward rows fall with length and are left out).
    AttentionKernel(name="cudnn", device="h200", dtype="bf16", fwd_eff=0.750, bwd_eff=0.622, half_keys=499,
                    causal_ratio=0.965, head_dim_ref=128, source=CUDNN_FE_H200),
    AttentionKernel(name="cudnn", device="h200", dtype="fp8", fwd_eff=0.553, bwd_eff=0.344, half_keys=551,
                    causal_ratio=0.988, head_dim_ref=128, source=CUDNN_FE_H200),
    # torch SDPA flash backend (FlashAttention-2 inside PyTorch) on H200; rms 3.0%. That run locked the SM clock
    # at 1980 MHz, above the 1830 MHz the 989 TFLOP/s peak is rated at (132 SMs x 4096 FLOP/clock): its fit
    # (0.377, 0.332) is scaled by 1830 / 1980 to the rated clock.
    AttentionKernel(name="torch-sdpa-flash", device="h200", dtype="bf16", fwd_eff=round(0.377 * 1830 / 1980, 3),
                    bwd_eff=round(0.332 * 1830 / 1980, 3),
                    half_keys=462, causal_ratio=0.955, head_dim_ref=128, source=CUDNN_FE_H200_2024),
    # GB200 (2500 bf16 / 5000 fp8 dense); rms 5.1% bf16, 5.8% fp8.
    AttentionKernel(name="cudnn", device="gb200", dtype="bf16", fwd_eff=0.707, bwd_eff=0.564, half_keys=498,
                    causal_ratio=0.974, head_dim_ref=128, source=CUDNN_FE_GB200),
    AttentionKernel(name="cudnn", device="gb200", dtype="fp8", fwd_eff=0.505, bwd_eff=0.366, half_keys=889,
                    causal_ratio=0.956, head_dim_ref=128, source=CUDNN_FE_GB200),
    # B200 (2250 bf16): torch SDPA flash = FA2 code, no Blackwell path; causal rows only (causal_ratio 1:
    # fwd_eff/bwd_eff are already causal figures); rms 8.0%.
    AttentionKernel(name="torch-sdpa-flash", device="b200", dtype="bf16", fwd_eff=0.194, bwd_eff=0.159,
                    half_keys=1007, causal_ratio=1.0, head_dim_ref=128, source=CUDNN_FE_B200),
)

GEMM_EFFICIENCIES: tuple[GemmEfficiency, ...] = (
    # A100 SXM: 271.2 of 312; half size from simexec.specs.cluster (_A100_COSTS: 1024^3 reaches ~2/3).
    GemmEfficiency(device="a100", dtype="bf16", max_eff=0.869, half_flops=1.0e9, source=MAMF),
    # H100 SXM: 794.5 of 989 bf16, 1402.6 of 1979 fp8; bf16 half size from simexec.specs.cluster (_H100_COSTS);
    # fp8 half size = bf16's x 1402.6 / 794.5 (same fixed per-kernel latency at a higher rate).
    GemmEfficiency(device="h100", dtype="bf16", max_eff=0.803, half_flops=2.0e9, source=MAMF),
    GemmEfficiency(device="h100", dtype="fp8", max_eff=0.709, half_flops=3.5e9, source=MAMF),
    # H200 SXM: bf16 "same as H100" (table note); fp8 1453.4 of 1979; fp8 half size = 2e9 x 1453.4 / 794.5.
    GemmEfficiency(device="h200", dtype="bf16", max_eff=0.803, half_flops=2.0e9, source=MAMF),
    GemmEfficiency(device="h200", dtype="fp8", max_eff=0.734, half_flops=3.7e9, source=MAMF),
    # B200 SXM: 1745 of 2250 bf16, 3432.5 of 4500 fp8.
    GemmEfficiency(device="b200", dtype="bf16", max_eff=0.776, half_flops=None, source=MAMF),
    GemmEfficiency(device="b200", dtype="fp8", max_eff=0.763, half_flops=None, source=MAMF),
    # MI300X: 668.4 of 1300 bf16 (PYTORCH_TUNABLEOP_ENABLED=1); fp8 row empty in the table.
    GemmEfficiency(device="mi300x", dtype="bf16", max_eff=0.514, half_flops=None, source=MAMF),
)
