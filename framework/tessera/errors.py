"""User-facing errors.

Every error a user can cause by what they wrote (a recipe, an override, a path, a layout) is a
:class:`TesseraError`: it names the field, the value and the fix. The CLI prints it in one short block
and exits with code 2; no traceback. Programming errors stay ordinary exceptions.
"""

from __future__ import annotations

from typing import Any

PREVIEW = 400  # characters of a value an error message echoes (a path fits; a 4 MB mapping does not)


def preview(value: Any, limit: int = PREVIEW) -> str:
    """``repr(value)``, cut to ``limit`` characters (an echoed value never floods the console)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 15] + f"... ({len(text):,} chars)"


class TesseraError(Exception):
    """An error in what the user handed in, with the field, the value and the fix."""

    def __init__(self, message: str, *, field: str | None = None, value: Any = None, fix: str | None = None):
        self.field = field
        self.value = value
        self.fix = fix
        self.message = message
        super().__init__(self.render())

    #: the message already says "field = value" (a list of problems): render adds no second prefix
    framed = False

    def render(self) -> str:
        head = self.message
        if self.field is not None and not self.framed:
            head = f"{self.field} = {preview(self.value)}: {self.message}"
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


class RunStopped(RuntimeError):
    """A stop rule or a preemption ended the run in step on every rank (not a fault: never restarted).
    ``code`` is the run's exit code (:class:`tessera.rundir.ExitCode`), the message its one-line
    diagnosis."""

    def __init__(self, message: str, *, code: int) -> None:
        super().__init__(message)
        self.code = code
