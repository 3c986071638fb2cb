"""What a program was lowered from, as the host model needs it: the plan and the model.

A lowered program carries its resolved plan (`Program.resolved`), model and all. A program read back
from its text carries only its meta: its plan string parses again and its model name finds a preset,
but a model loaded from a file is unknown by name; the host model then prices without the model's
parameter tensors (one optimizer tensor a rank, no per-tensor passes of collectives or gradient
hooks) and says so in `HostCosts.model` being None.
"""
from __future__ import annotations

from typing import Optional

from simexec.errors import SimexecError
from simexec.program.instructions import Program
from simexec.specs.model import ModelSpec, get_model
from simexec.specs.plan import Plan, parse_plan


def plan_of(program: Program) -> Optional[Plan]:
    """The plan the program was lowered from, or None where neither it nor its meta says."""
    if program.resolved is not None:
        return program.resolved.plan
    try:
        return parse_plan(str(program.meta.get("plan", "")))
    except SimexecError:
        return None


def model_of(program: Program) -> Optional[ModelSpec]:
    """The program's model, or None for a program read from its text whose model is not a preset."""
    if program.resolved is not None:
        return program.resolved.model
    try:
        return get_model(str(program.meta.get("model", "")))
    except SimexecError:
        return None


def expert_parallel_size(program: Program) -> int:
    plan = plan_of(program)
    return max(1, plan.ep) if plan is not None else 1
