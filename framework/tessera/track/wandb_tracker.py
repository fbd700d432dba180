"""Weights & Biases mirror of a run: the manifest as config, one log call per step, rank 0 only.

Mode comes from the recipe (``tracking.wandb.mode``: online | offline | disabled). The W&B run id is
kept in the run directory (``RunDir.wandb_id``) so that ``--resume`` continues the same W&B run instead of
starting a new one.

Online, ``wandb.init`` waits for the server at most ``tracking.wandb.init_timeout_s`` (W&B's own
``init_timeout`` setting; its default, 90 s plus retries, kept a run without network 2.5 min before its
first step). A server that cannot be reached (no network, no API key, a timeout) then costs one warning
and the run mirrors offline (``wandb sync`` uploads it later), or, with ``tracking.wandb.required: true``,
it is an error naming that setting (exit 2).
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path
from typing import Any

from tessera.config.schema import WandbSection
from tessera.errors import RecipeError
from tessera.rundir import RunDir


def _reason(exc: BaseException) -> str:
    """W&B's error in one line (its messages go on with advice about init_timeout, which we name)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def start_wandb(section: WandbSection, **init_kw: Any) -> Any:
    """``wandb.init`` in the section's mode with a bounded wait; online with no reachable server falls
    back to offline with one warning, or raises with ``section.required``. Returns the run."""
    import wandb

    os.environ.setdefault("WANDB_SILENT", "true")

    def start(mode: str) -> Any:
        settings = wandb.Settings(console="off", x_disable_stats=True, init_timeout=section.init_timeout_s)
        return wandb.init(mode=mode, settings=settings, **init_kw)

    if section.mode != "online":
        return start(section.mode)
    try:
        return start("online")
    except (wandb.Error, TimeoutError, ConnectionError) as e:  # CommError, UsageError (no API key), ...
        reason = _reason(e)
    if section.required:
        raise RecipeError(
            f"W&B online could not start within {section.init_timeout_s:g} s: {reason}",
            field="tracking.wandb.required",
            value=True,
            fix="make the W&B server reachable (network, WANDB_BASE_URL, wandb login), raise "
            "tracking.wandb.init_timeout_s, or set tracking.wandb.required: false to mirror offline",
        )
    # the service still holds the failed run's id (a second init with it: "run ID ... is in use"): end it
    wandb.teardown()
    print(
        f"[tessera] warning: W&B online could not start within {section.init_timeout_s:g} s ({reason}); "
        "mirroring offline instead (upload later with wandb sync; tracking.wandb.required: true makes "
        "this an error)",
        file=sys.stderr,
        flush=True,
    )
    return start("offline")


class WandbTracker:
    def __init__(self, section: WandbSection, *, run_dir: RunDir, manifest: dict[str, Any], resume: bool):
        self.enabled = section.mode != "disabled"
        self.run = None
        self.dir: str | None = None
        self.run_id = ""
        if not self.enabled:
            return
        id_file = run_dir.wandb_id
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else uuid.uuid4().hex[:12]
        from tessera.atomic import write_text_atomic

        write_text_atomic(id_file, run_id + "\n")  # never through a link planted there
        self.run_id = run_id
        self.run = start_wandb(
            section,
            project=section.project,
            entity=section.entity,
            name=section.name or run_dir.path.name,
            tags=section.tags,
            dir=str(run_dir.path),
            config=manifest,
            id=run_id,
            resume="allow",
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
    run = start_wandb(
        section,
        project=section.project,
        entity=section.entity,
        name=f"compare-{out_dir.name}",
        tags=section.tags,
        dir=str(out_dir),
        config=config,
        job_type="compare",
        id=uuid.uuid4().hex[:12],
    )
    for k, v in summary.items():
        run.summary[k] = v
    named = {p.name: p for p in files}
    named.update({f"manifests/{run_name}.json": path for run_name, path in manifests.items()})
    _log_artifact(run, f"comparison-{run.id}", "comparison", named)
    where = str(Path(run.dir).parent)
    run.finish(exit_code=0)
    return where
