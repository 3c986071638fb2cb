"""A rank's training state saved and restored with torch.distributed.checkpoint (DCP).

What a step leaves behind is the parameters, the ZeRO shards, Adam's moments, fp32 masters and step
counts, and the fp16 loss scale; the gradient buffers are zeroed as each step starts and the data of
step s is a function of (seed, s) (`simexec.exec.nn.data`), so these resume a run bit for bit.

The executor keeps its own layout (flat ZeRO buckets whose slices are the shards, parameters as views
of them, an optimizer over shards or host copies), not DTensors or an nn.Module's FQNs, so the
`torch.distributed.checkpoint.state_dict` helpers do not apply: each rank saves its own tensors by
name, under `rank<r>/`, with `dcp.save` over the world's process group (one collective save, one
`.metadata` written last by the coordinator). Keys are per rank, so DCP's de-duplication of equal keys
across ranks never merges two ZeRO shards; data-parallel replicas of a parameter are written once per
replica. Restoring needs the same plan (ranks and layout); resharding to another plan is not done.
Tensors that alias each other (a parameter and its bucket's shard) hold the same values, so the
order in which `dcp.load` fills them does not matter.
"""
from __future__ import annotations

import math
import time

import torch
import torch.distributed.checkpoint as dcp


def rank_state(r) -> dict[str, object]:
    """The state of `RankInterpreter` `r` by name: tensors to save or fill in place, and the loss
    scaler's and optimizer's counters as plain values."""
    pre = f"rank{r.rank}/"
    out: dict[str, object] = {}
    for n, t in r.p.items():
        if t.numel() == math.prod(r.shapes[n]):  # (ZeRO-3's released parameters live in their shards)
            out[f"{pre}param/{n}"] = t.detach()
    for key, t in r.shards.items():
        out[f"{pre}shard/{_key(key)}"] = t
    for name, t in r.opt.named_state().items():
        out[f"{pre}adam/{name}"] = t
    s = r.scaler
    out[f"{pre}counters"] = {"adam_steps": r.opt.steps, "scale": s.scale, "clean_steps": s.clean_steps,
                             "lives": s.lives, "scales": list(s.scales), "skipped": list(s.skipped)}
    return out


def save(r, path: str) -> float:
    """Save rank `r`'s state into checkpoint `path` (a collective: every rank calls it). Seconds taken."""
    t0 = time.perf_counter()
    if r.device.type == "cuda":
        torch.cuda.synchronize(r.device)
    dcp.save(rank_state(r), checkpoint_id=path)
    return time.perf_counter() - t0


def load(r, path: str) -> float:
    """Fill rank `r`'s state from checkpoint `path` in place (a collective). Seconds taken."""
    t0 = time.perf_counter()
    state = rank_state(r)
    dcp.load(state, checkpoint_id=path)
    c = state[f"rank{r.rank}/counters"]
    r.opt.steps = int(c["adam_steps"])
    s = r.scaler
    s.scale, s.clean_steps, s.lives = float(c["scale"]), int(c["clean_steps"]), int(c["lives"])
    s.scales, s.skipped = [float(x) for x in c["scales"]], [int(x) for x in c["skipped"]]
    if r.device.type == "cuda":
        torch.cuda.synchronize(r.device)
    return time.perf_counter() - t0


def _key(key: tuple) -> str:
    cls, items = key
    return f"{cls}/{'_'.join(map(str, items)) if isinstance(items, tuple) else items}"

