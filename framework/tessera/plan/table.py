"""The columns of `tessera plan`'s table: one list, from which both the header row and every cell row are
built, so that a header can never sit over another column's values.

Each :class:`Column` is a header, its alignment and the function that renders one candidate's cell; the
CLI turns :data:`COLUMNS` into a rich table, the tests read the same list.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tessera.plan.estimate import GiB
from tessera.plan.layout import LAYOUT_AXES

if TYPE_CHECKING:
    from tessera.plan.search import Candidate


def offload_text(c: Candidate) -> str:
    """What the layout keeps on the host: "opt+params", "opt" or "-" (+ "act": checkpointed activations)."""
    lay = c.layout
    text = "opt+params" if lay.offload_params else ("opt" if lay.offload_optimizer else "")
    if lay.offload_activations:
        text = f"{text}+act" if text else "act"
    return text or "-"


def tiled_text(c: Candidate) -> str:
    """What runs over sequence tiles: "mlp+loss", "mlp", "loss" or "-"."""
    tiled = [k for k in ("mlp", "loss") if getattr(c.layout, f"tiled_{k}")]
    return "+".join(tiled) or "-"


@dataclass(frozen=True)
class Column:
    """One column: its header, "left" or "right" alignment, and its cell for (row index, candidate)."""

    header: str
    justify: str
    cell: Callable[[int, Candidate], str]
    #: shown only where some row has a value (not ``blank``): a column of one kind of run
    optional: bool = False
    blank: str = "-"


def _axis(name: str) -> Column:
    # Ulysses' degree only where some row has it (a column of one kind of run, like the others below)
    return Column(name, "right", lambda i, c: str(getattr(c.layout, name)), optional=name == "sp", blank="1")


COLUMNS: tuple[Column, ...] = (
    Column("#", "right", lambda i, c: str(i + 1)),
    Column("engine", "left", lambda i, c: c.layout.engine),
    *(_axis(a) for a in (*LAYOUT_AXES, "zero")),
    # megatron's sequence parallelism in the TP regions (the "sp" column is Ulysses' degree)
    Column("seq par", "right", lambda i, c: "on" if c.layout.sequence_parallel else "-", optional=True),
    Column("offload", "left", lambda i, c: offload_text(c)),
    Column("recompute", "left", lambda i, c: "-" if c.recompute == "none" else c.recompute),
    Column("tiled", "left", lambda i, c: tiled_text(c), optional=True),
    Column("mb", "right", lambda i, c: str(c.layout.micro_batch)),
    Column("accum", "right", lambda i, c: str(c.layout.grad_accum)),
    Column("mem GiB/rank", "right", lambda i, c: f"{c.memory.total / GiB:.1f}"),
    # under adapters: the frozen base's share of the parameters (the rest of the states is the adapters')
    Column(
        "base GiB",
        "right",
        lambda i, c: f"{c.memory.frozen / GiB:.1f}" if c.memory.frozen else "-",
        optional=True,
    ),
    Column("act GiB", "right", lambda i, c: f"{c.memory.activations / GiB:.1f}"),
    Column("comm GB/step", "right", lambda i, c: f"{sum(c.comm_bytes.values()) / 1e9:.2f}"),
    Column("bubble", "right", lambda i, c: f"{c.bubble:.3f}"),
    Column("step s", "right", lambda i, c: f"{c.time.step_s:.3g}"),
    Column("MFU", "right", lambda i, c: f"{c.time.mfu:.3f}"),
)


def columns_for(candidates: Sequence[Candidate]) -> list[Column]:
    """The columns of a table of ``candidates``: an optional column only where some row has a value."""
    return [
        col
        for col in COLUMNS
        if not col.optional or any(col.cell(i, c) != col.blank for i, c in enumerate(candidates))
    ]


def headers(columns: Sequence[Column] = COLUMNS) -> list[str]:
    return [col.header for col in columns]


def cells(i: int, c: Candidate, columns: Sequence[Column] = COLUMNS) -> list[str]:
    """The row of candidate ``c`` at position ``i`` (0-based), one cell per column, in the columns' order."""
    return [col.cell(i, c) for col in columns]
