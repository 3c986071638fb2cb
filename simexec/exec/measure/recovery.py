"""What a killed and restarted run lost, measured (`simexec.resilience` sets the goodput model's
prediction beside it).

Measured (wall clock, one host): the kill (the rank notes the time before `os._exit`), the restarted
run's steps (every rank's [step, begin, end, loss], `simexec.exec.rank.interpreter.run_rank`):

- restart_s: kill -> the first restarted step begins: the driver noticing the dead actor, tearing
  down, new actors, rendezvous, loading the checkpoint;
- redo_s: the restarted steps before the killed step (work the checkpoint did not hold);
- lost_s = restart_s + redo_s: kill -> the run is back where it was killed;
- kill_to_first_step_s: kill -> the first restarted step ends;
- first_step_of_a_start_s: the first run's first step, a warm-up (first allocations, lazy set-up)
  that the first restarted step pays again and the goodput model does not price.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class StepSpan:
    begin: float  # wall clock, the first rank to begin it
    end: float  # wall clock, the last rank to end it


def step_spans(progress_by_rank: dict[int, list]) -> dict[int, StepSpan]:
    """Per step: when its first rank began it and its last rank ended it."""
    begins: dict[int, float] = {}
    ends: dict[int, float] = {}
    for rows in progress_by_rank.values():
        for step, t0, t1, _ in rows:
            begins[step] = min(t0, begins.get(step, t0))
            ends[step] = max(t1, ends.get(step, t1))
    return {s: StepSpan(begins[s], ends[s]) for s in sorted(begins)}


def _span_s(spans: dict[int, StepSpan], step: int) -> Optional[float]:
    return spans[step].end - spans[step].begin if step in spans else None


def step_losses(progress_by_rank: dict[int, list]) -> dict[int, float]:
    """Per step: the loss (every rank that reports one reports the global batch's)."""
    out: dict[int, float] = {}
    for rows in progress_by_rank.values():
        for step, _, _, loss in rows:
            if loss is not None:
                out.setdefault(step, loss)
    return out


def recovery_report(*, kill_rank: int, kill_step: int, kill_wall_s: float, detected_wall_s: float,
                    torn_down_wall_s: float, every: int, resumed_from: int, healthy_step_s: Optional[float],
                    save_s: Optional[float], load_s: Optional[float], restarted: dict[int, list],
                    before: dict[int, list], steps: int) -> dict:
    spans = step_spans(restarted)
    first = spans[resumed_from]
    back = spans[kill_step].begin if kill_step in spans else first.begin
    restart = first.begin - kill_wall_s
    redo = back - first.begin
    redone = kill_step - resumed_from
    measured = {"restart_s": restart, "detect_s": detected_wall_s - kill_wall_s,
                "teardown_s": torn_down_wall_s - detected_wall_s, "load_s": load_s, "redo_s": redo,
                "lost_s": restart + redo, "kill_to_first_step_s": first.end - kill_wall_s,
                "healthy_step_s": healthy_step_s, "checkpoint_save_s": save_s,
                "first_step_of_a_start_s": _span_s(step_spans(before), 0),
                "redone_step_s": [spans[s].end - spans[s].begin for s in range(resumed_from, kill_step)]}
    losses = step_losses(before)
    losses.update(step_losses(restarted))
    return {"killed": {"rank": kill_rank, "step": kill_step}, "checkpoint_every": every,
            "resumed_from_step": resumed_from, "steps_redone": redone, "measured": measured,
            "losses_all_steps": [losses.get(s) for s in range(steps)]}

