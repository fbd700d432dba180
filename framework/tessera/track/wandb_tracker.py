"""Weights & Biases mirror of a run: the manifest as config, one log call per step, rank 0 only.

Mode comes from the recipe (``tracking.wandb.mode``: online | offline | disabled). The W&B run id is
kept in the run directory (``RunDir.wandb_id``) so that ``--resume`` continues the same W&B run instead of starting a new one.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from tessera.config.schema import WandbSection
from tessera.rundir import RunDir


class WandbTracker:
    def __init__(self, section: WandbSection, *, run_dir: RunDir, manifest: dict[str, Any], resume: bool):
        self.enabled = section.mode != "disabled"
        self.run = None
        self.dir: str | None = None
        if not self.enabled:
            return
        import wandb

        id_file = run_dir.wandb_id
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(
            project=section.project,
            entity=section.entity,
            name=section.name or run_dir.path.name,
            tags=section.tags,
            mode=section.mode,
            dir=str(run_dir.path),
            config=manifest,
            id=run_id,
            resume="allow",
            settings=wandb.Settings(console="off", x_disable_stats=True),
        )
        self.dir = str(Path(self.run.dir).parent) if self.run is not None else None

    def log(self, record: dict[str, Any], step: int) -> None:
        if self.run is not None:
            self.run.log({k: v for k, v in record.items() if k != "step"}, step=step)

    def summary(self, values: dict[str, Any]) -> None:
        if self.run is not None:
            self.run.summary.update(values)

    def finish(self, exit_code: int = 0) -> None:
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
            self.run = None
