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
        self.run_id = ""
        if not self.enabled:
            return
        import wandb

        id_file = run_dir.wandb_id
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
        self.run_id = run_id
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

    def log_files(self, name: str, kind: str, files: dict[str, Path]) -> None:
        """An artifact of ``files`` (name in the artifact -> path), e.g. the manifest."""
        if self.run is not None:
            _log_artifact(self.run, name, kind, files)

    def summary(self, values: dict[str, Any]) -> None:
        if self.run is not None:
            self.run.summary.update(values)

    def finish(self, exit_code: int = 0) -> None:
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
            self.run = None


def _log_artifact(run: Any, name: str, kind: str, files: dict[str, Path]) -> None:
    import wandb

    art = wandb.Artifact(name=name, type=kind)
    for key, path in files.items():
        if Path(path).is_file():
            art.add_file(str(path), name=key)
    run.log_artifact(art)


def log_comparison(
    section: WandbSection,
    *,
    out_dir: Path,
    config: dict[str, Any],
    summary: dict[str, Any],
    files: list[Path],
    manifests: dict[str, Path],
) -> str | None:
    """A W&B run of ``tessera compare`` (job type ``compare``): the pre-registration as config, the
    verdict and thresholds in the summary, the report, verdict, plots and every run's manifest as one
    artifact. Returns the W&B run directory (None when W&B is disabled)."""
    if section.mode == "disabled":
        return None
    import wandb

    os.environ.setdefault("WANDB_SILENT", "true")
    run = wandb.init(
        project=section.project,
        entity=section.entity,
        name=f"compare-{out_dir.name}",
        tags=section.tags,
        mode=section.mode,
        dir=str(out_dir),
        config=config,
        job_type="compare",
        id=uuid.uuid4().hex[:12],
        settings=wandb.Settings(console="off", x_disable_stats=True),
    )
    for k, v in summary.items():
        run.summary[k] = v
    named = {p.name: p for p in files}
    named.update({f"manifests/{run_name}.json": path for run_name, path in manifests.items()})
    _log_artifact(run, f"comparison-{run.id}", "comparison", named)
    where = str(Path(run.dir).parent)
    run.finish(exit_code=0)
    return where
