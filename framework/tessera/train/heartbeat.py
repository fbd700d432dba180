"""Each rank's heartbeat: where it is, written every couple of seconds by a thread the step cannot block.

``logs/rank_NNNNN.heartbeat`` (JSON, replaced atomically): the time, the step, the phase (setup, data,
step, eval, checkpoint, done), the collective the rank is inside now (op, group, bytes, since when; from
the communication accounting), ``progress``, a number that grows whenever the rank finishes a
collective or changes phase, ``armed`` (this process has finished a step: set-up and the first step,
which may resume at step 7, are not judged) and ``at``, the innermost line of the training code the
rank's main thread is executing (file:line function), read from the interpreter's frames. The supervisor's hang watchdog (:mod:`tessera.launch.watchdog`) reads them:
a rank whose ``progress`` has not moved for ``stop.hang_timeout_s`` is hung, and the others' heartbeats
say what they are waiting in. The thread only reads a few attributes and writes a small file, so a rank
blocked in C++ (a collective, a kernel) keeps beating; a frozen process stops beating, which the
watchdog also sees.
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
_STDLIB = os.path.dirname(os.__file__)
_WRAPPERS = (os.path.join("tessera", "comm", "accounting.py"), os.path.join("torch", "distributed", ""))


def _skipped(filename: str) -> bool:
    return (filename.startswith(_STDLIB) and "site-packages" not in filename) or any(
        w in filename for w in _WRAPPERS
    )


class Heartbeat:
    def __init__(self, path: Path, rank: int, counter: Any) -> None:
        self.path, self.rank, self.counter = Path(path), rank, counter
        self.step = 0
        self.phase = "setup"
        self._phase_changes = 0
        self.armed = False
        self._main = threading.get_ident()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tessera-heartbeat", daemon=True)
        self._thread.start()

    def set(self, *, step: int | None = None, phase: str | None = None) -> None:
        if step is not None:
            self.step = step
        if phase is not None and phase != self.phase:
            self.phase = phase
            self._phase_changes += 1
            self.armed = self.armed or phase == "step end"

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
        while frame is not None and _skipped(frame.f_code.co_filename):
            frame = frame.f_back
        if frame is None:
            return None
        return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} {frame.f_code.co_name}"

    def write(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(self.snapshot()))
            os.replace(tmp, self.path)
        except OSError:  # a full disk must not kill the rank from this thread
            pass

    def _run(self) -> None:
        while not self._stop.is_set():
            self.write()
            self._stop.wait(INTERVAL_S)

    def close(self) -> None:
        self.set(phase="done")
        self._stop.set()
        self.write()
