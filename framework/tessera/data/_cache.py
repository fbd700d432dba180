"""Content hashes and crash/race-safe writes for the data cache.

Several ranks call :func:`tessera.data.prepare_data` at the same moment on a shared cache directory.
Two rules keep that safe without any coordination between ranks:

* nothing is ever written in place: a file or directory is built under a temporary name in the same
  parent and then renamed, so a reader sees either nothing or a complete entry (a killed writer leaves
  only a ``.tmp-*`` leftover that no one reads);
* a per-entry lock file lets one process build while the others wait and then read its result; the lock
  only saves work, correctness comes from the rename (a filesystem without ``flock`` still works).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tessera.atomic import sha256_file, sha256_json

try:  # POSIX only; without it every rank simply builds and the first rename wins.
    import fcntl
except ImportError:  # pragma: no cover - Windows is not a training platform for us
    fcntl = None  # type: ignore[assignment]


def sha256_dir(path: Path, names: list[str] | None = None) -> str:
    """Hash of the regular files of a directory (or of ``names`` in it), sorted by name.

    Each file contributes its name and its content hash, so renaming a file changes the result too.
    """
    if names is None:
        names = [p.name for p in path.iterdir() if p.is_file()]
    entries = [[name, sha256_file(path / name)] for name in sorted(names)]
    return sha256_json(entries)


@contextlib.contextmanager
def build_lock(target: Path) -> Iterator[None]:
    """Hold an exclusive lock named after ``target`` while it is being built.

    Waiting ranks re-check for the finished entry after they get the lock, so only the first one pays
    for tokenizer training or tokenization.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{target.name}.lock"
    with open(lock_path, "a+b") as handle:
        if fcntl is not None:
            # A filesystem without flock support raises here: fall back to racing renames.
            with contextlib.suppress(OSError):
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        yield


def _temp_name(target: Path) -> Path:
    """A unique hidden name beside ``target`` (same filesystem, so the final rename is atomic)."""
    return target.parent / f".tmp-{target.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def temp_dir_beside(target: Path) -> Path:
    """A fresh empty directory in ``target``'s parent.

    ``os.mkdir`` rather than ``tempfile.mkdtemp``: mkdtemp makes it 0700, which would lock other users
    of a shared cache out of the published entry; mkdir honours the umask.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_name(target)
    tmp.mkdir()
    return tmp


def publish_dir(tmp: Path, target: Path) -> Path:
    """Rename a fully written ``tmp`` directory to ``target``; if another process got there first,
    drop ours and keep theirs (both were built from the same inputs)."""
    try:
        os.rename(tmp, target)
    except OSError:
        if not target.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def atomic_torch_save(obj: Any, target: Path) -> None:
    """``torch.save`` to a temp file beside ``target``, fsync, then ``os.replace`` onto it."""
    import torch

    from tessera.atomic import atomic_file

    with atomic_file(target) as f:
        torch.save(obj, f)


def randperm(n: int, seed: int, cache: Path | None = None) -> Any:
    """``torch.randperm(n)`` drawn from a generator seeded with ``seed``, as a numpy array (int32 below
    2**31 rows: the same draws as int64, half the bytes).

    With ``cache`` (a directory) it is saved there once as ``randperm-N-SEED.npy`` and mapped, as
    megatron-core's ``GPTDataset`` caches and maps its shuffle index: a rank then holds only the pages of
    the rows it reads. Held in memory it would be the one term of a rank's memory that grows with the
    corpus (4 bytes a row: 35 MB at 2 GB of text). Written by hand because megatron's shuffle index is a
    numpy ``RandomState`` permutation of its own sample index, not the torch permutation our sampler
    position and its resumes are defined by. Several ranks may write it at once: each writes a temporary
    and renames it, the content is the same.
    """
    import numpy as np
    import torch

    from tessera.atomic import atomic_file

    path = None if cache is None else Path(cache) / f"randperm-{n}-{seed}.npy"
    if path is not None and path.is_file():
        return np.load(path, mmap_mode="r")
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=gen, dtype=torch.int32 if n < 2**31 else torch.int64).numpy()
    if path is None:
        return perm
    with atomic_file(path) as f:
        np.save(f, perm)
    del perm
    return np.load(path, mmap_mode="r")
