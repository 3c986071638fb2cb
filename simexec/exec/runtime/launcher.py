"""Start Ray (or join a cluster), place one actor per rank, drive the run, and always tear down.

Placement: one placement group per tensor-parallel group, `STRICT_PACK`, so that the ranks of a
TP group (the chattiest collectives, one per sub-block) share a node whenever Ray has several.

Watching a run: the driver waits on every rank's `run` and, every `poll_s`, asks each rank for its
status (answered by a second thread of the actor, even while the rank is blocked in a collective).
A run ends early when a rank's actor dies, a rank raises, or no rank makes progress (instructions
begun) for `timeout_s`. The driver then gives the other ranks a short grace to report, names the
rank to blame (a dead rank, else one that raised on its own, else the one furthest behind) and the
instruction it was on, collects what every live rank measured, and tears everything down. Process
groups time out a little after the watchdog, so a hang is reported by the driver, who sees all
ranks, rather than by a rank that only sees its own collective time out.

Teardown kills every actor, removes the placement groups, waits until the local actor processes
are gone (killing any that linger, by pid) and shuts Ray down if this process started it.
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from simexec.errors import ExecError
from simexec.exec.runtime.groups import group_specs
from simexec.exec.measure.tracer import Fault

STARTUP_TIMEOUT_S = 120.0  # actors import torch; 8 of them on 2 cores take a while
GRACE_S = 2.0  # after a first failure, time for the other ranks to report theirs
PG_TIMEOUT_MARGIN_S = 10.0  # process groups time out this much after the driver's watchdog
WORKER_CLASS = "RankWorker"
COMM_KINDS = ("collective", "send", "recv")


class RankFailure(ExecError):
    """A run that ended because of one rank; `partial` holds what was measured until then."""

    def __init__(self, message: str, *, rank: int, instruction: str, step: int, kind: str, partial: dict):
        super().__init__(message)
        self.rank, self.instruction, self.step, self.kind, self.partial = rank, instruction, step, kind, partial


def start_ray(address: Optional[str] = None, *, num_cpus: Optional[int] = None) -> bool:
    """Join `address`, or start a local Ray sized for this machine without a dashboard.

    Returns whether this call connected (so the caller disconnects/shuts down at the end); an
    already initialised Ray is used as it is.
    """
    import ray

    if ray.is_initialized():
        return False
    try:
        if address:
            import simexec

            # the cluster's nodes may not have this checkout: ship the package with the job
            ray.init(address=address, logging_level="warning",
                     runtime_env={"py_modules": [os.path.dirname(simexec.__file__)]})
        else:
            # address="local": start our own instance, never attach to another session's on this host
            ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False,
                     logging_level="warning")
    except BaseException:  # Ctrl-C or a failure half-way: leave nothing running
        ray.shutdown()
        raise
    return True


def stop_ray(owned: bool) -> None:
    import ray

    if owned and ray.is_initialized():
        ray.shutdown()


def tp_groups(rp) -> list[tuple[int, ...]]:
    return sorted({rp.mesh.group(r, "tp") for r in range(rp.world)})


def cpus_per_rank(world: int, tp: int, nodes: list[float]) -> float:
    """A fair share of the CPUs (at most one per rank) such that a TP group fits on the largest node."""
    total, largest = sum(nodes), max(nodes, default=0.0)
    share = min(1.0, total / world, largest / tp) if world else 1.0
    return max(0.001, int(share * 1000) / 1000)


@dataclass
class Failure:
    rank: int
    kind: str  # died | raised | comm | hung
    detail: str = ""


@dataclass
class Launch:
    """One run's actors, from placement to teardown. Use as a context manager."""

    rp: object
    program: object
    backend: str = "gloo"
    timeout_s: float = 60.0
    trace: bool = True
    fault: Optional[Fault] = None
    profile: bool = False
    poll_s: float = 0.5
    on_start: Optional[Callable[[list[dict]], None]] = None
    actors: list = field(default_factory=list)
    infos: list[dict] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    _pgs: list = field(default_factory=list)

    def __enter__(self) -> "Launch":
        try:
            self.start()
        except BaseException:
            self.teardown(graceful=False)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.teardown(graceful=exc_type is None)

    # --- start ------------------------------------------------------------------------------------
    def start(self) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from simexec.exec.runtime.worker import RankWorker

        world, tp = self.rp.world, self.rp.plan.tp
        t0 = time.perf_counter()
        nodes = [n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")]
        cpus = cpus_per_rank(world, tp, nodes)
        gpus = 1 if self.backend == "nccl" else 0
        bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
        slots: dict[int, tuple] = {}
        for ranks in tp_groups(self.rp):
            pg = placement_group([dict(bundle) for _ in ranks], strategy="STRICT_PACK")
            self._pgs.append(pg)
            slots.update({r: (pg, i) for i, r in enumerate(ranks)})
        ready = [pg.ready() for pg in self._pgs]
        done, _ = ray.wait(ready, num_returns=len(ready), timeout=STARTUP_TIMEOUT_S)
        if len(done) < len(ready):
            raise ExecError(f"cannot place {world} ranks as TP groups of {tp} on one node each, "
                            f"each rank {bundle}; Ray has {ray.available_resources()}")
        self.timings["placement_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        for rank in range(world):
            pg, idx = slots[rank]
            self.actors.append(RankWorker.options(
                num_cpus=cpus, num_gpus=gpus, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=idx),
            ).remote(rank, world))
        self.infos = self.get_all([a.info.remote() for a in self.actors], STARTUP_TIMEOUT_S, "start")
        self.timings["actors_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        port = self.get_all([self.actors[0].free_port.remote()], STARTUP_TIMEOUT_S, "start")[0]
        specs = group_specs(self.rp, self.program)
        pg_timeout = self.timeout_s + PG_TIMEOUT_MARGIN_S
        self.get_all([a.setup.remote(self.infos[0]["ip"], port, self.backend, pg_timeout, specs,
                                  trace=self.trace, fault=self.fault, profile=self.profile)
                   for a in self.actors], STARTUP_TIMEOUT_S, "rendezvous")
        self.timings["rendezvous_s"] = time.perf_counter() - t0
        if self.on_start is not None:
            self.on_start(self.infos)

    def get_all(self, refs: list, timeout: float, what: str) -> list:
        """ray.get of one call per rank, turning a dead or stuck rank into a one-line error."""
        import ray

        done, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        out = []
        for rank, ref in enumerate(refs):
            if ref in pending:
                raise ExecError(f"rank {rank}: {what} did not finish within {timeout:g} s")
            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayActorError as exc:
                raise ExecError(f"rank {rank} died during {what}: {_one_line(exc)}") from None
            except ray.exceptions.RayTaskError as exc:
                raise ExecError(f"rank {rank} failed during {what}: {_one_line(exc.cause or exc)}") from None
        return out

    # --- run --------------------------------------------------------------------------------------
    def run(self, *, steps: int, seed: int = 0, runner=None, profile_dir: Optional[str] = None,
            return_params: bool = False, control=None) -> dict[int, dict]:
        """Every rank's result; raises `RankFailure` when a rank dies, raises or hangs. control: a
        `simexec.exec.rank.run_control.RunControl` for every rank (None: the runner's defaults)."""
        import ray

        from simexec.exec.runtime.worker import DEFAULT_RUNNER

        ranks_ref = ray.put(self.program.ranks)
        rp_ref = ray.put(self.rp)
        pending = {a.run.remote(rp_ref, ranks_ref, steps=steps, seed=seed, runner=runner or DEFAULT_RUNNER,
                                profile_dir=profile_dir, return_params=return_params,
                                **({} if control is None else {"control": control})): r
                   for r, a in enumerate(self.actors)}
        outs: dict[int, dict] = {}
        failures: dict[int, Failure] = {}
        status: dict[int, dict] = {}
        last_seen, last_change, next_poll = None, time.monotonic(), time.monotonic() + self.poll_s
        while pending and not failures:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=self.poll_s)
            for ref in done:
                self._collect(ref, pending.pop(ref), outs, failures, status)
            now = time.monotonic()
            if failures or not pending or now < next_poll:
                continue
            next_poll = now + self.poll_s
            self._poll(sorted(pending.values()), status, failures)
            seen = tuple((r, s.get("phase"), s.get("count")) for r, s in sorted(status.items()))
            if seen != last_seen:
                last_seen, last_change = seen, now
            elif now - last_change > self.timeout_s:
                for r in pending.values():
                    failures[r] = Failure(r, "hung", f"no rank made progress for {self.timeout_s:g} s")
        if failures:
            self._post_mortem(pending, outs, failures, status)
        return outs

    def _collect(self, ref, rank: int, outs: dict, failures: dict, status: dict) -> None:
        import ray

        try:
            out = ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            failures[rank] = Failure(rank, "died", _death_cause(exc))
            return
        outs[rank] = out
        status[rank] = out["status"]
        err = out.get("error")
        if err:
            kind = "comm" if err["comm"] else "raised"
            failures[rank] = Failure(rank, kind, f"{err['type']}: {err['message']}")

    def _poll(self, ranks: list[int], status: dict, failures: dict, timeout: float = 2.0) -> None:
        import ray

        refs = {self.actors[r].status.remote(): r for r in ranks}
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
        for ref in done:
            r = refs[ref]
            try:
                status[r] = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                failures[r] = Failure(r, "died", _death_cause(exc))

    def _post_mortem(self, pending: dict, outs: dict, failures: dict, status: dict) -> None:
        import ray

        # A dead peer's connection errors often reach its neighbours before Ray reports the death:
        # wait a little for a cause (a death, an exception of its own) unless one is known already.
        deadline = time.monotonic() + GRACE_S
        while pending and time.monotonic() < deadline and not _has_cause(failures):
            done, _ = ray.wait(list(pending), num_returns=1, timeout=0.2)
            for ref in done:
                self._collect(ref, pending.pop(ref), outs, failures, status)
            self._poll([r for r in pending.values() if r not in failures], status, failures)
        alive = [r for r in sorted(pending.values()) if failures.get(r, Failure(r, "")).kind != "died"]
        self._poll(alive, status, failures)
        alive = [r for r in alive if failures.get(r, Failure(r, "")).kind != "died"]
        partial_refs = {self.actors[r].partial.remote(): r for r in alive}
        done, _ = ray.wait(list(partial_refs), num_returns=len(partial_refs), timeout=3.0)
        for ref in done:
            try:
                outs[partial_refs[ref]] = {"rank": partial_refs[ref], "trace": ray.get(ref), "partial": True}
            except ray.exceptions.RayError:
                pass
        rank, kind, detail = self._blame(failures, status)
        st = status.get(rank, {})
        instr, step = st.get("current") or "", st.get("step", -1)
        where = f"on {instr} (step {step})" if instr else "before its first instruction"
        if kind == "died":
            where = "last seen " + where
        verb = {"died": "died", "raised": "raised", "comm": "failed in communication", "hung": "hung"}[kind]
        others = sorted(set(failures) - {rank})
        msg = f"rank {rank} {verb} {where}: {detail}"
        if others:
            msg += f" (ranks {','.join(map(str, others))} also stopped)"
        raise RankFailure(msg, rank=rank, instruction=instr, step=step, kind=kind,
                          partial={"outs": outs, "status": status})

    def _blame(self, failures: dict[int, Failure], status: dict[int, dict]) -> tuple[int, str, str]:
        """The rank that caused the failure: one that died, else one that raised on its own, else
        (a hang, or only communication errors) one busy with its own work while the others wait on
        communication, else the one furthest behind in its program."""
        for kind in ("died", "raised"):
            hit = sorted(r for r, f in failures.items() if f.kind == kind)
            if hit:
                return hit[0], kind, failures[hit[0]].detail
        index = {r: {i.name: (k, i) for k, i in enumerate(instrs)} for r, instrs in self.program.ranks.items()}

        def waits_on_peers(r: int, st: dict) -> bool:
            comm = [index[r][n][1].kind in COMM_KINDS for n in st.get("open", ()) if n in index[r]]
            if st.get("current") in st.get("open", ()):
                return index[r][st["current"]][1].kind in COMM_KINDS
            return any(comm)

        def key(r: int) -> tuple:
            st = status.get(r, {})
            pos = index.get(r, {}).get(st.get("current", ""), (-1, None))[0]
            return waits_on_peers(r, st), st.get("step", -1), pos, r

        r = min(range(self.rp.world), key=key)
        hung = any(f.kind == "hung" for f in failures.values())
        detail = (f"no rank made progress for {self.timeout_s:g} s" if hung
                  else (failures.get(r) or failures[min(failures)]).detail)
        return r, "hung" if hung else "comm", detail

    # --- teardown ---------------------------------------------------------------------------------
    def teardown(self, graceful: bool = True) -> None:
        """Kill every actor and placement group; make sure no local actor process survives."""
        import ray

        if not ray.is_initialized():
            return
        t0 = time.perf_counter()
        if graceful and self.actors:
            try:  # destroy the process groups cleanly; the kill below does it anyway
                ray.wait([a.close.remote() for a in self.actors], num_returns=len(self.actors), timeout=10)
            except ray.exceptions.RayError:
                pass
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
        for pg in self._pgs:
            try:
                ray.util.remove_placement_group(pg)
            except Exception:  # noqa: BLE001
                pass
        reap([i["pid"] for i in self.infos if i.get("host") == socket.gethostname()])
        self.actors, self._pgs = [], []
        self.timings["teardown_s"] = time.perf_counter() - t0


def reap(pids: list[int], timeout: float = 10.0) -> None:
    """Wait until these actor processes have exited; SIGKILL any still running after `timeout`."""
    deadline = time.monotonic() + timeout
    left = [p for p in pids if _is_worker(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if _is_worker(p)]
    for pid in left:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def _is_worker(pid: int) -> bool:
    """A live (not zombie) process that is still one of our rank actors."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                return False
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return WORKER_CLASS.encode() in fh.read()
    except OSError:
        return False


def live_workers(pids) -> list[int]:
    """Those of `pids` that are still live rank actors on this host (for tests and checks)."""
    return [p for p in pids if _is_worker(p)]


def _has_cause(failures: dict[int, Failure]) -> bool:
    return any(f.kind in ("died", "raised") for f in failures.values())


def _death_cause(exc: BaseException) -> str:
    text = str(exc)
    for hint in ("SIGKILL", "killed", "OOM", "out of memory", "exit", "ray.kill"):
        if hint in text:
            return "actor process killed or exited" if hint != "OOM" else "actor process ran out of memory"
    return "actor process died"


def _one_line(exc: BaseException) -> str:
    """`Type: message` from the last line of a (possibly multi-line, remote) error."""
    lines = [l for l in str(exc).strip().splitlines() if l.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"
