"""Optimizer, parameter groups and the learning rate as a pure function of the step, shared by the engines.

The LR is set before every update from the step number, never restored from a saved scheduler, so a
resumed run (even one whose ``train.steps`` was raised) follows exactly the schedule of an uninterrupted run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from tessera.config.schema import OptimSection, Recipe


def lr_factor(step: int, *, optim: OptimSection, total_steps: int) -> float:
    """Multiplier of ``optim.lr`` for the update applied at 0-based ``step``: linear warmup, then cosine /
    linear decay to ``min_lr``, or constant."""
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


class LRSchedule:
    """``set(optimizer, step)``: the LR of 1-based ``step`` into every parameter group."""

    def __init__(self, recipe: Recipe) -> None:
        self.optim, self.total = recipe.optim, recipe.train.steps

    def lr(self, step: int) -> float:
        return self.optim.lr * lr_factor(step - 1, optim=self.optim, total_steps=self.total)

    def set(self, optimizer: Any, step: int) -> float:
        lr = self.lr(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr


def param_groups(named_params: Iterable[tuple[str, torch.nn.Parameter]], weight_decay: float) -> list[dict]:
    """No weight decay on biases and norm weights (1-D tensors), the usual LLM practice."""
    decay, no_decay = [], []
    for _, p in named_params:
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(
    recipe: Recipe, named_params: Iterable[tuple[str, torch.nn.Parameter]], *, device: str, offload: bool
) -> torch.optim.Optimizer:
    """torch AdamW (bit-exact resume, no JIT build), or DeepSpeed's fused / CPU Adam when asked for."""
    o = recipe.optim
    groups = param_groups(named_params, o.weight_decay)
    if o.name == "deepspeed_adam":
        # JIT-built C++/CUDA ops (cached under ~/.cache/torch_extensions after the first build)
        if offload or device == "cpu":
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(groups, lr=o.lr, betas=o.betas, eps=o.eps, adamw_mode=True)
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam(groups, lr=o.lr, betas=o.betas, eps=o.eps, adam_w_mode=True)
    return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, foreach=False)


MOMENTS = ("exp_avg", "exp_avg_sq")


def adam_state(inner: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, Any]:
    """torch AdamW's state of ``p``, created as AdamW creates it at its first step when it does not
    exist yet (a fresh optimizer that is about to load or receive state)."""
    st = inner.state[p]
    if not st:
        st.update(
            step=torch.zeros((), dtype=torch.float32),
            exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
            exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format),
        )
    return st


def materialize_adam_state(inner: torch.optim.Optimizer) -> None:
    for group in inner.param_groups:
        for p in group["params"]:
            adam_state(inner, p)


def set_adam_step(inner: torch.optim.Optimizer, step: int) -> None:
    """Every parameter's own step counter (AdamW adds 1 to each per update: they must not be shared)."""
    for st in inner.state.values():
        if "step" in st:
            st["step"] = (
                torch.full((), float(step), dtype=torch.float32) if torch.is_tensor(st["step"]) else step
            )


class ZeroMoments(Mapping[str, torch.Tensor]):
    """Zeros shaped like each weight: AdamW's state before its first update (an HF source has none)."""

    def __init__(self, weights: Mapping[str, torch.Tensor]) -> None:
        self._w = weights

    def __getitem__(self, key: str) -> torch.Tensor:
        return torch.zeros_like(self._w[key], dtype=torch.float32)

    def __iter__(self) -> Iterator[str]:
        return iter(self._w)

    def __len__(self) -> int:
        return len(self._w)


def initial_moments(moments: Mapping[str, Mapping[str, torch.Tensor]], step: int) -> bool:
    """Whether ``moments`` at ``step`` are AdamW's initial state (:class:`ZeroMoments`, step 0): a
    conversion's writer then writes zeros without reading them."""
    return step == 0 and all(isinstance(moments[k], ZeroMoments) for k in MOMENTS)
