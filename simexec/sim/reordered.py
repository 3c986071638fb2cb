"""The same step in the order that lowers the peak (`simexec.program.reorder`), simulated beside the original.

The reorder trades overlap for memory: a weight pass moved out of its bubble, a gather no longer issued
ahead. Both orders are simulated, so the report holds the memory saved beside the step time it costs.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from simexec.program.instructions import Program
from simexec.program.reorder import reorder_program


@dataclass
class ReorderedStep:
    """The reordered program's prediction (bytes, seconds) and how many instruction units moved."""

    moved: int
    step_time_s: float
    peak_memory_bytes: float
    peak_tensor_bytes: float
    planned_peak_bytes: float
    peak_memory_bytes_per_rank: dict[int, float]

    def to_json(self) -> dict:
        out = asdict(self)
        out["peak_memory_bytes_per_rank"] = {str(r): b for r, b in self.peak_memory_bytes_per_rank.items()}
        return out

    def format(self, original) -> str:
        from simexec.sim.simulate import byte_size

        dt = self.step_time_s / original.step_time_s - 1.0 if original.step_time_s else 0.0
        planned = f", planned {byte_size(self.planned_peak_bytes)}" if self.planned_peak_bytes else ""
        return (f"    reordered for memory ({self.moved} moves): peak {byte_size(self.peak_memory_bytes)}"
                f" (tensors {byte_size(self.peak_tensor_bytes)}{planned}), step time {self.step_time_s:.4g} s"
                f" ({100 * dt:+.1f}%)")


def simulate_reordered(rp, program: Program, memory_margin_bytes: float = 0.0) -> ReorderedStep:
    """Reorder `program` and simulate it (with its offline plan on GPU ranks)."""
    from simexec.sim.simulate import simulate_program

    result = reorder_program(program)
    sim = simulate_program(rp, result.program, memory_margin_bytes=memory_margin_bytes, memory_plan=True,
                           reorder=False)
    return ReorderedStep(result.moved, sim.step_time_s, sim.peak_memory_bytes, sim.peak_tensor_bytes,
                         sim.planned_peak_bytes, sim.peak_memory_bytes_per_rank)
