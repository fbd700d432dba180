"""DeepSpeed's CPU shared-memory all-reduce: where its op is built, building it ahead of the first run, and
removing the segments it leaves behind."""

from __future__ import annotations

import os
import sys
from pathlib import Path

SHM_PREFIX = "deepspeed_allreduce_buffer"


def release_shared_memory(addr: str, port: int | str) -> int:
    """Remove DeepSpeed's CPU shared-memory all-reduce segments of one rendezvous (``/dev/shm/
    deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``, 69 MB per rank). DeepSpeed 0.19.8 creates
    them at init and never unlinks them, and the port is in the name: without this every run would leave
    ~138 MB of memory behind until reboot (seen: 21 GB after a day of test runs, then the OOM killer).
    Unlinking while a process still maps a segment is safe (the mapping lives until it is unmapped)."""
    removed = 0
    for seg in Path("/dev/shm").glob(f"{SHM_PREFIX}_{os.getuid()}_{addr}_{port}_*"):
        try:
            seg.unlink()
            removed += 1
        except OSError:
            pass
    return removed


def use_venv_build_tools() -> None:
    """Build DeepSpeed's JIT ops (on CPU: its shared-memory comm op) with this venv's ``ninja`` into one
    directory per venv (unless ``TORCH_EXTENSIONS_DIR`` is set). torch's default directory
    (``~/.cache/torch_extensions/py311_cpu``) is shared by every venv of a Python version, and a ``ninja``
    of another version (the system's, when the venv is not activated) rejects the other's build log: either
    way the op was rebuilt at the next run's start (~90 s before the first step on 2 cores)."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    bin_dir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != bin_dir:
        os.environ["PATH"] = bin_dir + (os.pathsep + path if path else "")


def build_cpu_comm_op() -> None:
    """Build DeepSpeed's CPU shared-memory comm op now (``make setup``), not at the start of the first run
    that initialises DeepSpeed on the CPU; nothing to do on a GPU."""
    if os.environ.get("DS_ACCELERATOR") != "cpu":
        return
    use_venv_build_tools()
    from deepspeed.comm.torch import build_shm_op

    build_shm_op()


if __name__ == "__main__":
    build_cpu_comm_op()
