"""Launch modes without launching: the mode a `tessera run` takes from its flags, the recipe and SLURM's
variables; the per-node commands; every wrong combination one exit-2 error naming the field and the fix;
SLURM host lists; `tessera slurm --dry-run` against a golden script; the agents' check phase (recipe
hash, a busy port on a node); the failure that explains a generation across nodes."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from helpers import REPO
from tessera.cli import main
from tessera.config.loader import load_recipe, recipe_hash
from tessera.errors import RecipeError
from tessera.launch.agent import Follower, _first
from tessera.launch.launcher import RankFailure
from tessera.launch.modes import build_command, expand_hostlist, resolve_cluster
from tessera.rundir import ExitCode, RunDir

RECIPE = "recipes/tiny-llama-cpu.yaml"
GOLDEN = REPO / "tests" / "unit" / "golden" / "tiny-llama-cpu-2nodes.sbatch"


def recipe(*overrides: str):
    return load_recipe(str(REPO / RECIPE), list(overrides)).recipe


def hosts(tmp_path: Path, text: str = "127.0.0.1 slots=1\nlocalhost slots=1\n") -> Path:
    p = tmp_path / "hosts"
    p.write_text(text)
    return p


def test_hostlists():
    assert expand_hostlist("gpu[01-03,07],login-a[1-2]-ib,solo") == [
        "gpu01", "gpu02", "gpu03", "gpu07", "login-a1-ib", "login-a2-ib", "solo"
    ]  # fmt: skip
    assert expand_hostlist("rack[1-2]-n[8-9]") == ["rack1-n8", "rack1-n9", "rack2-n8", "rack2-n9"]
    with pytest.raises(RecipeError) as e:
        expand_hostlist("gpu[a-b]")
    assert e.value.field == "SLURM_JOB_NODELIST"


def test_modes_and_their_commands(tmp_path):
    r = recipe(f"run.hostfile={hosts(tmp_path)}", "run.bind_cores_to_rank=false")
    ssh = resolve_cluster(r)
    assert (ssh.mode, ssh.nnodes, ssh.agents) == ("ssh", 2, False)
    node1 = resolve_cluster(r, node_rank=1)
    assert (node1.mode, node1.node_rank, node1.slots, node1.agents) == ("no_ssh", 1, (1, 1), True)
    cmd, env = build_command(r, tmp_path, resume=False, device="cpu", port=29511, cluster=node1)
    line = " ".join(cmd)
    assert (
        f"--hostfile {r.run.hostfile} --no_ssh --node_rank 1 --master_addr 127.0.0.1 --master_port 29511"
        in line
    )
    assert env["TESSERA_NODE"] == "1" and env["DS_ACCELERATOR"] == "cpu"
    t = recipe("run.launcher=torchrun")
    tr = resolve_cluster(t, node_rank=0, nnodes=2, rdzv_endpoint="node0:29400")
    cmd, _ = build_command(t, tmp_path, resume=True, device="cpu", cluster=tr, rdzv_id="job-1")
    assert cmd[1:6] == ["--nproc_per_node=1", "--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=node0:29400",
                        "--rdzv_id=job-1"]  # fmt: skip
    assert "--resume" in cmd
    env = {"SLURM_JOB_ID": "77", "SLURM_NNODES": "2", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0",
           "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NODEID": "1"}  # fmt: skip
    sl = resolve_cluster(t, environ=env)
    assert (sl.mode, sl.node_rank, sl.hosts, sl.master_addr) == ("slurm", 1, ("gpu07", "gpu08"), "gpu07")
    cmd, _ = build_command(t, tmp_path, resume=False, device="cuda", cluster=sl)
    assert cmd[1:6] == ["--nproc_per_node=1", "--nnodes=2", "--node_rank=1", "--master_addr=gpu07",
                        "--master_port=20077"]  # fmt: skip


BAD = [
    # (overrides, flags, environment, the field named)
    ([], ["--node-rank", "0"], {}, "run.hostfile"),  # deepspeed --no_ssh without a hostfile
    (["run.launcher=torchrun"], ["--node-rank", "1"], {}, "--nnodes"),
    (["run.launcher=torchrun"], ["--nnodes", "2"], {}, "--node-rank"),
    (["run.launcher=torchrun"], ["--nnodes", "2", "--node-rank", "2"], {}, "--node-rank"),
    (
        ["run.launcher=torchrun", "run.world_size=3", "parallel.global_batch=12"],
        ["--nnodes", "2", "--node-rank", "0"],
        {},
        "run.world_size",
    ),
    (
        ["run.launcher=torchrun"],
        ["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "node0"],
        {},
        "--rdzv-endpoint",
    ),
    (["run.hostfile=HOSTS"], ["--node-rank", "0", "--nnodes", "3"], {}, "--nnodes"),
    (["run.hostfile=HOSTS", "run.world_size=4"], ["--node-rank", "0"], {}, "run.world_size"),
    (["run.hostfile=HOSTS"], ["--node-rank", "0", "--rdzv-endpoint", "a:29400"], {}, "--rdzv-endpoint"),
    (
        [],
        [],
        {"SLURM_JOB_ID": "5", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "a,b"},
        "SLURM_JOB_ID",
    ),  # no srun
    (
        [],
        [],
        {
            "SLURM_JOB_ID": "5",
            "SLURM_NNODES": "2",
            "SLURM_NTASKS": "4",
            "SLURM_STEP_ID": "0",
            "SLURM_JOB_NODELIST": "a,b",
        },
        "SLURM_NTASKS",
    ),
]


@pytest.mark.parametrize(("overrides", "flags", "env", "field"), BAD)
def test_wrong_combinations_are_one_clear_error(tmp_path, monkeypatch, capsys, overrides, flags, env, field):
    monkeypatch.chdir(REPO)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    overrides = [o.replace("HOSTS", str(hosts(tmp_path))) for o in overrides]
    assert main(["run", RECIPE, *overrides, f"run.out_dir={tmp_path / 'run'}", *flags, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert field in err and "fix" in err and "Traceback" not in err


def test_dry_run_of_a_node_prints_its_command(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    h = hosts(tmp_path)
    assert (
        main(
            [
                "run",
                RECIPE,
                f"run.hostfile={h}",
                f"run.out_dir={tmp_path / 'r'}",
                "--node-rank",
                "1",
                "--dry-run",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "mode no_ssh; this is node 1" in out and "--no_ssh --node_rank 1" in out


def test_slurm_dry_run_matches_the_golden_script(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    args = ["slurm", RECIPE, "train.steps=500", "run.world_size=16", "run.device=cuda",
            "parallel.global_batch=64", "--nodes", "2",
            "--partition", "gpu", "--time", "04:00:00", "--account", "proj", "--cpus-per-task", "32", "--dry-run"]  # fmt: skip
    assert main(args) == 0
    script = capsys.readouterr().out
    from tessera.launch.runs import _tessera_command

    normal = script.replace(" ".join(_tessera_command()), "{tessera}").replace(str(REPO), "{repo}")
    assert normal == GOLDEN.read_text(), normal
    assert main(["slurm", RECIPE, "--nodes", "3", "--dry-run"]) == 2  # 2 ranks over 3 nodes
    assert "run.world_size" in capsys.readouterr().err


def test_a_node_with_another_recipe_or_a_busy_port_is_refused_before_launch(tmp_path):
    rd = RunDir(tmp_path / "run")
    r = recipe(f"run.hostfile={hosts(tmp_path)}")
    cluster = resolve_cluster(r, node_rank=1)
    agent = Follower(r, rd, cluster, "cpu", recipe_hash(r))
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            busy = s.getsockname()[1]
            agent._check({"generation": 1, "port": busy, "recipe_hash": recipe_hash(r)})
            state = agent.me.state
            assert (
                state["status"] == "error"
                and f"port {busy} on 127.0.0.1 is in use on node 1" in state["error"]
            )
        agent._check({"generation": 2, "port": busy, "recipe_hash": "f" * 64})
        assert "its recipe differs from node 0's" in agent.me.state["error"]
        agent._check({"generation": 3, "port": busy, "recipe_hash": recipe_hash(r)})
        assert agent.me.state["status"] == "ready"
        assert not rd.control.exists()  # a node never writes node 0's word
    finally:
        agent.me.close()


def test_the_failure_that_explains_a_generation():
    lost = RankFailure(1, "died without exiting", [], code=ExitCode.RANK_LOST, where="node 1, host b")
    crash = RankFailure(0, "exited with code 1", [], code=ExitCode.FAILED, where="node 0, host a")
    stopped = RankFailure(None, "stopped by node 0", [], code=ExitCode.TERMINATED, who="node 0")
    gone = RankFailure(
        None, "was lost", [], code=ExitCode.RANK_LOST, who="node 1 (host b)", restartable=False
    )
    # the launchers' own status is 1 on both nodes: the ranks' codes decide (a rank lost beats the
    # peer's connection-reset crash it caused)
    assert _first({0: (1, crash), 1: (1, lost)}) == (ExitCode.RANK_LOST, lost)
    assert _first({0: (1, crash), 1: (143, stopped)}) == (ExitCode.FAILED, crash)
    assert _first({0: (1, crash), 1: (1, lost), -1: (9, gone)})[1] is gone
    assert _first({0: (0, None), 1: (0, None)}) == (0, None)
    assert lost.culprit == "rank 1 (on node 1, host b)" and gone.culprit == "node 1 (host b)"
