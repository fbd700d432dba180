"""The tokenizer of a data section: a locally trained byte-level BPE, or a local tokenizer directory.

``tokenizer: bpe`` trains a small byte-level BPE on the corpus itself (no hub, works for any text) and
caches it under ``<cache_dir>/tokenizers/<key>/`` where the key covers the corpus content hash, the
vocabulary size and the ``tokenizers`` version: the same recipe on the same files reuses it, any change
trains a new one. Otherwise ``tokenizer`` names a local directory (a tokenizer or a pretrained model);
``auto`` was resolved by the recipe schema (the pretrained model's directory, else ``bpe``).

The returned hash is over the saved files, not over the key, so two machines that trained "the same"
tokenizer can prove it and a run manifest pins exactly what was used.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tessera.config.schema import DataSection
from tessera.data._cache import build_lock, publish_dir, sha256_dir, sha256_json, temp_dir_beside
from tessera.data.corpus import Corpus
from tessera.errors import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"

# Files of a tokenizer / pretrained directory that decide how text is tokenized. Weights are left out on
# purpose: hashing a multi-GB checkpoint to fingerprint its tokenizer would dominate start-up.
_TOKENIZER_PREFIXES = (
    "tokenizer",
    "vocab",
    "merges",
    "special_tokens_map",
    "added_tokens",
    "spiece",
    "sentencepiece",
    "chat_template",
)
_TOKENIZER_NAMES = ("config.json",)
_TOKENIZER_SUFFIXES = (".model", ".tiktoken")


#: the special tokens whose ids a model's config (and generation config) names
SPECIAL_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


@dataclass
class TokenizerInfo:
    """A ready tokenizer with ``eos`` and ``pad`` set, where it lives, a hash of its files, and its special
    token ids as its files define them (``token_ids``: pad None where the files have no pad token, even
    though ``tokenizer`` then pads with eos)."""

    tokenizer: PreTrainedTokenizerBase
    tokenizer_dir: Path
    tokenizer_hash: str
    token_ids: dict[str, int | None]


def token_ids(tokenizer: PreTrainedTokenizerBase) -> dict[str, int | None]:
    """``bos_token_id``, ``eos_token_id``, ``pad_token_id`` of a tokenizer (None: it has no such token)."""
    return {k: getattr(tokenizer, k) for k in SPECIAL_TOKEN_IDS}


def trains_bpe(section: DataSection) -> bool:
    """Whether the section's tokenizer is a BPE trained on its corpus: ``bpe``, or ``auto`` in a data
    section on its own (a recipe resolves ``auto`` with its model: :class:`tessera.config.schema.Recipe`;
    without a model there is no pretrained tokenizer to default to)."""
    return section.tokenizer in ("bpe", "auto")


def load_tokenizer(
    section: DataSection, corpus: Corpus, *, root: Path, cache_dir: Path, held_out: int = 0
) -> TokenizerInfo:
    """The tokenizer a data section asks for (trained and cached, or loaded from a local directory). A BPE
    is trained on the corpus's documents but the last ``held_out`` (the eval split's, which it must not
    have seen)."""
    if trains_bpe(section):
        return _cached_bpe(corpus, section.vocab_size, cache_dir, held_out, section.eval.fraction)
    return local_tokenizer(section.tokenizer, root)


def bpe_cache_key(content_hash: str, vocab_size: int, eval_fraction: float = 0.0) -> str:
    """Cache key of a trained BPE; the library version is in it because merges may differ across versions,
    the eval fraction because the held-out documents are left out of its training text."""
    import tokenizers

    key: dict[str, object] = {
        "corpus": content_hash,
        "vocab_size": vocab_size,
        "tokenizers": tokenizers.__version__,
    }
    if eval_fraction > 0:
        key["held_out"] = eval_fraction
    return sha256_json(key)


def tokenizer_hash_on_disk(
    section: DataSection, content_hash: str, *, root: Path, cache_dir: Path, directory: str | None = None
) -> str | None:
    """The hash :func:`load_tokenizer` would report, from the files alone (no transformers, no training):
    None where it cannot be known yet (a BPE not trained yet, a directory that is not there: the ranks
    build it or report it)."""
    if directory is not None:  # the tokenizer data.sources were prepared with
        path = _local_dir(directory, root)
        return sha256_dir(path, _tokenizer_files(path)) if path.is_dir() else None
    if trains_bpe(section):
        target = _bpe_dir(content_hash, section.vocab_size, cache_dir, section.eval.fraction)
        return sha256_dir(target) if target.is_dir() else None
    path = _local_dir(section.tokenizer, root)
    return sha256_dir(path, _tokenizer_files(path)) if path.is_dir() else None


def _bpe_dir(content_hash: str, vocab_size: int, cache_dir: Path, eval_fraction: float) -> Path:
    return cache_dir / "tokenizers" / bpe_cache_key(content_hash, vocab_size, eval_fraction)


def _local_dir(spec: str, root: Path) -> Path:
    path = Path(spec).expanduser()
    return path if path.is_absolute() else root / path


def _cached_bpe(
    corpus: Corpus, vocab_size: int, cache_dir: Path, held_out: int, eval_fraction: float
) -> TokenizerInfo:
    """Reuse ``<cache>/tokenizers/<key>`` if present, else train it under a lock and publish atomically."""
    target = _bpe_dir(corpus.content_hash, vocab_size, cache_dir, eval_fraction)
    if not target.is_dir():
        with build_lock(target):
            if not target.is_dir():  # another rank may have built it while we waited for the lock
                tmp = temp_dir_beside(target)
                try:
                    docs = corpus.documents
                    _train_bpe(docs[: len(docs) - held_out], vocab_size).save_pretrained(str(tmp))
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
                publish_dir(tmp, target)
    # Always load what is on disk, never the in-memory trained object: every rank then uses the winner
    # of any race, byte for byte, and the hash below describes exactly what is used.
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(target), local_files_only=True)
    return TokenizerInfo(tok, target, sha256_dir(target), token_ids(tok))


def _train_bpe(documents: list[str], vocab_size: int) -> PreTrainedTokenizerBase:
    """Train a GPT-2 style byte-level BPE: any byte sequence encodes, so no ``<unk>`` is ever needed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents, trainer=trainer, length=len(documents))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)


def _tokenizer_files(path: Path) -> list[str]:
    """Names of the files in ``path`` that define tokenization (see ``_TOKENIZER_PREFIXES``)."""
    names = []
    for p in path.iterdir():
        if not p.is_file():
            continue
        n = p.name
        if n.startswith(_TOKENIZER_PREFIXES) or n in _TOKENIZER_NAMES or n.endswith(_TOKENIZER_SUFFIXES):
            names.append(n)
    return names


def check_tokenizer_dir(section: DataSection, *, root: Path) -> None:
    """The tokenizer directory a data section names exists and holds tokenizer files, checked without a
    tokenizer library (``tessera run`` checks it before launch); :class:`DataError` otherwise."""
    if not trains_bpe(section):
        _tokenizer_dir(section.tokenizer, root)


def _tokenizer_dir(spec: str, root: Path) -> tuple[Path, list[str]]:
    """The directory ``spec`` names and its tokenizer files (see ``_TOKENIZER_PREFIXES``)."""
    path = _local_dir(spec, root)
    if not path.is_dir():
        raise DataError(
            "tokenizer directory not found",
            field="data.tokenizer",
            value=spec,
            fix=f"use 'bpe' (train one on the corpus) or a local tokenizer / model directory "
            f"(relative paths are resolved against {root})",
        )
    names = _tokenizer_files(path)
    if set(names) - set(_TOKENIZER_NAMES):
        return path, names
    what = (
        "no tokenizer files (tokenizer.json, tokenizer_config.json, vocab/merges, *.model) in the directory"
    )
    fix = "point data.tokenizer at a directory written by save_pretrained(), or use 'bpe'"
    if (path / "config.json").is_file():  # config.json alone: a model saved without its tokenizer
        what += (
            " (a model saved without its tokenizer; data.tokenizer defaults to a pretrained model.path's own)"
        )
        fix = (
            f"save the tokenizer this model was trained with into {path} (tokenizer.save_pretrained), or set "
            "data.tokenizer to its directory (with data.tokenizer_override=true when model.pretrained)"
        )
    raise DataError(what, field="data.tokenizer", value=spec, fix=fix)


def local_tokenizer(spec: str, root: Path) -> TokenizerInfo:
    """Load a local tokenizer directory offline; a tokenizer without a pad token pads with eos."""
    path, names = _tokenizer_dir(spec, root)
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError... for broken dirs
        raise DataError(
            f"could not load the tokenizer: {type(exc).__name__}: {exc}",
            field="data.tokenizer",
            value=spec,
            fix="point data.tokenizer at a directory written by save_pretrained(), or use 'bpe'",
        ) from exc
    if tok.eos_token_id is None:
        raise DataError(
            "the tokenizer has no eos token (needed to separate documents)",
            field="data.tokenizer",
            value=spec,
            fix="set eos_token in its tokenizer_config.json, or use 'bpe'",
        )
    ids = token_ids(tok)  # before the pad below, which is this run's choice, not the tokenizer's
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return TokenizerInfo(tok, path, sha256_dir(path, names), ids)
