"""Hostile checkpoints for the tests: a payload pickle planted in place of each kind of pickle-bearing file
of a real checkpoint, its checksum forged, then every command that reads checkpoints run on it."""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import signal
from pathlib import Path

from helpers import PICKLE_MARKER, PicklePayload, forge_checksum
from tessera.rundir import RunDir

#: how the payload is planted: a plain pickle, and a torch.save zip whose data.pkl holds it
PAYLOADS = ("pickle", "torch-zip")


def plant(path: Path, how: str, marker: Path) -> None:
    """Replace ``path`` by a pickle that creates ``marker`` when unpickled."""
    if how == "pickle":
        path.write_bytes(pickle.dumps(PicklePayload(marker)))
    else:
        import torch

        with open(path, "wb") as f:  # a handle: torch.save refuses a name such as ".metadata"
            torch.save({"module": PicklePayload(marker), "optimizer_state_dict": {}}, f)


def pickle_kinds(ckpt: Path) -> dict[str, str]:
    """One file of each pickle-bearing kind in a checkpoint: DeepSpeed's model and optimizer states,
    megatron's common.pt, a .distcp shard and the distributed checkpoint's .metadata."""
    from tessera.checkpoint.index import read_meta

    out: dict[str, str] = {}
    for f in read_meta(ckpt)["files"]:
        rel = f["path"]
        name = Path(rel).name
        kind = next(
            (
                k
                for k in ("model_states.pt", "optim_states.pt", "common.pt", ".distcp", ".metadata")
                if name.endswith(k)
            ),
            None,
        )
        if kind is not None:
            out.setdefault(kind, rel)
    return out


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail instead of hanging (a FIFO opened for reading blocks forever)."""

    def boom(*_):
        raise TimeoutError(f"still running after {seconds} s: something opened a FIFO")

    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _commands(ckpt: Path, run: RunDir, out: Path) -> dict[str, list[str]]:
    return {
        "verify": ["verify", str(ckpt), str(ckpt), "--prompts", "1"],
        "convert": ["convert", str(ckpt), "--to", "hf", "--out", str(out)],
        "resume": ["run", str(run.recipe), f"run.out_dir={run.path}", "--resume"],
    }


def assert_no_code_runs(run_dir: Path, tmp_path: Path, capsys, kinds: tuple[str, ...]) -> list[str]:
    """For each kind of pickle-bearing file in the latest checkpoint of ``run_dir`` (``kinds`` must all be
    there) and each way of planting the payload: `tessera verify`, `tessera convert` and `tessera run
    --resume` exit 2 with no traceback, naming the file and the payload's class, and the payload never
    runs (no marker file, no rank launched). Returns the messages, one per case."""
    from tessera.checkpoint.manager import CheckpointManager
    from tessera.cli import main

    src = CheckpointManager(RunDir(run_dir).checkpoints, keep=2, rank=0, world_size=1).latest()
    found = pickle_kinds(src)
    assert set(kinds) <= set(found), (kinds, found)
    messages = []
    for kind in kinds:
        rel = found[kind]
        for how in PAYLOADS:
            case = tmp_path / f"{kind.strip('.')}-{how}"
            shutil.copytree(run_dir, case, ignore=shutil.ignore_patterns("wandb", "*.png"))
            run = RunDir(case)
            run.clear_rank_status()
            ckpt = run.checkpoints / src.name
            marker = case / PICKLE_MARKER
            plant(ckpt / rel, how, marker)
            forge_checksum(ckpt, rel)
            for name, argv in _commands(ckpt, run, tmp_path / f"hf-{kind.strip('.')}-{how}").items():
                with deadline(120):
                    rc = main(argv)
                err = capsys.readouterr().err
                where = (kind, how, name)
                assert rc == 2, (where, err[-2000:])
                assert str(ckpt / rel) in err and "Traceback" not in err, (where, err[-2000:])
                assert "pathlib.Path" in err and "allow-list" in err, (where, err[-2000:])
                assert not marker.exists(), where
                assert run.rank_pid(0) is None, where  # refused before any rank started
                messages.append(err)
            shutil.rmtree(case)
    return messages


def assert_fifo_is_refused(run_dir: Path, tmp_path: Path, capsys) -> None:
    """An extra, unlisted FIFO named like a DeepSpeed shard (DeepSpeed's glob would open it and block):
    `tessera verify` and `tessera convert` exit 2 at once, naming it."""
    from tessera.checkpoint.manager import CheckpointManager
    from tessera.cli import main

    src = CheckpointManager(RunDir(run_dir).checkpoints, keep=2, rank=0, world_size=1).latest()
    ckpt = tmp_path / "fifo" / src.name
    shutil.copytree(src, ckpt)
    fifo = ckpt / "zero_pp_rank_2_mp_rank_00_optim_states.pt"
    os.mkfifo(fifo)
    for argv in (
        ["verify", str(ckpt), str(ckpt)],
        ["convert", str(ckpt), "--to", "hf", "--out", str(tmp_path / "o")],
    ):
        with deadline(60):
            rc = main(argv)
        err = capsys.readouterr().err
        assert rc == 2 and str(fifo) in err and "FIFO" in err and "Traceback" not in err, err[-2000:]
