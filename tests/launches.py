"""`tessera run` through the real CLI and launcher, for the end-to-end tests: the command, the common
overrides of the recovery and multi-node runs, and the checks that a run equals its reference bit for bit
(the references: the session fixture ``reference`` in tests/e2e/conftest.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import torch

from helpers import REPO, read_metrics
from tessera.checkpoint.index import step_dir_name
from tessera.checkpoint.manager import CheckpointManager
from tessera.checkpoint.reader import read_hf_moment, read_hf_state
from tessera.rundir import RunDir

TESSERA = [sys.executable, "-m", "tessera.cli"]
STEPS = 10
COMMON = [f"train.steps={STEPS}", "checkpoint.every=2", "checkpoint.keep=5", "tracking.wandb.mode=disabled"]
RECIPES = {"zero2": "recipes/tiny-llama-cpu.yaml", "tp2": "recipes/tiny-llama-cpu-mcore-tp2.yaml"}
# a rank killed at the start of step 4; rank 0 dying inside step 6's save; rank 1 hanging in step 8
FAULTS = "kill:rank=1:step=4,crash_in_save:rank=0:step=6,hang:rank=1:step=8"
HANG_TIMEOUT = 5


def tessera(*args: str, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*TESSERA, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env
    )


def final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    """Weights and both Adam moments of the run's last checkpoint, by HF name."""
    ckpt = CheckpointManager(RunDir(run_dir).checkpoints, keep=5, rank=0, world_size=2).latest()
    assert ckpt is not None and ckpt.name == step_dir_name(STEPS)
    state, meta = read_hf_state(ckpt)
    out = {f"w/{k}": v for k, v in state.items()}
    for kind in ("exp_avg", "exp_avg_sq"):
        out.update({f"{kind}/{k}": v for k, v in (read_hf_moment(ckpt, meta, kind) or {}).items()})
    return out


def assert_bit_identical(a: Path, b: Path) -> None:
    sa, sb = final_state(a), final_state(b)
    assert sa.keys() == sb.keys() and any(k.startswith("exp_avg/") for k in sa)
    different = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"
    ma, mb = read_metrics(a), read_metrics(b)
    assert [r["step"] for r in ma] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in ma] == [r["loss"] for r in mb]


def tree(pid: int) -> list[int]:
    """Every descendant of ``pid`` (the launchers and ranks of a `tessera run`)."""
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def alive(pids: list[int]) -> list[int]:
    """The ones still running (not zombies)."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out
