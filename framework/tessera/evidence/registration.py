"""The comparison directory before any run: claimed for one ``tessera compare`` (exclusively, with a lock
that names the compare holding it) and the pre-registration written into it, whose hash every run's
manifest and the verdict quote (:mod:`tessera.evidence.compare` judges the runs afterwards)."""

from __future__ import annotations

import datetime
import fcntl
import json
import os
from pathlib import Path
from types import TracebackType
from typing import Any

from tessera.atomic import sha256_bytes, write_text_atomic
from tessera.errors import TesseraError

PREREGISTRATION = "preregistration.json"
PREREGISTRATION_SHA = "preregistration.sha256"
VERDICT = "verdict.json"
REPORT = "report.md"
#: the claim on a comparison directory: created exclusively (O_EXCL) and flock-ed while its comparison
#: runs; it stays after (pid and start time of the compare that made the directory)
CLAIM = "compare.lock"


# ---- the comparison directory ---------------------------------------------------------------------------


class ComparisonClaim:
    """``--out`` claimed for one ``tessera compare``: see :func:`claim_comparison_dir`."""

    def __init__(self, out: Path, fd: int, created: bool) -> None:
        self.out, self._fd, self._created = out, fd, created

    def __enter__(self) -> ComparisonClaim:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release(failed=kind is not None)

    def release(self, *, failed: bool = False) -> None:
        """Unlock. A compare that failed before registering anything leaves no trace: the claim (and
        the directory, if this compare made it) is removed so the same --out can be used again."""
        if self._fd < 0:
            return
        try:
            if failed and not (self.out / PREREGISTRATION).exists():
                (self.out / CLAIM).unlink(missing_ok=True)
                if self._created:
                    try:
                        os.rmdir(self.out)  # only if still empty
                    except OSError:
                        pass
        finally:
            os.close(self._fd)  # drops the flock
            self._fd = -1


def claim_comparison_dir(out: Path) -> ComparisonClaim:
    """Claim ``out`` for one comparison, or refuse (exit 2) naming it and the fix.

    Rule: ``--out`` is a new directory, or an existing empty one; any other existing path is refused -
    a finished or running comparison by name (its pre-registration and verdict are never overwritten),
    anything else as "not empty". Race-free: the claim file is created with O_EXCL, so of two compares
    started at once on one ``--out`` exactly one proceeds (the check "is it empty?" alone would let both
    through). The claim is flock-ed while the comparison runs, so a refusal can say whether another
    compare is writing there now."""
    out = Path(out)
    created = False
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(out)
        created = True
    except FileExistsError:
        pass
    except OSError as e:
        raise TesseraError(
            f"cannot create the comparison directory ({e.strerror})",
            field="--out",
            value=str(out),
            fix="give a path where a new directory can be made",
        ) from None
    if not created:
        if out.is_symlink() or not out.is_dir():
            raise TesseraError(
                "--out exists and is not a directory" + (" (a symlink)" if out.is_symlink() else ""),
                field="--out",
                value=str(out),
                fix="give the path of a new directory",
            )
        if any(os.scandir(out)):
            raise _occupied(out)
    try:
        fd = os.open(out / CLAIM, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except FileExistsError:  # another compare claimed it between our check and now
        raise _occupied(out) from None
    fcntl.flock(fd, fcntl.LOCK_EX)  # a prober holds it for an instant only
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    os.write(fd, f"pid {os.getpid()} started {stamp}\n".encode())
    return ComparisonClaim(out, fd, created)


def _claimed_by_running(out: Path) -> str | None:
    """The claim's text when another compare holds it now (its flock is taken), else None."""
    try:
        fd = os.open(out / CLAIM, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.read(fd, 200).decode(errors="replace").strip() or "a process that just started"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _occupied(out: Path) -> TesseraError:
    fix = (
        "give a new directory with --out (a comparison's pre-registration, runs and verdict are never "
        "reused or overwritten)"
    )
    running = _claimed_by_running(out)
    names = sorted(os.listdir(out))
    if running is not None:
        what = f"another tessera compare is writing into it now ({running}, see {CLAIM})"
    elif PREREGISTRATION in names and VERDICT in names:
        what = "it holds a finished comparison (preregistration.json and verdict.json)"
    elif PREREGISTRATION in names:
        what = "it holds a pre-registered comparison without a verdict (stopped before its verdict)"
    elif names == [CLAIM]:  # a compare starting this instant, or one killed before it registered
        what = f"it holds the claim of another tessera compare ({CLAIM}), starting or killed before it registered"
    else:
        shown = ", ".join(names[:5]) + (f", ... ({len(names)} entries)" if len(names) > 5 else "")
        what = f"it is not empty ({shown})"
    return TesseraError(f"the comparison directory is taken: {what}", field="--out", value=str(out), fix=fix)


# ---- pre-registration --------------------------------------------------------------------------------


def preregister(out: Path, record: dict[str, Any]) -> str:
    """Write ``preregistration.json`` (canonical JSON) and ``preregistration.sha256`` (``sha256sum -c``
    format) before any run starts; returns the hash the runs' manifests and the report quote. An
    existing pre-registration is never replaced."""
    out.mkdir(parents=True, exist_ok=True)
    if (out / PREREGISTRATION).exists() or (out / PREREGISTRATION_SHA).exists():
        raise _occupied(out)
    text = json.dumps(record, indent=2, sort_keys=True) + "\n"
    sha = sha256_bytes(text.encode())
    write_text_atomic(out / PREREGISTRATION, text)
    write_text_atomic(out / PREREGISTRATION_SHA, f"{sha}  {PREREGISTRATION}\n")
    return sha


def read_preregistration(out: Path) -> tuple[dict[str, Any], str]:
    """The registered record and its hash, refused if the file changed since it was written."""
    path, sha_file = out / PREREGISTRATION, out / PREREGISTRATION_SHA
    if not path.is_file() or not sha_file.is_file():
        raise TesseraError(
            "no pre-registration in the comparison directory",
            field="--out",
            value=str(out),
            fix="run `tessera compare` to register thresholds before the runs",
        )
    sha = sha256_bytes(path.read_bytes())
    if sha != sha_file.read_text().split()[0]:
        raise TesseraError(
            "preregistration.json changed after it was registered: thresholds cannot change after the runs start",
            field=PREREGISTRATION,
            value=sha,
            fix="restore the registered file, or run a new comparison with the new thresholds",
        )
    return json.loads(path.read_text()), sha
