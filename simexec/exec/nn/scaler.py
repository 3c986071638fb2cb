"""The fp16 loss scale from step to step, shared by the executor's ranks and the reference.

Static (`loss_scale_window=0`): the scale never changes, and a step whose gradients overflowed is
skipped (Megatron-LM's `--loss-scale`). Dynamic (`loss_scale_window=N`): Megatron-LM's
`DynamicGradScaler` and DeepSpeed's `DynamicLossScaler`, which start high and find the largest scale
the gradients bear. An overflow costs one of `loss_scale_hysteresis` lives, and with none left halves
the scale (never below 1); N clean steps in a row double it and restore the lives. Every rank sees
the same overflow flag (all-reduced over the world), so every rank's scale moves the same way.
"""
from __future__ import annotations

from dataclasses import dataclass, field

MIN_SCALE = 1.0  # Megatron-LM's --min-loss-scale and DeepSpeed's min_loss_scale default
GROWTH = 2.0  # both frameworks' growth factor; the back-off is its inverse


@dataclass
class LossScaler:
    scale: float  # the next step's
    window: int = 0  # clean steps that double the scale; 0: static
    hysteresis: int = 2  # overflows tolerated before a back-off
    clean_steps: int = field(default=0, init=False)  # clean steps since the last overflow or growth
    lives: int = field(default=0, init=False)  # overflows left before the scale halves
    scales: list[float] = field(default_factory=list, init=False)  # the scale each step's backward started from
    skipped: list[int] = field(default_factory=list, init=False)  # the steps whose gradients overflowed

    def __post_init__(self) -> None:
        self.lives = self.hysteresis

    @classmethod
    def of(cls, plan) -> "LossScaler":
        """The plan's scaler; scale 1 (no scaling) when the plan has no loss_scale."""
        return cls(plan.loss_scale or 1.0, plan.loss_scale_window, plan.loss_scale_hysteresis)

    def update(self, overflow: bool) -> None:
        """After a step: back off on an overflow (once the lives are spent), grow after a clean window."""
        if overflow:
            self.skipped.append(len(self.scales))
        self.scales.append(self.scale)
        if not self.window:
            return
        if overflow:
            self.clean_steps = 0
            self.lives -= 1
            if self.lives <= 0:
                self.scale = max(self.scale / GROWTH, MIN_SCALE)
            return
        self.clean_steps += 1
        if self.clean_steps == self.window:
            self.clean_steps = 0
            self.lives = self.hysteresis
            self.scale *= GROWTH
