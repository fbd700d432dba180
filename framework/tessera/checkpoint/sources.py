"""What a ``tessera convert`` / ``tessera verify`` argument points at: an HF directory, a checkpoint or a
run directory (meaning its latest checkpoint), and the tokenizer a checkpoint's run trained with.

Both commands read their arguments through these (:mod:`tessera.checkpoint.convert` writes, and
:mod:`tessera.checkpoint.verify` compares), so neither module imports the other for them.
"""

from __future__ import annotations

import os
from pathlib import Path

from tessera.checkpoint.index import META
from tessera.checkpoint.manager import CheckpointManager
from tessera.errors import CheckpointError
from tessera.rundir import RunDir

#: what ``save_pretrained`` writes of the model's config: an HF directory holds it (a checkpoint does not)
HF_CONFIG = "config.json"


def is_hf_dir(path: Path) -> bool:
    """A ``save_pretrained`` directory (``config.json``), not a Tessera checkpoint (``meta.json``)."""
    return (Path(path) / HF_CONFIG).is_file() and not os.path.lexists(Path(path) / META)


def resolve_source(src: Path) -> Path:
    """A checkpoint directory, or a run directory's latest checkpoint."""
    src = Path(src)
    if os.path.lexists(src / META):  # whatever it is: the verification names a link or a FIFO
        return src
    rd = RunDir(src)
    if rd.checkpoints.is_dir():
        latest = CheckpointManager(rd.checkpoints, keep=1, rank=0, world_size=1).latest()
        if latest is not None:
            return latest
    raise CheckpointError(
        "not a Tessera checkpoint (no meta.json) nor a run directory with checkpoints",
        field="SRC",
        value=str(src),
        fix="give a checkpoints/step_NNNNNN directory or a run directory",
    )


def tokenizer_dir_of(ckpt: Path) -> Path | None:
    """The tokenizer the run trained with: its run directory's prepared-data record names it."""
    record = RunDir.of_checkpoint(ckpt).read_json_if_present(RunDir.DATA)
    path = Path(record["tokenizer_dir"]) if record and record.get("tokenizer_dir") else None
    return path if path is not None and path.is_dir() else None
