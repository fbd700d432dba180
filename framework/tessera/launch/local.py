"""Environment of one rank started in-process (tests, benchmarks): what the launchers would set."""

from __future__ import annotations

import os


def set_rank_env(rank: int, world: int, port: int, *, threads: int = 1, addr: str = "127.0.0.1") -> None:
    """RANK / LOCAL_RANK / WORLD_SIZE / MASTER_* for a single-node rank, CPU accelerator, ``threads`` OMP threads."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR=addr,
        MASTER_PORT=str(port),
        OMP_NUM_THREADS=str(threads),
        DS_ACCELERATOR="cpu",
    )
