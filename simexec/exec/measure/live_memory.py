"""Peak memory on CPU: the live tensor storages of device memory.

CPU has no `max_memory_allocated`, so `run_rank` (`simexec.exec.rank.interpreter`) measures the first
step's peak with `LiveBytes`, a `TorchDispatchMode` that counts the bytes of every storage an op
creates until that storage dies. What is not the device's is left out: the communication backend's
temporaries (gloo's copy inside a reduce-scatter; `in_backend` is raised around `Work.wait()` in
`simexec.exec.rank.collectives`) and the host copies of an offloaded optimizer (`on_host`, `ignore`).
The active tracker is `LIVE_TRACKER[0]`.
"""
from __future__ import annotations

import weakref
from typing import Any

from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

LIVE_TRACKER: list = [None]  # the active LiveBytes, if any (read by InflightComm.wait)


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of every storage an op creates until that storage dies (CPU has no
    max_memory_allocated). Storages are tracked once, by identity, with a weakref finaliser."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # else torch wraps __torch_dispatch__ in a dynamo guard whose first call imports torch._dynamo
        # (seconds per rank); this mode never runs under torch.compile
        return False

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.largest = 0  # the largest single storage the interpreter's own ops created
        self.in_backend = 0  # > 0 inside Work.wait(): what appears there is the backend's (gloo's temporaries)
        self.on_host = 0  # > 0 while the rank computes on host memory (offloaded optimizer): not the device's
        self._seen: dict[int, weakref.finalize] = {}

    def ignore(self, t: Tensor) -> None:
        """A tensor that stands for host memory (offload): seen, never counted."""
        st = t.untyped_storage()
        key = id(st)
        if key not in self._seen or not self._seen[key].alive:
            self._seen[key] = weakref.finalize(st, self._seen.pop, key, None)

    def track(self, t: Any, created: bool = False) -> None:
        if not isinstance(t, Tensor) or t.device.type == "meta":
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = id(st)
        if key in self._seen and self._seen[key].alive:
            return
        if created and (self.in_backend or self.on_host):
            return  # the backend's own temporaries (NCCL's are outside max_memory_allocated too), host work
        n = st.nbytes()
        if created:
            self.largest = max(self.largest, n)
        self.live += n
        self.peak = max(self.peak, self.live)
        self._seen[key] = weakref.finalize(st, self._free, key, n)

    def _free(self, key: int, n: int) -> None:
        self.live -= n
        self._seen.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            self.track(t, created=True)
        return out
