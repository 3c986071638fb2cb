"""Runners that simulate a wave of plan strings: in this process, in local processes, or as Ray tasks.

A runner only evaluates; the search decides what to run and prunes between waves, and sorts each
wave's results, so which worker ran what never changes the outcome.
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Any, Callable, Optional

from simexec.specs.cluster import ClusterSpec
from simexec.errors import SimexecError
from simexec.specs.model import ModelSpec
from simexec.specs.stack import StackSpec
from simexec.specs.plan import parse_plan

_RESULT_KEYS = ("step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "peak_memory_bytes", "fits",
                "breakdown_s", "memory_breakdown_bytes", "memory_capacity_bytes")



@dataclass
class Context:
    """What a worker needs besides the plan string: the other inputs of `simulate`."""

    model: ModelSpec
    cluster: ClusterSpec
    seq_len: Optional[int]
    profile: Any = None
    stack: Optional[StackSpec] = None  # None: the default stack


_CTX: Optional[Context] = None


def _init_worker(ctx: Context) -> None:
    global _CTX
    _CTX = ctx
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle


def evaluate(plan_string: str, ctx: Optional[Context] = None, simulator: Optional[Callable] = None) -> dict:
    """Simulate one plan string exactly as `simexec simulate` would; a plain dict of its numbers."""
    ctx = ctx or _CTX
    if simulator is None:
        from simexec.sim.simulate import simulate as simulator
    try:
        extra = {"stack": ctx.stack} if ctx.stack is not None else {}
        res = simulator(ctx.model, ctx.cluster, parse_plan(plan_string), ctx.seq_len, profile=ctx.profile, **extra)
    except SimexecError as exc:  # a plan the simulator refuses is reported, not fatal to the search
        return {"plan": plan_string, "error": f"{type(exc).__name__}: {exc}"}
    d = res.to_json() if hasattr(res, "to_json") else dict(res)
    out = {"plan": plan_string}
    for k in _RESULT_KEYS:
        if k in d:
            out[k] = d[k]
    return out


def first_bounds(gbs: int, seq_len: int, fix: dict, part: tuple[int, int], ctx: Optional[Context] = None) -> list:
    """A worker's part of the search's first bounds: the structures of `part` (see
    `simexec.search.space.structures`), bounded as the search would bound them."""
    from simexec.search.bounds import Bounds
    from simexec.search.space import structures

    ctx = ctx or _CTX
    cluster = ctx.cluster
    if ctx.profile is not None:
        from simexec.sim.profile import apply_profile

        cluster = apply_profile(cluster, ctx.profile)
    return Bounds(ctx.model, cluster, seq_len).first_bounds(
        structures(ctx.model, cluster, gbs, seq_len, fix, part=part, stack=ctx.stack))


class _Serial:
    """Every runner: `map` calls `on_result` once per plan, in any order; `close(interrupted)` stops
    what it started, without waiting for running plans when interrupted; `name` and `workers` are
    reported with the result."""

    name = "serial"

    def __init__(self, ctx: Context, simulator: Optional[Callable]):
        self.ctx, self.simulator, self.workers = ctx, simulator, 1

    def map(self, plans: list[str], on_result: Callable[[dict], None]) -> None:
        for s in plans:
            on_result(evaluate(s, self.ctx, self.simulator))

    def close(self, interrupted: bool = False) -> None:
        pass


class _Processes:
    name = "processes"

    def __init__(self, ctx: Context, workers: int):
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        self.workers = workers
        self.pool = ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"),
                                        initializer=_init_worker, initargs=(ctx,))

    def first_bounds(self, gbs: int, seq_len: int, fix: dict) -> list:
        """Futures of the first bounds, the space shared among the workers by (tp, cp) pairs."""
        return [self.pool.submit(first_bounds, gbs, seq_len, fix, (k, self.workers)) for k in range(self.workers)]

    def map(self, plans: list[str], on_result: Callable[[dict], None]) -> None:
        from concurrent.futures import as_completed

        futures = [self.pool.submit(evaluate, s) for s in plans]
        for fut in as_completed(futures):
            on_result(fut.result())

    def close(self, interrupted: bool = False) -> None:
        if interrupted:
            procs = list(getattr(self.pool, "_processes", {}).values())
            self.pool.shutdown(wait=False, cancel_futures=True)
            for proc in procs:  # the workers this search started: do not wait for their current plan
                if proc.is_alive():
                    proc.terminate()
        else:
            self.pool.shutdown(wait=True)


class _Ray:
    name = "ray"

    def __init__(self, ctx: Context, address: str, workers: Optional[int]):
        import ray

        self.ray = ray
        self.owned = not ray.is_initialized()
        if self.owned:
            ray.init(address=None if address == "local" else address, log_to_driver=False)
        self.ctx_ref = ray.put(ctx)
        self.remote = ray.remote(num_cpus=1, max_retries=2)(evaluate)
        self.workers = workers or int(ray.cluster_resources().get("CPU", 1))
        self.pending: list = []

    def map(self, plans: list[str], on_result: Callable[[dict], None]) -> None:
        ray = self.ray
        self.pending = [self.remote.remote(s, self.ctx_ref) for s in plans]
        while self.pending:
            done, self.pending = ray.wait(self.pending, num_returns=1)
            for ref in done:
                on_result(ray.get(ref))

    def close(self, interrupted: bool = False) -> None:
        for ref in self.pending:
            try:
                self.ray.cancel(ref, force=True)
            except Exception:
                pass
        if self.owned:
            self.ray.shutdown()



def make_runner(ctx: Context, *, simulator: Optional[Callable] = None, ray_address: Optional[str] = None,
                workers: Optional[int] = None, serial: bool = False, local_only: bool = False):
    """Ray tasks when given an address, else local processes (`workers`, default the CPU count);
    in this process when asked (`serial`), with a stand-in simulator, or with one worker.
    local_only: local processes or nothing (None), for the search's bounds."""
    n_workers = workers if workers is not None else (os.cpu_count() or 1)
    if local_only:
        return _Processes(ctx, n_workers) if simulator is None and ray_address is None and n_workers > 1 else None
    if serial or simulator is not None or (ray_address is None and n_workers <= 1):
        return _Serial(ctx, simulator)
    if ray_address is not None:
        return _Ray(ctx, ray_address, workers)
    return _Processes(ctx, n_workers)
