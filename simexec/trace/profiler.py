"""What ran inside each instruction's range of a torch.profiler Chrome trace of an executor run: the
host's time and how much of it synchronised or allocated, the kernels it launched and their device time,
and the GEMMs whose shapes were new to cuBLAS (`scripts/block_profile.py`)."""
from __future__ import annotations

from collections import defaultdict

# calls that wait for the device (a copy into pageable host memory waits for the kernels before it)
SYNC_CALLS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                        "cudaMemcpyAsync"})
ALLOC_CALLS = frozenset({"cudaMalloc", "cudaFree", "cudaMallocAsync", "cudaFreeAsync"})
GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm"})


def inside(ev: dict, lo: float, hi: float) -> bool:
    return lo <= ev["ts"] and ev["ts"] + ev.get("dur", 0) <= hi


def block_instances(events: list[dict], block: str) -> list[dict]:
    """Each profiler range of an instruction whose name holds `.{block}` (the interpreter names
    instructions `phase.block...`), in the last step, with what ran inside it."""
    ranges = [e for e in events if e.get("cat") == "user_annotation" and e.get("ph") == "X"
              and f".{block}" in e["name"]]
    last: dict[str, dict] = {}
    for r in sorted(ranges, key=lambda e: e["ts"]):
        last[r["name"]] = r
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("ph") == "X"]
    kernels = {e["args"].get("correlation"): e for e in events
               if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("ph") == "X"}
    ops = [e for e in events if e.get("cat") == "cpu_op" and e.get("ph") == "X"]
    out = []
    for name, r in sorted(last.items(), key=lambda kv: kv[1]["ts"]):
        lo, hi = r["ts"], r["ts"] + r["dur"]
        calls = [c for c in runtime if inside(c, lo, hi)]
        launched = [kernels[c["args"]["correlation"]] for c in calls if c["args"].get("correlation") in kernels]
        mine = [o for o in ops if inside(o, lo, hi)]
        by_op: dict[str, float] = defaultdict(float)
        for o in mine:
            by_op[o["name"]] += o["dur"]
        by_kernel: dict[str, float] = defaultdict(float)
        for k in launched:
            by_kernel[k["name"][:60]] += k["dur"]
        out.append({
            "name": name, "host_us": r["dur"], "ops": len(mine),
            "sync_us": sum(c["dur"] for c in calls if c["name"].split(" ")[0] in SYNC_CALLS),
            "alloc_us": sum(c["dur"] for c in calls if c["name"] in ALLOC_CALLS),
            "allocs": sum(1 for c in calls if c["name"] in ALLOC_CALLS),
            "kernel_us": sum(k["dur"] for k in launched), "kernels": len(launched),
            "device_span_us": (max(k["ts"] + k["dur"] for k in launched) - min(k["ts"] for k in launched))
            if launched else 0.0,
            "gap_before_first_kernel_us": (min(k["ts"] for k in launched) - lo) if launched else 0.0,
            "top_ops": sorted(by_op.items(), key=lambda kv: -kv[1]),
            "top_kernels": sorted(by_kernel.items(), key=lambda kv: -kv[1]),
        })
    return out


def gemm_shapes(events: list[dict], block: str) -> dict[str, list[float]]:
    """Host time (µs) of each GEMM inside the block's ranges over the whole run, split by whether the
    run had met its shape (dimensions and strides) before: cuBLAS chooses an algorithm for every new
    shape, which an expert's row count (the tokens routed to it) makes of most of its GEMMs.
    {"met": [...], "new": [...]}; empty where the profile recorded no shapes."""
    ranges = sorted(((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "user_annotation"
                     and e.get("ph") == "X" and f".{block}" in e["name"]))
    gemms = sorted((e for e in events if e.get("cat") == "cpu_op" and e.get("ph") == "X" and e["name"] in GEMM_OPS
                    and e.get("args", {}).get("Input Dims") is not None), key=lambda e: e["ts"])
    seen: set = set()
    out: dict[str, list[float]] = {"met": [], "new": []}
    for e in gemms:
        if not any(inside(e, lo, hi) for lo, hi in ranges):
            continue
        shape = (e["name"], str(e["args"]["Input Dims"]), str(e["args"].get("Input Strides")))
        out["met" if shape in seen else "new"].append(e["dur"])
        seen.add(shape)
    return out
