"""Turn a data section into fixed-shape training tensors, cached by content hash.

Two layouts, both ``[N, seq_len]`` int64:

* ``packing: true`` - documents are tokenized, each followed by eos, concatenated and cut into rows of
  exactly ``seq_len`` (the tail is dropped). Every position is a real token, so ``labels == input_ids``
  (HF causal LMs shift labels internally).
* ``packing: false`` - one row per document, truncated to ``seq_len`` (eos appended if it fits) and
  right-padded. Labels are -100 on the padding, so rows carry different numbers of target tokens; this
  is what exercises token-normalised gradient accumulation.

The result is cached at ``<cache_dir>/data/<key>.pt``; the key covers the corpus content hash, the
tokenizer hash, ``seq_len`` and ``packing``, so a hit is guaranteed to be the same tensors. On a hit the
corpus is never parsed (only hashed).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tessera.config.schema import DataSection
from tessera.data._cache import atomic_torch_save, build_lock, sha256_json
from tessera.data.corpus import Corpus, load_corpus
from tessera.data.identity import data_key
from tessera.data.tokenizer import load_tokenizer
from tessera.errors import DataError

IGNORE_INDEX = -100
_TENSORS = ("input_ids", "labels", "eval_input_ids", "eval_labels")


@dataclass
class PreparedData:
    """The training samples of a run and everything needed to pin them in a manifest."""

    input_ids: torch.Tensor
    """int64 ``[N, seq_len]`` token ids."""
    labels: torch.Tensor
    """int64 ``[N, seq_len]``; equals ``input_ids`` except -100 on padding (unpacked rows only)."""
    vocab_size: int
    """``len(tokenizer)``, including added special tokens: the smallest embedding that fits every id."""
    pad_id: int
    eos_id: int
    tokenizer_dir: str
    tokenizer_hash: str
    fingerprint: dict[str, Any]
    """files, content_hash, data_hash, num_docs, num_tokens, num_samples, seq_len, packing."""
    cache_file: str
    """the cached tensors these rows were read from"""
    eval_input_ids: torch.Tensor | None = None
    """the held-out rows (``data.eval``), built from documents never trained on; None without a split"""
    eval_labels: torch.Tensor | None = None
    token_ids: dict[str, int | None] | None = None
    """bos / eos / pad ids as the tokenizer's files define them (pad None where they have none, though
    ``pad_id`` is then eos): what a model trained from scratch is told (None: a record from before)"""

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def record(self) -> dict[str, Any]:
        """Everything but the tensors, as JSON: what :func:`load_prepared` needs to skip the hashing."""
        return {k: v for k, v in self.__dict__.items() if k not in _TENSORS}


def load_prepared(record: dict[str, Any]) -> PreparedData:
    """The data that :meth:`PreparedData.record` describes, read straight from its cache file.

    ``tessera run`` prepares the data once before launch and hands this record to the ranks, so that N
    ranks do not each re-hash every data file and reload the tokenizer.
    """
    payload = _read_cache(Path(record["cache_file"]))
    if payload is None:
        raise DataError(
            "the prepared data cache file is gone",
            field="data.cache_dir",
            value=record["cache_file"],
            fix="run `tessera run` again (it rebuilds the cache)",
        )
    return PreparedData(**_tensors(payload), **record)


def _tensors(payload: dict[str, Any]) -> dict[str, torch.Tensor | None]:
    """The row tensors of a cache payload (packed rows store no labels: they equal the input ids)."""
    out: dict[str, torch.Tensor | None] = {}
    for prefix in ("", "eval_"):
        ids = payload.get(prefix + "input_ids")
        labels = payload.get(prefix + "labels")
        out[prefix + "input_ids"] = ids
        out[prefix + "labels"] = None if ids is None else (ids.clone() if labels is None else labels)
    return out


def eval_split_hash(input_ids: torch.Tensor, labels: torch.Tensor) -> str:
    """sha256 of the eval rows (ids and labels, int64 little-endian): what the manifest pins."""
    import hashlib

    h = hashlib.sha256()
    for t in (input_ids, labels):
        h.update(t.contiguous().to(torch.int64).numpy().tobytes())
    return h.hexdigest()


def prepare_data(section: DataSection, *, root: Path | None = None) -> PreparedData:
    """Corpus -> tokenizer -> tensors, each step cached; safe to call from several ranks at once.

    ``root`` is the base for a relative ``data.cache_dir`` and relative ``data.files`` (default: cwd).
    """
    root = Path.cwd() if root is None else Path(root)
    cache_dir = root / section.cache_dir  # an absolute cache_dir replaces root here
    corpus = load_corpus(section, root=root, cache_dir=cache_dir)
    tok = load_tokenizer(section, corpus, root=root, cache_dir=cache_dir)
    tokenizer = tok.tokenizer
    eos_id, pad_id = int(tokenizer.eos_token_id), int(tokenizer.pad_token_id)
    data_hash = sha256_json(
        data_key(section, content_hash=corpus.content_hash, tokenizer_hash=tok.tokenizer_hash)
    )
    target = cache_dir / "data" / f"{data_hash}.pt"
    payload = _read_cache(target)
    if payload is None:
        with build_lock(target):
            payload = _read_cache(target)  # built by another rank while we waited
            if payload is None:
                payload = _build(section, corpus, tokenizer, eos_id=eos_id, pad_id=pad_id)
                atomic_torch_save(payload, target)
    rows = _tensors(payload)
    input_ids = rows["input_ids"]
    assert input_ids is not None
    fingerprint: dict[str, Any] = {
        "source": corpus.fingerprint["source"],
        "files": corpus.fingerprint["files"],
        "content_hash": corpus.content_hash,
        "data_hash": data_hash,
        "num_docs": int(payload["num_docs"]),
        "num_tokens": int(payload["num_tokens"]),
        "num_samples": int(input_ids.shape[0]),
        "seq_len": section.seq_len,
        "packing": section.packing,
    }
    if rows["eval_input_ids"] is not None:
        assert rows["eval_labels"] is not None
        fingerprint["eval"] = {
            "fraction": section.eval.fraction,
            "num_docs": int(payload["eval_docs"]),
            "num_samples": int(rows["eval_input_ids"].shape[0]),
            "sha256": eval_split_hash(rows["eval_input_ids"], rows["eval_labels"]),
        }
    return PreparedData(
        **rows,
        vocab_size=len(tokenizer),
        pad_id=pad_id,
        eos_id=eos_id,
        tokenizer_dir=str(tok.tokenizer_dir),
        tokenizer_hash=tok.tokenizer_hash,
        token_ids=tok.token_ids,
        fingerprint=fingerprint,
        cache_file=str(target),
    )


def _read_cache(path: Path) -> dict[str, Any] | None:
    """The cached payload, or None if absent. Written by rename, so a present file is complete."""
    if not path.is_file():
        return None
    return torch.load(path, map_location="cpu", weights_only=True)


def _build(
    section: DataSection, corpus: Corpus, tokenizer: Any, *, eos_id: int, pad_id: int
) -> dict[str, Any]:
    """Tokenize the corpus and lay it out as packed or padded rows; with ``data.eval`` the last documents
    are laid out the same way into separate eval rows (a document is in one split only)."""
    docs = corpus.documents
    encoded = _encode(tokenizer, docs)
    n_eval = _eval_docs(section, len(docs))
    out = _rows(section, encoded[: len(docs) - n_eval], eos_id=eos_id, pad_id=pad_id, what="training")
    out["num_docs"] = len(docs)
    if n_eval:
        held = _rows(section, encoded[len(docs) - n_eval :], eos_id=eos_id, pad_id=pad_id, what="eval")
        out.update(eval_input_ids=held["input_ids"], eval_labels=held["labels"], eval_docs=n_eval)
    return out


def _eval_docs(section: DataSection, num_docs: int) -> int:
    """Documents held out for eval: ``data.eval.fraction`` of them, at least one, never all."""
    if section.eval.fraction <= 0:
        return 0
    n = max(1, round(section.eval.fraction * num_docs))
    if n >= num_docs:
        raise DataError(
            f"data.eval.fraction holds out {n} of {num_docs} documents, leaving none to train on",
            field="data.eval.fraction",
            value=section.eval.fraction,
            fix="lower data.eval.fraction or read more documents (data.max_docs, data.files)",
        )
    return n


def _rows(
    section: DataSection, encoded: list[list[int]], *, eos_id: int, pad_id: int, what: str
) -> dict[str, Any]:
    """Token ids per document -> ``input_ids`` / ``labels`` rows (labels None when packed) + token count."""
    seq_len = section.seq_len
    labels: torch.Tensor | None
    if section.packing:
        stream = [t for ids in encoded for t in (*ids, eos_id)]
        rows = len(stream) // seq_len
        _require_samples(rows, section, f"{len(stream)} {what} tokens, fewer than seq_len={seq_len}")
        input_ids = torch.tensor(stream[: rows * seq_len], dtype=torch.int64).view(rows, seq_len)
        labels = None  # == input_ids; not stored twice, rebuilt on load
        num_tokens = rows * seq_len
    else:
        encoded = [ids for ids in encoded if ids]
        _require_samples(len(encoded), section, f"every {what} document tokenized to nothing")
        input_ids = torch.full((len(encoded), seq_len), pad_id, dtype=torch.int64)
        labels = torch.full((len(encoded), seq_len), IGNORE_INDEX, dtype=torch.int64)
        for i, ids in enumerate(encoded):
            row = ids[:seq_len] if len(ids) >= seq_len else [*ids, eos_id]
            # Mask by position, not by id: pad may equal eos (a pretrained tokenizer without a pad token).
            input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
            labels[i, : len(row)] = input_ids[i, : len(row)]
        num_tokens = int((labels != IGNORE_INDEX).sum())
    return {"input_ids": input_ids, "labels": labels, "num_tokens": num_tokens}


def _encode(tokenizer: Any, docs: list[str]) -> list[list[int]]:
    """Token ids per document, without special tokens: documents are separated by the eos we append,
    not by whatever BOS/EOS a pretrained tokenizer would add.

    A fast tokenizer goes straight to ``encode_batch_fast`` (no offsets): the same ids, about twice as
    fast as ``tokenizer(...)`` on whole source files.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_batch_fast"):
        return [enc.ids for enc in backend.encode_batch_fast(docs, add_special_tokens=False)]
    # verbose=False hides the "longer than model_max_length" warning: long documents are cut later.
    return tokenizer(docs, add_special_tokens=False, verbose=False)["input_ids"]


def _require_samples(rows: int, section: DataSection, why: str) -> None:
    """A run needs at least one sample; say what to change rather than fail later in the sampler."""
    if rows >= 1:
        return
    raise DataError(
        f"the corpus gives no training samples ({why})",
        field="data.seq_len",
        value=section.seq_len,
        fix="lower data.seq_len, raise data.max_docs, or add data.files",
    )
