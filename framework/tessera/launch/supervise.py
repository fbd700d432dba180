"""``tessera run``'s supervision: the ranks under the hang watchdog, restarts after a fault, the verdict.

One node: the launcher under the local monitor (:func:`supervise_ranks`; ``tessera convert`` and each run of
``tessera compare`` use it too). Several
nodes with an agent each: every launch is a generation of :class:`tessera.launch.agent.Supervisor` on
node 0, the same restart policy over all of them.
"""

from __future__ import annotations

import sys
from typing import Any

from tessera.rundir import ORDERLY_EXITS, PREPARE_FLAG, ExitCode, RunDir


def _console():
    from rich.console import Console

    return Console()


def supervise_ranks(
    cmd: list[str],
    env: dict[str, str],
    rd: RunDir,
    world: int,
    *,
    what: str,
    grace_s: float = 120.0,
    watchdog: Any = None,
    verdict: bool = True,
) -> tuple[int, Any]:
    """Start the ranks and wait. A stop every rank agreed on (a stop rule, a preemption) ends with its
    own code and the diagnosis rank 0 printed; after a failure the failed rank's last log lines are
    printed, then (``verdict``; else the caller, who may restart, says it) one line naming the rank that
    failed first. The exit code is always Tessera's (the rank's own verdict where it gave one; RANK_LOST,
    HUNG or FAILED otherwise), never the launcher's raw status. Returns (code, the failure or None)."""
    from tessera.launch.launcher import run_and_monitor

    rc, failure = run_and_monitor(cmd, env, rd.path, world, grace_s=grace_s, watchdog=watchdog)
    return judge(rc, failure, rd, what=what, verdict=verdict)


def judge(rc: int, failure: Any, rd: RunDir, *, what: str, verdict: bool = True) -> tuple[int, Any]:
    """After every rank ended (on every node): the exit code and what to print (:func:`supervise_ranks`)."""
    rd.remove_partial_checkpoints()  # every rank has ended: a failed save's room is given back now
    if failure is not None and _orderly(failure):
        code = ExitCode(failure.code)
        hint = " (continue with --resume)" if code in (ExitCode.PREEMPTED, ExitCode.TIME_LIMIT) else ""
        print(f"tessera: {what} stopped: {code.name}{hint}", file=sys.stderr)
        return int(code), failure
    if failure is not None:
        # rank 0's error is on screen; a node lost left no log
        if failure.log_tail and not (failure.rank == 0 and failure.code == ExitCode.USER_ERROR):
            log = rd.launcher_log if failure.rank is None else rd.rank_file(failure.rank, "log")
            # the heading names no rank: the verdict below names the one that failed first, once
            _console().print(f"[bold red]last log lines[/] ({log}):", soft_wrap=True)
            for line in failure.log_tail:
                print(f"  | {line}")
        code = failure.code if failure.code not in (None, ExitCode.TERMINATED) else ExitCode.FAILED
        if verdict:
            say_failed(what, failure, code)
        return int(code), failure
    if rc not in (0, *(int(c) for c in ExitCode)):
        print(f"tessera: launcher exited with status {rc}; logs in {rd.logs}", file=sys.stderr)
        return int(ExitCode.FAILED), None
    return rc, None


def _orderly(failure: Any) -> bool:
    """A stop every rank agreed on (a stop rule, a preemption), not a failure; a divergence is one."""
    return failure.code in ORDERLY_EXITS[1:] and failure.code != ExitCode.DIVERGED


def describe_failure(failure: Any) -> str:
    """What failed and how, naming the rank once (a hang's diagnosis starts with the rank already)."""
    if failure.who is None and failure.how.startswith("hung: "):
        return failure.how
    return f"{failure.culprit} {failure.how}"


def say_failed(what: str, failure: Any, code: int) -> None:
    print(f"tessera: {what} failed: {describe_failure(failure)} (exit code {int(code)})", file=sys.stderr)


def supervise_run(
    recipe: Any,
    rd: RunDir,
    *,
    device: str,
    flags: tuple[str, ...],
    launch: dict[str, Any],
    resume: bool,
    cluster: Any,
    port: int,
) -> int:
    """Run the ranks under the hang watchdog; after a fault (a rank lost, crashed or hung; not bad input,
    not a stop rule or preemption) restart from the latest complete, verified checkpoint, at most
    ``run.restarts`` times, recording each restart (reason, failed rank, step, checkpoint, time lost).
    Every launch's rank 0 prepares the run dir again (the data and the model checks are cached or cheap
    by then), so a restart after a failure while preparing starts from the same point. ``cluster``: the
    launch mode (:mod:`tessera.launch.modes`); with an agent per node, node 0's waits for the others to
    join and each launch runs on every node; a node lost is not restarted. ``port``: the first launch's
    rendezvous port (the command already recorded in launch.json)."""
    from tessera.launch.modes import build_command
    from tessera.launch.watchdog import HangWatchdog

    world = recipe.run.world_size
    sup = None
    if cluster.agents:
        from tessera.config.loader import recipe_hash
        from tessera.launch.agent import Supervisor, slurm_hostfile

        sup = Supervisor(
            recipe, rd, cluster, device, recipe_hash(recipe), slurm_hostfile(rd, recipe, cluster)
        )

    def once(resume: bool, worker_args: tuple[str, ...], port: int | None) -> tuple[int, Any]:
        # after a rank's first step stop.hang_timeout_s, before it stop.startup_timeout_s per phase
        timeout, startup = recipe.stop.hang_timeout_s, recipe.stop.startup_timeout_s
        # ssh mode: the other nodes' heartbeats show here only on a shared run directory
        local = cluster.mode != "ssh"
        dog = HangWatchdog(rd, world, timeout, startup_timeout_s=startup, local=local, nodes=sup is not None)
        # no verdict there: a failure that is restarted is named once, by the restart line below
        if sup is not None:
            rc, failure = sup.generation(resume=resume, worker_args=worker_args, port=port, dog=dog)
            return judge(rc, failure, rd, what="run", verdict=False)
        cmd, env = build_command(
            recipe, rd.path, resume=resume, device=device, worker_args=worker_args, port=port, cluster=cluster
        )
        grace = recipe.run.preempt_grace_s
        return supervise_ranks(cmd, env, rd, world, what="run", grace_s=grace, watchdog=dog, verdict=False)

    code: int = ExitCode.FAILED
    try:
        if sup is not None:
            sup.join(recipe.stop.startup_timeout_s)
        code, failure = once(resume, (*flags, PREPARE_FLAG), port)
        code, failure = _restarts(recipe, rd, once, code, failure, flags=flags, launch=launch)
    finally:
        if sup is not None:  # every other node's agent ends with this code
            sup.end(code)
    if failure is not None and not _orderly(failure):  # not restarted (again): the verdict, once
        say_failed("run", failure, code)
    _record_failure(rd, code, failure)
    return code


def _restarts(
    recipe: Any,
    rd: RunDir,
    once: Any,
    code: int,
    failure: Any,
    *,
    flags: tuple[str, ...],
    launch: dict[str, Any],
) -> tuple[int, Any]:
    """``run.restarts``: after a fault, launch again from the latest complete, verified checkpoint."""
    import time

    from tessera.checkpoint.index import CheckpointIndex
    from tessera.errors import CheckpointError
    from tessera.rundir import NOT_RESTARTED

    ckpts = CheckpointIndex(rd.checkpoints, world_size=recipe.run.world_size)
    for attempt in range(1, recipe.run.restarts + 1):
        if code == 0 or code in NOT_RESTARTED:
            break
        if failure is not None and not failure.restartable:
            print(
                "tessera: no restart: a node is gone, and nothing is left there to start its ranks",
                file=sys.stderr,
            )
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
            "detail": _detail(failure),
            "failed_rank": failure.rank if failure is not None else None,
            "failed_at_step": records[-1]["step"] if records else 0,
            "checkpoint": latest.name if latest is not None else None,
            "time_lost_s": round(time.time() - saved, 3) if saved else None,
        }
        where = f"resuming from {latest.name}" if latest is not None else "starting over (no checkpoint yet)"
        lost = f", {record['time_lost_s']:.1f} s of training lost" if record["time_lost_s"] else ""
        _console().print(
            f"[bold yellow]restart {attempt}/{recipe.run.restarts}[/]: "
            + (f"{describe_failure(failure)} " if failure is not None else "")
            + f"({record['reason']} after step {record['failed_at_step']}); {where}{lost}",
            soft_wrap=True,
        )
        resume = latest is not None
        rd.write_json(RunDir.LAUNCH, {**launch, "resume": resume, "restart": record})
        again = (*_without_resume_from(flags), PREPARE_FLAG)  # from the latest, not a chosen step
        code, failure = once(resume, again, None)
    return code, failure


def _record_failure(rd: RunDir, code: int, failure: Any) -> None:
    from tessera.rundir import NOT_RESTARTED

    if failure is not None and code not in NOT_RESTARTED:  # the ranks wrote no summary: say why here
        summary = rd.read_json_if_present(RunDir.SUMMARY) or {}
        summary["failed"] = {
            "exit_code": int(code),
            "reason": ExitCode(code).name if code in tuple(ExitCode) else f"exit {code}",
            "rank": failure.rank,
            "detail": _detail(failure),
        }
        from tessera.atomic import DiskFull

        try:
            rd.write_json(RunDir.SUMMARY, summary)
        except DiskFull as e:  # the run's own exit code says more than this record would
            print(
                f"tessera: warning: the failure is not recorded in summary.json: {e.message}", file=sys.stderr
            )


def _detail(failure: Any) -> str | None:
    """A failure's diagnosis for the records; one that is not a rank's (the launcher) names what failed."""
    if failure is None:
        return None
    return failure.how if failure.who is None else f"{failure.culprit} {failure.how}"


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
