"""What a data section will be, known from the files alone: the corpus (or sources') content hash, the tokenizer hash
and the prepared-data hash (the cache key of the tensors), without tokenising and without torch.

``tessera run --resume`` compares these with the checkpoint's record before it launches a rank: a corpus
whose files were swapped (same sample count, so the ranks' sampler check passes) or another tokenizer
would otherwise continue the run on different data. :func:`data_key` is also the key
:func:`tessera.data.prepare_data` caches the tensors under, so both always agree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tessera.atomic import sha256_json
from tessera.config.schema import DataSection

# Bumped when the tensor layout produced from the same tokens changes (invalidates old cache entries).
DATA_VERSION = 2


def data_key(section: DataSection, *, content_hash: str, tokenizer_hash: str) -> dict[str, Any]:
    """The cache key of the prepared tensors: corpus, tokenizer and every option that shapes the rows."""
    key: dict[str, Any] = {
        "version": DATA_VERSION,
        "corpus": content_hash,
        "tokenizer": tokenizer_hash,
        "seq_len": section.seq_len,
        "packing": section.packing,
    }
    if section.eval.fraction > 0:  # absent otherwise: runs without a split keep their cache entries
        key["eval_fraction"] = section.eval.fraction
    if section.document_boundaries:
        key["document_boundaries"] = True
    if section.format in ("chat", "prompt_completion"):  # other rows and masks from the same files
        key["rows"] = section.format
        key["chat"] = section.chat.model_dump()
    return key


def data_identity(section: DataSection, *, root: Path | None = None) -> dict[str, str | None]:
    """``content_hash`` (always), ``tokenizer_hash`` and ``data_hash`` (None while the tokenizer is not
    built yet: a BPE trains on first use) of ``section``, as a run of it would record them."""
    from tessera.data.sources import recorded_tokenizer, source_specs
    from tessera.data.tokenizer import tokenizer_hash_on_disk, trains_bpe

    root = Path.cwd() if root is None else Path(root)
    cache_dir = root / section.cache_dir
    specs, content_hash, corpus = source_specs(section, root=root, cache_dir=cache_dir)
    directory = None
    if corpus is None and trains_bpe(section):  # data.sources: the tokenizer the prepared ones record
        directory = recorded_tokenizer(specs)
        if directory is None:
            return {"content_hash": content_hash, "tokenizer_hash": None, "data_hash": None}
    tok = tokenizer_hash_on_disk(section, content_hash, root=root, cache_dir=cache_dir, directory=directory)
    data = None
    if tok is not None:
        data = sha256_json(data_key(section, content_hash=content_hash, tokenizer_hash=tok))
    return {"content_hash": content_hash, "tokenizer_hash": tok, "data_hash": data}
