"""The executor on XLA devices (PJRT) through PyTorch/XLA, in the spirit of TorchAcc.

A rank whose device is an XLA device (`torch_xla.device()`) runs the same interpreter as on CPU or
CUDA. Tensors are lazy: a block's ops are only recorded into a graph. The interpreter cuts the graph
at every compute instruction's end (`cut`: `torch_xla.sync()`, then wait until the device has run
it), so each instruction is one compiled XLA graph, executed and timed on its own, and the measured
trace keeps the simulator's instruction ids one to one. Graphs repeat across layers, micro-batches
and steps (same shapes, parameters as inputs), so XLA compiles each distinct one once (the first
step pays the compilations: the warm-up step the summary leaves out).

Collectives, by runtime:

- TPU and GPU (`PJRT_DEVICE=TPU` / `CUDA`): the `xla` process-group backend of torch_xla
  (`torch_xla.distributed.xla_backend`), whose collectives are XLA ops on device tensors; the
  interpreter's calls go straight to torch.distributed.
- CPU runtime (`PJRT_DEVICE=CPU`, one process per rank): nothing XLA-native works. Tried with
  torch_xla 2.9.0: `torch_xla.launch` with two CPU devices hangs in XLA's in-process rendezvous
  (each process's CPU client expects both devices as its own threads) and aborts after 10 s; the
  `xla` process group over a TCP rendezvous, one plain process per rank, returns each rank's own
  tensor from `all_reduce` (every process is an XLA world of one device): silently wrong. So there
  the compute runs on XLA and the collectives run through gloo on host copies (`HostComm`): the
  input is copied to the host (which runs its pending graph), gloo runs the collective, and `wait()`
  copies the result into the XLA output tensor.

torch_xla 2.9.0 is bound to torch 2.9.0, so it lives in its own environment: `scripts/xla_env.sh`.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

from simexec.exec.rank.collectives import all_gather_tensor


def unavailable() -> Optional[str]:
    """None if torch_xla imports here; else why not (one line)."""
    try:
        import torch_xla  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - ImportError, or a torch_xla built for another torch
        return (f"torch_xla cannot be imported ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                "scripts/xla_env.sh creates an environment with torch 2.9.0 and torch_xla 2.9.0")
    return None


def runtime() -> str:
    """The PJRT runtime in use: CPU, TPU, CUDA, ... (PJRT_DEVICE; torch_xla defaults to CPU)."""
    return os.environ.get("PJRT_DEVICE", "CPU").upper()


def device() -> torch.device:
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import torch_xla

    return torch_xla.device()


def process_group_backend() -> str:
    """The torch.distributed backend for XLA ranks: `xla` on TPU/GPU, gloo (host copies) on CPU.
    SIMEXEC_XLA_PG overrides (for trying the xla backend elsewhere)."""
    forced = os.environ.get("SIMEXEC_XLA_PG")
    if forced:
        return forced
    if runtime() == "CPU":
        return "gloo"
    import torch_xla.distributed.xla_backend  # noqa: F401 - registers the "xla" backend

    return "cpu:gloo,xla:xla"  # gloo too, for CPU tensors (clock barrier, the loss sum)


def rank_setup() -> tuple[torch.device, str]:
    """For the worker: this rank's XLA device and the process-group backend to initialise."""
    return device(), process_group_backend()


def cut(dev: Optional[torch.device] = None) -> None:
    """End the current lazy graph here (compile if new, execute) and wait until the device ran it."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    torch_xla.sync()
    xm.wait_device_ops()


def peak_memory(dev: torch.device) -> int:
    """Peak device bytes where the runtime reports them (TPU, GPU); 0 on the CPU runtime."""
    try:
        import torch_xla.core.xla_model as xm

        info = xm.get_memory_info(dev)
    except Exception:  # noqa: BLE001 - the CPU runtime has no memory info
        return 0
    return int(info.get("peak_bytes_used", info.get("bytes_used", 0)) or 0)


def comm_for(group_backend: str):
    """The interpreter's communication calls for XLA tensors under this process-group backend:
    torch.distributed's own where the `xla` backend takes XLA tensors, else gloo on host copies."""
    if "xla" not in group_backend:
        return HostComm()
    from simexec.exec.rank.collectives import TorchComm

    return TorchComm


class _HostWork:
    """A gloo work on host copies; `wait()` also copies the results back into the XLA tensors."""

    __slots__ = ("work", "back", "keep")

    def __init__(self, work, back: list, keep=None):
        self.work, self.back, self.keep = work, back, keep

    def wait(self) -> bool:
        self.work.wait()
        for dst, src in self.back:
            dst.copy_(src)
        self.back = []
        self.keep = None
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed()


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu")


def _done(work: _HostWork, async_op: bool):
    if async_op:
        return work
    work.wait()
    return None


class HostComm:
    """torch.distributed's calls, for XLA tensors, carried out by gloo on host copies."""

    @staticmethod
    def all_reduce(t, op=dist.ReduceOp.SUM, group=None, async_op=False):
        h = _host(t)
        return _done(_HostWork(dist.all_reduce(h, op=op, group=group, async_op=True), [(t, h)]), async_op)

    @staticmethod
    def all_gather(out, inp, group=None, async_op=False):
        h = torch.empty(out.shape, dtype=out.dtype)
        return _done(_HostWork(all_gather_tensor(h, _host(inp), group=group, async_op=True), [(out, h)]), async_op)

    @staticmethod
    def reduce_scatter(out, inp, group=None, async_op=False):
        """As gloo runs it (an all-reduce, then this rank's slice), done here so that the work reports
        completion when the all-reduce ends (`simexec.exec.rank.collectives.reduce_scatter_by_all_reduce`)."""
        from simexec.exec.rank.collectives import rank_slice

        h = _host(inp)
        return _done(_HostWork(dist.all_reduce(h, group=group, async_op=True), [(out, rank_slice(h, out, group))]),
                     async_op)

    @staticmethod
    def all_to_all_single(out, inp, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        h = torch.empty(out.shape, dtype=out.dtype)
        w = dist.all_to_all_single(h, _host(inp), output_split_sizes, input_split_sizes, group=group, async_op=True)
        return _done(_HostWork(w, [(out, h)]), async_op)

    @staticmethod
    def isend(t, dst, group=None, tag=0):
        h = _host(t)
        return _HostWork(dist.isend(h, dst, group=group, tag=tag), [], keep=h)

    @staticmethod
    def irecv(t, src, group=None, tag=0):
        h = torch.empty(t.shape, dtype=t.dtype)
        return _HostWork(dist.irecv(h, src, group=group, tag=tag), [(t, h)])
