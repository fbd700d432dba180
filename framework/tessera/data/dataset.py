"""A data section -> the memory-mapped rows a run trains and evaluates on.

Every source becomes a megatron-core indexed dataset (:mod:`tessera.data.sources`): raw text is prepared
once into ``<cache_dir>/prepared/<key>`` by :mod:`tessera.data.prepare` (in ``data.prepare.workers``
processes, cached by content), prepared directories and megatron prefixes are mapped as they are. The
rows (:mod:`tessera.data.mapped`) are read from the mapped files on demand, so a rank's memory does not
grow with the corpus:

* ``packing: true`` - documents, each followed by eos, joined and cut into rows of exactly ``seq_len``
  (the tail is dropped); every position is a real token, labels equal the input ids (HF causal LMs shift
  labels internally);
* ``packing: false`` - one row per document, truncated to ``seq_len`` and right-padded; labels are -100
  on the padding, so rows carry different numbers of target tokens (what exercises token-normalised
  gradient accumulation).

Those are the rows the in-memory path before it produced, token for token. ``data.eval.fraction`` holds
out the last documents of every source (a document is in one split only). Several sources are blended
by weight (:class:`tessera.data.mapped.BlendRows`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tessera.atomic import sha256_json
from tessera.config.schema import DataSection
from tessera.data.chat import KINDS
from tessera.data.identity import data_key
from tessera.data.mapped import (
    IGNORE_INDEX,
    BlendRows,
    ConcatRows,
    DocumentRows,
    PackedRows,
    Rows,
    TokenFile,
    strided,
)
from tessera.data.sources import SourceSpec, recorded_tokenizer, source_specs
from tessera.data.tokenizer import TokenizerInfo, load_tokenizer, local_tokenizer, trains_bpe
from tessera.errors import DataError

__all__ = ["IGNORE_INDEX", "PreparedData", "eval_docs", "load_prepared", "prepare_data"]
_ROWS = ("rows", "eval_rows")


@dataclass
class PreparedData:
    """The training rows of a run and everything needed to pin them in a manifest."""

    rows: Rows
    """the training rows (``rows.batch(indices, epoch)``: ``input_ids`` / ``labels`` int64 ``[n, seq_len]``)"""
    vocab_size: int
    """``len(tokenizer)``, including added special tokens: the smallest embedding that fits every id."""
    pad_id: int
    eos_id: int
    tokenizer_dir: str
    tokenizer_hash: str
    fingerprint: dict[str, Any]
    """source, files, content_hash, data_hash, num_docs, num_tokens, num_samples, seq_len, packing,
    sources (each: name, kind, path, identity, weight, documents, tokens, rows), eval"""
    spec: dict[str, Any]
    """what :func:`load_prepared` re-opens the rows from: the prefixes and the document selection"""
    eval_rows: Rows | None = None
    """the held-out rows (``data.eval``), from documents never trained on; None without a split"""
    token_ids: dict[str, int | None] | None = None
    """bos / eos / pad ids as the tokenizer's files define them (pad None where they have none, though
    ``pad_id`` is then eos): what a model trained from scratch is told"""

    def __len__(self) -> int:
        return len(self.rows)

    def record(self) -> dict[str, Any]:
        """Everything but the rows, as JSON: what :func:`load_prepared` needs to skip the hashing."""
        return {k: v for k, v in self.__dict__.items() if k not in _ROWS}


def load_prepared(record: dict[str, Any]) -> PreparedData:
    """The data that :meth:`PreparedData.record` describes, mapped again from its files.

    ``tessera run`` prepares the data once before launch (rank 0) and hands this record to the ranks,
    so that N ranks do not each re-hash every data file and reload the tokenizer.
    """
    rows, eval_rows = build_rows(record["spec"])
    return PreparedData(rows=rows, eval_rows=eval_rows, **record)


def build_rows(spec: dict[str, Any]) -> tuple[Rows, Rows | None]:
    """The training and held-out rows ``spec`` describes (see :func:`prepare_data`)."""
    seq_len, packing, pad_id = spec["seq_len"], spec["packing"], spec["pad_id"]
    train: list[Rows] = []
    held: list[Rows] = []
    for src in spec["sources"]:
        tf = TokenFile(src["prefix"])
        mask = TokenFile(src["mask"]) if src.get("mask") else None
        if mask is not None and not np.array_equal(mask.lengths, tf.lengths):
            raise DataError(
                f"{src['mask']}.idx does not describe the documents of {src['prefix']}.idx",
                field="data.sources",
                value=src["name"],
                fix="prepare the source again (tessera data prepare)",
            )
        picks = strided(tf.num_docs, src["max_docs"])
        n_eval = src["eval_docs"]
        for docs, out in ((picks[: len(picks) - n_eval], train), (picks[len(picks) - n_eval :], held)):
            if out is held and not n_eval:
                continue
            if packing:
                bounds = spec.get("document_boundaries", False)
                out.append(PackedRows(tf, docs, seq_len, src["name"], mask=mask, boundaries=bounds))
            else:
                too_long = src.get("too_long", "truncate")
                out.append(DocumentRows(tf, docs, seq_len, pad_id, src["name"], mask=mask, too_long=too_long))
    names = [s["name"] for s in spec["sources"]]
    if len(train) == 1:
        rows: Rows = train[0]
    else:
        blend = spec["blend"]
        cache = Path(blend["cache"]) if blend.get("cache") else None
        rows = BlendRows(train, [s["weight"] for s in spec["sources"]], names, blend["size"], cache)
    eval_rows = None if not held else held[0] if len(held) == 1 else ConcatRows(held, names)
    rows.perm_cache = Path(spec["perm_cache"]) if spec.get("perm_cache") else None
    return rows, eval_rows


def eval_docs(section: DataSection, num_docs: int, source: str = "the corpus") -> int:
    """Documents held out for eval: ``data.eval.fraction`` of them, at least one, never all."""
    if section.eval.fraction <= 0:
        return 0
    n = max(1, round(section.eval.fraction * num_docs))
    if n >= num_docs:
        raise DataError(
            f"data.eval.fraction holds out {n} of the {num_docs} documents of {source}, leaving none to train on",
            field="data.eval.fraction",
            value=section.eval.fraction,
            fix="lower data.eval.fraction or read more documents (data.max_docs, data.files, data.sources)",
        )
    return n


def prepare_data(
    section: DataSection,
    *,
    root: Path | None = None,
    show_progress: bool = False,
    progress: Callable[[], None] | None = None,
) -> PreparedData:
    """Sources -> tokenizer -> prepared, mapped rows; safe to call from several ranks at once (the
    preparation's lock lets one build while the others wait).

    ``root`` is the base for a relative ``data.cache_dir`` and relative paths (default: cwd);
    ``show_progress``: a progress bar while raw sources are prepared; ``progress``: called as they advance.
    """
    root = Path.cwd() if root is None else Path(root)
    cache_dir = root / section.cache_dir  # an absolute cache_dir replaces root here
    specs, content_hash, corpus = source_specs(section, root=root, cache_dir=cache_dir)
    tok = _tokenizer(section, specs, corpus, root=root, cache_dir=cache_dir)
    tokenizer = tok.tokenizer
    eos_id, pad_id = int(tokenizer.eos_token_id), int(tokenizer.pad_token_id)
    data_hash = sha256_json(data_key(section, content_hash=content_hash, tokenizer_hash=tok.tokenizer_hash))
    entries = []
    for s in specs:
        prefix = _prefix(s, section, tok, cache_dir, show_progress, progress)
        tf = TokenFile(prefix)
        picked = len(strided(tf.num_docs, s.max_docs))
        entries.append(
            {
                "name": s.name,
                "prefix": prefix,
                "mask": s.mask_prefix(),
                "too_long": section.chat.too_long if s.mask_prefix() else "truncate",
                "weight": s.weight,
                "max_docs": s.max_docs,
                "eval_docs": eval_docs(section, picked, s.name if section.sources else "the corpus"),
                "documents": picked,
            }
        )
    spec: dict[str, Any] = {
        "seq_len": section.seq_len,
        "packing": section.packing,
        "document_boundaries": section.document_boundaries,
        "pad_id": pad_id,
        "sources": [{k: v for k, v in e.items() if k != "documents"} for e in entries],
    }
    if len(specs) > 1:
        spec["blend"] = {"size": 0, "cache": None}
        train, _ = build_rows({**spec, "blend": {"size": 1, "cache": None}})  # parts' sizes
        assert isinstance(train, BlendRows)
        for part, e in zip(train.parts, entries):
            if len(part) == 0:
                raise DataError(
                    f"source {e['name']} gives no training rows of seq_len={section.seq_len}",
                    field="data.sources",
                    value=e["name"],
                    fix="remove it from the blend, give it more documents, or lower data.seq_len",
                )
        size = sum(len(p) for p in train.parts)
        spec["blend"] = {"size": size, "cache": str(cache_dir / "blends" / f"{data_hash[:32]}-{size}")}
    spec["perm_cache"] = str(cache_dir / "orders")  # shuffle permutations: saved once, mapped by every rank
    rows, eval_rows = build_rows(spec)
    _require_samples(len(rows), section)
    fingerprint = _fingerprint(section, specs, entries, rows, eval_rows, content_hash, data_hash, corpus)
    return PreparedData(
        rows=rows,
        eval_rows=eval_rows,
        vocab_size=len(tokenizer),
        pad_id=pad_id,
        eos_id=eos_id,
        tokenizer_dir=str(tok.tokenizer_dir),
        tokenizer_hash=tok.tokenizer_hash,
        token_ids=tok.token_ids,
        fingerprint=fingerprint,
        spec=spec,
    )


def _tokenizer(
    section: DataSection, specs: list[SourceSpec], corpus: Any, *, root: Path, cache_dir: Path
) -> TokenizerInfo:
    """The section's tokenizer. A BPE is trained on the training documents only (never the held-out
    ones) of ``data.source`` / ``data.files``; ``data.sources`` name a tokenizer directory, or are all
    prepared with one (then that one is used)."""
    if corpus is not None and trains_bpe(section) and section.format in KINDS:
        raise DataError(
            f"data.format={section.format} needs a tokenizer directory (a trained BPE has no chat template "
            "and no idea of turns)",
            field="data.tokenizer",
            value=section.tokenizer,
            fix="set data.tokenizer to a tokenizer directory (with a chat template for chat rows), or use "
            "model.pretrained (its own tokenizer)",
        )
    if corpus is not None:
        docs = corpus.documents if trains_bpe(section) else None
        held = eval_docs(section, len(docs)) if docs is not None else 0
        return load_tokenizer(section, corpus, root=root, cache_dir=cache_dir, held_out=held)
    if trains_bpe(section):
        recorded = recorded_tokenizer(specs)
        if recorded is None:
            raise DataError(
                "data.sources need a tokenizer directory: a BPE is trained only on data.source / data.files, "
                "and these sources do not all record the same tokenizer",
                field="data.tokenizer",
                value=section.tokenizer,
                fix="set data.tokenizer to the tokenizer directory the sources were (or are to be) tokenized with",
            )
        return local_tokenizer(recorded, root)
    tok = local_tokenizer(section.tokenizer, root)
    for s in specs:
        was = (s.record or {}).get("tokenizer", {})
        if (
            s.kind == "prepared"
            and was.get("sha256") != tok.tokenizer_hash
            and not section.tokenizer_override
        ):
            raise DataError(
                f"source {s.name} was prepared with the tokenizer {was.get('path')} (sha256 "
                f"{str(was.get('sha256'))[:12]}), not with {tok.tokenizer_dir} ({tok.tokenizer_hash[:12]})",
                field="data.tokenizer",
                value=section.tokenizer,
                fix=f"set data.tokenizer to {was.get('path')}, prepare the source again with this tokenizer, "
                "or set data.tokenizer_override=true if the two tokenize alike",
            )
    return tok


def _prefix(
    s: SourceSpec,
    section: DataSection,
    tok: TokenizerInfo,
    cache_dir: Path,
    show_progress: bool,
    progress: Callable[[], None] | None,
) -> str:
    """The indexed dataset of a source: a raw one prepared (or found prepared) in the cache."""
    if s.kind != "raw":
        return s.prefix()
    from tessera.data.prepare import prepare_cached

    record = prepare_cached(
        s.files,
        info=tok,
        cache_dir=cache_dir,
        workers=section.prepare.workers,
        text_field=section.text_field,
        fmt=s.fmt,
        no_assistant=section.chat.no_assistant,
        hashes=s.hashes,
        show_progress=show_progress,
        progress=progress,
    )
    s.record = record
    s.path = record["dir"]
    return s.prefix()


def _fingerprint(
    section: DataSection,
    specs: list[SourceSpec],
    entries: list[dict[str, Any]],
    rows: Rows,
    eval_rows: Rows | None,
    content_hash: str,
    data_hash: str,
    corpus: Any,
) -> dict[str, Any]:
    """What the manifest records about the data (the pin a resume is checked against)."""
    parts = rows.parts if isinstance(rows, BlendRows) else [rows]
    out: dict[str, Any] = {
        "source": section.source if corpus is not None else "sources",
        "files": corpus.fingerprint["files"] if corpus is not None else [],
        "content_hash": content_hash,
        "data_hash": data_hash,
        "num_docs": sum(e["documents"] for e in entries),
        "num_tokens": len(rows) * section.seq_len if section.packing else sum(p.num_tokens for p in parts),
        "num_samples": len(rows),
        "seq_len": section.seq_len,
        "packing": section.packing,
        "document_boundaries": section.document_boundaries,
        "sources": [
            {
                "name": s.name,
                "kind": s.kind,
                "path": s.path,
                "identity": s.identity,
                "dataset_json_sha256": (s.record or {}).get("key") if s.kind == "raw" else None,
                "weight": e["weight"],
                "documents": e["documents"],
                "rows": len(p),
                "format": (s.record or {}).get("rows", "text"),
                "skipped": {
                    **(s.record or {}).get("skipped", {}),
                    **({"too_long": p.skipped} if getattr(p, "skipped", 0) else {}),
                },
            }
            for s, e, p in zip(specs, entries, parts)
        ],
    }
    if isinstance(rows, BlendRows):
        for f, share, draws in zip(out["sources"], rows.weights, rows.draws):
            f["share"], f["rows_per_pass"] = float(share), int(draws)
    if eval_rows is not None:
        out["eval"] = {
            "fraction": section.eval.fraction,
            "num_docs": sum(e["eval_docs"] for e in entries),
            "num_samples": len(eval_rows),
            "sha256": eval_split_hash(eval_rows),
        }
    return out


def eval_split_hash(rows: Rows, chunk: int = 1024) -> str:
    """sha256 of the held-out rows (ids then labels of each chunk of rows, int64 little-endian): what the
    manifest pins; read in chunks, never the whole split at once."""
    h = hashlib.sha256()
    for a in range(0, len(rows), chunk):
        b = rows.batch(range(a, min(a + chunk, len(rows))))
        h.update(b["input_ids"].numpy().astype("<i8").tobytes())
        h.update(b["labels"].numpy().astype("<i8").tobytes())
    return h.hexdigest()


def _require_samples(rows: int, section: DataSection) -> None:
    """A run needs at least one sample; say what to change rather than fail later in the sampler."""
    if rows >= 1:
        return
    raise DataError(
        f"the data gives no training samples (fewer tokens than seq_len={section.seq_len}, or no document)",
        field="data.seq_len",
        value=section.seq_len,
        fix="lower data.seq_len, raise data.max_docs, or add data.files / data.sources",
    )
