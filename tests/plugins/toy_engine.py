"""A toy fourth engine: the ddp engine under another name, writing its own ``sharding`` string and read
back by its own reader. Nothing of Tessera outside ``engines/`` and the registry may need to know either:
the test that runs it fails if some module compares an engine name or a sharding string."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tessera.engines.ddp import DDPEngine
from tessera.engines.ddp_reader import DDPReader

#: where the reader notes each call (the test's proof that the registry entry's reader was the one used)
LOG_ENV = "TOY_ENGINE_READER_LOG"


class ToyEngine(DDPEngine):
    sharding = "toy-ddp"


class ToyReader(DDPReader):
    """The ddp engine's reader (the same files), noting each call where the test asks."""

    def _note(self, what: str, ckpt: Path) -> None:
        if os.environ.get(LOG_ENV):
            with open(os.environ[LOG_ENV], "a") as f:
                f.write(f"{what} {Path(ckpt).name}\n")

    def weights(self, ckpt: Path, meta: dict[str, Any]) -> Any:
        self._note("weights", ckpt)
        return super().weights(ckpt, meta)

    def moment(self, ckpt: Path, meta: dict[str, Any], kind: str) -> Any:
        self._note(f"moment:{kind}", ckpt)
        return super().moment(ckpt, meta, kind)


READER = ToyReader()
