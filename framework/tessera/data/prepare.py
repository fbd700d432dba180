"""``tessera data prepare``: text sources -> a megatron-core indexed dataset (``.bin`` / ``.idx``) + ``dataset.json``.

The corpus is never held in memory. The sources are cut into shards (byte ranges of jsonl / text files
aligned to line starts, parquet row groups, Arrow files), N worker processes each tokenize their shards
in batches (``tokenizers``' ``encode_batch_fast``, one thread per worker) and write each shard with
megatron-core's own ``IndexedDatasetBuilder``; the parent concatenates the shards in source order
(:func:`tessera.data.indexfile.concat_indexed`, the format of the builder's ``add_index``, streamed) -
the approach of Megatron-LM's ``tools/preprocess_data.py``, whose output this is byte-compatible with:
what ``IndexedDataset`` maps, Megatron-LM, Megatron-Bridge and NeMo read. Each text document is stored as
its tokens followed by eos, so packed rows join documents with eos; chat and prompt-completion rows
(:mod:`tessera.data.chat`) carry a loss mask beside them (``mask.bin`` / ``mask.idx``).

Written by hand, because megatron-core has no reader for the sources: splitting the files into shards,
reading jsonl / text / parquet / Arrow / ``save_to_disk`` directories row by row with the file and line of
every bad row (:mod:`tessera.data.readers`), the progress, the content-hash no-op and the atomic publish (a temporary directory renamed
over ``--out`` at the end: a failed prepare leaves nothing there).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tessera.atomic import sha256_file, sha256_json
from tessera.data._cache import publish_dir, temp_dir_beside
from tessera.data.indexfile import concat_indexed
from tessera.data.readers import (
    RowKind,
    Shard,
    Where,
    check_text,
    jsonl_rows,
    row_kind,
    table_rows,
    text_rows,
)
from tessera.data.readers import (
    fail as _fail,
)
from tessera.errors import DataError

#: bumped when what is written changes, so an older directory is never taken for up to date
PREPARE_VERSION = 1
DATASET_JSON = "dataset.json"
#: the indexed dataset's path prefix inside ``--out``: ``tokens.bin`` / ``tokens.idx``
PREFIX = "tokens"
#: the loss mask's (chat / prompt-completion rows): one uint8 per token, the same documents
MASK = "mask"
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


_STATE: dict[str, Any] = {}


def _worker_init(tokenizer_dir: str, progress: Any) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: N workers use N cores
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    _STATE.update(
        tokenizer=tok,
        backend=tok.backend_tokenizer,
        eos=int(tok.eos_token_id),
        vocab=len(tok),
        progress=progress,
    )


def _encode(kind: RowKind, batch: list[Any]) -> list[tuple[list[int], Any]]:
    """(ids, mask or None) of each row of a batch: text + eos; prompt + completion + eos, the mask on the
    completion and eos; a chat conversation through the template, the mask on the assistant turns."""
    import numpy as np

    backend, eos = _STATE["backend"], _STATE["eos"]
    if kind.kind == "text":
        return [([*e.ids, eos], None) for e in backend.encode_batch_fast(batch, add_special_tokens=False)]
    if kind.kind == "prompt_completion":
        prompts = backend.encode_batch_fast([p for p, _ in batch], add_special_tokens=False)
        completions = backend.encode_batch_fast([c for _, c in batch], add_special_tokens=False)
        out = []
        for p, c in zip(prompts, completions):
            mask = np.concatenate([np.zeros(len(p.ids), np.uint8), np.ones(len(c.ids) + 1, np.uint8)])
            out.append(([*p.ids, *c.ids, eos], mask))
        return out
    from tessera.data.chat import render_chat

    out = []
    for messages, where in batch:
        try:
            out.append(render_chat(_STATE["tokenizer"], messages))
        except ValueError as e:
            raise _fail(
                f"{where()}: {e}",
                where(),
                "use a tokenizer whose chat template renders turn by turn",
                field="data.tokenizer",
            ) from None
    return out


def _payload(kind: RowKind, values: tuple[Any, ...], where: Where) -> Any:
    """A row's checked payload for :func:`_encode`, or None for a row that adds no document."""
    from tessera.data import chat

    if kind.kind == "text":
        text = check_text(values[0], where(), kind.field) if not isinstance(values[0], str) else values[0]
        return text if text is not None and text.strip() else None  # a blank document is no document
    if kind.kind == "prompt_completion":
        return chat.check_pair(values, where)
    messages = chat.check_messages(values[0], where, no_assistant=kind.no_assistant)
    return None if messages is None else (messages, where)


def _tokenize_shard(
    shard: Shard, kind: RowKind, tmp: str
) -> tuple[str, int, int, int] | tuple[str, str, Any, str, str]:
    """Tokenize one shard into ``tmp/shard-NNNNN.{bin,idx}`` (and ``mask-NNNNN`` for masked rows);
    ("ok", documents, tokens, skipped) or the error's parts (a DataError does not survive the trip
    between processes as itself)."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    progress = _STATE["progress"]
    prefix, mprefix = f"{tmp}/shard-{shard.index:05d}", f"{tmp}/mask-{shard.index:05d}"
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(_STATE["vocab"]))
    masks = IndexedDatasetBuilder(mprefix + ".bin", dtype=np.uint8) if kind.masked else None
    docs = tokens = skipped = 0
    batch: list[Any] = []
    nbytes = 0

    def flush() -> None:
        nonlocal docs, tokens, nbytes
        added = 0
        for ids, mask in _encode(kind, batch) if batch else ():
            arr = np.asarray(ids)
            builder.add_document(arr, [arr.size])
            if masks is not None:
                masks.add_document(np.asarray(mask, dtype=np.uint8), [arr.size])
            added += arr.size
        docs, tokens = docs + len(batch), tokens + added
        progress.put((nbytes, added, len(batch)))
        batch.clear()
        nbytes = 0

    try:
        read = jsonl_rows if shard.format == "jsonl" else text_rows if shard.format == "text" else table_rows
        for values, size, where in read(shard, kind):
            nbytes += size
            item = None if values is None else _payload(kind, values, where)
            if item is not None:
                batch.append(item)
            elif values is not None and kind.kind == "chat":
                skipped += 1  # no assistant turn, data.chat.no_assistant: skip
            if len(batch) >= BATCH:
                flush()
        flush()
        builder.finalize(prefix + ".idx")
        if masks is not None:
            masks.finalize(mprefix + ".idx")
    except DataError as e:
        return ("error", e.message, e.value, e.fix, e.field)
    return ("ok", docs, tokens, skipped)


# ---- the parent --------------------------------------------------------------------------------------


def _fingerprint(
    sources: list[tuple[Path, str]], tokenizer_hash: str, kind: RowKind, hashes: dict[str, str] | None = None
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
    return found, prepare_key(found, tokenizer_hash, kind)


def prepare_key(found: list[Source], tokenizer_hash: str, kind: RowKind) -> str:
    """What a prepared directory is the result of: the sources' bytes and formats, the tokenizer, the
    text field (or the kind of rows) and this module's version."""
    key: dict[str, Any] = {
        "version": PREPARE_VERSION,
        "sources": [[s.sha256, s.format] for s in found],
        "tokenizer": tokenizer_hash,
        "text_field": kind.field,
    }
    if kind.masked:
        key.update(rows=kind.kind, no_assistant=kind.no_assistant)
    return sha256_json(key)


def prepare_dataset(
    sources: list[str],
    *,
    tokenizer: str,
    out: Path,
    workers: int | None = None,
    text_field: str = "text",
    fmt: str = "auto",
    show_progress: bool = True,
    no_assistant: str = "error",
) -> dict[str, Any]:
    """Prepare ``sources`` into ``out`` (see the module); returns ``dataset.json``'s record. A directory
    prepared from the same bytes with the same tokenizer and options is left as it is. ``fmt``: a file
    format, or ``chat`` / ``prompt_completion`` rows (:mod:`tessera.data.chat`); ``no_assistant``: what a
    chat row without an assistant turn is (``error`` or ``skip``)."""
    from tessera.data.tokenizer import local_tokenizer

    info = local_tokenizer(tokenizer, root=Path.cwd())
    file_fmt, kind = row_kind(fmt, text_field, no_assistant)
    found, key = _fingerprint(resolve_sources(sources, file_fmt), info.tokenizer_hash, kind)
    return _prepare(found, key, info, Path(out), workers, kind, show_progress)


def prepare_cached(
    files: list[Path],
    *,
    info: Any,
    cache_dir: Path,
    workers: int | None,
    text_field: str,
    fmt: str = "auto",
    no_assistant: str = "error",
    hashes: dict[str, str] | None = None,
    show_progress: bool = False,
    progress: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """``files`` prepared with the tokenizer ``info`` into ``<cache_dir>/prepared/<key>`` (what a recipe's
    raw sources become before a run: once per content, shared by every run and rank that reads them);
    returns the record, whose ``"dir"`` is where it is."""
    from tessera.data._cache import build_lock

    file_fmt, kind = row_kind(fmt, text_field, no_assistant)
    found, key = _fingerprint(
        resolve_sources([str(f) for f in files], file_fmt), info.tokenizer_hash, kind, hashes
    )
    out = cache_dir / "prepared" / key[:32]
    if not (out / DATASET_JSON).is_file():
        with build_lock(out):  # one process prepares; the others find it done
            record = _prepare(found, key, info, out, workers, kind, show_progress, progress)
    else:
        record = json.loads((out / DATASET_JSON).read_text())
    return record | {"dir": str(out)}


def _prepare(
    found: list[Source],
    key: str,
    info: Any,
    out: Path,
    workers: int | None,
    kind: RowKind,
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
        docs, tokens, skipped = _run_shards(
            shards, kind, tmp, str(info.tokenizer_dir), workers, found, show_progress, progress
        )
        if docs == 0:
            raise _fail(
                "the sources hold no non-empty documents",
                [s.path for s in found],
                "point at files with text in them (or set --text-field / data.text_field)",
            )
        _merge(tmp, len(shards), info, kind.masked)
        record = {
            "format_version": PREPARE_VERSION,
            "key": key,
            "prefix": PREFIX,
            "sources": [asdict(s) for s in found],
            "text_field": kind.field,
            "rows": kind.kind,
            "loss_mask": MASK if kind.masked else None,
            "tokenizer": {"path": str(info.tokenizer_dir), "sha256": info.tokenizer_hash, **info.token_ids},
            "eod_appended": kind.kind != "chat",  # a chat template ends its turns itself
            "skipped": {"no_assistant": skipped} if kind.kind == "chat" else {},
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


def _context() -> Any:
    """How the workers start. ``fork`` from a single-threaded process (the command line, a test): a worker
    starts with the parent's imports (transformers, megatron-core: ~3 s each otherwise) and runs no torch
    op. Never ``fork`` from a process with other threads (a training rank: its heartbeat, its supervisor
    watch, torch's pools): a lock one of them held at the fork stays held in the child, which hung or
    lost a worker in 1 of 3 README fine-tunes. There a ``forkserver`` (a fresh interpreter that imports
    the workers' libraries once, then forks them) starts them."""
    import multiprocessing as mp
    import threading

    if not sys.platform.startswith("linux"):
        return mp.get_context("spawn")
    if threading.active_count() == 1:
        return mp.get_context("fork")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["transformers", "megatron.core.datasets.indexed_dataset", "tessera.data.prepare"]
    )
    return ctx


def _run_shards(
    shards: list[Shard],
    kind: RowKind,
    tmp: Path,
    tokenizer_dir: str,
    workers: int,
    found: list[Source],
    show_progress: bool,
    on_progress: Callable[[], None] | None = None,
) -> tuple[int, int, int]:
    """The shards through ``workers`` processes, with a progress bar of MB/s, tokens/s and the ETA."""
    import queue
    import warnings
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    with warnings.catch_warnings():  # megatron-core's package import warns about TransformerEngine / Apex
        warnings.simplefilter("ignore")
        import megatron.core.datasets.indexed_dataset  # noqa: F401  (once here; forked workers inherit it)

    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    ctx = _context()
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
    # concurrent.futures rather than multiprocessing.Pool: a worker that dies (killed, out of memory)
    # fails the pool with BrokenProcessPool instead of leaving its shard pending forever
    pool = ProcessPoolExecutor(
        workers, mp_context=ctx, initializer=_worker_init, initargs=(tokenizer_dir, progress)
    )
    with pool, bar:
        task = bar.add_task("prepare", total=total, mbs=0.0, tps=0.0)
        pending = [pool.submit(_tokenize_shard, s, kind, str(tmp)) for s in shards]
        while True:
            try:
                b, t, _ = progress.get(timeout=0.1)
                done_bytes, done_tokens = done_bytes + b, done_tokens + t
                dt = max(time.perf_counter() - t0, 1e-9)
                bar.update(task, completed=done_bytes, mbs=done_bytes / dt / 1e6, tps=done_tokens / dt)
                if on_progress is not None:
                    on_progress()
            except queue.Empty:
                if all(r.done() for r in pending):
                    break
        try:
            results = [r.result() for r in pending]
        except BrokenProcessPool as e:
            raise RuntimeError(
                f"a data preparation worker died ({e}); see the log above for its reason"
            ) from e
    for r in results:
        if r[0] == "error":
            _, message, value, fix, field_name = r
            raise DataError(message, field=field_name, value=value, fix=fix)
    return sum(r[1] for r in results), sum(r[2] for r in results), sum(r[3] for r in results)


def _merge(tmp: Path, n: int, info: Any, masked: bool = False) -> None:
    """The shards, in source order, into ``tmp/tokens.{bin,idx}`` (and ``tmp/mask.{bin,idx}``)."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import DType

    parts = [(PREFIX, "shard", DType.optimal_dtype(len(info.tokenizer)))]
    if masked:
        parts.append((MASK, "mask", np.uint8))
    for name, stem, dtype in parts:
        shards = [tmp / f"{stem}-{i:05d}" for i in range(n)]
        concat_indexed(shards, tmp / name, DType.code_from_dtype(dtype))
        for shard in shards:
            for ext in (".bin", ".idx"):
                Path(f"{shard}{ext}").unlink()
