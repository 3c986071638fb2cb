"""The hardware the engine runs a program on: compute costs, the network and its shared links.

The engine asks it how long a compute instruction takes at full speed, how fast compute runs while
transfers are in flight, and which phases over which links a collective, message, copy or CPU
optimizer step needs.
"""
from __future__ import annotations

from simexec.specs.cluster import ClusterSpec
from simexec.program.instructions import Instr, Program
from simexec.sim.compute import ComputeModel
from simexec.sim.host.model import exchanges_counts
from simexec.sim.network import Fluid, Network


class Machine:
    """One cluster, seen from the program's present ranks."""

    def __init__(self, cluster: ClusterSpec, program: Program, dtype: str = "bf16"):
        self.cluster = cluster
        self.compute = ComputeModel(cluster, dtype)
        self.network = Network(cluster, program.ranks, program.represents or {})
        self.slow_rate = 1.0 / cluster.costs.overlap_slowdown
        self.fluid: Fluid | None = None
        self._members: dict[tuple[int, ...], tuple[int, ...]] = {}
        self._phases: dict[tuple, tuple] = {}

    def bind(self, env) -> Fluid:
        """Links as resources of one simulation run."""
        self.fluid = Fluid(env, self.network.capacity)
        return self.fluid

    # --- compute ---------------------------------------------------------------------------------

    def work(self, ins: Instr) -> float:
        """Seconds of a compute instruction on an idle device."""
        return self.compute.time(ins.op, ins.flops, ins.bytes)

    def compute_rate(self, transfers_in_flight: int) -> float:
        """Compute speed (1 = idle device) while `transfers_in_flight` transfers of the rank run:
        communication kernels take SMs and memory bandwidth from compute (`overlap_slowdown`)."""
        return self.slow_rate if transfers_in_flight else 1.0

    def host_work(self, ins: Instr) -> float:
        """Parameters a CPU optimizer step updates."""
        return self.compute.cpu_optimizer_params(ins.flops, ins.bytes)

    def cpu_step(self, ins: Instr, params: float):
        return self.network.cpu_step(ins.rank, params)

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
