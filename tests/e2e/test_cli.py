"""The `tessera` command end to end: real launchers, real ranks, real failures."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO, free_port, read_metrics
from tessera.checkpoint.index import LATEST, MANIFEST, step_dir_name
from tessera.rundir import ExitCode, RunDir

TESSERA = [sys.executable, "-m", "tessera.cli"]
RECIPE = "recipes/tiny-llama-cpu.yaml"


def tessera(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*TESSERA, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_dry_run_prints_command_and_layout(tmp_path):
    p = tessera("run", RECIPE, f"run.out_dir={tmp_path}", "--dry-run")
    assert p.returncode == 0, p.stderr
    assert "--num_gpus 2 --bind_cores_to_rank" in p.stdout
    assert "--module tessera.train.worker" in p.stdout
    assert "dp=2" in p.stdout and "zero=2" in p.stdout and "grad_accum=2" in p.stdout
    assert not RunDir(tmp_path).logs.exists()  # nothing started


def _printed(stdout: str, label: str) -> str:
    """The line a dry run prints under ``label``: the command to run, or what the launcher receives."""
    lines = stdout.splitlines()
    heads = [i for i, ln in enumerate(lines) if ln.startswith(label)]
    assert len(heads) == 1, stdout
    return lines[heads[0] + 1]


def test_dry_run_torchrun_and_hostfile(tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"content": f"document {i} " * 8}) + "\n" for i in range(40)))
    data = ["data.source=files", f"data.files=[{docs}]", f"run.out_dir={tmp_path / 'run'}"]
    # overrides on either side of the flags
    p = tessera("run", RECIPE, "run.launcher=torchrun", *data, "--dry-run", "data.text_field=content")
    assert p.returncode == 0 and "--nproc_per_node=2" in p.stdout and "-m tessera.train.worker" in p.stdout
    # what the launcher receives is labelled as such: the worker's --prepare included (it needs the run
    # directory `tessera run` writes first); the command to copy is `tessera run` with the same arguments
    assert _printed(p.stdout, "the launcher will receive").endswith(f"--run-dir {tmp_path / 'run'} --prepare")
    assert _printed(p.stdout, "run it with").endswith(
        shlex.join(["tessera", "run", RECIPE, "run.launcher=torchrun", *data, "data.text_field=content"])
    )
    # the data is read as the ranks read it, bounded: the first 16 of the 40 records; nothing written
    assert "16 records, data.text_field 'content' holds text" in p.stdout
    assert not (tmp_path / "run").exists()
    # run as printed without `tessera run` having written the run directory: one line saying so, exit 2
    received = shlex.split(_printed(p.stdout, "the launcher will receive"))
    worker = received[received.index("-m") + 1 :]
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    w = subprocess.run(
        [sys.executable, "-m", *worker], cwd=REPO, capture_output=True, text=True, env=env, timeout=120
    )
    assert w.returncode == 2 and "Traceback" not in w.stderr, w.stderr
    assert f"--run-dir = '{tmp_path / 'run'}': not a run directory" in w.stderr
    # a wrong text_field is the run's own error, before any launch
    p = tessera("run", RECIPE, *data, "--dry-run")
    assert p.returncode == ExitCode.USER_ERROR and "Traceback" not in p.stderr, p.stderr
    assert p.stderr == (
        "tessera: error: data.text_field = 'text': column 'text' not found in docs.jsonl (columns: content)\n"
        "  fix: set data.text_field to the column that holds the text\n"
    )
    hf = tmp_path / "hostfile"
    hf.write_text("localhost slots=2\n")
    p = tessera("run", RECIPE, f"run.hostfile={hf}", "--dry-run")
    assert p.returncode == 0 and f"--hostfile {hf} --no_ssh_check" in p.stdout
    hf.write_text("localhost slots=4\n")
    p = tessera("run", RECIPE, f"run.hostfile={hf}", "--dry-run")
    assert p.returncode == 2 and "run.world_size" in p.stderr and "4 slots" in p.stderr


def test_overrides_on_either_side_of_the_flags():
    from tessera.cli import build_parser

    ap = build_parser()
    for argv, overrides in (
        (["run", RECIPE, "--dry-run", "train.steps=3", "--resume", "a=1"], ["train.steps=3", "a=1"]),
        (["compare", "--seeds", "3", RECIPE, "train.steps=3", "--out", "x"], ["train.steps=3"]),
        (["plan", RECIPE, "--world-size", "8", "train.steps=3", "--json"], ["train.steps=3"]),
        (["config", "show", "--json", RECIPE, "train.steps=3"], ["train.steps=3"]),
    ):
        args = ap.parse_args(argv)
        assert (args.recipe, args.overrides) == (RECIPE, overrides), argv
    assert ap.parse_args(["config", "show", RECIPE, "--json"]).overrides == []
    with pytest.raises(SystemExit):  # an unknown flag is still refused, wherever it stands
        ap.parse_args(["run", RECIPE, "train.steps=3", "--dry-rum"])


@pytest.mark.slow
def test_run_resume_through_deepspeed_launcher(tmp_path):
    out = tmp_path / "run"
    common = [f"run.out_dir={out}", f"run.master_port={free_port()}", "train.steps=6", "checkpoint.every=3"]
    p = tessera("run", RECIPE, *common)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "run dir:" in p.stdout and "last checkpoint:" in p.stdout and "W&B offline run:" in p.stdout
    rd = RunDir(out)
    ck = rd.checkpoints
    assert (ck / LATEST).read_text().strip() == step_dir_name(6)
    assert sorted(x.name for x in ck.glob("step_*")) == [step_dir_name(3), step_dir_name(6)]
    assert not list(ck.glob(".tmp-*"))
    manifest = rd.read_manifest()
    for key in (
        "recipe",
        "recipe_hash",
        "git",
        "versions",
        "hardware",
        "layout",
        "seed",
        "data",
        "tokenizer_hash",
        "launcher_command",
        "world_size",
    ):
        assert key in manifest, key
    assert manifest["versions"]["deepspeed"] and manifest["layout"]["zero"] == 2
    assert "--bind_cores_to_rank" in manifest["launcher_command"]
    assert (
        json.loads((ck / step_dir_name(6) / MANIFEST).read_text())["recipe_hash"] == manifest["recipe_hash"]
    )
    for png in RunDir.PLOTS:
        assert (out / png).stat().st_size > 1000
    wandb_runs = list(rd.wandb.glob("offline-run-*"))
    assert len(wandb_runs) == 1
    blob = b"".join(f.read_bytes() for f in wandb_runs[0].glob("*.wandb"))
    for key in (b"recipe_hash", b"tokens_per_s", b"grad_norm", b"step_time_s", b"peak_memory_bytes"):
        assert key in blob, key  # the manifest is the run config; every metric is logged
    first = read_metrics(out)
    assert [r["step"] for r in first] == list(range(1, 7))
    # a fresh run on a dir with checkpoints is refused (never mixes or overwrites)
    p = tessera("run", RECIPE, *common)
    assert p.returncode == ExitCode.USER_ERROR and "--resume" in p.stderr
    # resume to 9 steps through the launcher again, after a crash tore the last lines of the JSONL files
    with rd.metrics.open("a") as f, rd.comm.open("a") as g:
        f.write('{"step": 7, "lo')
        g.write('{"phase": "st')
    p = tessera("run", RECIPE, *common[:-2], "train.steps=9", "checkpoint.every=3", "--resume")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    torn = [ln for ln in p.stderr.splitlines() if "dropped its torn last line" in ln]
    assert len(torn) == 2 and str(rd.metrics) in torn[0] and str(rd.comm) in torn[1], p.stderr[-3000:]
    assert {r["phase"] for r in rd.read_comm()} >= {"setup", "step", "checkpoint"}
    after = read_metrics(out)
    assert [r["step"] for r in after] == list(range(1, 10))
    assert [r["loss"] for r in after[:6]] == [r["loss"] for r in first]
    assert (ck / LATEST).read_text().strip() == step_dir_name(9)
    _check_plan_against_the_run(out, tmp_path)


def _check_plan_against_the_run(out, tmp_path) -> None:
    """`tessera plan --measured` reports the run's own medians beside the planner's terms, and
    `--calibrate` writes a profile the planner loads and uses."""
    import statistics

    from tessera.plan.hardware import load_hardware

    p = tessera("plan", RECIPE, "--measured", str(out), "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    cmp = json.loads(p.stdout)
    steady = [r for r in read_metrics(out) if r["step"] > 5]
    for term, key in (
        ("step", "step_time_s"),
        ("communication", "comm_time_s"),
        ("optimizer", "optimizer_time_s"),
    ):
        assert cmp["terms"][term]["measured_s"] == statistics.median(r[key] for r in steady), term
    assert cmp["terms"]["step"]["predicted_s"] > 0 and cmp["terms"]["bubble"]["measured_s"] is None
    # per collective: the bytes the planner predicts are the bytes comm.jsonl counted (ZeRO-2, dp 2)
    pred, meas = cmp["ops"]["predicted"], cmp["ops"]["measured"]
    for key in ("all_gather:dp", "all_reduce:dp"):
        assert abs(meas[key]["bytes"] - pred[key]["bytes"]) <= 1e-3 * pred[key]["bytes"], key
    assert pred["all_gather:dp"]["calls"] == meas["all_gather:dp"]["calls"] == 2  # one per parameter group
    profile = tmp_path / "cal.yaml"
    p = tessera("plan", "--calibrate", str(out), "--hardware", "cpu-2core", "--out", str(profile))
    assert p.returncode == 0 and "latency" in p.stdout, p.stderr[-2000:]
    hw = load_hardware(profile)
    assert hw.name == "cpu-2core-calibrated" and hw.efficiency and not hw.comm_overlap and hw.latency_s >= 0
    assert list(hw.engine_efficiency or {}) == ["deepspeed"] and hw.tp_latency_s is None  # no TP / EP run
    from tessera.plan.measured import compare_to_run

    step = compare_to_run(out, hw)["terms"]["step"]  # in sample: the fit reproduces the run's own step
    assert 0.75 <= step["predicted_s"] / step["measured_s"] <= 1.25, step
    p = tessera("plan", RECIPE, "--measured", str(out), "--hardware", str(profile))
    assert p.returncode == 0 and "compute" in p.stdout, p.stderr[-2000:]
    p = tessera("plan", "--calibrate", str(tmp_path), "--hardware", "cpu-2core")
    assert p.returncode == ExitCode.USER_ERROR and "--calibrate" in p.stderr  # not a run directory


@pytest.mark.slow
def test_launchers_and_engines_agree(tmp_path):
    """The same recipe through torchrun and through the deepspeed launcher with a local hostfile gives the
    same 3 losses (one thread per rank in both), and the lr follows the recipe's warmup. (The megatron
    engine and the ddp baseline run from the CLI in test_recovery and test_cli_compare, and match the
    deepspeed engine in tests/dist.) `parallel.engine=ddp` on the default recipe: its ZeRO-2 layer does
    not apply, and the layout says so."""
    hf = tmp_path / "hosts"
    hf.write_text("localhost slots=2\n")
    runs = {}
    for name, extra in (("torchrun", ["run.launcher=torchrun"]), ("hostfile", [f"run.hostfile={hf}"])):
        out = tmp_path / name
        args = ["run", RECIPE, f"run.out_dir={out}", f"run.master_port={free_port()}", "train.steps=3",
                "tracking.wandb.mode=disabled", *extra]  # fmt: skip
        if name == "torchrun":  # the command a dry run prints, pasted into a shell as printed
            dry = tessera(*args, "--dry-run")
            assert dry.returncode == 0, dry.stderr
            line = _printed(dry.stdout, "run it with")
            p = subprocess.run(line, shell=True, cwd=REPO, capture_output=True, text=True, timeout=300)
        else:
            p = tessera(*args)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        runs[name] = read_metrics(out)
    assert [r["step"] for r in runs["torchrun"]] == [1, 2, 3]
    for a, b in zip(runs["torchrun"], runs["hostfile"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["tokens"] == b["tokens"] == 16 * 63  # global batch 16 rows x 63 predicted tokens
    assert [r["lr"] for r in runs["torchrun"]] == pytest.approx([3e-4, 6e-4, 9e-4])
    p = tessera("run", RECIPE, f"run.out_dir={tmp_path / 'ddp'}", "parallel.engine=ddp", "--dry-run")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "parallel.zero=2 (set by configs/deepspeed/zero2.yaml) does not apply to engine 'ddp'" in p.stderr
    assert "engine=ddp" in p.stdout and "zero=0 " in p.stdout


@pytest.mark.parametrize("verbose", [False, True])
def test_the_launchers_misleading_rank_line_stays_off_the_console(tmp_path, capfd, monkeypatch, verbose):
    """deepspeed.launcher.launch names the last rank it started when any rank fails (rank 1 when rank 0
    died): that line goes to logs/launcher.log only, even with --verbose; other launcher output stays."""
    from tessera.launch.launcher import LAUNCHER_LOG, VERBOSE_ENV, run_and_monitor

    if verbose:
        monkeypatch.setenv(VERBOSE_ENV, "1")
    wrong = (
        "[2026-12-05 19:09:22,267] [ERROR] [launch.py:259:sigkill_handler] ['numactl', '-m', '0', '-C', '1', "
        "'python3.11', '-u', '-m', 'tessera.train.worker', '--local_rank=1'] exits with return code = -9"
    )
    info = "[2026-12-05 19:09:20,001] [INFO] [launch.py:245:main] process 4242 spawned"
    lines = [info, "[tessera] step 1/4  loss 6.2617", wrong, "node1: " + wrong, "Traceback: kept"]
    script = "".join(f"print({ln!r})\n" for ln in lines)
    assert run_and_monitor([sys.executable, "-c", script], {}, tmp_path, 1)[0] == 0
    shown = capfd.readouterr().out.splitlines()
    assert shown == [*([info] if verbose else []), "[tessera] step 1/4  loss 6.2617", "Traceback: kept"]
    assert (RunDir(tmp_path).logs / LAUNCHER_LOG).read_text().splitlines() == [info, wrong, "node1: " + wrong]


@pytest.mark.slow
def test_sigkill_of_one_rank_fails_fast_and_names_it(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [
            *TESSERA,
            "run",
            RECIPE,
            f"run.out_dir={out}",
            f"run.master_port={free_port()}",
            "train.steps=100000",
            "checkpoint.every=0",
            "checkpoint.at_end=false",
            "tracking.wandb.mode=disabled",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        metrics = RunDir(out).metrics
        while time.monotonic() < deadline:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
                break
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.5)
        else:
            pytest.fail("run never reached step 3")
        victim = RunDir(out).rank_pid(0)  # rank 0: the deepspeed launcher's own line would say rank 1
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        output, _ = proc.communicate(timeout=90)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert elapsed < 60, elapsed
    # the rank that failed first is named once, in the verdict; the launcher's line naming rank 1 is not shown
    verdict = "tessera: run failed: rank 0 died without exiting (killed by a signal, e.g. SIGKILL or the OOM killer)"
    assert output.count("rank 0 died") == 1 and f"{verdict} (exit code {int(ExitCode.RANK_LOST)})" in output
    assert "sigkill_handler" not in output and "local_rank=1" not in output, output[-3000:]
    assert "sigkill_handler" in (RunDir(out).logs / "launcher.log").read_text()
    # no rank survives the run
    rank1 = RunDir(out).rank_pid(1)
    assert not Path(f"/proc/{rank1}").exists() or "Z" in Path(f"/proc/{rank1}/stat").read_text().split()[2]


@pytest.mark.slow
def test_a_model_config_transformers_refuses_is_rank0s_clear_error(tmp_path):
    """The model checks run on rank 0 of the launch (`tessera run` never imports transformers): a config
    that transformers refuses exits 2 with the reason and the field, no traceback, every rank gone and
    nothing prepared (no data record, no plan, no `logs/prepared`)."""
    out = tmp_path / "bad"
    p = tessera("run", RECIPE, "model.hf_config.num_attention_heads=5", f"run.out_dir={out}",
                f"run.master_port={free_port()}", "tracking.wandb.mode=disabled")  # fmt: skip
    assert p.returncode == ExitCode.USER_ERROR, p.stdout[-3000:] + p.stderr[-3000:]
    err = [ln for ln in p.stderr.splitlines() if "error:" in ln and "rank 0" in ln]
    assert err and "model.hf_config" in err[0] and "number of attention heads (5)" in err[0], p.stderr[-3000:]
    assert "Traceback" not in p.stdout + p.stderr
    rd = RunDir(out)
    assert rd.rank_exit(0) == ExitCode.USER_ERROR
    for rank in (0, 1):
        pid = rd.rank_pid(rank)
        assert pid is not None and (
            not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
        )
    assert not rd.data.exists() and not rd.plan.exists() and not (rd / RunDir.PREPARED).exists()


def test_plan_json_contract_and_known_8b_answer():
    p = tessera("plan", "recipes/llama3-8b-pretrain-h100x8-zero3.yaml", "--world-size", "8", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert set(out) == {"model", "recipe_layout", "chosen", "candidates", "rejected"}
    assert out["model"] == {
        "family": "llama",
        "parameters": 8_030_261_248,
        "counted_on": "the family's formula",
        "generic_estimates": [],
    }
    assert (
        out["recipe_layout"]["fits"] is True
    )  # the shipped recipe's own layout (ZeRO-3 + optimizer offload)
    for c in out["candidates"]:
        assert {"dp", "tp", "pp", "vpp", "ep", "zero", "micro_batch"} <= set(c["layout"])
        assert {"params", "grads", "optimizer", "activations", "total"} <= set(c["memory_bytes_per_rank"])
        assert c["memory_bytes_per_rank"]["total"] <= 80e9
        assert {"comm_bytes_per_step", "bubble_fraction", "step_time_s", "mfu"} <= set(c)
    assert out["chosen"] == out["candidates"][0]
    plain_dp = [
        r
        for r in out["rejected"]
        if r["layout"]["engine"] == "deepspeed"
        and r["layout"]["zero"] == 0
        and not r["layout"].get("offload_optimizer")
    ]
    assert plain_dp and "does not fit" in plain_dp[0]["reason"] and "short by" in plain_dp[0]["reason"]
    p = tessera("plan", "recipes/llama3-8b-pretrain-h100x8-zero3.yaml", "--world-size", "8")
    assert p.returncode == 0 and "chosen" in p.stdout and "rejected" in p.stdout


def test_plan_bad_hardware_is_a_clear_error(tmp_path):
    p = tessera("plan", RECIPE, "--hardware", "no-such-gpu")
    assert p.returncode == 2 and "Traceback" not in p.stderr and "no-such-gpu" in p.stderr
    bad = tmp_path / "hw.yaml"
    bad.write_text("name: x\ndevice: cuda\n")
    p = tessera("plan", RECIPE, "--hardware", str(bad))
    assert p.returncode == 2 and "Traceback" not in p.stderr and "fix:" in p.stderr


@pytest.mark.slow
def test_parallel_auto_runs_the_planners_layout(tmp_path):
    out = tmp_path / "auto"
    p = tessera(
        "run",
        RECIPE,
        "parallel.auto=true",
        f"run.out_dir={out}",
        f"run.master_port={free_port()}",
        "train.steps=2",
        "tracking.wandb.mode=disabled",
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rd = RunDir(out)
    plan = rd.read_json(RunDir.PLAN)
    assert plan["source"] == "planner" and plan["chosen"] == plan["candidates"][0]
    resolved = rd.recipe.read_text()
    chosen = plan["chosen"]["layout"]
    manifest = rd.read_manifest()
    assert manifest["plan"] == plan["chosen"] and "auto: false" in resolved
    for k in ("engine", "dp", "tp", "pp", "ep", "zero", "micro_batch"):
        assert manifest["layout"][k] == chosen[k], k
    rec = read_metrics(out)
    assert len(rec) == 2 and all(0 <= r["comm_fraction"] <= 1 and r["comm_bytes"] > 0 for r in rec)
    lines = rd.read_comm()
    steps = [x for x in lines if x["phase"] == "step"]
    assert sorted((x["step"], x["rank"]) for x in steps) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert all(x["bytes"] == sum(o["bytes"] for o in x["ops"]) for x in steps)
