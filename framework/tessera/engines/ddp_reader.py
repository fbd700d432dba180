"""The ddp engine's checkpoints read offline: its safetensors files, already keyed by HF names.

``model.safetensors`` holds the replica's parameters, ``optimizer.safetensors`` each parameter's Adam
moments and its step (``<name>/exp_avg``, ``<name>/exp_avg_sq``, ``<name>/step``), read lazily, one
tensor per access. Nothing here is a pickle.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tessera.engines.base import CheckpointReader
from tessera.engines.ddp import MODEL_FILE, OPTIMIZER_FILE
from tessera.errors import CheckpointError
from tessera.tensorfile import LazyTensors, load_tensors


class DDPReader(CheckpointReader):
    """The ddp engine's checkpoints (written by rank 0: the replicas are identical)."""

    def weights(self, ckpt: Path, meta: dict[str, Any]) -> dict[str, torch.Tensor]:
        return load_tensors(ckpt / MODEL_FILE)

    def moment(self, ckpt: Path, meta: dict[str, Any], kind: str) -> dict[str, torch.Tensor] | None:
        lazy = LazyTensors([ckpt / OPTIMIZER_FILE])
        return {k.rsplit("/", 1)[0]: lazy[k].float() for k in lazy if k.endswith("/" + kind)}

    def adam_step(self, ckpt: Path, meta: dict[str, Any]) -> int:
        """The step, checked against torch AdamW's own per-parameter count."""
        step = int(meta["step"])
        lazy = LazyTensors([ckpt / OPTIMIZER_FILE])
        seen = {int(lazy[k]) for k in lazy if k.endswith("/step")}
        if seen and seen != {step}:
            raise CheckpointError(
                f"the optimizer counted {sorted(seen)} updates at step {step}",
                field="checkpoint",
                value=str(ckpt / OPTIMIZER_FILE),
                fix="resume the run on its own layout once and convert the next checkpoint",
            )
        return step


READER = DDPReader()
