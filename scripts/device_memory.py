"""What one GPU gives a training process: the capacity CUDA reports and what the runtime, cuBLAS and
NCCL take of it before any tensor of the model exists.

    python scripts/device_memory.py [--out traces/gpu/device_memory.json]      # on the GPU machine

Prints the device's total memory as CUDA reports it, and the memory in use outside PyTorch's caching
allocator (`torch.cuda.mem_get_info` less `memory_reserved`) after each of: creating the context,
the first bf16 GEMM (cuBLAS's handle and workspace), a one-rank NCCL all-reduce (communicator and
its buffers). `--out` keeps one row per GPU model in that file, replacing this GPU's. The
datasheet's "80 GB" is the HBM's size; a process sees less, and the cluster presets'
`workspace_bytes` is meant to cover the rest.
"""
from __future__ import annotations

import argparse
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simexec.calibrate.device_memory import keep_row, read_rows  # noqa: E402

GiB = 1024**3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.out:  # a file that cannot take the row is refused before the measurement
        out = Path(args.out)
        try:
            if not out.parent.is_dir():
                raise ValueError(f"{out}: no folder {out.parent} to write it in")
            read_rows(out)
        except (ValueError, OSError) as e:
            print(f"device_memory.py: {e}", file=sys.stderr)
            return 2
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        print("device_memory.py: no CUDA device here", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)

    def used() -> float:
        """Memory in use on the device that is not the caching allocator's (context, libraries)."""
        free, total = torch.cuda.mem_get_info()
        return float(total - free - torch.cuda.memory_reserved())

    row = {"gpu": props.name, "torch": torch.__version__, "cuda": torch.version.cuda,
           "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "total_memory_bytes": float(props.total_memory)}
    torch.cuda.init()
    torch.empty(1, device="cuda")
    row["after_context_bytes"] = used()
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    row["after_gemm_bytes"] = used()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    x = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    row["after_nccl_bytes"] = used()
    dist.destroy_process_group()
    for k, v in row.items():
        print(f"{k}: {v / GiB:.3f} GiB" if k.endswith("bytes") else f"{k}: {v}")
    if args.out:
        keep_row(Path(args.out), row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
