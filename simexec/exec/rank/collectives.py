"""The communication calls the interpreter makes, and the handle of one it has issued.

`TorchComm` is torch.distributed on the rank's device, with two adjustments: the tensor forms of
all-gather and reduce-scatter under whichever name this torch has, and a CPU tensor's reduce-scatter
run as gloo runs it (an all-reduce of a copy, then this rank's slice) but with an honest completion
time (`reduce_scatter_by_all_reduce`). A backend whose process groups cannot take its tensors stands
in with the same methods (`simexec.exec.rank.xla.HostComm`).

`InflightComm` is an issued collective, send or recv: waited once (by an instruction that depends on it
or reads its result, or reaped once complete), then its `finish` stores the result and the tracer
ends its event. `SendWaiter` completes gloo's sends in the background, which gloo itself does not.
"""
from __future__ import annotations

import queue
import threading
from typing import TYPE_CHECKING, Callable, Optional

import torch.distributed as dist
from torch import Tensor

from simexec.exec.measure.live_memory import LIVE_TRACKER
from simexec.program.instructions import Instr

if TYPE_CHECKING:
    from simexec.exec.rank.interpreter import RankInterpreter

# torch 2.13 renamed the tensor forms of all-gather / reduce-scatter; torch 2.9 (torch_xla) has the old names.
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def rank_slice(full: Tensor, out: Tensor, group=None) -> Tensor:
    """This rank's part of a reduce-scatter's input (`full`, the group's parts end to end), shaped as `out`."""
    index = dist.get_rank(group) if group is not None else dist.get_rank()
    return full.view(-1, out.numel())[index].view(out.shape)


class _SliceWork:
    """A reduce-scatter run as an all-reduce of a copy: `wait()` copies this rank's slice out, and
    `is_completed()` is the all-reduce's, so the executor sees it finish when it did."""

    __slots__ = ("work", "part", "out")

    def __init__(self, work, part: Tensor, out: Tensor):
        self.work, self.part, self.out = work, part, out

    def wait(self) -> bool:
        self.work.wait()
        if self.part is not None:
            if self.part.data_ptr() != self.out.data_ptr():
                self.out.copy_(self.part)
            self.part = None
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed()


def reduce_scatter_by_all_reduce(out: Tensor, inp: Tensor, group=None, async_op: bool = False):
    """gloo's reduce-scatter, done the way gloo does it (an all-reduce of a copy of the input, then
    this rank's slice), but with an honest completion: gloo's own reports completion only inside
    `wait()`, which copies the slice out (`scripts/probe_host.py gloo-threads`), so a trace would time it from
    issue to wait. The copy is the backend's temporary, as gloo's is: not counted in peak memory."""
    tracker = LIVE_TRACKER[0]
    if tracker is not None:
        tracker.in_backend += 1
    try:
        full = inp.detach().clone()
        work = _SliceWork(dist.all_reduce(full, group=group, async_op=True), rank_slice(full, out, group), out)
    finally:
        if tracker is not None:
            tracker.in_backend -= 1
    if async_op:
        return work
    work.wait()
    return None


def _reduce_scatter_any(out: Tensor, inp: Tensor, group=None, async_op: bool = False):
    """torch.distributed's reduce-scatter on accelerator tensors (NCCL); gloo's (CPU tensors) as an
    all-reduce with an honest completion time (`reduce_scatter_by_all_reduce`)."""
    if inp.device.type == "cpu":
        return reduce_scatter_by_all_reduce(out, inp, group=group, async_op=async_op)
    return reduce_scatter_tensor(out, inp, group=group, async_op=async_op)


class TorchComm:
    """The communication calls the interpreter makes: torch.distributed's own, on the rank's device
    (a CPU tensor's reduce-scatter as `reduce_scatter_by_all_reduce`). A backend whose process
    groups cannot take its tensors stands in with the same methods (`simexec.exec.rank.xla.HostComm`:
    XLA tensors through gloo on host copies)."""

    all_reduce = staticmethod(dist.all_reduce)
    all_gather = staticmethod(all_gather_tensor)
    reduce_scatter = staticmethod(_reduce_scatter_any)
    all_to_all_single = staticmethod(dist.all_to_all_single)
    isend = staticmethod(dist.isend)
    irecv = staticmethod(dist.irecv)


class SendWaiter:
    """gloo's send reports itself complete only once someone has waited on it (`is_completed()` stays
    False after the data has left), so an eager send that nothing depends on would hold its buffer
    until the step ends, where NCCL's lets it go when sent. One thread per rank waits on each such
    send as it is issued; `InflightComm.wait` then waits on that thread's signal, never on the Work a
    second time (a gloo send waited twice waits for a second completion)."""

    _shared: Optional["SendWaiter"] = None

    def __init__(self):
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="simexec-send-waiter", daemon=True).start()

    @classmethod
    def shared(cls) -> "SendWaiter":
        """The process's waiter (a rank process runs one plan after another)."""
        if cls._shared is None:
            cls._shared = cls()
        return cls._shared

    def watch(self, works: list) -> "_Sent":
        sent = _Sent()
        self._todo.put((works, sent))
        return sent

    def _run(self) -> None:
        while True:
            works, sent = self._todo.get()
            try:
                for w in works:
                    w.wait()
            except Exception as e:  # raised again by the rank's own wait
                sent.error = e
            works = None
            sent.set()


class _Sent(threading.Event):
    error: Optional[BaseException] = None


class InflightComm:
    """An issued collective / send / recv: waited once, then `finish` stores its result."""

    __slots__ = ("ins", "works", "finish", "done", "rank", "sent")

    def __init__(self, rank: "RankInterpreter", ins: Instr, works: list, finish: Optional[Callable[[], None]],
                 waiter: Optional[SendWaiter] = None):
        self.rank, self.ins, self.works, self.finish, self.done = rank, ins, works, finish, False
        self.sent = waiter.watch(works) if waiter is not None else None

    def completed(self) -> bool:
        """Finished, so that waiting would not block."""
        if self.sent is not None:
            return self.sent.is_set()
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        if self.done:
            return
        self.done = True
        tracker = LIVE_TRACKER[0]
        if tracker is not None:
            tracker.in_backend += 1
        try:
            if self.sent is not None:
                self.sent.wait()
                if self.sent.error is not None:
                    raise self.sent.error
            else:
                for w in self.works:
                    w.wait()
        finally:
            if tracker is not None:
                tracker.in_backend -= 1
        self.works = ()  # a finished Work can hold the backend's temporaries: let them go now
        if self.finish is not None:
            self.finish()
            self.finish = None  # nor keep what its closure captured (a reduce-scatter's output, once summed)
        self.rank.tracer.end(self.ins, self.rank.step_no)
        self.rank.inflight.pop(self.ins.name, None)
