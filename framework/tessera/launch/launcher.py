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
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessera.comm.shm import release_shared_memory
from tessera.rundir import ExitCode, RunDir

GRACE_S = 10.0  # after a rank fails: time the launcher gets to stop the others itself
POLL_S = 0.25


VERBOSE_ENV = "TESSERA_VERBOSE"  # set by --verbose: launcher INFO lines and library warnings on the console


@dataclass
class RankFailure:
    rank: int | None  # None: not a rank failed but the process that started them (``who``)
    how: str
    log_tail: list[str]
    code: int | None = None  # the rank's exit code, when it wrote one
    who: str | None = None  # e.g. "the launcher deepspeed.launcher.launch (pid 4242)"
    where: str | None = None  # a multi-node run: "node 1, host gpu07"
    final: bool = False  # decided by the supervisor (a hang, a node lost): not re-scanned when settling
    restartable: bool = True  # False: a node is gone, nothing could start its ranks again

    @property
    def culprit(self) -> str:
        """What failed, for the diagnosis: "rank 1" (on a multi-node run "rank 1 on node 1, host h"), or
        the launcher process."""
        if self.who:
            return self.who
        return f"rank {self.rank}" + (f" (on {self.where})" if self.where else "")


_PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 36, 37


def _child_subreaper(on: bool) -> bool | None:
    """Make this process the reaper of its orphaned descendants (Linux ``PR_SET_CHILD_SUBREAPER``); returns
    the previous setting (None where it cannot be set). A rank whose parent, the per-node launcher, dies
    first is killed by its parent-death signal and then reparented here: reaping it is how the supervisor
    tells "the launcher died and took its ranks" from "a rank died" (which the launcher reaps itself)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        was = ctypes.c_int(0)
        if libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(was), 0, 0, 0) != 0:
            return None
        if libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
            return None
        return bool(was.value)
    except (OSError, AttributeError):
        return None


def _reap(pid: int) -> bool:
    """Reap ``pid`` if it is a finished child of this process (an orphaned rank); True when it was."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except (ChildProcessError, OSError):
        return False


def _parent_of(pid: int) -> tuple[int, str] | None:
    """(pid, name) of the process that started ``pid``: the per-node launcher, e.g. (4242,
    "deepspeed.launcher.launch"), or torchrun."""
    try:
        ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        argv = Path(f"/proc/{ppid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except (OSError, ValueError, IndexError):
        return None
    argv = [a for a in argv if a]
    if "-m" in argv[:-1]:
        name = argv[argv.index("-m") + 1]
    elif len(argv) > 1 and os.path.basename(argv[0]).startswith("python"):
        name = os.path.basename(argv[1])
    else:
        name = os.path.basename(argv[0]) if argv else "?"
    return ppid, name


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


class _Ranks:
    """What the supervisor knows of the rank processes: pid, the process that started each (its per-node
    launcher), when each was first seen dead, and which ones this process reaped as orphans."""

    def __init__(self, node: int | None = None) -> None:
        self.node = node  # a multi-node run's agent: the node whose ranks these are
        self.where: str | None = None  # "node 1, host h": named in this node's failures
        self.pids: dict[int, int] = {}
        self.parents: dict[int, tuple[int, str]] = {}
        self.dead_seen: dict[int, float] = {}
        self.orphaned: set[int] = set()


def _scan(rd: RunDir, world: int, ranks: _Ranks) -> RankFailure | None:
    """The rank that failed first: a vanished process beats a non-zero exit, which beats a rank that was
    only terminated because another one failed. Ranks that all vanished as orphans (reaped here, not by
    their launcher) died with their launcher, which is named instead. On a multi-node run only this
    node's ranks are looked at (their pid files name the node); the others are their agents' business."""
    pids, dead_seen = ranks.pids, ranks.dead_seen
    vanished: list[tuple[float, int]] = []
    exited: list[tuple[int, float, int, int]] = []
    for rank in range(world):
        if ranks.node is not None and rank not in pids:
            where = rd.rank_node(rank)
            if where is None or where[0] != ranks.node:
                continue  # not started yet, or another node's
            ranks.where = f"node {where[0]}, host {where[1]}"
        if rank not in pids:
            pid = rd.rank_pid(rank)
            if pid is not None:
                pids[rank] = pid
                parent = _parent_of(pid)
                if parent is not None and parent[0] not in (os.getpid(), 1):  # not orphaned already
                    ranks.parents[rank] = parent
        exit_f = rd.rank_file(rank, "exit")
        code = rd.rank_exit(rank)
        if code is not None:
            if code != ExitCode.OK:
                prio = 1 if code == ExitCode.TERMINATED else 0
                exited.append((prio, exit_f.stat().st_mtime, rank, code))
        elif rank in pids and not _alive(pids[rank]):
            dead_seen.setdefault(rank, time.monotonic())
            if _reap(pids[rank]):
                ranks.orphaned.add(rank)
            if time.monotonic() - dead_seen[rank] > 0.5 and not exit_f.is_file():  # not mid-write
                vanished.append((dead_seen[rank], rank))
    if vanished and all(r in ranks.orphaned and r in ranks.parents for _, r in vanished):
        rank = min(vanished)[1]
        ppid, name = ranks.parents[rank]
        lost = sorted(r for _, r in vanished)
        return RankFailure(
            None,
            f"died (killed by a signal?) and its rank{'s' if len(lost) > 1 else ''} "
            f"{', '.join(map(str, lost))} with it",
            _launcher_tail(rd, ranks.node),
            code=ExitCode.RANK_LOST,
            who=f"the launcher {name} (pid {ppid})" + (f" on {ranks.where}" if ranks.where else ""),
        )
    if vanished:
        rank = min(vanished)[1]
        return RankFailure(
            rank,
            "died without exiting (killed by a signal, e.g. SIGKILL or the OOM killer)",
            rd.log_tail(rank),
            code=ExitCode.RANK_LOST,
            where=ranks.where,
        )
    if exited:
        _, _, rank, code = min(exited)
        how = "was terminated" if code == ExitCode.TERMINATED else f"exited with code {code}"
        return RankFailure(rank, how, rd.log_tail(rank), code=code, where=ranks.where)
    return None


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of the process group ``pgid``: the launcher's whole tree."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
                out.append(int(entry.name))
    return out


def _stop_group(proc: subprocess.Popen, pids: dict[int, int]) -> None:
    """SIGTERM to the launcher's process group and the ranks, SIGKILL to what is left after 5 s. Done
    when the whole group is gone, not only the launcher's first process: deepspeed.launcher.launch
    outlives the runner while it stops its ranks (up to 30 s for a stopped one), and logging to the
    pipe of a ``tessera run`` that already exited printed a BrokenPipeError traceback."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for target in [proc.pid, *pids.values()]:
            try:
                if target == proc.pid:
                    os.killpg(proc.pid, sig)
                else:
                    os.kill(target, sig)
            except OSError:
                pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if (
                proc.poll() is not None
                and not _group_members(proc.pid)
                and not any(map(_alive, pids.values()))
            ):
                return
            time.sleep(0.1)


LAUNCHER_LOG = RunDir.LAUNCHER_LOG  # its name in logs/ (the path: RunDir.launcher_log)
#: a line of the deepspeed launcher's logger (or a rank's DeepSpeed logger): "[2026-12-03 06:08:41,112] [INFO] [...]"
_LOG_LINE = re.compile(
    rb"^(\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\] \[(DEBUG|INFO|WARNING)\]"
    # DeepSpeed's op builder (JIT-compiled C++ ops: loaded, built, cached)
    rb"|DeepSpeed \S+ built successfully|Using \S*torch_extensions|Emitting ninja|Building extension"
    rb"|Loading extension module|ninja: no work to do|Detected CUDA files|Creating extension directory)"
)


#: deepspeed.launcher.launch's line when one of its ranks failed: "[...] [ERROR] [launch.py:259:sigkill_handler]
#: [..., '--local_rank=1', ...] exits with return code = -9". It prints the command of the last rank it
#: started, whichever rank failed (rank 1 of 2 when rank 0 died); the supervisor names the rank that
#: failed first, so this line goes to launcher.log only, even with --verbose.
_MISLEADING = re.compile(
    rb"^(\S+: )?\[[^\]]*\] \[ERROR\] \[launch\.py:\d+:sigkill_handler\] .* exits with return code"
)  # (a pdsh node prefix "host: " allowed)


class _LauncherLines:
    """The launcher's stdout (which the ranks inherit): its log lines go to ``logs/launcher.log``, the rest
    (rank 0's progress and messages) to the console as they come; ``--verbose`` prints everything but the
    launcher's misleading line about which rank failed (:data:`_MISLEADING`)."""

    def __init__(self, stream: Any, log: Any) -> None:
        import threading

        self.stream, self.log = stream, log
        self.verbose = bool(os.environ.get(VERBOSE_ENV))
        self.thread = threading.Thread(target=self._pump, name="tessera-launcher-lines", daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        out = sys.stdout.buffer
        with self.log as log:  # opened (never through a link) before the launcher started
            for line in iter(self.stream.readline, b""):
                misleading = bool(_MISLEADING.match(line))
                if misleading or _LOG_LINE.match(line):
                    try:
                        log.write(line)
                        log.flush()
                    except OSError:  # a full disk: the line is lost, the pipe keeps draining
                        pass
                    if misleading or not self.verbose:
                        continue
                try:
                    out.write(line)
                    out.flush()
                except (OSError, ValueError):  # our own stdout closed: keep draining the pipe
                    release_closed_console()

    def finish(self, proc: subprocess.Popen) -> None:
        """After the launcher ended (or was stopped): let the pump drain what is left."""
        self.thread.join(timeout=10)


def release_closed_console() -> None:
    """Our stdout / stderr is a pipe whose reader went away (``tessera run ... | head -1``): point it at
    /dev/null. The run goes on under supervision and ends with its own exit code; without this the next
    line printed raises BrokenPipeError (a traceback, exit 1), rich exits 1 on it, and the interpreter
    reports the unflushed buffer at exit. A pipe without readers polls POLLERR on its write end."""
    import select

    for fd in (1, 2):
        try:
            poller = select.poll()
            poller.register(fd, select.POLLOUT)
            gone = any(ev & select.POLLERR for _, ev in poller.poll(0))
        except (OSError, ValueError):
            continue
        if gone:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, fd)
            os.close(devnull)


def _launcher_tail(rd: RunDir, node: int | None = None, n: int = 15) -> list[str]:
    try:
        return rd.launcher_log_of(node or 0).read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []


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
            from tessera.atomic import write_text_atomic
            from tessera.errors import TesseraError

            try:  # never through a link planted there
                write_text_atomic(self.rd / RunDir.PREEMPT, f"{signal.Signals(signum).name}\n")
            except (OSError, TesseraError) as e:
                print(f"tessera: cannot ask the ranks to checkpoint: {e}", file=sys.stderr, flush=True)
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
    node: int | None = None,
) -> tuple[int, RankFailure | None]:
    """Run the launcher; returns (exit code, the failed rank if one failed). ``grace_s``: how long a
    preemption may take before the ranks are stopped; ``watchdog``: an object whose ``check()`` returns
    a :class:`RankFailure` when the ranks must be stopped from outside (a hang; on a multi-node run also
    a node lost or the supervisor's word), None otherwise; ``node``: this node's rank when the run spans
    nodes (only its ranks are watched here, its launcher's lines go to its own log, and the run's status
    files were reset by node 0 before the launch). Afterwards the run's shared-memory segments are
    released, however it ended."""
    try:
        return _run_and_monitor(cmd, env_add, run_dir, world, grace_s=grace_s, watchdog=watchdog, node=node)
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
    node: int | None,
) -> tuple[int, RankFailure | None]:
    from tessera.train.guard import SUPERVISOR_ENV, supervisor_token

    rd = RunDir(run_dir)
    if node is None:
        fresh_launch(rd)
    from tessera.atomic import open_append

    # a link there: refused before launch
    launcher_log = open_append(rd.launcher_log_of(node or 0), binary=True)
    env = {**os.environ, **env_add, SUPERVISOR_ENV: supervisor_token()}
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE)
    sorter = _LauncherLines(proc.stdout, launcher_log)
    ranks = _Ranks(node)
    pids = ranks.pids
    reaper_was = _child_subreaper(True)
    failure: RankFailure | None = None
    failed_at = 0.0
    signals = _Signals(rd)
    try:
        while True:
            rc = proc.poll()
            if len(signals.times) >= 2:
                _stop_group(proc, ranks.pids)
                return ExitCode.INTERRUPTED, None
            if signals.times and time.monotonic() - signals.times[0] > grace_s:
                print(
                    f"tessera: the ranks did not checkpoint within {grace_s:g} s; stopping them",
                    file=sys.stderr,
                )
                _stop_group(proc, ranks.pids)
                return ExitCode.TERMINATED, None
            release_closed_console()
            if failure is None:
                failure = _scan(rd, world, ranks)
                if failure is None and watchdog is not None and rc is None:
                    failure = watchdog.check()  # type: ignore[attr-defined]
                    if failure is not None:  # a hang, a node lost: nothing will exit by itself
                        failure.final = True
                        _stop_group(proc, ranks.pids)
                        break
                if failure is not None:
                    failed_at = time.monotonic()
            if rc is not None:
                break
            if failure is not None and time.monotonic() - failed_at > GRACE_S:
                _stop_group(proc, ranks.pids)
                break
            time.sleep(POLL_S)
    except KeyboardInterrupt:  # not the main thread: no handlers were installed
        _stop_group(proc, ranks.pids)
        return ExitCode.INTERRUPTED, None
    finally:
        signals.restore()
        sorter.finish(proc)
        release_closed_console()
        if reaper_was is not None:
            _child_subreaper(reaper_was)
    try:
        return _settle(proc, rd, world, ranks, failure)
    finally:
        for pid in [*pids.values(), *(p for p, _ in ranks.parents.values())]:
            _reap(pid)  # orphans reparented here while we were their reaper: no zombies left behind


def fresh_launch(rd: RunDir) -> None:
    """Before the ranks start: no status files, preemption request or preparation mark of an earlier
    launch (a multi-node run: node 0 does this once for every node, before any node launches)."""
    rd.clear_rank_status()
    for stale in (RunDir.PREEMPT, RunDir.PREPARED):
        (rd / stale).unlink(missing_ok=True)
    rd.drop_torn_tails()  # an earlier launch that crashed mid-line: the ranks append on a line of their own


def _settle(
    proc: subprocess.Popen, rd: RunDir, world: int, ranks: _Ranks, failure: RankFailure | None
) -> tuple[int, RankFailure | None]:
    """After the launcher ended: no rank outlives it, and the failure is the one that came first."""
    for pid in ranks.pids.values():
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    rc = proc.returncode if proc.returncode is not None else ExitCode.FAILED
    if failure is not None and failure.final:  # a hang, a node lost: the ranks were stopped for it
        return int(failure.code or ExitCode.FAILED), failure
    if rc < 0 and failure is None:  # the launcher itself was killed (its ranks then by us, just above)
        return ExitCode.RANK_LOST, RankFailure(
            None,
            f"was killed by {signal.Signals(-rc).name}",
            _launcher_tail(rd, ranks.node),
            code=ExitCode.RANK_LOST,
            who=f"the launcher {os.path.basename(proc.args[0])} (pid {proc.pid})",  # type: ignore[index]
            where=ranks.where,
        )
    mine = sorted(ranks.pids) if ranks.node is not None else range(world)
    if rc != 0 or any(rd.rank_exit(r) != ExitCode.OK for r in mine):
        # re-scan with everything settled: a vanished rank beats the first exit we saw (the deepspeed
        # runner exits 0 when its per-node launcher was killed: the ranks' status tells). A rank first
        # seen dead now needs a second look half a second later to count as vanished.
        _scan(rd, world, ranks)
        time.sleep(0.6)
        failure = _scan(rd, world, ranks) or failure
    if failure is not None and rc == 0:
        rc = ExitCode.FAILED
    return rc, failure
