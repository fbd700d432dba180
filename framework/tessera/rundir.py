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
    checkpoints/          step_NNNNNN/ + latest (see tessera.checkpoint.manager)
    logs/rank_NNNNN.{log,pid,exit}
    wandb/, wandb_id      the W&B mirror

Nothing else in Tessera (nor its tests and tools) spells these names.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from enum import IntEnum
from pathlib import Path
from typing import Any

from tessera.atomic import write_json_atomic, write_text_atomic


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
    HUNG = 8  # the hang watchdog stopped the job (a rank made no progress for stop.hang_timeout_s)
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
        return json.loads((self.path / name).read_text())

    def read_json_if_present(self, name: str) -> Any:
        path = self.path / name
        return json.loads(path.read_text()) if path.is_file() else None

    def read_metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.metrics)

    def read_comm(self) -> list[dict[str, Any]]:
        return read_jsonl(self.comm)

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

    # ---- one run at a time ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def locked(self) -> Iterator[str | None]:
        """Hold the directory for one ``tessera run`` (an exclusive ``flock`` on ``run.lock``, released
        by the kernel if the holder dies). Yields a warning when it took over the lock file of a dead
        holder; a live holder is an error naming its pid."""
        import fcntl
        import os

        from tessera.errors import TesseraError

        self.path.mkdir(parents=True, exist_ok=True)
        f = open(self.path / self.LOCK, "a+")
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
            f.seek(0)
            f.truncate()
            f.write(f"{os.getpid()}\n")
            f.flush()
            yield (
                f"took over the lock of pid {stale}, which is gone (a run that was killed)" if stale else None
            )
            f.seek(0)
            f.truncate()  # a clean release leaves nothing to take over
        finally:
            f.close()

    # ---- rank status -------------------------------------------------------------------------------
    def mark_rank_started(self, rank: int, pid: int) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        self.rank_file(rank, "exit").unlink(missing_ok=True)
        write_text_atomic(self.rank_file(rank, "pid"), f"{pid}\n")

    def mark_rank_exited(self, rank: int, code: int) -> None:
        write_text_atomic(self.rank_file(rank, "exit"), f"{code}\n")

    def rank_pid(self, rank: int) -> int | None:
        return _read_int(self.rank_file(rank, "pid"))

    def rank_exit(self, rank: int) -> int | None:
        return _read_int(self.rank_file(rank, "exit"))

    def clear_rank_status(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        for kind in ("pid", "exit", "heartbeat"):
            for stale in self.logs.glob(f"rank_*.{kind}"):
                stale.unlink()

    def log_tail(self, rank: int, n: int = 15) -> list[str]:
        try:
            return self.rank_file(rank, "log").read_text(errors="replace").splitlines()[-n:]
        except OSError:
            return []


class MetricsWriter:
    """Appends one JSON line per step and flushes it (a crash keeps every finished step)."""

    def __init__(self, path: Path, *, resume_step: int | None) -> None:
        if resume_step is not None and path.is_file():
            kept = [
                ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= resume_step
            ]
            write_text_atomic(path, "".join(ln + "\n" for ln in kept))
        elif resume_step is None and path.exists():
            path.unlink()
        self._f = open(path, "a")

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record, sort_keys=True) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class CommWriter:
    """``comm.jsonl``: one line per rank per step (and per setup / checkpoint phase), appended by every
    rank to the same file; each line is one ``write`` of well under the page size, which local and
    network file systems append whole. Readers key on (phase, step, rank): a resume appends after the old
    lines."""

    def __init__(self, path: Path, *, rank: int) -> None:
        self.rank = rank
        self._f = open(path, "a", buffering=1)

    def write(self, phase: str, step: int, ops: list[dict[str, Any]]) -> None:
        rec = {
            "phase": phase,
            "step": step,
            "rank": self.rank,
            "bytes": sum(o["bytes"] for o in ops),
            "seconds": sum(o["seconds"] for o in ops),
            "ops": ops,
        }
        self._f.write(json.dumps(rec, sort_keys=True) + "\n")

    def close(self) -> None:
        self._f.close()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None
