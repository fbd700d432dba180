"""The one way Tessera writes and reads tensor files of its own: safetensors, never pickle.

A safetensors file holds raw tensors plus a string header, so loading one cannot run code, whatever the
file came from (``torch.load`` of a pickle can). JSON-able extras travel in the header's metadata.
Every failure to read is a :class:`CheckpointError` naming the file.
"""

from __future__ import annotations

import contextlib
import json
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

from tessera.errors import CheckpointError


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any] | None = None) -> None:
    """``tensors`` (and the JSON-able ``meta``) as one safetensors file at ``path``. Inside a checkpoint
    save (:func:`tessera.writes.current`) the file goes to that save: hashed while written, and written
    later from a snapshot when the save is asynchronous."""
    from tessera.writes import current

    data, seen = {}, set()
    for k, v in tensors.items():
        t = v.detach().contiguous()
        where = t.untyped_storage().data_ptr()
        # tied weights (an HF state dict's embedding and head) share one storage, which safetensors
        # refuses: each name gets its own copy, as every reader of these files expects every name
        data[k] = t.clone() if where in seen else t
        seen.add(where)
    header = {"tessera": json.dumps(meta or {}, sort_keys=True)}
    writes = current()
    if writes is not None:
        writes.add(Path(path), data, lambda snap, f: write_safetensors(f, snap, header))
        return
    from safetensors.torch import save_file

    save_file({k: t.cpu() for k, t in data.items()}, str(path), metadata=header)


#: torch dtype -> the safetensors format's name for it
_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}  # fmt: skip


def write_safetensors(stream: BinaryIO, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """The safetensors format (u64 header length, JSON header, raw little-endian tensor bytes) written to a
    stream, tensor by tensor. By hand because the safetensors package writes only whole files from its
    own buffer (``save_file``) or a ``bytes`` copy of the whole file (``save``): neither streams into a
    writer that hashes the bytes as they pass, and a copy of every checkpoint would double its memory.
    Files written here are read back by the safetensors package itself (tests compare both ways)."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    stream.write(struct.pack("<Q", len(raw)))
    stream.write(raw)
    for t in tensors.values():
        if t.numel():
            stream.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_tensors_and_meta(path)[0]


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[None]:
    """Any failure to read ``path`` as a :class:`CheckpointError` naming the file."""
    try:
        yield
    except FileNotFoundError:
        raise CheckpointError(
            "tensor file is missing", field="checkpoint", value=str(path), fix=_FIX
        ) from None
    except Exception as e:  # safetensors' header / size errors, or a pickle where a tensor file should be
        raise CheckpointError(
            f"not a readable safetensors file ({type(e).__name__}: {str(e)[:120]})",
            field="checkpoint",
            value=str(path),
            fix=_FIX,
        ) from None


def load_tensors_and_meta(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and the JSON metadata of a file written by :func:`save_tensors`."""
    from safetensors import safe_open

    path = Path(path)
    with _reading(path), safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        meta = json.loads((f.metadata() or {}).get("tessera", "{}"))
    return tensors, meta


_FIX = "resume from an earlier checkpoint (tessera run R.yaml --resume-from checkpoints/step_N), or restore this file from a copy"


class LazyTensors(Mapping[str, torch.Tensor]):
    """The tensors of one or more safetensors files (an HF directory's shards), read one tensor per
    access: holding the mapping holds only the file headers, so a rank that asks for the tensors it
    needs never has the whole file in memory. A damaged file is a :class:`CheckpointError` naming it."""

    def __init__(self, files: list[Path]) -> None:
        from safetensors import safe_open

        self._where: dict[str, Path] = {}
        for f in files:
            with _reading(Path(f)), safe_open(str(f), framework="pt") as h:
                self._where.update(dict.fromkeys(h.keys(), Path(f)))

    @classmethod
    def of_dir(cls, path: Path) -> LazyTensors:
        """All ``*.safetensors`` of an HF directory (sharded or not)."""
        return cls(sorted(Path(path).glob("*.safetensors")))

    def __getitem__(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        f = self._where[key]
        with _reading(f), safe_open(str(f), framework="pt") as h:  # truncated after the header was read
            return h.get_tensor(key)

    def part(self, key: str, index: tuple[int | slice, ...]) -> torch.Tensor:
        """``self[key][index]`` reading only that part of the file (safetensors slices)."""
        from safetensors import safe_open

        if not index:
            return self[key]
        f = self._where[key]
        with _reading(f), safe_open(str(f), framework="pt") as h:
            return h.get_slice(key)[index].contiguous()

    def shape_of(self, key: str) -> tuple[int, ...]:
        """The tensor's shape, from the file's header."""
        from safetensors import safe_open

        f = self._where[key]
        with _reading(f), safe_open(str(f), framework="pt") as h:
            return tuple(h.get_slice(key).get_shape())

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)
