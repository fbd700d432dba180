"""How Tessera writes a file, and content hashes: the one home of both (the run directory, checkpoints and
the data cache use them).

Three rules hold for every file Tessera writes in a run or checkpoint directory:

- **Atomic.** A reader sees the old content or the new one, never a torn file: the bytes go to a fresh
  temporary name beside the target (same file system), are fsynced, and are renamed over the target.
- **Never through a link.** The temporary is created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (a link
  planted at its name is refused, not followed), and ``rename`` replaces a link at the target itself,
  never the file it points to. Files that are appended to or locked in place (``metrics.jsonl``,
  ``comm.jsonl``, a rank's log, ``run.lock``) are opened with ``O_NOFOLLOW``: a link, a FIFO or a device
  there is refused with an error naming the file (:class:`UnsafeFile`), before anything is written.
- **A full disk is one clear error.** ``ENOSPC``, ``EDQUOT`` and ``EROFS`` while writing become
  :class:`DiskFull` (a :class:`~tessera.errors.TesseraError`: exit code 2) naming the file, and the
  temporary is removed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, BinaryIO

from tessera.errors import TesseraError

_CHUNK = 4 << 20

#: the write errors that mean "this file system takes no more bytes"
DISK_ERRNOS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
}


class DiskFull(TesseraError):
    """A write that the file system refused for lack of room (or because it is read-only)."""

    def __init__(self, path: Path, err: OSError) -> None:
        self.path = Path(path)
        self.errno = err.errno
        self.reason = f"{DISK_ERRNOS[err.errno]} ({errno.errorcode[err.errno]})"
        fix = (
            "remount it writable, or point run.out_dir at a writable disk"
            if err.errno == errno.EROFS
            else "free space (or quota) on that file system, or move run.out_dir to a larger disk; "
            "then continue with --resume"
        )
        super().__init__(f"{self.reason} while writing {self.path}", fix=fix)


class UnsafeFile(TesseraError):
    """A file Tessera would write is a symbolic link, a FIFO, a socket or a device."""

    def __init__(self, path: Path, what: str) -> None:
        self.path = Path(path)
        super().__init__(
            f"{self.path} is {what}, where Tessera keeps a regular file (it never writes through a link, "
            "nor reads a FIFO or a device)",
            fix=f"remove it (rm {self.path}), or point run.out_dir at a directory of your own",
        )


def disk_error(exc: BaseException | None) -> str | None:
    """``ENOSPC`` / ``EDQUOT`` / ``EROFS`` when ``exc`` or anything in its chain is that write error."""
    seen = exc
    while seen is not None:
        if isinstance(seen, DiskFull) and seen.errno is not None:
            return errno.errorcode[seen.errno]
        if isinstance(seen, OSError) and seen.errno in DISK_ERRNOS:
            return errno.errorcode[seen.errno]
        seen = seen.__cause__ or seen.__context__
    return None


def _link_target(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"


def refuse_link(path: Path) -> None:
    """An error naming ``path`` when it is a symbolic link (a file appended to is never one)."""
    if Path(path).is_symlink():
        raise UnsafeFile(path, f"a symbolic link (to {_link_target(Path(path))})")


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """Turn the OS errors of writing ``path`` that a user can fix into errors naming it: a link where
    the file goes (``ELOOP`` from ``O_NOFOLLOW``) and a full, over-quota or read-only file system."""
    try:
        yield
    except OSError as e:
        if e.errno == errno.ELOOP:
            refuse_link(path)
        if e.errno in DISK_ERRNOS:
            raise DiskFull(path, e) from e
        raise


def file_kind(mode: int) -> str:
    """What a ``stat`` / ``lstat`` mode is, in words ("a regular file", "a directory", "a symbolic link",
    "a FIFO", ...): the one wording of every refusal of a file that is not what Tessera expects."""
    for test, what in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return what
    return "a special file"


def open_regular(path: Path, flags: int, mode: int = 0o666) -> int:
    """``os.open`` of a regular file that is never a link (``O_NOFOLLOW``) and never blocks on a FIFO
    (opened non-blocking, checked, then switched back); returns the descriptor."""
    path = Path(path)
    with writing(path):
        try:
            fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
        except OSError as e:
            if e.errno == errno.ENXIO:  # a FIFO opened for writing with no reader
                raise UnsafeFile(path, "a FIFO") from None
            raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(path, file_kind(st.st_mode))
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_append(path: Path, *, binary: bool = False) -> IO[Any]:
    """``path`` opened for appending (created if absent), refusing a link or a non-regular file. Text
    files are line-buffered. A write to it that finds the disk full raises ``OSError``: wrap writes in
    :func:`writing` where that must be a clear error."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    return os.fdopen(fd, "ab") if binary else os.fdopen(fd, "a", buffering=1)


def open_lock(path: Path) -> IO[str]:
    """``path`` opened read-write for a lock file that names its holder (created if absent, never
    truncated here, never a link)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.fdopen(open_regular(path, os.O_RDWR | os.O_CREAT), "r+")


def read_regular(path: Path) -> bytes:
    """The bytes of a regular file (a FIFO or a device is refused, never read: it could block forever or
    never end)."""
    path = Path(path)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    with open(fd, "rb", closefd=True) as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(path, file_kind(st.st_mode))
        return f.read()


@contextlib.contextmanager
def atomic_file(path: Path, *, durable: bool = True) -> Iterator[BinaryIO]:
    """A binary file object whose bytes replace ``path`` atomically when the block ends (and only
    then): written to a new temporary beside it (``O_EXCL | O_NOFOLLOW``), fsynced (``durable``), renamed
    over ``path`` (which replaces a link there, never its target). On any error the temporary is removed;
    a full disk is :class:`DiskFull`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        try:
            with os.fdopen(fd, "wb") as f:
                yield f  # type: ignore[misc]
                f.flush()
                if durable:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def write_bytes_atomic(path: Path, data: bytes, *, durable: bool = True) -> None:
    with atomic_file(path, durable=durable) as f:
        f.write(data)


def write_text_atomic(path: Path, text: str, *, durable: bool = True) -> None:
    write_bytes_atomic(path, text.encode(), durable=durable)


def json_text(obj: Any) -> str:
    """How Tessera writes a JSON file: indented, keys sorted, a newline at the end."""
    return json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n"


def write_json_atomic(path: Path, obj: Any) -> None:
    write_text_atomic(path, json_text(obj))


class Beside:
    """One helper thread that runs work beside the caller: a file's bytes are hashed while the caller
    writes or reads the next ones (hashlib and file I/O both release the GIL), so a checkpoint file costs
    max(hash, I/O), not their sum. Made by the thread that uses it, whose priority its thread inherits (a
    background writer's lowest one)."""

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tessera-hash")

    def start(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on the helper thread; its future."""
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def sha256_file(path: Path, *, sync: bool = False) -> str:
    """Hex sha256 of a file's bytes, read in chunks so large files never sit in memory; a chunk is hashed
    while the next is read (two buffers, :class:`Beside`). ``sync``: also flush the file's data to disk (a
    file written through the page cache - ``torch.save``, safetensors - is durable only after an fsync)."""
    return _hash_file(path, hashlib.sha256(), sync=sync)


def _hash_file(path: Path, h: Any, *, sync: bool) -> str:
    with open(path, "rb", buffering=0) as f:
        first = f.read(_CHUNK)
        if len(first) == _CHUNK:  # more than one chunk: overlap the reads and the hash
            hasher, bufs, hashing = Beside(), (bytearray(_CHUNK), bytearray(_CHUNK)), None
            try:
                hashing = hasher.start(h.update, first)
                turn = 0
                while n := f.readinto(bufs[turn]):  # the buffer the hash is not reading
                    hashing.result()
                    hashing = hasher.start(h.update, memoryview(bufs[turn])[:n])
                    turn ^= 1
                hashing.result()
            finally:
                hasher.close()
        else:
            h.update(first)
        if sync:
            os.fsync(f.fileno())
    return str(h.hexdigest())


#: the checksum of a checkpoint's files in its meta.json. BLAKE3 (``b3sum`` checks it): hashed at 3.5-5 GB/s
#: on one core of the test bed where sha256 runs at 1.8, and a save hashes every byte it writes, so with
#: sha256 the hash, not the disk, set a save's speed. Checkpoints whose meta.json records ``sha256`` are
#: still verified by it.
CHECKSUM = "blake3"


def checksum_hasher(*, every_core: bool = False) -> Any:
    """A new hasher of :data:`CHECKSUM` (``update`` / ``hexdigest``; it releases the GIL on large
    blocks). ``every_core``: each block hashed on all cores (BLAKE3 is a tree hash: the same digest)."""
    import blake3

    return blake3.blake3(max_threads=blake3.blake3.AUTO if every_core else 1)


def checksum_file(path: Path, *, sync: bool = False) -> str:
    """Hex :data:`CHECKSUM` of a file's bytes, as :func:`sha256_file` reads them, each chunk hashed on
    every core."""
    return _hash_file(path, checksum_hasher(every_core=True), sync=sync)


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
