"""A hand-written DeepSpeed training script: the baseline ``tessera run`` (engine deepspeed) is measured against.

It trains the model of a Tessera recipe on the recipe's batches with nothing but DeepSpeed's own API:
``deepspeed.initialize`` on the HF model with a torch AdamW of two parameter groups (no weight decay on
biases and norms), then per micro-batch the HF forward with ``labels`` (HF's mean token loss),
``engine.backward`` and ``engine.step`` (DeepSpeed accumulates gradients, reduces / shards them per its
ZeRO stage, clips, casts for bf16 and steps at the boundary). What it takes from Tessera is the input side
only, so that both start from the same weights and see the same batches: the recipe and its overrides,
the tokenised data and seeded sampler, the seeded initial HF weights, the DeepSpeed JSON Tessera would
build (ZeRO stage, batch sizes, clipping, bf16) and the recipe's LR as a function of the step
(``tools/bench/_raw_common.py``). The optimizer settings match Tessera's (torch AdamW, foreach=False,
betas / eps / weight decay of the recipe). The loss is HF's mean per micro-batch averaged over micro-batches
and ranks: with packed data (every row the same label tokens) that equals Tessera's token-normalised loss.

Measures per step (rank 0 writes JSONL to --out; the fields: see _raw_common.py): the optimizer step's
time, its wall-clock end, tokens, loss, and on the first step the time from process start.

Launch it exactly as `tessera run` launches its ranks::

    DS_ACCELERATOR=cpu .venv/bin/deepspeed --num_gpus 2 --bind_cores_to_rank --master_addr 127.0.0.1 \\
        --master_port 29610 tools/bench/raw_deepspeed.py --recipe recipes/tiny-llama-cpu.yaml \\
        parallel.zero=3 --steps 10 --out /tmp/raw-ds.jsonl
    # one GPU: DS_ACCELERATOR=cuda .venv/bin/deepspeed --num_gpus 1 --master_addr 127.0.0.1 \\
    #   --master_port 29611 tools/bench/raw_deepspeed.py --recipe recipes/bench-llama-1b-h200.yaml ...
"""

from __future__ import annotations

import time
from typing import Any

import torch
from _raw_common import (
    PG_TIMEOUT,
    RawRun,
    Step,
    StepLog,
    finish,
    load_data,
    lr_of,
    mean_over,
    model_source,
    parse_args,
    run_main,
    setup,
    steps,
)


def build_engine(run: RawRun) -> object:
    """The HF model (Tessera's seeded initial weights, fp32 on the device) under ``deepspeed.initialize``
    with torch AdamW; DeepSpeed casts it to bf16 / partitions it (ZeRO-3) per the config."""
    import deepspeed

    from tessera.engines.zero import build_ds_config

    model = model_source(run).build_hf(device=run.torch_device)
    if run.layout.recompute == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    o = run.recipe.optim
    groups = [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": o.weight_decay},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, foreach=False)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=build_ds_config(run.recipe, run.layout, device=run.device)
    )
    return engine


def train_step(run: RawRun, engine: Any, batch: Step, n: int) -> tuple[torch.Tensor, float]:
    """One optimizer step of the raw loop on ``engine``: the LR, then per micro-batch the HF forward with
    labels, ``engine.backward`` and ``engine.step``. Returns the summed micro-batch losses and the LR."""
    lr = lr_of(run, n)
    for group in engine.optimizer.param_groups:
        group["lr"] = lr
    loss_sum = torch.zeros((), dtype=torch.float64, device=engine.device)
    for ids, labels in batch.micro:
        ids, labels = ids.to(engine.device, non_blocking=True), labels.to(engine.device, non_blocking=True)
        loss = engine(input_ids=ids, labels=labels, use_cache=False).loss
        engine.backward(loss)
        engine.step()  # a no-op between boundaries; at the last micro-batch: reduce, clip, update
        loss_sum += loss.detach().double()
    return loss_sum, lr


def reported_loss(run: RawRun, loss_sum: torch.Tensor) -> float:
    """The step's loss as the loop reports it: the micro-batch losses' mean over micro-batches and ranks
    (one all-reduce, after the timed step)."""
    return mean_over(loss_sum, run.layout.grad_accum * run.layout.dp)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    run = setup(args)
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if run.device == "cuda" else "gloo", timeout=PG_TIMEOUT)
    load_data(run)
    engine = build_engine(run)
    log = StepLog(run, args.out)
    engine.train()
    for n, batch in enumerate(steps(run), start=1):
        run.sync()
        t0 = time.perf_counter()
        loss_sum, lr = train_step(run, engine, batch, n)
        run.sync()
        dt = time.perf_counter() - t0
        wall = time.time()
        norm = engine.get_global_grad_norm()  # None without ZeRO (DeepSpeed does not keep it then)
        log.write(
            n,
            dt,
            wall,
            batch,
            loss=reported_loss(run, loss_sum),
            lr=lr,
            grad_norm=None if norm is None else float(norm),
        )
    finish(log)


if __name__ == "__main__":
    run_main(main)
