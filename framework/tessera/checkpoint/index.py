"""Finding and checking checkpoints without loading them (no torch: ``tessera run`` does this before
it launches the ranks): the directory names, ``meta.json``, the ``latest`` pointer, and the verification
of every file against its recorded size and checksum. Saving and loading are :mod:`tessera.checkpoint.manager`.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tessera.atomic import CHECKSUM, checksum_file, file_kind, sha256_file
from tessera.errors import CheckpointError, preview
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


# ---- the schema of meta.json ---------------------------------------------------------------------------

MAX_META_BYTES = 64 << 20  # one entry per file: far above any real checkpoint's, far below a memory problem
_Count = Annotated[int, Field(ge=1)]
_NonNegative = Annotated[int, Field(ge=0)]


class _Strict(BaseModel):
    # strict: a string, float or bool where a count belongs is refused, never coerced; unknown keys pass
    # (a newer release of the same format may add some)
    model_config = ConfigDict(strict=True, extra="allow")


_Hex64 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
#: the checksums a file entry may carry, each with its function: BLAKE3 (what Tessera writes) and sha256
#: (what checkpoints written before it record)
CHECKSUMS = {CHECKSUM: checksum_file, "sha256": sha256_file}


class FileEntry(_Strict):
    """One file of the checkpoint: where (relative, inside it), its size, its checksum (v2)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    path: str
    bytes: _NonNegative
    sha256: _Hex64 | None = None
    blake3: _Hex64 | None = None

    @field_validator("path")
    @classmethod
    def _inside(cls, v: str) -> str:
        if not v or v.startswith("/") or ".." in Path(v).parts or v == META or "\x00" in v:
            raise ValueError(
                "is not a valid relative path inside the checkpoint (no '..', not absolute, not meta.json)"
            )
        return v


class FileEntryV2(FileEntry):
    @model_validator(mode="after")
    def _one_checksum(self) -> FileEntryV2:
        if (self.sha256 is None) == (self.blake3 is None):
            raise ValueError(f"must carry exactly one checksum, {' or '.join(CHECKSUMS)}")
        return self


class LayoutRecord(_Strict):
    """The layout that wrote the checkpoint (``ParallelLayout.to_dict``): degrees and sizes are counts."""

    dp: _Count | None = None
    tp: _Count | None = None
    pp: _Count | None = None
    vpp: _Count | None = None
    ep: _Count | None = None
    etp: _Count | None = None
    micro_batch: _Count | None = None
    grad_accum: _Count | None = None
    global_batch: _Count | None = None
    world_size: _Count | None = None
    zero: Annotated[int, Field(ge=0, le=3)] | None = None
    engine: str | None = None
    zero_impl: str | None = None
    recompute: str | None = None
    offload_optimizer: bool | None = None
    offload_params: bool | None = None
    sequence_parallel: bool | None = None


class SamplerRecord(_Strict):
    """The sampler's layout-free position (:meth:`tessera.data.sampler.DistributedSampler.state_dict`)."""

    epoch: _NonNegative | None = None
    step_in_epoch: _NonNegative | None = None
    consumed_samples: _NonNegative | None = None
    num_samples: _NonNegative | None = None
    seed: _NonNegative | None = None
    global_batch: _Count | None = None


class MetaV2(_Strict):
    format: Literal["tessera-checkpoint"] = FORMAT
    format_version: Literal[2]
    step: _NonNegative
    world_size: _Count
    engine: str
    sharding: str
    layout: LayoutRecord
    sampler: SamplerRecord
    files: list[FileEntryV2]
    precision: str | None = None
    # model_config (the HF config) is checked by meta_problem: pydantic keeps that name for itself
    tokenizer_hash: str | None = None
    data_fingerprint: dict[str, Any] | None = None


class ClientStateV1(_Strict):
    sampler: SamplerRecord


class MetaV1(_Strict):
    step: _NonNegative
    world_size: _Count
    files: list[FileEntry]
    client_state: ClientStateV1


#: format_version -> (its schema, the keys without which it is no Tessera checkpoint description)
_SCHEMAS: dict[int | None, tuple[type[_Strict], tuple[str, ...]]] = {
    None: (MetaV1, ("step", "world_size", "files", "client_state")),
    FORMAT_VERSION: (MetaV2, ("step", "world_size", "files", "engine", "sharding", "layout", "sampler")),
}


def meta_problem(meta: Any) -> tuple[str, str | None] | None:
    """None, or (what is wrong with a parsed meta.json naming the field, a fix or None) : its version
    first (a newer one is named as such), then the keys a checkpoint description needs, then each
    field's type and range (strict: ``"6"`` and ``true`` are no step counts)."""
    if not isinstance(meta, dict):
        return (
            f"meta.json holds a JSON {type(meta).__name__}, not an object: not a Tessera checkpoint description",
            None,
        )
    version = meta.get("format_version")
    if "format_version" in meta and (type(version) is not int or version not in _SCHEMAS):
        if type(version) is int and version > FORMAT_VERSION:
            return (
                f'meta.json field "format_version" = {version}: written by a newer Tessera (checkpoint '
                f"format {version}; this Tessera reads formats 1-{FORMAT_VERSION})",
                "upgrade Tessera to read it, or resume it with the release that wrote it",
            )
        return (
            f'meta.json field "format_version" = {preview(version)}: not a checkpoint format Tessera '
            f"knows (1-{FORMAT_VERSION}; 1 has no format_version)",
            None,
        )
    schema, need = _SCHEMAS[version if "format_version" in meta else None]
    missing = [k for k in need if k not in meta]
    if missing:
        return f"meta.json lacks {', '.join(missing)}: not a Tessera checkpoint description", None
    try:
        record = schema.model_validate(meta)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        return (
            f'meta.json field "{loc}" = {preview(err.get("input"), 120)}: {msg[:1].lower() + msg[1:]}',
            None,
        )
    paths = [f.path for f in record.files]  # type: ignore[attr-defined]
    dup = next((p for p in paths if paths.count(p) > 1), None)
    if dup is not None:
        return f'meta.json field "files" lists {dup!r} twice', None
    hf = meta.get("model_config")
    if hf is not None and not isinstance(hf, dict):
        return f'meta.json field "model_config" = {preview(hf, 120)}: must be an object (the HF config)', None
    layout_world = getattr(getattr(record, "layout", None), "world_size", None)
    if layout_world is not None and layout_world != meta["world_size"]:
        return (
            f'meta.json field "world_size" = {meta["world_size"]} disagrees with layout.world_size = {layout_world}',
            None,
        )
    return None


# ---- reading and verifying -------------------------------------------------------------------------


def walk_regular(path: Path) -> list[str]:
    """Every regular file under checkpoint directory ``path``, relative and sorted, found with ``lstat``
    alone: a symbolic link (wherever it points), a FIFO, a socket or a device anywhere under it is a
    :class:`CheckpointError` naming it, raised before any file is opened (opening a FIFO blocks forever;
    a link can lead out of the checkpoint; a loader that globs the directory would open either)."""
    root = Path(path)
    out: list[str] = []
    todo = [root]
    while todo:
        d = todo.pop()
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError as e:
            raise CheckpointError(
                f"cannot list the checkpoint directory ({e.strerror})",
                field="checkpoint",
                value=str(d),
                fix=FIX,
            ) from None
        for e in entries:
            mode = e.stat(follow_symlinks=False).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                what = file_kind(mode)
                target = f" (to {os.readlink(e.path)})" if stat.S_ISLNK(mode) else ""
                raise CheckpointError(
                    f"{what}{target} inside a checkpoint; refused before anything was opened",
                    field="checkpoint",
                    value=e.path,
                    fix="a checkpoint holds only regular files: remove it (or copy the real file in its place) "
                    "and verify again",
                )
            if stat.S_ISDIR(mode):
                todo.append(Path(e.path))
            else:
                out.append(str(Path(e.path).relative_to(root)))
    return sorted(out)


def read_meta(path: Path) -> dict[str, Any]:
    """``meta.json`` of checkpoint directory ``path``, validated against its schema
    (:func:`meta_problem`); anything unreadable or invalid is an error naming it and the field."""
    meta_path = Path(path) / META
    try:
        st = meta_path.lstat()
    except FileNotFoundError:
        st = None
    if st is None or not stat.S_ISREG(st.st_mode):
        what = "no meta.json" if st is None else f"meta.json is {file_kind(st.st_mode)}"
        raise CheckpointError(
            f"checkpoint is incomplete ({what})", field="checkpoint", value=str(meta_path), fix=FIX
        )
    if st.st_size > MAX_META_BYTES:
        raise CheckpointError(
            f"meta.json is {st.st_size:,} bytes (a Tessera meta.json is well under {MAX_META_BYTES:,})",
            field="checkpoint",
            value=str(meta_path),
            fix=FIX,
        )
    try:
        meta = json.loads(meta_path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(
            f"meta.json is not valid JSON ({type(e).__name__})",
            field="checkpoint",
            value=str(meta_path),
            fix=FIX,
        ) from None
    problem = meta_problem(meta)
    if problem is not None:
        message, fix = problem
        raise CheckpointError(message, field="checkpoint", value=str(meta_path), fix=fix or FIX)
    return meta


def checkpoint_files(path: Path) -> list[str]:
    """Every regular file under a checkpoint directory except meta.json, relative and sorted; anything
    that is not a regular file or a directory is refused (:func:`walk_regular`)."""
    return [f for f in walk_regular(path) if f != META]


def share_by_bytes(files: list[tuple[str, int]], world: int) -> list[set[str]]:
    """The files each of ``world`` ranks reads: largest first, each to the rank with the fewest bytes so
    far (every rank computes the same split from the same list), so the ranks hash in parallel for about
    the same time."""
    load = [0] * world
    out: list[set[str]] = [set() for _ in range(world)]
    for name, size in sorted(files, key=lambda f: (-f[1], f[0])):
        r = load.index(min(load))
        load[r] += size
        out[r].add(name)
    return out


def verify_checkpoint(
    path: Path, *, rank: int = 0, world: int = 1, defer: list[tuple[Path, dict[str, Any]]] | None = None
) -> tuple[dict[str, Any], list[str]]:
    """Check a checkpoint against its meta.json before anything loads it: only regular files under it
    (raised at once, before any file is opened), meta.json valid, every listed file present with its
    size, nothing unlisted, and this rank's share of the files (``world`` ranks split the work): (v2) its
    checksum, then the static scan of its pickles (:func:`tessera.safeload.file_problem`: a global off the
    allow-list is refused, nothing is unpickled). Returns (meta, problems): each problem names the file;
    the caller raises. ``defer``: the share's checksums are not computed but appended to it as (file, its
    meta.json entry), for :func:`checksum_problems` later (a file whose scan fails is checksummed now: a
    corrupted file is reported as such)."""
    from tessera.safeload import file_problem

    path = Path(path)
    present = set(walk_regular(path))
    meta = read_meta(path)
    problems: list[str] = []
    v2 = meta.get("format_version") == FORMAT_VERSION
    listed = set()
    scans: dict[str, Any] = {}
    mine = share_by_bytes([(e["path"], int(e["bytes"])) for e in meta["files"]], world)[rank]
    for entry in meta["files"]:
        rel = entry["path"]  # a relative path without "..": the schema checked it
        listed.add(rel)
        f = path / rel
        if rel not in present:
            problems.append(f"{f}: missing")
            continue
        size = f.lstat().st_size
        if size != entry["bytes"]:
            problems.append(f"{f}: {size} bytes, meta.json says {entry['bytes']} (truncated or altered)")
        elif rel not in mine:
            continue
        elif v2 and defer is None and (bad := checksum_problem(f, entry)) is not None:
            problems.append(f"{f}: {bad}")
        elif (why := file_problem(path, rel, scans)) is not None:
            bad = checksum_problem(f, entry) if v2 and defer is not None else None
            problems.append(f"{f}: {bad or why}")
        elif v2 and defer is not None:
            defer.append((f, entry))
    for rel in sorted(present - listed - {META}):
        problems.append(f"{path / rel}: not listed in meta.json")
    return meta, problems


def checksum_problems(files: list[tuple[Path, dict[str, Any]]]) -> list[str]:
    """The problems of the checksums :func:`verify_checkpoint` deferred, each naming its file."""
    return [f"{f}: {bad}" for f, entry in files if (bad := checksum_problem(f, entry)) is not None]


def checksum_problem(path: Path, entry: dict[str, Any]) -> str | None:
    """None when file ``path`` has the checksum its meta.json ``entry`` records (BLAKE3, or an older
    checkpoint's sha256), else what is wrong."""
    kind = next(k for k in CHECKSUMS if entry.get(k) is not None)  # the schema requires one
    if CHECKSUMS[kind](path) != entry[kind]:
        return f"{kind} does not match meta.json (the file was altered or corrupted)"
    return None


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
        found = [
            p
            for p in self.root.iterdir()
            if STEP_RE.match(p.name) and not p.is_symlink() and (p / META).is_file()
        ]
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
        try:
            st = ptr.lstat()
        except FileNotFoundError:
            done = self.complete()
            return done[-1] if done else None
        name = None
        if stat.S_ISREG(st.st_mode) and st.st_size <= 4096:  # never a link, a FIFO or a huge file
            try:
                name = ptr.read_bytes().decode("ascii").strip()
            except UnicodeDecodeError:
                pass
        if not name or not STEP_RE.match(name):
            raise CheckpointError(
                "the latest pointer does not hold a step_NNNNNN name",
                field="checkpoint",
                value=str(ptr),
                fix=f"write the name of a complete checkpoint into it (one of: {self._names()})",
            )
        cand = self.root / name
        if cand.is_symlink() or not (cand / META).is_file():
            raise CheckpointError(
                f"the latest pointer names {name}, which is not a complete checkpoint",
                field="checkpoint",
                value=str(ptr),
                fix=f"write the name of a complete checkpoint into it (one of: {self._names()})",
            )
        return cand

    def _names(self) -> str:
        return ", ".join(p.name for p in self.complete()) or "none left: start fresh"

    def verify(self, path: Path, *, any_world: bool = False, defer_checksums: bool = False) -> dict[str, Any]:
        """Check ``path`` before anything loads it, and (unless ``any_world``: it is to be resharded) that
        it was written by ``world_size`` ranks; returns its meta. This process hashes every file (the CLI
        before launch); the ranks share the hashing (:class:`~tessera.checkpoint.manager.CheckpointManager`).
        ``defer_checksums``: a manager hashes the files in the background, and its :meth:`load` waits for
        the checksums (everything else is checked now)."""
        meta, problems = self._verify_files(path, defer=defer_checksums)
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

    def _verify_files(self, path: Path, *, defer: bool = False) -> tuple[dict[str, Any], list[str]]:
        return verify_checkpoint(path)
