"""Spawn real ranks (gloo) running the same worker entry point the launchers run."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_RECIPE = REPO / "recipes" / "tiny-llama-cpu.yaml"
TEST_OVERRIDES = ["tracking.wandb.mode=disabled", "checkpoint.every=0", "run.device=cpu"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, run_dir: str, resume: bool) -> None:
    from tessera.launch.local import set_rank_env

    set_rank_env(rank, world, port)
    import torch

    torch.set_num_threads(1)
    from tessera.train.worker import exit_process, run_rank

    exit_process(run_rank(run_dir, resume))


def prepare_run(run_dir: Path, overrides: list[str], recipe: Path = DEFAULT_RECIPE):
    """Resolve the recipe with overrides, write it into run_dir and warm the data cache (as the CLI does)."""
    from tessera.config.loader import load_recipe
    from tessera.train.worker import prepare_run_dir

    r = load_recipe(recipe, [*TEST_OVERRIDES, *overrides]).recipe
    prepare_run_dir(r, run_dir, root=REPO)
    return r


def spawn_ranks(run_dir: Path, world: int, *, resume: bool = False, timeout: float = 420) -> list[int]:
    """Start ``world`` processes, wait, return their exit codes (killing all on timeout)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, str(run_dir), resume)) for r in range(world)
    ]
    cwd = os.getcwd()
    os.chdir(REPO)  # data.cache_dir is relative to the working directory
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
    finally:
        os.chdir(cwd)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return [p.exitcode for p in procs]


def train_run(
    run_dir: Path, overrides: list[str], *, world: int, resume: bool = False, recipe: Path = DEFAULT_RECIPE
) -> list[dict]:
    """prepare + spawn + read metrics.jsonl; fails with the ranks' log tails if a rank failed."""
    if not resume:
        prepare_run(run_dir, [f"run.world_size={world}", *overrides], recipe)
    codes = spawn_ranks(run_dir, world, resume=resume)
    if any(codes):
        logs = "\n".join(
            f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-30:])
            for p in sorted((run_dir / "logs").glob("*.log"))
        )
        raise AssertionError(f"ranks exited with {codes}\n{logs}")
    return read_metrics(run_dir)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records]


def assert_close_rel(a: list[float], b: list[float], rel: float) -> None:
    assert len(a) == len(b), (len(a), len(b))
    for i, (x, y) in enumerate(zip(a, b), 1):
        assert abs(x - y) <= rel * abs(y), f"step {i}: {x!r} vs {y!r} (rel {abs(x - y) / abs(y):.2e} > {rel})"
