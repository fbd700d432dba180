"""Two "nodes" on this machine: two `tessera run` processes, each with its own node rank, one rank each,
sharing the run directory, on gloo. Every launch mode (deepspeed --no_ssh with a two-line hostfile, torchrun
c10d rendezvous, SLURM's variables with either launcher) gives the single-node 2-rank run's losses, weights
and Adam moments bit for bit (the session's ``reference`` runs, shared with test_recovery.py); a node's
ranks killed, a crash in a save and a hang on node 1 are restarted on both nodes (the hang named with its
node, within the timeout); a node's `tessera run` killed leaves no rank on either node."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from helpers import REPO, read_metrics
from launches import COMMON, HANG_TIMEOUT, RECIPES, TESSERA, alive, assert_bit_identical
from tessera.checkpoint.index import step_dir_name
from tessera.rundir import ExitCode, RunDir

pytestmark = pytest.mark.slow

# both "nodes" on 2 cores: one OMP thread per rank, as the reference's bound ranks have
NODE_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
NOT_BOUND = "run.bind_cores_to_rank=false"
HOST = socket.gethostname()  # deepspeed would bind each "node"'s rank to both cores


def hostfile(tmp_path: Path) -> Path:
    """Two names of this machine, one slot each: two nodes for deepspeed."""
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 slots=1\nlocalhost slots=1\n")
    return hosts


def start_nodes(recipe: str, overrides: list[str], flags: list[list[str]], envs: list[dict]) -> list:
    """Node 1 first (it waits for node 0), then node 0; returns [node 0, node 1] processes."""
    procs = {}
    for k in (1, 0):
        procs[k] = subprocess.Popen(
            [*TESSERA, "run", recipe, *overrides, *flags[k]], cwd=REPO, env=envs[k], text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
    return [procs[0], procs[1]]


def finish(procs: list, timeout: float = 600) -> list[tuple[int, str]]:
    """(exit code, stdout + stderr) of each node."""
    logs = ["".join(p.communicate(timeout=timeout)) for p in procs]
    return [(p.returncode, log) for p, log in zip(procs, logs, strict=True)]


def two_nodes(recipe: str, out: Path, flags: list[list[str]], extra: list[str] = (), env: dict | None = None):
    overrides = [*COMMON, f"run.out_dir={out}", *extra]
    envs = [{**NODE_ENV, **(env or {})} for _ in range(2)]
    return finish(start_nodes(recipe, overrides, flags, envs))


def assert_two_nodes(out: Path, mode: str) -> dict:
    m = RunDir(out).read_manifest()
    assert m["launch_mode"] == mode and m["topology"]["nodes"] == 2
    assert [n["node"] for n in m["nodes"]] == [0, 1]
    assert sorted(r for n in m["nodes"] for r in n["ranks"]) == [0, 1]
    assert all(len(n["ranks"]) == 1 and n["hardware"]["cpu_cores"] for n in m["nodes"])
    return m


def test_no_ssh_zero2_with_killed_crashed_and_hung_ranks_is_restarted_to_the_single_node_run(
    reference, tmp_path
):
    """deepspeed --no_ssh, one `tessera run --node-rank K` per node, run.restarts=3 and three faults (those
    test_recovery.py gives its single-node TP2 run): every rank of node 1 killed in step 4, rank 0 (node 0)
    dying inside step 6's save, rank 1 (node 1) hanging in step 8. Each restart runs on both nodes from the
    last complete checkpoint, names the rank with its node, and the run ends bit-identical to the 1-node run."""
    out, hosts = tmp_path / "ds", hostfile(tmp_path)
    flags = [["--node-rank", "0"], ["--node-rank", "1"]]
    extra = [f"run.hostfile={hosts}", NOT_BOUND, "run.restarts=3", f"stop.hang_timeout_s={HANG_TIMEOUT}"]
    faults = "kill:node=1:step=4,crash_in_save:rank=0:step=6,hang:rank=1:step=8"
    (rc0, log0), (rc1, log1) = two_nodes(RECIPES["zero2"], out, flags, extra, {"TESSERA_FAULTS": faults})
    assert rc0 == 0 and rc1 == 0, log0[-4000:] + log1[-3000:]
    assert_bit_identical(out, reference / "zero2")
    restarts = RunDir(out).read_summary()["restarts"]
    assert [r["reason"] for r in restarts] == ["RANK_LOST", "RANK_LOST", "HUNG"]
    assert [r["failed_rank"] for r in restarts] == [1, 0, 1]
    # killed in step 4 (step 2 saved), crashed saving step 6 (step 4 is the last complete), hung in 8
    assert [r["checkpoint"] for r in restarts] == [step_dir_name(2), step_dir_name(4), step_dir_name(6)]
    # the checkpoint policy runs before the metrics line is written: step 6's save crashed before its line
    assert [r["failed_at_step"] for r in restarts] == [3, 5, 7]
    lines = [ln for ln in log0.splitlines() if ln.startswith("restart ")]
    died = "died without exiting (killed by a signal, e.g. SIGKILL or the OOM killer)"
    assert [ln.split(" (RANK_LOST")[0] for ln in lines[:2]] == [
        f"restart 1/3: rank 1 (on node 1, host {HOST}) {died}", f"restart 2/3: rank 0 (on node 0, host {HOST}) {died}"
    ], log0[-4000:]  # fmt: skip
    assert lines[2].startswith(
        f"restart 3/3: hung: rank 1 (node 1, host {HOST}) has been in step (no collective"
    )
    assert "at step 8" in lines[2] and "rank 0 is waiting in" in lines[2] and "on group" in lines[2]
    assert "(HUNG after step 7); resuming from step_000006" in lines[2]
    assert "sigkill_handler" not in log0 and "run failed" not in log0
    hung_at = (RunDir(out) / RunDir.FAULTS_FIRED / "hang_rank-1_step-8").stat().st_mtime
    launch = RunDir(out).read_json(RunDir.LAUNCH)
    assert launch["restart"]["reason"] == "HUNG"
    assert RunDir(out).launch.stat().st_mtime - hung_at < HANG_TIMEOUT + 30  # diagnosed and restarted
    m = assert_two_nodes(out, "no_ssh")
    assert [n["ranks"] for n in m["nodes"]] == [[0], [1]]  # deepspeed numbers the ranks by node rank
    assert [(r["attempt"], r["from"]) for r in m["restarts"]] == [(1, step_dir_name(2)), (2, step_dir_name(4)),
                                                                  (3, step_dir_name(6))]  # fmt: skip
    assert "--no_ssh --node_rank 0" in launch["command"] and launch["cluster"]["hosts"] == [
        "127.0.0.1",
        "localhost",
    ]


@pytest.mark.parametrize("name", ["tp2", "zero2"])
def test_torchrun_c10d_two_nodes_equal_the_single_node_run(reference, tmp_path, name):
    out = tmp_path / name
    extra = ["run.launcher=torchrun"]
    flags = [["--nnodes", "2", "--node-rank", str(k)] for k in (0, 1)]
    (rc0, log0), (rc1, log1) = two_nodes(RECIPES[name], out, flags, extra)
    assert rc0 == 0 and rc1 == 0, log0[-4000:] + log1[-3000:]
    assert_bit_identical(out, reference / name)
    assert_two_nodes(out, "torchrun")
    assert "--rdzv_backend=c10d" in RunDir(out).read_json(RunDir.LAUNCH)["command"]


def test_no_ssh_megatron_tp2_equals_the_single_node_run(reference, tmp_path):
    out, hosts = tmp_path / "tp2", hostfile(tmp_path)
    flags = [["--node-rank", "0"], ["--node-rank", "1"]]
    (rc0, log0), (rc1, log1) = two_nodes(RECIPES["tp2"], out, flags, [f"run.hostfile={hosts}", NOT_BOUND])
    assert rc0 == 0 and rc1 == 0, log0[-4000:] + log1[-3000:]
    assert_bit_identical(out, reference / "tp2")
    assert_two_nodes(out, "no_ssh")


def slurm_env(node: int, job: str = "4242") -> dict:
    """What srun sets for task ``node`` of a 2-node, 1-task-per-node allocation (no slurmd here)."""
    return {
        **NODE_ENV,
        "SLURM_JOB_ID": job, "SLURM_JOB_NAME": "tiny", "SLURM_NNODES": "2", "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_JOB_NODELIST": "127.0.0.1,localhost", "SLURM_STEP_NODELIST": "127.0.0.1,localhost",
        "SLURM_NODEID": str(node), "SLURM_PROCID": str(node), "SLURM_LOCALID": "0",
    }  # fmt: skip


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_slurm_allocation_starts_both_nodes(reference, tmp_path, launcher):
    """`tessera run` as the two tasks of `srun --ntasks-per-node=1`: node ranks, node list and port from
    SLURM's variables; 4 steps give the reference's first 4 losses exactly (the warm-up is 10 steps)."""
    out = tmp_path / launcher
    overrides = [*COMMON, f"run.out_dir={out}", "train.steps=4", f"run.launcher={launcher}", NOT_BOUND]
    procs = start_nodes(RECIPES["zero2"], overrides, [[], []], [slurm_env(0), slurm_env(1)])
    (rc0, log0), (rc1, log1) = finish(procs)
    assert rc0 == 0 and rc1 == 0, log0[-4000:] + log1[-3000:]
    assert "mode slurm; this is node 0" in log0
    ref = [r["loss"] for r in read_metrics(reference / "zero2")][:4]
    assert [r["loss"] for r in read_metrics(out)] == ref
    assert_two_nodes(out, "slurm")
    command = RunDir(out).read_json(RunDir.LAUNCH)["command"]
    port = 20000 + 4242 % 40000  # from the job id: two jobs on one node do not collide
    if launcher == "torchrun":
        assert f"--nnodes=2 --node_rank=0 --master_addr=127.0.0.1 --master_port={port}" in command
    else:
        assert f"--no_ssh --node_rank 0 --master_addr 127.0.0.1 --master_port {port}" in command
        assert (out / "nodes" / "hostfile").read_text() == "127.0.0.1 slots=1\nlocalhost slots=1\n"


def test_sigkill_of_node1s_tessera_run_leaves_no_rank_on_either_node(tmp_path):
    out, hosts = tmp_path / "kill", hostfile(tmp_path)
    overrides = ["train.steps=400", "tracking.wandb.mode=disabled", f"run.out_dir={out}", f"run.hostfile={hosts}",
                 NOT_BOUND]  # fmt: skip
    procs = start_nodes(
        RECIPES["zero2"], overrides, [["--node-rank", "0"], ["--node-rank", "1"]], [NODE_ENV] * 2
    )
    deadline = time.time() + 300
    while time.time() < deadline and not (RunDir(out).metrics.is_file() and read_metrics(out)):
        time.sleep(0.3)
    assert read_metrics(out), "the run never reached its first step"
    ranks = [RunDir(out).rank_pid(r) for r in range(2)]
    assert alive(ranks) == ranks
    procs[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    while alive(ranks) and time.monotonic() - killed < 10:
        time.sleep(0.1)
    assert alive(ranks) == [], f"ranks alive 10 s after SIGKILL of node 1's tessera run: {alive(ranks)}"
    (rc0, log0), _ = finish(procs, timeout=60)
    assert rc0 == ExitCode.RANK_LOST, log0[-3000:]
    assert "node 1 (host" in log0 and "was lost: its tessera run (pid" in log0
    summary = json.loads(RunDir(out).summary.read_text())
    assert summary["failed"]["reason"] == "RANK_LOST" and "node 1" in summary["failed"]["detail"]
