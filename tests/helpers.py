"""Spawn real ranks (gloo) running the same worker entry point the launchers run."""

from __future__ import annotations

import contextlib
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


def _rank_main(rank: int, world: int, port: int, runs: list[tuple[str, bool]]) -> None:
    """One rank running one or more runs in turn (several runs per process spare the imports)."""
    from tessera.launch.local import set_rank_env

    set_rank_env(rank, world, port)
    import torch

    torch.set_num_threads(1)
    from tessera.train.worker import exit_process, run_rank

    code = 0
    for i, (run_dir, resume) in enumerate(runs):
        code = run_rank(run_dir, resume, keep_process_group=i < len(runs) - 1)
        if code:
            break
    exit_process(code)


def prepare_run(run_dir: Path, overrides: list[str], recipe: Path = DEFAULT_RECIPE):
    """Resolve the recipe with overrides, write it into run_dir and warm the data cache (as the CLI does)."""
    from tessera.config.loader import load_recipe
    from tessera.train.worker import prepare_run_dir

    r = load_recipe(recipe, [*TEST_OVERRIDES, *overrides]).recipe
    prepare_run_dir(r, run_dir, root=REPO)
    return r


def spawn_ranks(
    run_dir: Path | list[tuple[Path, bool]], world: int, *, resume: bool = False, timeout: float = 420
) -> list[int]:
    """Start ``world`` processes, wait, return their exit codes (killing all on timeout). ``run_dir`` may
    be a list of (run dir, resume) run one after the other by the same processes."""
    runs = [(str(run_dir), resume)] if isinstance(run_dir, Path) else [(str(d), r) for d, r in run_dir]
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, runs)) for r in range(world)]
    with _running(procs, timeout):
        pass
    return [p.exitcode for p in procs]


@contextlib.contextmanager
def _running(procs: list, timeout: float):
    """Start the rank processes from the repo root (data.cache_dir is relative to it), let the caller
    talk to them, then wait; whatever is still alive after ``timeout`` is killed."""
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        for p in procs:
            p.start()
        yield
        for p in procs:
            p.join(timeout)
    finally:
        os.chdir(cwd)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


def train_run(
    run_dir: Path, overrides: list[str], *, world: int, resume: bool = False, recipe: Path = DEFAULT_RECIPE
) -> list[dict]:
    """prepare + spawn + read metrics.jsonl; fails with the ranks' log tails if a rank failed."""
    return train_runs({run_dir: (recipe, overrides, resume)}, world=world)[run_dir]


def train_runs(specs: dict[Path, tuple[Path, list[str], bool]], *, world: int) -> dict[Path, list[dict]]:
    """Several runs of the same world size in one set of rank processes, in order:
    ``{run_dir: (recipe, overrides, resume)}`` -> ``{run_dir: metrics records}``."""
    for run_dir, (recipe, overrides, resume) in specs.items():
        if not resume:
            prepare_run(run_dir, [f"run.world_size={world}", *overrides], recipe)
    codes = spawn_ranks([(d, spec[2]) for d, spec in specs.items()], world, timeout=420 * len(specs))
    if any(codes):
        logs = "\n".join(
            f"--- {p}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-30:])
            for d in specs
            for p in sorted((d / "logs").glob("*.log"))
        )
        raise AssertionError(f"ranks exited with {codes}\n{logs}")
    return {d: read_metrics(d) for d in specs}


def _fn_main(rank: int, world: int, port: int, fn, args: tuple, queue) -> None:
    from tessera.launch.local import set_rank_env

    set_rank_env(rank, world, port)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from tessera.train.worker import exit_process

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        queue.put((rank, fn(*args), None))
    except BaseException:  # the test reports it with the rank's traceback
        import traceback

        queue.put((rank, None, traceback.format_exc()))
    exit_process(0)


def run_on_ranks(fn, world: int, *args, timeout: float = 600) -> list:
    """Run importable ``fn(*args)`` on ``world`` gloo ranks; returns each rank's result, raising with the
    rank's traceback if one failed."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_fn_main, args=(r, world, port, fn, args, queue)) for r in range(world)]
    results: dict[int, object] = {}
    with _running(procs, timeout):
        for _ in range(world):
            rank, value, err = queue.get()
            if err:
                raise AssertionError(f"rank {rank} failed:\n{err}")
            results[rank] = value
    return [results[r] for r in range(world)]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records]


def assert_close_rel(a: list[float], b: list[float], rel: float) -> None:
    assert len(a) == len(b), (len(a), len(b))
    for i, (x, y) in enumerate(zip(a, b), 1):
        assert abs(x - y) <= rel * abs(y), f"step {i}: {x!r} vs {y!r} (rel {abs(x - y) / abs(y):.2e} > {rel})"


def assert_comm_matches_plan(run_dir: Path, group: str, tol: float, *, step: int = 2) -> dict[str, int]:
    """The bytes a run really moved on ``group`` at ``step`` (comm.jsonl, every rank) against what the
    planner predicts for the run's layout, op by op within ``tol``; nothing sizeable unpredicted.
    Returns the prediction (op:group -> bytes)."""
    from collections import defaultdict

    import yaml

    from tessera.config.loader import validate_recipe
    from tessera.plan.hardware import load_hardware
    from tessera.plan.layout import layout_from_recipe
    from tessera.plan.search import estimate_layout

    recipe = validate_recipe(yaml.safe_load((run_dir / "recipe.resolved.yaml").read_text()))
    est = estimate_layout(recipe, layout_from_recipe(recipe), hardware=load_hardware("cpu-2core")).comm_bytes
    predicted = {k: v for k, v in est.items() if k.endswith(f":{group}") and v}
    assert predicted, est
    per_rank: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for line in (run_dir / "comm.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["phase"] == "step" and rec["step"] == step:
            for o in rec["ops"]:
                per_rank[rec["rank"]][f"{o['op']}:{o['group']}"] += o["bytes"]
    assert sorted(per_rank) == list(range(recipe.run.world_size))
    for rank, got in per_rank.items():
        for key, want in predicted.items():
            assert abs(got.get(key, 0) - want) <= tol * want, (rank, key, got.get(key, 0), want)
        # our own scalar token / loss sums are a few bytes; anything bigger must be in the prediction
        other = sum(v for k, v in got.items() if k.endswith(f":{group}") and k not in predicted)
        assert other <= 0.01 * sum(predicted.values()), (rank, dict(got))
    return predicted


def assert_model_states_match_plan(run_dir: Path, tol: float = 0.05) -> dict[str, int]:
    """The parameter, gradient and optimizer bytes each rank really held (summary.json, read from the
    engine's tensors) against the planner's model-state prediction, term by term within ``tol``."""
    import yaml

    from tessera.config.loader import validate_recipe
    from tessera.plan.hardware import load_hardware
    from tessera.plan.layout import layout_from_recipe
    from tessera.plan.search import estimate_layout

    recipe = validate_recipe(yaml.safe_load((run_dir / "recipe.resolved.yaml").read_text()))
    mem = estimate_layout(recipe, layout_from_recipe(recipe), hardware=load_hardware("cpu-2core")).memory
    want = {k: getattr(mem, k) for k in ("params", "grads", "optimizer")}
    held = json.loads((run_dir / "summary.json").read_text())["model_state_bytes_per_rank"]
    assert len(held) == recipe.run.world_size
    for rank, got in enumerate(held):
        for k, v in want.items():
            assert abs(got[k] - v) <= tol * v, (rank, k, got[k], v)
    return want
