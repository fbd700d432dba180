"""The hang watchdog: reads the ranks' heartbeats (:mod:`tessera.train.heartbeat`) from the supervisor.

A rank is hung when its heartbeat's ``progress`` (finished collectives + phase changes) has not moved
for ``stop.hang_timeout_s`` by the supervisor's clock, or its heartbeat file itself stopped being
rewritten for that long (a frozen process). The watchdog is armed per rank once that rank's process
has finished a step: set-up (imports, DeepSpeed's JIT builds, loading a checkpoint, the first
compilation) is not judged, including after a restart that resumes at a later step.

Once one rank is hung the job is, and the diagnosis names the rank holding the others up, chosen among
all the quiet ranks (not only those past the timeout: the ranks' heartbeats are seconds apart, so the
waiting rank can cross it first): a frozen process first, else the one outside any collective, else
the one with the least progress. It says what that rank is doing, at which line of the code, and what
the others wait in, e.g. "rank 1 has been in step (no collective, faults.py:159 on_step_start) at step
5 for 62 s; rank 0 is waiting in all_reduce on group dp (8 B)".
"""

from __future__ import annotations

import json
import time
from typing import Any

from tessera.rundir import ExitCode, RunDir
from tessera.train.heartbeat import INTERVAL_S

FROZEN_S = 10.0  # a heartbeat file older than this (and the timeout): the process itself is frozen
# how much later than its peers a rank's stop can be seen: two heartbeat intervals (one each side)
LAG_S = 2 * INTERVAL_S


def _size(n: int) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= div:
            return f"{n / div:.0f} {unit}"
    return f"{n} B"


def _where(hb: dict[str, Any]) -> str:
    op = hb.get("op")
    if op:
        return f"in {op['op']} on group {op['group']} ({_size(op['bytes'])})"
    at = f", {hb['at']}" if hb.get("at") else ""
    return f"in {hb['phase']} (no collective{at})"


class HangWatchdog:
    def __init__(self, rd: RunDir, world: int, timeout_s: float) -> None:
        self.rd, self.world, self.timeout = rd, world, timeout_s
        self.seen: dict[int, tuple[tuple[Any, ...], float]] = {}

    def _read(self, rank: int) -> dict[str, Any] | None:
        try:
            return json.loads(self.rd.rank_file(rank, "heartbeat").read_text())
        except (OSError, ValueError):
            return None

    def check(self) -> Any:
        """None while every armed rank makes progress; else a RankFailure (code HUNG) with the diagnosis."""
        from tessera.launch.launcher import RankFailure

        now, wall = time.monotonic(), time.time()
        beats = {r: hb for r in range(self.world) if (hb := self._read(r)) is not None}
        hung, quiet_ranks = False, []
        for r, hb in beats.items():
            if not hb.get("armed") or hb["phase"] == "done":
                continue  # set-up and this process's first step are not judged
            key = (hb["progress"], hb["phase"], hb["step"])
            if r not in self.seen or self.seen[r][0] != key:
                self.seen[r] = (key, now)
            quiet = now - self.seen[r][1]
            age = wall - hb["time"]
            frozen = age > max(self.timeout, FROZEN_S)  # a live rank rewrites it every 2 s
            hung = hung or quiet > self.timeout or frozen
            if quiet >= self.timeout - LAG_S or frozen:
                quiet_ranks.append(
                    (not frozen, hb.get("op") is not None, hb["progress"], r, max(quiet, age), frozen)
                )
        if not hung:
            return None
        *_, rank, for_s, frozen = min(quiet_ranks)
        hb = beats[rank]
        what = (
            f"stopped writing its heartbeat (process frozen?) at step {hb['step']}, {_where(hb)}"
            if frozen
            else f"has been {_where(hb)} at step {hb['step']}"
        )
        others: dict[str, list[int]] = {}
        for r, other in sorted(beats.items()):
            if r != rank:
                others.setdefault(_where(other), []).append(r)
        waiting = "; ".join(
            f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} {'are' if len(rs) > 1 else 'is'} "
            + ("waiting " if where.startswith("in ") and "collective" not in where else "")
            + where
            for where, rs in others.items()
        )
        diagnosis = f"rank {rank} {what} for {for_s:.0f} s" + (f"; {waiting}" if waiting else "")
        return RankFailure(rank, f"hung: {diagnosis}", self.rd.log_tail(rank), code=ExitCode.HUNG)
