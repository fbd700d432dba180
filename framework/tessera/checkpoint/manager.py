"""Atomic, sharded checkpoints: ``checkpoints/step_NNNNNN/`` + a ``latest`` pointer written last.

Protocol of one save (all ranks take part):

1. every rank writes its shard (the engine's format) and its RNG state into ``.tmp-step_NNNNNN/``;
2. rank 0 adds the manifest and ``meta.json`` (step, sampler position, file sizes), then renames the
   directory to ``step_NNNNNN`` (atomic on one file system);
3. rank 0 rewrites ``latest`` via a temporary file + ``os.replace``, then prunes to the last ``keep``.

A crash anywhere before step 3 leaves ``latest`` pointing at the previous complete checkpoint; a
stray ``.tmp-*`` directory is removed by the next save. A checkpoint without ``meta.json`` is never
offered for resume.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tessera.comm.groups import barrier
from tessera.errors import CheckpointError

STEP_RE = re.compile(r"^step_(\d{6,})$")
META = "meta.json"
LATEST = "latest"


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old or the new content, never a torn file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json_atomic(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointManager:
    """Save / find / load checkpoints of one run directory (``<run_dir>/checkpoints``)."""

    def __init__(self, root: Path, *, keep: int, rank: int, world_size: int):
        self.root = Path(root)
        self.keep = keep
        self.rank = rank
        self.world_size = world_size

    # ---- discovery -------------------------------------------------------------------------------
    def complete(self) -> list[Path]:
        """Complete checkpoints (with meta.json), oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if STEP_RE.match(p.name) and (p / META).is_file()]
        return sorted(found, key=lambda p: int(STEP_RE.match(p.name).group(1)))  # type: ignore[union-attr]

    def latest(self) -> Path | None:
        ptr = self.root / LATEST
        if ptr.is_file():
            cand = self.root / ptr.read_text().strip()
            if (cand / META).is_file():
                return cand
        done = self.complete()
        return done[-1] if done else None

    # ---- save ------------------------------------------------------------------------------------
    def save(self, step: int, engine, *, client_state: dict[str, Any], manifest: dict[str, Any]) -> Path:
        name = step_dir_name(step)
        tmp_name = f".tmp-{name}"
        tmp = self.root / tmp_name
        final = self.root / name
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(".tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
        barrier()
        engine.save(self.root, tmp_name, client_state)
        tmp.mkdir(parents=True, exist_ok=True)
        torch.save(rng_state(), tmp / f"rng_rank{self.rank:05d}.pt")
        barrier()
        if self.rank == 0:
            write_json_atomic(tmp / "manifest.json", manifest)
            files = sorted((str(p.relative_to(tmp)), p.stat().st_size) for p in tmp.rglob("*") if p.is_file())
            meta = {
                "step": step,
                "world_size": self.world_size,
                "client_state": client_state,
                "files": [{"path": f, "bytes": b} for f, b in files],
            }
            write_json_atomic(tmp / META, meta)
            if final.exists():  # re-saving a step (e.g. after a resume): swap, never a half state
                trash = self.root / f".tmp-old-{name}"
                os.rename(final, trash)
                os.rename(tmp, final)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.rename(tmp, final)
            write_text_atomic(self.root / LATEST, name + "\n")
            self._prune()
        barrier()
        return final

    def _prune(self) -> None:
        done = self.complete()
        for old in done[: max(0, len(done) - self.keep)]:
            shutil.rmtree(old, ignore_errors=True)

    # ---- load ------------------------------------------------------------------------------------
    def load(self, path: Path, engine) -> dict[str, Any]:
        """Restore engine state, this rank's RNG, and return the checkpoint's meta (client state)."""
        meta_path = path / META
        if not meta_path.is_file():
            raise CheckpointError(
                "checkpoint is incomplete (no meta.json)",
                field="checkpoint",
                value=str(path),
                fix="resume from an earlier step_* directory",
            )
        meta = json.loads(meta_path.read_text())
        if meta["world_size"] != self.world_size:
            raise CheckpointError(
                f"checkpoint was written by {meta['world_size']} ranks, this run has {self.world_size}",
                field="run.world_size",
                value=self.world_size,
                fix=f"resume with run.world_size={meta['world_size']} (resharding is `tessera convert`)",
            )
        for entry in meta["files"]:
            f = path / entry["path"]
            if not f.is_file() or f.stat().st_size != entry["bytes"]:
                raise CheckpointError(
                    "checkpoint file missing or truncated",
                    field="checkpoint",
                    value=str(f),
                    fix="resume from an earlier step_* directory",
                )
        engine.load(path.parent, path.name)
        rng_file = path / f"rng_rank{self.rank:05d}.pt"
        set_rng_state(torch.load(rng_file, weights_only=False))
        return meta
