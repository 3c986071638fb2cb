"""The Ray actor that runs one rank: torch.distributed set-up, process groups, the interpreter.

Two thread pools (Ray concurrency groups): the default one (one thread) runs `setup`, `run` and
`close` in order, so thread-local CUDA state and the process groups stay on one thread; the `ctl`
one answers `status` and `partial` while `run` is blocked in a collective, so the driver can watch
progress and, after a fault, learn which instruction each rank was on and keep what it measured.

`run` never raises: an exception comes back as a result with `error`, the rank's status and its
records, so the driver can name the rank and the instruction and save the partial trace.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads: one intra-op thread per rank

import importlib
import platform
import socket
import time
import traceback
from datetime import timedelta
from typing import Callable, Optional, Union

import ray
import torch
import torch.distributed as dist

from simexec.exec.runtime.gloo_loops import idle_gloo_loops
from simexec.exec.runtime.groups import GroupTable
from simexec.exec.measure.tracer import Fault, InjectedFault, Tracer, chrome_text, torch_profiler

DEFAULT_RUNNER = "simexec.exec.rank.interpreter:run_rank"
_COMM_HINTS = ("gloo", "nccl", "connection closed", "connection reset", "timed out", "timeout", "broken pipe",
               "socket", "peer")


@ray.remote(concurrency_groups={"ctl": 1})
class RankWorker:
    def __init__(self, rank: int, world: int):
        torch.set_num_threads(1)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:  # already set in this process
            pass
        self.rank, self.world = rank, world
        self.phase = "started"
        self.tracer: Optional[Tracer] = None
        self.groups: Optional[GroupTable] = None
        self.device = torch.device("cpu")
        self.gloo_loops_idled = 0  # gloo event-loop threads put at SCHED_IDLE by `setup`
        self.progress: list = []  # under a RunControl: [step, wall begin, wall end, loss] per finished step

    def info(self) -> dict:
        ctx = ray.get_runtime_context()
        return {"rank": self.rank, "pid": os.getpid(), "node_id": ctx.get_node_id(),
                "ip": ray.util.get_node_ip_address(), "host": socket.gethostname(), "torch": torch.__version__,
                "ray": ray.__version__, "kernel": platform.release(),
                "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"}

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def setup(self, master: str, port: int, backend: str, timeout_s: float, specs: list,
              trace: bool = True, fault: Optional[Fault] = None, profile: bool = False) -> float:
        """Join the rendezvous, build every process group, align clocks. Returns seconds taken."""
        t0 = time.perf_counter()
        self.phase = "rendezvous"
        if backend == "nccl":
            self.device = torch.device("cuda", 0)  # Ray's CUDA_VISIBLE_DEVICES leaves this rank one GPU
            torch.cuda.set_device(self.device)
            pg_backend = "cpu:gloo,cuda:nccl"  # gloo too, for CPU tensors (barriers, small checks)
        elif backend == "xla":  # PyTorch/XLA device; collectives as simexec.exec.rank.xla explains
            from simexec.exec.rank.xla import rank_setup

            self.device, pg_backend = rank_setup()
        else:
            pg_backend = backend
        dist.init_process_group(pg_backend, init_method=f"tcp://{master}:{port}", rank=self.rank,
                                world_size=self.world, timeout=timedelta(seconds=timeout_s))
        self.phase = "groups"
        self.groups = GroupTable(specs, self.rank, timeout_s=timeout_s)
        self.tracer = Tracer(self.rank, device=self.device, enabled=trace, fault=fault, profile=profile)
        self.tracer.sync_clock(lambda: dist.all_reduce(torch.zeros(1)))  # a CPU barrier on any backend
        self.gloo_loops_idled = idle_gloo_loops()  # every group exists now (simexec.exec.runtime.gloo_loops)
        self.phase = "ready"
        return time.perf_counter() - t0

    def run(self, rp, program_ranks: dict, *, steps: int, seed: int = 0,
            runner: Union[str, Callable] = DEFAULT_RUNNER, profile_dir: Optional[str] = None,
            return_params: bool = False, control=None) -> dict:
        """control: a `RunControl` for the runner (slowdown, checkpoints, resume, kill); the runner then
        also gets `progress`, a list of finished steps that `status` reports while it runs."""
        self.phase = "running"
        self.progress = []
        out: dict = {"rank": self.rank, "error": None, "gloo_loops_idled": self.gloo_loops_idled}
        prof = None
        try:
            fn = _load(runner)
            instrs = program_ranks[self.rank]
            if profile_dir:
                prof = torch_profiler(self.device)
                prof.__enter__()
            more = {} if control is None else {"control": control, "progress": self.progress}
            res = fn(rp, instrs, steps=steps, groups=self.groups, tracer=self.tracer, device=self.device, seed=seed,
                     **more)
            if prof is not None:
                prof.__exit__(None, None, None)
                out["profile"] = chrome_text(prof)
                prof = None
            out.update(losses=[float(x) for x in res.get("losses", [])],
                       step_times_s=[float(x) for x in res.get("step_times_s", [])],
                       cpu_times_s=[float(x) for x in res.get("cpu_times_s", [])],
                       main_cpu_times_s=[float(x) for x in res.get("main_cpu_times_s", [])],
                       peak_memory_bytes=int(res.get("peak_memory_bytes", 0) or 0))
            if "loss_scales" in res:
                out.update(loss_scales=[float(x) for x in res["loss_scales"]],
                           skipped_steps=[int(x) for x in res["skipped_steps"]])
            for key in ("progress", "checkpoints", "load_s"):  # (a RunControl's reports)
                if key in res:
                    out[key] = res[key]
            if res.get("extra") is not None:  # anything else a runner reports (benchmarks)
                out["extra"] = res["extra"]
            if return_params:
                out["params"] = {k: v.detach().cpu() for k, v in res.get("params", {}).items()}
            self.phase = "done"
        except BaseException as exc:  # noqa: BLE001 - reported to the driver, which ends the run
            self.phase = "failed"
            msg = str(exc).strip().splitlines()
            out["error"] = {"type": type(exc).__name__, "message": msg[0] if msg else "",
                            "comm": _is_comm_error(exc), "traceback": traceback.format_exc(limit=20)}
            if prof is not None:
                try:
                    prof.__exit__(None, None, None)
                    out["profile"] = chrome_text(prof)
                except Exception:  # noqa: BLE001 - the profile is a bonus on a failed run
                    pass
        out["status"] = self.status()
        out["trace"] = self.tracer.export() if self.tracer is not None else None
        return out

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self.phase = "closed"

    @ray.method(concurrency_group="ctl")
    def status(self) -> dict:
        st = {"rank": self.rank, "phase": self.phase, "step": -1, "current": "", "count": 0}
        if self.tracer is not None:
            st.update(self.tracer.status())
        if self.progress:
            st["progress"] = [list(p) for p in self.progress]
        return st

    @ray.method(concurrency_group="ctl")
    def partial(self) -> Optional[dict]:
        """What the tracer holds now (the run thread may be stuck): saved when a run fails."""
        return self.tracer.export() if self.tracer is not None else None


def _load(runner: Union[str, Callable]) -> Callable:
    if callable(runner):
        return runner
    mod, _, name = runner.partition(":")
    return getattr(importlib.import_module(mod), name)


def _is_comm_error(exc: BaseException) -> bool:
    """A failure of the communication (a peer died or timed out), not of this rank's own work."""
    if isinstance(exc, InjectedFault):
        return False
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = f"{type(exc).__name__} {exc}".lower()
    return isinstance(exc, RuntimeError) and any(h in text for h in _COMM_HINTS)
