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
anything reads it (:func:`verify_checkpoint`); DeepSpeed and megatron-core unpickle some of their own files,
and only after that check. Tessera itself writes no pickle.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tessera.atomic import fsync_dir, sha256_file, write_json_atomic, write_text_atomic
from tessera.comm.groups import all_gather_object, any_rank, barrier, multi_rank
from tessera.errors import CheckpointError, TrainingDiverged
from tessera.rundir import RunDir
from tessera.tensorfile import load_tensors_and_meta, save_tensors

FORMAT = "tessera-checkpoint"
FORMAT_VERSION = 2
#: ``step_NNNNNN``, or ``step_NNNNNN-<layout>`` for a checkpoint resharded to another layout at that step
STEP_RE = re.compile(r"^step_(\d{6,})(?:-[a-z0-9][a-z0-9-]*)?$")
META = "meta.json"
LATEST = "latest"
MANIFEST = RunDir.MANIFEST  # the run's manifest, copied into every checkpoint
_FIX = "resume from an earlier checkpoint (tessera run R.yaml --resume-from checkpoints/step_N), or restore this one from a copy"


def step_dir_name(step: int, tag: str | None = None) -> str:
    return f"step_{step:06d}" + (f"-{tag}" if tag else "")


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
            fix=_FIX,
        ) from None


# ---- reading and verifying -------------------------------------------------------------------------


def read_meta(path: Path) -> dict[str, Any]:
    """``meta.json`` of checkpoint directory ``path``; anything unreadable is an error naming it."""
    meta_path = Path(path) / META
    if not meta_path.is_file():
        raise CheckpointError(
            "checkpoint is incomplete (no meta.json)", field="checkpoint", value=str(meta_path), fix=_FIX
        )
    try:
        meta = json.loads(meta_path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"meta.json is not valid JSON ({type(e).__name__})",
            field="checkpoint",
            value=str(meta_path),
            fix=_FIX,
        ) from None
    v2 = isinstance(meta, dict) and meta.get("format_version") == FORMAT_VERSION
    need = (
        ("step", "files", "engine", "layout", "sampler")
        if v2
        else ("step", "world_size", "files", "client_state")
    )
    missing = [k for k in need if not isinstance(meta, dict) or k not in meta]
    files = meta.get("files") if isinstance(meta, dict) else None
    if missing or not isinstance(files, list) or not all(isinstance(f, dict) for f in files):
        what = f"lacks {', '.join(missing)}" if missing else "has no valid file list"
        raise CheckpointError(
            f"meta.json {what}: not a Tessera checkpoint description",
            field="checkpoint",
            value=str(meta_path),
            fix=_FIX,
        )
    if isinstance(meta.get("format_version"), int) and meta["format_version"] > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint format {meta['format_version']} is newer than this Tessera reads ({FORMAT_VERSION})",
            field="checkpoint",
            value=str(meta_path),
            fix="upgrade Tessera",
        )
    return meta


def checkpoint_files(path: Path) -> list[str]:
    """Every regular file under a checkpoint directory except meta.json, relative and sorted."""
    return sorted(str(p.relative_to(path)) for p in Path(path).rglob("*") if p.is_file() and p.name != META)


def verify_checkpoint(path: Path, *, rank: int = 0, world: int = 1) -> tuple[dict[str, Any], list[str]]:
    """Check a checkpoint against its meta.json before anything loads it: every listed file present with
    its size, nothing unlisted, and (v2) the sha256 of this rank's share of the files (``world`` ranks
    split the hashing). Returns (meta, problems): each problem names the file; the caller raises."""
    path = Path(path)
    meta = read_meta(path)
    problems: list[str] = []
    v2 = meta.get("format_version") == FORMAT_VERSION
    entries = meta["files"]
    listed = set()
    for i, entry in enumerate(entries):
        rel = entry.get("path")
        if not isinstance(rel, str) or rel.startswith("/") or ".." in Path(rel).parts:
            problems.append(f"{path / META}: file entry {i} has no valid relative path")
            continue
        listed.add(rel)
        f = path / rel
        if not f.is_file():
            problems.append(f"{f}: missing")
        elif f.stat().st_size != entry.get("bytes"):
            problems.append(
                f"{f}: {f.stat().st_size} bytes, meta.json says {entry.get('bytes')} (truncated or altered)"
            )
        elif v2 and i % world == rank and sha256_file(f) != entry.get("sha256"):
            problems.append(f"{f}: sha256 does not match meta.json (the file was altered or corrupted)")
    for rel in checkpoint_files(path):
        if rel not in listed:
            problems.append(f"{path / rel}: not listed in meta.json")
    return meta, problems


def raise_problems(problems: list[str]) -> None:
    """Raise the first problem (in the order found: meta.json's own first, then the files)."""
    if problems:
        first = problems[0]
        file, _, why = first.partition(": ")
        more = f" ({len(problems) - 1} more problem(s) in this checkpoint)" if len(problems) > 1 else ""
        raise CheckpointError(
            f"checkpoint verification failed: {why}{more}", field="checkpoint", value=file, fix=_FIX
        )


def verify_or_raise(path: Path) -> dict[str, Any]:
    """Single-process verification of every file (the CLI, before launch; tools)."""
    meta, problems = verify_checkpoint(path)
    raise_problems(problems)
    return meta


class CheckpointManager:
    """Save / find / verify / load checkpoints of one run directory (``<run_dir>/checkpoints``)."""

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
        # a resharded copy of a step is newer than the step it was made from
        return sorted(found, key=lambda p: (int(STEP_RE.match(p.name).group(1)), (p / META).stat().st_mtime))  # type: ignore[union-attr]

    def pick(self, chosen: str | Path | None) -> Path | None:
        """The checkpoint to resume from: ``chosen`` (``--resume-from``: a step directory of this run, by
        path or name) or else :meth:`latest`."""
        if chosen is None:
            return self.latest()
        p = Path(chosen)
        if not p.exists() and not p.is_absolute():
            p = self.root / p
        if p.resolve().parent != self.root.resolve() or not STEP_RE.match(p.name) or not (p / META).is_file():
            have = ", ".join(c.name for c in self.complete()) or "none"
            raise CheckpointError(
                "--resume-from must name a complete checkpoint of this run",
                field="--resume-from",
                value=str(chosen),
                fix=f"one of this run's checkpoints ({have}); another run's: tessera convert it first",
            )
        return p

    def latest(self) -> Path | None:
        """The checkpoint ``latest`` names; without a ``latest`` file (a crash between the rename and its
        write), the newest complete one. A ``latest`` that is unreadable or names nothing complete is an
        error: resuming from some other step silently would be worse."""
        ptr = self.root / LATEST
        if not ptr.is_file():
            done = self.complete()
            return done[-1] if done else None
        try:
            name = ptr.read_bytes().decode("ascii").strip()
        except UnicodeDecodeError:
            name = None
        if not name or not STEP_RE.match(name):
            raise CheckpointError(
                "the latest pointer does not hold a step_NNNNNN name",
                field="checkpoint",
                value=str(ptr),
                fix=f"write the name of a complete checkpoint into it (one of: {self._names()})",
            )
        cand = self.root / name
        if not (cand / META).is_file():
            raise CheckpointError(
                f"the latest pointer names {name}, which is not a complete checkpoint",
                field="checkpoint",
                value=str(ptr),
                fix=f"write the name of a complete checkpoint into it (one of: {self._names()})",
            )
        return cand

    def _names(self) -> str:
        return ", ".join(p.name for p in self.complete()) or "none left: start fresh"

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
    def verify(self, path: Path, *, any_world: bool = False) -> dict[str, Any]:
        """Check ``path`` before anything loads it, and (unless ``any_world``: it is to be resharded) that
        it was written by this many ranks. With a process group, every rank hashes its share of the files
        and all raise the same error when any failed; without one (the CLI before launch), this process
        hashes them all."""
        share = (dist.get_rank(), dist.get_world_size()) if multi_rank() else (0, 1)
        meta, problems = verify_checkpoint(path, rank=share[0], world=share[1])
        raise_problems(list(dict.fromkeys(p for part in all_gather_object(problems) for p in part)))
        if meta.get("format_version") != FORMAT_VERSION and self.rank == 0:
            print(f"[tessera] warning: {path} is a v1 checkpoint: it carries no checksums", file=sys.stderr)
        if meta["world_size"] != self.world_size and not any_world:
            raise CheckpointError(
                f"checkpoint was written by {meta['world_size']} ranks, this run has {self.world_size}",
                field="run.world_size",
                value=self.world_size,
                fix=f"resume with run.world_size={meta['world_size']}, or without --same-layout to reshard",
            )
        return meta

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
            raise CheckpointError(msg, field="checkpoint", value=value, fix=_FIX)
        return (
            meta["sampler"]
            if meta.get("format_version") == FORMAT_VERSION
            else meta["client_state"]["sampler"]
        )
