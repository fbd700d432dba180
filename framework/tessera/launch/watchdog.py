"""The hang watchdog: reads the ranks' heartbeats (:mod:`tessera.train.heartbeat`) from the supervisor.

A rank is hung when its heartbeat's ``progress`` (finished collectives + phase changes) has not moved
for its timeout by the supervisor's clock, or its heartbeat file itself stopped being rewritten for that
long (a frozen process). The timeout is ``stop.hang_timeout_s`` once that rank's process has finished a
step; before that (every start-up phase: imports, rank 0's preparation, the rendezvous, the checkpoint
check, the data, the model build with DeepSpeed's JIT-compiled ops, the checkpoint load, opening the
run's files, W&B; then the process's first step, which may resume at step 7) it is
``stop.startup_timeout_s`` per phase, long enough for a slow first build. A rank of a local launch
that has written no heartbeat at all by then is stuck in phase "launch". A rank waiting for another one
(the other ranks while rank 0 prepares the run) is not judged itself: the one it waits for is.

Once one rank is hung the job is, and the diagnosis names the rank holding the others up, chosen among
all the quiet ranks (not only those past the timeout: the ranks' heartbeats are seconds apart, so the
waiting rank can cross it first): a frozen process first, else the one outside any collective, else
the one with the least progress. It says what that rank is doing, at which line of the code, and what
the others wait in, e.g. "rank 1 has been in step (no collective, faults.py:159 on_step_start) at step
5 for 62 s; rank 0 is waiting in all_reduce on group dp (8 B)", or before the first step "rank 0 stuck
in phase run start for 31 s (no collective, rundir.py:212 metrics_writer); rank 1 is waiting in
broadcast on group world (8 B)".
"""

from __future__ import annotations

import json
import time
from typing import Any

from tessera.rundir import ExitCode, RunDir
from tessera.train.heartbeat import INTERVAL_S, WAITING_PHASES

FROZEN_S = 10.0  # a heartbeat file older than this (and the timeout): the process itself is frozen
# how much later than its peers a rank's stop can be seen: two heartbeat intervals (one each side)
LAG_S = 2 * INTERVAL_S
LAUNCH = "launch"  # the phase of a rank that has written no heartbeat yet


def _size(n: int) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= div:
            return f"{n / div:.0f} {unit}"
    return f"{n} B"


def _where(hb: dict[str, Any] | None) -> str:
    if hb is None:
        return "not started (no heartbeat yet)"
    if hb["phase"] in WAITING_PHASES:
        return "waiting for rank 0 to prepare the run directory"
    op = hb.get("op")
    if op:
        return f"in {op['op']} on group {op['group']} ({_size(op['bytes'])})"
    at = f", {hb['at']}" if hb.get("at") else ""
    return f"in {hb['phase']} (no collective{at})"


def _detail(hb: dict[str, Any] | None) -> str:
    """What a rank stuck before its first step is in: a collective, or the line of code."""
    if hb is None:
        return "no heartbeat yet: its process has not started, or hangs before Tessera's code"
    op = hb.get("op")
    if op:
        return f"in {op['op']} on group {op['group']} ({_size(op['bytes'])})"
    return "no collective" + (f", {hb['at']}" if hb.get("at") else "")


class HangWatchdog:
    """``timeout_s``: ``stop.hang_timeout_s`` (None: armed ranks are not judged); ``startup_timeout_s``:
    ``stop.startup_timeout_s`` (None: start-up is not judged); ``local``: every rank's heartbeat shows
    here (one machine, or a multi-node run with an agent per node and a shared run directory), so one
    that never writes a heartbeat is stuck in its launch; ``nodes``: name each rank's node and host."""

    def __init__(
        self,
        rd: RunDir,
        world: int,
        timeout_s: float | None,
        *,
        startup_timeout_s: float | None = None,
        local: bool = True,
        nodes: bool = False,
    ) -> None:
        self.rd, self.world, self.timeout = rd, world, timeout_s
        self.startup, self.local, self.nodes = startup_timeout_s, local, nodes
        self.seen: dict[int, tuple[tuple[Any, ...], float]] = {}

    def _name(self, rank: int) -> str:
        """``rank 1``; on a multi-node run ``rank 1 (node 1, host gpu07)``, from its pid file."""
        where = self.rd.rank_node(rank) if self.nodes else None
        return f"rank {rank}" + (f" (node {where[0]}, host {where[1]})" if where else "")

    def _read(self, rank: int) -> dict[str, Any] | None:
        try:
            return json.loads(self.rd.rank_file(rank, "heartbeat").read_text())
        except (OSError, ValueError):
            return None

    def check(self) -> Any:
        """None while every rank makes progress; else a RankFailure (code HUNG) with the diagnosis."""
        from tessera.launch.launcher import RankFailure

        now, wall = time.monotonic(), time.time()
        beats = {r: self._read(r) for r in range(self.world)}
        hung, quiet_ranks = False, []
        for r, hb in beats.items():
            if hb is None:
                if not self.local:
                    continue
                key: tuple[Any, ...] = (LAUNCH,)
                timeout = self.startup
            else:
                if hb["phase"] == "done" or hb["phase"] in WAITING_PHASES:
                    continue  # finished, or waiting for another rank (which is judged instead)
                key = (hb["progress"], hb["phase"], hb["step"])
                timeout = self.timeout if hb.get("armed") else self.startup
            if timeout is None:
                continue
            if r not in self.seen or self.seen[r][0] != key:
                self.seen[r] = (key, now)
            quiet = now - self.seen[r][1]
            age = 0.0 if hb is None else wall - hb["time"]
            frozen = age > max(timeout, FROZEN_S)  # a live rank rewrites it every 2 s
            hung = hung or quiet > timeout or frozen
            if quiet >= timeout - LAG_S or frozen:
                progress = -1 if hb is None else hb["progress"]
                waiting = hb is not None and hb.get("op") is not None
                quiet_ranks.append((not frozen, waiting, progress, r, max(quiet, age), frozen))
        if not hung:
            return None
        *_, rank, for_s, frozen = min(quiet_ranks)
        hb = beats[rank]
        if hb is not None and hb.get("armed"):
            what = (
                f"stopped writing its heartbeat (process frozen?) at step {hb['step']}, {_where(hb)}"
                if frozen
                else f"has been {_where(hb)} at step {hb['step']}"
            )
            diagnosis = f"{self._name(rank)} {what} for {for_s:.0f} s"
            setting = f"stop.hang_timeout_s={self.timeout:g}"
        else:
            phase = LAUNCH if hb is None else hb["phase"]
            if hb is not None and hb["step"]:
                phase += f" (step {hb['step']}, this process's first)"
            state = "stopped writing its heartbeat (process frozen?)" if frozen else "stuck"
            diagnosis = f"{self._name(rank)} {state} in phase {phase} for {for_s:.0f} s ({_detail(hb)})"
            setting = f"stop.startup_timeout_s={self.startup:g}"
        others: dict[str, list[int]] = {}
        for r, other in sorted(beats.items()):
            if r != rank and (other is not None or self.local):
                others.setdefault(_where(other), []).append(r)
        waiting = "; ".join(
            f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} {'are' if len(rs) > 1 else 'is'} "
            + ("waiting " if where.startswith("in ") and "collective" not in where else "")
            + where
            for where, rs in others.items()
        )
        diagnosis += (f"; {waiting}" if waiting else "") + f" ({setting})"
        return RankFailure(rank, f"hung: {diagnosis}", self.rd.log_tail(rank), code=ExitCode.HUNG)
