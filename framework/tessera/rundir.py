"""The run directory: every file name in it, their readers and writers, the rank status files, and the
one table of exit codes.

Layout of ``runs/<name>/`` (one per run)::

    recipe.resolved.yaml  the recipe the ranks run (written before launch)
    data.json             the prepared data the ranks read (tokenised once, before launch)
    plan.json             the planner's estimates for the layout
    launch.json           the exact launcher command
    manifest.json         the reproducibility manifest (rank 0)
    metrics.jsonl         one line per step (rank 0)
    comm.jsonl            the collectives of every rank, per step
    summary.json          final loss, peaks, model-state and activation bytes per rank, plot paths
    *.png                 loss, step-time distribution, memory per rank
    checkpoints/          step_NNNNNN/ + latest (see tessera.checkpoint.manager); .stage-step_NNNNNN/
                          while a checkpoint of another layout is resharded (tessera.checkpoint.reshard)
    reshard-<ckpt>.json   tessera verify's report of a resharded checkpoint against its source
    tessera_conversion.json  the record of a `tessera convert --to ENGINE` run directory
    logs/rank_NNNNN.{log,pid,exit,heartbeat}, logs/.rank_NNNNN.exit.reserve (room for the exit file),
                          logs/launcher.log (the launcher's own lines; node K's: launcher.nodeK.log)
    tessera.sbatch        the script `tessera slurm` wrote and submitted
    nodes/                a multi-node run's agents: node_K.json, control.json (tessera.launch.agent)
    wandb/, wandb_id      the W&B mirror

Nothing else in Tessera (nor its tests and tools) spells these names. Every file here is written through
:mod:`tessera.atomic`: atomically or appended, never through a link, a full disk one clear error.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from enum import IntEnum
from pathlib import Path
from typing import IO, Any

from tessera.atomic import (
    open_append,
    open_lock,
    open_regular,
    read_regular,
    refuse_link,
    write_json_atomic,
    write_text_atomic,
    writing,
)
from tessera.errors import TesseraError, preview


class ExitCode(IntEnum):
    """What ``tessera`` and every rank exit with."""

    OK = 0
    FAILED = 1  # a crash: a bug or an environment failure (the log has the traceback)
    USER_ERROR = 2  # bad input: recipe, override, layout, data, checkpoint; the message names the fix
    DIVERGED = 3  # a stop rule saw NaN / Inf; the last good checkpoint is kept
    LOSS_SPIKE = 4  # stop rule: the loss's z-score over a trailing window stayed above the limit
    THROUGHPUT_FLOOR = 5  # stop rule: tokens/s below stop.min_tokens_per_s over its window
    TIME_LIMIT = 6  # stop rule: stop.max_time_s reached; a final checkpoint was saved
    PREEMPTED = 7  # SIGTERM / SIGINT to tessera run: the current step was checkpointed; --resume continues
    HUNG = 8  # the hang watchdog stopped the job (no progress for stop.hang_timeout_s; before step 1: one
    # start-up phase longer than stop.startup_timeout_s)
    RANK_LOST = 9  # a rank died without exiting (killed by a signal, the OOM killer)
    INTERRUPTED = 130  # Ctrl-C twice (128 + SIGINT): stopped at once
    TERMINATED = 143  # stopped by SIGTERM (128 + 15): the launcher stopping the survivors of a failure


#: exit codes after which every rank left the run in step with the others (collectively decided), so a
#: process may start another run on the same process group (the test harness does)
ORDERLY_EXITS = (
    ExitCode.OK,
    ExitCode.DIVERGED,
    ExitCode.LOSS_SPIKE,
    ExitCode.THROUGHPUT_FLOOR,
    ExitCode.TIME_LIMIT,
    ExitCode.PREEMPTED,
)
#: a run that ended this way is not restarted (bad input, or a decision rather than a fault)
NOT_RESTARTED = (ExitCode.USER_ERROR, *ORDERLY_EXITS[1:], ExitCode.INTERRUPTED)


#: the node rank a rank runs on, set for its launcher by the node's agent on a multi-node run (the rank
#: writes it into its pid file)
NODE_ENV = "TESSERA_NODE"

#: the worker's flag for a ``tessera run`` launch: rank 0 prepares the run dir (model checks, data, plan),
#: the other ranks wait for ``RunDir.PREPARED`` (:mod:`tessera.train.prepare`)
PREPARE_FLAG = "--prepare"


class RunDir:
    """One run directory. Paths are properties; the JSON / JSONL files have readers and writers here."""

    RECIPE = "recipe.resolved.yaml"
    GIT_DIFF = "git.diff"  # the uncommitted code of the run (manifest.json holds its sha256)
    DATA = "data.json"
    PLAN = "plan.json"
    LAUNCH = "launch.json"
    MANIFEST = "manifest.json"
    METRICS = "metrics.jsonl"
    COMM = "comm.jsonl"
    SUMMARY = "summary.json"
    CHECKPOINTS = "checkpoints"
    LOGS = "logs"
    WANDB = "wandb"  # W&B writes its runs below it (wandb.init(dir=run dir))
    WANDB_ID = "wandb_id"
    LOCK = "run.lock"  # held (flock) by the `tessera run` using the directory; names its pid
    FAULTS_FIRED = "faults.fired"  # one marker per injected fault that fired (each fires once per run dir)
    PREEMPT = "preempt.request"  # written by tessera run on SIGTERM / SIGINT; every rank checks per step
    PREPARED = "logs/prepared"  # rank 0 prepared the run dir (--prepare); the other ranks wait for it
    PLOTS = ("loss.png", "step_time.png", "memory.png")
    #: in logs/: the launcher's own INFO / WARNING lines (:mod:`tessera.launch.launcher`)
    LAUNCHER_LOG = "launcher.log"
    SBATCH = "tessera.sbatch"  # tessera slurm's script
    NODES = "nodes"  # a multi-node run's agents: nodes/node_K.json (each agent's), nodes/control.json
    # (node 0's word to the others), nodes/hostfile (a SLURM run's, for deepspeed)
    #: ``tessera convert``'s record: in the run directory of a ``--to ENGINE`` conversion (and, under the
    #: same name, in the HF directory a ``--to hf`` conversion writes)
    CONVERSION = "tessera_conversion.json"
    #: a checkpoint being written, ``checkpoints/.tmp-step_NNNNNN`` (:mod:`tessera.checkpoint.manager`)
    PARTIAL_CHECKPOINT = ".tmp-"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    # ---- paths -------------------------------------------------------------------------------------
    @property
    def recipe(self) -> Path:
        return self.path / self.RECIPE

    @property
    def data(self) -> Path:
        return self.path / self.DATA

    @property
    def plan(self) -> Path:
        return self.path / self.PLAN

    @property
    def launch(self) -> Path:
        return self.path / self.LAUNCH

    @property
    def manifest(self) -> Path:
        return self.path / self.MANIFEST

    @property
    def metrics(self) -> Path:
        return self.path / self.METRICS

    @property
    def comm(self) -> Path:
        return self.path / self.COMM

    @property
    def summary(self) -> Path:
        return self.path / self.SUMMARY

    @property
    def checkpoints(self) -> Path:
        return self.path / self.CHECKPOINTS

    @property
    def logs(self) -> Path:
        return self.path / self.LOGS

    @property
    def wandb(self) -> Path:
        return self.path / self.WANDB

    @property
    def wandb_id(self) -> Path:
        return self.path / self.WANDB_ID

    @property
    def launcher_log(self) -> Path:
        return self.logs / self.LAUNCHER_LOG

    def launcher_log_of(self, node: int) -> Path:
        """The launcher's own lines of node ``node`` (node 0's is ``launcher.log``)."""
        return self.launcher_log if node == 0 else self.logs / f"launcher.node{node}.log"

    @property
    def nodes(self) -> Path:
        return self.path / self.NODES

    def node_file(self, node: int) -> Path:
        """``nodes/node_K.json``: agent K's state (:mod:`tessera.launch.agent`)."""
        return self.nodes / f"node_{node}.json"

    @property
    def control(self) -> Path:
        """``nodes/control.json``: node 0's word to the other nodes' agents."""
        return self.nodes / "control.json"

    @classmethod
    def of_checkpoint(cls, ckpt: str | Path) -> RunDir:
        """The run directory a checkpoint ``<run>/checkpoints/step_NNNNNN`` lies in."""
        return cls(Path(ckpt).parent.parent)

    @staticmethod
    def reshard_report(checkpoint: str) -> str:
        """The name of ``tessera verify``'s report of checkpoint ``checkpoint`` (a step directory's name),
        resharded here, against its source (:mod:`tessera.train.resharding`)."""
        return f"reshard-{checkpoint}.json"

    def reshard_stage(self, checkpoint: str) -> Path:
        """``checkpoints/.stage-<checkpoint>``: the layout-free stage of checkpoint ``checkpoint`` (a step
        directory's name) while this run reshards it (:mod:`tessera.checkpoint.reshard`)."""
        return self.checkpoints / f".stage-{checkpoint}"

    def rank_file(self, rank: int, kind: str) -> Path:
        """``logs/rank_NNNNN.<kind>``: ``log`` (its output), ``pid`` (written at start), ``exit`` (its code,
        written at the end: a rank killed by a signal leaves none), ``heartbeat`` (where it is now, see
        :mod:`tessera.train.heartbeat`)."""
        return self.logs / f"rank_{rank:05d}.{kind}"

    # ---- readers and writers -----------------------------------------------------------------------
    def write_json(self, name: str, obj: Any) -> Path:
        path = self.path / name
        write_json_atomic(path, obj)
        return path

    def read_json(self, name: str) -> Any:
        return json.loads(read_regular(self.path / name))

    def read_json_if_present(self, name: str) -> Any:
        path = self.path / name
        return json.loads(path.read_text()) if path.is_file() else None

    def read_metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.metrics, keys=("step",))

    def read_comm(self) -> list[dict[str, Any]]:
        return read_jsonl(self.comm, keys=("step", "rank"))

    def drop_torn_tails(self) -> None:
        """Before ranks append to ``metrics.jsonl`` and ``comm.jsonl`` again: cut a torn last line (a
        crash while it was written) off each, with a warning, so that the next line starts on a line of
        its own instead of gluing onto the fragment (which would then be garbage in the middle)."""
        for path in (self.metrics, self.comm):
            if not (path.exists() or path.is_symlink()):
                continue
            with os.fdopen(open_regular(path, os.O_RDWR), "r+b") as f, writing(path):
                data = f.read()
                lines = _jsonl_lines(data)
                if lines and not isinstance(_record(lines[-1][2], ()), dict):
                    n, offset, raw = lines[-1]
                    f.truncate(offset)
                    _warn_torn(path, n, raw)
                elif data and not data.endswith(b"\n"):  # a whole record, only its newline missing
                    f.write(b"\n")

    def metrics_writer(self, *, resume_step: int | None) -> MetricsWriter:
        """The writer of ``metrics.jsonl`` (rank 0): a fresh run starts it empty; a resume first drops the
        lines after the step it resumes from."""
        return MetricsWriter(self.metrics, resume_step=resume_step)

    def comm_writer(self, rank: int) -> CommWriter:
        """This rank's appender to ``comm.jsonl`` (every rank appends to the one file)."""
        return CommWriter(self.comm, rank=rank)

    def read_summary(self) -> dict[str, Any]:
        return self.read_json(self.SUMMARY)

    def read_manifest(self) -> dict[str, Any]:
        return self.read_json(self.MANIFEST)

    def remove_partial_checkpoints(self) -> None:
        """After every rank ended: the directories of saves that did not complete (a full disk, a crash).
        The next save would remove them too, but a full disk needs their room now, and a run that ends
        here leaves only complete checkpoints behind."""
        import shutil

        if self.checkpoints.is_dir():
            for partial in self.checkpoints.glob(self.PARTIAL_CHECKPOINT + "*"):
                if partial.is_dir() and not partial.is_symlink():
                    shutil.rmtree(partial, ignore_errors=True)

    # ---- one run at a time ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def locked(self) -> Iterator[str | None]:
        """Hold the directory for one ``tessera run`` (an exclusive ``flock`` on ``run.lock``, released
        by the kernel if the holder dies). Yields a warning when it took over the lock file of a dead
        holder; a live holder is an error naming its pid. ``run.lock`` is never a link: a link there
        is refused before anything is written (it would point the pid at another file)."""
        import fcntl

        self.path.mkdir(parents=True, exist_ok=True)
        lock = self.path / self.LOCK
        f = open_lock(lock)
        try:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                holder = f.read().strip() or "unknown"
                raise TesseraError(
                    f"the run directory is in use by another tessera process (pid {holder})",
                    field="run.out_dir",
                    value=str(self.path),
                    fix="wait for that run to end (or stop it), or set run.out_dir to another directory",
                ) from None
            f.seek(0)
            stale = f.read().strip()
            with writing(lock):
                f.seek(0)
                f.truncate()
                f.write(f"{os.getpid()}\n")
                f.flush()
            yield (
                f"took over the lock of pid {stale}, which is gone (a run that was killed)" if stale else None
            )
            with contextlib.suppress(OSError):
                f.seek(0)
                f.truncate()  # a clean release leaves nothing to take over
        finally:
            with contextlib.suppress(OSError):  # a write the full disk refused is not flushed again
                f.close()

    # ---- rank status -------------------------------------------------------------------------------
    def _exit_reserve(self, rank: int) -> Path:
        return self.logs / f".rank_{rank:05d}.exit.reserve"

    def mark_rank_started(self, rank: int, pid: int, node: int | None = None) -> None:
        """``rank_N.pid`` (``pid``, or ``pid node host`` on a multi-node run: which node's agent watches
        it), and a block of disk for the rank's exit file, taken now: a rank that ends because the disk
        filled up can still say how it ended (:meth:`mark_rank_exited`)."""
        import socket

        self.logs.mkdir(parents=True, exist_ok=True)
        self.rank_file(rank, "exit").unlink(missing_ok=True)
        where = "" if node is None else f" {node} {socket.gethostname()}"
        write_text_atomic(self.rank_file(rank, "pid"), f"{pid}{where}\n")
        write_text_atomic(self._exit_reserve(rank), "room for this rank's exit code\n")

    def mark_rank_exited(self, rank: int, code: int) -> None:
        """``rank_N.exit``; never raises (the rank is ending). On a full disk the code goes into the
        block reserved at start (overwritten in place: no new space) and that file is renamed."""
        exit_f, reserve = self.rank_file(rank, "exit"), self._exit_reserve(rank)
        data = f"{code}\n".encode()
        try:
            write_text_atomic(exit_f, data.decode())
        except (TesseraError, OSError):
            with contextlib.suppress(TesseraError, OSError):
                fd = open_regular(reserve, os.O_WRONLY)
                try:
                    os.pwrite(fd, data, 0)
                    os.ftruncate(fd, len(data))
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(reserve, exit_f)
            return
        with contextlib.suppress(OSError):
            reserve.unlink(missing_ok=True)

    def rank_pid(self, rank: int) -> int | None:
        return _read_int(self.rank_file(rank, "pid"))

    def rank_node(self, rank: int) -> tuple[int, str] | None:
        """(node rank, host) of a rank of a multi-node run, from its pid file; None before it started."""
        try:
            _, node, host = self.rank_file(rank, "pid").read_text().split()
            return int(node), host
        except (OSError, ValueError):
            return None

    def rank_exit(self, rank: int) -> int | None:
        return _read_int(self.rank_file(rank, "exit"))

    def clear_rank_status(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        for pattern in ("rank_*.pid", "rank_*.exit", "rank_*.heartbeat", ".rank_*.exit.reserve"):
            for stale in self.logs.glob(pattern):
                stale.unlink()

    def open_rank_log(self, rank: int) -> RankLog:
        """``rank_N.log``, appended to (never through a link)."""
        return RankLog(open_append(self.rank_file(rank, "log")))

    def log_tail(self, rank: int, n: int = 15) -> list[str]:
        path = self.rank_file(rank, "log")
        if path.is_symlink():  # planted: its target is no log of this run, and is not shown
            return []
        try:
            return read_regular(path).decode(errors="replace").splitlines()[-n:]
        except (OSError, TesseraError):
            return []


class RankLog:
    """A rank's log file. A line the disk has no room for is lost rather than raised: the log is where
    a rank reports its end, and that report must not become a second failure (the exit code, and on
    rank 0 the console, still say what happened)."""

    def __init__(self, f: IO[str]) -> None:
        self._f = f

    def write(self, text: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._f.write(text)

    def fileno(self) -> int:
        return self._f.fileno()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._f.close()


class MetricsWriter:
    """Appends one JSON line per step and flushes it (a crash keeps every finished step, and tears at
    most the last line, which readers drop)."""

    def __init__(self, path: Path, *, resume_step: int | None) -> None:
        self.path = path
        refuse_link(path)  # nothing is read or written through a link
        if resume_step is not None and path.exists():
            kept = [r for r in read_jsonl(path, keys=("step",)) if r["step"] <= resume_step]
            write_text_atomic(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
        elif resume_step is None and path.exists():
            path.unlink()
        self._f = open_append(path)

    def write(self, record: dict[str, Any]) -> None:
        with writing(self.path):
            self._f.write(json.dumps(record, sort_keys=True) + "\n")
            self._f.flush()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._f.close()


class CommWriter:
    """``comm.jsonl``: one line per rank per step (and per setup / checkpoint phase), appended by every
    rank to the same file; each line is one ``write`` of well under the page size, which local and
    network file systems append whole. Readers key on (phase, step, rank): a resume appends after the old
    lines (``tessera run`` cut a torn last line off first: :meth:`RunDir.drop_torn_tails`)."""

    def __init__(self, path: Path, *, rank: int) -> None:
        self.rank = rank
        self.path = path
        self._f = open_append(path)

    def write(self, phase: str, step: int, ops: list[dict[str, Any]]) -> None:
        rec = {
            "phase": phase,
            "step": step,
            "rank": self.rank,
            "bytes": sum(o["bytes"] for o in ops),
            "seconds": sum(o["seconds"] for o in ops),
            "ops": ops,
        }
        with writing(self.path):
            self._f.write(json.dumps(rec, sort_keys=True) + "\n")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._f.close()


# ---- JSON lines ----------------------------------------------------------------------------------------


def _jsonl_lines(data: bytes) -> list[tuple[int, int, bytes]]:
    """(line number, byte offset, bytes) of every non-blank line."""
    out: list[tuple[int, int, bytes]] = []
    offset = 0
    for n, raw in enumerate(data.split(b"\n"), 1):
        if raw.strip():
            out.append((n, offset, raw))
        offset += len(raw) + 1
    return out


def _record(raw: bytes, keys: tuple[str, ...]) -> dict[str, Any] | str:
    """The line's record, or what is wrong with it."""
    try:
        rec = json.loads(raw)
    except json.JSONDecodeError as e:
        return f"not JSON ({e.msg})"
    except ValueError as e:  # not UTF-8
        return f"not JSON ({type(e).__name__})"
    if not isinstance(rec, dict):
        return "not a JSON object"
    missing = [k for k in keys if not isinstance(rec.get(k), int) or isinstance(rec.get(k), bool)]
    if missing:
        return f"a record without an integer {missing[0]!r}"
    return rec


def _warn_torn(path: Path, line: int, raw: bytes) -> None:
    text = preview(raw.decode("utf-8", errors="replace"), 60)
    print(
        f"tessera: warning: {path}: dropped its torn last line (line {line}: {text}), "
        "left by a crash while it was written",
        file=sys.stderr,
        flush=True,
    )


def read_jsonl(path: Path, *, keys: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (each a JSON object; ``keys``: integer fields each must have).
    A torn last line - what a crash in the middle of an append leaves - is dropped with one warning
    naming the file; a bad line anywhere else is an error naming the file and the line."""
    path = Path(path)
    lines = _jsonl_lines(read_regular(path))
    records: list[dict[str, Any]] = []
    for i, (n, _, raw) in enumerate(lines):
        rec = _record(raw, keys)
        if isinstance(rec, dict):
            records.append(rec)
        elif i == len(lines) - 1:
            _warn_torn(path, n, raw)
        else:
            raise TesseraError(
                f"{path}, line {n}: {rec}: {preview(raw.decode('utf-8', errors='replace'), 80)}",
                fix=f"restore the file from a copy, or delete line {n} "
                "(only a torn last line, as a crash leaves it, is dropped by itself)",
            )
    return records


def _read_int(path: Path) -> int | None:
    """The first number of a status file (a pid file may go on with the node and host)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
