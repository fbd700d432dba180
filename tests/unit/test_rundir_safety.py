"""The files of a run directory under hostile or unlucky conditions, without ranks: a torn or garbled
``metrics.jsonl`` / ``comm.jsonl``, a symbolic link planted where Tessera writes a file (the outside file
is never written; a link is replaced by rename, or refused where a file is appended to or locked), and a
full file system (one clear error naming the file, no temporaries left, the rank's exit code still
recorded)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import REPO
from tessera.atomic import DiskFull, UnsafeFile, write_json_atomic, write_text_atomic
from tessera.checkpoint.index import LATEST, step_dir_name
from tessera.checkpoint.manager import CheckpointManager
from tessera.cli import main
from tessera.errors import TesseraError
from tessera.rundir import ExitCode, RunDir
from tessera.tensorfile import save_tensors

PRECIOUS = "precious: never written by Tessera\n"


@pytest.fixture
def outside(tmp_path) -> Path:
    """A file outside the run directory that a planted link points at."""
    f = tmp_path / "outside.txt"
    f.write_text(PRECIOUS)
    return f


def plant(path: Path, target: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, path)
    return path


def replaced(path: Path, outside: Path) -> bool:
    """The link at ``path`` was replaced by a regular file and the file it pointed at is untouched."""
    return path.is_file() and not path.is_symlink() and outside.read_text() == PRECIOUS


# ---- item 4: torn and garbled JSON lines ---------------------------------------------------------------


def test_a_torn_last_line_is_dropped_with_one_warning(tmp_path, capsys):
    rd = RunDir(tmp_path)
    rd.metrics.write_text('{"step": 1, "loss": 6.1}\n{"step": 2, "loss": 6.0}\n{"step": 7, "lo')
    assert [r["step"] for r in rd.read_metrics()] == [1, 2]
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"tessera: warning: {rd.metrics}: dropped its torn last line (line 3: "
        '\'{"step": 7, "lo\'), left by a crash while it was written'
    ]


@pytest.mark.parametrize(
    "bad, why",
    [("garbage", "not JSON (Expecting value)"), ("[1, 2]", "not a JSON object"),
     ('{"loss": 1.0}', "a record without an integer 'step'")],
)  # fmt: skip
def test_a_bad_line_before_the_last_is_an_error_naming_file_and_line(tmp_path, bad, why):
    rd = RunDir(tmp_path)
    rd.metrics.write_text(f'{{"step": 1}}\n\n{bad}\n{{"step": 3}}\n')
    with pytest.raises(TesseraError) as e:
        rd.read_metrics()
    assert e.value.message.startswith(f"{rd.metrics}, line 3: {why}: ")
    assert "delete line 3" in e.value.fix


def test_compare_runs_on_a_garbled_metrics_file_exits_2_naming_it(tmp_path, capsys):
    runs = []
    for name in ("cand", "base"):
        rd = RunDir(tmp_path / name)
        rd.path.mkdir()
        rd.recipe.write_text("run: {}\n")
        for f in (RunDir.MANIFEST, RunDir.SUMMARY):
            (rd / f).write_text("{}\n")
        rd.metrics.write_text('{"step": 1, "loss": 6.1}\n{"step": 2, "lo\n{"step": 3, "loss": 6.0}\n')
        runs.append(str(rd.path))
    assert main(["compare", "--runs", *runs, "--out", str(tmp_path / "cmp")]) == ExitCode.USER_ERROR
    err = capsys.readouterr().err
    assert f"{tmp_path / 'cand' / RunDir.METRICS}, line 2: not JSON" in err and "Traceback" not in err
    assert not (tmp_path / "cmp").exists()


def test_resume_drops_a_torn_tail_and_appends_on_a_line_of_its_own(tmp_path, capsys):
    rd = RunDir(tmp_path)
    rd.metrics.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "lo')
    rd.comm.write_text('{"phase": "step", "rank": 0, "step": 1}\n{"phase": "st')
    rd.drop_torn_tails()  # tessera run, before the ranks start appending again
    assert capsys.readouterr().err.count("dropped its torn last line") == 2
    w = rd.metrics_writer(resume_step=2)  # rank 0 resuming from step 2
    w.write({"step": 3, "loss": 1.0})
    w.close()
    c = rd.comm_writer(1)
    c.write("step", 3, [])
    c.close()
    assert [r["step"] for r in rd.read_metrics()] == [1, 2, 3]
    assert [(r["rank"], r["step"]) for r in rd.read_comm()] == [(0, 1), (1, 3)]
    assert capsys.readouterr().err == ""


def test_a_fifo_in_place_of_metrics_is_refused_not_read(tmp_path):
    rd = RunDir(tmp_path)
    os.mkfifo(rd.metrics)
    with pytest.raises(UnsafeFile, match="is a FIFO"):
        rd.read_metrics()  # would block forever on open() or read()
    with pytest.raises(UnsafeFile, match="is a FIFO"):
        rd.metrics_writer(resume_step=2)  # rank 0 resuming
    os.mkfifo(rd.comm)
    with pytest.raises(UnsafeFile, match="is a FIFO"):
        rd.comm_writer(0)  # would block on open() until a reader came


# ---- item 6: links where Tessera writes ----------------------------------------------------------------


def test_a_linked_run_lock_is_refused_and_its_target_untouched(tmp_path, outside):
    rd = RunDir(tmp_path / "run")
    plant(rd / RunDir.LOCK, outside)
    with pytest.raises(UnsafeFile) as e, rd.locked():
        pass
    assert outside.read_text() == PRECIOUS
    assert e.value.message == (
        f"{rd / RunDir.LOCK} is a symbolic link (to {outside}), where Tessera keeps a regular file "
        "(it never writes through a link, nor reads a FIFO or a device)"
    )


@pytest.mark.parametrize("which", ["metrics fresh", "metrics resume", "comm", "rank log"])
def test_a_linked_append_file_is_refused(tmp_path, outside, which):
    rd = RunDir(tmp_path / "run")
    path = {"comm": rd.comm, "rank log": rd.rank_file(0, "log")}.get(which, rd.metrics)
    plant(path, outside)
    open_it = {
        "metrics fresh": lambda: rd.metrics_writer(resume_step=None),
        "metrics resume": lambda: rd.metrics_writer(resume_step=2),
        "comm": lambda: rd.comm_writer(0),
        "rank log": lambda: rd.open_rank_log(0),
    }[which]
    with pytest.raises(UnsafeFile, match="is a symbolic link"):
        open_it()
    assert outside.read_text() == PRECIOUS and path.is_symlink()
    assert rd.log_tail(0) == []  # a planted log is never shown as the rank's last lines either


def test_the_launcher_log_link_is_refused_before_anything_starts(tmp_path, outside):
    from tessera.launch.launcher import LAUNCHER_LOG, run_and_monitor

    rd = RunDir(tmp_path / "run")
    plant(rd.logs / LAUNCHER_LOG, outside)
    marker = tmp_path / "started"
    with pytest.raises(UnsafeFile):
        run_and_monitor([sys.executable, "-c", f"open({str(marker)!r}, 'w')"], {}, rd.path, 1)
    assert outside.read_text() == PRECIOUS and not marker.exists()


@pytest.mark.parametrize(
    "name", [RunDir.SUMMARY, RunDir.LAUNCH, RunDir.PLAN, RunDir.DATA, RunDir.MANIFEST, RunDir.PREPARED]
)
def test_a_linked_json_file_is_replaced_not_written_through(tmp_path, outside, name):
    rd = RunDir(tmp_path / "run")
    plant(rd / name, outside)
    rd.write_json(name, {"ok": True})
    assert replaced(rd / name, outside) and rd.read_json(name) == {"ok": True}


def test_linked_rank_status_files_are_replaced(tmp_path, outside):
    from tessera.train.heartbeat import Heartbeat

    rd = RunDir(tmp_path / "run")
    for kind in ("pid", "exit", "heartbeat"):
        plant(rd.rank_file(0, kind), outside)
    rd.mark_rank_started(0, 1234)  # removes the exit link, replaces the pid link
    plant(rd.rank_file(0, "exit"), outside)
    rd.mark_rank_exited(0, 2)

    class Counter:
        current, completed = None, 0

    hb = Heartbeat(rd.rank_file(0, "heartbeat"), 0, Counter())
    hb.close()
    for kind in ("pid", "exit", "heartbeat"):
        assert replaced(rd.rank_file(0, kind), outside), kind
    assert rd.rank_pid(0) == 1234 and rd.rank_exit(0) == 2
    assert json.loads(rd.rank_file(0, "heartbeat").read_text())["phase"] == "done"


def test_linked_preempt_request_fault_marker_and_wandb_id_are_replaced(tmp_path, outside, monkeypatch):
    import tessera.track.wandb_tracker as wt
    from tessera.config.schema import WandbSection
    from tessera.launch.launcher import _Signals
    from tessera.train.faults import Fault, FaultInjection, _fire, _marker

    rd = RunDir(tmp_path / "run")
    # the request tessera run writes on SIGTERM
    plant(rd / RunDir.PREEMPT, outside)
    signals = _Signals(rd)
    try:
        signals._on(signal.SIGTERM, None)
        assert replaced(rd / RunDir.PREEMPT, outside)
        assert (rd / RunDir.PREEMPT).read_text() == "SIGTERM\n"
    finally:
        signals.restore()
    # the one a fault injection writes without a supervisor
    plant(rd / RunDir.PREEMPT, outside)

    class Ctx:
        run_dir = rd

    monkeypatch.delenv("TESSERA_SUPERVISOR", raising=False)
    FaultInjection([])._preempt(Ctx())  # type: ignore[arg-type]
    assert replaced(rd / RunDir.PREEMPT, outside)
    # a fault's fired marker
    fault = Fault("kill", rank=1, step=4)
    plant(_marker(rd, fault, 1), outside)
    _fire(rd, fault, 1, "at step 4")
    assert replaced(_marker(rd, fault, 1), outside)
    # the W&B id (W&B itself not started)
    plant(rd.wandb_id, outside)
    monkeypatch.setattr(wt, "start_wandb", lambda *a, **k: None)
    tracker = wt.WandbTracker(WandbSection(mode="offline"), run_dir=rd, manifest={}, resume=True)
    assert replaced(rd.wandb_id, outside) and rd.wandb_id.read_text() == tracker.run_id + "\n"


def test_linked_plots_are_replaced(tmp_path, outside):
    from tessera.train.metrics import plot_run

    rd = RunDir(tmp_path / "run")
    for png in RunDir.PLOTS:
        plant(rd / png, outside)
    records = [{"step": s, "loss": 6.0 - s / 10, "step_time_s": 0.1} for s in (1, 2, 3)]
    written = plot_run(rd.path, records, [2**20], None, None)
    assert [p.name for p in written] == list(RunDir.PLOTS)
    for png in RunDir.PLOTS:
        assert replaced(rd / png, outside) and (rd / png).read_bytes()[:4] == b"\x89PNG"


class _OneTensorEngine:
    """The save part of the engine protocol, for one rank."""

    def __init__(self) -> None:
        self.model = torch.nn.Linear(2, 2, bias=False)

    def modules(self):
        return [self.model]

    def optimizer_tensors(self):
        return iter(())

    def save(self, path: Path) -> None:
        save_tensors(path / "shard_rank0.safetensors", {"w": self.model.weight.detach()})


def test_a_linked_latest_pointer_is_replaced(tmp_path, outside):
    m = CheckpointManager(RunDir(tmp_path).checkpoints, keep=2, rank=0, world_size=1)
    plant(m.root / LATEST, outside)
    describe = {"engine": "test", "sharding": "none", "layout": {"dp": 1}, "precision": "fp32",
                "model_config": {}, "tokenizer_hash": "t"}  # fmt: skip
    m.save(1, _OneTensorEngine(), describe=describe, sampler={}, manifest={})
    assert replaced(m.root / LATEST, outside) and m.latest().name == step_dir_name(1)


@pytest.mark.parametrize("text", [True, False])
def test_atomic_writes_replace_a_link_and_leave_no_temporary(tmp_path, outside, text):
    target = plant(tmp_path / "report.md", outside)
    if text:
        write_text_atomic(target, "# report\n")
    else:
        write_json_atomic(target, {"verdict": "PASS"})
    assert replaced(target, outside) and sorted(p.name for p in tmp_path.iterdir()) == [
        "outside.txt",
        "report.md",
    ]


# ---- item 5: a full file system ------------------------------------------------------------------------


@pytest.fixture
def full_disk(tmp_path):
    """A 256 KiB tmpfs, filled up to the last byte (needs root to mount; skipped otherwise)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], capture_output=True)
    if p.returncode != 0:
        pytest.skip(f"mounting a tmpfs needs root: {p.stderr.decode().strip()}")
    rd = RunDir(disk / "run")
    rd.mark_rank_started(0, os.getpid())  # at the start of a run: the disk still has room
    try:

        def fill() -> None:
            fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
            try:
                while os.write(fd, b"\0" * 4096):
                    pass
            except OSError:  # ENOSPC: full
                pass
            finally:
                os.close(fd)

        yield rd, fill
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)  # -l: even with a file open


def test_a_full_disk_is_one_clear_error_and_leaves_no_temporary(full_disk, capsys):
    rd, fill = full_disk
    writer = rd.metrics_writer(resume_step=None)
    log = rd.open_rank_log(0)
    fill()
    with pytest.raises(DiskFull) as e:
        rd.write_json(RunDir.SUMMARY, {"final_loss": 1.0})
    assert e.value.render() == (
        f"no space left on the device (ENOSPC) while writing {rd.summary}\n  fix: free space (or quota) on "
        "that file system, or move run.out_dir to a larger disk; then continue with --resume"
    )
    with pytest.raises(DiskFull, match="ENOSPC"):
        writer.write({"step": 1, "loss": 1.0})
    writer.close()
    log.write("[rank 0] error: ...\n")  # a line lost, not a second failure
    log.close()
    rd.mark_rank_exited(0, ExitCode.USER_ERROR)  # into the room reserved at start
    assert rd.rank_exit(0) == ExitCode.USER_ERROR
    left = [p.name for p in rd.path.rglob("*") if ".tmp-" in p.name or p.name.endswith(".reserve")]
    assert left == []
    # tessera run refuses before anything starts
    recipe = str(REPO / "recipes" / "tiny-llama-cpu.yaml")
    assert main(["run", recipe, f"run.out_dir={rd.path / 'next'}"]) == ExitCode.USER_ERROR
    err = capsys.readouterr().err
    assert "the run directory cannot be written: no space left on the device (ENOSPC)" in err
    assert "Traceback" not in err
