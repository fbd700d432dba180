"""Which device a run trains on (``run.device``), decided without importing torch where that is exact.

``tessera run`` resolves the device before it launches the ranks; importing torch for that costs ~2-3 s
on a small machine, before anything else can start. A torch build without CUDA or ROCm libraries can
never report a GPU, so on such a build ``auto`` is ``cpu`` and ``cuda`` an error without the import; any
other build asks ``torch.cuda.is_available()`` itself.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from tessera.errors import TesseraError

#: torch's GPU back-end libraries (CUDA, ROCm); a build without either is CPU-only
_GPU_LIBS = ("libtorch_cuda.so", "libtorch_hip.so")


def torch_has_gpu_backend() -> bool:
    """Whether the installed torch was built with a GPU back-end (without importing it)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return False
    lib = Path(spec.origin).parent / "lib"
    return any((lib / name).exists() for name in _GPU_LIBS)


def cuda_available() -> bool:
    if "torch" not in sys.modules and not torch_has_gpu_backend():
        return False
    import torch

    return bool(torch.cuda.is_available())


def resolve_device(requested: str) -> str:
    """``run.device`` to ``cpu`` or ``cuda``; ``cuda`` without a visible CUDA device is an error."""
    if requested == "cpu":
        return "cpu"
    available = cuda_available()
    if requested == "auto":
        return "cuda" if available else "cpu"
    if not available:
        raise TesseraError(
            "no CUDA device is visible",
            field="run.device",
            value=requested,
            fix="use run.device: cpu or auto",
        )
    return requested
