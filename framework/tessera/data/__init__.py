"""Data: the corpus, the tokenizer, fixed-shape training tensors and a layout-invariant sampler.

``prepare_data(recipe.data)`` gives :class:`PreparedData` (cached by content hash under
``data.cache_dir``); :class:`StepSampler` picks, per optimizer step, the samples each data-parallel rank
consumes, the same set per step whatever the layout; :func:`data_identity` gives the hashes a run's data
will have without tokenising or importing torch (``tessera run --resume`` compares them before launch).

The names are imported on first use (PEP 562), so that the command line can import the torch-free parts
(``tessera.data.identity``, ``tessera.data.corpus``) without paying for torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "IGNORE_INDEX": "dataset",
    "PreparedData": "dataset",
    "load_prepared": "dataset",
    "prepare_data": "dataset",
    "Corpus": "corpus",
    "load_corpus": "corpus",
    "load_documents": "corpus",
    "StepSampler": "sampler",
    "TokenizerInfo": "tokenizer",
    "load_tokenizer": "tokenizer",
    "data_identity": "identity",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'tessera.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tessera.data.{_WHERE[name]}"), name)
