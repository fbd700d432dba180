"""Learning-rate schedules: linear warmup, then cosine / linear decay to ``min_lr``, or constant."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

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


def build_scheduler(optimizer: torch.optim.Optimizer, optim: OptimSection, total_steps: int):
    """A LambdaLR, so the engine checkpoints its position with the optimizer."""
    fn: Callable[[int], float] = lambda s: lr_factor(s, optim=optim, total_steps=total_steps)  # noqa: E731
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
