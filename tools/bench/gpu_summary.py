"""Summarise the GPU benchmark's runs (tools/bench/gpu.sh): tokens/s and MFU of Tessera and of the raw scripts.

Reads the run table gpu.sh writes (one tab-separated row per run: config, impl, path, exit code, wall
seconds, recipe, overrides) and each run's step records: a ``tessera run`` directory's metrics.jsonl or
a raw script's JSONL (tools/bench/_raw_common.py). The first ``--warmup`` steps are left out. Per run:

    step_time_s      median step time of the measured steps
    tokens_per_s     input tokens of a step (global_batch x seq_len) / step_time_s
    mfu              flops_per_token x tokens_per_s / (peak_flops x world_size)
    flops_per_token  6·N + 12·L·H·Q·T   (PaLM App. B, the formula of Tessera's planner,
                     tessera/plan/time_estimate.py: N = the non-embedding matmul parameters with the
                     LM head, L layers, H heads, Q head dim, T sequence length)
    peak_flops       the recipe's hardware profile at its precision (h200-141g: 989e12 bf16 dense)

and per configuration the ratio Tessera / raw of step time and tokens/s. Writes JSON (``--out``) and
prints a table.

    python tools/bench/gpu_summary.py --runs bench-results/gpu-runs/runs.tsv --warmup 5 \\
        --out bench-results/gpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def read_records(path: Path) -> list[dict[str, Any]]:
    """Step records of a run: ``path/metrics.jsonl`` for a Tessera run directory, else the JSONL itself."""
    f = path / "metrics.jsonl" if path.is_dir() else path
    if not f.is_file():
        return []
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()]


def model_flops(recipe_path: str, overrides: list[str]) -> dict[str, Any]:
    """FLOPs per token (the planner's formula, its terms written out), tokens per step, peak FLOP/s and
    world size of the recipe with its overrides."""
    from tessera.config.loader import load_recipe
    from tessera.models.hf import load_hf_config
    from tessera.plan.facts import model_facts
    from tessera.plan.layout import layout_from_recipe
    from tessera.plan.search import hardware_for
    from tessera.plan.time_estimate import flops_per_token, matmul_params

    recipe = load_recipe(REPO / recipe_path, overrides).recipe
    layout = layout_from_recipe(recipe)
    facts = model_facts(load_hf_config(recipe.model, vocab_size=recipe.data.vocab_size))
    seq = recipe.data.seq_len
    device = "cpu" if recipe.run.device == "cpu" else "cuda"
    hw = hardware_for(recipe, device=device)
    n = matmul_params(facts)
    attn = 12 * facts.num_layers * facts.num_heads * facts.head_dim * seq
    return {
        "flops_per_token": float(flops_per_token(facts, seq)),
        "terms": {"N": n, "L": facts.num_layers, "H": facts.num_heads, "Q": facts.head_dim, "T": seq},
        "expression": f"6*{n} + 12*{facts.num_layers}*{facts.num_heads}*{facts.head_dim}*{seq} = "
        f"{6 * n + attn:.4e}",
        "tokens_per_step": layout.global_batch * seq,
        "peak_flops": hw.peak_for(recipe.train.precision),
        "hardware": hw.name,
        "precision": recipe.train.precision,
        "world_size": layout.world_size,
    }


def summarise_run(row: dict[str, Any], warmup: int) -> dict[str, Any]:
    """One run's figures (``error`` instead when it failed or recorded no step after the warm-up)."""
    recs = read_records(Path(row["path"]))
    out: dict[str, Any] = {k: row[k] for k in ("config", "impl", "path", "rc", "wall_s", "overrides")}
    out["steps_recorded"] = len(recs)
    measured = [r for r in recs if r["step"] > warmup]
    if row["rc"] != 0 or not measured:
        out["error"] = f"exit code {row['rc']}, {len(recs)} steps recorded (see the run's log)"
        return out
    f = model_flops(row["recipe"], row["overrides"].split())
    times = [r["step_time_s"] for r in measured]
    med = statistics.median(times)
    tps = f["tokens_per_step"] / med
    out.update(
        steps_measured=len(measured),
        step_time_s=med,
        step_time_mean_s=statistics.fmean(times),
        tokens_per_s=tps,
        tokens_per_s_mean=f["tokens_per_step"] * len(times) / sum(times),
        mfu=f["flops_per_token"] * tps / (f["peak_flops"] * f["world_size"]),
        time_to_first_step_s=recs[0].get("time_to_first_step_s"),
        loss_step1=recs[0]["loss"],
        loss_last=recs[-1]["loss"],
        peak_memory_bytes=max(r.get("peak_memory_bytes") or 0 for r in recs),
        model=f,
    )
    if "mfu" in measured[0]:  # Tessera's own per-step MFU (the plan's model FLOPs): a cross-check
        out["tessera_reported_mfu_median"] = statistics.median(r["mfu"] for r in measured)
    return out


def compare(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tessera / raw per configuration: step time, tokens/s, time to first step, step-1 loss."""
    by = {(r["config"], r["impl"]): r for r in runs if "error" not in r}
    out = []
    for cfg in dict.fromkeys(r["config"] for r in runs):
        t, raw = by.get((cfg, "tessera")), by.get((cfg, "raw"))
        if t is None or raw is None:
            out.append({"config": cfg, "error": "a run of the pair failed"})
            continue
        out.append(
            {
                "config": cfg,
                "step_time_ratio_tessera_over_raw": t["step_time_s"] / raw["step_time_s"],
                "tokens_per_s_ratio_tessera_over_raw": t["tokens_per_s"] / raw["tokens_per_s"],
                "mfu": {"tessera": t["mfu"], "raw": raw["mfu"]},
                "time_to_first_step_s": {
                    "tessera": t["time_to_first_step_s"],
                    "raw": raw["time_to_first_step_s"],
                },
                "loss_step1": {"tessera": t["loss_step1"], "raw": raw["loss_step1"]},
            }
        )
    return out


def read_table(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        cfg, impl, run_path, rc, wall, recipe, overrides = (line.split("\t") + [""] * 7)[:7]
        rows.append(
            {
                "config": cfg,
                "impl": impl,
                "path": run_path,
                "rc": int(rc),
                "wall_s": float(wall),
                "recipe": recipe,
                "overrides": overrides,
            }
        )
    return rows


def environment() -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        env["device_name"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", required=True, help="the run table gpu.sh writes (runs.tsv)")
    ap.add_argument("--warmup", type=int, default=5, help="first steps left out of the figures")
    ap.add_argument("--mode", default="gpu", help="recorded in the JSON (gpu / cpu-smoke)")
    ap.add_argument("--out", required=True, help="JSON to write")
    args = ap.parse_args(argv)
    runs = [summarise_run(row, args.warmup) for row in read_table(Path(args.runs))]
    result = {
        "benchmark": "tessera_vs_raw_gpu",
        "mode": args.mode,
        "warmup_steps_excluded": args.warmup,
        "formulas": {
            "flops_per_token": "6*N + 12*L*H*Q*T (PaLM App. B; Tessera's planner)",
            "tokens_per_s": "global_batch * seq_len / median step_time_s",
            "mfu": "flops_per_token * tokens_per_s / (peak_flops * world_size)",
        },
        "environment": environment(),
        "runs": runs,
        "comparisons": compare(runs),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{'config':14s} {'impl':8s} {'step ms':>9s} {'tokens/s':>11s} {'MFU':>7s} {'ttfs s':>7s} {'loss@1':>9s}"
    )
    for r in runs:
        if "error" in r:
            print(f"{r['config']:14s} {r['impl']:8s} FAILED: {r['error']}")
            continue
        print(
            f"{r['config']:14s} {r['impl']:8s} {r['step_time_s'] * 1e3:9.1f} {r['tokens_per_s']:11.0f} "
            f"{r['mfu']:7.3f} {r['time_to_first_step_s'] or float('nan'):7.1f} {r['loss_step1']:9.5f}"
        )
    for c in result["comparisons"]:
        if "error" not in c:
            print(f"{c['config']:14s} Tessera/raw step time = {c['step_time_ratio_tessera_over_raw']:.3f}")
    print(f"wrote {out}")
    return 0 if all("error" not in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
