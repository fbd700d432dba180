"""The documents of a recipe's ``data`` section, and a fingerprint of where they came from.

The embedded default (``source: stdlib``) is real text that exists on every machine with no download:
the Python standard library's own ``*.py`` files. ``source: files`` reads local text / jsonl / parquet
files through ``datasets``, with its cache kept under ``data.cache_dir`` so nothing lands in
``~/.cache`` and nothing touches the hub.

The fingerprint is computed from file bytes before any parsing, and documents are parsed lazily: on a
warm cache :func:`tessera.data.prepare_data` needs only the hash, so ranks skip parsing entirely.
"""

from __future__ import annotations

import contextlib
import glob
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from tessera.config.schema import DataSection
from tessera.data._cache import sha256_file, sha256_json
from tessera.errors import DataError

# Bumped when the way documents are derived from files changes, so old cache entries are not reused.
CORPUS_VERSION = 1

# Directory names pruned from the stdlib walk: third-party code, the CPython test suite (huge and full of
# deliberately odd files), and tools that are not library code.
_STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
)
_EXT_FORMAT = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".rst": "text",
    ".py": "text",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
}
_DATASETS_BUILDER = {"text": "text", "jsonl": "json", "parquet": "parquet"}


@dataclass
class Corpus:
    """The files behind a data section, their fingerprint and (on first access) their documents."""

    section: DataSection
    files: list[Path]
    formats: list[str]
    fingerprint: dict[str, Any]
    datasets_cache: Path

    @property
    def content_hash(self) -> str:
        """One hash over the file contents (in document order) and the options that shape documents."""
        return self.fingerprint["content_hash"]

    @cached_property
    def documents(self) -> list[str]:
        """The non-empty documents, in a fixed order; parsed on first access."""
        if self.section.source == "stdlib":
            docs = [p.read_text(encoding="utf-8", errors="replace") for p in self.files]
        else:
            docs = [
                d
                for d in _load_files(self.files, self.formats, self.section, self.datasets_cache)
                if d.strip()
            ]
            # blank documents are dropped before data.max_docs picks, as the prepared dataset holds none
            docs = _strided_pick(docs, self.section.max_docs)
        docs = [d for d in docs if d.strip()]
        if not docs:
            raise DataError(
                "the data files hold no non-empty documents",
                field="data.files",
                value=self.section.files,
                fix="point data.files at files with text in them",
            )
        return docs


def load_corpus(section: DataSection, *, root: Path | None = None, cache_dir: Path | None = None) -> Corpus:
    """Resolve a data section to its files and fingerprint; documents follow lazily.

    ``root`` anchors relative paths in ``data.files`` and ``data.cache_dir`` (default: the working dir).
    """
    root = Path.cwd() if root is None else Path(root)
    cache = Path(cache_dir) if cache_dir is not None else root / section.cache_dir
    if section.source == "stdlib":
        files = _stdlib_files(section.max_docs)
        formats = ["text"] * len(files)
    else:
        files = _expand_files(section.files, root)
        formats = [_file_format(p, section.format) for p in files]
    entries = [{"path": str(p), "size": p.stat().st_size, "sha256": sha256_file(p)} for p in files]
    # Options that change which documents come out of the same bytes. The hashes stay in document order
    # (not sorted): packing concatenates in that order, so reordering files must give a new cache key.
    options: dict[str, Any] = {"version": CORPUS_VERSION, "source": section.source}
    if section.source == "files":
        options.update(formats=formats, text_field=section.text_field, max_docs=section.max_docs)
    content_hash = sha256_json({"files": [e["sha256"] for e in entries], "options": options})
    fingerprint = {"source": section.source, "files": entries, "content_hash": content_hash}
    # Keyed by content: datasets' own cache key looks at paths and mtimes, so a file rewritten in place
    # could otherwise come back stale.
    return Corpus(section, files, formats, fingerprint, cache / "datasets" / content_hash[:32])


def load_documents(section: DataSection, *, root: Path | None = None) -> list[str]:
    """The documents of a data section (convenience over :func:`load_corpus`)."""
    return load_corpus(section, root=root).documents


def _strided_pick(items: list[Any], k: int | None) -> list[Any]:
    """``k`` items spread evenly over ``items`` (all of them if ``k`` is None or large enough).

    Evenly strided rather than the first ``k`` so that a small CPU corpus still spans many modules.
    """
    n = len(items)
    if k is None or k >= n:
        return list(items)
    return [items[(i * n) // k] for i in range(k)]


def _stdlib_files(max_docs: int | None) -> list[Path]:
    """The standard library's non-empty ``*.py`` files, sorted by relative path, strided to ``max_docs``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                if path.stat().st_size > 0:  # empty __init__.py files are not documents
                    found.append((path.relative_to(root).as_posix(), path))
    if not found:
        raise DataError(
            f"found no standard-library source files under {root}",
            field="data.source",
            value="stdlib",
            fix="this Python ships without its .py sources; use data.source: files with local text files",
        )
    found.sort(key=lambda item: item[0])
    return _strided_pick([p for _, p in found], max_docs)


def _expand_files(patterns: list[str], root: Path) -> list[Path]:
    """Expand paths and globs (relative to ``root``), keeping the user's order and dropping repeats."""
    out: list[Path] = []
    seen: set[Path] = set()
    for pattern in patterns:
        full = os.path.expanduser(pattern)
        if not os.path.isabs(full):
            full = str(root / full)
        if glob.has_magic(full):
            matches = sorted(Path(m) for m in glob.glob(full, recursive=True) if os.path.isfile(m))
            if not matches:
                raise DataError(
                    "the pattern matches no files",
                    field="data.files",
                    value=pattern,
                    fix=f"check the pattern (relative paths are resolved against {root})",
                )
        else:
            path = Path(full)
            if path.is_dir():
                raise DataError(
                    "is a directory, not a file",
                    field="data.files",
                    value=pattern,
                    fix=f"list the files, or use a glob such as {pattern.rstrip('/')}/*.jsonl",
                )
            if not path.is_file():
                raise DataError(
                    "file not found",
                    field="data.files",
                    value=pattern,
                    fix=f"check the path (relative paths are resolved against {root})",
                )
            matches = [path]
        for m in matches:
            m = m.resolve()
            if m not in seen:
                seen.add(m)
                out.append(m)
    return out


def _file_format(path: Path, fmt: str) -> str:
    """The format a file is read as: ``data.format`` if set, else by its extension (also for chat and
    prompt-completion rows, which are kinds of rows, not of files)."""
    if fmt not in ("auto", "chat", "prompt_completion"):
        return fmt
    suffix = path.suffix.lower()
    if suffix not in _EXT_FORMAT:
        known = ", ".join(_EXT_FORMAT)
        raise DataError(
            f"cannot tell the format of {path.name} from its extension",
            field="data.format",
            value=fmt,
            fix=f"set data.format to text, jsonl or parquet (known extensions: {known})",
        )
    return _EXT_FORMAT[suffix]


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """Silence ``datasets`` progress bars (one per rank otherwise) and its error log lines (a file it
    cannot parse is reported once, by the DataError naming the reason), restoring the caller's setting."""
    from datasets.utils import logging as ds_logging

    was_enabled = ds_logging.is_progress_bar_enabled()
    verbosity = ds_logging.get_verbosity()
    ds_logging.disable_progress_bar()
    ds_logging.set_verbosity(ds_logging.CRITICAL)
    try:
        yield
    finally:
        ds_logging.set_verbosity(verbosity)
        if was_enabled:
            ds_logging.enable_progress_bar()


def _reason(exc: BaseException) -> str:
    """Why ``datasets`` could not read a file: the innermost cause (its DatasetGenerationError says only
    "An error occurred while generating the dataset")."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    if isinstance(exc, StopIteration):  # the json builder on a file without a single record
        return "no records in it (an empty file?)"
    return f"{type(exc).__name__}: {exc}"


def _load_files(files: list[Path], formats: list[str], section: DataSection, cache: Path) -> list[str]:
    """Read files with ``datasets``, one ``load_dataset`` call per run of same-format files (in order)."""
    from datasets import load_dataset

    runs: list[tuple[str, list[Path]]] = []
    for path, fmt in zip(files, formats):
        if runs and runs[-1][0] == fmt:
            runs[-1][1].append(path)
        else:
            runs.append((fmt, [path]))
    docs: list[str] = []
    with _quiet_datasets():
        for fmt, paths in runs:
            kwargs: dict[str, Any] = {"sample_by": "document"} if fmt == "text" else {}
            try:
                ds = load_dataset(
                    _DATASETS_BUILDER[fmt],
                    data_files=[str(p) for p in paths],
                    split="train",
                    cache_dir=str(cache),
                    **kwargs,
                )
            except Exception as exc:  # datasets raises many types; the user needs the file and the reason
                raise DataError(
                    f"could not read as {fmt}: {_reason(exc)}",
                    field="data.files",
                    value=[str(p) for p in paths],
                    fix="check the file contents, or set data.format to the format the files really have",
                ) from exc
            column = _text_column(ds.column_names, fmt, paths, section)
            docs.extend(_texts(ds[column], column, section))
    return docs


def _text_column(columns: list[str] | None, fmt: str, paths: list[Path], section: DataSection) -> str:
    """The column the documents are in, checked against the columns the files have."""
    column = "text" if fmt == "text" else section.text_field
    if column not in (columns or []):
        raise DataError(
            f"column {column!r} not found in {', '.join(p.name for p in paths)} "
            f"(columns: {', '.join(columns or [])})",
            field="data.text_field",
            value=section.text_field,
            fix="set data.text_field to the column that holds the text",
        )
    return column


def _texts(values: Any, column: str, section: DataSection) -> list[str]:
    """The documents of a column: strings, missing values skipped; any other type is refused."""
    docs: list[str] = []
    for value in values:
        if value is None:
            continue
        if not isinstance(value, str):
            raise DataError(
                f"column {column!r} holds {type(value).__name__} values, not text",
                field="data.text_field",
                value=section.text_field,
                fix="set data.text_field to a column of strings",
            )
        docs.append(value)
    return docs


#: records of each file a dry run reads (:func:`sample_corpus`)
SAMPLE_RECORDS = 16


@dataclass
class CorpusSample:
    """What a dry run read: the files the data section names and the first records of each."""

    files: list[Path]
    formats: list[str]
    records: int
    """records read, over all files"""
    documents: int
    """non-empty documents among them"""


def sample_corpus(
    section: DataSection, *, root: Path | None = None, records: int = SAMPLE_RECORDS
) -> CorpusSample:
    """A dry run's check of the data, bounded: the files resolve as :func:`load_corpus` resolves them
    (paths, globs, formats), and the first ``records`` records of each are read by the reader the ranks
    use (the same ``datasets`` builder, streamed: it parses the file's first block, 10 MB for jsonl and
    text, so a 10 GB corpus is neither read nor hashed whole) and checked as the ranks check them (the
    text column, its type). A wrong ``data.text_field``, a missing file or a record that does not parse
    in that block fails here with the error the run would give. A text file is read by lines here (its
    document is the whole file), which decodes its first block."""
    import itertools

    root = Path.cwd() if root is None else Path(root)
    if section.source == "stdlib":
        files = _stdlib_files(section.max_docs)
        return CorpusSample(files, ["text"] * len(files), len(files), len(files))
    files = _expand_files(section.files, root)
    formats = [_file_format(p, section.format) for p in files]
    n_records = n_docs = 0
    exhausted = True
    import tempfile

    from datasets import load_dataset

    # a stream caches nothing; the temporary directory keeps a dry run from creating data.cache_dir
    with _quiet_datasets(), tempfile.TemporaryDirectory(prefix="tessera-sample-") as cache:
        for path, fmt in zip(files, formats):
            if path.stat().st_size == 0:  # adds nothing to the run (read with the others, it is no error)
                continue
            # sample_by="line": a text document is the whole file, which a bounded read must not load
            kwargs: dict[str, Any] = {"sample_by": "line"} if fmt == "text" else {}
            try:
                ds = load_dataset(
                    _DATASETS_BUILDER[fmt],
                    data_files=[str(path)],
                    split="train",
                    streaming=True,
                    cache_dir=cache,
                    **kwargs,
                )
                rows = list(itertools.islice(iter(ds), records))
            except Exception as exc:  # the same wording as the full read (:func:`_load_files`)
                raise DataError(
                    f"could not read as {fmt}: {_reason(exc)}",
                    field="data.files",
                    value=[str(path)],
                    fix="check the file contents, or set data.format to the format the files really have",
                ) from exc
            exhausted = exhausted and len(rows) < records
            if not rows:
                continue  # an empty file adds no documents to the run, and no columns to check
            columns = list(dict.fromkeys(k for row in rows for k in row))
            n_records += len(rows)
            if section.format in ("chat", "prompt_completion"):  # rows of fields, checked by the prepare
                from tessera.data.chat import KINDS

                absent = [f for f in KINDS[section.format] if f not in columns]
                if absent:
                    raise DataError(
                        f"{path.name}: no {absent[0]!r} field in its first records (fields: {', '.join(columns)})",
                        field="data.format",
                        value=section.format,
                        fix=f"{section.format} rows need the fields {', '.join(KINDS[section.format])}",
                    )
                n_docs += len(rows)
                continue
            column = _text_column(columns, fmt, [path], section)
            texts = _texts((row.get(column) for row in rows), column, section)
            n_docs += sum(1 for t in texts if t.strip())
    if exhausted and n_docs == 0:  # every file read to its end: the run would find nothing either
        raise DataError(
            "the data files hold no non-empty documents",
            field="data.files",
            value=section.files,
            fix="point data.files at files with text in them",
        )
    return CorpusSample(files, formats, n_records, n_docs)
