"""User-facing errors.

Every error a user can cause by what they wrote (a recipe, an override, a path, a layout) is a
:class:`TesseraError`: it names the field, the value and the fix. The CLI prints it in one short block
and exits with code 2; no traceback. Programming errors stay ordinary exceptions.
"""

from __future__ import annotations

from typing import Any


class TesseraError(Exception):
    """An error in what the user handed in, with the field, the value and the fix."""

    def __init__(self, message: str, *, field: str | None = None, value: Any = None, fix: str | None = None):
        self.field = field
        self.value = value
        self.fix = fix
        self.message = message
        super().__init__(self.render())

    def render(self) -> str:
        head = self.message
        if self.field is not None:
            head = f"{self.field} = {self.value!r}: {self.message}"
        if self.fix:
            head += f"\n  fix: {self.fix}"
        return head


class RecipeError(TesseraError):
    """A recipe value is unknown, of the wrong type, out of range or inconsistent with another."""


class LayoutError(TesseraError):
    """A parallel layout that cannot run (divisibility, unsupported combination, world size)."""


class DataError(TesseraError):
    """A data source, file or tokenizer that cannot be used."""


class CheckpointError(TesseraError):
    """A checkpoint that is missing, incomplete or does not match the run."""


class TrainingDiverged(RuntimeError):
    """Loss, gradient norm or model state became NaN / Inf; the last good checkpoint is kept. Not a user
    error: a stop rule (exit code :attr:`tessera.rundir.ExitCode.DIVERGED`)."""
