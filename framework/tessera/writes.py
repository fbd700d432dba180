"""A checkpoint's files, written in one pass over their bytes: hashed while they are written, fsynced
once, in line or on a background thread.

One save of one rank is a :class:`Writes`: the engine's serializers (``torch.save`` for DeepSpeed's
files, safetensors for Tessera's, megatron-core's bucket writer) produce their bytes into a
:class:`HashingFile`, which feeds every block to the checksum (:data:`tessera.atomic.CHECKSUM`) on its
way to the disk, so no file is read back to be hashed. With ``background=True`` (``checkpoint.async``), :meth:`Writes.add` first takes a
:func:`snapshot` of what it is given (a copy on CPU, a copy into pinned host memory on GPU), so that the
steps that follow cannot change what is written, and one thread per save writes the snapshots in order.

The engines do not take a ``Writes`` argument: the checkpoint manager makes one :func:`current` while
the engine saves (:func:`collecting`), and the engine's writing paths (:func:`tessera.tensorfile.save_tensors`,
DeepSpeed's checkpoint engine, megatron's bucket writer) hand their files to it. Outside a save they
write directly, as before.
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch

from tessera.atomic import Beside, checksum_hasher, json_text, write_json_atomic

#: (checksum hex, bytes) of one written file
Hashed = tuple[str, int]
_BUFFER = 8 << 20
#: blocks at least this large are hashed on a helper thread while they are written
_BESIDE = 1 << 20


class HashingFile:
    """A new file opened for writing (never through a link: ``O_EXCL | O_NOFOLLOW``), whose bytes are
    hashed as they pass. ``progress`` hears of every block (the heartbeat's sign of life)."""

    def __init__(self, path: Path, progress: Callable[[int], None] | None = None) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        self.path = Path(path)
        self._f = os.fdopen(fd, "wb", buffering=_BUFFER)
        self._h = checksum_hasher()
        self._progress = progress
        self._beside: Beside | None = None
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")  # torch.save hands bytes, bytearrays and tensor storages
        if view.nbytes >= _BESIDE:  # hashed on the helper thread while written; done before returning
            if self._beside is None:  # (the caller may reuse or free ``data`` once this returns)
                self._beside = Beside()
            hashing = self._beside.start(self._h.update, view)
            try:
                self._f.write(view)
            finally:
                hashing.result()
        else:
            self._h.update(view)
            self._f.write(view)
        self.size += view.nbytes
        if self._progress is not None:
            self._progress(view.nbytes)
        return view.nbytes

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()

    def finish(self) -> Hashed:
        """Flush, fsync and close: the bytes are on disk when this returns."""
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        self._close_beside()
        return self._h.hexdigest(), self.size

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self._f.close()
        self._close_beside()

    def _close_beside(self) -> None:
        if self._beside is not None:
            self._beside.close()
            self._beside = None


def write_hashed(
    path: Path, fill: Callable[[BinaryIO], None], progress: Callable[[int], None] | None = None
) -> Hashed:
    """Write ``path`` with ``fill(stream)`` through a :class:`HashingFile`; its hash and size."""
    out = HashingFile(path, progress)
    try:
        fill(out)  # type: ignore[arg-type]
        return out.finish()
    except BaseException:
        out.abort()
        raise


def snapshot(obj: Any) -> Any:
    """``obj`` with every tensor replaced by a copy that later steps cannot change: a clone on CPU, a
    non-blocking copy into pinned host memory from an accelerator (the CUDA event :meth:`Writes.start`
    records after them lets the writer thread wait for the copies before it reads them). Dicts, lists and tuples are rebuilt (their types kept);
    anything else is shared (ints, strings, configs: nothing a step changes), as is a container with no
    tensor in it."""
    if torch.is_tensor(obj):
        t = obj.detach()
        if t.device.type == "cpu":
            return t.clone()
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        out.copy_(t, non_blocking=True)
        return out
    if isinstance(obj, dict | list | tuple):
        items = list(obj.items()) if isinstance(obj, dict) else list(obj)
        copied = (
            [(k, snapshot(v)) for k, v in items] if isinstance(obj, dict) else [snapshot(v) for v in items]
        )
        parts = [v for _, v in copied] if isinstance(obj, dict) else copied
        olds = [v for _, v in items] if isinstance(obj, dict) else items
        if all(a is b for a, b in zip(parts, olds, strict=True)):
            return obj  # no tensor inside: kept as it is (torch.Size, a config, a defaultdict's type)
        if isinstance(obj, dict):
            out = copy.copy(obj)  # its type and attributes (an OrderedDict, a defaultdict's factory)
            out.update(copied)
            return out
        if isinstance(obj, list):
            return type(obj)(copied) if type(obj) is list else _replaced(obj, copied)
        return type(obj)(*copied) if hasattr(obj, "_fields") else type(obj)(copied)
    return obj


def _replaced(obj: list[Any], items: list[Any]) -> list[Any]:
    out = copy.copy(obj)
    out[:] = items
    return out


class Writes:
    """This rank's files of one checkpoint directory ``root``. ``background``: the files are written by a
    thread from snapshots (:meth:`start` starts it); otherwise each is written when it is added.

    ``results``: relative path -> (checksum, bytes) of every file written here. A failure in the thread is
    kept and raised by :meth:`wait`."""

    def __init__(self, root: Path, *, background: bool) -> None:
        self.root = Path(root)
        self.background = background
        self.results: dict[str, Hashed] = {}
        self.bytes_written = 0
        self.error: BaseException | None = None
        #: called with :attr:`bytes_written` after every block (the fault injection's kill points)
        self.watch: Callable[[int], None] | None = None
        #: JSON-able facts this rank's marker carries to rank 0 (megatron-core's write results)
        self.extra: dict[str, Any] = {}
        #: rank 0's completion steps, given every rank's marker, before meta.json is written
        self.commits: list[Callable[[list[dict[str, Any]]], None]] = []
        self._jobs: list[Callable[[], None]] = []
        self._last: list[Callable[[BaseException | None], None]] = []
        self._event: Any = None
        self._thread: threading.Thread | None = None
        self._done = threading.Event()

    # ---- what the engines hand over ---------------------------------------------------------------
    def add(self, path: Path, obj: Any, serialize: Callable[[Any, BinaryIO], None]) -> None:
        """``serialize(obj, stream)`` into ``path`` (under ``root``): now, or later from a snapshot."""
        if not self.background:
            self._file(path, lambda f: serialize(obj, f))
            return
        copy = snapshot(obj)
        self._jobs.append(lambda: self._file(path, lambda f: serialize(copy, f)))

    def add_task(self, task: Callable[[Callable[[int], None]], dict[str, Hashed]]) -> None:
        """A writer of its own (megatron-core's buckets): ``task(progress)`` writes its files from data
        that is already a snapshot and returns their hashes, keyed by path."""

        def run() -> None:
            for p, h in task(self._count).items():
                self.results[str(Path(p).relative_to(self.root))] = h

        if self.background:
            self._jobs.append(run)
        else:
            run()

    def always(self, fn: Callable[[BaseException | None], None]) -> None:
        """Run ``fn(error)`` at the end of a background save whether it failed or not (``error``: the
        failure, or None); in line, ``fn(None)`` now (a failure there raised in the caller already)."""
        if self.background:
            self._last.append(fn)
        else:
            fn(None)

    # ---- running -----------------------------------------------------------------------------------
    def _count(self, n: int) -> None:
        self.bytes_written += n
        if self.watch is not None:
            self.watch(self.bytes_written)

    def _file(self, path: Path, fill: Callable[[BinaryIO], None]) -> None:
        rel = str(Path(path).relative_to(self.root))
        self.results[rel] = write_hashed(Path(path), fill, self._count)

    def start(self) -> None:
        """Begin writing (background), or mark the writes done (in line: they already are)."""
        if not self.background:
            self._done.set()
            return
        if torch.cuda.is_available():
            self._event = torch.cuda.Event()
            self._event.record()  # after any device-to-host copies of the snapshot: the thread waits for them
        self._thread = threading.Thread(target=self._run, name="tessera-checkpoint-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        _lower_priority()
        try:
            if self._event is not None:
                self._event.synchronize()
            for job in self._jobs:
                job()
        except BaseException as e:  # kept for wait(): the thread never raises into the void
            self.error = e
        try:
            for fn in self._last:
                fn(self.error)
        except BaseException as e:
            self.error = self.error or e
        finally:
            self._jobs, self._last = [], []
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, tick: Callable[[], None] | None = None, every_s: float = 0.5) -> None:
        """Block until this rank's files are written; ``tick`` is called while waiting (the heartbeat)
        whenever bytes were written since the last call. Raises the writer's failure."""
        seen = -1
        while not self._done.wait(every_s):
            if tick is not None and self.bytes_written != seen:
                seen = self.bytes_written
                tick()
        if self.error is not None:
            raise self.error


@contextlib.contextmanager
def without_zip_crc() -> Iterator[None]:
    """``torch.save`` calls in the block skip the zip format's CRC-32 of every record: a checkpoint
    writer's stream hashes every byte for meta.json already, and the CRC is a second pass
    over the bytes (a copy of each storage through the zip writer: ~0.3 s per 0.5 GB on a 2-core
    machine). ``torch.load`` does not check it; Tessera's pickle scan reads such members without it."""
    from torch.utils.serialization import config

    before = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        yield
    finally:
        config.save.compute_crc32 = before


def torch_save(obj: Any, stream: BinaryIO, **kwargs: Any) -> None:
    """``torch.save`` into a checkpoint writer's stream (:func:`without_zip_crc`)."""
    with without_zip_crc():
        torch.save(obj, stream, **kwargs)


def _lower_priority() -> None:
    """The writer thread yields to the step loop: the lowest scheduling priority for this thread only
    (Linux applies ``setpriority`` to a thread id). Where the step loop keeps the cores busy (a CPU run,
    ranks pinned to cores), the writer runs in the step's waits instead of slowing its compute; on a GPU
    host it takes the idle cores as before. Elsewhere, or without permission, nothing changes."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


_CURRENT = threading.local()


def current() -> Writes | None:
    """The save in progress on this thread (set by :func:`collecting`), or None."""
    return getattr(_CURRENT, "writes", None)


@contextlib.contextmanager
def collecting(writes: Writes) -> Iterator[Writes]:
    """While the block runs, the engine's writing paths hand their files to ``writes``."""
    before = current()
    _CURRENT.writes = writes
    try:
        yield writes
    finally:
        _CURRENT.writes = before


def write_json_now_or_later(path: Path, obj: Any) -> None:
    """A small JSON file of a checkpoint (rank 0's manifest): through the current save, or atomically."""
    writes = current()
    if writes is None:
        write_json_atomic(path, obj)
        return
    text = json_text(obj).encode()
    writes.add(path, text, lambda data, f: f.write(data))
