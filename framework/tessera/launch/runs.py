"""Starting runs from the command line's side: validate a recipe before launch, prepare its run
directory, start the ranks through the launcher and wait (``tessera run``, ``tessera convert --to ENGINE``
and each run of ``tessera compare`` go through here)."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tessera.errors import RecipeError, TesseraError
from tessera.rundir import ORDERLY_EXITS, WAIT_FLAG, ExitCode, RunDir


def _console():
    from rich.console import Console

    return Console()


def check_recipe(path: str, overrides: list[str]):
    """The checks that need no model library (torch, transformers): the recipe's schema and overrides,
    the device, the precision, the engine of a DeepSpeed JSON and the layout's arithmetic (world size,
    batch). ``tessera run`` launches the ranks after these and runs :func:`check_model` while they start.
    Returns (resolved, device)."""
    from tessera.config.loader import load_recipe
    from tessera.device import resolve_device
    from tessera.engines.registry import capabilities
    from tessera.plan.layout import batch_split

    resolved = load_recipe(path, overrides)
    recipe = resolved.recipe
    device = resolve_device(recipe.run.device)
    if recipe.train.precision == "fp16" and device == "cpu":
        raise RecipeError(
            "fp16 does not exist on the CPU",
            field="train.precision",
            value="fp16",
            fix="use train.precision: bf16 or fp32 on CPU",
        )
    engine = recipe.parallel.engine
    if recipe.parallel.deepspeed_config and "deepspeed" not in capabilities(engine).zero_impls:
        raise RecipeError(
            f"engine '{engine}' does not run DeepSpeed, so a DeepSpeed JSON would be ignored",
            field="parallel.deepspeed_config",
            value=recipe.parallel.deepspeed_config,
            fix="remove parallel.deepspeed_config, or use parallel.engine: deepspeed",
        )
    if not recipe.parallel.auto:  # the planner's layout is checked by the planner
        batch_split(recipe)
    return resolved, device


def check_model(resolved, device: str):
    """The checks that read the model's config (transformers) or build the DeepSpeed config: the
    planner's layout for ``parallel: auto`` (written into the recipe the ranks read), the layout against
    the model (heads, layers, experts per rank), the user's DeepSpeed JSON, the vocabulary, the router.
    Returns the layout."""
    from tessera.plan.layout import layout_from_recipe

    if resolved.recipe.parallel.auto:
        from tessera.plan.search import apply_plan, hardware_for, plan_recipe

        r = resolved.recipe
        plan = plan_recipe(r, world_size=r.run.world_size, hardware=hardware_for(r, device=device))
        resolved.recipe = apply_plan(r, plan)
        resolved.plan = plan.to_json()
    recipe = resolved.recipe
    layout = layout_from_recipe(recipe)
    from tessera.engines.zero import build_ds_config

    build_ds_config(recipe, layout, device=device)  # user JSON conflicts are errors before the first step
    from tessera.models.hf import check_vocab, load_hf_config

    cfg = load_hf_config(recipe.model)
    if recipe.data.tokenizer == "bpe":
        check_vocab(cfg, recipe.data.vocab_size)
    if recipe.model.moe_aux_loss_coeff:
        from tessera.models.families import family_of

        if not family_of(cfg.model_type).facts(cfg)["topk"]:
            raise RecipeError(
                f"a load-balancing loss needs a router, and this {cfg.model_type} model has no experts",
                field="model.moe_aux_loss_coeff",
                value=recipe.model.moe_aux_loss_coeff,
                fix="remove model.moe_aux_loss_coeff (or set it to 0) for a dense model",
            )
    return layout


def validate(path: str, overrides: list[str]):
    """Everything about the recipe that can be checked before launch, cheaply (the data files are checked
    where they are read: by ``load_corpus`` on a dry run, by ``prepare_run_dir`` otherwise); returns
    (resolved, layout, device)."""
    resolved, device = check_recipe(path, overrides)
    return resolved, check_model(resolved, device), device


def run_dir_of(recipe, recipe_path: str) -> Path:
    name = recipe.run.name or Path(recipe_path).stem
    return Path(recipe.run.out_dir) if recipe.run.out_dir else Path("runs") / name


def supervise_ranks(
    cmd: list[str],
    env: dict[str, str],
    rd: RunDir,
    world: int,
    *,
    what: str,
    grace_s: float = 120.0,
    watchdog: Any = None,
    prepare: Callable[[], None] | None = None,
) -> tuple[int, Any]:
    """Start the ranks and wait. A stop every rank agreed on (a stop rule, a preemption) ends with its
    own code and the diagnosis rank 0 printed; a failed rank is named with its last log lines. The exit
    code is always Tessera's (the rank's own verdict where it gave one; RANK_LOST, HUNG or FAILED
    otherwise), never the launcher's raw status. Returns (code, the failure or None)."""
    from tessera.launch.launcher import run_and_monitor

    rc, failure = run_and_monitor(
        cmd, env, rd.path, world, grace_s=grace_s, watchdog=watchdog, prepare=prepare
    )
    if failure is not None and failure.code in ORDERLY_EXITS[1:] and failure.code != ExitCode.DIVERGED:
        code = ExitCode(failure.code)
        hint = " (continue with --resume)" if code in (ExitCode.PREEMPTED, ExitCode.TIME_LIMIT) else ""
        print(f"tessera: {what} stopped: {code.name}{hint}", file=sys.stderr)
        return int(code), failure
    if failure is not None:
        _console().print(
            f"[bold red]rank {failure.rank} {failure.how}[/]; last log lines ({rd.rank_file(failure.rank, 'log')}):"
        )
        for line in failure.log_tail:
            print(f"  | {line}")
        code = failure.code if failure.code not in (None, ExitCode.TERMINATED) else ExitCode.FAILED
        print(
            f"tessera: {what} failed: rank {failure.rank} {failure.how} (exit code {int(code)})",
            file=sys.stderr,
        )
        return int(code), failure
    if rc not in (0, *(int(c) for c in ExitCode)):
        print(f"tessera: launcher exited with status {rc}; logs in {rd.logs}", file=sys.stderr)
        return int(ExitCode.FAILED), None
    return rc, None


def resume_point(index, run_dir: Path, *, resume: bool, resume_from: str | None, same_layout: bool,
                 strict: bool) -> Path | None:  # fmt: skip
    """Before launch: the checkpoint ``--resume`` reads (it must exist), or for a fresh run a directory
    without checkpoints (a fresh run would mix with them)."""
    if not resume:
        if same_layout or strict:
            flag = "--same-layout" if same_layout else "--strict"
            raise TesseraError(f"{flag} only applies to --resume", field=flag, value=True, fix="add --resume")
        if index.complete():
            raise TesseraError(
                "this run directory already holds checkpoints; a fresh run would mix with them",
                field="run.out_dir",
                value=str(run_dir),
                fix="pass --resume to continue it, or set run.out_dir (or run.name) to a new directory",
            )
        return None
    latest = index.pick(resume_from)
    if latest is None:
        raise TesseraError(
            "--resume found no complete checkpoint",
            field="run.out_dir",
            value=str(run_dir),
            fix="run without --resume to start fresh",
        )
    return latest


def announce_reshard(meta: dict[str, Any], latest: Path, layout, *, same_layout: bool) -> None:
    """A layout change between the checkpoint ``--resume`` reads (``meta``) and this run is announced
    (the ranks reshard it), or refused with ``same_layout``."""
    from tessera.train.worker import check_resume_layout

    diff = check_resume_layout(meta, layout, latest, same_layout=same_layout)
    if diff:
        print(
            f"tessera: {latest.name} was written with "
            + ", ".join(f"{k}={a}" for k, a, _ in diff)
            + "; resharding it to "
            + ", ".join(f"{k}={b}" for k, _, b in diff)
            + " before the first step (--same-layout refuses instead)",
            file=sys.stderr,
        )


def plan_record(resolved, layout, device: str) -> dict[str, Any]:
    """plan.json: the planner's full answer for ``parallel: auto``; otherwise the estimates of the
    recipe's own layout (what the run should cost, against which comm.jsonl is read)."""
    if resolved.plan is not None:
        return {"source": "planner", **resolved.plan}
    from tessera.plan.search import estimate_layout, hardware_for

    hw = hardware_for(resolved.recipe, device=device)
    return {
        "source": "recipe",
        "chosen": estimate_layout(resolved.recipe, layout, hardware=hw, recompute=layout.recompute).to_json(),
    }


def start_run(
    recipe_path: str,
    overrides: list[str],
    *,
    resume: bool = False,
    same_layout: bool = False,
    strict: bool = False,
    dry_run: bool = False,
    launch_record: dict[str, Any] | None = None,
    resume_from: str | None = None,
) -> tuple[int, RunDir]:
    """``tessera run``: check the recipe, start the ranks and wait. The checks that need no model library
    come first (:func:`check_recipe`, the run directory); then the launcher starts, and while it and the
    ranks import their libraries this process checks the model (:func:`check_model`), the checkpoint a
    resume reads, and prepares the run directory (recipe, data, plan, launch record); the ranks wait for
    that (``--wait-prepared``), and a check that fails there stops them before they read anything.
    ``launch_record``: extra keys of launch.json (``tessera compare`` records its pre-registration hash
    there, which the manifest copies). Returns the exit code and the run dir."""
    from tessera.checkpoint.index import CheckpointIndex
    from tessera.launch.launcher import build_command

    resolved, device = check_recipe(recipe_path, overrides)
    layout = check_model(resolved, device) if dry_run else None  # a dry run checks all before the command
    recipe = resolved.recipe
    run_dir = run_dir_of(recipe, recipe_path).resolve()
    rd = RunDir(run_dir)
    for note in resolved.notes:
        print(f"tessera: note: {note}", file=sys.stderr)
    if resume_from is not None:
        resume = True
    flags = (("--same-layout",) if same_layout else ()) + (("--strict",) if strict else ())
    flags += (
        ("--resume-from", str(Path(resume_from).resolve() if Path(resume_from).exists() else resume_from))
        if resume_from
        else ()
    )
    first = (*flags, WAIT_FLAG)  # the first launch's ranks wait for prepare() below
    cmd, env = build_command(recipe, run_dir, resume=resume, device=device, worker_args=first)
    con = _console()
    env_txt = " ".join(f"{k}={v}" for k, v in env.items())
    printable = (env_txt + " " if env_txt else "") + shlex.join(cmd)
    if layout is not None:
        from tessera.data import load_corpus

        load_corpus(recipe.data, root=Path.cwd())  # missing files / empty globs fail here
        con.print(f"[bold]layout[/]  {layout.describe()}")
        con.print(f"[bold]device[/]  {device}")
        con.print(f"[bold]run dir[/] {run_dir}")
        con.print("[bold]command[/]")
        print(printable)
        return 0, rd
    if run_dir.exists() and not run_dir.is_dir():
        raise TesseraError(
            "the run directory is an existing file",
            field="run.out_dir",
            value=str(run_dir),
            fix="point run.out_dir at a directory (new or an earlier run of this recipe)",
        )
    _check_writable(run_dir)
    with rd.locked() as stale:
        if stale:
            print(f"tessera: warning: {stale}", file=sys.stderr)
            release_killed_run(rd)
        index = CheckpointIndex(rd.checkpoints, world_size=recipe.run.world_size)
        chosen = resume_point(
            index, run_dir, resume=resume, resume_from=resume_from, same_layout=same_layout, strict=strict
        )
        # every file of it matches its checksum before anything launches (the ranks verify again)
        meta = index.verify(chosen, any_world=not same_layout) if chosen is not None else None
        launch = {"command": printable, "argv": sys.argv, "resume": resume, **(launch_record or {})}

        def prepare() -> None:  # beside the launcher: the ranks wait for it (--wait-prepared)
            from tessera.train.worker import prepare_run_dir

            layout = check_model(resolved, device)
            if meta is not None:
                announce_reshard(meta, chosen, layout, same_layout=same_layout)
            with con.status("preparing data (tokenizer + packing, cached by content hash)"):
                data = prepare_run_dir(resolved.recipe, rd, root=Path.cwd())
            rd.write_json(RunDir.PLAN, plan_record(resolved, layout, device))
            con.print(f"data: {len(data)} samples x {recipe.data.seq_len} tokens, vocab {data.vocab_size}")
            rd.write_json(RunDir.LAUNCH, launch)
            con.print(f"[bold]launch[/] {printable}")

        return _supervise(recipe, rd, cmd, env, prepare, device=device, flags=flags, launch=launch), rd


def release_killed_run(rd: RunDir) -> None:
    """What a killed ``tessera run`` could not clean up: DeepSpeed's shared-memory all-reduce segments of
    its rendezvous (~138 MB in /dev/shm for 2 ranks), found by the port in its ``launch.json``."""
    import shlex

    from tessera.comm.shm import release_shared_memory
    from tessera.launch.launcher import rendezvous_of

    before = rd.read_json_if_present(RunDir.LAUNCH) or {}
    try:
        where = rendezvous_of(shlex.split(str(before.get("command", ""))))
    except ValueError:  # an unreadable record: nothing to release by name
        return
    if where is not None:
        release_shared_memory(*where)


def _supervise(
    recipe: Any,
    rd: RunDir,
    cmd: list[str],
    env: dict[str, str],
    prepare: Callable[[], None],
    *,
    device: str,
    flags: tuple[str, ...],
    launch: dict[str, Any],
) -> int:
    """Run the ranks under the hang watchdog; after a fault (a rank lost, crashed or hung; not bad input,
    not a stop rule or preemption) restart from the latest complete, verified checkpoint, at most
    ``run.restarts`` times, recording each restart (reason, failed rank, step, checkpoint, time lost).
    ``prepare``: what the first launch's ranks wait for (see :func:`start_run`)."""
    import time

    from tessera.checkpoint.manager import CheckpointManager
    from tessera.errors import CheckpointError
    from tessera.launch.launcher import build_command
    from tessera.launch.watchdog import HangWatchdog
    from tessera.rundir import NOT_RESTARTED

    world = recipe.run.world_size

    def once(c: list[str], e: dict[str, str], prep: Callable[[], None] | None = None) -> tuple[int, Any]:
        timeout = recipe.stop.hang_timeout_s
        dog = HangWatchdog(rd, world, timeout) if timeout else None
        grace = recipe.run.preempt_grace_s
        return supervise_ranks(c, e, rd, world, what="run", grace_s=grace, watchdog=dog, prepare=prep)

    code, failure = once(cmd, env, prepare)
    ckpts = CheckpointManager(rd.checkpoints, keep=recipe.checkpoint.keep, rank=0, world_size=world)
    for attempt in range(1, recipe.run.restarts + 1):
        if code == 0 or code in NOT_RESTARTED:
            break
        records = rd.read_metrics() if rd.metrics.is_file() else []
        latest = ckpts.latest()
        if latest is not None:
            try:
                meta = ckpts.verify(latest, any_world=False)
            except CheckpointError as e:
                print(
                    f"tessera: no restart: the latest checkpoint is not usable ({e.message})", file=sys.stderr
                )
                break
            step = int(meta["step"])
        else:
            step = 0
        saved = next((r.get("wall_time") for r in records if r["step"] == step), None)
        record = {
            "attempt": attempt,
            "reason": ExitCode(code).name if code in tuple(ExitCode) else f"exit {code}",
            "detail": failure.how if failure is not None else None,
            "failed_rank": failure.rank if failure is not None else None,
            "failed_at_step": records[-1]["step"] if records else 0,
            "checkpoint": latest.name if latest is not None else None,
            "time_lost_s": round(time.time() - saved, 3) if saved else None,
        }
        where = f"resuming from {latest.name}" if latest is not None else "starting over (no checkpoint yet)"
        lost = f", {record['time_lost_s']:.1f} s of training lost" if record["time_lost_s"] else ""
        _console().print(
            f"[bold yellow]restart {attempt}/{recipe.run.restarts}[/]: {record['reason']}"
            + (f" (rank {record['failed_rank']})" if record["failed_rank"] is not None else "")
            + f" after step {record['failed_at_step']}; {where}{lost}"
        )
        resume = latest is not None
        rd.write_json(RunDir.LAUNCH, {**launch, "resume": resume, "restart": record})
        again = _without_resume_from(flags)  # a restart continues from the latest, not a chosen step
        cmd, env = build_command(recipe, rd.path, resume=resume, device=device, worker_args=again)
        code, failure = once(cmd, env)
    if failure is not None and code not in NOT_RESTARTED:  # the ranks wrote no summary: say why here
        summary = rd.read_json_if_present(RunDir.SUMMARY) or {}
        summary["failed"] = {
            "exit_code": int(code),
            "reason": ExitCode(code).name if code in tuple(ExitCode) else f"exit {code}",
            "rank": failure.rank,
            "detail": failure.how,
        }
        rd.write_json(RunDir.SUMMARY, summary)
    return code


def _check_writable(run_dir: Path) -> None:
    """The run directory can be created and written, checked before anything starts."""
    import os

    probe = run_dir / f".write-test-{os.getpid()}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise TesseraError(
            f"the run directory cannot be written: {e.strerror or e}",
            field="run.out_dir",
            value=str(run_dir),
            fix="point run.out_dir (or run.name under runs/) at a writable directory",
        ) from None


def _without_resume_from(flags: tuple[str, ...]) -> tuple[str, ...]:
    out: list[str] = []
    skip = False
    for f in flags:
        if skip:
            skip = False
        elif f == "--resume-from":
            skip = True
        else:
            out.append(f)
    return tuple(out)
