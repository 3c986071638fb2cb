"""The hardware the engine runs a program on: compute costs, the network and its shared links.

The engine asks a machine (`simexec.sim.engine.MachineModel`) what an instruction costs, how fast
compute runs while transfers are in flight, and to run transfers. Two machines answer:
- `Machine`, ranks that each own a device (GPUs, or one CPU each): compute priced by the roofline of
  `simexec.sim.compute`, slowed by the SMs the rank's transfers in flight hold (`simexec.sim.overlap`), the host issuing operators ahead of
  the device unless `costs.host_dispatch_s` makes it eager (`simexec.sim.host.model.dispatch_clock`);
  transfers as phases over the network's shared links;
- `SharedCoresMachine`, CPU ranks whose threads share one host's cores (`costs.cores_shared`): every
  compute, copy and host step is CPU-seconds on a core (`simexec.sim.host.model.HostCosts`) that
  the cores' scheduler (`simexec.sim.host.cores`) hands out, and so is every step of a transfer.
`machine_for` picks the one a cluster needs.
"""
from __future__ import annotations

from typing import Callable, Optional

from simexec.specs.cluster import ClusterSpec
from simexec.program.instructions import Instr, Program, exchanges_counts
from simexec.sim.compute import ComputeModel
from simexec.sim.host.model import HostCosts, dispatch_clock, shares_cores
from simexec.sim.network import Fluid, Network
from simexec.sim.overlap import OverlapShares


class FluidTransfer:
    """Phases of one transfer run back to back on the fluid network; then `finish()`."""

    __slots__ = ("fluid", "phases", "i", "finish")

    def __init__(self, fluid: Fluid, phases, finish: Callable[[], None]):
        self.fluid, self.phases, self.i, self.finish = fluid, phases, 0, finish
        amount, links, cap, lat = phases[0]
        fluid.start(amount, links, cap, lat, self)

    def __call__(self) -> None:
        self.i += 1
        if self.i < len(self.phases):
            amount, links, cap, lat = self.phases[self.i]
            self.fluid.start(amount, links, cap, lat, self)
            return
        self.finish()


class Machine:
    """One cluster whose ranks each own a device, seen from the program's present ranks."""

    cores = None  # each rank computes on its own device: no cores for the engine to share out

    def __init__(self, cluster: ClusterSpec, program: Program, dtype: str = "bf16"):
        self.cluster = cluster
        self.program = program
        resolved = program.resolved
        self.compute = ComputeModel(cluster, dtype, resolved.stack if resolved is not None else None)
        self.network = Network(cluster, program.ranks, program.represents or {})
        self.overlap = OverlapShares(cluster, bool(resolved is not None and resolved.plan.tp_async))
        self.fluid: Fluid | None = None
        self._members: dict[tuple[int, ...], tuple[int, ...]] = {}
        self._phases: dict[tuple, tuple] = {}

    def bind(self, env) -> Fluid:
        """Links as resources of one simulation run."""
        self.fluid = Fluid(env, self.network.capacity)
        return self.fluid

    # --- compute ---------------------------------------------------------------------------------

    def work(self, ins: Instr) -> float:
        """Seconds of a compute instruction on an idle device, after the host time it waits for."""
        return self.compute.time(ins.op, ins.flops, ins.bytes, ins.phase, ins.keys, ins.gemm_groups) + ins.host_s

    def transfer_sms(self, ins: Instr) -> int:
        """SMs transfer `ins` takes from its ranks' compute while in flight (`simexec.sim.overlap`)."""
        return self.overlap.held(ins)

    def compute_rate(self, held: int) -> float:
        """Compute speed (1 = idle device) while the rank's transfers in flight hold `held` SMs."""
        return self.overlap.rate(held)

    def host_work(self, ins: Instr) -> float:
        """Parameters a CPU optimizer step updates."""
        return self.compute.cpu_optimizer_params(ins.flops, ins.bytes)

    def reprice(self, instrs: list[Instr], work: list[float]) -> None:
        """The machine's last word on `work` (per instruction, in program order) once the whole
        program is known: a device's prices stand as `work` and `host_work` gave them."""

    def issue_clock(self) -> Optional[tuple[list[float], list[bool]]]:
        """Per instruction, the host thread's seconds to issue it and whether it waits for the device
        first, where an eager host issues the device's operators (`dispatch_clock`); else None."""
        return dispatch_clock(self.cluster, self.program)

    # --- transfers -------------------------------------------------------------------------------

    def collective(self, ins: Instr):
        counts = exchanges_counts(ins)
        key = (ins.op, ins.group, ins.bytes, counts)
        out = self._phases.get(key)
        if out is None:
            out = self.network.collective(ins.collective, ins.group, ins.bytes)
            if counts:  # the token counts' all-to-all first (latency-bound: a few bytes per expert)
                out = self.network.collective("alltoall", ins.group, 0.0) + out
            self._phases[key] = out
        return out

    def comm_ranks(self, ins: Instr) -> tuple[int, ...]:
        """Present ranks whose compute a collective slows down."""
        out = self._members.get(ins.group)
        if out is None:
            out = self._members[ins.group] = self.network.geometry(ins.group).present
        return out

    def p2p(self, src: int, dst: int, nbytes: float):
        return self.network.p2p(src, dst, nbytes)

    def p2p_ranks(self, ins: Instr) -> tuple[int, ...]:
        present = self.network.present
        return (ins.rank, ins.peer) if ins.peer in present else (ins.rank,)

    def copy(self, ins: Instr):
        direction = "d2h" if ("d2h" in ins.stream or ins.op == "d2h") else "h2d"
        return self.network.copy(ins.rank, direction, ins.bytes)

    def cpu_step(self, ins: Instr, params: float):
        return self.network.cpu_step(ins.rank, params)

    def start_collective(self, ins: Instr, ranks: tuple[int, ...], finish: Callable[[], None]) -> None:
        """Run a collective among `ranks`; `finish()` when it is over."""
        FluidTransfer(self.fluid, self.collective(ins), finish)

    def start_p2p(self, ins: Instr, src: int, dst: int, ranks: tuple[int, ...], finish: Callable[[], None]) -> None:
        """Move a message from `src` to `dst`; `finish()` when it has arrived."""
        FluidTransfer(self.fluid, self.p2p(src, dst, ins.bytes), finish)

    def start_copy(self, ins: Instr, finish: Callable[[], None]) -> None:
        FluidTransfer(self.fluid, self.copy(ins), finish)

    def start_cpu_step(self, ins: Instr, params: float, finish: Callable[[], None]) -> None:
        FluidTransfer(self.fluid, self.cpu_step(ins, params), finish)


class SharedCoresMachine(Machine):
    """CPU ranks whose threads share one host's cores (`simexec.sim.host.model`): compute, copies and
    host steps cost CPU-seconds on a core, each rank's thread also pays for handling its collectives
    and messages, and a transfer's steps need a core of every member."""

    def __init__(self, cluster: ClusterSpec, program: Program, dtype: str = "bf16"):
        super().__init__(cluster, program, dtype)
        # the host model reads the dtype from the program's plan
        self.host = HostCosts(cluster, program)
        self.cores = None  # the host's cores, once bound to a run

    def bind(self, env) -> Fluid:
        fluid = super().bind(env)
        self.cores = self.host.cores_for(env)
        return fluid

    def reprice(self, instrs: list[Instr], work: list[float]) -> None:
        """Compute, copies and host steps cost CPU-seconds on a core (`HostCosts.cpu_seconds`), and
        the rank's thread handles its collectives and messages between two compute instructions
        (`HostCosts.issue_split`): what it does before the call joins the compute instruction before
        it in program order (the first compute after it, where none comes before), what it does once
        the result is waited for joins the first compute after it."""
        host = self.host
        for k, ins in enumerate(instrs):
            if ins.kind in ("compute", "copy"):
                work[k] = host.cpu_seconds(ins)
        owner, pending, rank = -1, 0.0, None
        for k, ins in enumerate(instrs):
            if ins.rank != rank:
                if owner >= 0:  # what the rank's last collectives leave once waited: its last compute
                    work[owner] += pending
                owner, pending, rank = -1, 0.0, ins.rank
            if ins.kind == "compute" and not (ins.op == "cpu_optimizer" or ins.stream == "host"):
                owner = k
                work[k] += pending
                pending = 0.0
            elif ins.kind in ("collective", "send", "recv"):
                before, after = host.issue_split(ins)
                if owner >= 0:
                    work[owner] += before
                else:
                    pending += before
                pending += after
        if owner >= 0:
            work[owner] += pending

    def issue_clock(self) -> None:
        """The ranks' threads issue their operators on the cores themselves (`reprice`)."""
        return None

    def start_collective(self, ins: Instr, ranks: tuple[int, ...], finish: Callable[[], None]) -> None:
        self.host.transfer(self.fluid.env, self.cores, ins, ranks, finish)

    def start_p2p(self, ins: Instr, src: int, dst: int, ranks: tuple[int, ...], finish: Callable[[], None]) -> None:
        self.host.transfer(self.fluid.env, self.cores, ins, ranks, finish)


def machine_for(cluster: ClusterSpec, program: Program, dtype: str = "bf16") -> Machine:
    """The machine that runs `program` on `cluster`: shared cores where its CPU ranks share a host's
    (`costs.cores_shared`), else a device per rank."""
    if shares_cores(cluster):
        return SharedCoresMachine(cluster, program, dtype)
    return Machine(cluster, program, dtype)
