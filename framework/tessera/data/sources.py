"""What a recipe's data section reads, known from the files alone (no tokenizer, no torch).

Every source ends as a megatron-core indexed dataset the ranks map (:mod:`tessera.data.mapped`):

* ``prepared``: a directory written by ``tessera data prepare`` (``dataset.json`` + ``tokens.bin/.idx``);
  its identity is the sha256 of its ``dataset.json`` (which holds the sources' and the tokenizer's hashes);
* ``megatron``: a prefix ``PATH`` with ``PATH.bin`` / ``PATH.idx`` beside it, written by Megatron-LM's
  ``tools/preprocess_data.py``, Megatron-Bridge, NeMo or megatron-core's builder: used in place, never
  copied; its identity is the sha256 of the ``.idx`` and the size of the ``.bin`` (hashing a multi-GB
  ``.bin`` at every resume would cost minutes; a ``.bin`` of the same size that does not match its index
  is caught when it is opened);
* ``raw``: text / jsonl / parquet / Arrow files (``data.source`` / ``data.files``, or a ``data.sources``
  entry naming files): prepared once into ``<cache_dir>/prepared/<key>`` and shared by every run that
  reads the same bytes with the same tokenizer; its identity is the files' content hash.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tessera.atomic import sha256_file, sha256_json
from tessera.config.schema import DataSection
from tessera.data.indexfile import check_prefix
from tessera.errors import DataError


@dataclass
class SourceSpec:
    """One source of a data section, resolved and identified."""

    name: str
    kind: str
    """raw | prepared | megatron"""
    path: str
    weight: float
    identity: str
    files: list[Path] = field(default_factory=list)
    """a raw source's files, in order"""
    hashes: dict[str, str] = field(default_factory=dict)
    """sha256 of each raw file (hashed once, here)"""
    fmt: str = "auto"
    max_docs: int | None = None
    """documents kept (evenly strided): ``data.max_docs`` for ``data.files``; None = all"""
    record: dict[str, Any] | None = None
    """a prepared directory's dataset.json"""

    def prefix(self) -> str:
        """The indexed dataset's path prefix (a raw source's only once prepared: see the dataset module)."""
        if self.kind == "megatron":
            return self.path
        assert self.record is not None
        return str(Path(self.path) / self.record.get("prefix", "tokens"))

    def mask_prefix(self) -> str | None:
        """The loss mask's prefix (chat / prompt-completion rows), None for plain text."""
        name = (self.record or {}).get("loss_mask")
        return None if not name else str(Path(self.path) / name)


def _local(spec: str, root: Path) -> Path:
    path = Path(os.path.expanduser(spec))
    return path if path.is_absolute() else root / path


def source_specs(section: DataSection, *, root: Path, cache_dir: Path) -> tuple[list[SourceSpec], str, Any]:
    """The sources of ``section``, its content hash, and the :class:`Corpus` when the section reads
    ``data.source`` / ``data.files`` (None for ``data.sources``)."""
    if not section.sources:
        from tessera.data.corpus import load_corpus

        corpus = load_corpus(section, root=root, cache_dir=cache_dir)
        files = [Path(e["path"]) for e in corpus.fingerprint["files"]]
        spec = SourceSpec(
            name=section.source,
            kind="raw",
            path=section.source,
            weight=1.0,
            identity=corpus.content_hash,
            files=files,
            hashes={e["path"]: e["sha256"] for e in corpus.fingerprint["files"]},
            fmt="text" if section.source == "stdlib" else section.format,
            max_docs=None if section.source == "stdlib" else section.max_docs,  # stdlib: files picked already
        )
        return [spec], corpus.content_hash, corpus
    specs = [_entry(e.path, e.weight, e.name, section, root) for e in section.sources]
    content = sha256_json([[s.name, s.kind, s.identity, s.weight] for s in specs])
    return specs, content, None


def _entry(spec: str, weight: float, name: str | None, section: DataSection, root: Path) -> SourceSpec:
    path = _local(spec, root)
    name = name or spec
    if (path / "dataset.json").is_file():
        record = json.loads((path / "dataset.json").read_text())
        return SourceSpec(
            name, "prepared", str(path), weight, sha256_file(path / "dataset.json"), record=record
        )
    if Path(f"{path}.bin").is_file() or Path(f"{path}.idx").is_file():
        for ext in (".bin", ".idx"):
            if not Path(f"{path}{ext}").is_file():
                raise DataError(
                    f"{path}{ext} not found beside the other half of the indexed dataset",
                    field="data.sources",
                    value=spec,
                    fix="a megatron prefix PATH needs both PATH.bin and PATH.idx",
                )
        identity = sha256_json([sha256_file(Path(f"{path}.idx")), Path(f"{path}.bin").stat().st_size])
        return SourceSpec(name, "megatron", str(path), weight, identity)
    if path.is_dir() and not (path / "state.json").is_file():
        raise DataError(
            "a directory that is neither a prepared dataset (dataset.json) nor a datasets save_to_disk one",
            field="data.sources",
            value=spec,
            fix="name a `tessera data prepare` output, a megatron prefix (PATH for PATH.bin/.idx), files or a glob",
        )
    from tessera.data.prepare import resolve_sources, row_kind

    fmt = section.format
    try:
        files = [p for p, _ in resolve_sources([str(path)], row_kind(fmt)[0])]
    except DataError as e:
        raise DataError(e.message, field="data.sources", value=spec, fix=e.fix) from None
    hashes = {str(p): sha256_file(p) for p in files}
    identity = sha256_json(
        {"files": [hashes[str(p)] for p in files], "format": fmt, "text_field": section.text_field}
    )
    return SourceSpec(name, "raw", str(path), weight, identity, files=files, hashes=hashes, fmt=fmt)


def recorded_tokenizer(specs: list[SourceSpec]) -> str | None:
    """The tokenizer directory the prepared sources were all written with (None: no prepared source,
    or they disagree): what ``data.tokenizer: auto`` means for ``data.sources`` without a model's own."""
    paths = {(s.record or {}).get("tokenizer", {}).get("path") for s in specs if s.kind == "prepared"}
    if len(paths) == 1 and all(s.kind == "prepared" for s in specs):
        return paths.pop()
    return None


def describe_sources(section: DataSection, *, root: Path) -> list[str]:
    """A dry run's look at ``data.sources``, cheap at any size (no file is hashed or read whole): each
    source found, its kind, and for an indexed dataset its header checked against the file sizes."""
    lines = []
    for e in section.sources:
        path = _local(e.path, root)
        name = e.name or e.path
        if (path / "dataset.json").is_file():
            rec = json.loads((path / "dataset.json").read_text())
            prefix = str(path / rec.get("prefix", "tokens"))
            what = f"prepared, {rec.get('documents', 0):,} documents, {rec.get('tokens', 0):,} tokens"
        elif Path(f"{path}.idx").is_file():
            prefix, what = str(path), "megatron prefix"
        else:
            from tessera.data.prepare import resolve_sources, row_kind

            try:
                files = resolve_sources([str(path)], row_kind(section.format)[0])
            except DataError as err:
                raise DataError(err.message, field="data.sources", value=e.path, fix=err.fix) from None
            lines.append(
                f"{name}: {len(files)} raw file(s), prepared before the launch (weight {e.weight:g})"
            )
            continue
        seqs, _ = check_prefix(prefix)
        lines.append(f"{name}: {what}, {seqs:,} sequences (weight {e.weight:g})")
    return lines
