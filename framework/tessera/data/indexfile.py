"""megatron-core's indexed-dataset files (``PREFIX.bin`` / ``PREFIX.idx``), checked and concatenated
without reading them whole: what the sources module checks before a run, the dry run before a launch,
and the preparation uses to merge its shards (no torch: the command line imports it)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from tessera.errors import DataError

#: megatron-core's ``.idx`` header (``indexed_dataset._INDEX_HEADER``) and the fixed part after it
INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_FIXED = 9 + 8 + 1 + 8 + 8
REPREPARE = "prepare the source again (tessera data prepare), or restore the .bin/.idx pair it was written as"


def bad_source(prefix: str, why: str, fix: str) -> DataError:
    return DataError(why, field="data.sources", value=prefix, fix=fix)


def check_index(idx: Path) -> tuple[int, int]:
    """(sequences, documents + 1) from a megatron ``.idx`` header, after checking that the file's size is
    what they imply (megatron-core itself would assert, or map past the end)."""
    import struct

    size = idx.stat().st_size
    with open(idx, "rb") as f:
        head = f.read(INDEX_FIXED)
    if len(head) < INDEX_FIXED or head[:9] != INDEX_HEADER:
        raise bad_source(str(idx)[:-4], f"{idx}: not a megatron index (header {head[:9]!r})", REPREPARE)
    version, _code, seqs, docs = struct.unpack("<QBQQ", head[9:])
    want = INDEX_FIXED + seqs * (4 + 8) + docs * 8
    if _code not in DTYPES:
        raise bad_source(str(idx)[:-4], f"{idx}: unknown token dtype code {_code}", REPREPARE)
    if version != 1 or size not in (want, want + seqs):  # + seqs: the multimodal index's mode bytes
        raise bad_source(
            str(idx)[:-4],
            f"{idx}: {size:,} bytes, its header (version {version}, {seqs:,} sequences, {docs:,} document "
            f"offsets) needs {want:,}",
            REPREPARE,
        )
    return seqs, docs


def check_prefix(prefix: str) -> tuple[int, int]:
    """An indexed dataset's ``.idx`` header against the file's size and the ``.bin``'s size against the
    index; (sequences, documents + 1). Reads a few bytes, whatever the size of the dataset."""
    idx = Path(prefix + ".idx")
    if not idx.is_file():
        raise bad_source(
            prefix, f"{idx} not found", "name a prefix PATH with PATH.bin and PATH.idx beside it"
        )
    seqs, docs = check_index(idx)
    _check_bin(idx, Path(prefix + ".bin"), seqs)
    return seqs, docs


#: megatron-core's dtype codes (``indexed_dataset.DType``) -> numpy dtype names
DTYPES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32", 8: "uint16"}


def index_arrays(idx: Path, seqs: int, docs: int) -> tuple[Any, Any, Any]:
    """(sequence lengths int32, sequence byte pointers int64, document indices int64) of an ``.idx``,
    mapped (a page is read when used), laid out as megatron-core's ``_IndexReader`` reads them."""
    import numpy as np

    raw = np.memmap(idx, mode="r", dtype=np.uint8)
    lengths = np.frombuffer(raw, np.int32, seqs, INDEX_FIXED)
    pointers = np.frombuffer(raw, np.int64, seqs, INDEX_FIXED + 4 * seqs)
    doc_index = np.frombuffer(raw, np.int64, docs, INDEX_FIXED + 12 * seqs)
    return lengths, pointers, doc_index


def index_dtype(idx: Path) -> str:
    """The token dtype an ``.idx`` header names."""
    with open(idx, "rb") as f:
        code = f.read(INDEX_FIXED)[17]
    return DTYPES[code]


def _check_bin(idx: Path, bin_: Path, seqs: int) -> None:
    """The ``.bin`` is as long as the index's last sequence says (read from the index: two numbers)."""
    import struct

    if not bin_.is_file():
        raise bad_source(str(bin_)[:-4], f"{bin_} not found", REPREPARE)
    if seqs == 0:
        return
    import numpy as np

    itemsize = np.dtype(index_dtype(idx)).itemsize
    with open(idx, "rb") as f:
        f.seek(INDEX_FIXED + 4 * (seqs - 1))
        (length,) = struct.unpack("<i", f.read(4))
        f.seek(INDEX_FIXED + 4 * seqs + 8 * (seqs - 1))
        (pointer,) = struct.unpack("<q", f.read(8))
    end, size = pointer + length * itemsize, bin_.stat().st_size
    if itemsize and size != end:
        what = "truncated" if size < end else "longer than its index"
        raise bad_source(
            str(bin_)[:-4],
            f"{bin_} is {what}: {size:,} bytes, the index {idx.name} describes {end:,}",
            REPREPARE,
        )


def concat_indexed(prefixes: list[Path], out: Path, code: int) -> None:
    """Indexed datasets one after the other into ``out.{bin,idx}``, in the format megatron-core's
    ``IndexedDatasetBuilder.add_index`` + ``finalize`` write (its reader maps the result; tested).

    Written by hand because the builder keeps every document's length and pointer in Python lists until
    it finalizes: O(documents) memory in the process that merges (~120 MiB at 2 GiB of text). Here the
    ``.bin`` files are copied and each shard's index arrays are streamed with their offsets added, so the
    merge holds one shard's index at a time, whatever the corpus."""
    import struct

    import numpy as np

    counts = [check_index(Path(f"{p}.idx")) for p in prefixes]  # (sequences, documents + 1) each
    total_seqs = sum(s for s, _ in counts)
    total_docs = sum(d - 1 for _, d in counts) + 1
    sizes = []
    with open(f"{out}.bin", "wb") as fb:
        for p in prefixes:
            with open(f"{p}.bin", "rb") as src:
                shutil.copyfileobj(src, fb, 16 << 20)
            sizes.append(Path(f"{p}.bin").stat().st_size)
    with open(f"{out}.idx", "wb") as f:
        f.write(INDEX_HEADER + struct.pack("<QBQQ", 1, code, total_seqs, total_docs))
        for p, (seqs, docs) in zip(prefixes, counts):
            f.write(index_arrays(Path(f"{p}.idx"), seqs, docs)[0].tobytes())
        offset = 0
        for p, (seqs, docs), size in zip(prefixes, counts, sizes):
            f.write((index_arrays(Path(f"{p}.idx"), seqs, docs)[1] + offset).astype(np.int64).tobytes())
            offset += size
        f.write(np.zeros(1, np.int64).tobytes())
        first = 0
        for p, (seqs, docs) in zip(prefixes, counts):
            f.write((index_arrays(Path(f"{p}.idx"), seqs, docs)[2][1:] + first).astype(np.int64).tobytes())
            first += seqs
