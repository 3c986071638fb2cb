#!/usr/bin/env python
"""What torch's fused Adam costs a CPU core per tensor and per element, against the simulator's price.

    python scripts/adam_passes.py [--elements 16384,65536,270000,1048576] [--tensors 1,4,16,53,128]

Times one fp32 Adam step (`torch.optim.adam.adam(..., fused=True)`, as `simexec.exec.nn.optim.Adam`
runs it) over T tensors holding E elements in all, one intra-op thread, the median of 50 steps after
10 discarded; then, for a calibrated `local` profile, what the host model charges the same step
(`HostCosts.cpu_seconds`: two operators, a kernel pass per tensor at `launch_overhead_s`, the bytes
at the memory bandwidth times `elementwise_cost["optim.optim"]`). The per-tensor column is the step over T
tensors less the step over one, per extra tensor.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def time_step(tensors: int, elements: int, steps: int = 60, warm: int = 10) -> float:
    """Median seconds of one fused fp32 Adam step over `tensors` tensors of `elements` in all."""
    import torch
    from torch.optim.adam import adam

    n = max(1, elements // tensors)
    w = [torch.randn(n) for _ in range(tensors)]
    g = [torch.randn(n) for _ in range(tensors)]
    m = [torch.zeros(n) for _ in range(tensors)]
    v = [torch.zeros(n) for _ in range(tensors)]
    counts = [torch.zeros(()) for _ in range(tensors)]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        adam(w, g, m, v, [], counts, fused=True, amsgrad=False, beta1=0.9, beta2=0.95, lr=1e-3,
             weight_decay=0.0, eps=1e-6, maximize=False)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warm:])


def pricer(profile: str):
    """The host model's CPU-seconds for the same step, as a function of (tensors, elements):
    `HostCosts.cpu_seconds` of the optimizer instruction the lowering emits for that many fp32
    parameters, held in that many tensors."""
    from simexec.specs.cluster import get_cluster
    from simexec.program.lower import adam_bytes_per_param
    from simexec.specs.model import get_model
    from simexec.specs.plan import load_plan, resolve
    from simexec.program.instructions import Instr, Program
    from simexec.program.adam import ADAM_FLOPS_PER_PARAM
    from simexec.sim.host.model import HostCosts
    from simexec.sim.profile import apply_profile

    cluster = apply_profile(get_cluster("local"), profile)
    per_param = adam_bytes_per_param(resolve(get_model("gpt-tiny"), cluster, load_plan("dp=1,gbs=1,dtype=fp32")))

    def price(tensors: int, elements: int) -> float:
        class Priced(HostCosts):
            def tensors(self, rank: int) -> int:  # the step's tensors, not a program's
                return tensors

        ins = Instr(0, "optim.optim", "compute", "compute", "optimizer", phase="optim", block="optim",
                    flops=elements * ADAM_FLOPS_PER_PARAM, bytes=elements * per_param)
        return Priced(cluster, Program(meta={}, ranks={0: [ins]}), "fp32").cpu_seconds(ins)

    return price


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elements", type=_ints, default=[16384, 65536, 270000, 1048576],
                    help="elements in all, comma-separated")
    ap.add_argument("--tensors", type=_ints, default=[1, 4, 16, 53, 128], help="tensor counts, comma-separated")
    ap.add_argument("--profile", default=str(ROOT / "traces" / "profiles" / "local-microbench.json"),
                    help="a calibrated local profile to price the steps with")
    args = ap.parse_args(argv)
    from simexec.errors import SimexecError

    try:
        price = pricer(args.profile)
    except SimexecError as exc:
        print(f"adam_passes: error: {exc}", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(1)
    print(f"{'elements':>9s} {'tensors':>7s} {'measured ms':>11s} {'model ms':>9s} {'per extra tensor µs':>20s}")
    for e in args.elements:
        one = None
        for t in sorted(args.tensors):
            ms = time_step(t, e) * 1e3
            one = ms if t == 1 else one
            extra = f"{(ms - one) / (t - 1) * 1e3:20.1f}" if one is not None and t > 1 else f"{'':20s}"
            print(f"{e:9d} {t:7d} {ms:11.3f} {price(t, e) * 1e3:9.3f} {extra}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
