"""The project's own errors: every user mistake surfaces as one of these, with one line that names it."""


class SimexecError(Exception):
    """Base of every error a user can cause (bad spec, bad plan, bad file, bad flag)."""


class SpecError(SimexecError):
    """A model or cluster description is malformed or inconsistent."""


class PlanError(SimexecError):
    """A plan breaks a rule of parallel training for the given model and cluster."""


class TraceError(SimexecError):
    """A trace file is unreadable or does not belong with another trace."""


class OutputError(SimexecError):
    """An output file or folder cannot be written where the user asked."""


class ExecError(SimexecError):
    """A real run failed: a rank died, hung or raised."""
