"""Activation CPU offloading in the executor (`Plan.offload_layers`), as Transformer Engine runs it for
Megatron-Core (NVIDIA/TransformerEngine@d0067d0d transformer_engine/pytorch/cpu_offload.py):
`torch.autograd.graph.saved_tensors_hooks` around an offloaded layer's forward blocks keep a handle to
each tensor autograd saves (TE's `push_tensor`; the weights stay, as TE's `_check_if_offload` keeps
`nn.Parameter`s), the program's `copy.act_d2h` moves the layer's tensors to host memory (pinned on CUDA) and
drops the device ones, `copy.act_h2d` brings them back, and the backward's unpack hook returns the
reloaded tensor (TE's `pop_tensor`); after the layer's backward the reloaded tensors go (TE's
`release_all_memory`). The interpreter lets go of its own references to the moved storages
(`BlockCompute.release_offloaded_inputs`). The copies run where the program puts them, synchronously: the
simulator prices the overlap, the executor checks that the math is the same.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from simexec.exec.measure.live_memory import LIVE_TRACKER
from simexec.program.instructions import Instr


class ActivationOffloader:
    """One rank's offloaded layers' saved tensors, per (layer, micro-batch): on the device after the
    forward, on the host after `copy.act_d2h`, on the device again after `copy.act_h2d`."""

    def __init__(self, layers: int, device: torch.device):
        self.layers = layers
        self.device = device
        self.saved: dict[tuple[int, int], list[Tensor]] = {}
        self.versions: dict[tuple[int, int], list[int]] = {}

        # under sp, the norm outputs a layer keeps as slices for its backward's re-gathers: the interpreter's
        # environment holds them rather than autograd (Megatron's column-parallel linear saves that slice)
        self.slices: dict[tuple[int, int], list[tuple[tuple, Tensor]]] = {}

    def reset(self) -> None:
        self.saved.clear()
        self.versions.clear()
        self.slices.clear()

    def stash(self, layer: int, mb: int, items: list[tuple[tuple, Tensor]]) -> None:
        """With `copy.act_d2h`: environment values (key, device tensor) the backward reads, to the host."""
        tracker = LIVE_TRACKER[0]
        if tracker is not None:
            tracker.on_host += 1
        try:
            host = _moved([t for _, t in items], torch.device("cpu"), pin=self.device.type == "cuda")
            for h in host if tracker is not None else ():
                tracker.ignore(h)
        finally:
            if tracker is not None:
                tracker.on_host -= 1
        self.slices[(layer, mb)] = [(k, h) for (k, _), h in zip(items, host)]

    def unstash(self, layer: int, mb: int) -> list[tuple[tuple, Tensor]]:
        """With `copy.act_h2d`: the stashed environment values, on the device again."""
        items = self.slices.pop((layer, mb), [])
        return [(k, d) for (k, _), d in zip(items, _moved([h for _, h in items], self.device, pin=False))]

    def covers(self, ins: Instr) -> bool:
        """Whether a compute instruction is the forward of an offloaded layer."""
        return ins.phase == "fwd" and 0 <= ins.layer < self.layers

    def hooks(self, layer: int, mb: int, weights: set[int]) -> torch.autograd.graph.saved_tensors_hooks:
        """The pack and unpack hooks of layer `layer`'s forward blocks for micro-batch `mb`; `weights`:
        the storages (`data_ptr`) of the rank's parameters as the block reads them (ZeRO-3: gathered),
        which stay on the device as TE keeps `nn.Parameter`s (cpu_offloading_weights=False)."""
        key = (layer, mb)
        saved = self.saved.setdefault(key, [])
        versions = self.versions.setdefault(key, [])

        def pack(t: Tensor) -> Any:
            if isinstance(t, nn.Parameter) or t.untyped_storage().data_ptr() in weights:
                return t
            # an alias of its own: the executor later empties a block's output (`_deallocate`) or shrinks
            # its input leaf by assigning `.data`, which an alias does not follow
            saved.append(t.detach())
            versions.append(t._version)
            return len(saved) - 1

        def unpack(h: Any) -> Tensor:
            if isinstance(h, Tensor):
                return h
            t = self.saved[key][h]
            return t if t.device == self.device else t.to(self.device)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def copy(self, ins: Instr) -> set[int]:
        """`act_d2h`: the layer's saved tensors to host memory, the device's let go; `act_h2d`: back.
        Returns the device storages (`data_ptr`) the offload moved away (none for a reload).
        Each storage moves once and its saved views are rebuilt on it (tensors saved twice, or q, k and
        v views of one projection, as TE's `_deduplicate_tensors` and `offload_base_tensor` do): copying
        each view alone would bring one storage back as several."""
        key = (ins.layer, ins.mb)
        tensors = self.saved.get(key, [])
        if ins.block == "act_d2h":
            for t, v in zip(tensors, self.versions.get(key, [])):
                if t._version != v:
                    raise RuntimeError(f"{ins.name}: a saved tensor was modified in place before its offload copy")
            tracker = LIVE_TRACKER[0]
            if tracker is not None:
                tracker.on_host += 1
            moved = {t.untyped_storage().data_ptr() for t in tensors}
            try:
                # in place: the pack hook's closure holds this list, and autograd keeps the hook alive
                tensors[:] = _moved(tensors, torch.device("cpu"), pin=self.device.type == "cuda")
                for h in self.saved[key] if tracker is not None else ():
                    tracker.ignore(h)  # host memory, also when the reload reads it
            finally:
                if tracker is not None:
                    tracker.on_host -= 1
            return moved
        tensors[:] = _moved(tensors, self.device, pin=False)
        return set()


    def release(self, layer: int, mb: int) -> None:
        """After layer `layer`'s backward for micro-batch `mb`: its reloaded tensors go (TE's
        `release_all_memory`); the list is emptied in place, as the pack hook's closure holds it."""
        t = self.saved.get((layer, mb))
        if t is not None:
            t.clear()


def _moved(tensors: list[Tensor], device: torch.device, pin: bool) -> list[Tensor]:
    """The same views on copies of their storages on `device`, each storage copied once."""
    copies: dict[int, torch.UntypedStorage] = {}
    out = []
    for t in tensors:
        st = t.untyped_storage()
        k = st.data_ptr()
        if k not in copies:
            whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st)
            copies[k] = torch.empty(st.nbytes(), dtype=torch.uint8, device=device,
                                    pin_memory=pin).copy_(whole).untyped_storage()
        out.append(torch.empty(0, dtype=t.dtype, device=device).set_(copies[k], t.storage_offset(), t.shape,
                                                                       t.stride()))
    return out
