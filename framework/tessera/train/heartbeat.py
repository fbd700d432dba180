"""Each rank's heartbeat: where it is, written every couple of seconds by a thread the step cannot block.

``logs/rank_NNNNN.heartbeat`` (JSON, replaced atomically): the time, the step, the phase (setup, data,
step, eval, checkpoint, done), the collective the rank is inside now (op, group, bytes, since when; from
the communication accounting) and ``progress``, a number that grows whenever the rank finishes a
collective or changes phase. The supervisor's hang watchdog (:mod:`tessera.launch.watchdog`) reads them:
a rank whose ``progress`` has not moved for ``stop.hang_timeout_s`` is hung, and the others' heartbeats
say what they are waiting in. The thread only reads a few attributes and writes a small file, so a rank
blocked in C++ (a collective, a kernel) keeps beating; a frozen process stops beating, which the
watchdog also sees.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

INTERVAL_S = 2.0


class Heartbeat:
    def __init__(self, path: Path, rank: int, counter: Any) -> None:
        self.path, self.rank, self.counter = Path(path), rank, counter
        self.step = 0
        self.phase = "setup"
        self._phase_changes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tessera-heartbeat", daemon=True)
        self._thread.start()

    def set(self, *, step: int | None = None, phase: str | None = None) -> None:
        if step is not None:
            self.step = step
        if phase is not None and phase != self.phase:
            self.phase = phase
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
        }

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
