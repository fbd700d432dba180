"""Resuming a run: the checkpoint it continues from, checked against the run before any engine exists
(layout, adapters, the base the adapters were trained on). Used by every rank (:mod:`tessera.train.worker`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tessera.config.schema import Recipe, same_dir
from tessera.errors import CheckpointError, TesseraError
from tessera.plan.layout import ParallelLayout
from tessera.rundir import RunDir


def resume_point(
    ckpt: Any, layout: ParallelLayout, run_dir: RunDir, *, same_layout: bool, chosen: Path | None = None
) -> tuple[Path, dict[str, Any], bool]:
    """The checkpoint to resume from, verified file by file before any engine exists, its meta, and
    whether its layout differs from this run's (it is resharded first)."""
    latest = ckpt.pick(chosen)
    if latest is None:
        raise TesseraError(
            "--resume found no complete checkpoint",
            field="run.out_dir",
            value=str(run_dir.path),
            fix="run without --resume to start fresh",
        )
    # the checksums run while the model is built and the engine loads (CheckpointManager.load waits for
    # them); a checkpoint to reshard is read by the resharding first: its checksums are waited for here
    meta = ckpt.verify(latest, any_world=not same_layout, defer_checksums=True)
    try:
        diff = check_resume_layout(meta, layout, latest, same_layout=same_layout)
    except BaseException:
        ckpt.settle(latest, gather=False)
        raise
    if diff:
        ckpt.settle(latest)
    if diff and ckpt.rank == 0:
        print(
            f"tessera: {latest.name} was written with "
            + ", ".join(f"{k}={a}" for k, a, _ in diff)
            + "; resharding it to "
            + ", ".join(f"{k}={b}" for k, _, b in diff)
            + " before the first step (--same-layout refuses instead)",
            file=sys.stderr,
            flush=True,
        )
    return latest, meta, bool(diff)


def check_resume_layout(
    meta: dict[str, Any], layout: ParallelLayout, path: Path, *, same_layout: bool
) -> list[tuple[str, Any, Any]]:
    """The layout differences between a v2 checkpoint and this run (a reshard at resume); with
    ``same_layout`` any difference is an error instead. A v1 checkpoint records no layout: it can only
    be resumed as it is (its world size was checked)."""
    from tessera.checkpoint.reshard import layout_changes

    diff = layout_changes(meta.get("layout"), layout.to_dict())
    if not isinstance(meta.get("layout"), dict) and meta["world_size"] != layout.world_size:
        raise CheckpointError(
            f"a v1 checkpoint of {meta['world_size']} ranks cannot be resharded",
            field="run.world_size",
            value=layout.world_size,
            fix=f"resume it with run.world_size={meta['world_size']} once; its next checkpoint is v2",
        )
    if diff and same_layout:
        k, was, is_ = diff[0]
        raise CheckpointError(
            f"checkpoint {path.name} was written with parallel.{k}={was!r}, this run has {is_!r}"
            + (f" (and {len(diff) - 1} more layout difference(s))" if len(diff) > 1 else ""),
            field=f"parallel.{k}",
            value=is_,
            fix="resume with the layout the checkpoint was written with ("
            + ", ".join(f"parallel.{a}={b}" for a, b, _ in diff)
            + "), or without --same-layout to reshard it",
        )
    return diff


def base_record(
    source: Any, manifest: dict[str, Any], resume_from: tuple[Path, dict[str, Any]] | None, *, same_run: bool
) -> dict[str, Any]:
    """What every checkpoint of a run with adapters names as its base (meta.json ``base``): a fresh run's
    initial weights as its manifest records them; a resume of the run, what the checkpoint it resumes
    recorded (hashing the base again would read all of it at every resume; its path must still be the
    recipe's, and convert / verify check the sha256); a conversion, the recipe's base, hashed now."""
    if resume_from is None and source.weights is None:
        return manifest["initial_weights"]
    saved = resume_from[1].get("base") if resume_from is not None and same_run else None
    if not saved:
        return source.base_identity()
    now = source.section.path if source.section.pretrained else None
    if saved.get("from") == "files" and (now is None or not same_dir(saved["path"], now)):
        raise CheckpointError(
            f"the checkpoint's adapters were trained on the base in {saved['path']}; this recipe's base is "
            f"{now or 'built from its config'}",
            field="model.path",
            value=now,
            fix=f"resume with model.path={saved['path']} model.pretrained=true (the base the adapters belong to)",
        )
    if saved.get("from") == "seed" and (now is not None or int(saved.get("seed", -1)) != source.seed):
        raise CheckpointError(
            f"the checkpoint's adapters were trained on the base drawn from seed {saved.get('seed')} (the "
            "model's config); this recipe's base is another",
            field="train.seed" if now is None else "model.path",
            value=source.seed if now is None else now,
            fix=f"resume with train.seed={saved.get('seed')} and the recipe's model config (no model.path)",
        )
    return saved


def check_resume_adapters(meta: dict[str, Any], recipe: Recipe, path: Path) -> None:
    """A checkpoint continues with the adapters it was trained with: the recipe's ``peft`` section must
    say what the checkpoint's meta.json records (a checkpoint of adapters holds no base, one of a full
    model no adapters)."""
    from tessera.models.adapters import section_dict

    saved, now = meta.get("peft"), section_dict(recipe.peft)
    if saved == now:
        return
    if saved is None or now is None:
        what = (
            "trains every weight" if saved is None else f"holds {saved['method']} adapters (r={saved['r']})"
        )
        raise CheckpointError(
            f"checkpoint {path.name} {what}; this recipe "
            + ("has adapters" if saved is None else "has none"),
            field="peft",
            value=now,
            fix="resume with the recipe's peft section as the checkpoint records it (its meta.json 'peft'), "
            "or export it (tessera convert) and start a new run from the export",
        )
    k = next(k for k in saved if saved.get(k) != now.get(k))
    raise CheckpointError(
        f"checkpoint {path.name} was trained with peft.{k}={saved[k]!r}, this recipe has {now[k]!r}",
        field=f"peft.{k}",
        value=now[k],
        fix=f"resume with peft.{k}={saved[k]!r} (the adapters' shapes and targets cannot change mid-run)",
    )
