"""The one way Tessera writes and reads tensor files of its own: safetensors, never pickle.

A safetensors file holds raw tensors plus a string header, so loading one cannot run code, whatever the
file came from (``torch.load`` of a pickle can). JSON-able extras travel in the header's metadata.
Every failure to read is a :class:`CheckpointError` naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tessera.errors import CheckpointError


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any] | None = None) -> None:
    from safetensors.torch import save_file

    data = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    save_file(data, str(path), metadata={"tessera": json.dumps(meta or {}, sort_keys=True)})


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_tensors_and_meta(path)[0]


def load_tensors_and_meta(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and the JSON metadata of a file written by :func:`save_tensors`."""
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
            raw = (f.metadata() or {}).get("tessera", "{}")
        meta = json.loads(raw)
    except FileNotFoundError:
        raise CheckpointError(
            "checkpoint file is missing", field="checkpoint", value=str(path), fix=_FIX
        ) from None
    except Exception as e:  # safetensors' header / size errors, or a pickle where a tensor file should be
        raise CheckpointError(
            f"not a readable safetensors file ({type(e).__name__}: {str(e)[:120]})",
            field="checkpoint",
            value=str(path),
            fix=_FIX,
        ) from None
    return tensors, meta


_FIX = "resume from an earlier step_* directory, or restore this file from a copy"
