"""A run with slowed ranks against the same run healthy: the measured slowdown of the step."""
from __future__ import annotations

import statistics


def steady(times: list[float]) -> float:
    """The median step after the warm-up step."""
    return statistics.median(times[1:] or times)


def straggler_report(slow: dict[int, float], healthy_steps_s: list[float], slowed_steps_s: list[float],
                     healthy_cpu_s: dict[int, list[float]],
                     slowed_cpu_s: dict[int, list[float]]) -> dict:
    """Healthy and slowed runs' step times (warm-up step left out), their medians and ratio; and, per
    slowed rank, how much more CPU its own thread used a step (F x its compute, plus its
    communication's share, which is not slowed): that the slowdown happened, whatever the cores'
    other load did to the step times."""
    healthy, slowed = steady(healthy_steps_s), steady(slowed_steps_s)
    ratio = slowed / healthy if healthy > 0 else None
    cpu = {str(r): steady(slowed_cpu_s[r]) / steady(healthy_cpu_s[r]) for r in sorted(slow)
           if healthy_cpu_s.get(r) and slowed_cpu_s.get(r) and steady(healthy_cpu_s[r]) > 0}
    return {"slow": {str(r): f for r, f in sorted(slow.items())}, "healthy_step_s": healthy, "slowed_step_s": slowed,
            "measured_ratio": ratio, "slowed_rank_cpu_ratio": cpu,
            "healthy_step_times_s": healthy_steps_s, "slowed_step_times_s": slowed_steps_s}
