"""The one way Tessera writes and reads tensor files of its own: safetensors, never pickle.

A safetensors file holds raw tensors plus a string header, so loading one cannot run code, whatever the
file came from (``torch.load`` of a pickle can). JSON-able extras travel in the header's metadata.
Every failure to read is a :class:`CheckpointError` naming the file.
"""

from __future__ import annotations

import contextlib
import json
import math
import struct
from collections.abc import Callable, Iterator, Mapping
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


def write_safetensors(
    stream: BinaryIO,
    tensors: Mapping[str, torch.Tensor],
    metadata: dict[str, str],
    layout: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
) -> None:
    """The safetensors format (u64 header length, JSON header, raw little-endian tensor bytes) written to a
    stream, tensor by tensor. By hand because the safetensors package writes only whole files from its
    own buffer (``save_file``) or a ``bytes`` copy of the whole file (``save``): neither streams into a
    writer that hashes the bytes as they pass, and a copy of every checkpoint would double its memory.
    Files written here are read back by the safetensors package itself (tests compare both ways).

    ``layout``: name -> (shape, dtype) of every tensor, in the file's order, known before any is read; the
    header is written from it and then each tensor is asked of ``tensors`` (a lazy mapping) as it is
    written, so only one is ever needed at a time."""
    if layout is None:
        layout = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, (shape, dtype) in layout.items():
        n = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    stream.write(struct.pack("<Q", len(raw)))
    stream.write(raw)
    for name, (shape, dtype) in layout.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype:  # internal: the layout promised otherwise
            raise RuntimeError(f"{name}: {tuple(t.shape)} {t.dtype}, its header says {tuple(shape)} {dtype}")
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
    needs never has the whole file in memory. A damaged file is a :class:`CheckpointError` naming it.

    A tensor, or a range of its rows, is read with ``readinto`` into memory of its own. By hand, not
    through safetensors' ``get_tensor`` / ``get_slice``: those map the whole file, a tensor they return is a
    view of that mapping, and a slice is copied out of it; the pages read stay resident beside the copy
    while the file is open, and with ``get_tensor`` for as long as any tensor of that file lives (a
    verification's logits pass kept the 131 MB LM head of a ~300M model resident after the pass). Other
    parts (columns) still go through ``get_slice``."""

    def __init__(self, files: list[Path]) -> None:
        from safetensors import safe_open

        self._where: dict[str, Path] = {}
        self._shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self._at: dict[str, int] = {}  # where the tensor's bytes start in its file
        named = {v: k for k, v in _ST_DTYPES.items()}
        for f in files:
            with _reading(Path(f)), safe_open(str(f), framework="pt") as h:  # checks the header and sizes
                keys = list(h.keys())
            with _reading(Path(f)), open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
            for k in keys:
                self._where[k] = Path(f)
                dtype = named.get(header[k]["dtype"])
                if dtype is not None:  # a dtype the table does not name: read through safetensors
                    self._shapes[k] = (torch.Size(header[k]["shape"]), dtype)
                    self._at[k] = 8 + n + int(header[k]["data_offsets"][0])

    @classmethod
    def of_dir(cls, path: Path) -> LazyTensors:
        """All ``*.safetensors`` of an HF directory (sharded or not)."""
        return cls(sorted(Path(path).glob("*.safetensors")))

    def __getitem__(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        f = self._where[key]
        if key in self._at:
            return self._rows(key, 0, self._shapes[key][0][0] if self._shapes[key][0] else None)
        with _reading(f), safe_open(str(f), framework="pt") as h:  # truncated after the header was read
            return h.get_tensor(key)

    def part(self, key: str, index: tuple[int | slice, ...]) -> torch.Tensor:
        """``self[key][index]`` reading only that part of the file (a range of rows with ``readinto``,
        other parts through safetensors' slices)."""
        from safetensors import safe_open

        if not index:
            return self[key]
        rows = index[0]
        if (
            key in self._at
            and self._shapes[key][0]
            and isinstance(rows, slice)
            and rows.step in (None, 1)
            and all(i == slice(None) for i in index[1:])
        ):
            start, stop, _ = rows.indices(self._shapes[key][0][0])
            return self._rows(key, start, max(start, stop))
        f = self._where[key]
        with _reading(f), safe_open(str(f), framework="pt") as h:
            return h.get_slice(key)[index].contiguous()

    def _rows(self, key: str, start: int, stop: int | None) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``key`` (``stop`` None: a 0-dim tensor), read from its file."""
        shape, dtype = self._shapes[key]
        out = torch.empty((stop - start, *shape[1:]) if stop is not None else shape, dtype=dtype)
        nbytes = out.numel() * out.element_size()
        if not nbytes:
            return out
        per_row = nbytes // max(1, stop - start) if stop is not None else 0
        f = self._where[key]
        with _reading(f), open(f, "rb", buffering=0) as fh:
            fh.seek(self._at[key] + start * per_row)
            view, got = memoryview(out.reshape(-1).view(torch.uint8).numpy()), 0
            while got < nbytes and (n := fh.readinto(view[got:])):
                got += n
            if got != nbytes:  # truncated after the header was read
                raise EOFError(f"{key}: {got} of {nbytes} bytes")
        return out

    def shape_of(self, key: str) -> tuple[int, ...]:
        """The tensor's shape, from the file's header."""
        from safetensors import safe_open

        if key in self._shapes:
            return tuple(self._shapes[key][0])
        f = self._where[key]
        with _reading(f), safe_open(str(f), framework="pt") as h:
            return tuple(h.get_slice(key).get_shape())

    def shapes(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """Name -> (shape, dtype), from the files' headers (a tensor of a dtype :data:`_ST_DTYPES` does not
        name is read for it)."""
        return {
            k: self._shapes[k] if k in self._shapes else (self[k].shape, self[k].dtype) for k in self._where
        }

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: object) -> bool:  # Mapping's would read the tensor
        return key in self._where


class TensorView(Mapping[str, torch.Tensor]):
    """Another mapping's tensors under other names (``names``: name -> the source's key; all of them when
    None), each detached and cast to ``dtype`` (when given) on access: nothing is read or copied before it
    is asked for, so a view of a lazy reader stays lazy."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        names: Mapping[str, str] | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self._tensors, self._dtype = tensors, dtype
        self._names = dict(names) if names is not None else {k: k for k in tensors}

    def __getitem__(self, key: str) -> torch.Tensor:
        t = self._tensors[self._names[key]].detach()
        return t if self._dtype is None else t.to(self._dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, key: object) -> bool:
        return key in self._names

    @property
    def part(self) -> Callable[[str, tuple[int | slice, ...]], torch.Tensor] | None:
        """``part(key, index)``: ``self[key][index]`` read alone, where the source reads parts (a lazy
        reader's ``part`` and ``shape_of``); None where it does not (a caller reads the tensor once)."""
        of, shape_of = getattr(self._tensors, "part", None), getattr(self._tensors, "shape_of", None)
        if of is None or shape_of is None:
            return None

        def part(key: str, index: tuple[int | slice, ...]) -> torch.Tensor:
            t = of(self._names[key], index).detach()
            return t if self._dtype is None else t.to(self._dtype)

        return part

    def shape_of(self, key: str) -> tuple[int, ...]:
        """The tensor's shape, from the source without reading it where it can say."""
        of = getattr(self._tensors, "shape_of", None)
        return tuple(of(self._names[key])) if of is not None else tuple(self.shapes()[key][0])

    def shapes(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """Name -> (shape, dtype as read), without reading a tensor where the source can say (a lazy
        reader's ``shapes``)."""
        of = getattr(self._tensors, "shapes", None)
        known = of() if of is not None else {k: (t.shape, t.dtype) for k, t in self._tensors.items()}
        return {k: (known[src][0], self._dtype or known[src][1]) for k, src in self._names.items()}

    def release(self) -> None:
        """Let the source go of the tensors it holds between reads (a lazy reader's last group)."""
        getattr(self._tensors, "release", lambda: None)()
