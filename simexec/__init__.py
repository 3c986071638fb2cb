"""simexec: plan, simulate and execute parallel training of large models.

`import simexec` stays light (no torch, no ray): the executor lives in `simexec.exec` and is
imported only when a real run is asked for.
"""
from simexec.errors import PlanError, SimexecError, SpecError

__version__ = "0.1.0"
__all__ = ["PlanError", "SimexecError", "SpecError", "simulate", "__version__"]


def simulate(*args, **kwargs):
    """Predict one training step; see `simexec.sim.simulate.simulate`."""
    from simexec.sim.simulate import simulate as run_simulation

    return run_simulation(*args, **kwargs)
