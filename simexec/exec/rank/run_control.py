"""What the driver asks of the ranks beyond running their program: slow down, checkpoint, resume, die.

Torch-free, so that the command line can check the flags before any rank starts. The ranks receive
one `RunControl` (the same for all; each reads its own entries):

- `slow`: real rank -> F; a slowed rank computes F times as long (`simexec.exec.rank.interpreter`).
  The command line parses `--slow` with the simulator's own parser (`simexec.resilience`), so it
  means the same to `simulate` and `execute`.
- `checkpoint_dir` / `checkpoint_every`: every rank saves its state with torch.distributed.checkpoint
  after steps K, 2K, ... into `<dir>/step_<K>` (`simexec.exec.rank.checkpoint`).
- `resume_from` / `start_step`: the checkpoint to load and the step it ends before.
- `kill_rank` / `kill_step`: that rank leaves with `os._exit` as it is about to begin that step.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from simexec.errors import ExecError

CHECKPOINT_PREFIX = "step_"
KILL_RECORD = "killed.json"  # written by a rank just before it kills itself: which step, when (wall clock)
KILLED_EXIT_CODE = 17  # a killed rank's exit status (os._exit), told apart from a crash in its logs


@dataclass(frozen=True)
class RunControl:
    slow: dict[int, float] = field(default_factory=dict)
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0
    resume_from: Optional[str] = None
    start_step: int = 0
    kill_rank: Optional[int] = None
    kill_step: Optional[int] = None

    def slow_factor(self, rank: int) -> float:
        return self.slow.get(rank, 1.0)

    def saves_after(self, steps_done: int) -> bool:
        return bool(self.checkpoint_dir) and self.checkpoint_every > 0 and steps_done % self.checkpoint_every == 0

    def kills(self, rank: int, step: int) -> bool:
        return self.kill_rank == rank and self.kill_step == step


def parse_kill(text: str, world: int, steps: int) -> tuple[int, int]:
    """`rank:R:step:S` -> (R, S): rank R exits hard as it is about to begin step S (0-based)."""
    parts = text.split(":")
    if len(parts) != 4 or parts[0] != "rank" or parts[2] != "step":
        raise ExecError(f"--kill {text!r}: expected rank:R:step:S")
    try:
        rank, step = int(parts[1]), int(parts[3])
    except ValueError:
        raise ExecError(f"--kill {text!r}: R and S must be integers") from None
    if not 0 <= rank < world:
        raise ExecError(f"--kill {text!r}: rank {rank} out of range (the plan has {world} ranks)")
    if not 1 <= step < steps:
        raise ExecError(f"--kill {text!r}: step {step} must be between 1 and {steps - 1} (--steps {steps})")
    return rank, step


def checkpoint_path(directory: str, steps_done: int) -> str:
    return os.path.join(directory, f"{CHECKPOINT_PREFIX}{steps_done:06d}")


def newest_checkpoint(directory: str) -> Optional[tuple[str, int]]:
    """The newest complete checkpoint under `directory` and the steps it holds, or None. Complete:
    torch.distributed.checkpoint renames its `.metadata` into place after every rank has written."""
    if not os.path.isdir(directory):
        return None
    best = None
    for name in os.listdir(directory):
        tail = name[len(CHECKPOINT_PREFIX):]
        if name.startswith(CHECKPOINT_PREFIX) and tail.isdigit() \
                and os.path.exists(os.path.join(directory, name, ".metadata")):
            if best is None or int(tail) > best[1]:
                best = (os.path.join(directory, name), int(tail))
    return best
