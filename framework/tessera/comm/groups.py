"""Small collectives Tessera itself issues (no-ops on a single process)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def multi_rank() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def barrier() -> None:
    if multi_rank():
        dist.barrier()


def all_gather_int(value: int) -> list[int]:
    """``value`` from every rank, in rank order."""
    return [int(v) for v in all_gather_object(value)]


def all_gather_object(value: Any) -> list[Any]:
    """``value`` (any picklable object Tessera built itself) from every rank, in rank order."""
    if not multi_rank():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any rank."""
    return any(all_gather_object(bool(flag)))
