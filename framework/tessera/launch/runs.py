"""Starting runs from the command line's side: validate a recipe before launch, prepare its run
directory, start the ranks through the launcher and wait (``tessera run``, ``tessera convert --to ENGINE``
and each run of ``tessera compare`` go through here)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

from tessera.errors import RecipeError, TesseraError
from tessera.rundir import ORDERLY_EXITS, ExitCode, RunDir


def _console():
    from rich.console import Console

    return Console()


def validate(path: str, overrides: list[str]):
    """Everything about the recipe that can be checked before launch, cheaply (the data files are checked
    where they are read: by ``load_corpus`` on a dry run, by ``prepare_run_dir`` otherwise); returns
    (resolved, layout, device)."""
    from tessera.config.loader import load_recipe
    from tessera.plan.layout import layout_from_recipe
    from tessera.train.worker import resolve_device

    resolved = load_recipe(path, overrides)
    device = resolve_device(resolved.recipe.run.device)
    if resolved.recipe.parallel.auto:  # the planner's layout, written into the recipe the ranks read
        from tessera.plan.search import apply_plan, hardware_for, plan_recipe

        r = resolved.recipe
        plan = plan_recipe(r, world_size=r.run.world_size, hardware=hardware_for(r, device=device))
        resolved.recipe = apply_plan(r, plan)
        resolved.plan = plan.to_json()
    recipe = resolved.recipe
    layout = layout_from_recipe(recipe)
    if recipe.train.precision == "fp16" and device == "cpu":
        raise RecipeError(
            "fp16 does not exist on the CPU",
            field="train.precision",
            value="fp16",
            fix="use train.precision: bf16 or fp32 on CPU",
        )
    from tessera.engines.registry import capabilities
    from tessera.engines.zero import build_ds_config

    if recipe.parallel.deepspeed_config and "deepspeed" not in capabilities(layout.engine).zero_impls:
        raise RecipeError(
            f"engine '{layout.engine}' does not run DeepSpeed, so a DeepSpeed JSON would be ignored",
            field="parallel.deepspeed_config",
            value=recipe.parallel.deepspeed_config,
            fix="remove parallel.deepspeed_config, or use parallel.engine: deepspeed",
        )
    build_ds_config(recipe, layout, device=device)  # user JSON conflicts are errors before launch
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
    return resolved, layout, device


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
) -> tuple[int, Any]:
    """Start the ranks and wait. A stop every rank agreed on (a stop rule, a preemption) ends with its
    own code and the diagnosis rank 0 printed; a failed rank is named with its last log lines. The exit
    code is always Tessera's (the rank's own verdict where it gave one; RANK_LOST, HUNG or FAILED
    otherwise), never the launcher's raw status. Returns (code, the failure or None)."""
    from tessera.launch.launcher import run_and_monitor

    rc, failure = run_and_monitor(cmd, env, rd.path, world, grace_s=grace_s, watchdog=watchdog)
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


def check_resumable(
    ckpts, layout, run_dir: Path, *, same_layout: bool, resume_from: str | None = None
) -> None:
    """Before launch: the checkpoint ``--resume`` would read exists and every file matches its checksum
    (the ranks verify again before loading); a layout change is announced (the ranks reshard it), or
    refused with ``same_layout``."""
    from tessera.train.worker import check_resume_layout

    latest = ckpts.pick(resume_from)
    if latest is None:
        raise TesseraError(
            "--resume found no complete checkpoint",
            field="run.out_dir",
            value=str(run_dir),
            fix="run without --resume to start fresh",
        )
    meta = ckpts.verify(latest, any_world=not same_layout)
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
    """``tessera run``: validate, prepare the run directory (recipe, data, plan, launch record), start
    the ranks and wait. ``launch_record``: extra keys of launch.json (``tessera compare`` records its
    pre-registration hash there, which the manifest copies). Returns the exit code and the run dir."""
    from tessera.checkpoint.manager import CheckpointManager
    from tessera.launch.launcher import build_command
    from tessera.train.worker import prepare_run_dir

    resolved, layout, device = validate(recipe_path, overrides)
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
    cmd, env = build_command(recipe, run_dir, resume=resume, device=device, worker_args=flags)
    con = _console()
    env_txt = " ".join(f"{k}={v}" for k, v in env.items())
    printable = (env_txt + " " if env_txt else "") + shlex.join(cmd)
    if dry_run:
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
        ckpts = CheckpointManager(
            rd.checkpoints, keep=recipe.checkpoint.keep, rank=0, world_size=layout.world_size
        )
        if resume:
            check_resumable(ckpts, layout, run_dir, same_layout=same_layout, resume_from=resume_from)
        elif same_layout or strict:
            flag = "--same-layout" if same_layout else "--strict"
            raise TesseraError(f"{flag} only applies to --resume", field=flag, value=True, fix="add --resume")
        if not resume and ckpts.complete():
            raise TesseraError(
                "this run directory already holds checkpoints; a fresh run would mix with them",
                field="run.out_dir",
                value=str(run_dir),
                fix="pass --resume to continue it, or set run.out_dir (or run.name) to a new directory",
            )
        with con.status("preparing data (tokenizer + packing, cached by content hash)"):
            data = prepare_run_dir(recipe, rd, root=Path.cwd())
        rd.write_json(RunDir.PLAN, plan_record(resolved, layout, device))
        con.print(f"data: {len(data)} samples x {recipe.data.seq_len} tokens, vocab {data.vocab_size}")
        launch = {"command": printable, "argv": sys.argv, "resume": resume, **(launch_record or {})}
        rd.write_json(RunDir.LAUNCH, launch)
        con.print(f"[bold]launch[/] {printable}")
        return _supervise(recipe, rd, ckpts, cmd, env, device=device, flags=flags, launch=launch), rd


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
    ckpts: Any,
    cmd: list[str],
    env: dict[str, str],
    *,
    device: str,
    flags: tuple[str, ...],
    launch: dict[str, Any],
) -> int:
    """Run the ranks under the hang watchdog; after a fault (a rank lost, crashed or hung; not bad input,
    not a stop rule or preemption) restart from the latest complete, verified checkpoint, at most
    ``run.restarts`` times, recording each restart (reason, failed rank, step, checkpoint, time lost)."""
    import time

    from tessera.errors import CheckpointError
    from tessera.launch.launcher import build_command
    from tessera.launch.watchdog import HangWatchdog
    from tessera.rundir import NOT_RESTARTED

    world = recipe.run.world_size

    def once(c: list[str], e: dict[str, str]) -> tuple[int, Any]:
        timeout = recipe.stop.hang_timeout_s
        dog = HangWatchdog(rd, world, timeout) if timeout else None
        return supervise_ranks(c, e, rd, world, what="run", grace_s=recipe.run.preempt_grace_s, watchdog=dog)

    code, failure = once(cmd, env)
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
