"""Cluster specs: device, node, network, and the cost parameters the simulator prices work with.

A cluster is data only. Every number in a preset is a datasheet figure or a published
micro-benchmark, cited beside it; the simulator's algorithms hold no constants of their own, and
calibration rewrites `CostParams` (see `simexec.sim.profile`), never code.
"""
from __future__ import annotations

import difflib
import json
import re
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from simexec.errors import SpecError

GB = 1e9
GiB = 1024**3


class _Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class DeviceSpec(_Spec):
    """One accelerator (or one CPU rank of the `local` cluster)."""

    name: str
    peak_flops: dict[str, float] = Field(description="dense peak FLOP/s per dtype: bf16, fp16, fp32, tf32, fp8, fp4")
    memory_bytes: float = Field(gt=0, description="device memory a process can allocate: the capacity CUDA reports"
                                " (torch.cuda.get_device_properties().total_memory), under the HBM's nominal size")
    memory_bw: float = Field(gt=0, description="device memory bandwidth, bytes/s")
    launch_overhead_s: float = Field(ge=0, description="fixed cost per kernel launch")
    nccl_arch: Optional[Literal["ampere", "hopper", "blackwell"]] = Field(
        None, description="the NVIDIA generation NCCL tunes its collectives for (simexec.sim.nccl_tuning); "
        "None: not NCCL (RCCL, gloo), collectives priced by plain alpha-beta candidates")
    fp8_gemm_any_layout: bool = Field(
        False, description="the FP8 tensor cores take operands in either layout (Blackwell, sm100; Transformer "
        "Engine's is_non_tn_fp8_gemm_supported, transformer_engine/pytorch/utils.py); False: TN only (Hopper, "
        "Ada), so an FP8 operand used transposed in the backward needs a transposed copy")
    compute_capability: Optional[tuple[int, int]] = Field(
        None, description="CUDA compute capability (major, minor), which frameworks read to pick kernels "
        "(torch.cuda.get_device_capability; `StackSpec.cudnn_attention_from`); None: not a CUDA device")
    sms: Optional[int] = Field(
        None, gt=0, description="streaming multiprocessors (cudaDeviceProp.multiProcessorCount): a transfer whose "
        "kernels hold some of them leaves compute the rest (`simexec.sim.overlap`); None: not known, the "
        "cluster then needs a uniform `costs.overlap_slowdown`")

    @field_validator("peak_flops")
    @classmethod
    def _peaks(cls, v: dict[str, float]) -> dict[str, float]:
        if not v:
            raise ValueError("needs at least one dtype, e.g. {bf16: 312e12}")
        bad = {k: x for k, x in v.items() if not x > 0 or x == float("inf")}
        if bad:
            raise ValueError(f"peak FLOP/s must be positive and finite, got {bad}")
        return v

    def supports(self, dtype: str) -> bool:
        return dtype in self.peak_flops


class NodeSpec(_Spec):
    """One host: its devices, the fabric between them and its link to host memory."""

    gpus_per_node: int = Field(ge=0, description="0: sized to the plan (the `local` cluster)")
    intra_bw: float = Field(gt=0, description="per-device unidirectional fabric bandwidth (NVLink), bytes/s")
    intra_latency_s: float = Field(ge=0, description="one-hop latency inside the node")
    host_link_bw: float = Field(gt=0, description="per-device host link (PCIe) bandwidth per direction, bytes/s")
    host_memory_bytes: float = Field(gt=0)
    cpu_cores: int = Field(gt=0, description="host cores (ranks of `local` share them)")
    cpu_optimizer_params_per_s: float = Field(gt=0, description="Adam steps per second on the host, whole node")
    nvlink_domain_gpus: int = Field(
        0, ge=0, description="consecutive ranks that share one NVLink fabric, a multiple of gpus_per_node (a GB200 "
        "NVL72 rack: 72 GPUs over 18 trays of 4); 0 = the node's GPUs. Ranks of one domain talk at `intra_bw`; "
        "host memory, CPU and NICs stay per node")
    intra_peer_bw: float = Field(
        0.0, ge=0, description="a fabric without a switch (a full mesh, e.g. MI300X Infinity Fabric): the one "
        "link between two devices, bytes/s per direction, so a group of k devices of a node reaches at most "
        "(k-1) of them; 0 = switched (NVSwitch): any group gets `intra_bw`")
    nvls: bool = Field(
        False, description="the NVLink switches reduce in the network (NVLink SHARP, NCCL's NVLS algorithms: "
        "third-generation NVSwitch on Hopper and Blackwell)")
    cpu_vendor: Literal["intel", "amd", "arm"] = Field(
        "intel", description="host CPU: NCCL's per-step network overhead and LL bandwidth cap depend on it")

    @model_validator(mode="after")
    def _domain(self) -> "NodeSpec":
        d, g = self.nvlink_domain_gpus, self.gpus_per_node
        if d and (g == 0 or d % g):
            raise ValueError(f"nvlink_domain_gpus {d} must be a multiple of gpus_per_node {g}")
        return self


class NetworkSpec(_Spec):
    """The network between nodes."""

    nics_per_node: int = Field(ge=0)
    nic_bw: float = Field(ge=0, description="per-NIC unidirectional bandwidth, bytes/s")
    latency_s: float = Field(ge=0, description="end-to-end latency between nodes")
    topology: Literal["fat-tree", "rail-optimized"] = "fat-tree"
    pod_nodes: int = Field(0, ge=0, description="nodes under full bisection; 0 = the whole cluster")
    oversubscription: float = Field(1.0, ge=1.0, description="bandwidth divisor for traffic leaving a pod")
    sharp: bool = Field(
        False, description="the InfiniBand switches reduce in the network (SHARP, e.g. Quantum-2 SHARPv3) and NCCL "
        "runs with its SHARP plugin and NCCL_COLLNET_ENABLE=1: all-reduce may take NCCL's CollNet algorithms, "
        "and NVLS across nodes where the node has NVLink SHARP")


class CostParams(_Spec):
    """Efficiency parameters of the cost model: what calibration fits.

    Compute runs at `peak * eff(op, size)`, with eff(size) = max_eff * f / (f + half_flops):
    small kernels run below peak. Links reach `peak_bw * bw_eff` (nccl-tests bus bandwidth).
    """

    gemm_eff: float = Field(gt=0, le=1, description="large-GEMM fraction of peak")
    gemm_half_flops: float = Field(ge=0, description="GEMM size (FLOPs) at which half of gemm_eff is reached")
    attention_eff: float = Field(gt=0, le=1, description="fused attention fraction of peak")
    attention_half_flops: float = Field(ge=0)
    attention_bwd_eff: Optional[float] = Field(
        None, gt=0, le=1, description="fused attention backward fraction of peak, its FLOPs counted as 2.5x the "
        "forward's (FlashAttention's convention); None = attention_eff")
    attention_half_keys: Optional[float] = Field(
        None, gt=0, description="keys per query at which a fused attention kernel reaches half its efficiency "
        "(the inner loop amortising the prologue and epilogue); set, it replaces attention_half_flops' size curve")
    attention_kernel: str = Field(
        "", description="the fused attention kernel the attention_* fields describe (cudnn, fa2, fa3); a stack "
        "running another kernel takes that kernel's published efficiencies (simexec.specs.kernel_tables)")
    fp8_gemm_eff: Optional[float] = Field(
        None, gt=0, le=1, description="large FP8 GEMM fraction of the FP8 peak; None = gemm_eff")
    fp8_gemm_half_flops: Optional[float] = Field(
        None, ge=0, description="FP8 GEMM size (FLOPs) at which half of fp8_gemm_eff is reached; None = gemm_half_flops")
    memory_eff: float = Field(gt=0, le=1, description="fraction of memory bandwidth for element-wise kernels")
    intra_bw_eff: float = Field(gt=0, le=1, description="intra-node bus-bandwidth efficiency (nccl-tests)")
    inter_bw_eff: float = Field(gt=0, le=1, description="inter-node bus-bandwidth efficiency (nccl-tests)")
    host_link_eff: float = Field(gt=0, le=1, description="achieved fraction of PCIe bandwidth for pinned copies")
    collective_latency_s: float = Field(ge=0, description="fixed software cost per collective call")
    overlap_slowdown: Optional[float] = Field(
        None, ge=1.0, description="uniform compute slowdown while any transfer of the rank is in flight (CPU"
        " ranks, devices without `sms`); None: charged per kind of transfer by the SMs its kernels hold"
        " (`nccl_channels`, `deepep_sms`, `userbuffers_sms`; copy-engine copies none: `simexec.sim.overlap`)")
    nccl_channels: int = Field(
        16, gt=0, description="SMs an NCCL collective or send/recv holds while in flight: one CTA per channel")
    nccl_p2p_channels: int = Field(
        4, gt=0, description="SMs an NCCL send/recv between two ranks holds: the channels per peer NCCL gives"
        " a peer across the network (one per NIC, or a channel per 14 GB/s of NIC bandwidth)")
    deepep_sms: int = Field(20, gt=0, description="SMs DeepEP's dispatch and combine kernels hold (Buffer.num_sms)")
    userbuffers_sms: int = Field(
        16, ge=0, description="SMs Transformer Engine's userbuffers reduce-scatters and bulk all-gathers hold"
        " under tp_async (num_sm; the GEMM beside them runs on the rest, set_sm_margin)")
    compute_contention: float = Field(
        1.0, ge=1.0, description="ranks per core-set sharing compute (CPU ranks on shared cores); 1 on GPUs"
    )
    collective_threads: int = Field(
        1, ge=1, description="collectives of one process group in flight at once: NCCL runs a communicator's "
        "on one stream (1); gloo hands a group's async collectives to 2 worker threads (ProcessGroupGloo's default)")
    workspace_bytes: float = Field(ge=0, description="runtime context + library workspaces per device")
    allocator_overhead: float = Field(ge=0, description="caching-allocator fragmentation, fraction of dynamic bytes")
    # --- CPU ranks sharing one host's cores (the `local` cluster; simexec.sim.host.model). Off unless
    # `cores_shared`, so GPU clusters and the uncalibrated `local` preset are priced as before. ---
    cores_shared: bool = Field(
        False, description="ranks are CPU processes time-sharing node.cpu_cores cores (simexec.sim.host.model)")
    instr_overhead_s: float = Field(0.0, ge=0, description="CPU ranks: interpreter cost per instruction")
    bwd_overhead_s: float = Field(0.0, ge=0, description="CPU ranks: autograd set-up per backward instruction")
    nograd_fwd_ratio: float = Field(
        1.0, gt=0, le=2, description="CPU ranks: cost of a forward instruction run without autograd (a "
        "recomputed layer's first forward: no graph recorded, nothing saved) relative to the same with it")
    sched_slice_s: float = Field(0.0, ge=0, description="CPU ranks: OS scheduler time slice; 0 = processor sharing")
    cpu_scheduler: Literal["sharing", "slices"] = Field(
        "sharing", description="CPU ranks: how the cores are shared (simexec.sim.host.cores): `sharing`, a mean-field "
        "processor sharing; `slices`, threads run whole slices of `sched_slice_s` in turn, as the OS does")
    background_load: float = Field(0.0, ge=0, description="CPU ranks: other runnable threads on the host when measured")
    timeslice_contention: float = Field(
        1.0, ge=1.0, description="CPU ranks: slowdown of a core that alternates between threads (twice as many "
        "runnable as cores): context switches, and each thread's caches refilled when it is switched back in")
    idle_wake_s: float = Field(
        0.0, ge=0, description="CPU ranks: waking a thread on a core idle past the hypervisor's poll window "
        "(a halted vCPU the host must run again); 0 = bare metal")
    comm_cpu_s: float = Field(
        0.0, ge=0, description="CPU ranks: CPU a member spends per step of a collective or message besides "
        "copying its bytes (gloo's thread hand-offs and wake-ups, socket syscalls); 0 = one dispatched operator")
    collective_issue_s: float = Field(
        0.0, ge=0, description="CPU ranks: CPU the calling thread spends in a collective's call (torch.distributed's "
        "Python, the backend's work set up and queued), part of collective_latency_s; 0 = none on the thread")
    gloo_loops_idle: bool = Field(
        False, description="CPU ranks: gloo's TCP event loops run at Linux's SCHED_IDLE (the executor's default, "
        "simexec.exec.runtime.gloo_loops): the bytes they move get only the cores no other thread wants")
    idle_poll_s: float = Field(
        200e-6, gt=0, description="CPU ranks: how long a hypervisor polls a halted vCPU before it gives the "
        "physical core away (KVM's halt_poll_ns default)")
    host_dispatch_s: float = Field(
        0.0, ge=0, description="accelerators: the host thread's CPU time per operator it dispatches (eager "
        "PyTorch, simexec.sim.host.model.dispatch_clock); 0 = the host stays ahead of the device (fused kernels, graphs)")
    elementwise_cost: dict[str, float] = Field(
        default_factory=dict,
        description="CPU ranks: per `<phase>.<block>`, what a byte of the block's element-wise traffic costs "
                    "relative to a streaming add (GELU's tanh, softmax's exp and normalisation are compute-bound "
                    "on a CPU core); `<family>/<phase>.<block>` (simexec.sim.host.operators.cost_family) for the "
                    "models of one family, ahead of the plain key; absent = 1")


class ClusterSpec(_Spec):
    """`nodes` identical nodes joined by one network."""

    name: str
    nodes: int = Field(gt=0)
    device: DeviceSpec
    node: NodeSpec
    network: NetworkSpec
    costs: CostParams
    source: str = ""

    @model_validator(mode="after")
    def _check(self) -> "ClusterSpec":
        if self.nodes > 1 and self.node.gpus_per_node == 0:
            raise ValueError(f"nodes={self.nodes}: a cluster sized to the plan (node.gpus_per_node 0) is one host")
        if self.nodes > 1 and (self.network.nics_per_node == 0 or self.network.nic_bw == 0):
            raise ValueError(
                f"nodes={self.nodes} needs a network: network.nics_per_node and network.nic_bw must be positive,"
                f" got {self.network.nics_per_node} and {self.network.nic_bw:g}"
            )
        if self.costs.overlap_slowdown is None and self.device.sms is None:
            raise ValueError("costs.overlap_slowdown is unset and device.sms is unknown: give one of them, e.g."
                             " device.sms: 132 or costs.overlap_slowdown: 1.05")
        return self

    @property
    def sized_to_plan(self) -> bool:
        return self.node.gpus_per_node == 0

    @property
    def world_size(self) -> int:
        return self.nodes * self.node.gpus_per_node

    def with_world_size(self, world: int) -> "ClusterSpec":
        """The `local` cluster takes as many ranks as the plan asks for, on one node."""
        if not self.sized_to_plan:
            return self
        return self.model_copy(update={"node": self.node.model_copy(update={"gpus_per_node": world})})

    def node_of(self, rank: int) -> int:
        return rank // self.node.gpus_per_node

    @property
    def nvlink_domain(self) -> int:
        """Consecutive ranks on one NVLink fabric: the node's GPUs unless `node.nvlink_domain_gpus` says more."""
        return self.node.nvlink_domain_gpus or self.node.gpus_per_node

    def domain_of(self, rank: int) -> int:
        return rank // self.nvlink_domain


# --- presets ------------------------------------------------------------------------------------
# Efficiency defaults, shared by every GPU preset of a generation:
# - GEMM on A100: the best bf16 matmul shape reaches 271 of 312 TFLOP/s (0.87, at boost clock:
#   S. Bekman, ml-engineering "Maximum Achievable Matmul FLOPS" table, mamf-finder); under a
#   training load the A100 holds ~1305 of its 1410 MHz at its 400 W cap (the clock NVIDIA rates
#   A100 Rpeak at for HPL: 0.926), and the GEMMs of a training step are not the best shape (tile
#   and wave quantization, ~0.93: NVIDIA "Matrix Multiplication Background" guide; Anthony et al.
#   2024, "The Case for Co-Designing Model Architectures with Hardware"): 0.87 x 0.926 x 0.93 ~ 0.75
#   of peak for a large GEMM in steady state. (0.82, the boost-clock best-shape figure, made
#   Megatron-LM's large models ~10% too fast; docs/validation.md.) Half efficiency near 1 GFLOP:
#   a 1024^3 GEMM (2.1 GFLOP) reaches ~2/3 of that.
# - Attention: FlashAttention-2 forward reaches ~70% of A100 peak, backward ~55% (Dao 2023, Fig. 4);
#   we take their mean.
# - Memory-bound kernels reach ~85% of HBM bandwidth (STREAM-like copy on A100/H100).
# - NVLink all-reduce bus bandwidth ~230 GB/s of 300 on DGX A100 and ~370 of 450 on DGX H100
#   (nccl-tests all_reduce_perf, 8 GPUs, 1 GiB messages) -> ~0.78-0.82.
# - InfiniBand: ~90% of line rate (nccl-tests busbw across nodes, ~23 GB/s per HDR 200 Gb/s NIC).
# - PCIe pinned copies ~80% of link rate (cudaMemcpy bandwidthTest).
# - Compute beside communication: charged per kind of transfer by the SMs its kernels hold
#   (`simexec.sim.overlap`; docs/validation.md, finding 9). NCCL runs one CTA per channel, each on
#   an SM of its own (src/device/common.h, ncclKernelMain: blockIdx.x picks the channel); its logs
#   show 16 collective channels on 8-GPU H800 and multi-node H100 systems (NVIDIA/nccl issues #892,
#   #1453): `nccl_channels` 16. A send/recv (pipeline messages) runs on the channels NCCL gives one
#   peer: across the network max(NICs, ceil(NIC GB/s / 14)) = 4 for one 400 Gb/s NIC per GPU, a power
#   of two (NVIDIA/nccl@5067397c src/graph/paths.cc, ncclTopoGetNchannels and
#   ncclTopoComputeP2pChannels; NCCL_P2P_PER_CHANNEL_NET_BW 14): `nccl_p2p_channels` 4 (NVLink
#   peers get more, 2 per NVLink's bandwidth, not priced). DeepEP's kernels take Buffer.num_sms = 20 SMs
#   (deepseek-ai/DeepEP@b306af0^ deep_ep/buffer.py; Megatron-Core's moe_deepep_num_sms leaves it
#   unset by default). Transformer Engine's userbuffers (tp_async): all-gathers by ring_exchange
#   over the copy engines (use_ce, num_sm 1, no SM margin), reduce-scatters (pipeline) and bulk
#   overlaps on num_sm = 16 SMs with the GEMM on the rest (set_sm_margin) (NVIDIA/TransformerEngine
#   @d0067d0 transformer_engine/pytorch/module/base.py, get_default_config; MLPerf v3.1 GPT-3 on
#   Eos: 16 and 24 for the pipelined reduce-scatters, 4-16 for the bulk ones,
#   mlcommons/training_results_v3.1@d06288b NVIDIA/benchmarks/gpt3/implementations/pytorch/conf/
#   tp_overlap/h100tp8pp8mbs2.yaml). Host copies run on the copy engines and hold none.
_A100_COSTS = CostParams(
    gemm_eff=0.75, gemm_half_flops=1.0e9, attention_eff=0.62, attention_half_flops=1.0e9,
    memory_eff=0.85, intra_bw_eff=0.78, inter_bw_eff=0.90, host_link_eff=0.80,
    collective_latency_s=10e-6, workspace_bytes=2.0 * GiB, allocator_overhead=0.05,
)
# H100: cuBLAS bf16 large GEMMs reach ~700-750 of 989 TFLOP/s (~0.72); NVLink4 busbw ~370/450.
# - GEMM shapes of a training step against the best shape: 0.72 of the best shape's 0.803 (794.5 of
#   989 TFLOP/s, mamf-finder: docs/kernel_efficiency.md) is 0.897. Devices without a published
#   training-shape figure (FP8 on Hopper, Blackwell, MI300X) take their best-shape figure times this
#   same ratio (`TRAINING_SHAPES`). FP8: 1402.6 of 1979 best shape (0.709) -> 0.636; half efficiency
#   at 3.5 GFLOP (the bf16 curve's fixed per-kernel time at the FP8 rate).
# - Fused attention as Transformer Engine runs it on Hopper (cuDNN; `simexec.specs.stack`): forward
#   0.659 and backward 0.504 of peak at long sequences, 0.876 of that under a causal mask, half of it
#   at 215 keys per query (cuDNN bars of the FlashAttention-3 paper, Shah et al. 2024, Figs. 5-6;
#   the fit in docs/kernel_efficiency.md). Other kernels: simexec.specs.kernel_tables.
TRAINING_SHAPES = 0.72 / 0.803
_H100_COSTS = CostParams(
    gemm_eff=0.72, gemm_half_flops=2.0e9, fp8_gemm_eff=round(0.709 * TRAINING_SHAPES, 3), fp8_gemm_half_flops=3.5e9,
    attention_eff=round(0.659 * 0.876, 3), attention_bwd_eff=round(0.504 * 0.876, 3), attention_half_flops=2.0e9,
    attention_half_keys=215, attention_kernel="cudnn",
    memory_eff=0.85, intra_bw_eff=0.82, inter_bw_eff=0.90, host_link_eff=0.80,
    collective_latency_s=10e-6, workspace_bytes=2.0 * GiB, allocator_overhead=0.05,
)
# H200: the H100's SMs and clocks. FP8 GEMM 1453.4 of 1979 best shape (mamf-finder) -> 0.658, half at
# 3.7 GFLOP; cuDNN 9.19 attention forward 0.750, backward 0.622, causal 0.965, half at 499 keys
# (NVIDIA/cudnn-frontend benchmark/sdpa_benchmark_training results on H200: docs/kernel_efficiency.md).
_H200_COSTS = _H100_COSTS.model_copy(update=dict(
    fp8_gemm_eff=round(0.734 * TRAINING_SHAPES, 3), fp8_gemm_half_flops=3.7e9,
    attention_eff=round(0.750 * 0.965, 3), attention_bwd_eff=round(0.622 * 0.965, 3), attention_half_keys=499,
))

_A100 = dict(
    # NVIDIA A100 Tensor Core GPU datasheet: 312 TFLOP/s bf16/fp16 dense, 19.5 fp32, 156 tf32.
    peak_flops={"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12, "tf32": 156e12},
    launch_overhead_s=4e-6,
    nccl_arch="ampere",  # SM80: NCCL's Ampere tuning row (src/graph/tuning.cc, compCapIndex)
    compute_capability=(8, 0),
    sms=108,  # A100 datasheet / whitepaper: 108 SMs
)
_DGX_A100_NODE = dict(
    # DGX A100 user guide: 8 GPUs, NVLink3 600 GB/s bidirectional per GPU over NVSwitch,
    # PCIe Gen4 x16 (32 GB/s per direction), 2x AMD EPYC 7742 (128 cores).
    gpus_per_node=8, intra_bw=300 * GB, intra_latency_s=3e-6, host_link_bw=32 * GB,
    cpu_cores=128, cpu_vendor="amd",
    # ZeRO-Offload (Ren et al. 2021) CPU-Adam: ~1B params in ~0.25 s on a dual-socket host.
    cpu_optimizer_params_per_s=4e9,
)
_HDR_IB = dict(nics_per_node=8, nic_bw=25 * GB, latency_s=5e-6)  # 8x ConnectX-6 HDR 200 Gb/s
_NDR_IB = dict(nics_per_node=8, nic_bw=50 * GB, latency_s=5e-6)  # 8x ConnectX-7 NDR 400 Gb/s

_H100 = dict(
    # NVIDIA H100 SXM5 datasheet: 989 TFLOP/s bf16 dense, 1979 fp8, 67 fp32, 494 tf32; 80 GB HBM3
    # at 3.35 TB/s.
    peak_flops={"bf16": 989e12, "fp16": 989e12, "fp32": 67e12, "tf32": 494e12, "fp8": 1979e12},
    launch_overhead_s=4e-6,
    nccl_arch="hopper",  # SM90 (src/graph/tuning.cc, compCapIndex)
    compute_capability=(9, 0),
    sms=132,  # H100 SXM5 (H200 the same die): 132 SMs (NVIDIA H100 Tensor Core GPU architecture whitepaper)
)
# Device memory as CUDA gives it to a process (total_memory), a little under the HBM's nominal size;
# the runtime's context, cuBLAS and NCCL then take their share of it (`workspace_bytes`).
# - H100 SXM5 80GB HBM3: 79.18 GiB; H200: 139.80 GiB (scripts/device_memory.py on one of each, torch
#   2.11 + CUDA 13.0, driver 580; traces/gpu/device_memory.json). The H200's "141 GB" is 141 GiB of HBM.
# - A100 SXM4 80GB: 79.25 GiB; 40GB: 39.59 GiB (PyTorch's out-of-memory reports, "GPU 0; 79.25 GiB
#   total capacity" and "39.59 GiB total capacity", in public issue threads).
_A100_40G_CUDA_BYTES = 39.59 * GiB
_A100_80G_CUDA_BYTES = 79.25 * GiB
_H100_CUDA_BYTES = 85_017_493_504  # 79.18 GiB
_H200_CUDA_BYTES = 150_109_880_320  # 139.80 GiB
_HOPPER_NODE = dict(
    # DGX H100 / HGX H100-H200: NVLink4 900 GB/s bidirectional per GPU, PCIe Gen5 x16 (64 GB/s),
    # 2x Xeon 8480C (112 cores), 2 TB host memory. Third-generation NVSwitch reduces in the switch
    # (NVLink SHARP: DGX H100 user guide; NCCL runs it as NVLS, src/transport/nvls.cc).
    gpus_per_node=8, intra_bw=450 * GB, intra_latency_s=3e-6, host_link_bw=64 * GB,
    host_memory_bytes=2e12, cpu_cores=112, cpu_optimizer_params_per_s=5e9, nvls=True, cpu_vendor="intel",
)

# --- Blackwell: HGX B200 and the GB200 NVL72 rack ---
# Peaks are the dense (no 2:4 sparsity) halves of NVIDIA's tensor-core figures, which NVIDIA prints with
# sparsity: NVIDIA Blackwell datasheet / HGX B200 page (https://www.nvidia.com/en-us/data-center/hgx/),
# per B200 of HGX B200 at 1000 W: 4.5 PFLOP/s bf16/fp16, 9 fp8, 18 fp4, 2.2 tf32 (sparse); 75 TFLOP/s fp32.
# GB200 NVL72 datasheet (https://www.nvidia.com/en-us/data-center/gb200-nvl72/), rack totals / 72 at
# 1200 W: 360 PFLOP/s bf16 -> 5 per GPU, 720 fp8 -> 10, 1440 fp4 -> 20, 180 tf32 -> 2.5 (sparse);
# 5760 TFLOP/s fp32 -> 80. The same dense figures per GPU: S. Bekman, ml-engineering
# compute/accelerator/README.md "TFLOPS comparison table" (B200 2250 bf16, GB200 2500).
_B200 = dict(
    peak_flops={"bf16": 2250e12, "fp16": 2250e12, "fp8": 4500e12, "fp4": 9000e12, "tf32": 1100e12, "fp32": 75e12},
    launch_overhead_s=4e-6,  # not measured on Blackwell: the Hopper presets' value
    nccl_arch="blackwell",  # SM100 (src/graph/tuning.cc, compCapIndex)
    compute_capability=(10, 0),
    fp8_gemm_any_layout=True,  # sm100: (10, 0) <= capability < (12, 0) (TE utils.is_non_tn_fp8_gemm_supported)
    sms=148,  # B200: 148 SMs (multiProcessorCount), two dies
)
_GB200 = dict(
    peak_flops={"bf16": 2500e12, "fp16": 2500e12, "fp8": 5000e12, "fp4": 10000e12, "tf32": 1250e12, "fp32": 80e12},
    launch_overhead_s=4e-6,  # as _B200
    nccl_arch="blackwell",
    compute_capability=(10, 0),
    fp8_gemm_any_layout=True,  # as _B200 (GB200's B200 is sm100 as well)
    sms=148,  # as _B200, per GPU
)
# Device memory as CUDA reports it: B200 178.35 GiB (cudaDeviceProp.totalGlobalMem in pytorch/ao PR #4002,
# and "GPU 0 has a total capacity of 178.35 GiB" in public out-of-memory reports; nvidia-smi shows
# 183359 MiB); GB200 184.31 GiB ("total capacity of 184.31 GiB" in public out-of-memory reports on GB200;
# nvidia-smi 189471 MiB). Both under the datasheets' 180 GB (HGX B200) and 186 GB (GB200) of HBM3e.
_B200_CUDA_BYTES = 178.35 * GiB
_GB200_CUDA_BYTES = 184.31 * GiB
# HBM bandwidth: HGX B200 7.7 TB/s per GPU (Blackwell datasheet; 62 TB/s per board; pytorch/ao PR #4002
# derives 7.67 TB/s from the 7680-bit bus at 3996 MHz, where early material said 8 TB/s);
# GB200 8 TB/s (576 TB/s per rack / 72).
# Efficiencies, per field (the Hopper figures where Blackwell has no published one, said so):
# - GEMM: the best bf16 matmul shape reaches 1745 of 2250 TFLOP/s on B200 (0.776) and 1822 of 2500 on
#   GB200 (0.729): S. Bekman, ml-engineering "Maximum Achievable Matmul FLOPS comparison table"
#   (mamf-finder), times H100's training-shape ratio (`TRAINING_SHAPES`) and the sustained clock under
#   Blackwell's power cap (below). Half efficiency at 2 GFLOP: the H100's.
# - Attention: cuDNN's fused attention on GB200 (below), times the sustained clock.
# - NVLink 5 all-reduce bus bandwidth 835-847 GB/s of 900 across a full GB200 NVL72 rack (nccl-tests
#   all_reduce_perf, 72 GPUs, 4-8 GiB; coreweave/nccl-tests PR #43) -> 0.93; the HGX B200 board has
#   the same per-GPU NVLink 5 port and NVSwitch generation, so the same figure.
# - InfiniBand: both use ConnectX-7 NDR 400 Gb/s, as DGX H100 does: its 0.90.
# - Memory-bound kernels: the H100 generation's 0.85, which B200 reaches: CUB's DeviceTransform (relu, 2^28
#   fp16 elements) moves 6.553 TB/s, 0.854 of 7.67 (NVIDIA/cccl PR #7391; 0.47 at 2^24 elements, where
#   launch and tail dominate). PCIe, latencies, workspace: the H100 generation's.
# - Clocks under the power cap (`BLACKWELL_SUSTAINED_CLOCK`, on every tensor-core efficiency above). The
#   figures above are short bursts at the maximum SM clock: per clock, mamf-finder's best bf16 shapes are
#   0.733 of B200's tensor cores at 1965 MHz (1745 / (148 SMs x 8192 FLOP/clk x 1.965 GHz)), 0.729 of
#   GB200's at 2062 MHz (1822 / 2500: GB200's datasheet peak is 148 x 8192 x 2.062 GHz) and 0.742 of
#   H100's at 1980 MHz (794.5 / (132 x 4096 x 1.98 GHz)); max clocks: nvidia-smi 1965 MHz on B200
#   (flashinfer-ai/flashinfer PR #2899), 1965 / 2062 (ByteDance-Seed/VeOmni PR #986). A training step holds
#   the tensor cores busy for seconds: under back-to-back tensor-core kernels a B200 at its 1000 W cap
#   falls from 1965 to ~1580 MHz (0.804) within ~100 ms, FA4 attention from 1450 to 1237 TFLOP/s
#   (flashinfer PR #2899, "fix GPU power throttling in benchmark utilities"). The H100 presets' GEMMs
#   carry H100's own fall through `TRAINING_SHAPES` (0.897, training-shape GEMMs against the burst best
#   shape), taken here as all clock (no shape loss): the smallest Blackwell derating the sources allow,
#   0.804 / 0.897, relative to the validated H100 reference. GB200 (1200 W, liquid-cooled) has no
#   published sustained clock: B200's fraction, said so.
BLACKWELL_SUSTAINED_CLOCK = round((1580 / 1965) / TRAINING_SHAPES, 3)
_BLACKWELL_COSTS = dict(
    attention_half_flops=2.0e9,
    # cuDNN attention on GB200 (cuDNN 9.22): forward 0.707, backward 0.564, causal 0.974, half at 498 keys
    # (NVIDIA/cudnn-frontend sdpa_benchmark_training results: docs/kernel_efficiency.md); B200 is the same
    # chip, so the same fractions of its own peak
    attention_eff=round(0.707 * 0.974 * BLACKWELL_SUSTAINED_CLOCK, 3),
    attention_bwd_eff=round(0.564 * 0.974 * BLACKWELL_SUSTAINED_CLOCK, 3), attention_half_keys=498,
    attention_kernel="cudnn",
    memory_eff=0.85, intra_bw_eff=0.93, inter_bw_eff=0.90, host_link_eff=0.80,
    collective_latency_s=10e-6, workspace_bytes=2.0 * GiB, allocator_overhead=0.05,
)
# GEMMs: the best-shape figures (mamf-finder: B200 bf16 1745.0 of 2250, fp8 3432.5 of 4500; GB200 bf16
# 1822.0 of 2500, fp8 3615.6 of 5000) times the training-shape ratio measured on H100 (`TRAINING_SHAPES`)
# and the sustained-clock fraction (`BLACKWELL_SUSTAINED_CLOCK`).
# Half-efficiency sizes: no size sweep is published for Blackwell, so each GEMM kind keeps H100's fixed
# per-kernel time (`GEMM_FIXED_S`) at its own best-shape rate, the rule the Hopper FP8 figures follow.
GEMM_FIXED_S = 2.0e9 / 794.5e12  # H100 bf16: half efficiency at 2 GFLOP, best shape 794.5 TFLOP/s


def half_flops_at(best_rate: float) -> float:
    """The GEMM size at which a kernel with H100's fixed per-kernel time reaches half its efficiency."""
    return round(GEMM_FIXED_S * best_rate, -8)


_B200_COSTS = CostParams(gemm_eff=round(0.776 * TRAINING_SHAPES * BLACKWELL_SUSTAINED_CLOCK, 3),
                         gemm_half_flops=half_flops_at(1745.0e12),
                         fp8_gemm_eff=round(0.763 * TRAINING_SHAPES * BLACKWELL_SUSTAINED_CLOCK, 3),
                         fp8_gemm_half_flops=half_flops_at(3432.5e12), **_BLACKWELL_COSTS)
_GB200_COSTS = CostParams(gemm_eff=round(0.729 * TRAINING_SHAPES * BLACKWELL_SUSTAINED_CLOCK, 3),
                          gemm_half_flops=half_flops_at(1822.0e12),
                          fp8_gemm_eff=round(0.723 * TRAINING_SHAPES * BLACKWELL_SUSTAINED_CLOCK, 3),
                          fp8_gemm_half_flops=half_flops_at(3615.6e12), **_BLACKWELL_COSTS)
_HGX_B200_NODE = dict(
    # DGX B200 user guide (docs.nvidia.com/dgx/dgxb200-user-guide/introduction-to-dgxb200.html): 8 B200,
    # NVLink 5 1.8 TB/s bidirectional per GPU (900 GB/s each way) over NVSwitch, 2x Xeon 8570 (56 cores
    # each), 2 TB host memory, 8x ConnectX-7 400 Gb/s; PCIe Gen5 x16 to the host (128 GB/s bidirectional,
    # Blackwell datasheet). Host Adam rate: the DGX H100's, a host of the same 112 cores.
    gpus_per_node=8, intra_bw=900 * GB, intra_latency_s=3e-6, host_link_bw=64 * GB,
    host_memory_bytes=2e12, cpu_cores=112, cpu_optimizer_params_per_s=5e9,
    nvls=True, cpu_vendor="intel",  # NVLink 5 switch with SHARP; DGX B200: 2x Xeon Platinum 8570
)
_GB200_TRAY = dict(
    # DGX GB200 user guide (docs.nvidia.com/dgx/dgxgb200-user-guide/hardware.html): a rack is 18 compute
    # trays of 2 Grace CPUs + 4 Blackwell GPUs, all 72 GPUs on one NVLink 5 fabric through 9 NVLink switch
    # trays (900 GB/s each way per GPU); each tray has 4x ConnectX-7 single-port 400G NICs. A Grace has 72
    # Neoverse V2 cores and 480 GB LPDDR5X (GB200 NVL72 datasheet: 2592 cores, 17 TB per rack), so a tray
    # holds 144 cores and 960 GB. The host link is NVLink-C2C, 900 GB/s bidirectional between a Grace and
    # its two GPUs (NVIDIA technical blog "GB200 NVL72 delivers trillion-parameter LLM training"):
    # 225 GB/s each way per GPU. Host Adam rate: the Hopper host's (no published Grace figure).
    gpus_per_node=4, nvlink_domain_gpus=72, intra_bw=900 * GB, intra_latency_s=3e-6, host_link_bw=225 * GB,
    host_memory_bytes=960e9, cpu_cores=144, cpu_optimizer_params_per_s=5e9,
    nvls=True, cpu_vendor="arm",  # NVLink 5 switch trays with SHARP; 2 Grace (Arm) CPUs per tray
)

# --- AMD MI300X platform (8 OAM GPUs on one baseboard) ---
# AMD Instinct MI300X datasheet: 1307.4 TFLOP/s bf16/fp16 dense, 2614.9 fp8, 653.7 tf32, 163.4 fp32;
# 192 GB HBM3 at 5.3 TB/s (the same dense figures: ml-engineering "TFLOPS comparison table").
# ROCm reports 191.98 GiB to a process ("GPU 0 has a total capacity of 191.98 GiB", AMD ROCm blog
# "GPTQModel ... on AMD GPUs", rocm.blogs.amd.com; virtualised instances report 191.69 GiB).
# Fabric: each GPU has 7 Infinity Fabric (xGMI) links, one to each peer, 64 GB/s each way per link, no
# switch; RCCL reaches ~48 GB/s of a link (CRC and protocol overhead: AMD ROCm blog "Understanding RCCL
# Bandwidth and xGMI Performance on AMD Instinct MI300X", 2025) -> 0.75. GEMM: best bf16 shape 668.4 of
# 1300 TFLOP/s (0.514, PYTORCH_TUNABLEOP_ENABLED=1; ml-engineering MAMF table), the table figure as
# it stands. Not sourced for this platform, borrowed from the H100 generation and said so: launch
# overhead, attention, memory-bound and PCIe efficiencies, InfiniBand efficiency, and the host (AMD
# publishes no reference host: an HGX-class 2-socket, 112-core, 2 TB host as the DGX H100's).
# Network: 8x 400 Gb/s NICs, one per GPU on its own rail (TensorWave's MI300X clusters,
# docs.tensorwave.com/slurm/performance).
_MI300X = dict(
    peak_flops={"bf16": 1307.4e12, "fp16": 1307.4e12, "fp8": 2614.9e12, "tf32": 653.7e12, "fp32": 163.4e12},
    launch_overhead_s=4e-6,
)
_MI300X_NODE = dict(
    gpus_per_node=8, intra_bw=7 * 64 * GB, intra_peer_bw=64 * GB, intra_latency_s=3e-6, host_link_bw=64 * GB,
    host_memory_bytes=2e12, cpu_cores=112, cpu_optimizer_params_per_s=5e9,
)
_MI300X_COSTS = CostParams(
    gemm_eff=round(0.514 * TRAINING_SHAPES, 3), gemm_half_flops=2.0e9, attention_eff=0.40, attention_half_flops=2.0e9,
    memory_eff=0.85, intra_bw_eff=0.75, inter_bw_eff=0.90, host_link_eff=0.80,
    # RCCL's channels on MI300X are not sourced here: the former uniform guess stays
    collective_latency_s=10e-6, overlap_slowdown=1.05, workspace_bytes=2.0 * GiB, allocator_overhead=0.05,
)

# The `local` cluster: CPU ranks on this host. Its numbers are placeholders of the right order
# (one AVX2 core: ~50 GFLOP/s fp32; DDR4 ~20 GB/s; loopback gloo ~2 GB/s) until
# `simexec calibrate` measures the machine and writes a profile. Its ranks talk gloo, whose process
# groups run two async collectives at once (`collective_threads`): that is the backend, not a fit.
_LOCAL_COSTS = CostParams(
    gemm_eff=0.5, gemm_half_flops=5e6, attention_eff=0.25, attention_half_flops=5e6,
    memory_eff=0.5, intra_bw_eff=0.5, inter_bw_eff=0.5, host_link_eff=0.5,
    collective_latency_s=100e-6, overlap_slowdown=1.3, workspace_bytes=0.0, allocator_overhead=0.0,
    collective_threads=2,
)

PRESETS: dict[str, ClusterSpec] = {
    "dgx-a100-40g": ClusterSpec(
        name="dgx-a100-40g", nodes=1,
        device=DeviceSpec(name="A100-SXM4-40GB", memory_bytes=_A100_40G_CUDA_BYTES, memory_bw=1555 * GB, **_A100),
        node=NodeSpec(host_memory_bytes=1e12, **_DGX_A100_NODE),
        network=NetworkSpec(**_HDR_IB), costs=_A100_COSTS,
        source="NVIDIA A100 datasheet; DGX A100 user guide (1 TB host memory, 8x HDR IB)",
    ),
    "dgx-a100-80g": ClusterSpec(
        name="dgx-a100-80g", nodes=1,
        device=DeviceSpec(name="A100-SXM4-80GB", memory_bytes=_A100_80G_CUDA_BYTES, memory_bw=2039 * GB, **_A100),
        node=NodeSpec(host_memory_bytes=2e12, **_DGX_A100_NODE),
        network=NetworkSpec(**_HDR_IB), costs=_A100_COSTS,
        source="NVIDIA A100 80GB datasheet; DGX A100 640GB user guide (2 TB host memory, 8x HDR IB)",
    ),
    "dgx-h100": ClusterSpec(
        name="dgx-h100", nodes=1,
        device=DeviceSpec(name="H100-SXM5-80GB", memory_bytes=_H100_CUDA_BYTES, memory_bw=3350 * GB, **_H100),
        node=NodeSpec(**_HOPPER_NODE), network=NetworkSpec(topology="rail-optimized", **_NDR_IB),
        costs=_H100_COSTS,
        source="NVIDIA H100 datasheet; DGX H100 user guide (8x ConnectX-7 NDR 400 Gb/s)",
    ),
    "hgx-h200": ClusterSpec(
        name="hgx-h200", nodes=1,
        # H200 datasheet: H100 compute, 141 GB HBM3e at 4.8 TB/s.
        device=DeviceSpec(name="H200-SXM-141GB", memory_bytes=_H200_CUDA_BYTES, memory_bw=4800 * GB, **_H100),
        node=NodeSpec(**_HOPPER_NODE), network=NetworkSpec(topology="rail-optimized", **_NDR_IB),
        costs=_H200_COSTS,
        source="NVIDIA H200 datasheet; HGX H200 reference (8x NDR 400 Gb/s)",
    ),
    "hgx-b200": ClusterSpec(
        name="hgx-b200", nodes=1,
        device=DeviceSpec(name="B200-SXM-180GB", memory_bytes=_B200_CUDA_BYTES, memory_bw=7700 * GB, **_B200),
        node=NodeSpec(**_HGX_B200_NODE), network=NetworkSpec(topology="rail-optimized", **_NDR_IB),
        costs=_B200_COSTS,
        source="NVIDIA Blackwell datasheet (HGX B200); DGX B200 user guide (8x ConnectX-7 400 Gb/s)",
    ),
    "gb200-nvl72": ClusterSpec(
        name="gb200-nvl72", nodes=18,
        device=DeviceSpec(name="GB200-186GB", memory_bytes=_GB200_CUDA_BYTES, memory_bw=8000 * GB, **_GB200),
        node=NodeSpec(**_GB200_TRAY),
        network=NetworkSpec(topology="rail-optimized", nics_per_node=4, nic_bw=50 * GB, latency_s=5e-6),
        costs=_GB200_COSTS,
        source="NVIDIA GB200 NVL72 datasheet; DGX GB200 user guide (18 trays of 4 GPUs, 4x ConnectX-7 400 Gb/s"
               " per tray, one 72-GPU NVLink domain)",
    ),
    "mi300x-8": ClusterSpec(
        name="mi300x-8", nodes=1,
        device=DeviceSpec(name="MI300X-192GB", memory_bytes=191.98 * GiB, memory_bw=5300 * GB, **_MI300X),
        node=NodeSpec(**_MI300X_NODE), network=NetworkSpec(topology="rail-optimized", **_NDR_IB),
        costs=_MI300X_COSTS,
        source="AMD Instinct MI300X datasheet; AMD ROCm blogs (xGMI/RCCL bandwidth, reported capacity);"
               " host and several efficiencies borrowed from the H100 generation",
    ),
    "local": ClusterSpec(
        name="local", nodes=1,
        device=DeviceSpec(
            name="cpu", peak_flops={"fp32": 50e9, "bf16": 50e9, "fp16": 50e9},
            memory_bytes=4 * GiB, memory_bw=20 * GB, launch_overhead_s=20e-6,
        ),
        node=NodeSpec(
            gpus_per_node=0, intra_bw=2 * GB, intra_latency_s=50e-6, host_link_bw=10 * GB,
            host_memory_bytes=24 * GiB, cpu_cores=2, cpu_optimizer_params_per_s=2e8,
        ),
        network=NetworkSpec(nics_per_node=0, nic_bw=0, latency_s=0), costs=_LOCAL_COSTS,
        source="this host's CPU ranks over gloo; placeholder costs until calibrated",
    ),
}

_MULTI = re.compile(r"^(\d+)x(.+)$")


def list_clusters() -> list[ClusterSpec]:
    return list(PRESETS.values())


def _preset(name: str) -> Optional[ClusterSpec]:
    """A preset by name, or N nodes of one (`4xdgx-h100`); None if `name` is neither."""
    if name in PRESETS:
        return PRESETS[name]
    m = _MULTI.match(name)
    if not (m and m.group(2) in PRESETS):
        return None
    nodes = int(m.group(1))
    if nodes < 1:
        raise SpecError(f"cluster {name!r}: node count must be at least 1")
    base = PRESETS[m.group(2)]
    if base.sized_to_plan and nodes > 1:
        raise SpecError(f"cluster {name!r}: {m.group(2)} is one host sized to the plan; it takes no node count")
    # N copies of the preset: N nodes of a one-node preset, N racks of a rack preset (gb200-nvl72: 18 trays)
    return base.model_copy(update={"nodes": nodes * base.nodes, "name": name})


def get_cluster(name_or_path: str) -> ClusterSpec:
    """A preset (`dgx-h100`), N nodes of one (`4xdgx-h100`), or a YAML/JSON file (see docs/cluster.md)."""
    preset = _preset(name_or_path)
    if preset is not None:
        return preset
    if names_a_file(name_or_path):
        return load_cluster_file(Path(name_or_path))
    raise unknown_name("cluster", name_or_path, list(PRESETS), "presets")


def names_a_file(name_or_path: str) -> bool:
    """Whether a spec argument is a file (a YAML/JSON suffix, or a path that exists) rather than a name."""
    path = Path(name_or_path)
    return path.suffix.lower() in (".yaml", ".yml", ".json") or path.exists()


def unknown_name(what: str, name: str, names: list[str], listed: str) -> SpecError:
    """The one-line error for a name that is neither a preset nor a file: the closest names, or all."""
    close = difflib.get_close_matches(name, names, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; {listed}: {', '.join(names)}"
    return SpecError(f"unknown {what} {name!r}{hint}")


def read_mapping(path: Path, what: str) -> dict:
    """Read a YAML or JSON file holding one mapping, with one-line errors."""
    if not path.is_file():
        raise SpecError(f"{what} file not found: {path}")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"cannot read {what} file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:  # parse errors of either library
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SpecError(f"{what} file {path} is not valid {path.suffix.lstrip('.').upper() or 'YAML'}: {first}")
    if not isinstance(data, dict):
        raise SpecError(f"{what} file {path} must hold a mapping, not {type(data).__name__}")
    return data


def one_line(exc: ValidationError) -> str:
    """The first pydantic error as `field.path: message`."""
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    return (f"{loc}: {msg}" if loc else msg) + (f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else "")


def deep_merge(base: dict, over: dict) -> dict:
    """`over` laid onto `base`, mappings merged key by key."""
    out = dict(base)
    for key, val in over.items():
        out[key] = deep_merge(out[key], val) if isinstance(val, dict) and isinstance(out.get(key), dict) else val
    return out


def load_cluster_file(path: Path) -> ClusterSpec:
    """A cluster file: either every section in full, or `base: <preset>` plus the fields to change."""
    data = read_mapping(Path(path), "cluster")
    data.setdefault("name", Path(path).stem)  # the file's name, also over a base preset's
    base_name = data.pop("base", None)
    if base_name is not None:
        base = _preset(base_name) if isinstance(base_name, str) else None
        if base is None:
            raise SpecError(
                f"cluster file {path}: base: unknown preset {base_name!r}; presets: {', '.join(PRESETS)} (or NxPRESET)"
            )
        data = deep_merge(base.model_dump(), data)
    try:
        return ClusterSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(f"cluster file {path}: {one_line(exc)}") from None
