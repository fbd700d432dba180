"""The one way Tessera writes and reads tensor files of its own: safetensors, never pickle.

A safetensors file holds raw tensors plus a string header, so loading one cannot run code, whatever the
file came from (``torch.load`` of a pickle can). JSON-able extras travel in the header's metadata.
Every failure to read is a :class:`CheckpointError` naming the file.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from tessera.errors import CheckpointError


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any] | None = None) -> None:
    from safetensors.torch import save_file

    data, seen = {}, set()
    for k, v in tensors.items():
        t = v.detach().contiguous().cpu()
        where = t.untyped_storage().data_ptr()
        # tied weights (an HF state dict's embedding and head) share one storage, which safetensors
        # refuses: each name gets its own copy, as every reader of these files expects every name
        data[k] = t.clone() if where in seen else t
        seen.add(where)
    save_file(data, str(path), metadata={"tessera": json.dumps(meta or {}, sort_keys=True)})


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
