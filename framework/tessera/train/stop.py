"""Stop rules: callbacks that end a run when continuing would waste the cluster or the checkpoint."""

from __future__ import annotations

import math
from typing import Any

from tessera.errors import TrainingDiverged
from tessera.train.loop import Callback, RunContext


class NonFiniteStop(Callback):
    """NaN or Inf in the loss or the gradient norm ends the run before anything records or saves that
    step (exit code DIVERGED; ``latest`` keeps the last good checkpoint). A missing norm (``None``: the
    engine reports none) is not a divergence. Every rank sees the same global values, so all stop together."""

    def on_step_end(self, ctx: RunContext, rec: dict[str, Any], ops: list[dict[str, Any]]) -> None:
        bad = [k for k in ("loss", "grad_norm") if rec[k] is not None and not math.isfinite(rec[k])]
        if bad:
            ctx.records.pop()  # the diverged step is not a result
            what = ", ".join(f"{k} {rec[k]}" for k in bad)
            raise TrainingDiverged(f"step {rec['step']}: {what}")
