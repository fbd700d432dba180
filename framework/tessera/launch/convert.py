"""``tessera convert SRC --to ENGINE``: the target layout's ranks reshard a checkpoint (or an HF directory)
into a new run directory's first checkpoint and verify it against the source.

Orchestration only, from the pieces ``tessera run`` starts its ranks with (:mod:`tessera.launch.runs`:
the recipe checks, the launcher command, the supervised ranks): the source is checked (an HF directory's
weights readable, a checkpoint's checksums) before anything starts, the run directory is built in a
temporary directory beside ``--out`` (its recipe, prepared data and plan, as rank 0 of a run prepares
them), the ranks reshard (:mod:`tessera.train.resharding`), the conversion record is written, and only
then is the directory renamed to ``--out``; a failure leaves nothing there.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

from tessera.launch.runs import validate
from tessera.launch.supervise import supervise_ranks
from tessera.rundir import RunDir


def _console():
    from rich.console import Console

    return Console()


def convert_to_layout(
    src: Path,
    out: Path,
    *,
    to: str,
    layout: str | None = None,
    recipe: str | None = None,
    dtype: str | None = None,
    verify: bool = True,
) -> tuple[int, dict[str, Any] | None]:
    """Reshard ``src`` (a checkpoint, a run directory's latest, or an HF directory) to engine ``to`` at the
    layout ``layout`` (``--layout k=v,...``) into the new run directory ``out``, resumable with the
    recipe ``recipe`` (default: the source run's own). ``dtype``: the training precision. Returns the
    ranks' exit code and the conversion record (None when they failed: nothing was written to ``out``)."""
    from tessera.checkpoint.convert import check_out, layout_overrides, source_recipe, write_conversion_record
    from tessera.checkpoint.index import verify_or_raise
    from tessera.checkpoint.sources import is_hf_dir, resolve_source
    from tessera.launch.modes import build_command
    from tessera.train.prepare import plan_record, prepare_run_dir

    out = Path(out).resolve()
    check_out(out)
    src = Path(src).resolve()
    if is_hf_dir(src):
        from tessera.checkpoint.verify import open_side

        open_side(src)  # readable weights, or an error naming the file, before anything starts
        world = None
    else:
        src = resolve_source(src)
        world = int(verify_or_raise(src)["world_size"])
    overrides = layout_overrides(layout, engine=to, source_world=world)
    if world is None:  # an HF directory: the run trains that model, from those weights
        overrides += ["model.hf_config=null", f"model.path={src}", "model.pretrained=true"]
    overrides += [f"run.out_dir={out}"] + ([f"train.precision={dtype}"] if dtype else [])
    resolved, parallel, device = validate(str(source_recipe(src, recipe)), overrides)
    run_recipe = resolved.recipe
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        prepare_run_dir(run_recipe, RunDir(tmp), root=Path.cwd())
        RunDir(tmp).write_json(RunDir.PLAN, plan_record(resolved, parallel, device))
        worker_args = ("--convert-from", str(src)) + (() if verify else ("--no-verify",))
        cmd, env = build_command(run_recipe, tmp, resume=False, device=device, worker_args=worker_args)
        _console().print(
            f"[bold]convert[/] {src} -> {to} {parallel.describe()} on {parallel.world_size} rank(s)"
        )
        rc, _ = supervise_ranks(cmd, env, RunDir(tmp), run_recipe.run.world_size, what="conversion")
        if rc != 0:
            print(f"tessera: nothing written to {out}", file=sys.stderr)
            return rc, None
        rec = write_conversion_record(tmp, src, to)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0, rec
