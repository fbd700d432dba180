"""A rank never outlives the ``tessera run`` that started it.

Two mechanisms, both on Linux: the kernel's parent-death signal (``PR_SET_PDEATHSIG``: SIGKILL when the
rank's parent, the launcher's per-node agent, dies) and a watch thread on the supervisor itself, the
``tessera run`` process named in ``TESSERA_SUPERVISOR`` as ``pid:start-time@host`` (the start time tells a
recycled pid apart; with one ``tessera run`` per node each rank watches its own node's; in DeepSpeed's
ssh mode ranks on other hosts rely on the parent-death signal alone). Killing ``tessera run`` with any signal, SIGKILL included, therefore ends every rank
within about a second, and the launcher's processes, whose children are gone, follow.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

SUPERVISOR_ENV = "TESSERA_SUPERVISOR"
_PR_SET_PDEATHSIG = 1
POLL_S = 1.0


def start_ticks(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), or None if
    there is no such (live) process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def supervisor_token(pid: int | None = None) -> str:
    """What ``tessera run`` puts in ``TESSERA_SUPERVISOR`` for its ranks: ``pid:start-time@host``."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{start_ticks(pid) or ''}@{socket.gethostname()}"


def supervisor_pid() -> int | None:
    """The ``tessera run`` process of this rank, when it runs on this host."""
    token, _, host = os.environ.get(SUPERVISOR_ENV, "").partition("@")
    pid = token.partition(":")[0]
    return int(pid) if pid.isdigit() and host == socket.gethostname() else None


def die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def guard_rank(on_orphaned) -> None:
    """Arm both mechanisms for this rank; ``on_orphaned()`` runs (then the process exits) when the
    supervisor is gone."""
    die_with_parent()
    token, _, host = os.environ.get(SUPERVISOR_ENV, "").partition("@")
    pid_s, _, ticks = token.partition(":")
    if not pid_s.isdigit() or not ticks:
        return  # started without tessera run (the test harness, a manual launcher call)
    if host != socket.gethostname():
        return  # another node of a multi-node run: its launcher agent dies with the ssh session instead
    pid = int(pid_s)

    def watch() -> None:
        while True:
            if start_ticks(pid) != ticks:
                on_orphaned()
                os._exit(143)  # ExitCode.TERMINATED: stopped from outside
            time.sleep(POLL_S)

    threading.Thread(target=watch, name="tessera-supervisor-watch", daemon=True).start()
