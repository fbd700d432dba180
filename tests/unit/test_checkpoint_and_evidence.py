"""Checkpoint protocol (atomic rename, latest last, keep-N, crash mid-save), manifest, schedule, launcher."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from tessera.checkpoint.manager import CheckpointManager
from tessera.errors import CheckpointError, RecipeError


class TensorFileEngine:
    """The smallest engine that honours the save/load protocol: one tensor file per rank."""

    def __init__(self, value: float, fail_on_save: bool = False):
        self.t = torch.full((4,), value)
        self.fail_on_save = fail_on_save

    def save(self, root: Path, tag: str, client_state: dict) -> None:
        d = root / tag
        d.mkdir(parents=True, exist_ok=True)
        torch.save(self.t, d / "shard_rank0.pt")
        if self.fail_on_save:
            raise RuntimeError("disk full (simulated crash mid-save)")

    def load(self, root: Path, tag: str) -> dict:
        self.t = torch.load(root / tag / "shard_rank0.pt")
        return {}


def _mgr(tmp_path, keep=2):
    return CheckpointManager(tmp_path / "checkpoints", keep=keep, rank=0, world_size=1)


def test_save_rename_latest_and_keep(tmp_path):
    m = _mgr(tmp_path)
    for step in (1, 2, 3):
        m.save(step, TensorFileEngine(step), client_state={"step": step}, manifest={"m": step})
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step_000002", "step_000003"]
    assert m.latest().name == "step_000003"
    meta = json.loads((m.latest() / "meta.json").read_text())
    assert meta["step"] == 3 and {f["path"] for f in meta["files"]} >= {"shard_rank0.pt", "manifest.json"}
    e = TensorFileEngine(0)
    m.load(m.latest(), e)
    assert torch.equal(e.t, torch.full((4,), 3.0))


def test_crash_mid_save_keeps_the_last_good_checkpoint(tmp_path):
    m = _mgr(tmp_path)
    m.save(5, TensorFileEngine(5), client_state={}, manifest={})
    with pytest.raises(RuntimeError, match="simulated"):
        m.save(10, TensorFileEngine(10, fail_on_save=True), client_state={}, manifest={})
    assert m.latest().name == "step_000005"
    assert not (tmp_path / "checkpoints" / "step_000010").exists()
    m.save(10, TensorFileEngine(10), client_state={}, manifest={})  # the next save clears the stray tmp
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    assert m.latest().name == "step_000010"


def test_truncated_checkpoint_is_refused(tmp_path):
    m = _mgr(tmp_path)
    p = m.save(1, TensorFileEngine(1), client_state={}, manifest={})
    (p / "shard_rank0.pt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="missing or truncated"):
        m.load(p, TensorFileEngine(0))
    other = CheckpointManager(tmp_path / "checkpoints", keep=2, rank=0, world_size=4)
    with pytest.raises(CheckpointError, match="written by 1 ranks"):
        other.load(p, TensorFileEngine(0))


def test_manifest_capture_and_diff():
    from tessera.evidence.manifest import capture_manifest, diff_manifests

    m = capture_manifest(
        recipe={"a": 1},
        recipe_hash="h",
        layout={"dp": 2},
        data_fingerprint={"content_hash": "c"},
        tokenizer_hash="t",
        launcher_command="deepspeed ...",
        world_size=2,
        seed=1,
        device="cpu",
    )
    assert m["versions"]["torch"].startswith("2.13") and m["versions"]["python"].startswith("3.11")
    assert m["hardware"]["cpu_cores"] >= 1 and m["hardware"]["memory_bytes"] > 0
    assert set(m["git"]) == {"commit", "dirty"}
    m2 = json.loads(json.dumps(m))
    m2["layout"]["dp"] = 4
    m2["launcher_command"] = "other"
    assert diff_manifests(m, m2) == [("layout.dp", 2, 4)]


def test_lr_schedule_warmup_cosine():
    from tessera.config.schema import OptimSection
    from tessera.train.schedule import lr_factor

    o = OptimSection(lr=1.0, min_lr=0.1, warmup_steps=4, schedule="cosine")
    f = [lr_factor(s, optim=o, total_steps=14) for s in range(14)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert (
        f[4] == 1.0
        and f[9] == pytest.approx(0.55)
        and f[13] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(torch.pi * 0.9)).item()))
    )
    assert all(a >= b for a, b in itertools.pairwise(f[4:]))


def test_hostfile_parsing(tmp_path):
    from tessera.launch.launcher import parse_hostfile

    hf = tmp_path / "h"
    hf.write_text("# nodes\nnode1 slots=8\nnode2 slots=8  # second\n\n")
    assert parse_hostfile(str(hf)) == [("node1", 8), ("node2", 8)]
    hf.write_text("node1 8\n")
    with pytest.raises(RecipeError, match="line 1"):
        parse_hostfile(str(hf))
