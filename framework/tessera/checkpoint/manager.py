"""Atomic, sharded, self-describing checkpoints: ``checkpoints/step_NNNNNN/`` + a ``latest`` pointer.

Protocol of one save (all ranks take part):

1. every rank checks that its parameters and optimizer state are finite (the ranks agree on the answer);
   a checkpoint is never written from non-finite state;
2. every rank writes its shard (the engine's format) and its RNG state (safetensors) into
   ``.tmp-step_NNNNNN/``; rank 0 adds the manifest;
3. the ranks hash and fsync the files between them (balanced by bytes), so the data is on disk before
   anything names it; rank 0 writes ``meta.json`` (format v2: engine, sharding,
   layout, precision, HF model config, tokenizer hash, step, the layout-free sampler position, and the
   BLAKE3 checksum and size of every file), then renames the directory to ``step_NNNNNN`` (atomic on one file
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

import json
import os
import random
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tessera.atomic import CHECKSUM, checksum_file, fsync_dir, write_json_atomic, write_text_atomic
from tessera.checkpoint.index import (
    FIX,
    FORMAT,
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    META,
    CheckpointIndex,
    checkpoint_files,
    checksum_problems,
    raise_problems,
    step_dir_name,
    verify_checkpoint,
)
from tessera.comm.groups import all_gather_object, any_rank, barrier, multi_rank
from tessera.errors import CheckpointError, TrainingDiverged
from tessera.tensorfile import load_tensors_and_meta, save_tensors
from tessera.writes import Writes, collecting, write_json_now_or_later


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
    """Save / find / verify / load checkpoints of one run directory (``<run_dir>/checkpoints``).

    ``background`` (``checkpoint.async``): :meth:`save` returns once the state is snapshot; the files are
    written by a thread while the steps go on, and the checkpoint becomes ``latest`` only when every
    rank's files are on disk. At most one save is in flight: the next :meth:`save` (and :meth:`finish`,
    which the training loop calls before it ends or stops) first waits for it."""

    def __init__(self, root: Path, *, keep: int, rank: int, world_size: int, background: bool = False):
        super().__init__(root, rank=rank, world_size=world_size)
        self.keep = keep
        self.background = background
        self.pending: _Pending | None = None
        #: seconds the last :meth:`save` waited for the save before it (0 when none was in flight)
        self.waited_s = 0.0
        #: ``watch(step, where, bytes)`` hears of every block written ("bytes", this rank's total so far)
        #: and, on rank 0, of the rename ("renamed"): the fault injection's kill points
        self.watch: Callable[[int, str, int], None] | None = None
        #: checksums :meth:`verify` left running, by checkpoint (:meth:`settle` waits for them)
        self._checksums: dict[Path, Future[list[str]]] = {}

    # ---- save ------------------------------------------------------------------------------------
    def save(self, step: int, engine: Any, *, describe: dict[str, Any], sampler: dict[str, Any],
             manifest: dict[str, Any], tag: str | None = None,
             tick: Callable[[], None] | None = None) -> Path:  # fmt: skip
        """Save ``engine`` at ``step``. ``describe``: engine-independent facts for meta.json (engine,
        sharding, layout, precision, model_config, tokenizer_hash). ``tag``: a resharded checkpoint's
        layout, appended to the directory name so the source step stays untouched. ``tick``: called while
        waiting for a save in flight (the heartbeat). Returns the checkpoint's directory: complete when
        the save is synchronous, named by ``latest`` once :attr:`pending` completes otherwise."""
        previous = self.finish(tick)
        self.waited_s = previous.waited_s if previous is not None and previous.writes.background else 0.0
        if getattr(engine, "holds_state", True):  # a conversion's writer makes its tensors as it writes them
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
        writes = Writes(tmp, background=self.background and getattr(engine, "saves_in_background", False))
        if self.watch is not None:
            watch = self.watch
            writes.watch = lambda n: watch(step, "bytes", n)
        with collecting(writes):
            engine.save(tmp)
            tensors, rng_meta = rng_state()
            save_tensors(tmp / rng_file_name(self.rank), tensors, rng_meta)
            if self.rank == 0:
                write_json_now_or_later(tmp / MANIFEST, manifest)
        pending = _Pending(step, name, tmp, final, writes)
        writes.always(lambda error: _write_marker(tmp, self.rank, writes, error))
        if self.rank == 0:
            record = {"format": FORMAT, "format_version": FORMAT_VERSION, "step": step,
                      "world_size": self.world_size, **describe, "sampler": sampler}  # fmt: skip
            writes.always(lambda error: None if error else self._commit(pending, record))
        writes.start()
        self.pending = pending
        if not writes.background:
            self.finish(tick)
        return final

    def finish(self, tick: Callable[[], None] | None = None) -> _Pending | None:
        """Wait for the save in flight (this rank's files; on rank 0 also the commit), then for every
        rank. Returns it (None when there was none). Its failure on any rank is raised on that rank."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        t0 = time.perf_counter()
        try:
            pending.writes.wait(tick)
        finally:
            pending.waited_s = time.perf_counter() - t0
        if not pending.writes.background:
            barrier()  # a synchronous save returns when the checkpoint is complete on every rank
        return pending

    def _commit(self, pending: _Pending, record: dict[str, Any]) -> None:
        """Rank 0, after its own files: wait for every rank's marker, hash what no writer hashed, write
        meta.json, rename the directory to its step name, point ``latest`` at it, prune."""
        tmp, final = pending.tmp, pending.final
        markers = _read_markers(tmp, self.world_size)
        failed = [m for m in markers if m.get("error")]
        if failed:
            raise CheckpointError(
                f"rank {failed[0]['rank']} could not write its part of the checkpoint of step {pending.step}: "
                f"{failed[0]['error']}; `latest` still names the previous checkpoint",
                field="checkpoint",
                value=str(tmp),
                fix="see that rank's log; free space or fix the disk, then --resume",
            )
        for r in range(self.world_size):
            (tmp / _marker_name(r)).unlink()
        hashed = {f: tuple(h) for m in markers for f, h in m["files"].items()}
        for fn in pending.writes.commits:  # an engine's own completion (megatron-core's metadata)
            fn(markers)
        files = checkpoint_files(tmp)
        for f in files:
            if f not in hashed:  # written outside the writers (megatron-core's common and metadata files)
                hashed[f] = (checksum_file(tmp / f, sync=True), (tmp / f).stat().st_size)
        meta = {
            **record,
            "files": [{"path": f, "bytes": hashed[f][1], CHECKSUM: hashed[f][0]} for f in files],
        }
        write_json_atomic(tmp / META, meta)
        fsync_dir(tmp)
        if final.exists():  # re-saving a step (e.g. after a resume): swap, never a half state
            trash = self.root / f".tmp-old-{pending.name}"
            os.rename(final, trash)
            os.rename(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, final)
        fsync_dir(self.root)  # the rename is durable before `latest` names it
        if self.watch is not None:
            self.watch(pending.step, "renamed", 0)
        write_text_atomic(self.root / LATEST, pending.name + "\n")
        fsync_dir(self.root)
        self._prune()

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
    def _verify_files(self, path: Path, *, defer: bool = False) -> tuple[dict[str, Any], list[str]]:
        """With a process group, every rank hashes its share of the files and all see every problem.
        ``defer``: the share's checksums are computed by a thread while the caller goes on (the model is
        built, the engine loads: the one read of the files serves both); :meth:`load` waits for them."""
        rank, world = (dist.get_rank(), dist.get_world_size()) if multi_rank() else (0, 1)
        later: list[tuple[Path, dict[str, Any]]] | None = [] if defer else None
        meta, problems = verify_checkpoint(path, rank=rank, world=world, defer=later)
        if later is not None:
            from concurrent.futures import ThreadPoolExecutor

            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tessera-checksums")
            self._checksums[Path(path)] = pool.submit(checksum_problems, later)
            pool.shutdown(wait=False)
        return meta, self._everyones(problems)

    def _everyones(self, problems: list[str]) -> list[str]:
        if not multi_rank():
            return problems
        return list(dict.fromkeys(p for part in all_gather_object(problems) for p in part))

    def settle(self, path: Path, *, gather: bool = True) -> None:
        """Wait for the checksums :meth:`verify` left running for ``path`` and raise the first problem
        (``gather``: every rank's, called on every rank; else this rank's own); nothing to do when none
        were deferred."""
        future = self._checksums.pop(Path(path), None)
        if future is not None:
            raise_problems(self._everyones(future.result()) if gather else future.result())

    def load(self, path: Path, meta: dict[str, Any], engine: Any) -> dict[str, Any]:
        """Restore the engine and this rank's RNG from a verified checkpoint; returns the sampler state.
        Checksums left running by :meth:`verify` are waited for after the engine's load (it reads the
        files the hashing reads, from the page cache the first of them filled): a mismatch is raised
        then, before anything trains, and a load that failed on a corrupted file reports the file."""
        try:
            engine.load(path)
        except BaseException:
            # this rank's checksum problem explains the failure: raised instead of it (no collective here:
            # the other ranks may be inside the engine's load)
            self.settle(path, gather=False)
            raise
        self.settle(path)
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


# ---- one save in flight, and the ranks' markers ---------------------------------------------------------

MARKER_POLL_S = 0.02


@dataclass
class _Pending:
    """A save whose files are being written: where, by which :class:`Writes`, and its times."""

    step: int
    name: str
    tmp: Path
    final: Path
    writes: Writes
    waited_s: float = 0.0  # the time :meth:`CheckpointManager.finish` waited for the writes


def _marker_name(rank: int) -> str:
    return f".done-rank{rank:05d}.json"


def _write_marker(tmp: Path, rank: int, writes: Writes, error: BaseException | None) -> None:
    """This rank's files are on disk: their hashes (and an engine's extras) for rank 0's commit. Written
    atomically, so rank 0 never reads half of one. A rank whose writer failed writes the error instead."""
    files = {f: list(h) for f, h in writes.results.items()}
    why = None if error is None else f"{type(error).__name__}: {str(error)[:300]}"
    write_json_atomic(tmp / _marker_name(rank), {"rank": rank, "files": files, "error": why, **writes.extra})


def _read_markers(tmp: Path, world: int) -> list[dict[str, Any]]:
    """Every rank's marker, waiting for the ones not written yet. The ranks share the checkpoint's file
    system, which is how rank 0 learns that every rank is done without a collective on the training
    loop's process group (its thread must not issue one beside the steps')."""
    out: list[dict[str, Any]] = []
    for r in range(world):
        path = tmp / _marker_name(r)
        while not path.is_file():
            if not tmp.is_dir():
                raise CheckpointError("the checkpoint's directory vanished while it was written",
                                      field="checkpoint", value=str(tmp), fix=FIX)  # fmt: skip
            time.sleep(MARKER_POLL_S)
        out.append(json.loads(path.read_text()))
    return out
