"""Data: the corpus, the tokenizer, fixed-shape training tensors and a layout-invariant sampler.

``prepare_data(recipe.data)`` gives :class:`PreparedData` (cached by content hash under
``data.cache_dir``); :class:`StepSampler` picks, per optimizer step, the samples each data-parallel rank
consumes, the same set per step whatever the layout.
"""

from __future__ import annotations

from tessera.data.corpus import Corpus, load_corpus, load_documents
from tessera.data.dataset import IGNORE_INDEX, PreparedData, load_prepared, prepare_data
from tessera.data.sampler import StepSampler
from tessera.data.tokenizer import TokenizerInfo, load_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "Corpus",
    "PreparedData",
    "StepSampler",
    "TokenizerInfo",
    "load_corpus",
    "load_documents",
    "load_prepared",
    "load_tokenizer",
    "prepare_data",
]
