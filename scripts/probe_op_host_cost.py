"""Host seconds per eager PyTorch operator, on CPU tensors (docs/stacks.md §2, StackSpec.host).

What an eager GPU step's host thread pays per operator apart from the driver's launch: Python, the
dispatcher and autograd (forward: the op called from Python with autograd recording its node; backward:
the autograd engine running that node from C++). On CPU tensors of one element the kernel itself is a
few nanoseconds, so the time per operator is the host's part of the same call on a GPU, without
cudaLaunchKernel. The best of several runs of one thread, in its own CPU time (time.thread_time: a shared host's other
threads do not count).

    PYTHONPATH=$PWD python scripts/probe_op_host_cost.py
"""
from __future__ import annotations

import time

import torch

N, RUNS = 5000, 9


def best(f) -> float:
    out = []
    for _ in range(RUNS):
        t = time.thread_time()
        f()
        out.append(time.thread_time() - t)
    return min(out) / N


def main() -> None:
    torch.set_num_threads(1)
    x = torch.ones(1, requires_grad=True)

    def chain():
        y = x
        for _ in range(N):
            y = torch.mul(y, 1.0)
        return y

    def nograd():
        with torch.no_grad():
            chain()

    fwd = best(chain)
    plain = best(nograd)
    bwd = []
    for _ in range(RUNS):
        y = chain()
        t = time.thread_time()
        y.backward()
        bwd.append(time.thread_time() - t)
    print(f"forward op, no autograd:        {plain * 1e6:6.2f} us")
    print(f"forward op, autograd recording: {fwd * 1e6:6.2f} us")
    print(f"backward node (engine, C++):    {min(bwd) / N * 1e6:6.2f} us")


if __name__ == "__main__":
    main()
