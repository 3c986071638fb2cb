"""Measuring many runs on this machine in one Ray session: an actor pool, a CPU meter, a session.

Starting the executor costs ~15 s (Ray, then actors that import torch); calibration and validation
run a dozen plans and the micro-benchmarks. `Session` starts Ray once and keeps one set of rank
actors per world size (`RankPool`), re-doing only the rendezvous for each plan; every run is measured
together with the host's background load (`CpuMeter`: the cores' worth of CPU other users of the
host took meanwhile, which slows CPU ranks down and which the cost model takes as
`costs.background_load`).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from simexec.errors import ExecError


# --- background load -------------------------------------------------------------------------------
def _jiffies_busy() -> Optional[tuple[float, float]]:
    """(busy, total) CPU jiffies of the host so far (/proc/stat; steal counts as busy: another VM's)."""
    try:
        with open("/proc/stat") as fh:
            f = [float(x) for x in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = f[3] + (f[4] if len(f) > 4 else 0.0)
    return sum(f[:8]) - idle, sum(f[:8])


def _jiffies_of(pids: Iterable[int]) -> float:
    """utime + stime of these processes (all their threads), in jiffies."""
    n = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                parts = fh.read().rsplit(b")", 1)[1].split()
            n += float(parts[11]) + float(parts[12])
        except (OSError, IndexError, ValueError):
            continue
    return n


class CpuMeter:
    """How many cores' worth of CPU the host's other users (other processes, other VMs' steal) took
    between `start()` and `stop()`: /proc/stat's busy time minus that of the processes in `own`."""

    def __init__(self, own: Callable[[], set[int]]):
        self.own = own
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._t0 = None

    def start(self) -> None:
        pids = self.own()
        self._t0 = (time.monotonic(), _jiffies_busy(), _jiffies_of(pids), pids)

    def stop(self) -> Optional[float]:
        if self._t0 is None:
            return None
        t0, busy0, mine0, pids0 = self._t0
        new = self.own() - pids0  # processes that appeared meanwhile: all their CPU time is the run's
        busy1, mine1 = _jiffies_busy(), _jiffies_of(pids0) + _jiffies_of(new)
        wall = time.monotonic() - t0
        if busy0 is None or busy1 is None or wall <= 0:
            return None
        others = (busy1[0] - busy0[0]) - (mine1 - mine0)
        return max(0.0, others / self.hz / wall)


# --- a pool of rank actors -------------------------------------------------------------------------
class RankPool:
    """Rank actors kept alive across runs: one set per world size, created on first use.

    `launch` is what `execute(..., pool=pool)` builds instead of a `Launch`: it takes the pool's
    actors for the plan's world size, re-does the rendezvous (a fresh default process group and
    groups), runs, and on success only destroys the process groups (a failed run kills the actors;
    the next run starts new ones).
    """

    def __init__(self, num_cpus_per_rank: float = 0.01):
        self.cpus = num_cpus_per_rank
        self.sets: dict[int, tuple[list, list[dict]]] = {}

    def actors_for(self, world: int, backend: str = "gloo") -> tuple[list, list[dict]]:
        import ray

        from simexec.exec.runtime.launcher import STARTUP_TIMEOUT_S
        from simexec.exec.runtime.worker import RankWorker

        got = self.sets.get(world)
        if got is None:
            gpus = 1 if backend == "nccl" else 0
            actors = [RankWorker.options(num_cpus=self.cpus, num_gpus=gpus, max_restarts=0).remote(r, world)
                      for r in range(world)]
            refs = [a.info.remote() for a in actors]
            done, pending = ray.wait(refs, num_returns=len(refs), timeout=STARTUP_TIMEOUT_S)
            if pending:
                raise ExecError(f"rank actors for {world} ranks did not start within {STARTUP_TIMEOUT_S:g} s")
            got = self.sets[world] = (actors, ray.get(refs))
        return got

    def drop(self, world: int) -> None:
        import ray

        actors, infos = self.sets.pop(world, ([], []))
        for a in actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
        from simexec.exec.runtime.launcher import reap

        reap([i["pid"] for i in infos])

    def close(self) -> None:
        for world in list(self.sets):
            self.drop(world)

    def pids(self) -> set[int]:
        return {i["pid"] for _, infos in self.sets.values() for i in infos}

    def launch(self, rp, program, **kw):
        return _PooledLaunch(rp, program, pool=self, **kw)


def _pooled_launch_class():
    from simexec.exec.runtime.launcher import Launch

    class PooledLaunch(Launch):
        """A `Launch` whose actors come from (and go back to) a `RankPool`."""

        def __init__(self, rp, program, *, pool: RankPool, **kw):
            super().__init__(rp, program, **kw)
            self.pool = pool

        def start(self) -> None:
            from simexec.exec.runtime.groups import group_specs
            from simexec.exec.runtime.launcher import PG_TIMEOUT_MARGIN_S, STARTUP_TIMEOUT_S

            t0 = time.perf_counter()
            actors, infos = self.pool.actors_for(self.rp.world, self.backend)
            self.actors, self.infos = list(actors), list(infos)
            self.timings["actors_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            port = self.get_all([self.actors[0].free_port.remote()], STARTUP_TIMEOUT_S, "start")[0]
            specs = group_specs(self.rp, self.program)
            self.get_all([a.setup.remote(self.infos[0]["ip"], port, self.backend, self.timeout_s + PG_TIMEOUT_MARGIN_S,
                                      specs, trace=self.trace, fault=self.fault, profile=self.profile)
                       for a in self.actors], STARTUP_TIMEOUT_S, "rendezvous")
            self.timings["rendezvous_s"] = time.perf_counter() - t0
            if self.on_start is not None:
                self.on_start(self.infos)

        def teardown(self, graceful: bool = True) -> None:
            import ray

            if not ray.is_initialized() or not self.actors:
                return
            if graceful:
                refs = [a.close.remote() for a in self.actors]
                done, pending = ray.wait(refs, num_returns=len(refs), timeout=10)
                if not pending:
                    self.actors = []
                    return
            self.pool.drop(self.rp.world)  # a failed or stuck run: these actors are not reused
            self.actors = []

    return PooledLaunch


_PL = None


def _PooledLaunch(rp, program, **kw):
    global _PL
    if _PL is None:
        _PL = _pooled_launch_class()
    return _PL(rp, program, **kw)


# --- a session -------------------------------------------------------------------------------------
@dataclass
class Measured:
    """One plan's run: the executor's result and the background load while it ran."""

    plan: str
    result: object  # ExecResult
    background: Optional[float]
    wall_s: float

    @property
    def step_time_s(self) -> float:
        return self.result.step_time_s


@dataclass
class Session:
    """One Ray instance and one actor pool for many runs (use as a context manager)."""

    ray_address: Optional[str] = None
    measure_load: bool = True
    pool: RankPool = field(default_factory=RankPool)
    _owned: bool = False
    _own: set = field(default_factory=set)

    def __enter__(self) -> "Session":
        from simexec.exec.runtime.launcher import start_ray

        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
        self._owned = start_ray(self.ray_address)
        self._refresh_own()
        return self

    def __exit__(self, *exc) -> None:
        from simexec.exec.runtime.launcher import stop_ray

        try:
            self.pool.close()
        finally:
            stop_ray(self._owned)

    def _refresh_own(self) -> set[int]:
        """This session's processes: the driver, Ray's daemons it started, the rank actors."""
        own = {os.getpid()} | self.pool.pids()
        try:
            import psutil

            own |= {c.pid for c in psutil.Process().children(recursive=True)}
        except Exception:  # noqa: BLE001 - psutil is optional; /proc children then
            pass
        self._own = own
        return own

    def execute(self, model, plan: str, *, steps: int = 6, cluster="local", timeout_s: float = 120.0,
                runner: Optional[Callable] = None, **kw) -> Measured:
        """Run a plan on the pool's actors; `background` is the cores the host's other users took meanwhile."""
        from simexec.exec.api import execute

        meter = CpuMeter(self._refresh_own) if self.measure_load else None
        t0 = time.perf_counter()
        if meter is not None:
            meter.start()
        res = execute(model, cluster, plan, steps=steps, timeout_s=timeout_s, runner=runner, pool=self.pool,
                      on_start=lambda infos: self._refresh_own(), **kw)
        bg = meter.stop() if meter is not None else None
        if bg is not None and res.trace is not None:
            res.trace.meta["background_load"] = bg
        return Measured(plan=str(plan), result=res, background=bg, wall_s=time.perf_counter() - t0)
