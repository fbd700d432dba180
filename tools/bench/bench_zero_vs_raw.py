"""Tessera's deepspeed engine vs a raw DeepSpeed training loop, side by side in one run.

Both run on the same ranks, the same tiny model (same seed) and the same batches, alternating in blocks
so that machine drift hits both equally. Prints the median step time of each and their ratio (the
orchestration overhead Tessera adds: token-normalised loss, its all-reduces, LR setting) and writes JSON.

    python tools/bench/bench_zero_vs_raw.py [--zero 2] [--world 2] [--steps 30] [--out bench-results]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, q) -> None:
    from tessera.launch.local import set_rank_env

    set_rank_env(rank, world, port, threads=max(1, (os.cpu_count() or 1) // world))
    import deepspeed
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    from tessera.config.loader import load_recipe
    from tessera.data import StepSampler, prepare_data
    from tessera.engines.base import MicroBatches, ModelSource, known_counts, row_label_tokens
    from tessera.engines.deepspeed_engine import DeepSpeedEngine
    from tessera.engines.zero import build_ds_config
    from tessera.plan.layout import layout_from_recipe

    recipe = load_recipe(
        REPO / "recipes" / "tiny-llama-cpu.yaml",
        [f"parallel.zero={args.zero}", f"run.world_size={world}", "run.device=cpu"],
    ).recipe
    layout = layout_from_recipe(recipe)
    deepspeed.init_distributed(dist_backend="gloo")
    data = prepare_data(recipe.data, root=REPO)
    sampler = StepSampler.for_layout(len(data), layout, rank=rank, seed=0)
    # as the training loop feeds the engine: this rank's micro-batches + the global batch's counts
    row_tokens = row_label_tokens(data.labels)
    batches, counts = [], []
    for _ in range(args.steps):
        batches.append([(data.input_ids[i], data.labels[i]) for i in sampler.next_step()])
        counts.append(known_counts(row_tokens, sampler.last_global_batch, data.labels.shape[1]))

    source = ModelSource(section=recipe.model, vocab_size=data.vocab_size, seed=1)
    tess = DeepSpeedEngine(source, recipe, layout, device="cpu")
    raw_model = source.build_hf()  # the same initial weights, as a plain HF module
    # the same training math a hand-written script would do: no weight decay on biases and norms (two
    # parameter groups: ZeRO flattens, reduces and gathers each group on its own)
    matrices = [p for p in raw_model.parameters() if p.dim() >= 2]
    vectors = [p for p in raw_model.parameters() if p.dim() < 2]
    groups = [
        {"params": matrices, "weight_decay": recipe.optim.weight_decay},
        {"params": vectors, "weight_decay": 0.0},
    ]
    raw, _, _, _ = deepspeed.initialize(
        model=raw_model,
        optimizer=torch.optim.AdamW(groups, lr=1e-3, foreach=False),
        config=build_ds_config(recipe, layout, device="cpu"),
    )

    def raw_step(step: list) -> None:
        for ids, labels in step:
            loss = raw(input_ids=ids, labels=labels, use_cache=False).loss  # HF mean loss, per micro-batch
            raw.backward(loss)
            raw.step()

    def tess_step(step: list, n: int) -> None:
        tess.train_step(MicroBatches(({"input_ids": i, "labels": lab} for i, lab in step), counts[n - 1]), n)

    times: dict[str, list[float]] = {"raw": [], "tessera": []}
    block = 5
    for start in range(0, args.steps, block):
        for name in ("raw", "tessera"):
            for k in range(start, min(start + block, args.steps)):
                torch.distributed.barrier()
                t0 = time.perf_counter()
                raw_step(batches[k]) if name == "raw" else tess_step(batches[k], k + 1)
                times[name].append(time.perf_counter() - t0)
    torch.distributed.destroy_process_group()
    if rank == 0:
        q.put(times)
        q.close()
        q.join_thread()
    from tessera.train.worker import exit_process

    exit_process(0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--zero", type=int, default=2)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default=str(REPO / "bench-results"))
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, args.world, port, args, q)) for r in range(args.world)]
    for p in procs:
        p.start()
    times = q.get(timeout=900)
    for p in procs:
        p.join()
    from tessera.comm.shm import release_shared_memory

    release_shared_memory("127.0.0.1", port)  # DeepSpeed leaves its CPU all-reduce segments behind
    warm = {k: v[5:] if len(v) > 10 else v for k, v in times.items()}  # first block includes warm-up
    med = {k: statistics.median(v) for k, v in warm.items()}
    result = {
        "benchmark": "tessera_deepspeed_engine_vs_raw_deepspeed",
        "zero": args.zero,
        "world_size": args.world,
        "steps": args.steps,
        "median_step_s": med,
        "ratio_tessera_over_raw": med["tessera"] / med["raw"],
        "step_times_s": times,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"zero{args.zero}_vs_raw_ws{args.world}.json"
    path.write_text(json.dumps(result, indent=2))
    print(
        f"ZeRO-{args.zero}, {args.world} ranks, median step: raw DeepSpeed {med['raw'] * 1e3:.1f} ms, "
        f"Tessera {med['tessera'] * 1e3:.1f} ms, ratio Tessera/raw = {result['ratio_tessera_over_raw']:.3f}"
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
