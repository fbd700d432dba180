"""Build and run the launcher command (``deepspeed`` or ``torchrun``); fail fast when a rank dies.

The launcher does the process management it is good at (starting N ranks, environment, core binding).
Tessera adds a monitor around it: every rank writes ``logs/rank_N.pid`` at start and ``logs/rank_N.exit``
at the end; a rank whose process is gone without an exit file (SIGKILL, OOM killer) or that exited
non-zero is named, the launcher and all remaining ranks are stopped, and ``tessera run`` exits non-zero
with the rank's last log lines. A run never hangs on a dead peer.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tessera.config.schema import Recipe
from tessera.errors import LayoutError, RecipeError
from tessera.rundir import ExitCode, RunDir

GRACE_S = 10.0  # after a rank fails: time the launcher gets to stop the others itself
POLL_S = 0.25


def _venv_bin(name: str) -> str:
    """The console script next to this interpreter (the venv's), else whatever PATH has."""
    cand = Path(sys.executable).parent / name
    return str(cand) if cand.exists() else (shutil.which(name) or name)


def parse_hostfile(path: str) -> list[tuple[str, int]]:
    """``host slots=N`` lines (DeepSpeed's format); comments and blank lines ignored."""
    p = Path(path)
    if not p.is_file():
        raise RecipeError(
            "hostfile not found",
            field="run.hostfile",
            value=path,
            fix="give a file of lines like 'node1 slots=8'",
        )
    hosts: list[tuple[str, int]] = []
    for i, line in enumerate(p.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        slots = [x for x in parts[1:] if x.startswith("slots=")]
        if len(parts) < 2 or not slots or not slots[0][6:].isdigit():
            raise RecipeError(
                f"line {i} is not 'host slots=N': {line!r}",
                field="run.hostfile",
                value=path,
                fix="write one 'hostname slots=N' per line",
            )
        hosts.append((parts[0], int(slots[0][6:])))
    if not hosts:
        raise RecipeError(
            "hostfile lists no hosts",
            field="run.hostfile",
            value=path,
            fix="add lines like 'localhost slots=2'",
        )
    return hosts


def build_command(
    recipe: Recipe, run_dir: Path, *, resume: bool, device: str, worker_args: tuple[str, ...] = ()
) -> tuple[list[str], dict[str, str]]:
    """The exact launcher command and the environment additions for this run (``worker_args``: more
    flags for the worker, e.g. ``--same-layout`` or ``--convert-from SRC``)."""
    r = recipe.run
    env: dict[str, str] = {}
    worker = ["tessera.train.worker", "--run-dir", str(run_dir)] + (["--resume"] if resume else [])
    worker += list(worker_args)
    if device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    if r.launcher == "torchrun":
        if r.hostfile:
            raise RecipeError(
                "torchrun runs are single-node here; multi-node goes through the deepspeed launcher",
                field="run.launcher",
                value=r.launcher,
                fix="set run.launcher: deepspeed to use run.hostfile",
            )
        cmd = [
            _venv_bin("torchrun"),
            f"--nproc_per_node={r.world_size}",
            f"--master_addr={r.master_addr}",
            f"--master_port={r.master_port}",
            "-m",
            *worker,
        ]
        if device == "cpu":
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // r.world_size))
        return cmd, env
    cmd = [_venv_bin("deepspeed")]
    if r.hostfile:
        hosts = parse_hostfile(r.hostfile)
        slots = sum(n for _, n in hosts)
        if slots != r.world_size:
            raise LayoutError(
                f"the hostfile has {slots} slots in all",
                field="run.world_size",
                value=r.world_size,
                fix=f"set run.world_size: {slots} or edit {r.hostfile}",
            )
        cmd += ["--hostfile", r.hostfile, "--no_ssh_check"]
    else:
        cmd += ["--num_gpus", str(r.world_size)]
    if device == "cpu" and r.bind_cores_to_rank:
        if shutil.which("numactl") is None:
            raise RecipeError(
                "deepspeed --bind_cores_to_rank needs numactl, which is not installed",
                field="run.bind_cores_to_rank",
                value=True,
                fix="apt-get install numactl (make setup does), or set run.bind_cores_to_rank: false",
            )
        if (os.cpu_count() or 1) < r.world_size:
            raise LayoutError(
                f"cannot bind {r.world_size} ranks to {os.cpu_count()} cores",
                field="run.bind_cores_to_rank",
                value=True,
                fix="set run.bind_cores_to_rank: false or use fewer ranks",
            )
        cmd.append("--bind_cores_to_rank")
    cmd += ["--master_addr", r.master_addr, "--master_port", str(r.master_port), "--module", *worker]
    return cmd, env


@dataclass
class RankFailure:
    rank: int
    how: str
    log_tail: list[str]
    code: int | None = None  # the rank's exit code, when it wrote one


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


def _scan(rd: RunDir, world: int, pids: dict[int, int], dead_seen: dict[int, float]) -> RankFailure | None:
    """The rank that failed first: a vanished process beats a non-zero exit, which beats a rank that was
    only terminated because another one failed."""
    vanished: list[tuple[float, int]] = []
    exited: list[tuple[int, float, int, int]] = []
    for rank in range(world):
        if rank not in pids:
            pid = rd.rank_pid(rank)
            if pid is not None:
                pids[rank] = pid
        exit_f = rd.rank_file(rank, "exit")
        code = rd.rank_exit(rank)
        if code is not None:
            if code != ExitCode.OK:
                prio = 1 if code == ExitCode.TERMINATED else 0
                exited.append((prio, exit_f.stat().st_mtime, rank, code))
        elif rank in pids and not _alive(pids[rank]):
            dead_seen.setdefault(rank, time.monotonic())
            if time.monotonic() - dead_seen[rank] > 0.5 and not exit_f.is_file():  # not mid-write
                vanished.append((dead_seen[rank], rank))
    if vanished:
        rank = min(vanished)[1]
        return RankFailure(
            rank,
            "died without exiting (killed by a signal, e.g. SIGKILL or the OOM killer)",
            rd.log_tail(rank),
        )
    if exited:
        _, _, rank, code = min(exited)
        how = "was terminated" if code == ExitCode.TERMINATED else f"exited with code {code}"
        return RankFailure(rank, how, rd.log_tail(rank), code=code)
    return None


def _stop_group(proc: subprocess.Popen, pids: dict[int, int]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for target in [proc.pid, *pids.values()]:
            try:
                if target == proc.pid:
                    os.killpg(proc.pid, sig)
                else:
                    os.kill(target, sig)
            except OSError:
                pass
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def run_and_monitor(
    cmd: list[str], env_add: dict[str, str], run_dir: Path, world: int
) -> tuple[int, RankFailure | None]:
    """Run the launcher; returns (exit code, the failed rank if one failed)."""
    rd = RunDir(run_dir)
    rd.clear_rank_status()
    env = {**os.environ, **env_add}
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    pids: dict[int, int] = {}
    dead_seen: dict[int, float] = {}
    failure: RankFailure | None = None
    failed_at = 0.0
    try:
        while True:
            rc = proc.poll()
            if failure is None:
                failure = _scan(rd, world, pids, dead_seen)
                if failure is not None:
                    failed_at = time.monotonic()
            if rc is not None:
                break
            if failure is not None and time.monotonic() - failed_at > GRACE_S:
                _stop_group(proc, pids)
                break
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        _stop_group(proc, pids)
        return ExitCode.INTERRUPTED, None
    # the launcher is gone; make sure no rank outlives it
    for pid in pids.values():
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    rc = proc.returncode if proc.returncode is not None else ExitCode.FAILED
    if rc != 0:  # re-scan with everything settled: a vanished rank beats the first exit we saw
        time.sleep(0.6)
        failure = _scan(rd, world, pids, dead_seen) or failure
    if failure is not None and rc == 0:
        rc = ExitCode.FAILED
    return rc, failure
