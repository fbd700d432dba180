"""Finding and checking checkpoints without loading them (no torch: ``tessera run`` does this before
it launches the ranks): the directory names, ``meta.json``, the ``latest`` pointer, and the verification
of every file against its recorded size and sha256. Saving and loading are :mod:`tessera.checkpoint.manager`.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from tessera.atomic import sha256_file
from tessera.errors import CheckpointError
from tessera.rundir import RunDir

FORMAT = "tessera-checkpoint"
FORMAT_VERSION = 2
#: ``step_NNNNNN``, or ``step_NNNNNN-<layout>`` for a checkpoint resharded to another layout at that step
STEP_RE = re.compile(r"^step_(\d{6,})(?:-[a-z0-9][a-z0-9-]*)?$")
META = "meta.json"
LATEST = "latest"
MANIFEST = RunDir.MANIFEST  # the run's manifest, copied into every checkpoint
FIX = "resume from an earlier checkpoint (tessera run R.yaml --resume-from checkpoints/step_N), or restore this one from a copy"


def step_dir_name(step: int, tag: str | None = None) -> str:
    return f"step_{step:06d}" + (f"-{tag}" if tag else "")


# ---- reading and verifying -------------------------------------------------------------------------


def read_meta(path: Path) -> dict[str, Any]:
    """``meta.json`` of checkpoint directory ``path``; anything unreadable is an error naming it."""
    meta_path = Path(path) / META
    if not meta_path.is_file():
        raise CheckpointError(
            "checkpoint is incomplete (no meta.json)", field="checkpoint", value=str(meta_path), fix=FIX
        )
    try:
        meta = json.loads(meta_path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"meta.json is not valid JSON ({type(e).__name__})",
            field="checkpoint",
            value=str(meta_path),
            fix=FIX,
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
            fix=FIX,
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
            f"checkpoint verification failed: {why}{more}", field="checkpoint", value=file, fix=FIX
        )


def verify_or_raise(path: Path) -> dict[str, Any]:
    """Single-process verification of every file (the CLI, before launch; tools)."""
    meta, problems = verify_checkpoint(path)
    raise_problems(problems)
    return meta


class CheckpointIndex:
    """The complete checkpoints of one run directory (``<run_dir>/checkpoints``) and which one a resume
    reads."""

    def __init__(self, root: Path, *, rank: int = 0, world_size: int = 1) -> None:
        self.root = Path(root)
        self.rank = rank
        self.world_size = world_size

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

    def verify(self, path: Path, *, any_world: bool = False) -> dict[str, Any]:
        """Check ``path`` before anything loads it, and (unless ``any_world``: it is to be resharded) that
        it was written by ``world_size`` ranks; returns its meta. This process hashes every file (the CLI
        before launch); the ranks share the hashing (:class:`~tessera.checkpoint.manager.CheckpointManager`)."""
        meta, problems = self._verify_files(path)
        raise_problems(problems)
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

    def _verify_files(self, path: Path) -> tuple[dict[str, Any], list[str]]:
        return verify_checkpoint(path)
