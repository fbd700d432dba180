"""Conversion memory against model depth: HF -> megatron TP2 and back, every process's peak RSS.

Issue 37's bound: a conversion's peak RSS, in every process, at most 1.5 x the largest layer's bytes plus
the process's baseline, and independent of depth (the 2-layer and 24-layer models' peaks within one
layer's bytes of each other). This measures both, for the checkpoint benchmark's model
(tools/bench/checkpoint_io.py: hidden 1024, SwiGLU 2048, 16 heads / 8 KV heads, vocab 32000 untied) at each
``--layers`` depth (24 layers: ~291M parameters), generated here from its config (seeded, fp32,
``save_pretrained``; nothing downloaded):

1. ``tessera convert HF --to megatron --layout tp=2`` (the CLI, its 2 ranks: stage, engine, save, verify);
2. ``tessera convert <that run> --to hf`` (back: read, write, verify);
3. with ``--zero``, the same to DeepSpeed ZeRO-2 over 2 data-parallel ranks and back (the ZeRO writer and
   reader), and megatron TP2 -> ZeRO-2 dp2 (a reshard: rank 0 stages the checkpoint, the writer writes it).

Per process: its peak RSS (polled every 0.1 s, and the largest process's exact peak from the kernel), the
*baseline* (the RSS of a process that has imported what a conversion imports: torch, transformers,
megatron-core, DeepSpeed, Tessera, and nothing else), the largest layer's bytes (a decoder layer, or the
embedding / LM head, whichever is larger, in fp32) and the bound. Writes bench-results/conversion_memory.json
and conversion_memory.png.

    python tools/bench/conversion_memory.py [--layers 2,24] [--out bench-results] [--dir runs] [--zero]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from checkpoint_io import GB, MODEL, REPO, _write_recipes, measure_tree

BASELINE = (
    "import resource, torch, transformers, deepspeed, megatron.core, tessera.cli, tessera.train.worker\n"
    "import transformers.models.llama.modeling_llama\n"
    # the export's and the verification's own: accelerate's hooks, torch's dist-checkpoint metadata,
    # megatron's layer spec (the reader's key map), tokenizers
    "import accelerate, tokenizers, torch.distributed.checkpoint, megatron.core.models.gpt.gpt_layer_specs\n"
    "import tessera.checkpoint.convert, tessera.checkpoint.verify, tessera.engines.megatron_reader\n"
    "print('RSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
)


#: each direction measured: its key in the JSON, its label in the plot
NAMES = {
    "hf_to_megatron_tp2": "HF -> megatron TP2",
    "megatron_tp2_to_hf": "megatron TP2 -> HF",
    "hf_to_deepspeed_z2_dp2": "HF -> DeepSpeed ZeRO-2 dp2",
    "deepspeed_z2_dp2_to_hf": "DeepSpeed ZeRO-2 dp2 -> HF",
    "megatron_tp2_to_deepspeed_z2_dp2": "megatron TP2 -> ZeRO-2 dp2 (stage)",
}


def baseline_rss() -> int:
    """Peak RSS of a process with the conversion's libraries imported (bytes)."""
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    out = subprocess.run(
        [sys.executable, "-c", BASELINE], capture_output=True, text=True, env=env, check=True
    )
    return int(re.search(r"RSS_KB (\d+)", out.stdout).group(1)) * 1024  # type: ignore[union-attr]


def make_hf(layers: int, where: Path) -> dict[str, int]:
    """The model at ``layers`` depth, seeded, saved as an HF directory; its bytes per layer (fp32): each
    decoder layer, and the embedding, the LM head and the final norm as their own."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**{**MODEL, "num_hidden_layers": layers})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float()
    model.save_pretrained(where, safe_serialization=True)
    per: dict[str, int] = {}
    for name, t in model.state_dict().items():
        m = re.match(r"model\.layers\.(\d+)\.", name)
        key = f"layer {m.group(1)}" if m else name
        per[key] = per.get(key, 0) + t.numel() * t.element_size()
    del model
    return per


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="2,24", help="comma-separated depths")
    ap.add_argument("--out", default=str(REPO / "bench-results"))
    ap.add_argument("--dir", default=str(REPO / "runs"), help="parent of the temporary directory")
    ap.add_argument("--zero", action="store_true",
                    help="also HF -> DeepSpeed ZeRO-2 dp2 and back, and megatron TP2 -> ZeRO-2 dp2")  # fmt: skip
    args = ap.parse_args()
    depths = [int(x) for x in args.layers.split(",")]
    parent = Path(args.dir).resolve()
    parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".bench-conversion-memory-", dir=parent))
    base = baseline_rss()
    print(f"baseline (the libraries imported): {base / GB:.3f} GB", flush=True)
    rows: list[dict[str, Any]] = []
    try:
        _, conv_recipe = _write_recipes(work, "deepspeed")
        for layers in depths:
            d = work / f"L{layers}"
            d.mkdir()
            per_layer = make_hf(layers, d / "hf")
            largest = max(per_layer.values())
            bound = base + 1.5 * largest
            row: dict[str, Any] = {"layers": layers, "hf_bytes": sum(per_layer.values()),
                                   "largest_layer_bytes": largest, "largest_layer": max(per_layer, key=per_layer.get),
                                   "baseline_bytes": base, "bound_bytes": bound}  # fmt: skip
            to_mcore = [sys.executable, "-m", "tessera.cli", "convert", str(d / "hf"), "--to", "megatron",
                        "--layout", "tp=2", "--recipe", str(conv_recipe), "--out", str(d / "mcore")]  # fmt: skip
            back = [sys.executable, "-m", "tessera.cli", "convert", str(d / "mcore"), "--to", "hf",
                    "--out", str(d / "hf-back")]  # fmt: skip
            runs = [
                ("hf_to_megatron_tp2", to_mcore, d / "mcore"),
                ("megatron_tp2_to_hf", back, d / "hf-back"),
            ]
            if args.zero:
                to_zero = [sys.executable, "-m", "tessera.cli", "convert", str(d / "hf"), "--to", "deepspeed",
                           "--layout", "dp=2,zero=2", "--recipe", str(conv_recipe), "--out", str(d / "zero")]  # fmt: skip
                zero_back = [sys.executable, "-m", "tessera.cli", "convert", str(d / "zero"), "--to", "hf",
                             "--out", str(d / "hf-back-zero")]  # fmt: skip
                reshard = [sys.executable, "-m", "tessera.cli", "convert", str(d / "mcore"), "--to", "deepspeed",
                           "--layout", "dp=2,zero=2", "--out", str(d / "mcore-zero")]  # fmt: skip
                runs += [("hf_to_deepspeed_z2_dp2", to_zero, d / "zero"),
                         ("deepspeed_z2_dp2_to_hf", zero_back, d / "hf-back-zero"),
                         ("megatron_tp2_to_deepspeed_z2_dp2", reshard, d / "mcore-zero")]  # fmt: skip
            for name, cmd, out in runs:
                m = measure_tree(cmd, out, d / f"{name}.log")
                procs = [{"cmd": p["cmd"], "peak_rss": p.get("peak_rss", 0)} for p in m["processes_polled"]]
                peak = max([m["peak_rss_largest_process"] or 0, *(p["peak_rss"] for p in procs)])
                row[name] = {"seconds": m["seconds"], "peak_rss_largest_process": peak, "processes": procs,
                             "within_bound": peak <= bound, "peak_over_bound": peak / bound}  # fmt: skip
                print(f"{layers:3d} layers  {name:20s} {m['seconds']:6.1f} s  peak RSS {peak / GB:.3f} GB  "
                      f"bound {bound / GB:.3f} GB ({peak / bound:.2f} x)", flush=True)  # fmt: skip
            shutil.rmtree(d, ignore_errors=True)
            rows.append(row)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result: dict[str, Any] = {"model": MODEL, "rows": rows, "baseline_bytes": base}
    if len(rows) >= 2:
        lo, hi = rows[0], rows[-1]
        layer = max(r["largest_layer_bytes"] for r in rows)
        for name in [k for k in NAMES if k in hi]:
            growth = hi[name]["peak_rss_largest_process"] - lo[name]["peak_rss_largest_process"]
            result[f"{name}_peak_growth_bytes"] = growth
            result[f"{name}_growth_over_one_layer"] = growth / layer
            print(f"{name}: {lo['layers']} -> {hi['layers']} layers, the peak grew {growth / GB:.3f} GB = "
                  f"{growth / layer:.1f} x the largest layer (the bound: < 1)", flush=True)  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "conversion_memory.json").write_text(json.dumps(result, indent=2))
    plot(rows, out / "conversion_memory.png")
    print(f"wrote {out / 'conversion_memory.json'} and conversion_memory.png")
    return 0


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Peak RSS of the largest process per direction and depth, beside the bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [(k, label) for k, label in NAMES.items() if k in rows[0]]
    fig, ax = plt.subplots(figsize=(7 if len(names) <= 2 else 9, 4))
    width = 0.7 / len(names)
    xs = list(range(len(rows)))
    for i, (key, label) in enumerate(names):
        ax.bar([x + (i - (len(names) - 1) / 2) * width for x in xs], [r[key]["peak_rss_largest_process"] / GB for r in rows],
               width, label=f"{label}: peak RSS, largest process")  # fmt: skip
    for x, r in zip(xs, rows, strict=True):
        ax.hlines(r["bound_bytes"] / GB, x - 0.4, x + 0.4, colors="black", linestyles="--",
                  label="bound: baseline + 1.5 x largest layer" if x == 0 else None)  # fmt: skip
        ax.hlines(r["baseline_bytes"] / GB, x - 0.4, x + 0.4, colors="gray", linestyles=":",
                  label="baseline: the libraries imported" if x == 0 else None)  # fmt: skip
    ax.set_xticks(xs, [f"{r['layers']} layers\n({r['hf_bytes'] / GB:.2f} GB fp32)" for r in rows])
    ax.set_ylabel("peak RSS (GB)")
    ax.set_title("Conversion memory against model depth")
    top = max(
        [r[k]["peak_rss_largest_process"] for r in rows for k, _ in names] + [r["bound_bytes"] for r in rows]
    )
    ax.set_ylim(0, top / GB * (1.35 if len(names) <= 2 else 1.6))  # room for the legend above the bound
    ax.legend(fontsize=8, loc="upper center", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
