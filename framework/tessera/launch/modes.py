"""How the ranks are started, on one node or many: the launch modes, their commands, addresses and ports.

The recipe is the same in every mode; the mode comes from the command line or from SLURM's environment:

==========  ==========================================================================================
single      one node: ``deepspeed --num_gpus N`` or ``torchrun --nproc_per_node N``
ssh         ``run.hostfile`` and nothing else: DeepSpeed's runner starts every node over pdsh / ssh
            from this one ``tessera run`` (node 0 supervises what it can see)
no_ssh      ``run.hostfile`` + ``tessera run --node-rank K`` on every node: ``deepspeed --hostfile H
            --no_ssh --node_rank K``, for clusters without ssh between nodes
torchrun    ``run.launcher: torchrun`` + ``tessera run --nnodes N --node-rank K [--rdzv-endpoint H:P]``
            on every node: torchrun's c10d rendezvous
slurm       inside an allocation, ``srun --ntasks-per-node=1 tessera run R.yaml`` (``tessera slurm``
            writes that script): node rank, node list and address from SLURM's variables; the
            per-node launcher is ``run.launcher`` (torchrun with a static rendezvous, or deepspeed
            --no_ssh with a hostfile of the allocation)
==========  ==========================================================================================

In the last three every node's ``tessera run`` is an agent (:mod:`tessera.launch.agent`): it starts and
stops its own ranks, and node 0's agent supervises all of them through the shared run directory.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tessera.config.schema import Recipe
from tessera.errors import LayoutError, RecipeError
from tessera.rundir import NODE_ENV

DEFAULT_PORT = 29500
LOCAL_ADDRS = ("127.0.0.1", "localhost", "0.0.0.0")
AGENT_MODES = ("no_ssh", "torchrun", "slurm")


def venv_bin(name: str) -> str:
    """The console script next to this interpreter (the venv's), else whatever PATH has."""
    cand = Path(sys.executable).parent / name
    return str(cand) if cand.exists() else (shutil.which(name) or name)


def parse_hostfile(path: str) -> list[tuple[str, int]]:
    """``host slots=N`` lines (DeepSpeed's format); comments and blank lines ignored."""
    from tessera.config.loader import read_config_file  # regular file, size-bounded

    p = Path(path)
    if not p.exists():  # a FIFO or a device exists: read_config_file names it
        raise RecipeError(
            "hostfile not found",
            field="run.hostfile",
            value=path,
            fix="give a file of lines like 'node1 slots=8'",
        )
    hosts: list[tuple[str, int]] = []
    for i, line in enumerate(read_config_file(p, field="run.hostfile", what="host").splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        slots = [x for x in parts[1:] if x.startswith("slots=")]
        if len(parts) < 2 or not slots or not slots[0][6:].isdigit():
            raise RecipeError(
                f"line {i} is not 'host slots=N': {line!r}",
                field="run.hostfile",
                value=path,
                fix="write one 'hostname slots=N' per line",
            )
        hosts.append((parts[0], int(slots[0][6:])))
    if not hosts:
        raise RecipeError(
            "hostfile lists no hosts",
            field="run.hostfile",
            value=path,
            fix="add lines like 'localhost slots=2'",
        )
    if len({h for h, _ in hosts}) != len(hosts):
        raise RecipeError(
            "a host is listed twice",
            field="run.hostfile",
            value=path,
            fix="one line per node (two nodes on one machine: two names of it, e.g. 127.0.0.1 and localhost)",
        )
    return hosts


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compressed host list (``SLURM_JOB_NODELIST``): ``gpu[01-03,07],login-a[1-2]-ib`` ->
    gpu01, gpu02, gpu03, gpu07, login-a1-ib, login-a2-ib. Written here because ``scontrol show
    hostnames`` needs the SLURM client on the node and a subprocess per node; the syntax is small
    (ranges keep their zero padding; several bracket groups in one name multiply)."""
    items, depth, cur = [], 0, ""
    for ch in text.strip():
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    items.append(cur)
    out: list[str] = []
    for item in filter(None, (i.strip() for i in items)):
        m = re.match(r"^([^\[]*)\[([^\]]+)\](.*)$", item)
        if m is None:
            out.append(item)
            continue
        head, ranges, tail = m.groups()
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise RecipeError(
                    f"cannot read the host range {part!r}",
                    field="SLURM_JOB_NODELIST",
                    value=text,
                    fix="a SLURM host list such as node[01-04],gpu7",
                )
            for n in range(int(lo), int(hi or lo) + 1):
                out += [head + str(n).zfill(len(lo)) + t for t in expand_hostlist(tail or "")] or [
                    head + str(n).zfill(len(lo))
                ]
    return out


@dataclass(frozen=True)
class Cluster:
    """Where this ``tessera run`` stands: the mode, the nodes and this node's rank among them."""

    mode: str = "single"
    nnodes: int = 1
    node_rank: int = 0
    hosts: tuple[str, ...] = ()  # the nodes in order (a hostfile's lines, SLURM's node list)
    slots: tuple[int, ...] = ()  # ranks per node
    master_addr: str | None = None  # SLURM's first node; else the recipe's run.master_addr
    rdzv_endpoint: str | None = None  # torchrun's c10d rendezvous, "host:port"
    job_id: str | None = None  # SLURM's

    @property
    def agents(self) -> bool:
        """One ``tessera run`` per node, node 0's supervising (:mod:`tessera.launch.agent`)."""
        return self.nnodes > 1 and self.mode in AGENT_MODES

    @property
    def ranks_here(self) -> int:
        return self.slots[self.node_rank]

    def first_rank(self, node: int) -> int:
        return sum(self.slots[:node])

    def address(self, recipe: Recipe) -> str:
        return self.master_addr or recipe.run.master_addr

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _flag_error(what: str, value: Any, fix: str, field: str) -> RecipeError:
    return RecipeError(what, field=field, value=value, fix=fix)


def ranks_per_node(world: int, nnodes: int, field: str) -> tuple[int, ...]:
    """``world`` ranks spread evenly over ``nnodes`` nodes (``field``: what sets the node count)."""
    if world % nnodes:
        raise LayoutError(
            f"{world} ranks cannot be split evenly over {nnodes} nodes",
            field="run.world_size",
            value=world,
            fix=f"set run.world_size to a multiple of {nnodes} (ranks per node x nodes), or change {field}",
        )
    return (world // nnodes,) * nnodes


def _slurm(recipe: Recipe, env: Mapping[str, str]) -> Cluster:
    """``tessera run`` as one task of ``srun --ntasks-per-node=1`` in a multi-node allocation."""
    nnodes = int(env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES") or 1)
    if "SLURM_STEP_ID" not in env and "SLURM_STEPID" not in env:
        raise RecipeError(
            f"tessera run is in the batch script of a {nnodes}-node SLURM job, not in an srun step: "
            "it would start the ranks of one node only",
            field="SLURM_JOB_ID",
            value=env.get("SLURM_JOB_ID"),
            fix="start it as `srun --ntasks-per-node=1 tessera run R.yaml` (`tessera slurm R.yaml` writes "
            "that script)",
        )
    ntasks = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or nnodes)
    if ntasks != nnodes:
        raise RecipeError(
            f"srun started {ntasks} tasks on {nnodes} nodes; Tessera wants one per node (it starts the "
            "node's ranks itself)",
            field="SLURM_NTASKS",
            value=ntasks,
            fix="srun --ntasks-per-node=1 tessera run R.yaml",
        )
    hosts = expand_hostlist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "")
    if len(hosts) != nnodes:
        raise RecipeError(
            f"the node list names {len(hosts)} nodes, SLURM_NNODES says {nnodes}",
            field="SLURM_JOB_NODELIST",
            value=env.get("SLURM_JOB_NODELIST"),
            fix="run inside the allocation's own environment (srun sets both)",
        )
    return Cluster(
        mode="slurm",
        nnodes=nnodes,
        node_rank=int(env.get("SLURM_NODEID", 0)),
        hosts=tuple(hosts),
        slots=ranks_per_node(recipe.run.world_size, nnodes, "the allocation's --nodes"),
        master_addr=hosts[0],
        job_id=env.get("SLURM_JOB_ID"),
    )


def resolve_cluster(
    recipe: Recipe,
    *,
    node_rank: int | None = None,
    nnodes: int | None = None,
    rdzv_endpoint: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> Cluster:
    """The launch mode of this ``tessera run`` from its flags (``--node-rank``, ``--nnodes``,
    ``--rdzv-endpoint``), the recipe's ``run.launcher`` / ``run.hostfile`` and SLURM's variables."""
    env = os.environ if environ is None else environ
    r = recipe.run
    flags = node_rank is not None or nnodes is not None or rdzv_endpoint is not None
    in_slurm = bool(env.get("SLURM_JOB_ID")) and int(env.get("SLURM_NNODES") or 1) > 1
    if in_slurm and not flags:
        return _slurm(recipe, env)
    if not flags:
        if not r.hostfile:
            return Cluster(slots=(r.world_size,))
        hosts = parse_hostfile(r.hostfile)
        cluster = Cluster(
            mode="ssh", nnodes=len(hosts), hosts=tuple(h for h, _ in hosts), slots=tuple(n for _, n in hosts)
        )
        _check_slots(cluster, recipe)
        return cluster
    if node_rank is None:
        raise _flag_error(
            "a multi-node launch needs this node's rank",
            None,
            "add --node-rank K (0 on the node whose tessera run supervises the others)",
            "--node-rank",
        )
    if r.launcher == "deepspeed":
        if not r.hostfile:
            raise _flag_error(
                "deepspeed --no_ssh takes the nodes from a hostfile",
                None,
                "set run.hostfile to a file of 'host slots=N' lines, one per node (the same file on "
                "every node), or use run.launcher: torchrun with --nnodes",
                "run.hostfile",
            )
        if rdzv_endpoint is not None:
            raise _flag_error(
                "--rdzv-endpoint is torchrun's; deepspeed --no_ssh meets at run.master_addr",
                rdzv_endpoint,
                "drop --rdzv-endpoint (set run.master_addr to node 0's address), or run.launcher: torchrun",
                "--rdzv-endpoint",
            )
        hosts = parse_hostfile(r.hostfile)
        if nnodes is not None and nnodes != len(hosts):
            raise _flag_error(
                f"--nnodes {nnodes} but the hostfile lists {len(hosts)} nodes",
                nnodes,
                f"drop --nnodes (the hostfile decides) or edit {r.hostfile}",
                "--nnodes",
            )
        cluster = Cluster(
            mode="no_ssh",
            nnodes=len(hosts),
            node_rank=node_rank,
            hosts=tuple(h for h, _ in hosts),
            slots=tuple(n for _, n in hosts),
        )
    else:
        if r.hostfile:
            raise _flag_error(
                "torchrun meets at --rdzv-endpoint; a hostfile is deepspeed's",
                r.hostfile,
                "remove run.hostfile, or set run.launcher: deepspeed",
                "run.hostfile",
            )
        if nnodes is None or nnodes < 1:
            raise _flag_error(
                "torchrun across nodes needs the number of nodes",
                nnodes,
                "add --nnodes N (the same on every node)",
                "--nnodes",
            )
        if rdzv_endpoint is not None:
            host, _, port = rdzv_endpoint.rpartition(":")
            if not host or not port.isdigit() or not 1024 <= int(port) <= 65535:
                raise _flag_error(
                    "not host:port",
                    rdzv_endpoint,
                    "--rdzv-endpoint node0.example:29400 (a port in 1024-65535)",
                    "--rdzv-endpoint",
                )
        cluster = Cluster(
            mode="torchrun",
            nnodes=nnodes,
            node_rank=node_rank,
            slots=ranks_per_node(r.world_size, nnodes, "--nnodes"),
            rdzv_endpoint=rdzv_endpoint,
        )
    if not 0 <= node_rank < cluster.nnodes:
        raise _flag_error(
            f"node ranks run 0..{cluster.nnodes - 1}",
            node_rank,
            f"--node-rank between 0 and {cluster.nnodes - 1}",
            "--node-rank",
        )
    _check_slots(cluster, recipe)
    return cluster


def _check_slots(cluster: Cluster, recipe: Recipe) -> None:
    r = recipe.run
    if sum(cluster.slots) != r.world_size:
        raise LayoutError(
            f"the hostfile has {sum(cluster.slots)} slots in all",
            field="run.world_size",
            value=r.world_size,
            fix=f"set run.world_size: {sum(cluster.slots)} or edit {r.hostfile}",
        )


def port_state(addr: str, port: int) -> str:
    """``free``, ``busy`` (taken on this machine) or ``elsewhere`` (``addr`` is not this machine's: the
    port is another node's business)."""
    try:
        infos = socket.getaddrinfo(addr, port, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror:
        return "elsewhere"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((infos[0][4][0], port))
        except OSError as e:
            return "busy" if e.errno == errno.EADDRINUSE else "elsewhere"
    return "free"


def check_port(addr: str, port: int, *, where: str = "") -> None:
    """Refuse a rendezvous port that is taken on this machine, before anything starts."""
    if port_state(addr, port) == "busy":
        raise RecipeError(
            f"port {port} on {addr} is in use{where} (another run, or another program)",
            field="run.master_port",
            value=port,
            fix="set run.master_port: auto (the default) or another free port",
        )


def rendezvous_port(recipe: Recipe, cluster: Cluster | None = None) -> int:
    """``run.master_port`` for this launch. ``auto``: a free port where the rendezvous address is this
    machine's; SLURM: one derived from the job id (two jobs sharing a node differ); a hostfile run whose
    rendezvous host is another machine: 29500. An explicit port taken here is refused."""
    r, cluster = recipe.run, cluster or Cluster(slots=(recipe.run.world_size,))
    addr = cluster.address(recipe)
    if cluster.rdzv_endpoint:
        port = int(cluster.rdzv_endpoint.rpartition(":")[2])
    elif r.master_port != "auto":
        port = int(r.master_port)
    elif cluster.mode == "slurm" and (cluster.job_id or "").isdigit():
        return 20000 + int(cluster.job_id) % 40000  # type: ignore[arg-type]
    elif (
        cluster.mode == "ssh"
        or port_state(addr, 0) != "free"
        or (cluster.mode == "single" and addr not in LOCAL_ADDRS)
    ):
        return DEFAULT_PORT
    else:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((socket.getaddrinfo(addr, 0, socket.AF_INET)[0][4][0], 0))
            return int(s.getsockname()[1])
    check_port(addr, port)
    return port


def _omp_threads(per_node: int) -> str:
    """OMP threads of a CPU rank: the user's OMP_NUM_THREADS, else the node's cores split over its ranks."""
    return os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // per_node))


def build_command(
    recipe: Recipe,
    run_dir: Path,
    *,
    resume: bool,
    device: str,
    worker_args: tuple[str, ...] = (),
    port: int | None = None,
    cluster: Cluster | None = None,
    hostfile: str | None = None,
    rdzv_id: str | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The exact launcher command of this node and its environment additions. ``worker_args``: more
    flags for the worker (``--same-layout``, ``--convert-from SRC``); ``port``: the rendezvous port
    (default :func:`rendezvous_port`); ``cluster``: the launch mode (default one node); ``hostfile``: the
    hostfile a SLURM run's deepspeed reads (written by the agent); ``rdzv_id``: torchrun's rendezvous id."""
    r = recipe.run
    cluster = cluster or resolve_cluster(recipe)
    port = rendezvous_port(recipe, cluster) if port is None else port
    addr = cluster.address(recipe)
    env: dict[str, str] = {}
    worker = ["tessera.train.worker", "--run-dir", str(run_dir)] + (["--resume"] if resume else [])
    worker += list(worker_args)
    per_node = cluster.ranks_here if cluster.agents else r.world_size
    if device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    if cluster.agents:
        env[NODE_ENV] = str(cluster.node_rank)
    if r.launcher == "torchrun":
        if cluster.mode == "ssh":
            raise RecipeError(
                "torchrun meets at --rdzv-endpoint; a hostfile is deepspeed's",
                field="run.launcher",
                value=r.launcher,
                fix="set run.launcher: deepspeed to use run.hostfile, or start one `tessera run --nnodes N "
                "--node-rank K` per node",
            )
        cmd = [venv_bin("torchrun"), f"--nproc_per_node={per_node}"]
        if cluster.mode == "torchrun":  # c10d: the ranks are numbered in the order the nodes meet
            endpoint = cluster.rdzv_endpoint or f"{addr}:{port}"
            cmd += [f"--nnodes={cluster.nnodes}", "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}"]
            cmd += [f"--rdzv_id={rdzv_id or 'tessera'}"]
        elif cluster.agents:  # SLURM: the node ranks are SLURM's, a static rendezvous at its first node
            cmd += [f"--nnodes={cluster.nnodes}", f"--node_rank={cluster.node_rank}"]
            cmd += [f"--master_addr={addr}", f"--master_port={port}"]
        else:
            cmd += [f"--master_addr={addr}", f"--master_port={port}"]
        if device == "cpu":
            env["OMP_NUM_THREADS"] = _omp_threads(per_node)
        return [*cmd, "-m", *worker], env
    cmd = [venv_bin("deepspeed")]
    if cluster.agents:
        cmd += ["--hostfile", hostfile or str(r.hostfile), "--no_ssh", "--node_rank", str(cluster.node_rank)]
    elif r.hostfile:
        cmd += ["--hostfile", r.hostfile, "--no_ssh_check"]
    else:
        cmd += ["--num_gpus", str(r.world_size)]
    if device == "cpu" and r.bind_cores_to_rank:
        if shutil.which("numactl") is None:
            raise RecipeError(
                "deepspeed --bind_cores_to_rank needs numactl, which is not installed",
                field="run.bind_cores_to_rank",
                value=True,
                fix="apt-get install numactl (make setup does), or set run.bind_cores_to_rank: false",
            )
        if (os.cpu_count() or 1) < per_node:
            raise LayoutError(
                f"cannot bind {per_node} ranks to {os.cpu_count()} cores",
                field="run.bind_cores_to_rank",
                value=True,
                fix="set run.bind_cores_to_rank: false or use fewer ranks",
            )
        cmd.append("--bind_cores_to_rank")
    elif device == "cpu" and cluster.agents:
        env["OMP_NUM_THREADS"] = _omp_threads(per_node)
    cmd += ["--master_addr", addr, "--master_port", str(port), "--module", *worker]
    return cmd, env
