"""Atomic writes and content hashes: the one home of both (the data cache, checkpoints and the run
directory use them).

A reader of a file written here sees the old content or the new one, never a torn file: the bytes go to a
temporary name in the same directory, are fsynced, and are renamed over the target (atomic on one file
system).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

_CHUNK = 1 << 20


def write_bytes_atomic(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_text_atomic(path: Path, text: str) -> None:
    write_bytes_atomic(path, text.encode())


def write_json_atomic(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def sha256_file(path: Path, *, sync: bool = False) -> str:
    """Hex sha256 of a file's bytes, read in chunks so large files never sit in memory. ``sync``: also
    flush the file's data to disk (a file written through the page cache - ``torch.save``, safetensors -
    is durable only after an fsync)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
        if sync:
            os.fsync(f.fileno())
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename into it, a new file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_json(obj: Any) -> str:
    """Hex sha256 of a canonical JSON encoding, so that key order never changes a hash."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(blob.encode()).hexdigest()
