"""Learning-rate schedules: linear warmup, then cosine / linear decay to ``min_lr``, or constant."""

from __future__ import annotations

import math

from tessera.config.schema import OptimSection


def lr_factor(step: int, *, optim: OptimSection, total_steps: int) -> float:
    """Multiplier of ``optim.lr`` for the update applied at 0-based ``step``."""
    if optim.warmup_steps and step < optim.warmup_steps:
        return (step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - optim.warmup_steps)
    progress = min(1.0, (step - optim.warmup_steps) / decay_steps)
    floor = optim.min_lr / optim.lr
    if optim.schedule == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
