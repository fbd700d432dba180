"""Resume at another layout, and ``tessera convert --to ENGINE``, on the target layout's ranks.

The worker calls these between building the engine and the first step: rank 0 stages the source
(:mod:`tessera.checkpoint.reshard`) unless the target engine reshards it while loading (its registry
entry's ``reshard_on_load``: megatron-core's dist_checkpointing); the engine (built with the staged
weights) takes its share of the Adam moments and step count; the result
is saved as a checkpoint of this layout, verified offline against the source on rank 0, recorded in the
manifest and announced.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tessera.errors import CheckpointError, TesseraError
from tessera.plan.layout import ParallelLayout
from tessera.rundir import RunDir
from tessera.train.loop import RunContext


def on_rank0(fn: Any) -> Any:
    """``fn()`` on rank 0 only; its result, or its CheckpointError, on every rank."""
    from tessera.comm.groups import all_gather_object

    out, err = None, None
    if int(os.environ.get("RANK", 0)) == 0:
        try:
            out = fn()
        except TesseraError as e:
            err = (e.message, e.field, e.value, e.fix)
    out, err = all_gather_object((out, err))[0]
    if err is not None:
        msg, field, value, fix = err
        raise CheckpointError(msg, field=field, value=value, fix=fix)
    return out


def engine_reshards_on_load(meta: dict[str, Any], layout: ParallelLayout) -> bool:
    """Whether the engine of ``layout`` loads checkpoint ``meta`` resharding it itself
    (``Engine.load_resharded``), so that no stage is written: its registry entry's ``reshard_on_load``
    says so (e.g. :func:`tessera.engines.megatron_reader.reshards_on_load`); an engine without one never."""
    from tessera.tables.engines import engine_hook

    reshards = engine_hook(layout.engine, "reshard_on_load")
    return bool(reshards(meta, layout)) if reshards is not None else False


def stage_on_rank0(src: Path, run_dir: RunDir) -> Path:
    """Rank 0 writes the layout-free stage of checkpoint ``src`` (see :mod:`tessera.checkpoint.reshard`)."""
    from tessera.checkpoint.reshard import remove_stage, stage

    where = run_dir.reshard_stage(src.name)

    def write() -> None:
        from tessera.hostmem import give_back

        remove_stage(where)  # a stale one of a failed attempt
        stage(src, where)
        give_back()  # before this rank builds its engine (or writer)

    on_rank0(write)
    return where


def import_reshard(
    ctx: RunContext,
    src: tuple[Path, dict[str, Any]] | None,
    stage_dir: Path | None,
    *,
    tag: str | None,
    verify: bool = True,
    release: bool = False,
) -> tuple[Path, dict[str, Any]]:
    """The engine was built with the staged weights: give it the moments and step count, save it as a
    checkpoint of this layout, verify that against the source offline, record it. ``src`` None: an HF
    directory (``stage_dir``), no optimizer state: step 0 with fresh moments. ``stage_dir`` None: the
    engine loads and reshards the source itself (:func:`engine_reshards_on_load`). ``release``: nothing
    trains after this (``tessera convert``): the engine is closed and let go once saved, before the
    verification reads both sides (``ctx.engine`` is None afterwards)."""
    from tessera.checkpoint.manager import rng_file_name, set_rng_state
    from tessera.checkpoint.reshard import (
        STAGE_INFO,
        layout_tag,
        remove_stage,
        stage_moments,
        summary_of,
        verify_against_stage,
    )
    from tessera.checkpoint.verify import compare, open_side
    from tessera.engines.optim import MOMENTS, ZeroMoments
    from tessera.tensorfile import LazyTensors, load_tensors_and_meta

    # a conversion's writer (the engine's registry entry names one) writes the files without the model
    writer = getattr(ctx.engine, "holds_state", True) is False
    by = f"stage + {type(ctx.engine).__name__} (no model in memory)" if writer else "stage + engine import"
    if stage_dir is None:
        assert src is not None
        by = ctx.engine.load_resharded(src[0])
        step, sampler = int(src[1]["step"]), src[1]["sampler"]
    elif src is None:
        zeros = ZeroMoments(LazyTensors.of_dir(stage_dir))
        ctx.engine.import_optimizer(dict.fromkeys(MOMENTS, zeros), 0)  # AdamW's own initial state
        step, sampler = 0, ctx.sampler.state_dict()
    else:
        info = json.loads((stage_dir / STAGE_INFO).read_text())
        ctx.engine.import_optimizer(stage_moments(stage_dir), int(info["adam_step"]))
        step, sampler = int(info["step"]), info["sampler"]
    if src is not None and (src[0] / rng_file_name(ctx.rank)).is_file():
        # this rank's RNG streams continue where the source rank of that number left them
        set_rng_state(*load_tensors_and_meta(src[0] / rng_file_name(ctx.rank)))
    # in line, not in the background: nothing runs beside this save, and a background save would first
    # snapshot (copy) the rank's whole state: weights and moments twice at the conversion's peak
    background, ctx.ckpt.background = ctx.ckpt.background, False
    try:
        path = ctx.ckpt.save(
            step, ctx.engine, describe=ctx.describe, sampler=sampler, manifest=ctx.manifest, tag=tag
        )
    finally:
        ctx.ckpt.background = background
    ctx.ckpt.finish()  # complete before it is checked and named in the manifest
    if release:  # its weights, gradients and moments are not needed beside the verification's models
        from tessera.hostmem import give_back

        ctx.engine.close()
        ctx.engine = None  # type: ignore[assignment]
        give_back()

    def check() -> dict[str, Any] | None:
        if not verify:
            if src is not None and stage_dir is not None:
                remove_stage(stage_dir)
            return None
        if stage_dir is None or src is None:  # against the source itself: a checkpoint / an HF directory
            source = open_side(src[0] if src else stage_dir)  # type: ignore[arg-type]
            report = compare(source, open_side(path), prompts=2, source_tokens=False)
        else:
            report = verify_against_stage(stage_dir, path)
            remove_stage(stage_dir)
        ctx.run_dir.write_json(RunDir.reshard_report(path.name), report)
        return report

    report = on_rank0(check)
    record = {
        "from": str(src[0] if src else stage_dir),
        "by": by,
        "from_engine": src[1]["engine"] if src else "hf",
        "from_layout": layout_tag(src[1]["layout"]) if src else None,
        "to": str(path),
        "to_layout": layout_tag(ctx.layout.to_dict()),
        "step": step,
        "verify": summary_of(report) if report else "skipped (--no-verify)",
    }
    if report and not report["ok"]:
        bad = [r["name"] for r in report["tensors"] if not r["equal"]]
        raise CheckpointError(
            "the resharded checkpoint does not verify against its source: "
            + ", ".join((bad or (report.get("optimizer") or {}).get("differ") or ["logits"])[:4]),
            field="checkpoint",
            value=str(path),
            fix=f"report this as a bug; resume with --same-layout on the source layout ({record['from_layout']})",
        )
    ctx.manifest["resharded"] = record
    if ctx.is_rank0:
        v = record["verify"]
        what = f"{Path(record['from']).name} ({record['from_layout'] or 'hf'}) -> {path.name} ({record['to_layout']})"
        if report is None:
            print(f"[tessera] resharded {what}; not verified (--no-verify)", flush=True)
        else:
            moments = "bit-exact" if v["moments_equal"] else "none (fresh optimizer)"
            print(
                f"[tessera] resharded {what}; verified: {v['tensors_equal']} tensors bit-exact, "
                f"Adam moments {moments}, logits max |diff| {v['logits_max_abs_diff']:.2g}",
                flush=True,
            )
    return path, ctx.ckpt.verify(path)
