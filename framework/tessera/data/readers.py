"""Rows of the sources ``tessera data prepare`` reads, one at a time: jsonl lines of a byte range, parquet
row groups, Arrow files, whole text files; each row's fields for its kind (text, chat messages, prompt and
completion), with the file and line (or row) of every refused one."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessera.errors import DataError


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


def fail(why: str, value: Any, fix: str, field: str = "SRC") -> DataError:
    """A refused source or row: one DataError naming it (``SRC``: the command's positional argument)."""
    return DataError(why, field=field, value=value, fix=fix)


def _line_of(path: str, offset: int) -> int:
    """The 1-based line number of byte ``offset`` (counted only when a row is refused)."""
    with open(path, "rb") as f:
        return f.read(offset).count(b"\n") + 1


@dataclass(frozen=True)
class RowKind:
    """What a source's rows hold: ``text`` (``field``), ``chat`` (``messages``) or ``prompt_completion``."""

    kind: str = "text"
    field: str = "text"
    no_assistant: str = "error"
    """a chat row without an assistant turn: ``error`` or ``skip`` (counted in dataset.json)"""

    @property
    def fields(self) -> tuple[str, ...]:
        from tessera.data.chat import KINDS

        return KINDS.get(self.kind, (self.field,))

    @property
    def setting(self) -> tuple[str, str]:
        """The recipe field and the fix for a row that lacks a field."""
        if self.kind == "text":
            return "data.text_field", "set --text-field (data.text_field) to the field that holds the text"
        return "data.format", f"{self.kind} rows need the fields {', '.join(self.fields)}"

    @property
    def masked(self) -> bool:
        return self.kind != "text"


def row_kind(fmt: str, field: str = "text", no_assistant: str = "error") -> tuple[str, RowKind]:
    """``--format`` / ``data.format`` split into the file format and the rows' kind (``chat`` and
    ``prompt_completion`` are kinds of rows in files whose format goes by their extension)."""
    from tessera.data.chat import KINDS

    if fmt in KINDS:
        return "auto", RowKind(fmt, field, no_assistant)
    return fmt, RowKind("text", field)


Where = Callable[[], str]


def _missing(row: Any, kind: RowKind, where: Where) -> DataError | None:
    missing = [f for f in kind.fields if f not in row] if isinstance(row, dict) else list(kind.fields)
    if not missing:
        return None
    setting, fix = kind.setting
    has = f" (fields: {', '.join(row)})" if isinstance(row, dict) else ""
    return fail(f"{where()}: no {missing[0]!r} field{has}", missing[0], fix, field=setting)


def jsonl_rows(shard: Shard, kind: RowKind) -> Iterator[tuple[tuple[Any, ...] | None, int, Where]]:
    """(values of the kind's fields, bytes, where) of each line whose first byte lies in the shard's
    range; None for a blank line."""
    with open(shard.path, "rb") as f:
        if shard.start > 0:
            f.seek(shard.start - 1)
            if f.read(1) != b"\n":
                f.readline()  # the line that started in the previous shard is that shard's
        while (pos := f.tell()) < shard.end:
            raw = f.readline()
            if not raw:
                break

            def where(pos: int = pos) -> str:  # the line number is counted only for a refused row
                return f"{shard.path}:{_line_of(shard.path, pos)}"

            if not raw.strip():
                yield None, len(raw), where
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise fail(
                    f"{where()}: not UTF-8 ({e.reason} at byte {pos + e.start})",
                    shard.path,
                    "re-encode the file as UTF-8",
                ) from None
            except json.JSONDecodeError as e:
                raise fail(
                    f"{where()}: not a JSON object ({e.msg})", shard.path, "fix or remove that line"
                ) from None
            missing = _missing(row, kind, where)
            if missing is not None:
                raise missing
            yield tuple(row[f] for f in kind.fields), len(raw), where


def check_text(value: Any, where: str, field: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise fail(
        f"{where}: {field!r} holds {type(value).__name__}, not text",
        field,
        "set --text-field (data.text_field) to a field of strings",
        field="data.text_field",
    )


def _size(values: tuple[Any, ...]) -> int:
    """A row's text bytes (what the progress bar counts for a table's rows)."""
    n = 0
    for v in values:
        if isinstance(v, str):
            n += len(v.encode("utf-8"))
        elif isinstance(v, list):
            n += sum(len(str(m.get("content", "")).encode("utf-8")) for m in v if isinstance(m, dict))
    return n


def table_rows(shard: Shard, kind: RowKind) -> Iterator[tuple[tuple[Any, ...] | None, int, Where]]:
    """Rows of a parquet row group or of an Arrow file (datasets' IPC stream, or the IPC file format)."""
    import pyarrow as pa

    fields = list(kind.fields)
    if shard.format == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(shard.path)
        names = pf.schema_arrow.names
        present = [f for f in fields if f in names]
        batches = pf.iter_batches(row_groups=[shard.row_group], columns=present)
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
    absent = [f for f in fields if f not in names]
    if absent:
        setting, fix = kind.setting
        raise fail(
            f"{shard.path}: no column {absent[0]!r} (columns: {', '.join(names)})",
            absent[0],
            fix.replace("field", "column"),
            field=setting,
        )
    row = 0
    for batch in batches:
        for values in zip(*(batch.column(f).to_pylist() for f in fields)):
            row += 1
            yield values, _size(values), lambda row=row: f"{shard.path} row {row}"


def text_rows(shard: Shard, kind: RowKind) -> Iterator[tuple[tuple[Any, ...] | None, int, Where]]:
    """A text file is one document (as ``datasets``' text builder with ``sample_by: document`` reads it)."""
    if kind.masked:
        raise fail(
            f"{shard.path}: a text file holds no {kind.kind} rows",
            shard.path,
            f"give {kind.kind} rows as jsonl / parquet / Arrow, with the fields {', '.join(kind.fields)}",
            field="data.format",
        )
    raw = Path(shard.path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise fail(
            f"{shard.path}:{line}: not UTF-8 ({e.reason} at byte {e.start})",
            shard.path,
            "re-encode the file as UTF-8",
        ) from None
    yield (text,), len(raw), lambda: f"{shard.path}:1"
