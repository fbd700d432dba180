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
    from tessera.launch.modes import rendezvous_port

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


# ---- bounded start-up (issue 38 item 3) and the minor supervision defects (item 11) --------------------


def test_a_startup_phase_gets_its_own_timeout_and_is_named(tmp_path):
    """Before its first step a rank is judged by stop.startup_timeout_s per phase (not left unjudged): the
    diagnosis names the rank, the phase, the line it is at and the setting; a rank waiting for rank 0's
    preparation is not judged itself, and a rank that never wrote a heartbeat is stuck in its launch."""
    rd = RunDir(tmp_path)
    waiting = {"op": "broadcast", "group": "world", "bytes": 8, "since": time.time()}
    _beat(rd, 0, step=0, phase="checkpoint load", progress=9, armed=False, at="manager.py:212 load")
    _beat(rd, 1, step=0, phase="checkpoint load", progress=9, armed=False, op=waiting)
    dog = HangWatchdog(rd, 2, timeout_s=300, startup_timeout_s=0.3)
    assert dog.check() is None  # first sight: the clocks start
    time.sleep(0.4)
    got = dog.check()
    assert got is not None and got.rank == 0 and got.code == ExitCode.HUNG
    assert got.how == (
        "hung: rank 0 stuck in phase checkpoint load for 0 s (no collective, manager.py:212 load); "
        "rank 1 is waiting in broadcast on group world (8 B) (stop.startup_timeout_s=0.3)"
    )
    # the ranks wait for rank 0's preparation while it makes progress: nobody is hung
    _beat(rd, 1, step=0, phase="wait prepare", progress=1, armed=False)
    dog = HangWatchdog(rd, 2, timeout_s=300, startup_timeout_s=0.3)
    for progress in range(3):
        _beat(rd, 0, step=0, phase="data prepare", progress=progress, armed=False)
        assert dog.check() is None
        time.sleep(0.2)
    time.sleep(0.2)
    got = dog.check()  # rank 0's preparation stopped moving: it is named, rank 1 waits for it
    assert got is not None and got.rank == 0, got
    assert "rank 0 stuck in phase data prepare for" in got.how
    assert "rank 1 is waiting for rank 0 to prepare the run directory" in got.how
    # the first step of a resumed process is still start-up; a rank with no heartbeat is stuck in launch
    _beat(rd, 0, step=7, phase="step", progress=3, armed=False, at="engine.py:88 train_step")
    rd.rank_file(1, "heartbeat").unlink()
    dog = HangWatchdog(rd, 2, timeout_s=300, startup_timeout_s=0.3)
    assert dog.check() is None
    time.sleep(0.4)
    got = dog.check()
    assert got is not None and got.rank == 1
    assert got.how.startswith("hung: rank 1 stuck in phase launch for 0 s (no heartbeat yet")
    assert "rank 0 is in step (no collective, engine.py:88 train_step)" in got.how
    # neither a multi-node run (remote heartbeats need not show here) nor a disabled timeout judges it
    assert HangWatchdog(rd, 2, 300, startup_timeout_s=0.3, local=False).check() is None
    _beat(rd, 0, step=0, phase="model build", progress=3, armed=False)
    dog = HangWatchdog(rd, 2, 300, startup_timeout_s=None)
    assert dog.check() is None and (time.sleep(0.4) or dog.check()) is None


def test_a_frozen_rank_is_diagnosed_at_the_step_it_froze_in(tmp_path, monkeypatch):
    """11a: a SIGSTOPped rank was reported "at step 2" when it stopped at step 6: the heartbeat thread
    writes every 2 s, and fast steps moved on in between. A new step is written at once now."""
    import tessera.launch.watchdog as watchdog
    from tessera.train.heartbeat import Heartbeat

    class Counter:
        current, completed = None, 0

    rd = RunDir(tmp_path)
    rd.logs.mkdir(parents=True)
    _beat(
        rd,
        0,
        step=6,
        phase="step",
        progress=50,
        op={"op": "all_reduce", "group": "dp", "bytes": 16, "since": 0},
    )
    hb = Heartbeat(rd.rank_file(1, "heartbeat"), 1, Counter())
    for step in range(1, 7):  # six fast steps, well inside one heartbeat interval
        hb.set(step=step, phase="data")
        hb.set(phase="step")
        if step < 6:
            hb.set(phase="step end")
    hb._stop.set()  # the process froze (SIGSTOP) in step 6: nothing writes its heartbeat any more
    assert json.loads(rd.rank_file(1, "heartbeat").read_text())["step"] == 6
    monkeypatch.setattr(watchdog, "FROZEN_S", 0.2)
    dog = HangWatchdog(rd, 2, timeout_s=0.2)
    dog.check()
    time.sleep(0.4)
    got = dog.check()
    assert got is not None and got.rank == 1
    assert "rank 1 stopped writing its heartbeat (process frozen?) at step 6" in got.how, got.how


def test_startup_phase_faults():
    got = parse_faults("hang:rank=0:phase=checkpoint_load,hang:phase=wandb_start")
    assert got == [Fault("hang", rank=0, phase="checkpoint load"), Fault("hang", phase="wandb start")]
    assert got[0].spec == "hang:rank=0:phase=checkpoint_load"
    with pytest.raises(RecipeError) as e:
        parse_faults("hang:phase=lunch")
    assert "unknown start-up phase 'lunch'" in str(e.value) and "checkpoint_load" in str(e.value)


@pytest.fixture
def unreachable_wandb(monkeypatch):
    """W&B online with no server: WANDB_BASE_URL at a closed local port (refused at once, no network)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)  # a key, so that W&B really tries the server
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_wandb_online_without_a_server_falls_back_to_offline_once_or_is_an_error(
    tmp_path, unreachable_wandb, capsys
):
    from tessera.config.schema import WandbSection
    from tessera.track.wandb_tracker import WandbTracker

    rd = RunDir(tmp_path)
    t0 = time.monotonic()
    tracker = WandbTracker(
        WandbSection(mode="online", init_timeout_s=1), run_dir=rd, manifest={"a": 1}, resume=False
    )
    assert time.monotonic() - t0 < 30
    tracker.log({"step": 1, "loss": 2.5}, 1)
    tracker.finish()
    assert tracker.dir is not None and "offline-run-" in tracker.dir and tracker.run_id in tracker.dir
    err = capsys.readouterr().err
    warnings = [ln for ln in err.splitlines() if "warning" in ln]
    assert len(warnings) == 1 and "Traceback" not in err, err
    assert warnings[0].startswith("[tessera] warning: W&B online could not start within 1 s (CommError: ")
    assert "mirroring offline instead" in warnings[0] and "tracking.wandb.required: true" in warnings[0]
    with pytest.raises(RecipeError) as e:  # required: the rank's bad-input exit (2), naming the setting
        WandbTracker(
            WandbSection(mode="online", init_timeout_s=1, required=True), run_dir=rd, manifest={}, resume=True
        )
    assert e.value.field == "tracking.wandb.required" and "W&B online could not start within 1 s" in str(
        e.value
    )
    assert "tracking.wandb.init_timeout_s" in e.value.fix


# A launcher in miniature, shaped like `deepspeed` (runner -> per-node agent -> ranks): the runner exits 0
# when its agent was killed by a signal (deepspeed's runner does: it propagates only positive codes), the
# agent polls its ranks and on a failure stops the others (SIGTERM) and exits with that code, like
# deepspeed.launcher.launch; each rank dies with its agent (PR_SET_PDEATHSIG, as Tessera's ranks do).
_FAKE_LAUNCHER = r"""
import os, subprocess, sys, time
role, run_dir, lines = sys.argv[1], sys.argv[2], int(sys.argv[3])
me = [sys.executable, __file__]
if role == "runner":
    agent = subprocess.Popen([*me, "agent", run_dir, str(lines)])
    agent.wait()
    sys.exit(agent.returncode if agent.returncode > 0 else 0)
if role == "agent":
    ranks = [subprocess.Popen([*me, str(r), run_dir, str(lines)]) for r in range(2)]
    while ranks:
        for p in list(ranks):
            if p.poll() is None:
                continue
            if p.returncode != 0:
                for q in ranks:
                    q.terminate()
                for q in ranks:
                    q.wait(timeout=10)
                sys.exit(p.returncode % 256)
            ranks.remove(p)
        time.sleep(0.2)
    sys.exit(0)
import signal
from tessera.rundir import RunDir
from tessera.train.guard import die_with_parent
die_with_parent()
rd, rank = RunDir(run_dir), int(role)
signal.signal(signal.SIGTERM, lambda *a: (rd.mark_rank_exited(rank, 143), sys.exit(143)))
rd.mark_rank_started(rank, os.getpid())
for i in range(lines):
    print(f"rank {rank} line {i}", flush=True)
    time.sleep(0.01)
if lines:
    rd.mark_rank_exited(rank, 0)
    sys.exit(0)
time.sleep(3600)
"""


def _fake_launch(run_dir: Path, lines: int = 0) -> list[str]:
    import sys

    script = run_dir.parent / "fake_launcher.py"
    script.write_text(_FAKE_LAUNCHER)
    return [sys.executable, str(script), "runner", str(run_dir), str(lines)]


def _supervise_in_thread(cmd: list[str], run_dir: Path):
    import threading

    from tessera.launch.launcher import run_and_monitor

    out: dict = {}
    t = threading.Thread(target=lambda: out.update(r=run_and_monitor(cmd, {}, run_dir, 2, grace_s=5)))
    t.start()
    rd = RunDir(run_dir)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(rd.rank_pid(r) for r in (0, 1)):
        time.sleep(0.05)
    return t, out, [rd.rank_pid(r) for r in (0, 1)]


def test_a_killed_launcher_is_named_not_rank_0(tmp_path):
    """11c: SIGKILL of the per-node launcher (deepspeed.launcher.launch) takes its ranks with it; the
    supervisor reaps them as orphans and names the launcher. A rank killed by itself is still the rank."""
    import signal

    import psutil

    try:
        t, out, pids = _supervise_in_thread(_fake_launch(tmp_path / "run"), tmp_path / "run")
        agent = psutil.Process(pids[0]).ppid()
        time.sleep(1.0)  # the supervisor has seen the ranks (it polls every 0.25 s) before anything dies
        os.kill(agent, signal.SIGKILL)
        t.join(timeout=60)
        code, failure = out["r"]
        # (the runner exited 0, as deepspeed's does when its agent died by a signal; tessera run then exits
        # failure.code)
        assert code != 0 and failure.rank is None and failure.code == ExitCode.RANK_LOST, failure
        assert failure.culprit == f"the launcher fake_launcher.py (pid {agent})"
        assert failure.how == "died (killed by a signal?) and its ranks 0, 1 with it"
        assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)

        t, out, pids = _supervise_in_thread(_fake_launch(tmp_path / "run2"), tmp_path / "run2")
        time.sleep(1.0)
        os.kill(pids[1], signal.SIGKILL)  # the agent is alive: it reaps rank 1, stops rank 0 and exits
        t.join(timeout=60)
        code, failure = out["r"]
        assert failure.rank == 1 and failure.culprit == "rank 1" and failure.code == ExitCode.RANK_LOST
        assert failure.how.startswith("died without exiting")
    finally:  # a failed assertion leaves no fake launcher behind
        for child in psutil.Process().children(recursive=True):
            if "fake_launcher.py" in " ".join(child.cmdline()):
                child.kill()


def test_a_closed_reader_of_tessera_runs_output_is_no_traceback(tmp_path):
    """11b: `tessera run ... | head -1`: the reader goes away while the ranks print. The supervisor's
    output goes to /dev/null from then on; no BrokenPipeError traceback, no exit 1 from rich, and the
    process ends with the run's own exit code."""
    import subprocess
    import sys

    child = f"""
import sys
from pathlib import Path
from rich.console import Console
from tessera.launch.launcher import run_and_monitor
print("launch ...", flush=True)
rc, failure = run_and_monitor({_fake_launch(tmp_path / "run", lines=300)!r}, {{}}, Path({str(tmp_path / "run")!r}), 2)
Console().print("[bold green]done[/]  final loss 1.0")
print("run dir: ...")
sys.exit(rc if failure is None else 99)
"""
    p = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.readline() == b"launch ...\n"
    p.stdout.close()  # `head -1` exits
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err.decode()
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()


_TERM_IN_CLEANUP = r"""
import os, signal, sys, time
import tessera.train.worker as worker
from tessera.errors import RunStopped
from tessera.train.heartbeat import Heartbeat

def preempted(*a, **k):
    raise RunStopped("preempted at step 6", code=7)

def close(self, _close=Heartbeat.close):
    os.kill(os.getpid(), signal.SIGTERM)  # the launcher, on a peer's exit, while this rank cleans up
    time.sleep(0.2)
    _close(self)

worker.train, Heartbeat.close = preempted, close
code = worker.run_rank(sys.argv[1])
sys.exit(100 + code)
"""


def test_a_sigterm_during_a_ranks_clean_up_keeps_its_exit_code(tmp_path):
    """A rank that stops (a preemption: exit 7) is SIGTERMed by DeepSpeed's launcher as soon as a peer
    exits non-zero, possibly while it tears down its process group: the exit file says 7 and the rank
    returns 7 (a SIGTERM raising inside the clean-up left no exit file: "died without exiting", 9)."""
    import subprocess
    import sys

    from tessera.rundir import RunDir

    script = tmp_path / "rank.py"
    script.write_text(_TERM_IN_CLEANUP)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    p = subprocess.run([sys.executable, str(script), str(run_dir)], env=env, timeout=120)
    assert p.returncode == 107
    assert RunDir(run_dir).rank_exit(0) == 7
