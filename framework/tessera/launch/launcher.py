"""Build and run the launcher command (``deepspeed`` or ``torchrun``); fail fast when a rank dies.

The launcher does the process management it is good at (starting N ranks, environment, core binding).
Tessera adds a monitor around it: every rank writes ``logs/rank_N.pid`` at start and ``logs/rank_N.exit``
at the end; a rank whose process is gone without an exit file (SIGKILL, OOM killer) or that exited
non-zero is named, the launcher and all remaining ranks are stopped, and ``tessera run`` exits non-zero
with the rank's last log lines. A run never hangs on a dead peer.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessera.comm.shm import release_shared_memory
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


DEFAULT_PORT = 29500
VERBOSE_ENV = "TESSERA_VERBOSE"  # set by --verbose: launcher INFO lines and library warnings on the console


def _bindable(addr: str, port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
        except OSError:
            return False
    return True


def rendezvous_port(recipe: Recipe) -> int:
    """``run.master_port``: ``auto`` picks a free port on this machine (a hostfile run, whose rendezvous
    host may be another machine, gets 29500); an explicit port that is taken here is refused before
    anything starts."""
    r = recipe.run
    local = not r.hostfile and r.master_addr in ("127.0.0.1", "localhost", "0.0.0.0")
    if r.master_port == "auto":
        if not local:
            return DEFAULT_PORT
        import socket

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((r.master_addr, 0))
            return int(s.getsockname()[1])
    port = int(r.master_port)
    if local and not _bindable(r.master_addr, port):
        raise RecipeError(
            f"port {port} on {r.master_addr} is in use (another run, or another program)",
            field="run.master_port",
            value=port,
            fix="set run.master_port: auto (the default) or another free port",
        )
    return port


def build_command(
    recipe: Recipe,
    run_dir: Path,
    *,
    resume: bool,
    device: str,
    worker_args: tuple[str, ...] = (),
    port: int | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The exact launcher command and the environment additions for this run (``worker_args``: more
    flags for the worker, e.g. ``--same-layout`` or ``--convert-from SRC``; ``port``: the rendezvous
    port, by default :func:`rendezvous_port`)."""
    r = recipe.run
    port = rendezvous_port(recipe) if port is None else port
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
            f"--master_port={port}",
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
    cmd += ["--master_addr", r.master_addr, "--master_port", str(port), "--module", *worker]
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
            code=ExitCode.RANK_LOST,
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


LAUNCHER_LOG = "launcher.log"  # in logs/: the launcher's own INFO / WARNING lines
#: a line of the deepspeed launcher's logger (or a rank's DeepSpeed logger): "[2026-12-03 06:08:41,112] [INFO] [...]"
_LOG_LINE = re.compile(
    rb"^(\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\] \[(DEBUG|INFO|WARNING)\]"
    # DeepSpeed's op builder (JIT-compiled C++ ops: loaded, built, cached)
    rb"|DeepSpeed \S+ built successfully|Using \S*torch_extensions|Emitting ninja|Building extension"
    rb"|Loading extension module|ninja: no work to do|Detected CUDA files|Creating extension directory)"
)


class _LauncherLines:
    """The launcher's stdout (which the ranks inherit): its log lines go to ``logs/launcher.log``, the rest
    (rank 0's progress and messages) to the console as they come; ``--verbose`` prints everything."""

    def __init__(self, stream: Any, log: Path) -> None:
        import threading

        self.stream, self.log = stream, log
        self.verbose = bool(os.environ.get(VERBOSE_ENV))
        self.thread = threading.Thread(target=self._pump, name="tessera-launcher-lines", daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        out = sys.stdout.buffer
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            for line in iter(self.stream.readline, b""):
                if _LOG_LINE.match(line):
                    log.write(line)
                    log.flush()
                    if not self.verbose:
                        continue
                try:
                    out.write(line)
                    out.flush()
                except (OSError, ValueError):  # our own stdout closed: keep draining the pipe
                    pass

    def finish(self, proc: subprocess.Popen) -> None:
        """After the launcher ended (or was stopped): let the pump drain what is left."""
        self.thread.join(timeout=10)


class _Signals:
    """SIGTERM / SIGINT to ``tessera run`` while ranks run: the first asks for a preemption (the ranks
    checkpoint the current step and exit PREEMPTED), a second one stops everything at once."""

    def __init__(self, rd: RunDir) -> None:
        import threading

        self.rd = rd
        self.times: list[float] = []
        self.old: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.old[sig] = signal.signal(sig, self._on)

    def _on(self, signum: int, frame: object) -> None:
        self.times.append(time.monotonic())
        if len(self.times) == 1:
            (self.rd / RunDir.PREEMPT).write_text(f"{signal.Signals(signum).name}\n")
            print(
                f"tessera: {signal.Signals(signum).name}: checkpointing the current step, then stopping "
                "(again to stop at once)",
                file=sys.stderr,
                flush=True,
            )

    def restore(self) -> None:
        for sig, handler in self.old.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        (self.rd / RunDir.PREEMPT).unlink(missing_ok=True)


def rendezvous_of(cmd: list[str]) -> tuple[str, str] | None:
    """(master addr, port) of a launcher command (deepspeed ``--master_port P``, torchrun ``--master_port=P``)."""
    found: dict[str, str] = {}
    for i, arg in enumerate(cmd):
        for key in ("--master_addr", "--master_port"):
            if arg == key and i + 1 < len(cmd):
                found[key] = cmd[i + 1]
            elif arg.startswith(key + "="):
                found[key] = arg.split("=", 1)[1]
    if "--master_port" not in found:
        return None
    return found.get("--master_addr", "127.0.0.1"), found["--master_port"]


def run_and_monitor(
    cmd: list[str],
    env_add: dict[str, str],
    run_dir: Path,
    world: int,
    *,
    grace_s: float = 120.0,
    watchdog: object | None = None,
) -> tuple[int, RankFailure | None]:
    """Run the launcher; returns (exit code, the failed rank if one failed). ``grace_s``: how long a
    preemption may take before the ranks are stopped; ``watchdog``: a hang watchdog whose ``check()``
    returns a :class:`RankFailure` (code HUNG) when a rank stopped making progress. Afterwards the run's
    shared-memory segments are released, however it ended."""
    try:
        return _run_and_monitor(cmd, env_add, run_dir, world, grace_s=grace_s, watchdog=watchdog)
    finally:
        where = rendezvous_of(cmd)
        if where is not None:
            release_shared_memory(*where)


def _run_and_monitor(
    cmd: list[str],
    env_add: dict[str, str],
    run_dir: Path,
    world: int,
    *,
    grace_s: float,
    watchdog: object | None,
) -> tuple[int, RankFailure | None]:
    from tessera.train.guard import SUPERVISOR_ENV, supervisor_token

    rd = RunDir(run_dir)
    rd.clear_rank_status()
    for stale in (RunDir.PREEMPT, RunDir.PREPARED):
        (rd / stale).unlink(missing_ok=True)
    env = {**os.environ, **env_add, SUPERVISOR_ENV: supervisor_token()}
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE)
    sorter = _LauncherLines(proc.stdout, rd.logs / LAUNCHER_LOG)
    pids: dict[int, int] = {}
    dead_seen: dict[int, float] = {}
    failure: RankFailure | None = None
    failed_at = 0.0
    signals = _Signals(rd)
    try:
        while True:
            rc = proc.poll()
            if len(signals.times) >= 2:
                _stop_group(proc, pids)
                return ExitCode.INTERRUPTED, None
            if signals.times and time.monotonic() - signals.times[0] > grace_s:
                print(
                    f"tessera: the ranks did not checkpoint within {grace_s:g} s; stopping them",
                    file=sys.stderr,
                )
                _stop_group(proc, pids)
                return ExitCode.TERMINATED, None
            if failure is None:
                failure = _scan(rd, world, pids, dead_seen)
                if failure is None and watchdog is not None and rc is None:
                    failure = watchdog.check()  # type: ignore[attr-defined]
                    if failure is not None:  # a hang: nothing will exit by itself
                        _stop_group(proc, pids)
                        break
                if failure is not None:
                    failed_at = time.monotonic()
            if rc is not None:
                break
            if failure is not None and time.monotonic() - failed_at > GRACE_S:
                _stop_group(proc, pids)
                break
            time.sleep(POLL_S)
    except KeyboardInterrupt:  # not the main thread: no handlers were installed
        _stop_group(proc, pids)
        return ExitCode.INTERRUPTED, None
    finally:
        signals.restore()
        sorter.finish(proc)
    # the launcher is gone; make sure no rank outlives it
    for pid in pids.values():
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    rc = proc.returncode if proc.returncode is not None else ExitCode.FAILED
    if failure is not None and failure.code == ExitCode.HUNG:
        return ExitCode.HUNG, failure
    if rc != 0:  # re-scan with everything settled: a vanished rank beats the first exit we saw
        time.sleep(0.6)
        failure = _scan(rd, world, pids, dead_seen) or failure
    if failure is not None and rc == 0:
        rc = ExitCode.FAILED
    return rc, failure
