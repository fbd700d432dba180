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
    if not multi_rank():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return [int(v) for v in out]
