"""Tessera's engine against the raw script's, alternating step by step in one job.

The launch pairs of the overhead benchmark (suite.py) compare whole runs a minute apart, and on a shared
machine two launches a minute apart differ by up to ~15 %: far more than the 3 % they are asked to settle.
This puts both sides in the same processes, a step apart. It builds Tessera's engine as `tessera run`
does (``engine_class(layout.engine)`` with the comm accounting installed first) and, beside it, the
hand-written script's own objects as the script builds them (``raw_deepspeed.build_engine``: the HF model
under ``deepspeed.initialize``; ``raw_megatron.build``: GPTModel, megatron's DDP and optimizer), from the
same initial weights. Then it alternates ``engine.train_step`` (Tessera's loss normalisation, token
counts, LR schedule, optimizer phase, the loss's all-reduce in the background of the optimizer step) with
the raw loop's work of a step (``raw_deepspeed.train_step`` / ``raw_megatron.train_step`` and the
all-reduce of the loss its loop reports), in the order ABBA so that a trend within a pair hits both sides
alike. Each pair's ratio is Tessera's step over the raw one next to it; the machine's load moves both
alike. ``--raw-objects tessera`` runs the raw step on the objects Tessera's engine built instead (the step
alone, without what each side's construction decides). What it leaves out is what the launch pairs
measure: the loop between steps (metrics, progress, stop rules: ``between_steps_s`` there), the process
(its threads, its allocator settings) and the start. Both sides' collectives pass the comm accounting
(installed once per process), ~2 µs each. The two sides' models train apart: each sees every other batch.

Launched as the raw scripts are (rank 0 writes the JSON to --out)::

    DS_ACCELERATOR=cpu .venv/bin/deepspeed --num_gpus 2 --bind_cores_to_rank --master_addr 127.0.0.1 \\
        --master_port 29630 tools/bench/step_ab.py --recipe recipes/tiny-llama-cpu.yaml --pairs 30 \\
        --out /tmp/step-ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _raw_common import (
    RawRun,
    Step,
    finish,
    load_data,
    model_source,
    parse_args,
    run_main,
    setup,
    steps,
)
from suite import geometric_mean


def _options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--pairs", type=int, default=30, help="timed step pairs (tessera, raw) after warm-up")
    ap.add_argument("--warmup", type=int, default=2, help="untimed pairs first")
    ap.add_argument(
        "--raw-objects",
        choices=["tessera", "own"],
        default="own",
        help="the raw step on the objects the raw script builds (beside Tessera's), or on Tessera's",
    )


def _tessera_step(engine: Any, batch: Step, n: int) -> None:
    from tessera.engines.base import MicroBatches

    micro = MicroBatches(
        ({"input_ids": ids, "labels": labels} for ids, labels in batch.micro),
        counts=(float(batch.tokens), float(batch.input_tokens)),
    )
    engine.train_step(micro, n)


def _raw_step(run: RawRun, engine: Any, own: bool) -> Callable[[Step, int], None]:
    """The raw loop's work of one step: its step, then the loss it reports (the all-reduce its loop makes
    after the timed step; Tessera's step reduces its loss too, in the background of the optimizer step).
    On the raw script's own DeepSpeed engine / megatron model and optimizer (``own``), built beside
    Tessera's in the same processes, or on the objects Tessera's engine built."""
    if run.layout.engine == "deepspeed":
        import raw_deepspeed

        if own:
            ds = raw_deepspeed.build_engine(run)
            ds.train()
        else:
            ds = engine.ds.engine

        def ds_step(batch: Step, n: int) -> None:
            loss_sum, _ = raw_deepspeed.train_step(run, ds, batch, n)
            raw_deepspeed.reported_loss(run, loss_sum)

        return ds_step
    import raw_megatron

    if own:
        from megatron.core import parallel_state

        model, optimizer, forward_backward = raw_megatron.build(run, parallel_state, init="tessera")
        model.train()
    else:
        model, optimizer, forward_backward = engine.chunks[0], engine.optimizer, engine.forward_backward

    def mcore_step(batch: Step, n: int) -> None:
        reported, _, _ = raw_megatron.train_step(run, model, optimizer, forward_backward, batch, n)
        raw_megatron.reported_loss(run, reported, batch)

    return mcore_step


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], extra=_options)
    args.steps = 2 * (args.warmup + args.pairs)
    run = setup(args)
    if run.layout.engine == "megatron":  # the layouts the raw script runs: tp x dp, megatron's own optimizer
        import raw_megatron

        raw_megatron.check_layout(run)
    from tessera.comm.accounting import group_namer, install
    from tessera.comm.shm import use_venv_build_tools
    from tessera.tables.engines import engine_class
    from tessera.train.worker import init_distributed

    use_venv_build_tools()
    counter = install(group_namer(run.layout))  # as the worker: before the engines bind torch.distributed
    init_distributed(run.device, run.layout)  # the worker's own rule (through DeepSpeed where it shards)
    load_data(run)
    engine = engine_class(run.layout.engine)(model_source(run), run.recipe, run.layout, device=run.device)
    counter.namer = group_namer(run.layout, engine.named_groups())
    raw = _raw_step(run, engine, own=args.raw_objects == "own")
    sides: dict[str, Callable[[Step, int], None]] = {
        "tessera": lambda batch, n: _tessera_step(engine, batch, n),
        "raw": raw,
    }
    batches = steps(run)
    times: dict[str, list[float]] = {"tessera": [], "raw": []}
    n = 0
    for k in range(args.warmup + args.pairs):
        order = ("tessera", "raw") if k % 2 == 0 else ("raw", "tessera")
        for who in order:
            n += 1
            batch = next(batches)
            run.sync()
            t0 = time.perf_counter()
            sides[who](batch, n)
            run.sync()
            dt = time.perf_counter() - t0
            counter.pop_step()  # as the loop does after each step (the tally does not grow)
            if k >= args.warmup:
                times[who].append(dt)
        if run.rank == 0 and k >= args.warmup:
            print(f"pair {k - args.warmup + 1:3d}  tessera {times['tessera'][-1] * 1e3:8.1f} ms  "
                  f"raw {times['raw'][-1] * 1e3:8.1f} ms", flush=True)  # fmt: skip
    if run.rank == 0:
        ratios = [t / r for t, r in zip(times["tessera"], times["raw"], strict=True)]
        res = {
            "recipe": str(args.recipe),
            "overrides": list(args.overrides),
            "engine": run.layout.engine,
            "raw_objects": args.raw_objects,
            "pairs": args.pairs,
            "warmup_pairs": args.warmup,
            "step_s": times,
            "median_step_s": {w: statistics.median(v) for w, v in times.items()},
            "pair_ratios": ratios,
        }
        Path(args.out).write_text(json.dumps(res, indent=1))
        print(f"step ratio (geometric mean of {args.pairs} pairs) {geometric_mean(ratios):.4f}", flush=True)
    finish()


if __name__ == "__main__":
    run_main(main)
