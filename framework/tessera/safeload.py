"""No code runs from a checkpoint: the pickles DeepSpeed and megatron-core write, checked and loaded safely.

A checksum in ``meta.json`` detects bit-rot, not tampering (whoever can replace a shard can rewrite its
hash), and a pickle can name any callable to run at load. So every pickle-bearing file of a checkpoint
passes two independent guards, each sufficient on its own:

1. a static scan (:func:`scan_pickles`, :func:`file_problem`), run by the checkpoint verification before
   anything is loaded (``tessera verify``, ``tessera convert``, ``tessera run --resume`` before launch,
   and every rank again): it disassembles each pickle with :mod:`pickletools`, never unpickling it, and
   refuses any global that is not on :data:`ALLOWED` (torch ``.pt`` zip archives: DeepSpeed's
   model / optimizer states, megatron's ``common.pt``, each tensor or byte entry of a torch
   distributed-checkpoint ``.distcp``) or :data:`DCP_METADATA` (the ``.metadata`` pickle);
2. the loads themselves: :func:`safe_torch_load` (``weights_only=True`` with the allow-list), used by
   Tessera's readers and plugged into DeepSpeed's checkpoint engine and megatron-core's load strategies
   (:mod:`tessera.engines.zero`, :mod:`tessera.engines.megatron_engine`); the distributed checkpoint's
   ``.metadata`` is read by :class:`RestrictedUnpickler`, which resolves only :data:`DCP_METADATA`.

Found empirically (deepspeed 0.19.8, megatron-core 0.16.1, torch 2.13): the globals of ZeRO 0-3, offload
and bf16 checkpoints, megatron's distributed optimizer / DDP with tp / pp / ep, and megatron with
DeepSpeed ZeRO. This module imports no torch at import time (the CLI scans before it launches).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import os
import pickle
import pickletools
import re
import sys
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from tessera.errors import CheckpointError

_STORAGES = ("Float", "Double", "Half", "BFloat16", "Long", "Int", "Short", "Char", "Byte", "Bool")
_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")

#: every global a torch ``.pt`` zip archive of a DeepSpeed or megatron-core checkpoint holds: torch's
#: tensor reconstruction, and DeepSpeed's optimizer-state records (its loss scaler, the ZeRO stage enum,
#: a parameter's fragment address); nothing that runs code of its choosing
ALLOWED: tuple[str, ...] = (
    "collections.OrderedDict",
    "builtins.set",
    "_codecs.encode",  # how protocol 2 spells bytes
    "torch.Size",
    "torch.Tensor",
    "torch.device",
    "torch.nn.parameter.Parameter",
    "torch._utils._rebuild_tensor",
    "torch._utils._rebuild_tensor_v2",
    "torch._utils._rebuild_parameter",
    "torch._utils._rebuild_parameter_with_state",
    "torch._tensor._rebuild_from_type_v2",
    "torch.storage.UntypedStorage",
    *(f"torch.{s}Storage" for s in _STORAGES),
    *(f"torch.{d}" for d in _DTYPES),
    # numpy's array reconstruction: the RNG state of a v1 (predecessor) checkpoint
    "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray._reconstruct",
    "numpy.ndarray",
    "numpy.dtype",
    "numpy.dtypes.UInt32DType",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)

#: every global of a torch distributed checkpoint's ``.metadata`` (plain dataclasses and enums)
DCP_METADATA: tuple[str, ...] = (
    "collections.OrderedDict",
    "torch.Size",
    "torch.serialization._get_layout",
    *(f"torch.{d}" for d in _DTYPES),
    *(
        f"torch.distributed.checkpoint.metadata.{c}"
        for c in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    *(f"torch.distributed.checkpoint.planner.{c}" for c in ("SavePlan", "WriteItem", "WriteItemType")),
    "torch.distributed.checkpoint.planner.TensorWriteData",
)

#: Tessera's own files, never unpickled by anyone (JSON; safetensors holds raw tensors and a JSON header)
NOT_PICKLES = (".json", ".safetensors")
DCP_METADATA_FILE = ".metadata"
ZIP_MAGIC = b"PK\x03\x04"  # torch.load takes a file for a zip archive by these bytes, as this does
FIX = (
    "this file asks to run code on load: do not use this checkpoint (restore it from a trusted copy, or "
    "resume from an earlier one with --resume-from checkpoints/step_N)"
)


def _refusal(names: list[str], what: str) -> str:
    bad = sorted(set(names))
    listed = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
    verb = "is" if len(bad) == 1 else "are"
    return (
        f"{what} needs {listed}, which {verb} not on Tessera's allow-list of the classes DeepSpeed and "
        "megatron-core checkpoints hold; refused, nothing was loaded"
    )


# ---- the static scan -----------------------------------------------------------------------------------

_DYNAMIC = "<a global computed at load time>"


def pickle_globals(stream: IO[bytes]) -> list[str]:
    """The globals (``module.qualname``) one pickle in ``stream`` names, by disassembly alone: the pickle
    machine's stack and memo are followed just far enough to know the strings a ``STACK_GLOBAL`` takes
    its module and name from (a name that is not a plain string read from the file is reported as
    ``<a global computed at load time>``). Raises ValueError where ``stream`` is not a pickle."""
    found: list[str] = []
    stack: list[Any] = []
    memo: dict[int, Any] = {}
    mark = object()
    for op, arg, _ in pickletools.genops(stream):
        name = op.name
        if name in ("GLOBAL", "INST"):
            found.append(str(arg).replace(" ", "."))
        elif name == "STACK_GLOBAL":
            mod, qual = stack[-2:] if len(stack) >= 2 else (None, None)
            ok = isinstance(mod, str) and isinstance(qual, str)
            found.append(f"{mod}.{qual}" if ok else _DYNAMIC)
        elif name.startswith("EXT"):  # the copyreg extension registry: a global by number
            found.append(f"<copyreg extension {arg}>")
        if name == "STOP":
            break
        # follow the stack: what MEMOIZE / PUT store is its top, what GET pushes comes from the memo
        if name in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"):
            memo[len(memo) if name == "MEMOIZE" else arg] = stack[-1] if stack else None
            continue
        if name == "DUP":
            stack.append(stack[-1] if stack else None)
            continue
        before, after = op.stack_before, op.stack_after
        if pickletools.markobject in before:
            while stack and stack.pop() is not mark:
                pass
            del stack[max(0, len(stack) - before.index(pickletools.markobject)) :]
        else:
            del stack[max(0, len(stack) - len(before)) :]
        if name in ("GET", "BINGET", "LONG_BINGET"):
            stack.append(memo.get(arg))
        elif after == [pickletools.markobject]:
            stack.append(mark)
        else:
            # the string opcodes (protocol 0-2 strings unpickle as str too)
            value = arg if isinstance(arg, str) and ("UNICODE" in name or "STRING" in name) else None
            stack.extend([value] * len(after))
    return found


def _pickles_in(stream: IO[bytes], limit: int) -> Iterator[list[str]]:
    """The globals of each pickle in a row at the start of ``stream`` (a legacy torch file is five), up to
    ``limit`` bytes; stops at the first thing that is not a pickle. The first must be one."""
    first = True
    while stream.tell() < limit:
        try:
            yield pickle_globals(stream)
        except (ValueError, EOFError, IndexError, KeyError, UnicodeDecodeError):
            if first:
                raise ValueError("not a pickle") from None
            return
        first = False


def _zip_globals(archive: IO[bytes]) -> list[str]:
    """The globals of every pickle in a torch zip archive, read through its central directory (as
    torch.load reads it), one member at a time."""
    out: list[str] = []
    with zipfile.ZipFile(archive) as z:
        for info in z.infolist():
            if info.filename.endswith(".pkl"):
                with z.open(info) as member:
                    # Tessera's checkpoint writer saves without torch's zip CRC-32 (the file's sha256 in
                    # meta.json covers every byte, checked before this scan): zipfile's own check of it
                    # would refuse those members, so it is not asked for (torch.load never checks it)
                    if info.CRC == 0:
                        member._expected_crc = None  # type: ignore[attr-defined]
                    out += pickle_globals(io.BytesIO(member.read()))
    return out


class FileWindow(io.RawIOBase):
    """Bytes ``[start, start + length)`` of an open file, as a seekable file of their own: one entry of a
    ``.distcp`` file (a ``torch.save`` archive)."""

    def __init__(self, f: IO[bytes], start: int, length: int) -> None:
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = max(
            0, min(self.length, {0: offset, 1: self.pos + offset, 2: self.length + offset}[whence])
        )
        return self.pos

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = max(0, min(len(view), self.length - self.pos))
        self.f.seek(self.start + self.pos)
        got = self.f.readinto(view[:n]) if n else 0  # type: ignore[attr-defined]
        self.pos += got or 0
        return got or 0


def _torch_blob_problem(stream: IO[bytes], length: int, what: str) -> str | None:
    """One torch.save output (a whole ``.pt`` file, or one entry of a ``.distcp``): a zip archive whose
    pickles name only allowed globals; or a legacy / raw pickle, scanned the same way."""
    head = stream.read(4)
    stream.seek(0)
    try:
        names = (
            _zip_globals(stream) if head == ZIP_MAGIC else [n for p in _pickles_in(stream, length) for n in p]
        )
    except (zipfile.BadZipFile, ValueError, EOFError, OSError) as e:
        return f"{what} is not a readable torch.save archive nor a pickle ({type(e).__name__})"
    bad = [n for n in names if n not in ALLOWED]
    return _refusal(bad, what) if bad else None


def _dcp_entries(meta_file: Path) -> dict[str, list[tuple[int, int, Any]]]:
    """``relative file -> [(offset, length, transforms)]`` of a distributed checkpoint, from its
    ``.metadata`` read by :class:`RestrictedUnpickler` with stand-ins for the allowed classes (no torch
    import, nothing of the file's choosing constructed)."""
    with open(meta_file, "rb") as f:
        md = RestrictedUnpickler(f, stand_ins=True).load()
    out: dict[str, list[tuple[int, int, Any]]] = {}
    for info in dict(getattr(md, "storage_data", None) or {}).values():
        rel, off, n = (getattr(info, k, None) for k in ("relative_path", "offset", "length"))
        if not (isinstance(rel, str) and isinstance(off, int) and isinstance(n, int)):
            raise ValueError("a storage entry without file, offset and length")
        out.setdefault(rel, []).append((off, n, getattr(info, "transform_descriptors", None)))
    return out


def file_problem(root: Path, rel: str, cache: dict[str, Any] | None = None) -> str | None:
    """None, or why file ``rel`` of checkpoint ``root`` may not be loaded: a pickle in it names a global
    off the allow-list (or one computed at load time), or it cannot be read as what its name says.
    ``cache`` keeps a directory's distributed-checkpoint metadata between the files of one check."""
    f = Path(root) / rel
    if f.name.endswith(NOT_PICKLES):
        return None
    cache = {} if cache is None else cache
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            if f.name == DCP_METADATA_FILE:
                if fh.read(4) == ZIP_MAGIC:  # torch would fail on it; the classes it holds are the news
                    fh.seek(0)
                    return _torch_blob_problem(fh, size, "a pickle in it") or "is a zip archive, not a pickle"
                fh.seek(0)
                bad = [n for n in pickle_globals(fh) if n not in DCP_METADATA]
                return _refusal(bad, "the distributed-checkpoint metadata") if bad else None
            problem = _torch_blob_problem(fh, size, "a pickle in it")
            if problem is not None and f.suffix == ".distcp" and "not a readable" in problem:
                problem = None  # a .distcp is entries one after another: judged entry by entry below
            if problem is not None or f.suffix != ".distcp":
                return problem
            meta_file = f.parent / DCP_METADATA_FILE
            key = str(meta_file)
            if key not in cache:
                try:
                    cache[key] = _dcp_entries(meta_file)
                except (OSError, ValueError, pickle.UnpicklingError, CheckpointError, TypeError) as e:
                    cache[key] = f"its {DCP_METADATA_FILE} is unreadable ({type(e).__name__})"
            entries = cache[key]
            if isinstance(entries, str):
                return f"cannot be checked: {entries}"
            for off, n, transforms in entries.get(f.name, []):
                what = f"its entry at byte {off}"
                if transforms:
                    return f"{what} is stored through a stream transform, which Tessera does not read"
                if off < 0 or n < 0 or off + n > size:
                    return f"{what} ({n} bytes) lies outside the file ({size} bytes)"
                problem = _torch_blob_problem(io.BufferedReader(FileWindow(fh, off, n)), n, what)  # type: ignore[arg-type]
                if problem is not None:
                    return problem
    except (ValueError, EOFError, UnicodeDecodeError) as e:
        return f"is not a readable pickle ({type(e).__name__})"
    except OSError as e:
        return f"cannot be read ({e.strerror or type(e).__name__})"
    return None


def scan_pickles(ckpt_dir: Path, files: list[str]) -> None:
    """Raise :class:`CheckpointError` naming the first of ``files`` (paths relative to ``ckpt_dir``, each
    already known to be a regular file: :func:`tessera.checkpoint.index.walk_regular`) whose pickles name
    a global off the allow-list."""
    root = Path(ckpt_dir)
    cache: dict[str, Any] = {}
    for rel in files:
        problem = file_problem(root, rel, cache)
        if problem is not None:
            raise CheckpointError(problem, field="checkpoint", value=str(root / rel), fix=FIX)


# ---- safe loads ----------------------------------------------------------------------------------------


def _resolve(name: str) -> Any:
    """The object ``module.qualname`` names: the longest importable module prefix, then attributes."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(name)


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only :data:`DCP_METADATA` (``names``) and refuses any other global
    with a :class:`CheckpointError`: how a distributed checkpoint's ``.metadata`` is read (torch's own
    reader calls ``pickle.load``). ``stand_ins``: every allowed class is replaced by an inert record of
    its arguments and state (the static scan, which imports no torch)."""

    def __init__(
        self, f: IO[bytes], *, names: tuple[str, ...] = DCP_METADATA, stand_ins: bool = False, where: str = ""
    ) -> None:
        super().__init__(f)
        self.names, self.stand_ins, self.where = names, stand_ins, where

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if full not in self.names:
            raise CheckpointError(
                _refusal([full], "the distributed-checkpoint metadata"),
                field="checkpoint",
                value=self.where,
                fix=FIX,
            )
        return type(full, (_StandIn,), {}) if self.stand_ins else _resolve(full)


class _StandIn:
    """Inert: keeps what the pickle hands it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        slots = None
        if isinstance(state, tuple) and len(state) == 2:
            state, slots = state
        for part in (state, slots):
            if isinstance(part, dict):
                self.__dict__.update(part)


_TORCH_ALLOWS = ("torch", "collections", "builtins", "_codecs")
_NEEDED: set[str] = set()  # allowed names a file asked for whose package was not loaded yet


def _allowed_objects() -> list[Any]:
    """The objects of :data:`ALLOWED` that torch does not allow by itself, for ``safe_globals``: those
    whose package is loaded (a DeepSpeed checkpoint is usually read by code that imported DeepSpeed), and
    any that a file asked for before (:func:`safe_torch_load` imports it then and tries again)."""
    out = []
    for name in ALLOWED:
        if name.split(".")[0] in _TORCH_ALLOWS:
            continue  # torch's weights_only unpickler allows these itself
        if name.split(".")[0] in sys.modules or name in _NEEDED:
            try:
                out.append(_resolve(name))
            except (ImportError, AttributeError):
                pass
    return out


_GLOBAL_RE = re.compile(r"GLOBAL ([\w.<>]+)|global '?([\w.<>]+)")


def _refused_names(error: Exception, source: Any) -> list[str]:
    """What a refused load needed: every global off the allow-list by the static scan of ``source`` (a
    file), else the one torch's message names, else torch's reason."""
    if isinstance(source, (str, Path)):
        try:
            with open(source, "rb") as f:
                problem = _torch_blob_problem(f, os.fstat(f.fileno()).st_size, "")
        except OSError:
            problem = None
        if problem is not None and " needs " in problem:
            return re.split(r", | and ", problem.split(" needs ", 1)[1].split(", which ", 1)[0])
    m = _GLOBAL_RE.search(str(error))
    if m:
        return [m.group(1) or m.group(2)]
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    reason = next((ln for ln in lines if ln.startswith("Unsupported")), lines[-1] if lines else "?")
    return [f"a construct the weights-only loader refuses ({reason[:120]})"]


@contextlib.contextmanager
def _refusing(where: str, source: Any = None) -> Iterator[None]:
    """A refused or unreadable torch load of ``where`` as a :class:`CheckpointError` naming the file and,
    for a refusal, the classes it needed."""
    try:
        yield
    except pickle.UnpicklingError as e:
        names = _refused_names(e, source)
        raise CheckpointError(
            _refusal(names, "a pickle in it"), field="checkpoint", value=where, fix=FIX
        ) from None
    except (RuntimeError, EOFError, ValueError, zipfile.BadZipFile) as e:
        raise CheckpointError(
            f"not a readable torch.save file ({type(e).__name__}: {str(e).strip()[:120]})",
            field="checkpoint",
            value=where,
            fix=FIX,
        ) from None


def safe_torch_load(path: Path | str | IO[bytes], *, where: str | None = None, **kwargs: Any) -> Any:
    """``torch.load(path, weights_only=True, **kwargs)`` with :data:`ALLOWED` as its safe globals: a
    pickle that names anything else is refused before it runs, as a :class:`CheckpointError` naming the
    file (``where``, for a stream) and the class."""
    import torch

    kwargs.pop("weights_only", None)
    start = path.tell() if hasattr(path, "tell") else None
    with _refusing(where or str(path), path):
        while True:
            try:
                with torch.serialization.safe_globals(_allowed_objects()):
                    return torch.load(path, weights_only=True, **kwargs)
            except pickle.UnpicklingError as e:
                # an allowed class whose package is not loaded yet: import it and load again
                m = _GLOBAL_RE.search(str(e))
                name = (m.group(1) or m.group(2)) if m else None
                if name not in ALLOWED or name in _NEEDED:
                    raise
                _NEEDED.add(name)
                if start is not None:
                    path.seek(start)  # type: ignore[union-attr]


def _file_mappings() -> list[tuple[int, int]] | None:
    """(start, end) of every file-backed mapping of this process, sorted; None where /proc is missing."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    out = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            start, end = fields[0].split("-")
            out.append((int(start, 16), int(end, 16)))
    return sorted(out)


def into_memory(state: Any, reuse: Iterable[Any] = ()) -> int:
    """Copy every CPU tensor of ``state`` (nested dicts, lists, tuples) that maps a file into this
    process's own memory, in place (``Tensor.set_``: every holder of the tensor sees the copy); returns
    the bytes copied. A tensor of ``torch.load(mmap=True)`` that an optimizer keeps as its state maps the
    checkpoint file for the rest of the run: the file's blocks stay allocated on disk after the checkpoint
    is pruned, and the next save reads them back from disk. Where /proc is missing, every CPU tensor is
    copied.

    ``reuse``: tensors nobody holds any more (the state the load replaced), each taken at most once as
    the destination of a mapped tensor of its shape and dtype. Their pages are already in memory: a copy
    into them runs at memory speed (~13 GB/s on the test bed), a copy into new memory at page-fault
    speed (2-3 GB/s), the larger part of a resume's time after the reads."""
    import bisect

    import torch

    pool: dict[tuple[Any, ...], list[Any]] = {}
    for t in reuse:
        if torch.is_tensor(t) and t.device.type == "cpu" and t.is_contiguous():
            pool.setdefault((tuple(t.shape), t.dtype), []).append(t)

    maps = _file_mappings()
    starts = [a for a, _ in maps] if maps is not None else []
    seen: set[int] = set()
    copied = 0

    def mapped(t: torch.Tensor) -> bool:
        if maps is None:
            return True
        i = bisect.bisect_right(starts, t.data_ptr()) - 1
        return i >= 0 and t.data_ptr() < maps[i][1]

    def walk(obj: Any) -> None:
        nonlocal copied
        if torch.is_tensor(obj):
            if obj.device.type == "cpu" and id(obj) not in seen and obj.numel() and mapped(obj):
                seen.add(id(obj))
                spare = pool.get((tuple(obj.shape), obj.dtype))
                with torch.no_grad():
                    if spare and obj.is_contiguous():
                        into = spare.pop()
                        into.copy_(obj)
                        obj.set_(into)
                    else:
                        obj.set_(obj.clone())
                copied += obj.numel() * obj.element_size()
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)

    walk(state)
    return copied


@contextlib.contextmanager
def forced_weights_only(where: Path | str) -> Iterator[None]:
    """Every ``torch.load`` in this block loads with ``weights_only=True`` and the allow-list, even one
    that asks for ``weights_only=False``: for a library function that loads a file itself and takes no
    loader (DeepSpeed's ``zero_to_fp32.parse_model_states``). It sets torch's own switch for that,
    ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``, for the block only (single-threaded callers: the CLI's readers).
    A load that does not say otherwise also maps a zip-format file (torch's ``serialization.config.load.mmap``):
    ``parse_model_states`` keeps the buffers and shapes of a model-states file that holds the whole
    module, which a plain load would read whole (0.8 GB of a 1.2 GB model's export at its peak)."""
    import torch
    from torch.utils.serialization import config

    key = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
    before, mapped = os.environ.get(key), config.load.mmap
    os.environ[key] = "1"
    config.load.mmap = Path(where).is_file() and zipfile.is_zipfile(where)  # torch maps zip archives only
    try:
        with _refusing(str(where), where), torch.serialization.safe_globals(_allowed_objects()):
            yield
    finally:
        config.load.mmap = mapped
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


@functools.cache
def dcp_reader_class() -> type:
    """torch's distributed-checkpoint file reader (megatron-core's caching one) whose ``.metadata`` is
    read by :class:`RestrictedUnpickler` instead of ``pickle.load``."""
    from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
        CachedMetadataFileSystemReader,
    )
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(CachedMetadataFileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if self._cached_metadata is None:
                path = self._get_metadata_path(kwargs.get("rank"))
                with self.fs.create_stream(path, "rb") as f:
                    md = RestrictedUnpickler(f, where=str(path)).load()
                if getattr(md, "storage_meta", None) is None:  # as torch's reader completes it
                    md.storage_meta = StorageMeta()
                md.storage_meta.load_id = self.load_id
                self._cached_metadata = md
            return self._cached_metadata

    return SafeFileSystemReader
