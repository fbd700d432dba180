"""Each rank's heartbeat: where it is, written every couple of seconds by a thread the step cannot block.

``logs/rank_NNNNN.heartbeat`` (JSON, replaced atomically): the time, the step, the phase (the start-up
phases of :data:`STARTUP_PHASES`, then data, step, eval, step end, checkpoint; done), the collective the rank is inside now (op, group, bytes, since when; from
the communication accounting), ``progress``, a number that grows whenever the rank finishes a
collective or changes phase, ``armed`` (this process has finished a step: set-up and the first step,
which may resume at step 7, are not judged) and ``at``, the innermost line of the training code the
rank's main thread is executing (file:line function), read from the interpreter's frames. The
supervisor's hang watchdog (:mod:`tessera.launch.watchdog`) reads them: an armed rank whose ``progress``
has not moved for ``stop.hang_timeout_s`` is hung, a rank before that (a start-up phase, or its
process's first step) gets ``stop.startup_timeout_s`` per phase, and the others' heartbeats say what
they are waiting in. The thread only reads a few attributes and writes a small file, so a rank
blocked in C++ (a collective, a kernel) keeps beating; a frozen process stops beating, which the
watchdog also sees. A new step, and every start-up phase, is written at once by the thread that sets it
(a frozen process's file then names the step it froze in, not one from up to ``INTERVAL_S`` earlier); the
phases within a step are left to the thread (four file writes a step would cost more than they say).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

INTERVAL_S = 2.0
#: what a rank does before its first step, in order (a rank other than 0 of a ``tessera run`` launch waits
#: in "wait prepare" while rank 0 is in "prepare"); the supervisor names the phase a start-up hang is in
STARTUP_PHASES = (
    "start",  # interpreter and library imports (the worker module imports torch before this exists)
    "prepare",  # rank 0: the model checks (the model's config, the layout, the DeepSpeed config)
    "data prepare",  # rank 0: the data, tokenised once (cached by content hash), and plan.json
    "wait prepare",  # the other ranks: waiting for rank 0's RunDir.PREPARED
    "rendezvous",  # torch.distributed / DeepSpeed process group
    "checkpoint verify",  # the checkpoint a resume reads, file by file against its checksums
    "reshard",  # a checkpoint of another layout, staged / imported
    "data load",
    "model build",  # the engine: the model, the optimizer, DeepSpeed's JIT-built ops
    "checkpoint load",
    "run start",  # the manifest, metrics.jsonl, comm.jsonl opened
    "wandb start",
)
#: phases in which a rank waits for another one (it is not judged itself; the one it waits for is)
WAITING_PHASES = ("wait prepare",)
_STDLIB = os.path.dirname(os.__file__)
_WRAPPERS = (
    os.path.join("tessera", "comm", "accounting.py"),
    os.path.join("torch", "distributed", ""),
    os.path.join("tessera", "train", "heartbeat.py"),  # the main thread writing its own heartbeat
)


def _skipped(filename: str) -> bool:
    return (filename.startswith(_STDLIB) and "site-packages" not in filename) or any(
        w in filename for w in _WRAPPERS
    )


class Heartbeat:
    def __init__(self, path: Path, rank: int, counter: Any) -> None:
        self.path, self.rank, self.counter = Path(path), rank, counter
        self.step = 0
        self.phase = "start"
        self._phase_changes = 0
        self.armed = False
        self._main = threading.get_ident()
        self._lock = threading.Lock()  # one writer at a time: a late periodic write never undoes a newer one
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tessera-heartbeat", daemon=True)
        self._thread.start()

    def set(self, *, step: int | None = None, phase: str | None = None) -> None:
        new_step = step is not None and step != self.step
        if new_step:
            self.step = step  # type: ignore[assignment]
        if phase is not None and phase != self.phase:
            self.phase = phase
            self._phase_changes += 1
            self.armed = self.armed or phase == "step end"
            new_step = new_step or not self.armed  # a start-up phase: written at once
        if new_step:
            self.write()

    def tick(self) -> None:
        """Progress inside a start-up phase (the data preparation's shards): the watchdog judges a phase
        by its progress, so a long preparation that advances is not taken for a hang."""
        self._phase_changes += 1

    def snapshot(self) -> dict[str, Any]:
        cur = self.counter.current
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "time": time.time(),
            "step": self.step,
            "phase": self.phase,
            "progress": self.counter.completed + self._phase_changes,
            "op": None if cur is None else {"op": cur[0], "group": cur[1], "bytes": cur[2], "since": cur[3]},
            "armed": self.armed,
            "at": self._at(),
        }

    def _at(self) -> str | None:
        """file:line function of the main thread's innermost frame outside Python's own library and the
        collective wrappers (where a blocked rank is, for the hang diagnosis)."""
        frame = sys._current_frames().get(self._main)
        while frame is not None and (_skipped(frame.f_code.co_filename) or frame.f_code.co_name == "beat"):
            frame = frame.f_back  # (RunContext.beat: the caller of the heartbeat, when it writes itself)
        if frame is None:
            return None
        return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} {frame.f_code.co_name}"

    def write(self) -> None:
        from tessera.atomic import write_text_atomic
        from tessera.errors import TesseraError

        with self._lock:
            try:  # a fresh temporary renamed over it: never through a link; no fsync (a snapshot)
                write_text_atomic(self.path, json.dumps(self.snapshot()), durable=False)
            except (OSError, TesseraError):  # a full disk must not kill the rank from this thread
                pass

    def _run(self) -> None:
        while not self._stop.is_set():
            self.write()
            self._stop.wait(INTERVAL_S)

    def close(self) -> None:
        self.set(phase="done")
        self._stop.set()
        self.write()
