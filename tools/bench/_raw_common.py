"""The input and output side shared by the hand-written baselines (raw_deepspeed.py, raw_megatron.py).

Only what makes a raw run comparable with ``tessera run`` of the same recipe lives here: the recipe with
its dotted overrides, the same tokenised data, the same seeded sampler (so the same global batches in the
same order on the same ranks), the same initial weights (:class:`tessera.engines.base.ModelSource`), the
LR as the same pure function of the step, and the per-step JSONL record timed exactly as Tessera's loop
times a step (``tessera/train/loop.py``). The training loops themselves stay in the two scripts.

A record (rank 0 writes one JSON line per step to ``--out``)::

    {"step", "step_time_s", "wall_time", "tokens", "input_tokens", "tokens_per_s", "loss", "lr",
     "grad_norm", "peak_memory_bytes"} (+ "time_to_first_step_s" on the first step)

``step_time_s`` spans the optimizer step only (the batch is fetched before, the loss read after; on CUDA
with a device sync at both ends), ``wall_time`` is ``time.time()`` at its end, ``tokens`` the label
tokens of the global step, ``input_tokens`` its input positions (Tessera's throughput counts these), and
``time_to_first_step_s`` = the first step's ``wall_time`` minus the rank process's start time
(``psutil.Process().create_time()``), as Tessera measures it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil
import torch

REPO = Path(__file__).resolve().parents[2]
#: Tessera's worker bounds a hang on a dead peer with the same process-group timeout
PG_TIMEOUT = datetime.timedelta(minutes=5)


def parse_args(
    description: str, extra: Callable[[argparse.ArgumentParser], Any] | None = None
) -> argparse.Namespace:
    """``--recipe R [dotted overrides ...] --steps N --out FILE.jsonl`` (and the launcher's --local_rank);
    ``extra`` adds a script's own options."""
    ap = argparse.ArgumentParser(description=description)
    if extra is not None:
        extra(ap)
    ap.add_argument("--recipe", required=True, help="recipe YAML, as for `tessera run`")
    ap.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. parallel.zero=3 train.precision=bf16"
    )
    ap.add_argument(
        "--steps", type=int, default=None, help="optimizer steps (= train.steps=N); default the recipe's"
    )
    ap.add_argument("--out", required=True, help="JSONL file rank 0 writes, one record per step")
    ap.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    return ap.parse_intermixed_args()


@dataclass
class RawRun:
    """One rank's inputs: recipe, layout, device, data and sampler."""

    rank: int
    world: int
    local_rank: int
    device: str
    recipe: Any  # tessera.config.schema.Recipe
    layout: Any  # tessera.plan.layout.ParallelLayout
    process_start: float
    data: Any = None
    sampler: Any = None

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda", self.local_rank) if self.device == "cuda" else torch.device("cpu")

    def sync(self) -> None:
        """Wait for the device (CUDA), so that a timer reads finished work."""
        if self.device == "cuda":
            torch.cuda.synchronize()


def setup(args: argparse.Namespace) -> RawRun:
    """Recipe (with ``train.steps`` = ``--steps``), layout and device of this rank; CUDA device bound. The
    process group is the caller's to initialise (each baseline does it its own way)."""
    from tessera.config.loader import load_recipe
    from tessera.plan.layout import layout_from_recipe

    process_start = psutil.Process().create_time()  # when this rank's process started (numactl exec'd it)
    overrides = list(args.overrides) + ([f"train.steps={args.steps}"] if args.steps else [])
    recipe = load_recipe(args.recipe, overrides).recipe
    layout = layout_from_recipe(recipe)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if world != layout.world_size:
        raise SystemExit(
            f"the launcher started {world} ranks, the recipe's run.world_size is {layout.world_size}"
        )
    device = recipe.run.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("run.device is cuda but torch sees no CUDA device (a CPU build of torch?)")
        torch.cuda.set_device(local_rank)
    return RawRun(rank, world, local_rank, device, recipe, layout, process_start)


def load_data(run: RawRun) -> None:
    """The recipe's tokenised data (Tessera's cache under the repo) and the seeded sampler of this rank."""
    from tessera.data import StepSampler, prepare_data

    run.data = prepare_data(run.recipe.data, root=REPO)
    run.sampler = StepSampler.for_layout(len(run.data), run.layout, rank=run.rank, seed=run.recipe.train.seed)


def model_source(run: RawRun) -> Any:
    """Where the initial weights come from: the recipe's model and seed, as Tessera's engines get them."""
    from tessera.engines.base import ModelSource

    return ModelSource.of(run.recipe, vocab_size=run.data.vocab_size)


def lr_of(run: RawRun, step: int) -> float:
    """The recipe's LR at 1-based ``step`` (warmup + decay; a pure function of the step, as in Tessera)."""
    from tessera.engines.optim import LRSchedule

    return LRSchedule(run.recipe).lr(step)


@dataclass
class Step:
    """One global step's inputs on this rank: its micro-batches (input_ids, labels) and the global batch's
    label tokens and input positions."""

    micro: list[tuple[torch.Tensor, torch.Tensor]]
    tokens: int
    input_tokens: int


def steps(run: RawRun) -> Iterator[Step]:
    """This rank's micro-batches of each global step, from the seeded sampler (every rank knows the whole
    global batch, so the token counts need no collective)."""
    from tessera.engines.base import known_counts, row_label_tokens

    data = run.data
    row_tokens = row_label_tokens(data.labels)
    for _ in range(run.recipe.train.steps):
        rows = run.sampler.next_step()
        tokens, inputs = known_counts(row_tokens, run.sampler.last_global_batch, data.labels.shape[1])
        yield Step([(data.input_ids[i], data.labels[i]) for i in rows], int(tokens), int(inputs))


class StepLog:
    """Rank 0's JSONL of step records (the other ranks write nothing)."""

    def __init__(self, run: RawRun, path: str | Path) -> None:
        self.run = run
        self.first = True
        self.file: IO[str] | None = None
        if run.rank == 0:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "w", buffering=1)

    def write(
        self,
        step: int,
        dt: float,
        wall: float,
        batch: Step,
        *,
        loss: float,
        lr: float,
        grad_norm: float | None,
    ) -> dict[str, Any]:
        from tessera.train.metrics import peak_memory_bytes

        rec: dict[str, Any] = {
            "step": step,
            "step_time_s": dt,
            "wall_time": wall,
            "tokens": batch.tokens,
            "input_tokens": batch.input_tokens,
            "tokens_per_s": batch.input_tokens / dt if dt > 0 else float("nan"),
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "peak_memory_bytes": peak_memory_bytes(self.run.torch_device),
        }
        if self.first:  # this process's first step
            rec["time_to_first_step_s"] = wall - self.run.process_start
            self.first = False
        if self.file is not None:
            self.file.write(json.dumps(rec) + "\n")
            print(
                f"step {step:4d}  loss {loss:.6f}  {dt * 1e3:8.1f} ms"
                + (f"  ttfs {rec['time_to_first_step_s']:.1f} s" if "time_to_first_step_s" in rec else ""),
                flush=True,
            )
        return rec

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def mean_over(t: torch.Tensor, n: int, group: Any = None) -> float:
    """Sum ``t`` over ``group`` (None: the world) and divide by ``n``: the reported loss (outside the timed
    step, so the baseline pays no extra collective)."""
    t = t.detach().double().reshape(1).clone()
    torch.distributed.all_reduce(t, group=group)
    return float(t) / n


def finish(log: StepLog | None = None) -> None:
    """Close the log, leave the process group, remove DeepSpeed's CPU shared-memory segments of this
    rendezvous and exit without interpreter teardown (gloo / DeepSpeed threads can abort it)."""
    from tessera.comm.shm import release_shared_memory
    from tessera.train.worker import exit_process

    if log is not None:
        log.close()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    release_shared_memory(os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""))
    exit_process(0)


def run_main(main: Callable[[], None]) -> None:
    """Run ``main``; on a failure, remove this rendezvous's shared-memory segments before the error."""
    try:
        main()
    except BaseException:
        from tessera.comm.shm import release_shared_memory

        release_shared_memory(os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""))
        raise
