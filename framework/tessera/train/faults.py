"""Fault injection for tests of the stop rules and recovery: ``TESSERA_FAULT=<kind>@<step>``.

Kinds: ``nan_grad`` (every rank's first parameter gets a NaN gradient in that step's backward) and
``nan_param`` (after that step, every rank's first parameter is set to NaN, so the model state is
non-finite at the checkpoint while the step's loss and norm were finite). Active only when the variable is
set; the manifest then records it, so a faulted run is never mistaken for a real one.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tessera.errors import RecipeError
from tessera.train.loop import Callback, RunContext

ENV = "TESSERA_FAULT"
KINDS = ("nan_grad", "nan_param")


def fault_from_env() -> FaultInjection | None:
    spec = os.environ.get(ENV)
    if not spec:
        return None
    kind, _, step = spec.partition("@")
    if kind not in KINDS or not step.isdigit():
        raise RecipeError(
            "unknown fault",
            field=ENV,
            value=spec,
            fix=f"use <kind>@<step> with kind one of {', '.join(KINDS)}",
        )
    return FaultInjection(kind, int(step))


class FaultInjection(Callback):
    def __init__(self, kind: str, step: int) -> None:
        self.kind, self.step = kind, step

    def describe(self) -> str:
        return f"{self.kind}@{self.step}"

    def _param(self, ctx: RunContext) -> torch.nn.Parameter:
        return next(p for m in ctx.engine.modules() for p in m.parameters() if p.requires_grad)

    def on_run_start(self, ctx: RunContext) -> None:
        if self.kind == "nan_grad":

            def poison(grad: torch.Tensor) -> torch.Tensor:
                return torch.full_like(grad, float("nan")) if ctx.step == self.step else grad

            self._param(ctx).register_hook(poison)

    def on_step_end(self, ctx: RunContext, rec: dict[str, Any], ops: list[dict[str, Any]]) -> None:
        if self.kind == "nan_param" and rec["step"] == self.step:
            with torch.no_grad():
                self._param(ctx).fill_(float("nan"))
