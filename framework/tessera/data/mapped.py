"""Training rows read from memory-mapped indexed datasets (megatron-core's ``.bin`` / ``.idx``).

A rank maps the index and reads only the rows of its micro-batches: its memory does not grow with the
corpus (the page cache holds what was read; nothing is copied into the process but the rows of a step).

* :class:`TokenFile` opens a prefix after checking that the ``.idx`` and the ``.bin`` belong together
  (a header that is not megatron's, sizes that do not match the file, a ``.bin`` shorter or longer than
  the index says are refused with the file named: megatron-core would assert or read garbage), maps the
  index as megatron-core's ``IndexedDataset`` does and reads rows from the ``.bin`` with ``pread``.
* :class:`PackedRows`: documents (each stored with its eos) joined and cut into rows of ``seq_len`` —
  row ``i`` is tokens ``[i*L, (i+1)*L)`` of the selected documents' stream, the same rows as packing the
  tokenized documents in memory. Written by hand because megatron-core's ``GPTDataset`` has other rows
  (``seq_len + 1`` tokens overlapping by one, documents shuffled per epoch by its own index): the order
  belongs to :class:`tessera.data.sampler.StepSampler`, whose position is layout-free, and a packed row
  of a contiguous stream is one slice of the mapped file.
* :class:`DocumentRows`: one row per document, truncated to ``seq_len`` and right-padded (labels -100 on
  the padding), as ``data.packing: false`` does.
* :class:`BlendRows`: a weighted mixture of several sources. The sequence of sources comes from
  megatron-core's ``build_blending_indices`` (the compiled helper ``BlendedDataset`` uses: at every
  position the source furthest behind its weight); the row inside a source advances by the source's
  draws per pass, so a downsampled source shows other rows in the next epoch and an upsampled one wraps.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tessera.data._cache import randperm
from tessera.data.indexfile import REPREPARE, bad_source, check_prefix, index_arrays, index_dtype
from tessera.errors import DataError

IGNORE_INDEX = -100


class TokenFile:
    """One indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``), checked and mapped."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        counts = check_prefix(prefix)
        # The index is read here as megatron-core's ``IndexedDataset`` reads it (the same arrays at the
        # same offsets; interop is tested both ways), without importing megatron-core: a rank of the
        # deepspeed or ddp engine would pay ~1.5 s of start-up for it.
        idx = Path(prefix + ".idx")
        self.dtype = np.dtype(index_dtype(idx))
        self.lengths, self.pointers, self.doc_index = index_arrays(idx, *counts)
        if len(self.doc_index) and (self.doc_index[0] != 0 or self.doc_index[-1] != len(self.lengths)):
            raise bad_source(
                prefix, f"{prefix}.idx: its document index does not cover its sequences", REPREPARE
            )
        if not self._contiguous():
            raise bad_source(
                prefix, f"{prefix}.idx: sequence pointers are not contiguous in the .bin", REPREPARE
            )
        # Rows are read with pread, not through a mapping of the .bin: a mapped page read stays in the
        # process's RSS (a fault maps a whole page-cache folio, up to 2 MiB), so a rank's RSS would grow
        # with the rows it has read - 136 MiB after 20 steps on a 2 GiB corpus, measured. A read costs
        # one system call per row piece and leaves only the page cache (shared, reclaimable) behind.
        self._bin = Path(prefix + ".bin")
        self._fd: int | None = None
        self.num_tokens = self._bin.stat().st_size // self.dtype.itemsize

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens ``[start, start + count)`` of the ``.bin``."""
        if self._fd is None:
            self._fd = os.open(self._bin, os.O_RDONLY)
        size = self.dtype.itemsize
        raw = os.pread(self._fd, count * size, start * size)
        if len(raw) != count * size:
            raise bad_source(self.prefix, f"{self._bin} ends before token {start + count:,}", REPREPARE)
        return np.frombuffer(raw, dtype=self.dtype)

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)  # type: ignore[arg-type]

    def _contiguous(self, samples: int = 1024) -> bool:
        """Each sequence starts where the one before it ends (what packing a stream relies on), checked at
        ``samples`` places spread over the index: reading all of it would map O(documents) pages at every
        run's start (megatron-core's builder always writes contiguous pointers; this catches an index
        written by something else)."""
        n, size = len(self.lengths), self.dtype.itemsize
        if n == 0:
            return True
        if self.pointers[0] != 0:
            return False
        at = (
            np.unique(np.linspace(0, n - 2, num=min(samples, max(n - 1, 1))).astype(np.int64))
            if n > 1
            else []
        )
        for i in at:
            if int(self.pointers[i + 1]) != int(self.pointers[i]) + int(self.lengths[i]) * size:
                return False
        return True

    @property
    def num_docs(self) -> int:
        return len(self.doc_index) - 1

    def doc_bounds(self, docs: np.ndarray | range) -> tuple[np.ndarray, np.ndarray]:
        """Token start and end of each document in ``docs`` (a document is one or more sequences)."""
        docs = np.asarray(docs, dtype=np.int64)
        first, last = self.doc_index[docs], self.doc_index[docs + 1] - 1
        start = self.pointers[first] // self.dtype.itemsize
        end = self.pointers[last] // self.dtype.itemsize + self.lengths[last]
        return start.astype(np.int64), end.astype(np.int64)


def strided(n: int, k: int | None) -> np.ndarray | range:
    """``k`` indices spread evenly over ``range(n)`` (all of them if ``k`` is None or ``>= n``): the
    documents ``data.max_docs`` keeps (evenly strided so a small CPU corpus spans the whole source).
    All of them is a ``range``: two numbers, however many documents."""
    if k is None or k >= n:
        return range(n)
    return (np.arange(k, dtype=np.int64) * n) // k


# ---- rows ------------------------------------------------------------------------------------------


class Rows(ABC):
    """The rows of one split: ``len``, ``batch`` of row indices, label tokens and tokens per source."""

    seq_len: int
    names: list[str]
    #: the rows come in an order of their own (a blend: the weights hold at every step), so the sampler
    #: takes them in sequence rather than shuffling them (see :class:`BlendRows`)
    own_order = False
    #: where shuffle permutations of these rows are saved and mapped from (the data cache); None: memory
    perm_cache: Path | None = None

    def set_seed(self, seed: int) -> None:
        """The run's seed, for rows that shuffle themselves (a blend shuffles inside each source)."""
        del seed  # rows taken in the sampler's order have no use for it

    @abstractmethod
    def __len__(self) -> int: ...

    #: whether the rows carry a loss mask (chat / prompt-completion sources)
    masked = False

    @abstractmethod
    def rows(self, indices: Sequence[int], epoch: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(ids, lengths): ``[n, seq_len]`` token ids and each row's real (unpadded) length."""

    def masks(self, indices: Sequence[int], epoch: int = 0) -> np.ndarray | None:
        """``[n, seq_len]`` uint8, 1 where the loss is taken (before padding); None: everywhere."""
        return None

    #: packed rows restart their position ids at each document (``data.document_boundaries``)
    boundaries = False

    def doc_starts(self, indices: Sequence[int], epoch: int = 0) -> np.ndarray | None:
        """``[n, seq_len]`` bool, True where a document starts inside a row (not at its first position);
        None: rows are not cut at documents."""
        return None

    def _off(self, indices: Sequence[int], epoch: int, n: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Where a row's labels are -100 (padding, a loss mask's 0, a document's first token: it is not
        predicted from the document before it), and the document starts (None without boundaries)."""
        off = np.arange(self.seq_len)[None, :] >= n[:, None]
        mask = self.masks(indices, epoch)
        if mask is not None:
            off |= mask == 0
        starts = self.doc_starts(indices, epoch) if self.boundaries else None
        if starts is not None:
            off |= starts
        return off, starts

    def batch(self, indices: Sequence[int], epoch: int = 0) -> dict[str, torch.Tensor]:
        """``input_ids`` / ``labels`` (int64 ``[n, seq_len]``) of rows ``indices`` in pass ``epoch``:
        labels are -100 on padding and where a loss mask is 0."""
        ids, n = self.rows(indices, epoch)
        input_ids = torch.from_numpy(ids.astype(np.int64))
        labels = input_ids.clone()
        off, starts = self._off(indices, epoch, n)
        if off.any():
            labels[torch.from_numpy(off)] = IGNORE_INDEX
        out = {"input_ids": input_ids, "labels": labels}
        if starts is not None:  # positions count from each document's first token
            pos = np.arange(self.seq_len)[None, :].repeat(len(indices), 0)
            last = np.maximum.accumulate(np.where(starts, pos, 0), axis=1)
            out["position_ids"] = torch.from_numpy(pos - last)
        return out

    @abstractmethod
    def lengths(self, indices: Sequence[int], epoch: int = 0) -> np.ndarray:
        """Each row's real tokens (``seq_len`` for a packed row)."""

    def label_tokens(self, indices: Sequence[int], epoch: int = 0) -> int:
        """Label tokens of rows ``indices`` after the causal shift (what the loss is normalised by). With a
        loss mask this reads the mask bytes of the rows (one byte a token), never their tokens."""
        n = self.lengths(indices, epoch)
        if not self.masked and not self.boundaries:
            return int((n - 1).sum())
        off, _ = self._off(indices, epoch, n)
        return int((~off)[:, 1:].sum())

    def tokens_by_source(self, indices: Sequence[int], epoch: int = 0) -> np.ndarray:
        """Real tokens of rows ``indices`` per source (one source: everything)."""
        return np.array([int(self.lengths(indices, epoch).sum())])


@dataclass
class _Stream:
    """Selected documents of one file as a token stream: runs of contiguous tokens."""

    starts: np.ndarray
    """token offset of each run in the file"""
    cum: np.ndarray
    """stream offset of each run (``len(starts) + 1``, the last is the stream's length)"""


def _stream(tf: TokenFile, docs: np.ndarray | range) -> _Stream:
    """The documents ``docs`` (ascending) as runs of contiguous tokens: one run for a range of
    documents, so a source read whole costs two numbers however large it is."""
    if len(docs) == 0:
        return _Stream(np.zeros(0, np.int64), np.zeros(1, np.int64))
    if isinstance(docs, range):  # contiguous: its first document's start, its last one's end
        start, _ = tf.doc_bounds(np.array([docs[0]]))
        _, end = tf.doc_bounds(np.array([docs[-1]]))
        return _Stream(start, np.array([0, int(end[0] - start[0])], dtype=np.int64))
    start, end = tf.doc_bounds(docs)
    breaks = np.flatnonzero(start[1:] != end[:-1]) + 1  # where a document does not follow the last
    first = np.concatenate([[0], breaks])
    last = np.concatenate([breaks, [len(docs)]]) - 1
    starts, ends = start[first], end[last]
    return _Stream(starts, np.concatenate([[0], np.cumsum(ends - starts)]))


class PackedRows(Rows):
    """Rows of ``seq_len`` tokens cut from the stream of the selected documents (the tail is dropped)."""

    def __init__(
        self,
        tf: TokenFile,
        docs: np.ndarray | range,
        seq_len: int,
        name: str = "data",
        mask: TokenFile | None = None,
        boundaries: bool = False,
    ):
        self.tf, self.seq_len, self.names, self.mask = tf, seq_len, [name], mask
        self.masked, self.boundaries = mask is not None, boundaries
        self.stream = _stream(tf, docs)
        self.num_tokens = int(self.stream.cum[-1])

    def __len__(self) -> int:
        return self.num_tokens // self.seq_len

    def rows(self, indices: Sequence[int], epoch: int = 0) -> tuple[np.ndarray, np.ndarray]:
        return self._gather(self.tf, indices), np.full(len(indices), self.seq_len)

    def masks(self, indices: Sequence[int], epoch: int = 0) -> np.ndarray | None:
        return None if self.mask is None else self._gather(self.mask, indices)

    def doc_starts(self, indices: Sequence[int], epoch: int = 0) -> np.ndarray | None:
        """From the index alone (no token read): the documents whose first token lies inside each row."""
        L, s, tf = self.seq_len, self.stream, self.tf
        out = np.zeros((len(indices), L), dtype=bool)
        size = tf.dtype.itemsize
        for k, i in enumerate(indices):
            pos, filled = int(i) * L, 0
            run = int(np.searchsorted(s.cum, pos, side="right")) - 1
            while filled < L:
                off = pos + filled - int(s.cum[run])
                take = min(L - filled, int(s.cum[run + 1]) - pos - filled)
                a = int(s.starts[run]) + off  # file tokens [a, a + take) fill the row from ``filled``
                lo, hi = np.searchsorted(tf.pointers, [a * size, (a + take) * size], side="left")
                seqs = np.arange(lo, hi)
                d_lo, d_hi = np.searchsorted(tf.doc_index, [lo, hi], side="left")
                firsts = seqs[np.isin(seqs, tf.doc_index[d_lo:d_hi])]  # sequences that open a document
                at = filled + tf.pointers[firsts] // size - a
                out[k, at[at > 0]] = True
                filled, run = filled + take, run + 1
        return out

    def _gather(self, tf: TokenFile, indices: Sequence[int]) -> np.ndarray:
        """Rows ``indices`` of the stream, read from ``tf`` (the tokens, or their mask)."""
        L, s = self.seq_len, self.stream
        out = np.empty((len(indices), L), dtype=tf.dtype)
        for k, i in enumerate(indices):
            if not 0 <= i < len(self):
                raise IndexError(f"row {i} of {len(self)}")
            pos, filled = int(i) * L, 0
            run = int(np.searchsorted(s.cum, pos, side="right")) - 1
            while filled < L:  # a row spans runs only where documents were left out between them
                off = pos + filled - int(s.cum[run])
                take = min(L - filled, int(s.cum[run + 1]) - pos - filled)
                a = int(s.starts[run]) + off
                out[k, filled : filled + take] = tf.read(a, take)
                filled, run = filled + take, run + 1
        return out

    def lengths(self, indices: Sequence[int], epoch: int = 0) -> np.ndarray:
        return np.full(len(indices), self.seq_len)


class DocumentRows(Rows):
    """One row per selected document (a document of only its eos is no row), truncated and padded.

    ``too_long``: a document longer than ``seq_len`` is cut (``truncate``), left out (``skip``, counted in
    :attr:`skipped`) or refused (``error``), the recipe's explicit choice for fine-tuning rows."""

    def __init__(
        self,
        tf: TokenFile,
        docs: np.ndarray | range,
        seq_len: int,
        pad_id: int,
        name: str = "data",
        mask: TokenFile | None = None,
        too_long: str = "truncate",
    ):
        self.tf, self.seq_len, self.pad_id, self.names, self.mask = tf, seq_len, pad_id, [name], mask
        self.masked = mask is not None
        start, end = tf.doc_bounds(docs)
        keep = end - start > 1
        longer = keep & (end - start > seq_len)
        self.skipped = 0
        if longer.any() and too_long == "error":
            first = int(np.asarray(docs)[np.flatnonzero(longer)[0]])
            raise DataError(
                f"{int(longer.sum())} rows of {name} are longer than seq_len={seq_len} (the first: document "
                f"{first}, {int((end - start)[longer][0])} tokens)",
                field="data.chat.too_long",
                value=too_long,
                fix="set data.chat.too_long to truncate (cut them) or skip (leave them out, counted), or raise "
                "data.seq_len",
            )
        if too_long == "skip":
            self.skipped = int(longer.sum())
            keep &= ~longer
        self.start = start[keep]
        self.len = np.minimum(end[keep] - start[keep], seq_len)

    def __len__(self) -> int:
        return len(self.start)

    def rows(self, indices: Sequence[int], epoch: int = 0) -> tuple[np.ndarray, np.ndarray]:
        n = self.len[np.asarray(indices, dtype=np.int64)]
        return self._gather(self.tf, indices, n, self.pad_id), n

    def masks(self, indices: Sequence[int], epoch: int = 0) -> np.ndarray | None:
        if self.mask is None:
            return None
        return self._gather(self.mask, indices, self.len[np.asarray(indices, dtype=np.int64)], 0)

    def _gather(self, tf: TokenFile, indices: Sequence[int], n: np.ndarray, fill: int) -> np.ndarray:
        out = np.full((len(indices), self.seq_len), fill, dtype=np.int64)
        for k, i in enumerate(indices):
            a = int(self.start[i])
            out[k, : n[k]] = tf.read(a, int(n[k]))
        return out

    def lengths(self, indices: Sequence[int], epoch: int = 0) -> np.ndarray:
        return self.len[np.asarray(indices, dtype=np.int64)]

    @cached_property
    def num_tokens(self) -> int:
        return int(self.len.sum())


class _Composite(Rows):
    """Rows drawn from several sources' rows: :meth:`_locate` maps an index to (source, row)."""

    parts: list[Rows]

    @abstractmethod
    def _locate(self, indices: Sequence[int], epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, row within the source) of each index."""

    @property
    def masked(self) -> bool:  # type: ignore[override]
        return any(p.masked for p in self.parts)

    def _each(self, indices: Sequence[int], epoch: int, read: Any, width: int | None) -> np.ndarray:
        """``read(part, rows)`` of each source's share of ``indices``, put back in their order."""
        src, row = self._locate(indices, epoch)
        out = np.empty((len(indices), width) if width else len(indices), dtype=np.int64)
        for s in np.unique(src):
            at = np.flatnonzero(src == s)
            out[at] = read(self.parts[s], row[at].tolist())
        return out

    def rows(self, indices: Sequence[int], epoch: int = 0) -> tuple[np.ndarray, np.ndarray]:
        ids = self._each(indices, epoch, lambda p, r: p.rows(r)[0], self.seq_len)
        return ids, self.lengths(indices, epoch)

    def lengths(self, indices: Sequence[int], epoch: int = 0) -> np.ndarray:
        return self._each(indices, epoch, lambda p, r: p.lengths(r), None)

    def masks(self, indices: Sequence[int], epoch: int = 0) -> np.ndarray | None:
        if not self.masked:
            return None
        ones = np.ones(self.seq_len, dtype=np.int64)  # a source without a mask trains on every token

        def read(p: Rows, r: list[int]) -> np.ndarray:
            m = p.masks(r)
            return np.broadcast_to(ones, (len(r), self.seq_len)) if m is None else m

        return self._each(indices, epoch, read, self.seq_len)

    @property
    def boundaries(self) -> bool:  # type: ignore[override]
        return any(p.boundaries for p in self.parts)

    def doc_starts(self, indices: Sequence[int], epoch: int = 0) -> np.ndarray | None:
        def read(p: Rows, r: list[int]) -> np.ndarray:
            d = p.doc_starts(r) if p.boundaries else None
            return np.zeros((len(r), self.seq_len), dtype=bool) if d is None else d

        return self._each(indices, epoch, read, self.seq_len).astype(bool)

    def tokens_by_source(self, indices: Sequence[int], epoch: int = 0) -> np.ndarray:
        src, _ = self._locate(indices, epoch)
        n = self.lengths(indices, epoch)
        return np.bincount(src, weights=n, minlength=len(self.parts)).astype(np.int64)


class BlendRows(_Composite):
    """A deterministic weighted mixture of the rows of several sources (see the module).

    As in megatron-core (a ``BlendedDataset`` read in sequence), position ``j`` of a pass draws from the
    source megatron's blending index names, so after any number of steps each source has given its weight
    of the rows to within one row; the shuffling happens inside each source instead: a source's ``k``-th
    draw is row ``perm_p[k mod n]`` of its pass ``p = k div n``, a permutation seeded by the run's seed,
    the source and the pass, so every row of a source is seen once before any is seen again.
    """

    own_order = True

    def __init__(
        self, parts: list[Rows], weights: list[float], names: list[str], size: int, cache: Path | None
    ):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets import helpers

        self.parts, self.names, self.size = parts, names, size
        self.seq_len = parts[0].seq_len
        w = np.asarray(weights, dtype=np.float64)
        self.weights = w / w.sum()
        self.source, self.sample = _blend_index(helpers, self.weights, size, cache)
        self.draws = np.bincount(self.source, minlength=len(parts)).astype(np.int64)
        """rows each source gives per pass"""
        self.sizes = np.array([len(p) for p in parts], dtype=np.int64)
        self.seed = 0
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def set_seed(self, seed: int) -> None:
        self.seed, self._perms = seed, {}

    def _perm(self, source: int, p: int) -> np.ndarray:
        """Source ``source``'s row order in its pass ``p`` (the two last used are kept per source)."""
        key = (source, p)
        if key not in self._perms:
            for old in [k for k in self._perms if k[0] == source and k[1] < p - 1]:
                del self._perms[old]
            seed = self.seed * 1_000_003 + source * 10_007 + p
            self._perms[key] = randperm(int(self.sizes[source]), seed, self.perm_cache)
        return self._perms[key]

    def __len__(self) -> int:
        return self.size

    def _locate(self, indices: Sequence[int], epoch: int) -> tuple[np.ndarray, np.ndarray]:
        j = np.asarray(indices, dtype=np.int64)
        src = self.source[j].astype(np.int64)
        k = self.sample[j] + epoch * self.draws[src]  # the source's draws before this one
        row = np.empty(len(j), dtype=np.int64)
        for i, (s, draw) in enumerate(zip(src.tolist(), k.tolist())):
            p, at = divmod(draw, int(self.sizes[s]))
            row[i] = self._perm(s, p)[at]
        return src, row


def _blend_index(
    helpers: Any, weights: np.ndarray, size: int, cache: Path | None
) -> tuple[np.ndarray, np.ndarray]:
    """megatron-core's blending indices, cached as numpy files under ``cache`` (as ``BlendedDataset``
    caches them) and mapped: ten bytes a row, in the page cache rather than in every rank."""
    if cache is not None and (cache / "source.npy").is_file():
        return np.load(cache / "source.npy", mmap_mode="r"), np.load(cache / "sample.npy", mmap_mode="r")
    source = np.zeros(size, dtype=np.int16)
    sample = np.zeros(size, dtype=np.int64)
    helpers.build_blending_indices(source, sample, weights, len(weights), size, False)
    if cache is not None:
        from tessera.data._cache import publish_dir, temp_dir_beside

        tmp = temp_dir_beside(cache)
        np.save(tmp / "source.npy", source)
        np.save(tmp / "sample.npy", sample)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        publish_dir(tmp, cache)
    return source, sample


class ConcatRows(_Composite):
    """The rows of several sources one after the other (the held-out split of a blend: every source's
    held-out documents, unweighted)."""

    def __init__(self, parts: list[Rows], names: list[str]):
        self.parts, self.names, self.seq_len = parts, names, parts[0].seq_len
        self.offsets = np.cumsum([0] + [len(p) for p in parts])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def _locate(self, indices: Sequence[int], epoch: int = 0) -> tuple[np.ndarray, np.ndarray]:
        j = np.asarray(indices, dtype=np.int64)
        src = np.searchsorted(self.offsets, j, side="right") - 1
        return src, j - self.offsets[src]
