"""``tessera data prepare``: text sources -> a megatron-core indexed dataset (``.bin`` / ``.idx``) + ``dataset.json``.

The corpus is never held in memory. The sources are cut into shards (byte ranges of jsonl / text files
aligned to line starts, parquet row groups, Arrow files), N worker processes each tokenize their shards
in batches (``tokenizers``' ``encode_batch_fast``, one thread per worker) and write each shard with
megatron-core's own ``IndexedDatasetBuilder``; the parent concatenates the shards in source order with the
same builder's ``add_index`` (the approach of Megatron-LM's ``tools/preprocess_data.py``, whose output
this is byte-compatible with: what ``IndexedDataset`` maps, Megatron-LM, Megatron-Bridge and NeMo read).
Each document is stored as its tokens followed by eos, so packing rows later joins documents with eos as
:mod:`tessera.data.dataset` does today.

Written by hand, because megatron-core has no reader for the sources: splitting the files into shards,
reading jsonl / text / parquet / Arrow / ``save_to_disk`` directories row by row with the file and line of
every bad row, the progress, the content-hash no-op and the atomic publish (a temporary directory renamed
over ``--out`` at the end: a failed prepare leaves nothing there).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tessera.atomic import sha256_file, sha256_json
from tessera.data._cache import publish_dir, temp_dir_beside
from tessera.errors import DataError

#: bumped when what is written changes, so an older directory is never taken for up to date
PREPARE_VERSION = 1
DATASET_JSON = "dataset.json"
#: the indexed dataset's path prefix inside ``--out``: ``tokens.bin`` / ``tokens.idx``
PREFIX = "tokens"
_TEXT = {".txt", ".text", ".md", ".rst", ".py"}
_FORMATS = {
    **dict.fromkeys(_TEXT, "text"),
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
    ".arrow": "arrow",
}
#: documents per tokenizer call (and per progress update)
BATCH = 512


@dataclass(frozen=True)
class Source:
    """One input file, as hashed before it is read."""

    path: str
    format: str
    sha256: str
    bytes: int


@dataclass(frozen=True)
class Shard:
    """A piece of one source a worker tokenizes on its own: a byte range (jsonl: the lines whose first byte
    is in it), a parquet row group, or a whole file (text, Arrow)."""

    index: int
    path: str
    format: str
    start: int = 0
    end: int = -1
    row_group: int = -1


def _fail(why: str, value: Any, fix: str, field: str = "SRC") -> DataError:
    return DataError(why, field=field, value=value, fix=fix)


def resolve_sources(paths: list[str], fmt: str = "auto") -> list[tuple[Path, str]]:
    """The files the sources name, each with its format: files, globs, ``save_to_disk`` directories (their
    Arrow files). A megatron ``.bin``/``.idx`` prefix is already prepared and is refused here."""
    import glob

    out: list[tuple[Path, str]] = []
    for spec in paths:
        p = Path(spec)
        if Path(spec + ".bin").is_file() and Path(spec + ".idx").is_file():
            raise _fail(
                "this is a prepared megatron indexed dataset (.bin/.idx) already",
                spec,
                "train on it as it is; prepare only text / jsonl / parquet / Arrow sources",
            )
        if p.is_dir():
            state = p / "state.json"
            if not state.is_file():
                raise _fail(
                    "a directory that is not a datasets save_to_disk directory (no state.json)",
                    spec,
                    "name the files in it, or a directory written by Dataset.save_to_disk",
                )
            files = [p / f["filename"] for f in json.loads(state.read_text()).get("_data_files", [])]
            out += [(f, "arrow") for f in files]
            continue
        matches = sorted(glob.glob(spec)) if any(c in spec for c in "*?[") else [spec]
        if not matches or not all(Path(m).is_file() for m in matches):
            raise _fail(
                "no such file", spec, "check the path (relative paths are from the current directory)"
            )
        for m in matches:
            kind = fmt if fmt != "auto" else _FORMATS.get(Path(m).suffix.lower())
            if kind is None:
                raise _fail(
                    f"unknown file type {Path(m).suffix!r}",
                    m,
                    "use .txt / .jsonl / .parquet / .arrow files, or pass --format",
                    field="--format",
                )
            out.append((Path(m), kind))
    return out


def _shards(sources: list[tuple[Path, str]], workers: int) -> list[Shard]:
    """Cut the sources into shards: enough for every worker to stay busy and for a steady progress bar,
    none above 64 MB."""
    total = sum(p.stat().st_size for p, _ in sources)
    size = max(1 << 20, min(64 << 20, total // max(1, 4 * workers)))
    shards: list[Shard] = []
    for path, kind in sources:
        if kind == "jsonl":
            n = path.stat().st_size
            for a in range(0, max(n, 1), size):
                shards.append(Shard(len(shards), str(path), kind, a, min(a + size, n)))
        elif kind == "parquet":
            import pyarrow.parquet as pq

            for g in range(pq.ParquetFile(path).num_row_groups):
                shards.append(Shard(len(shards), str(path), kind, row_group=g))
        else:
            shards.append(Shard(len(shards), str(path), kind))
    return shards


# ---- the workers -------------------------------------------------------------------------------------


def _line_of(path: str, offset: int) -> int:
    """The 1-based line number of byte ``offset`` (counted only when a row is refused)."""
    with open(path, "rb") as f:
        return f.read(offset).count(b"\n") + 1


def _jsonl_docs(shard: Shard, field: str) -> Iterator[tuple[str | None, int]]:
    """(text, bytes) of each line whose first byte lies in the shard's range; None for a null text."""
    with open(shard.path, "rb") as f:
        if shard.start > 0:
            f.seek(shard.start - 1)
            if f.read(1) != b"\n":
                f.readline()  # the line that started in the previous shard is that shard's
        while (pos := f.tell()) < shard.end:
            raw = f.readline()
            if not raw:
                break
            if not raw.strip():
                yield None, len(raw)
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                where = f"{shard.path}:{_line_of(shard.path, pos)}"
                raise _fail(
                    f"{where}: not UTF-8 ({e.reason} at byte {pos + e.start})",
                    shard.path,
                    "re-encode the file as UTF-8",
                ) from None
            except json.JSONDecodeError as e:
                where = f"{shard.path}:{_line_of(shard.path, pos)}"
                raise _fail(
                    f"{where}: not a JSON object ({e.msg})", shard.path, "fix or remove that line"
                ) from None
            if not isinstance(row, dict) or field not in row:
                where = f"{shard.path}:{_line_of(shard.path, pos)}"
                raise _fail(
                    f"{where}: no {field!r} field"
                    + (f" (fields: {', '.join(row)})" if isinstance(row, dict) else ""),
                    field,
                    "set --text-field (data.text_field) to the field that holds the text",
                    field="data.text_field",
                )
            value = row[field]
            if value is not None and not isinstance(value, str):
                _text(value, f"{shard.path}:{_line_of(shard.path, pos)}", field)
            yield value, len(raw)


def _text(value: Any, where: str, field: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise _fail(
        f"{where}: {field!r} holds {type(value).__name__}, not text",
        field,
        "set --text-field (data.text_field) to a field of strings",
        field="data.text_field",
    )


def _table_docs(shard: Shard, field: str) -> Iterator[tuple[str | None, int]]:
    """Rows of a parquet row group or of an Arrow file (datasets' IPC stream, or the IPC file format)."""
    import pyarrow as pa

    if shard.format == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(shard.path)
        names = pf.schema_arrow.names
        batches = pf.iter_batches(row_groups=[shard.row_group], columns=[field] if field in names else [])
    else:
        source = pa.memory_map(shard.path)
        try:
            reader: Any = pa.ipc.open_stream(source)
        except pa.ArrowInvalid:
            file_reader = pa.ipc.open_file(source)
            reader = (file_reader.get_batch(i) for i in range(file_reader.num_record_batches))
            names = file_reader.schema.names
        else:
            names = reader.schema.names
        batches = reader
    if field not in names:
        raise _fail(
            f"{shard.path}: no column {field!r} (columns: {', '.join(names)})",
            field,
            "set --text-field (data.text_field) to the column that holds the text",
            field="data.text_field",
        )
    row = 0
    for batch in batches:
        for value in batch.column(field).to_pylist():
            row += 1
            text = _text(value, f"{shard.path} row {row}", field)
            yield text, len(text.encode("utf-8")) if text else 0


def _text_docs(shard: Shard) -> Iterator[tuple[str | None, int]]:
    """A text file is one document (as ``datasets``' text builder with ``sample_by: document`` reads it)."""
    raw = Path(shard.path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise _fail(
            f"{shard.path}:{line}: not UTF-8 ({e.reason} at byte {e.start})",
            shard.path,
            "re-encode the file as UTF-8",
        ) from None
    yield text, len(raw)


_STATE: dict[str, Any] = {}


def _worker_init(tokenizer_dir: str, progress: Any) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: N workers use N cores
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    _STATE.update(backend=tok.backend_tokenizer, eos=int(tok.eos_token_id), vocab=len(tok), progress=progress)


def _tokenize_shard(
    shard: Shard, field: str, tmp: str
) -> tuple[str, int, int] | tuple[str, str, Any, str, str]:
    """Tokenize one shard into ``tmp/shard-NNNNN.{bin,idx}``; ("ok", documents, tokens) or the error's parts
    (a DataError does not survive the trip between processes as itself)."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    backend, eos, progress = _STATE["backend"], _STATE["eos"], _STATE["progress"]
    prefix = f"{tmp}/shard-{shard.index:05d}"
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(_STATE["vocab"]))
    docs = tokens = 0
    batch: list[str] = []
    nbytes = 0

    def flush() -> None:
        nonlocal docs, tokens, nbytes
        added = 0
        for enc in backend.encode_batch_fast(batch, add_special_tokens=False) if batch else ():
            ids = np.asarray([*enc.ids, eos])
            builder.add_document(ids, [ids.size])
            added += ids.size
        docs, tokens = docs + len(batch), tokens + added
        progress.put((nbytes, added, len(batch)))
        batch.clear()
        nbytes = 0

    try:
        reader = (
            _jsonl_docs(shard, field)
            if shard.format == "jsonl"
            else _text_docs(shard)
            if shard.format == "text"
            else _table_docs(shard, field)
        )
        for text, size in reader:
            nbytes += size
            if text is not None and text.strip():  # a blank document is no document (as before)
                batch.append(text)
            if len(batch) >= BATCH:
                flush()
        flush()
        builder.finalize(prefix + ".idx")
    except DataError as e:
        return ("error", e.message, e.value, e.fix, e.field)
    return ("ok", docs, tokens)


# ---- the parent --------------------------------------------------------------------------------------


def _fingerprint(
    sources: list[tuple[Path, str]], tokenizer_hash: str, field: str, hashes: dict[str, str] | None = None
) -> tuple[list[Source], str]:
    """The sources as hashed (``hashes``: sha256 by path, already known to the caller) and the key of
    the dataset they give with this tokenizer and text field."""
    known = hashes or {}
    found = [
        Source(str(p), kind, known.get(str(p)) or sha256_file(p), p.stat().st_size) for p, kind in sources
    ]
    empty = [s.path for s in found if s.bytes == 0]
    if empty:
        raise _fail("an empty source", empty[0], "remove it from the sources, or give it documents")
    return found, prepare_key(found, tokenizer_hash, field)


def prepare_key(found: list[Source], tokenizer_hash: str, field: str) -> str:
    """What a prepared directory is the result of: the sources' bytes and formats, the tokenizer, the
    text field and this module's version."""
    return sha256_json(
        {
            "version": PREPARE_VERSION,
            "sources": [[s.sha256, s.format] for s in found],
            "tokenizer": tokenizer_hash,
            "text_field": field,
        }
    )


def prepare_dataset(
    sources: list[str],
    *,
    tokenizer: str,
    out: Path,
    workers: int | None = None,
    text_field: str = "text",
    fmt: str = "auto",
    show_progress: bool = True,
) -> dict[str, Any]:
    """Prepare ``sources`` into ``out`` (see the module); returns ``dataset.json``'s record. A directory
    prepared from the same bytes with the same tokenizer and options is left as it is."""
    from tessera.data.tokenizer import local_tokenizer

    info = local_tokenizer(tokenizer, root=Path.cwd())
    found, key = _fingerprint(resolve_sources(sources, fmt), info.tokenizer_hash, text_field)
    return _prepare(found, key, info, Path(out), workers, text_field, show_progress)


def prepare_cached(
    files: list[Path],
    *,
    info: Any,
    cache_dir: Path,
    workers: int | None,
    text_field: str,
    fmt: str = "auto",
    hashes: dict[str, str] | None = None,
    show_progress: bool = False,
    progress: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """``files`` prepared with the tokenizer ``info`` into ``<cache_dir>/prepared/<key>`` (what a recipe's
    raw sources become before a run: once per content, shared by every run and rank that reads them);
    returns the record, whose ``"dir"`` is where it is."""
    from tessera.data._cache import build_lock

    found, key = _fingerprint(
        resolve_sources([str(f) for f in files], fmt), info.tokenizer_hash, text_field, hashes
    )
    out = cache_dir / "prepared" / key[:32]
    if not (out / DATASET_JSON).is_file():
        with build_lock(out):  # one process prepares; the others find it done
            record = _prepare(found, key, info, out, workers, text_field, show_progress, progress)
    else:
        record = json.loads((out / DATASET_JSON).read_text())
    return record | {"dir": str(out)}


def _prepare(
    found: list[Source],
    key: str,
    info: Any,
    out: Path,
    workers: int | None,
    text_field: str,
    show_progress: bool,
    progress: Callable[[], None] | None = None,
) -> dict[str, Any]:
    if (out / DATASET_JSON).is_file():
        old = json.loads((out / DATASET_JSON).read_text())
        if old.get("key") == key:
            return old | {"up_to_date": True}
    if out.exists() and any(out.iterdir()):
        raise _fail(
            "the output directory exists and holds something else",
            str(out),
            "choose a new --out, or remove that directory",
            field="--out",
        )
    if not hasattr(info.tokenizer, "backend_tokenizer"):
        raise _fail(
            "a slow (pure Python) tokenizer: preparing needs a fast one (tokenizer.json)",
            str(info.tokenizer_dir),
            "save the tokenizer with transformers' fast class (AutoTokenizer(..., use_fast=True)"
            ".save_pretrained) so the directory has a tokenizer.json",
            field="--tokenizer",
        )
    workers = max(1, workers or os.cpu_count() or 1)
    paths = [(Path(s.path), s.format) for s in found]
    shards = _shards(paths, workers)
    tmp = temp_dir_beside(out)
    try:
        t0 = time.perf_counter()
        docs, tokens = _run_shards(
            shards, text_field, tmp, str(info.tokenizer_dir), workers, found, show_progress, progress
        )
        if docs == 0:
            raise _fail(
                "the sources hold no non-empty documents",
                [s.path for s in found],
                "point at files with text in them (or set --text-field / data.text_field)",
            )
        _merge(tmp, len(shards), info)
        record = {
            "format_version": PREPARE_VERSION,
            "key": key,
            "prefix": PREFIX,
            "sources": [asdict(s) for s in found],
            "text_field": text_field,
            "tokenizer": {"path": str(info.tokenizer_dir), "sha256": info.tokenizer_hash, **info.token_ids},
            "eod_appended": True,
            "documents": docs,
            "tokens": tokens,
            "workers": workers,
            "seconds": round(time.perf_counter() - t0, 3),
        }
        (tmp / DATASET_JSON).write_text(json.dumps(record, indent=1) + "\n")
        if out.exists():
            out.rmdir()  # empty, checked above
        publish_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return record


def _run_shards(
    shards: list[Shard],
    field: str,
    tmp: Path,
    tokenizer_dir: str,
    workers: int,
    found: list[Source],
    show_progress: bool,
    on_progress: Callable[[], None] | None = None,
) -> tuple[int, int]:
    """The shards through ``workers`` processes, with a progress bar of MB/s, tokens/s and the ETA."""
    import multiprocessing as mp
    import queue
    import warnings

    with warnings.catch_warnings():  # megatron-core's package import warns about TransformerEngine / Apex
        warnings.simplefilter("ignore")
        import megatron.core.datasets.indexed_dataset  # noqa: F401  (once here; forked workers inherit it)

    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    # fork on Linux: a worker starts with the parent's imports (transformers, torch: ~3 s each otherwise)
    # and runs no torch op (numpy and tokenizers only), so no inherited thread pool is ever touched
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    progress: Any = ctx.Queue()
    total = sum(s.bytes for s in found)
    done_bytes = done_tokens = 0
    bar = Progress(
        TextColumn("prepare"),
        BarColumn(),
        TextColumn("{task.fields[mbs]:.1f} MB/s  {task.fields[tps]:,.0f} tokens/s"),
        TimeRemainingColumn(),
        disable=not show_progress,
        transient=True,
    )
    t0 = time.perf_counter()
    with ctx.Pool(workers, initializer=_worker_init, initargs=(tokenizer_dir, progress)) as pool, bar:
        task = bar.add_task("prepare", total=total, mbs=0.0, tps=0.0)
        pending = [pool.apply_async(_tokenize_shard, (s, field, str(tmp))) for s in shards]
        while True:
            try:
                b, t, _ = progress.get(timeout=0.1)
                done_bytes, done_tokens = done_bytes + b, done_tokens + t
                dt = max(time.perf_counter() - t0, 1e-9)
                bar.update(task, completed=done_bytes, mbs=done_bytes / dt / 1e6, tps=done_tokens / dt)
                if on_progress is not None:
                    on_progress()
            except queue.Empty:
                if all(r.ready() for r in pending):
                    break
        results = [r.get() for r in pending]
    for r in results:
        if r[0] == "error":
            _, message, value, fix, field_name = r
            raise DataError(message, field=field_name, value=value, fix=fix)
    return sum(r[1] for r in results), sum(r[2] for r in results)


def _merge(tmp: Path, n: int, info: Any) -> None:
    """The shards, in source order, into ``tmp/tokens.{bin,idx}`` by megatron-core's ``add_index``."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(
        str(tmp / f"{PREFIX}.bin"), dtype=DType.optimal_dtype(len(info.tokenizer))
    )
    for i in range(n):
        shard = tmp / f"shard-{i:05d}"
        builder.add_index(str(shard))
        for ext in (".bin", ".idx"):
            (tmp / f"shard-{i:05d}{ext}").unlink()
    builder.finalize(str(tmp / f"{PREFIX}.idx"))
