#!/usr/bin/env python
"""What one pass over a unit's parameter tensors costs a CPU core, per tensor, by what it does.

    python scripts/tensor_passes.py [--tensors 16] [--shape 64,64] [--repeats 300]

The interpreter handles a collective's parameter tensors one at a time (`simexec.exec.rank.sharding`):
views of a flat buffer (`_Flat.views`: a slice and a reshape each), copies into them, parameters
pointed at them (`p.data = view`) and, for FSDP's release, pointed at one empty tensor. The host
model prices a pass of views or copies at `ISSUE_OPS_PER_TENSOR` operators a tensor
(`simexec.sim.host.issue.tensor_passes`) and the release at nothing; this times each kind of pass, one
intra-op thread, median over the repeats, in µs per tensor.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not dims or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return dims


def time_passes(tensors: int, shape: tuple[int, ...], repeats: int) -> dict[str, float]:
    """Median µs per tensor of each kind of pass over `tensors` parameters of `shape`."""
    import torch

    torch.set_num_threads(1)
    n = math.prod(shape)
    params = [torch.nn.Parameter(torch.randn(shape)) for _ in range(tensors)]
    grads = [torch.randn(shape) for _ in range(tensors)]
    flat = torch.empty(tensors * n)
    empty = torch.empty(0)

    def views():
        return [flat[i * n:(i + 1) * n].view(shape) for i in range(tensors)]

    made = views()

    def point(vs):
        for p, v in zip(params, vs):
            p.data = v

    kinds = {
        "views of the flat buffer": views,
        "copies into views": lambda: [v.copy_(g) for v, g in zip(made, grads)],
        "parameters pointed at new views": lambda: point(views()),
        "release (pointed at one empty tensor)": lambda: point([empty] * tensors),
    }
    out = {}
    for name, fn in kinds.items():
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        out[name] = statistics.median(ts) / tensors * 1e6
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=16, help="tensors in a pass (a gpt-tiny layer: 16)")
    ap.add_argument("--shape", type=_shape, default=(64, 64))
    ap.add_argument("--repeats", type=int, default=300)
    args = ap.parse_args(argv)
    if args.tensors < 1 or args.repeats < 1:
        print(f"tensor_passes: error: --tensors and --repeats must be at least 1, got {args.tensors} and "
              f"{args.repeats}", file=sys.stderr)
        return 2
    for name, us in time_passes(args.tensors, args.shape, args.repeats).items():
        print(f"{name:<40}{us:8.2f} µs a tensor")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
