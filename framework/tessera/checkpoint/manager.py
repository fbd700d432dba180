"""Atomic, sharded, self-describing checkpoints: ``checkpoints/step_NNNNNN/`` + a ``latest`` pointer.

Protocol of one save (all ranks take part):

1. every rank checks that its parameters and optimizer state are finite (the ranks agree on the answer);
   a checkpoint is never written from non-finite state;
2. every rank writes its shard (the engine's format) and its RNG state (safetensors) into
   ``.tmp-step_NNNNNN/``; rank 0 adds the manifest;
3. the ranks hash and fsync the files between them (balanced by bytes), so the data is on disk before
   anything names it; rank 0 writes ``meta.json`` (format v2: engine, sharding,
   layout, precision, HF model config, tokenizer hash, step, the layout-free sampler position, and the
   sha256 and size of every file), then renames the directory to ``step_NNNNNN`` (atomic on one file
   system; the directories fsynced), rewrites ``latest`` via a temporary file + ``os.replace``, and prunes
   to the last ``keep``.

A crash anywhere before the rename leaves ``latest`` pointing at the previous complete checkpoint; a stray
``.tmp-*`` directory is removed by the next save. Loading verifies every file against ``meta.json`` before
anything reads it (:func:`verify_checkpoint`: only regular files, meta.json valid by its schema, checksums,
and a static scan of every pickle against an allow-list). DeepSpeed and megatron-core keep their own
pickled files; they are loaded only after that check, and only with ``weights_only=True`` and the same
allow-list (:mod:`tessera.safeload`). Tessera itself writes no pickle.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tessera.atomic import fsync_dir, sha256_file, sync_filesystem, write_json_atomic, write_text_atomic
from tessera.checkpoint.index import (
    FIX,
    FORMAT,
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    META,
    CheckpointIndex,
    checkpoint_files,
    step_dir_name,
    verify_checkpoint,
)
from tessera.comm.groups import all_gather_object, any_rank, barrier, multi_rank
from tessera.errors import CheckpointError, TrainingDiverged
from tessera.tensorfile import load_tensors_and_meta, save_tensors


def rng_file_name(rank: int) -> str:
    return f"rng_rank{rank:05d}.safetensors"


# ---- RNG state without pickle --------------------------------------------------------------------------


def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This process's torch / CUDA / numpy / Python RNG states as tensors plus JSON."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = s
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    tensors["numpy.keys"] = torch.from_numpy(np.asarray(keys, dtype=np.int64))
    version, py_state, py_gauss = random.getstate()
    tensors["python.state"] = torch.tensor(py_state, dtype=torch.int64)
    meta = {
        "numpy": {"kind": kind, "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "python": {"version": version, "gauss_next": py_gauss},
    }
    return tensors, meta


def set_rng_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch"])
    n = meta["numpy"]
    keys = tensors["numpy.keys"].numpy().astype(np.uint32)
    np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["gauss"]))
    p = meta["python"]
    random.setstate((p["version"], tuple(int(x) for x in tensors["python.state"].tolist()), p["gauss_next"]))
    cuda = [tensors[k] for k in sorted(k for k in tensors if k.startswith("cuda."))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def _load_v1_rng(path: Path) -> None:
    """The predecessor's pickled RNG file, read with ``weights_only=True`` (numpy's array reconstruction
    allow-listed, nothing else): a file that needs any other global is refused, never executed."""
    import pickle

    safe = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    try:
        with torch.serialization.safe_globals(safe):
            state = torch.load(path, weights_only=True)
        torch.set_rng_state(state["torch"])
        np.random.set_state(state["numpy"])
        random.setstate(state["python"])
    except (pickle.UnpicklingError, RuntimeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(
            f"cannot read this v1 RNG file safely ({type(e).__name__})",
            field="checkpoint",
            value=str(path),
            fix=FIX,
        ) from None


class CheckpointManager(CheckpointIndex):
    """Save / find / verify / load checkpoints of one run directory (``<run_dir>/checkpoints``)."""

    def __init__(self, root: Path, *, keep: int, rank: int, world_size: int):
        super().__init__(root, rank=rank, world_size=world_size)
        self.keep = keep

    # ---- save ------------------------------------------------------------------------------------
    def save(self, step: int, engine: Any, *, describe: dict[str, Any], sampler: dict[str, Any],
             manifest: dict[str, Any], tag: str | None = None) -> Path:  # fmt: skip
        """Save ``engine`` at ``step``. ``describe``: engine-independent facts for meta.json (engine,
        sharding, layout, precision, model_config, tokenizer_hash). ``tag``: a resharded checkpoint's
        layout, appended to the directory name so the source step stays untouched."""
        self.check_finite(engine, step)
        name = step_dir_name(step, tag)
        tmp = self.root / f".tmp-{name}"
        final = self.root / name
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(".tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        engine.save(tmp)
        tensors, rng_meta = rng_state()
        save_tensors(tmp / rng_file_name(self.rank), tensors, rng_meta)
        if self.rank == 0:
            write_json_atomic(tmp / MANIFEST, manifest)
        local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE")  # torchrun's, deepspeed's
        if local is not None and int(local) < self.world_size:
            sync_filesystem(tmp)  # ranks on several nodes: each node's part is on disk before the hashes
        barrier()
        files = checkpoint_files(tmp)
        # each rank hashes and fsyncs its share (balanced by bytes): the data is on disk before the rename
        mine = {
            f: (sha256_file(tmp / f, sync=True), (tmp / f).stat().st_size) for f in self._share(tmp, files)
        }
        hashed = {k: v for part in all_gather_object(mine) for k, v in part.items()}
        if self.rank == 0:
            meta = {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "step": step,
                "world_size": self.world_size,
                **describe,
                "sampler": sampler,
                "files": [{"path": f, "bytes": hashed[f][1], "sha256": hashed[f][0]} for f in files],
            }
            write_json_atomic(tmp / META, meta)
            fsync_dir(tmp)
            if final.exists():  # re-saving a step (e.g. after a resume): swap, never a half state
                trash = self.root / f".tmp-old-{name}"
                os.rename(final, trash)
                os.rename(tmp, final)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.rename(tmp, final)
            fsync_dir(self.root)  # the rename is durable before `latest` names it
            write_text_atomic(self.root / LATEST, name + "\n")
            fsync_dir(self.root)
            self._prune()
        barrier()
        return final

    def _share(self, root: Path, files: list[str]) -> list[str]:
        """This rank's files to hash: largest first to the rank with the fewest bytes so far (every rank
        computes the same split from the same sizes)."""
        load = [0] * self.world_size
        share: list[str] = []
        for f in sorted(files, key=lambda f: (-(root / f).stat().st_size, f)):
            r = load.index(min(load))
            load[r] += (root / f).stat().st_size
            if r == self.rank:
                share.append(f)
        return share

    def check_finite(self, engine: Any, step: int) -> None:
        """Refuse to save non-finite state: every rank checks its parameters and optimizer tensors, and
        all ranks raise together when any one found NaN / Inf."""
        from tessera.engines.base import first_nonfinite

        params = ((n, p.detach()) for m in engine.modules() for n, p in m.named_parameters())
        bad = first_nonfinite(params) or first_nonfinite(engine.optimizer_tensors())
        if any_rank(bad is not None):
            where = f"rank {self.rank}: {bad}" if bad else "another rank"
            raise TrainingDiverged(f"step {step}: non-finite model or optimizer state ({where}); not saved")

    def _prune(self) -> None:
        done = self.complete()
        for old in done[: max(0, len(done) - self.keep)]:
            shutil.rmtree(old, ignore_errors=True)

    # ---- verify + load ---------------------------------------------------------------------------
    def _verify_files(self, path: Path) -> tuple[dict[str, Any], list[str]]:
        """With a process group, every rank hashes its share of the files and all see every problem."""
        if not multi_rank():
            return super()._verify_files(path)
        meta, problems = verify_checkpoint(path, rank=dist.get_rank(), world=dist.get_world_size())
        return meta, list(dict.fromkeys(p for part in all_gather_object(problems) for p in part))

    def load(self, path: Path, meta: dict[str, Any], engine: Any) -> dict[str, Any]:
        """Restore the engine and this rank's RNG from a verified checkpoint; returns the sampler state."""
        engine.load(path)
        failed: CheckpointError | None = None
        try:  # every rank reads its own RNG file; a bad one on any rank stops all of them together
            if meta.get("format_version") == FORMAT_VERSION:
                set_rng_state(*load_tensors_and_meta(path / rng_file_name(self.rank)))
            else:
                _load_v1_rng(path / f"rng_rank{self.rank:05d}.pt")
        except CheckpointError as e:
            failed = e
        errors = [e for e in all_gather_object(failed and (failed.message, failed.value)) if e]
        if errors:
            msg, value = errors[0]
            raise CheckpointError(msg, field="checkpoint", value=value, fix=FIX)
        return (
            meta["sampler"]
            if meta.get("format_version") == FORMAT_VERSION
            else meta["client_state"]["sampler"]
        )
