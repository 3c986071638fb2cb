"""A run with slowed ranks against the same run healthy: the measured slowdown of the step."""
from __future__ import annotations

import statistics
from typing import Optional


def straggler_report(slow: dict[int, float], healthy_steps_s: list[float], slowed_steps_s: list[float],
                     predicted_ratio: Optional[float]) -> dict:
    """Healthy and slowed runs' step times (warm-up step left out), their medians and ratio."""
    healthy = statistics.median(healthy_steps_s[1:] or healthy_steps_s)
    slowed = statistics.median(slowed_steps_s[1:] or slowed_steps_s)
    ratio = slowed / healthy if healthy > 0 else None
    return {"slow": {str(r): f for r, f in sorted(slow.items())}, "healthy_step_s": healthy, "slowed_step_s": slowed,
            "measured_ratio": ratio, "predicted_ratio": predicted_ratio,
            "healthy_step_times_s": healthy_steps_s, "slowed_step_times_s": slowed_steps_s,
            "predicted_by": "simexec simulate --full --slow (the same plan, model and cluster)"}
