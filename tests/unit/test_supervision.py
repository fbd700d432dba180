"""The supervisor's parts without ranks: fault specs, the hang diagnosis from heartbeat files, the run
directory lock, the rendezvous port."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from tessera.errors import RecipeError, TesseraError
from tessera.launch.watchdog import HangWatchdog
from tessera.rundir import ExitCode, RunDir
from tessera.train.faults import Fault, parse_faults


def test_fault_specs():
    got = parse_faults("kill:rank=1:step=7, hang:rank=1:step=5,slow:rank=1:factor=3,nan:step=6,nan_grad@3")
    assert got == [
        Fault("kill", rank=1, step=7),
        Fault("hang", rank=1, step=5),
        Fault("slow", rank=1, factor=3.0),
        Fault("nan", step=6),
        Fault("nan", step=3),
    ]
    assert [f.spec for f in got[:3]] == ["kill:rank=1:step=7", "hang:rank=1:step=5", "slow:rank=1:factor=3"]
    assert got[0].here(1, 7) and not got[0].here(0, 7) and got[3].here(5)
    for bad, why in (("explode:step=1", "unknown kind"), ("kill:rank=1", "needs a step"),
                     ("kill:step=x", "must be a number"), ("slow:factor=1", "factor > 1"), ("kill:when=3", "unknown key")):  # fmt: skip
        with pytest.raises(RecipeError) as e:
            parse_faults(bad)
        assert why in str(e.value) and e.value.field == "TESSERA_FAULTS"


def _beat(rd: RunDir, rank: int, *, step: int, phase: str, progress: int, op=None, age: float = 0.0,
          armed: bool = True, at: str | None = None) -> None:  # fmt: skip
    rd.logs.mkdir(parents=True, exist_ok=True)
    hb = {"rank": rank, "pid": 1, "time": time.time() - age, "step": step, "phase": phase, "progress": progress,
          "op": op, "armed": armed, "at": at}  # fmt: skip
    rd.rank_file(rank, "heartbeat").write_text(json.dumps(hb))


def test_hang_diagnosis_names_the_rank_the_op_and_the_group(tmp_path):
    rd = RunDir(tmp_path)
    waiting = {"op": "all_reduce", "group": "dp", "bytes": 558336, "since": time.time()}
    _beat(rd, 0, step=5, phase="step", progress=40, op=waiting)
    _beat(rd, 1, step=5, phase="step", progress=37, at="faults.py:159 on_step_start")
    _beat(rd, 2, step=5, phase="step", progress=40, op=waiting)
    dog = HangWatchdog(rd, 3, timeout_s=0.3)
    assert dog.check() is None  # first sight: the clock starts
    time.sleep(0.4)
    got = dog.check()
    assert got is not None and got.rank == 1 and got.code == ExitCode.HUNG
    assert "rank 1 has been in step (no collective, faults.py:159 on_step_start) at step 5" in got.how
    assert "ranks 0, 2 are waiting in all_reduce on group dp (558 KB)" in got.how


def test_the_rank_that_crossed_the_timeout_first_is_not_blamed_for_waiting(tmp_path):
    """Heartbeats are seconds apart: the rank waiting in a collective can be seen quiet for longer than
    the hung one. The culprit is the quiet rank outside any collective, not the first past the timeout."""
    rd = RunDir(tmp_path)
    waiting = {"op": "all_reduce", "group": "dp", "bytes": 16, "since": time.time()}
    _beat(rd, 0, step=8, phase="step", progress=12, op=waiting)
    _beat(rd, 1, step=8, phase="step", progress=12)
    dog = HangWatchdog(rd, 2, timeout_s=4.5)
    assert dog.check() is None  # first sight: the clocks start
    # rank 0 has been quiet past the timeout, rank 1 (whose last change was seen 1.6 s later) not yet
    for r, ago in ((0, 4.6), (1, 3.0)):
        dog.seen[r] = (dog.seen[r][0], dog.seen[r][1] - ago)
    got = dog.check()
    assert got is not None and got.rank == 1, got.how if got else None
    assert "rank 0 is waiting in all_reduce on group dp (16 B)" in got.how


def test_progress_and_setup_are_not_hangs(tmp_path):
    rd = RunDir(tmp_path)
    _beat(rd, 0, step=7, phase="data", progress=3, armed=False)  # its process's first step (resumed at 6)
    _beat(rd, 1, step=4, phase="step", progress=10)
    dog = HangWatchdog(rd, 2, timeout_s=0.3)
    assert dog.check() is None
    time.sleep(0.2)
    _beat(rd, 1, step=4, phase="step", progress=11)  # moved
    time.sleep(0.2)
    assert dog.check() is None
    # a heartbeat that stopped being written (a frozen process) is a hang too
    _beat(rd, 1, step=4, phase="step", progress=12, age=30.0)
    got = dog.check()
    assert got is not None and got.rank == 1 and "stopped writing its heartbeat" in got.how


def test_one_run_per_directory(tmp_path):
    rd = RunDir(tmp_path / "run")
    with rd.locked() as stale:
        assert stale is None
        assert (rd / RunDir.LOCK).read_text().strip() == str(os.getpid())
        with pytest.raises(TesseraError) as e, rd.locked():
            pass
        assert f"pid {os.getpid()}" in str(e.value) and e.value.field == "run.out_dir"
    assert (rd / RunDir.LOCK).read_text() == ""  # released cleanly: nothing to take over
    (rd / RunDir.LOCK).write_text("999999999\n")  # a holder that was killed
    with rd.locked() as stale:
        assert stale is not None and "999999999" in stale


def test_rendezvous_port(tmp_path):
    from tessera.config.loader import load_recipe
    from tessera.launch.launcher import rendezvous_port

    recipe = load_recipe("recipes/tiny-llama-cpu.yaml", []).recipe
    assert recipe.run.master_port == "auto"
    a = rendezvous_port(recipe)
    assert 1024 <= a <= 65535
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        busy = load_recipe("recipes/tiny-llama-cpu.yaml", [f"run.master_port={taken}"]).recipe
        with pytest.raises(RecipeError) as e:
            rendezvous_port(busy)
        assert e.value.field == "run.master_port" and str(taken) in str(e.value)


def test_taking_over_a_killed_runs_directory_releases_its_shared_memory(tmp_path):
    """DeepSpeed's CPU all-reduce segments are named by the rendezvous port; a run killed before its
    supervisor could unlink them leaves them in /dev/shm. The next run on the directory removes them, by
    the port in the killed run's launch.json, and nothing of another port."""
    from tessera.comm.shm import SHM_PREFIX
    from tessera.launch.runs import release_killed_run

    rd = RunDir(tmp_path)
    rd.write_json(
        RunDir.LAUNCH,
        {"command": "DS_ACCELERATOR=cpu deepspeed --master_addr 127.0.0.1 --master_port 59991 --module x"},
    )
    shm = Path("/dev/shm")
    mine = [shm / f"{SHM_PREFIX}_{os.getuid()}_127.0.0.1_59991_{r}" for r in range(2)]
    other = shm / f"{SHM_PREFIX}_{os.getuid()}_127.0.0.1_59992_0"
    try:
        for f in [*mine, other]:
            f.write_bytes(b"x")
        release_killed_run(rd)
        assert not any(f.exists() for f in mine) and other.exists()
    finally:
        for f in [*mine, other]:
            f.unlink(missing_ok=True)
