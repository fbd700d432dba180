"""Asynchronous checkpoints against synchronous ones: what a save costs the step loop.

For each model (the tiny Llama of the recipes, hidden 64, and a ~30M-parameter Llama) and each layout
(DeepSpeed ZeRO-2 and megatron-core TP2, 2 gloo ranks), two `tessera run` s of the same recipe, one with
``checkpoint.async=true`` and one with ``false``, save every ``--every`` steps. From rank 0's
metrics.jsonl, each step's **loop time** is the wall time from the end of the step before to the end of
this one: its data, its forward / backward / optimizer step, and what the callbacks of the step before
cost (the save call among them). A step is

- *with a save* when the save was called right before it, or (async) the save was still being written
  when it began (``checkpoint_writing`` in the record before);
- *without* otherwise (the first 3 steps, warm-up, are left out).

Printed per model and layout: the median loop time without a save, with an async save, with a
synchronous save, and the ratios (async / without must stay ≤ 1.10 where sync / without is ≥ 2), and what a save costs the loop in
all (the steps it slowed, beyond their median without a save). The runs alternate (async first, then
sync, per case). Results: ``<out>/async_save.json`` and ``<out>/async_save.png`` (each step's loop time).

    python tools/bench/async_save.py [--steps 40] [--every 4] [--models tiny,30m] [--layouts zero2,tp2]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
LAYOUTS = {"zero2": "tiny-llama-cpu.yaml", "tp2": "tiny-llama-cpu-mcore-tp2.yaml"}
#: ~30M parameters: 8 layers of hidden 512 (25M) + untied 8192-token embeddings and head (8M)
MODELS: dict[str, dict[str, Any] | None] = {
    "tiny": None,  # the recipe's own
    "30m": {
        "model_type": "llama", "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
        "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 8192,
        "max_position_embeddings": 512, "rms_norm_eps": 1.0e-5, "tie_word_embeddings": False,
    },
}  # fmt: skip
WARMUP = 3


def run_once(recipe: Path, out: Path, steps: int, every: int, mode: bool) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "tessera.cli", "run", str(recipe), f"run.out_dir={out}",
           f"train.steps={steps}", f"checkpoint.every={every}", "checkpoint.keep=2",
           f"checkpoint.async={'true' if mode else 'false'}", "tracking.wandb.mode=disabled",
           "train.eval_every=0"]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        raise RuntimeError(f"tessera run failed ({p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def split(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Loop times of the steps with and without a save (see the module's docstring)."""
    with_save, without, series = [], [], []
    for before, rec in itertools.pairwise(records):
        if rec["step"] <= WARMUP or rec.get("eval_loss") is not None or before.get("eval_loss") is not None:
            continue
        loop = rec["wall_time"] - before["wall_time"]
        saving = bool("checkpoint_s" in before or before.get("checkpoint_writing"))
        (with_save if saving else without).append(loop)
        series.append((rec["step"], loop, saving))
    saves = [r["checkpoint_s"] for r in records if "checkpoint_s" in r]
    waits = [r.get("checkpoint_wait_s", 0.0) for r in records if "checkpoint_s" in r]
    return {
        "with_save_s": with_save,
        "without_s": without,
        "median_with_save_s": statistics.median(with_save) if with_save else None,
        "median_without_s": statistics.median(without) if without else None,
        "save_call_s": saves,
        "save_wait_s": waits,
        "steps_writing": sum(1 for r in records if r.get("checkpoint_writing")),
        "saved_after": [r["step"] for r in records if "checkpoint_s" in r],
        "series": series,
    }


def plot(cases: list[dict[str, Any]], path: Path) -> None:
    """Per case, each step's loop time with async and with sync saves, the saves marked, and the median
    step without a save drawn beside them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(cases), figsize=(5.2 * len(cases), 4.2), squeeze=False)
    for ax, case in zip(axes[0], cases, strict=True):
        for mode, color in (("sync", "tab:red"), ("async", "tab:blue")):
            steps = [st for st, _, _ in case[mode]["series"]]
            ms = [loop * 1e3 for _, loop, _ in case[mode]["series"]]
            ax.plot(steps, ms, color=color, lw=1.2, label=f"checkpoint.async={str(mode == 'async').lower()}")
            for saved in case[mode]["saved_after"]:
                ax.axvline(saved + 1, color=color, lw=0.5, alpha=0.25)
        ax.axhline(
            case["median_without_s"] * 1e3, color="black", ls="--", lw=1, label="median step without a save"
        )
        ax.set_title(f"{case['model']} model, {case['layout']}: async {case['async_over_without']:.2f} x, "
                     f"sync {case['sync_over_without']:.2f} x", fontsize=9)  # fmt: skip
        ax.set_xlabel("step (faint lines: the step after each save)")
        ax.set_ylabel("loop time per step (ms)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("What a checkpoint costs the step loop (2 gloo ranks, 2 CPU cores)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--models", default="tiny,30m")
    ap.add_argument("--layouts", default="zero2,tp2")
    ap.add_argument("--out", default=str(REPO / "bench-results"))
    args = ap.parse_args()
    work = Path(
        tempfile.mkdtemp(prefix=".bench-async-save-", dir=REPO / "runs" if (REPO / "runs").is_dir() else None)
    )
    results: list[dict[str, Any]] = []
    lines: list[str] = []
    try:
        for model in args.models.split(","):
            for layout in args.layouts.split(","):
                recipe = work / f"{model}-{layout}.yaml"
                doc: dict[str, Any] = {"include": [str(REPO / "recipes" / LAYOUTS[layout])]}
                if MODELS[model] is not None:
                    doc["model"] = {"hf_config": MODELS[model]}
                    doc["data"] = {"vocab_size": MODELS[model]["vocab_size"]}
                recipe.write_text(yaml.safe_dump(doc, sort_keys=False))
                case: dict[str, Any] = {"model": model, "layout": layout}
                for mode in (True, False):
                    out = work / f"{model}-{layout}-{'async' if mode else 'sync'}"
                    t0 = time.perf_counter()
                    case["async" if mode else "sync"] = {**split(run_once(recipe, out, args.steps, args.every, mode)),
                                                         "run_s": time.perf_counter() - t0}  # fmt: skip
                    shutil.rmtree(out, ignore_errors=True)
                a, s = case["async"], case["sync"]
                base = statistics.median(a["without_s"] + s["without_s"])
                case["median_without_s"] = base
                case["async_over_without"] = a["median_with_save_s"] / base
                case["sync_over_without"] = s["median_with_save_s"] / base
                for mode in (a, s):  # what a save costs the loop in all: the steps it slowed, beyond a step
                    mode["extra_per_save_s"] = (
                        sum(mode["with_save_s"]) - base * len(mode["with_save_s"])
                    ) / max(1, len(mode["save_call_s"]))
                results.append(case)
                lines.append(
                    f"{model:5} {layout:6} step {base * 1e3:8.1f} ms | with an async save "
                    f"{a['median_with_save_s'] * 1e3:8.1f} ms = {case['async_over_without']:5.2f} x | with a sync save "
                    f"{s['median_with_save_s'] * 1e3:8.1f} ms = {case['sync_over_without']:5.2f} x | "
                    f"async save call {statistics.median(a['save_call_s']) * 1e3:6.1f} ms, "
                    f"sync {statistics.median(s['save_call_s']) * 1e3:7.1f} ms | per save in all: async "
                    f"{a['extra_per_save_s'] * 1e3:7.1f} ms over {a['steps_writing'] / max(1, len(a['save_call_s'])) + 1:.1f} "
                    f"steps, sync {s['extra_per_save_s'] * 1e3:7.1f} ms"
                )
                print(lines[-1], flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if results:
        plot(results, out_dir / "async_save.png")
    record = {"steps": args.steps, "every": args.every, "table": lines, "cases": results,
              "cpu_count": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
    (out_dir / "async_save.json").write_text(json.dumps(record, indent=2))
    print(f"wrote {out_dir / 'async_save.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
