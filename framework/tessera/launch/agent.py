"""A multi-node run's agents: one ``tessera run`` per node, each starting and stopping its own ranks; node
0's agent supervises every node.

They talk through the run directory, which every node shares (the checkpoints need that anyway): no
port or service beyond the launchers' own rendezvous. Launcher-independent on purpose: deepspeed
--no_ssh, torchrun and SLURM steps get the same supervision (NVRx's needs SLURM, torchft replica
groups, torchrun's elastic agent restarts only its own node).

``nodes/node_K.json``  agent K's state, rewritten every ``BEAT_S``: its id (fresh per process), host,
                       pid, hardware, recipe hash, ``beat`` (a counter), the generation it acts on, its
                       status (joined, ready, running, ended, error) and the outcome of its ranks
``nodes/control.json`` node 0's word: the members (node -> agent id), the generation, the action
                       (check, launch, stop, end), the port, resume and the worker's flags

One generation = one launch of every node's ranks. Node 0 resets the run's status files, asks every
agent to ``check`` (same recipe, rendezvous port free where it is local), then to ``launch``; each agent
runs its launcher under the local monitor (:mod:`tessera.launch.launcher`: a rank lost or crashed on
this node) and reports the outcome. Node 0 also watches every rank's heartbeat (the hang watchdog) and
every agent's beat (a node lost: its ``tessera run`` killed, the machine gone), and on a failure anywhere
tells the others to ``stop``. The outcome of a generation is the failure that came first anywhere; the
restart policy (``run.restarts``, from the last complete checkpoint) is the single-node one
(:func:`tessera.launch.runs._supervise`), each restart a new generation on every node. A node lost ends
the run: there is no agent left to start its ranks. Every rank watches its own node's agent
(:mod:`tessera.train.guard`), so no rank outlives the ``tessera run`` of its node, and an agent whose
supervisor is gone stops its ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tessera.atomic import write_json_atomic
from tessera.errors import TesseraError
from tessera.launch.launcher import RankFailure, fresh_launch, run_and_monitor
from tessera.launch.modes import Cluster, build_command, check_port, rendezvous_port
from tessera.rundir import ORDERLY_EXITS, ExitCode, RunDir

BEAT_S = 0.5  # an agent rewrites its node file this often
LOST_S = 4.0  # an agent whose beat has not moved for this long (by the reader's clock) is lost
POLL_S = 0.2
STOP_WAIT_S = 30.0  # after "stop": how long a live agent may take to report before it counts as lost


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class NodeState:
    """This agent's ``nodes/node_K.json``, rewritten every ``BEAT_S`` by a thread (a busy main loop
    never makes a live node look lost) and at once on every change of status."""

    def __init__(self, rd: RunDir, node: int, recipe_hash: str) -> None:
        from tessera.evidence.manifest import host_facts

        self.path = rd.node_file(node)
        self.id = uuid.uuid4().hex
        facts = host_facts()
        self.state: dict[str, Any] = {
            "node": node,
            "id": self.id,
            "host": facts["hostname"],
            "pid": os.getpid(),
            "hardware": facts,
            "recipe_hash": recipe_hash,
            "status": "joined",
            "generation": 0,
            "result": None,
            "error": None,
        }
        self.beat = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        rd.nodes.mkdir(parents=True, exist_ok=True)
        self._write()
        self._thread = threading.Thread(target=self._run, name="tessera-node-beat", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        with self._lock:
            self.beat += 1
            with contextlib.suppress(OSError, TesseraError):  # a full disk: the beat skips, node 0 waits
                write_json_atomic(self.path, {**self.state, "beat": self.beat})

    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            self._write()

    def update(self, **changes: Any) -> None:
        self.state.update(changes)
        self._write()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


class Peers:
    """Whether other agents are alive: a beat that moved within ``LOST_S`` by this process's clock (no
    clock is compared across machines)."""

    def __init__(self, rd: RunDir) -> None:
        self.rd = rd
        self.seen: dict[int, tuple[Any, float]] = {}

    def read(self, node: int) -> dict[str, Any] | None:
        state = _read(self.rd.node_file(node))
        now = time.monotonic()
        key = None if state is None else (state.get("id"), state.get("beat"))
        if node not in self.seen or self.seen[node][0] != key:
            self.seen[node] = (key, now)
        return state

    def quiet_s(self, node: int) -> float:
        return time.monotonic() - self.seen[node][1] if node in self.seen else 0.0

    def lost(self, node: int, member: str) -> bool:
        """The agent ``member`` of node ``node`` has not beaten for ``LOST_S``, or another process took
        its place (a second ``tessera run`` of that node: the first one is gone)."""
        state = self.read(node)
        if state is not None and state.get("id") not in (None, member):
            return True
        return self.quiet_s(node) > LOST_S


def _to_record(failure: RankFailure | None) -> dict[str, Any] | None:
    return None if failure is None else {**asdict(failure), "seen": time.time()}


def _from_record(rec: dict[str, Any]) -> RankFailure:
    rec = {k: v for k, v in rec.items() if k != "seen"}
    return RankFailure(**rec)


def _priority(code: int, failure: RankFailure) -> int:
    """Which failure explains a generation: a node lost, then a rank lost, a hang, a crash; a stop every
    rank agreed on (a preemption, a stop rule) comes after those; a rank stopped because another failed,
    last."""
    if not failure.restartable:
        return 0
    order = {ExitCode.RANK_LOST: 1, ExitCode.HUNG: 2, ExitCode.TERMINATED: 6}
    if code in order:
        return order[code]
    return 4 if code in ORDERLY_EXITS else 3


def lost_node(
    state: dict[str, Any] | None, node: int, quiet_s: float, *, supervisor: bool = False
) -> RankFailure:
    host = (state or {}).get("host", "?")
    pid = (state or {}).get("pid", "?")
    role = " (the supervisor)" if supervisor else ""
    return RankFailure(
        None,
        f"was lost: its tessera run (pid {pid}){role} has not been heard from for {quiet_s:.0f} s (killed, "
        "or the machine went down); every rank of the job is stopped",
        [],
        code=ExitCode.RANK_LOST,
        who=f"node {node} (host {host})",
        restartable=False,
    )


class _Watch:
    """What stops this node's ranks from outside: node 0 checks the hang watchdog, every other agent and
    their reports; another node checks node 0's word (stop) and that node 0 is alive."""

    def __init__(self, owner: Any, generation: int, dog: Any = None) -> None:
        self.owner, self.generation, self.dog = owner, generation, dog

    def check(self) -> RankFailure | None:
        return self.owner.outside(self.generation, self.dog)


class _Agent:
    """What every node's agent has: the run, its own node file, its view of the other agents, and the
    launch of its node's ranks."""

    def __init__(self, recipe: Any, rd: RunDir, cluster: Cluster, device: str, recipe_hash: str) -> None:
        self.recipe, self.rd, self.cluster, self.device = recipe, rd, cluster, device
        self.hash = recipe_hash
        self.me = NodeState(rd, cluster.node_rank, recipe_hash)
        self.peers = Peers(rd)
        self.control: dict[str, Any] = {}

    def launch(self, g: int, control: dict[str, Any], dog: Any) -> tuple[int, RankFailure | None]:
        """Start this node's ranks for generation ``g`` and watch them (and, through the agent's own
        ``outside``, the rest of the job) until they end."""
        recipe = self.recipe
        cmd, env = build_command(
            recipe,
            self.rd.path,
            resume=bool(control["resume"]),
            device=self.device,
            worker_args=tuple(control["worker_args"]),
            port=int(control["port"]),
            cluster=self.cluster,
            hostfile=control.get("hostfile"),
            rdzv_id=control.get("rdzv_id"),
        )
        grace = recipe.run.preempt_grace_s
        return run_and_monitor(
            cmd, env, self.rd.path, recipe.run.world_size, grace_s=grace, watchdog=_Watch(self, g, dog),
            node=self.cluster.node_rank,
        )  # fmt: skip


class Supervisor(_Agent):
    """Node 0's agent: gathers the nodes, runs each generation on all of them, names what failed."""

    def __init__(
        self, recipe: Any, rd: RunDir, cluster: Cluster, device: str, recipe_hash: str, hostfile: str | None
    ) -> None:
        super().__init__(recipe, rd, cluster, device, recipe_hash)
        self.hostfile = hostfile  # a SLURM run's deepspeed hostfile, written here for every node
        self.members: dict[str, str] = {}
        self.session = uuid.uuid4().hex[:12]

    def _say(self, **control: Any) -> None:
        self.control = {"session": self.session, "members": self.members, "recipe_hash": self.hash, **control}
        write_json_atomic(self.rd.control, self.control)

    def join(self, timeout_s: float | None) -> None:
        """Wait until every node's agent beats (started with the same recipe, run dir and node count)."""
        self.members = {"0": self.me.id}
        others = range(1, self.cluster.nnodes)
        moved: dict[int, Any] = {}
        start, told = time.monotonic(), 0.0
        while True:
            for k in others:
                state = self.peers.read(k)
                if state is None:
                    continue
                first = moved.setdefault(k, (state.get("id"), state.get("beat")))
                if (state.get("id"), state.get("beat")) != first and state.get("status") == "joined":
                    self.members[str(k)] = state["id"]  # a live agent, not the file of an earlier run
            if len(self.members) == self.cluster.nnodes:
                return
            waited = time.monotonic() - start
            missing = [k for k in others if str(k) not in self.members]
            if waited > 3 and (not told or waited - told > 15):
                told = waited or 1e-9
                print(
                    f"tessera: waiting for node{'s' if len(missing) > 1 else ''} "
                    f"{', '.join(map(str, missing))} to join (tessera run ... --node-rank K there, with this "
                    f"run directory shared: {self.rd.path})",
                    file=sys.stderr,
                    flush=True,
                )
            if timeout_s is not None and waited > timeout_s:
                raise TesseraError(
                    f"node{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not join within "
                    f"{timeout_s:g} s",
                    field="--node-rank",
                    value=missing[0],
                    fix="start `tessera run` with the same recipe and --node-rank on every node, with the run "
                    "directory on a file system every node shares (stop.startup_timeout_s sets this wait)",
                )
            time.sleep(POLL_S)

    def generation(
        self, *, resume: bool, worker_args: tuple[str, ...], port: int | None, dog: Any
    ) -> tuple[int, RankFailure | None]:
        """Launch every node's ranks once and wait for all of them; returns (code, the first failure)."""
        g = int(self.control.get("generation", 0)) + 1
        fresh_launch(self.rd)
        port = rendezvous_port(self.recipe, self.cluster) if port is None else port
        common = {"generation": g, "port": port, "resume": resume, "worker_args": list(worker_args)}
        common["rdzv_id"] = f"{self.cluster.job_id or self.session}-{g}"
        common["hostfile"] = self.hostfile
        if self.hostfile:  # a SLURM run's deepspeed: a hostfile of the allocation, for every node
            from tessera.atomic import write_text_atomic

            hosts = zip(self.cluster.hosts, self.cluster.slots, strict=True)
            write_text_atomic(Path(self.hostfile), "".join(f"{h} slots={n}\n" for h, n in hosts))
        self._say(action="check", **common)
        failure = self._await("ready", g)
        if failure is not None:
            return int(failure.code or ExitCode.FAILED), failure
        self._say(action="launch", **common)
        self.me.update(status="running", generation=g, result=None)
        code, failure = self.launch(g, common, dog)
        self.me.update(status="ended", result={"code": code, "failure": _to_record(failure)})
        if code != 0:
            self._say(action="stop", **common)
        results: dict[int, tuple[int, RankFailure | None]] = {0: (code, failure)}
        lost = self._await("ended", g, results=results, stopping=code != 0)
        if lost is not None:
            self._say(action="stop", **common)
            results[-1] = (int(ExitCode.RANK_LOST), lost)
        return _first(results)

    def _await(
        self,
        status: str,
        g: int,
        *,
        results: dict[int, tuple[int, RankFailure | None]] | None = None,
        stopping: bool = True,
    ) -> RankFailure | None:
        """Wait until every other node's agent reports ``status`` for generation ``g``. Returns the reason
        to give up: a node lost, or (``ready``) a node's check that failed."""
        waiting = set(range(1, self.cluster.nnodes))
        since = time.monotonic()
        while waiting:
            for k in sorted(waiting):
                state = self.peers.read(k)
                member = self.members[str(k)]
                mine = state is not None and state.get("id") == member and state.get("generation") == g
                if mine and state["status"] == "error":
                    return RankFailure(
                        None,
                        state["error"],
                        [],
                        code=ExitCode.USER_ERROR,
                        who=f"node {k} (host {state['host']})",
                    )
                if mine and state["status"] == status:
                    waiting.discard(k)
                    if results is not None:
                        rec = state.get("result") or {}
                        failure = rec.get("failure")
                        results[k] = (
                            int(rec.get("code", ExitCode.FAILED)),
                            failure and _from_record(failure),
                        )
                        if rec.get("code") and not stopping:  # a node failed after node 0 finished well
                            stopping = True
                            self._say(**{**self.control, "action": "stop"})
                            since = time.monotonic()
                    continue
                too_long = stopping and status == "ended" and time.monotonic() - since > STOP_WAIT_S
                if self.peers.lost(k, member) or too_long:
                    return lost_node(state, k, max(self.peers.quiet_s(k), LOST_S))
            time.sleep(POLL_S)
        return None

    def outside(self, g: int, dog: Any) -> RankFailure | None:
        """While node 0's ranks run: a hang anywhere, a node lost, another node's ranks failed."""
        failure = dog.check() if dog is not None else None
        if failure is not None:
            return failure
        for k in range(1, self.cluster.nnodes):
            member = self.members[str(k)]
            state = self.peers.read(k)
            if self.peers.lost(k, member):
                return lost_node(state, k, self.peers.quiet_s(k))
            if state and state.get("generation") == g and state.get("status") == "ended":
                rec = state.get("result") or {}
                # a stop every rank agreed on (a preemption) is theirs and ours alike: not stopped from here
                if rec.get("code") not in ORDERLY_EXITS and rec.get("failure"):
                    theirs = _from_record(rec["failure"])
                    theirs.final = True
                    return theirs
        return None

    def end(self, code: int) -> None:
        with contextlib.suppress(OSError, TesseraError):
            self._say(**{**self.control, "action": "end", "code": int(code)})
        self.me.close()


def _first(results: dict[int, tuple[int, RankFailure | None]]) -> tuple[int, RankFailure | None]:
    """The outcome of a generation over every node: the failure that explains it (:func:`_priority`)."""
    failed = [(c, f) for c, f in results.values() if c != 0 and f is not None]
    if not failed:
        bad = [c for c, _ in results.values() if c != 0]
        return (bad[0], None) if bad else (0, None)
    # the rank's own code (a launcher's exit status says less: 1 whichever rank failed how)
    code, failure = min(failed, key=lambda cf: _priority(cf[1].code or cf[0], cf[1]))  # type: ignore[union-attr]
    return int(failure.code or code), failure  # type: ignore[union-attr]


class Follower(_Agent):
    """The agent of node K > 0: does what node 0 says, for as long as node 0 lives."""

    def _mine(self) -> dict[str, Any] | None:
        c = _read(self.rd.control)
        if c is None or (c.get("members") or {}).get(str(self.cluster.node_rank)) != self.me.id:
            return None  # none yet, or an earlier run's
        return c

    def outside(self, g: int, dog: Any) -> RankFailure | None:
        c = self._mine()
        if c is not None and c.get("generation") == g and c.get("action") in ("stop", "end"):
            return RankFailure(None, "stopped by node 0", [], code=ExitCode.TERMINATED, who="node 0")
        if self.peers.lost(0, self.control["members"]["0"]):
            return lost_node(self.peers.read(0), 0, self.peers.quiet_s(0), supervisor=True)
        return None

    def follow(self, startup_timeout_s: float | None) -> int:
        k, done = self.cluster.node_rank, 0
        start = time.monotonic()
        try:
            while True:
                c = self._mine()
                if c is None:
                    if startup_timeout_s is not None and time.monotonic() - start > startup_timeout_s:
                        print(f"tessera: node {k}: node 0 did not start the run within {startup_timeout_s:g} s "
                              "(is its tessera run started, on the same run directory?)", file=sys.stderr)  # fmt: skip
                        return int(ExitCode.FAILED)
                    time.sleep(POLL_S)
                    continue
                self.control = c
                if c["action"] == "end":
                    return int(c.get("code", 0))
                if self.peers.lost(0, c["members"]["0"]):
                    failure = lost_node(self.peers.read(0), 0, self.peers.quiet_s(0), supervisor=True)
                    print(f"tessera: node {k}: {failure.culprit} {failure.how}", file=sys.stderr)
                    return int(ExitCode.RANK_LOST)
                g = int(c["generation"])
                if c["action"] == "check" and self.me.state["generation"] != g:
                    self._check(c)
                elif c["action"] == "stop" and g > done and self.me.state["status"] == "ready":
                    # node 0 failed before this node launched: nothing ran here
                    self.me.update(status="ended", result={"code": int(ExitCode.TERMINATED), "failure": None})
                    done = g
                elif c["action"] == "launch" and g > done and self.me.state["status"] == "ready":
                    self.me.update(status="running", result=None)
                    code, failure = self.launch(g, c, None)
                    self.me.update(status="ended", result={"code": code, "failure": _to_record(failure)})
                    done = g
                    if failure is not None and failure.who != "node 0":
                        print(f"tessera: node {k}: {failure.culprit} {failure.how}", file=sys.stderr)
                time.sleep(POLL_S)
        finally:
            self.me.close()

    def _check(self, c: dict[str, Any]) -> None:
        g = int(c["generation"])
        error = None
        if c.get("recipe_hash") != self.hash:
            error = (
                f"its recipe differs from node 0's (hash {self.hash[:12]} vs {str(c.get('recipe_hash'))[:12]}): "
                "start every node with the same recipe file and overrides"
            )
        else:
            try:
                check_port(
                    self.cluster.address(self.recipe),
                    int(c["port"]),
                    where=f" on node {self.cluster.node_rank}",
                )
            except TesseraError as e:
                error = f"{e.message} ({e.fix})"
        self.me.update(status="error" if error else "ready", generation=g, error=error, result=None)


def slurm_hostfile(rd: RunDir, recipe: Any, cluster: Cluster) -> str | None:
    """Where a SLURM run's deepspeed finds its hostfile (node 0 writes it; None for other modes)."""
    if cluster.mode != "slurm" or recipe.run.launcher != "deepspeed":
        return None
    return str(rd.nodes / "hostfile")


def follow(recipe: Any, rd: RunDir, cluster: Cluster, device: str) -> int:
    """``tessera run`` on node K > 0: join, then launch and stop this node's ranks as node 0 says; returns
    the run's exit code (node 0's verdict), or this node's own reason to give up."""
    import fcntl

    from tessera.atomic import open_lock
    from tessera.config.loader import recipe_hash

    rd.nodes.mkdir(parents=True, exist_ok=True)
    lock = open_lock(rd.nodes / f"node_{cluster.node_rank}.lock")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise TesseraError(
            f"another tessera run already is node {cluster.node_rank} of this run",
            field="--node-rank",
            value=cluster.node_rank,
            fix="give each node its own --node-rank (0 .. nodes-1)",
        ) from None
    try:
        print(
            f"tessera: node {cluster.node_rank} of {cluster.nnodes} ({cluster.mode}): waiting for node 0 "
            f"(run directory {rd.path})",
            file=sys.stderr,
            flush=True,
        )
        agent = Follower(recipe, rd, cluster, device, recipe_hash(recipe))
        return agent.follow(recipe.stop.startup_timeout_s)
    finally:
        lock.close()
