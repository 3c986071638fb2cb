"""Calibrate a one-GPU hardware profile from real kernels, and score the datasheet preset against it.

Two steps, because the GPU host needs nothing but torch:

    python scripts/gpu_profile.py measure --out gpu_raw.json            # on the GPU machine (CUDA events)
    python scripts/gpu_profile.py fit gpu_raw.json --cluster dgx-h100 \
        --out traces/profiles/h100.json --report docs/gpu_profile.md     # here: fit and compare
    python scripts/gpu_profile.py fit traces/gpu/h200_raw.json --cluster hgx-h200 \
        --out traces/profiles/h200.json --report docs/gpu_profile_h200.md  # an H200's, the same way
    python scripts/gpu_profile.py gemm-plan --out traces/gpu/gemm_plan.json  # on the GPU: a new shape's planning
    python scripts/gpu_profile.py wait-cpu                              # on the GPU: a waiting thread's CPU

`measure` times bf16 GEMMs over a sweep of shapes, causal fused attention (SDPA, forward and
forward+backward), memory-bound element-wise kernels, pinned host<->device copies and an empty
kernel, each as the median of repeated CUDA-event timings. `fit` fits the cost model's parameters
(GEMM and attention efficiency curves, memory and PCIe efficiency, launch overhead) with
scipy.optimize.least_squares on log durations (soft-L1 loss), writes the profile, and reports how the
datasheet preset's predictions for the same kernels compare with the measurements before and after.
No NCCL: one GPU calibrates compute, memory and host-copy costs only.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GEMM_SHAPES = [(m, k, n) for m, k, n in [
    (256, 256, 256), (512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096),
    (8192, 8192, 8192), (16384, 8192, 8192), (4096, 4096, 14336), (4096, 14336, 4096), (8192, 4096, 12288),
    (2048, 8192, 28672), (8192, 28672, 8192), (1024, 4096, 4096), (512, 8192, 8192), (4096, 128, 4096),
    (8192, 1024, 1024), (16384, 4096, 4096),
]]
ATTN = [(1, 32, s, 128) for s in (512, 1024, 2048, 4096, 8192)] + [(4, 16, 2048, 64), (2, 64, 4096, 128)]
ELEMENTWISE_MB = [1, 8, 64, 256, 1024]
COPY_MB = [1, 16, 128, 512]
FINDINGS = "## Findings"


def _time_cuda(fn, reps: int = 20, warmup: int = 5) -> float:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def measure(out: str) -> None:
    import torch
    import torch.nn.functional as F

    dev = torch.device("cuda")
    dt = torch.bfloat16
    rows = []
    for m, k, n in GEMM_SHAPES:
        a, b = torch.randn(m, k, device=dev, dtype=dt), torch.randn(k, n, device=dev, dtype=dt)
        t = _time_cuda(lambda: a @ b)
        rows.append({"kind": "gemm", "shape": [m, k, n], "flops": 2.0 * m * k * n,
                     "bytes": 2.0 * (m * k + k * n + m * n), "seconds": t})
    for bsz, heads, s, d in ATTN:
        q, k_, v = (torch.randn(bsz, heads, s, d, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
        flops = 4.0 * bsz * heads * s * s * d * 0.5  # QK^T and PV, causal half
        t = _time_cuda(lambda: F.scaled_dot_product_attention(q, k_, v, is_causal=True))
        rows.append({"kind": "attention_fwd", "shape": [bsz, heads, s, d], "flops": flops,
                     "bytes": 4.0 * 2 * bsz * heads * s * d, "seconds": t})
        grad = torch.randn(bsz, heads, s, d, device=dev, dtype=dt)
        t = _time_cuda(lambda: F.scaled_dot_product_attention(q, k_, v, is_causal=True).backward(grad))
        rows.append({"kind": "attention_fwdbwd", "shape": [bsz, heads, s, d], "flops": 3.0 * flops,
                     "bytes": 3 * 4.0 * 2 * bsz * heads * s * d, "seconds": t})
    for mb in ELEMENTWISE_MB:
        x = torch.randn(int(mb * 2**20 // 2), device=dev, dtype=dt)
        y = torch.empty_like(x)
        t = _time_cuda(lambda: torch.mul(x, 1.5, out=y))
        rows.append({"kind": "elementwise", "shape": [x.numel()], "flops": float(x.numel()),
                     "bytes": 2.0 * x.numel() * 2, "seconds": t})
    for mb in COPY_MB:
        host = torch.empty(int(mb * 2**20), dtype=torch.uint8, pin_memory=True)
        gpu = torch.empty(int(mb * 2**20), dtype=torch.uint8, device=dev)
        rows.append({"kind": "h2d", "shape": [host.numel()], "flops": 0.0, "bytes": float(host.numel()),
                     "seconds": _time_cuda(lambda: gpu.copy_(host, non_blocking=True))})
        rows.append({"kind": "d2h", "shape": [host.numel()], "flops": 0.0, "bytes": float(host.numel()),
                     "seconds": _time_cuda(lambda: host.copy_(gpu, non_blocking=True))})
    tiny = torch.zeros(1, device=dev)
    t = _time_cuda(lambda: tiny.add_(1.0), reps=200)
    rows.append({"kind": "launch", "shape": [1], "flops": 0.0, "bytes": 8.0, "seconds": t})
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "host": platform.node(), "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    Path(out).write_text(json.dumps({"machine": meta, "rows": rows}, indent=1))
    print(f"wrote {len(rows)} measurements to {out} ({meta['gpu']})")


# The shapes of a Mixtral-style expert's GEMMs (hidden, ffn) and of a dense model's: what cuBLAS must plan
# again whenever the tokens routed to an expert change its row count.
PLAN_SHAPES = [(1024, 3584), (3584, 1024), (2048, 5632), (4096, 14336)]
PLAN_CALLS = 40


def _host_us(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e6


def gemm_plan(out: str) -> None:
    """The host's time to issue one GEMM (no synchronisation: what the CPU spends before the launch
    returns) when its shape repeats and when it is new. An expert's GEMMs take a new row count every
    micro-batch (the tokens routed to it), and cuBLAS chooses an algorithm for every shape it has
    not seen; the difference is that choice. Three cases per (k, n):
    `repeat` (one shape), `new_rows` (x (m, k) @ w (k, n), m new each call: a forward or an input
    gradient) and `new_inner` (x.t() @ y with x (m, k), y (m, n): a weight gradient). Even row counts
    warm the kernels first, so odd ones measure the planning, not the first load of a kernel."""
    import torch

    dev = torch.device("cuda")
    rows = []
    for dt in (torch.bfloat16, torch.float32):
        for k, n in PLAN_SHAPES:
            w = torch.randn(k, n, device=dev, dtype=dt)
            big = torch.randn(4096, max(k, n), device=dev, dtype=dt)
            for m in range(1536, 1536 + 2 * PLAN_CALLS, 2):  # warm-up: even row counts
                big[:m, :k] @ w
                big[:m, :k].t() @ big[:m, :n]
            torch.cuda.synchronize()
            x = big[:2048, :k]
            cases = {
                "repeat": [_host_us(lambda: x @ w) for _ in range(PLAN_CALLS)],
                "new_rows": [_host_us(lambda: big[:m, :k] @ w) for m in range(1537, 1537 + 2 * PLAN_CALLS, 2)],
                "new_inner": [_host_us(lambda: big[:m, :k].t() @ big[:m, :n])
                              for m in range(1537, 1537 + 2 * PLAN_CALLS, 2)],
            }
            torch.cuda.synchronize()
            name = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dt]
            for case, ts in cases.items():
                rows.append({"dtype": name, "k": k, "n": n, "case": case, "median_us": statistics.median(ts),
                             "host_us": ts})
            print(f"{str(dt):15s} k={k:5d} n={n:5d} " + "  ".join(
                f"{case} {statistics.median(ts):7.1f} us" for case, ts in cases.items()), flush=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "blas": str(torch.backends.cuda.preferred_blas_library()), "host": platform.node(),
            "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    Path(out).write_text(json.dumps({"machine": meta, "rows": rows}, indent=1))
    from simexec.calibrate.gpu_kernels import plan_costs

    plan = plan_costs(rows)
    print("planning a new GEMM shape: " + ", ".join(f"{dt} {s * 1e6:.1f} us" for dt, s in plan.items())
          + f" ({meta['gpu']}, {meta['blas']}); wrote {out}")


def wait_cpu() -> None:
    """What a thread that waits for the GPU spends of its CPU: about a second of fp32 GEMMs queued,
    then one wait (`torch.cuda.synchronize()`, an event's `synchronize()`, `.item()`) timed by the
    wall clock and by `time.thread_time`. CUDA's default scheduling spins where the cores outnumber
    the contexts, so a GPU rank's CPU a step cannot tell waiting from issuing."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float32)
    waits = {"synchronize": torch.cuda.synchronize, "item": lambda: a[0, 0].item(),
             "event": lambda: _recorded_event().synchronize()}
    for name, wait in waits.items():
        for _ in range(40):
            a @ a
        w0, c0 = time.perf_counter(), time.thread_time()
        wait()
        w, c = time.perf_counter() - w0, time.thread_time() - c0
        print(f"{name:12s} waited {w * 1e3:7.1f} ms, {c * 1e3:7.1f} ms of the thread's CPU ({c / w:.0%})", flush=True)


def _recorded_event():
    import torch

    ev = torch.cuda.Event()
    ev.record()
    return ev


# --- fitting (here, with the project installed) ------------------------------------------------------
def fit(raw_path: str, cluster_name: str, out: str, report: str | None) -> None:
    from simexec.calibrate.gpu_kernels import fit_kernel_profile

    text = fit_kernel_profile(raw_path, cluster_name, out)
    if report:
        old = Path(report).read_text() if Path(report).exists() else ""
        keep = old[old.index(FINDINGS):] if FINDINGS in old else ""  # hand-written analysis survives a re-run
        Path(report).write_text(text + ("\n" + keep if keep else ""))
    print(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--out", required=True)
    g = sub.add_parser("gemm-plan", help="the host's time to issue a GEMM of a repeated and of a new shape")
    g.add_argument("--out", required=True)
    sub.add_parser("wait-cpu", help="what a thread waiting for the GPU spends of its CPU")
    f = sub.add_parser("fit")
    f.add_argument("raw")
    f.add_argument("--cluster", default="dgx-h100")
    f.add_argument("--out", required=True)
    f.add_argument("--report", default=None)
    args = ap.parse_args()
    t0 = time.time()
    if args.cmd == "measure":
        measure(args.out)
    elif args.cmd == "gemm-plan":
        gemm_plan(args.out)
    elif args.cmd == "wait-cpu":
        wait_cpu()
    else:
        fit(args.raw, args.cluster, args.out, args.report)
    print(f"({time.time() - t0:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
