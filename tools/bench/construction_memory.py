"""Peak host memory of model construction per rank, at world size 1 and 2, for the layouts that shard the
model: DeepSpeed ZeRO-3, megatron TP2, megatron PP2 (the ~300M Llama of configs/models/llama-300m.yaml).

Construction is the engine's own model-building code (``partitioned_from`` for ZeRO-3, megatron-core's
parallel state + ``build_model_chunks``, inside ``lean_construction`` as the engines call it), seeded
initial weights, on CPU with gloo. Each rank imports
everything first, records its RSS, resets the kernel's peak-RSS mark (``/proc/self/clear_refs``), builds,
and reads the peak (VmHWM): the construction's peak = peak - RSS before (the libraries' ~0.5 GB per rank
are the same at every world size and are not the model's). Also reported: the bytes of parameters the
rank holds afterwards, and the seconds it took.

    python tools/bench/construction_memory.py [--layouts zero3,tp2,pp2] [--out bench-results/construction_memory.json]

Prints, per layout, the world-2 peak of each rank / the world-1 peak (the memory-lean target: <= 0.6),
writes the JSON and a PNG beside it. Not a timing benchmark: one run of each is exact enough.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "configs" / "models" / "llama-300m.yaml"
LAYOUTS: dict[str, tuple[str, list[str]]] = {  # name -> (recipe, overrides at world size 2)
    "zero3": ("tiny-llama-cpu.yaml", ["parallel.zero=3"]),
    "tp2": ("tiny-llama-cpu-mcore-tp2.yaml", []),
    "pp2": ("tiny-llama-cpu-mcore-pp2.yaml", []),
}
TARGET = 0.6


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS (Linux >= 4.0)


def _rank(rank: int, world: int, layout_name: str, recipe_file: str, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")  # fmt: skip
    import gc

    import deepspeed
    import megatron.core  # noqa: F401  (imported before the measurement, as in a run)
    import torch
    import transformers  # noqa: F401

    from tessera.config.loader import load_recipe
    from tessera.engines.base import ModelSource
    from tessera.hostmem import lean_construction
    from tessera.plan.layout import layout_from_recipe

    torch.set_num_threads(1)  # ranks share the host's cores; one thread each, as the test harness
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    with tempfile.TemporaryDirectory() as d:
        recipe_path = Path(d) / "recipe.yaml"
        recipe_path.write_text(f"include:\n  - {REPO / 'recipes' / recipe_file}\n  - {MODEL}\n")
        overrides = [*LAYOUTS[layout_name][1], f"run.world_size={world}", "run.device=cpu"]
        if world == 1:  # the same construction on one rank
            overrides += ["parallel.tp=1", "parallel.pp=1"] if LAYOUTS[layout_name][1] == [] else []
        recipe = load_recipe(recipe_path, overrides).recipe
    layout = layout_from_recipe(recipe)
    source = ModelSource.of(recipe, vocab_size=recipe.data.vocab_size)
    hf_cfg = source.hf_config()
    gc.collect()
    before = _status_kb("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    with lean_construction():
        held = _construct(recipe, layout, source, hf_cfg)
    seconds = time.perf_counter() - t0
    peak = _status_kb("VmHWM")
    record = {"rank": rank, "rss_before": before, "peak": peak, "construction_peak": peak - before,
              "held_bytes": held, "seconds": round(seconds, 2)}  # fmt: skip
    Path(out_dir, f"{layout_name}-w{world}-r{rank}.json").write_text(json.dumps(record))


def _construct(recipe: Any, layout: Any, source: Any, hf_cfg: Any) -> int:
    """The engine's own model construction; the bytes of parameters this rank holds afterwards."""
    from tessera.engines.deepspeed_engine import partitioned_from
    from tessera.engines.megatron_build import build_model_chunks, init_parallel_state, transformer_config
    from tessera.engines.zero import build_ds_config

    if layout.engine == "deepspeed":
        model = partitioned_from(source, source.tensors(), build_ds_config(recipe, layout, device="cpu"))
        return sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in model.parameters())
    ps = init_parallel_state(layout, seed=recipe.train.seed, device="cpu")
    config = transformer_config(hf_cfg, layout, seq_len=recipe.data.seq_len, precision="fp32", device="cpu")
    chunks = build_model_chunks(hf_cfg, source.tensors(), config, layout, ps)
    return sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# imported once in a forkserver whose forks are the ranks: each measured rank still imports everything
# before it reads its RSS, so the imports (~8 s per spawned process) are paid once, not per rank
PRELOAD = ["torch", "torch.distributed", "deepspeed", "megatron.core", "transformers", "tessera.hostmem"]


def preloaded_forkserver(preload: list[str], env: dict[str, str]) -> Any:
    """A forkserver context with ``preload`` imported under ``env`` (also tests/helpers.py's, for the test
    ranks); the imports start no thread, so its forks are as clean as spawned processes. The server starts
    once per process (a caller may have started it); ``env`` holds only while it starts."""
    import multiprocessing as mp
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(preload)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        forkserver.ensure_running()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return ctx


def measure_all(jobs: list[tuple[str, int]], *, together: bool = False) -> dict[tuple[str, int], list]:
    """For each (layout, world size): ``world`` ranks that build the layout's model; their records by
    rank. ``together``: every job's ranks at once (each its own process group; a rank's peak RSS is
    its own, so sharing the CPUs changes only the seconds), else one job after the other."""
    ctx = preloaded_forkserver(PRELOAD, {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    with tempfile.TemporaryDirectory() as out:
        waves = [jobs] if together else [[j] for j in jobs]
        for wave in waves:
            procs = [
                ctx.Process(target=_rank, args=(r, world, name, LAYOUTS[name][0], port, out))
                for name, world in wave
                for port in [_free_port()]
                for r in range(world)
            ]
            for p in procs:
                p.start()
            for p in procs:
                p.join(900)
            codes = [p.exitcode for p in procs]
            for p in procs:
                if p.is_alive():
                    p.kill()
            if any(c != 0 for c in codes):  # None: still running after the wait, killed
                raise RuntimeError(f"construction ranks of {wave} exited with {codes}")
        return {
            (name, world): [
                json.loads(Path(out, f"{name}-w{world}-r{r}.json").read_text()) for r in range(world)
            ]
            for name, world in jobs
        }


def measure(layout_name: str, world: int) -> list[dict[str, Any]]:
    """Spawn ``world`` ranks that build the layout's model; their records, by rank."""
    return measure_all([(layout_name, world)])[(layout_name, world)]


def run(layouts: list[str], *, together: bool = False) -> dict[str, Any]:
    """``together``: all constructions at once (a check of the peaks: quicker on a small machine, but
    the seconds are not each construction's own)."""
    # the megatron layouts share one world-1 construction
    engine = {name: "megatron" if "mcore" in LAYOUTS[name][0] else "deepspeed" for name in layouts}
    first = {e: name for name, e in reversed(engine.items())}  # the first layout of each engine
    jobs = [(first[e], 1) for e in dict.fromkeys(engine.values())] + [(name, 2) for name in layouts]
    got = measure_all(jobs, together=together)
    results: dict[str, Any] = {}
    for name in layouts:
        one, two = got[(first[engine[name]], 1)], got[(name, 2)]
        ratios = [r["construction_peak"] / one[0]["construction_peak"] for r in two]
        results[name] = {"world1": one, "world2": two, "ratio_per_rank": ratios, "max_ratio": max(ratios)}
    return results


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(results)
    width = 0.25
    for i, name in enumerate(names):
        r = results[name]
        base = r["world1"][0]["construction_peak"] / 2**20
        ax.bar(i - width, base, width, color="0.6", label="world size 1" if i == 0 else None)
        for rank, rec in enumerate(r["world2"]):
            ax.bar(i + rank * width, rec["construction_peak"] / 2**20, width, color=f"C{rank}",
                   label=f"world size 2, rank {rank}" if i == 0 else None)  # fmt: skip
        ax.hlines(TARGET * base, i - 1.5 * width, i + 1.5 * width, colors="k", linestyles="--",
                  label=f"target: {TARGET} x world size 1" if i == 0 else None)  # fmt: skip
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("peak host RSS of construction (MiB)")
    ax.set_title("Model construction memory per rank, ~300M Llama (fp32)")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--out", default=str(REPO / "bench-results" / "construction_memory.json"))
    args = ap.parse_args()
    results = run(args.layouts.split(","))
    print(f"{'layout':8} {'world 1 (MiB)':>14} {'world 2 per rank (MiB)':>24} {'ratio':>12}")
    for name, r in results.items():
        two = ", ".join(f"{x['construction_peak'] / 2**20:.0f}" for x in r["world2"])
        print(
            f"{name:8} {r['world1'][0]['construction_peak'] / 2**20:14.0f} {two:>24} {r['max_ratio']:12.3f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": "construction_memory", "model": str(MODEL.relative_to(REPO)), "target": TARGET,
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "results": results}  # fmt: skip
    out.write_text(json.dumps(record, indent=2))
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0 if all(r["max_ratio"] <= TARGET for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
