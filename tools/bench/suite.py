"""`make bench`: Tessera's benchmark suite on this machine, every figure a ratio measured side by side.

1. overhead     `tessera run` vs a hand-written DeepSpeed script (ZeRO-2) and a hand-written megatron-core
                script (TP2), each launched the same way (the deepspeed launcher, cores bound per rank), on
                the tiny Llama and a ~30M one, alternating tessera / raw / raw / tessera, then raw /
                tessera / tessera / raw, repeated (--pairs N launch pairs, default 16; --quick: the first
                four launches): the step ratio is the geometric mean over the neighbouring launch pairs
                of their median steady step periods (wall clock between consecutive step ends, so the
                loop's own work counts), with a bootstrap 90 % interval over the pairs; the time to first
                step (rank process start, and command start, to the end of step 1), after one untimed
                launch of each (the raw ranks build DeepSpeed's CPU comm op at their first use); and
                tools/bench/step_ab.py: both sides' engines, each built as its side builds it, in the
                same two rank processes, alternating step by step (ABBA).
2. comm         per layout (ZeRO 0-3, ddp, megatron TP2, PP2, EP2): the bytes each rank sent per step
                (counted collectives x the algorithm's wire factor) / the theoretical minimum of the
                layout (`plan.comm_estimate.minimum_wire_bytes`), and the share of the step in collectives.
3. memory       the same runs: model-state bytes, one micro-batch's activation bytes and peak memory per
                rank / the planner's figures (plan.json).
4. checkpoint   tools/bench/checkpoint_io.py: save / load of a ~1 GB checkpoint vs a plain fsync'd write /
                read of the same bytes; HF -> megatron TP2 conversion vs reading the weights, peak RSS.
5. scaling      step time at 1 and 2 ranks (same global batch) for ddp, ZeRO-3 and megatron TP2 (TP1 at
                one rank), against the ideal halving.
6. calibration  leave one out over a pool of two layouts per engine / per fitted term (ZeRO-1, ZeRO-2;
                DDP at micro-batch 4 and 8; megatron TP2 at micro-batch 4 and 8, PP2, EP2): `tessera plan
                --calibrate` on the others predicts each of ZeRO-2, DDP, TP2 and PP2 / its measured median
                step (the planner's 25 % acceptance), and the profile fitted on all of them, in sample.

Writes bench-results/<item>.json, bench-results/suite.json, bench-results/results.md, bench-results/
suite.png, and the results section of docs/benchmarks.md (between the bench-results markers).

    python tools/bench/suite.py [--only overhead,comm,...] [--quick] [--out bench-results] [--no-doc]

The GPU benchmark is tools/bench/gpu.sh (one H200), run apart.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
ITEMS = ("overhead", "comm", "memory", "checkpoint", "scaling", "calibration")
#: the results section the suite rewrites, between these markers (the README links to it)
RESULTS_DOC = "docs/benchmarks.md"
RESULTS_BEGIN, RESULTS_END = "<!-- bench-results:begin -->", "<!-- bench-results:end -->"
#: every run: no W&B, no checkpoint (the checkpoint benchmark measures those apart), eval only after the
#: last step (outside the step periods; ~6 s of the ~30M command's end)
QUIET = [
    "tracking.wandb.mode=disabled",
    "checkpoint.at_end=false",
    "checkpoint.every=0",
    "train.eval_every=0",
]
LAYOUTS: dict[str, tuple[str, list[str]]] = {  # name -> (recipe, overrides), the tiny models on 2 ranks
    "zero0": ("tiny-llama-cpu.yaml", ["parallel.zero=0"]),
    "zero1": ("tiny-llama-cpu.yaml", ["parallel.zero=1"]),
    "zero2": ("tiny-llama-cpu.yaml", []),
    "zero2_mb2": ("tiny-llama-cpu.yaml", ["parallel.micro_batch=2"]),  # 4 micro-batches: 3 hook passes
    "zero3": ("tiny-llama-cpu.yaml", ["parallel.zero=3"]),
    "ddp": ("tiny-llama-cpu-ddp.yaml", []),
    "ddp_mb8": (
        "tiny-llama-cpu-ddp.yaml",
        ["parallel.micro_batch=8"],
    ),  # the same global batch, no accumulation
    "tp2": ("tiny-llama-cpu-mcore-tp2.yaml", []),
    "tp2_mb8": ("tiny-llama-cpu-mcore-tp2.yaml", ["parallel.micro_batch=8"]),  # half the TP messages per step
    "pp2": ("tiny-llama-cpu-mcore-pp2.yaml", []),
    "ep2": ("tiny-mixtral-cpu-mcore-ep2.yaml", []),
}
#: scaling: the 2-rank layout and the same engine on one rank
SCALING = {"ddp": [], "zero3": [], "tp2": ["parallel.tp=1"]}
#: overhead: launch pairs per layout (ABBA BAAB blocks of four pairs; --pairs)
LAUNCH_PAIRS = 16
#: overhead pairs: (model, layout, raw script, steps a launch, warm-up steps). Tiny ZeRO-2 ~35 ms and TP2
#: ~125 ms a step: ~9 s and ~15 s of steady steps a launch (60 steps of ZeRO-2, ~2 s, were shorter than the
#: machine's moods: pairs spread 0.81-1.38 then); the ~30M model's ~1.1 s steps, at a smaller global batch:
#: 27 periods (~30 s) a launch (12 steps, 9 periods, spread its pairs 0.85-1.22: shorter than the tens of
#: seconds the machine keeps its fast or slow mode)
OVERHEAD = [
    ("tiny", "zero2", "raw_deepspeed.py", 240, 10),
    ("tiny", "tp2", "raw_megatron.py", 120, 10),
    ("30m", "zero2", "raw_deepspeed.py", 30, 2),
    ("30m", "tp2", "raw_megatron.py", 30, 2),
]
#: the planner's acceptance layouts, each predicted by a profile calibrated on the rest of the pool (which
#: holds another layout of each engine, so that no engine's efficiency is missing when one is held out,
#: and a second ZeRO-2 layout, whose gradient hooks on its micro-batches before the last are fitted)
POOL = ("zero1", "zero2", "zero2_mb2", "ddp", "ddp_mb8", "tp2", "tp2_mb8", "pp2", "ep2")
CHECKED = ("zero2", "ddp", "tp2", "pp2")


@dataclass
class Steps:
    """One run's per-step records (rank 0) and when its command started."""

    records: list[dict[str, Any]]
    launched: float
    run_dir: Path | None = None

    def periods(self, warmup: int) -> list[float]:
        """Wall-clock seconds between consecutive step ends after ``warmup`` steps."""
        wall = [r["wall_time"] for r in self.records if r["step"] > warmup]
        return [b - a for a, b in itertools.pairwise(wall)]

    def gaps(self, warmup: int) -> list[float]:
        """Seconds between one step's end and the next one's start after ``warmup`` steps: the loop's own
        work outside the timed step (metrics, logs, progress, stop rules)."""
        recs = [r for r in self.records if r["step"] > warmup]
        return [b["wall_time"] - a["wall_time"] - b["step_time_s"] for a, b in itertools.pairwise(recs)]

    def median_step(self, warmup: int) -> float:
        return statistics.median(r["step_time_s"] for r in self.records if r["step"] > warmup)

    @property
    def ttfs_process(self) -> float:
        return float(self.records[0]["time_to_first_step_s"])

    @property
    def ttfs_command(self) -> float:
        return float(self.records[0]["wall_time"]) - self.launched


def _say(msg: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(f"[bold cyan]bench[/] {msg}", highlight=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _recipe(model: str, recipe: str, work: Path) -> Path:
    """The recipe file, or for the ~30M model the same recipe with configs/models/llama-30m.yaml on top, at
    a smaller global batch (8, micro-batch 4: ~1.1 s steps)."""
    if model == "tiny":
        return REPO / "recipes" / recipe
    path = work / f"{model}-{recipe}"
    path.write_text(
        f"include:\n  - {REPO / 'recipes' / recipe}\n  - {REPO / 'configs/models/llama-30m.yaml'}\n"
        "parallel:\n  global_batch: 8\n  micro_batch: 4\n"
    )
    return path


def _check(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> None:
    with log.open("w") as out:
        rc = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise SystemExit(f"bench: `{' '.join(cmd)}` exited {rc}; the end of {log}:\n{tail}")


REUSE = False  # --reuse: keep the layout runs of an earlier suite in --work (re-analysing, not re-running)


def tessera_run(recipe: Path, overrides: list[str], steps: int, out: Path, *, reuse: bool = False) -> Steps:
    """`tessera run` as a user types it; returns rank 0's metrics and the launch time (``reuse``: a finished
    run already in ``out`` instead)."""
    from tessera.rundir import RunDir

    if reuse and (out / "summary.json").is_file():
        return Steps(RunDir(out).read_metrics(), float("nan"), out)
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        str(BIN / "tessera"),
        "run",
        str(recipe),
        *overrides,
        *QUIET,
        f"train.steps={steps}",
        f"run.out_dir={out}",
    ]
    t0 = time.time()
    _check(cmd, out.with_suffix(".log"))
    return Steps(RunDir(out).read_metrics(), t0, out)


def _launch_script(script: str, args: list[str], log: Path, world: int = 2) -> None:
    """tools/bench/``script`` on ``world`` ranks, launched as `tessera run` launches its ranks (the deepspeed
    launcher, cores bound per rank); DeepSpeed's CPU shared-memory segments of the rendezvous removed after."""
    from tessera.comm.shm import release_shared_memory

    port = _free_port()
    cmd = [str(BIN / "deepspeed"), "--num_gpus", str(world), "--bind_cores_to_rank", "--master_addr", "127.0.0.1",
           "--master_port", str(port), str(REPO / "tools/bench" / script), *args]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    try:
        _check(cmd, log, env)
    finally:
        release_shared_memory("127.0.0.1", port)


def raw_run(script: str, recipe: Path, overrides: list[str], steps: int, out: Path) -> Steps:
    """A hand-written script's run; rank 0's step records and the launch time."""
    jsonl = out.with_suffix(".jsonl")
    jsonl.unlink(missing_ok=True)
    t0 = time.time()
    args = ["--recipe", str(recipe), *overrides, "--steps", str(steps), "--out", str(jsonl)]
    _launch_script(script, args, out.with_suffix(".log"))
    return Steps([json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()], t0)


def step_ab(recipe: Path, overrides: list[str], pairs: int, out: Path) -> dict[str, Any]:
    """tools/bench/step_ab.py: Tessera's engine and the raw script's own, alternating step by step in one
    job; its JSON."""
    res = out.with_suffix(".json")
    res.unlink(missing_ok=True)
    args = ["--recipe", str(recipe), *overrides, *QUIET, "--pairs", str(pairs), "--out", str(res)]
    _launch_script("step_ab.py", args, out.with_suffix(".log"))
    return dict(json.loads(res.read_text()))


def geometric_mean(ratios: list[float]) -> float:
    """The mean of ratios on the log scale (a pair at 1.1 and one at 1/1.1 average to 1)."""
    return math.exp(statistics.fmean(math.log(x) for x in ratios))


def bootstrap_ci90(ratios: list[float], resamples: int = 10_000, seed: int = 0) -> list[float]:
    """5th and 95th percentile of the geometric mean over resamples of the pairs (with replacement, seeded):
    where the paired estimate would land if the machine's noise were drawn again. With few pairs it is
    narrower than the truth (8 pairs: it cannot see noise the 8 did not meet)."""
    rng = random.Random(seed)
    means = sorted(geometric_mean(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return [means[int(0.05 * resamples)], means[int(0.95 * resamples) - 1]]


def bench_overhead(work: Path, quick: bool, launch_pairs: int = LAUNCH_PAIRS) -> dict[str, Any]:
    # untimed: the raw scripts' ranks JIT-build DeepSpeed's CPU shared-memory comm op in torch's default
    # directory at their first use (~90 s here; Tessera's ranks load the one make setup built)
    _say("overhead: one untimed launch of each side (one-time builds)")
    recipe_name, overrides = LAYOUTS["zero2"]
    tessera_run(REPO / "recipes" / recipe_name, overrides, 1, work / "overhead-warmup-tessera")
    raw_run("raw_deepspeed.py", REPO / "recipes" / recipe_name, overrides, 1, work / "overhead-warmup-raw")
    rows = []
    for model, layout, script, steps, warmup in OVERHEAD:
        recipe_name, overrides = LAYOUTS[layout]
        recipe = _recipe(model, recipe_name, work)
        if quick:
            steps, warmup = (30, 5) if model == "tiny" else (6, 2)
        runs: dict[str, list[Steps]] = {"tessera": [], "raw": []}
        # ABBA BAAB, repeated: drift hits both alike, and each neighbouring pair holds one launch of each
        # side. Sixteen pairs: a launch's median moves by up to ~15 % with the machine's load a minute
        # apart (the ~30M steps switch between a fast and a slow mode for tens of seconds at a time), so a
        # 3 % question needs the average of many pairs, not one long launch of each
        abba = ("tessera", "raw", "raw", "tessera")
        baab = ("raw", "tessera", "tessera", "raw")
        order = abba if quick else (abba + baab) * (launch_pairs // 4)
        for k, who in enumerate(order):
            _say(f"overhead {model} {layout}: {who} ({k + 1}/{len(order)})")
            out = work / f"overhead-{model}-{layout}-{who}-{k}"
            if who == "tessera":
                runs[who].append(tessera_run(recipe, overrides, steps, out))
            else:
                runs[who].append(raw_run(script, recipe, overrides, steps, out))
        # the same comparison a step apart in one job, each side on the objects it builds itself: the
        # machine's load moves both sides alike
        _say(f"overhead {model} {layout}: tessera's engine and the raw script's alternating in one job")
        ab_pairs = (10 if quick else 100) if model == "tiny" else (6 if quick else 60)
        ab = step_ab(recipe, overrides, ab_pairs, work / f"overhead-{model}-{layout}-step-ab")
        period = {w: statistics.median(p for r in rs for p in r.periods(warmup)) for w, rs in runs.items()}
        # each launch's median step period over its neighbour's (the k-th tessera launch and the k-th raw
        # launch are neighbours in this order): the paired design's estimate is their geometric mean
        launch = {w: [statistics.median(r.periods(warmup)) for r in rs] for w, rs in runs.items()}
        pairs = [t / r for t, r in zip(launch["tessera"], launch["raw"], strict=True)]
        gap = {w: statistics.median(g for r in rs for g in r.gaps(warmup)) for w, rs in runs.items()}
        proc = {w: statistics.median(r.ttfs_process for r in rs) for w, rs in runs.items()}
        cmd = {w: statistics.median(r.ttfs_command for r in rs) for w, rs in runs.items()}
        rows.append({
            "model": model, "layout": layout, "raw_script": f"tools/bench/{script}", "steps": steps,
            "warmup_steps": warmup, "tokens_per_step": runs["tessera"][0].records[-1]["tokens"],
            "step_ratio": geometric_mean(pairs), "step_ratio_ci90": bootstrap_ci90(pairs),
            "pair_step_ratios": pairs, "launch_median_step_period_s": launch,
            "median_step_period_s": period, "pooled_step_ratio": period["tessera"] / period["raw"],
            "between_steps_s": gap,
            "time_to_first_step_process_s": proc, "ttfs_process_ratio": proc["tessera"] / proc["raw"],
            "time_to_first_step_command_s": cmd, "ttfs_command_ratio": cmd["tessera"] / cmd["raw"],
            "loss_at_last_step": {w: rs[0].records[-1]["loss"] for w, rs in runs.items()},
            "in_process": {
                "raw_objects": ab["raw_objects"], "pairs": ab["pairs"], "median_step_s": ab["median_step_s"], "pair_ratios": ab["pair_ratios"],
                "step_ratio": geometric_mean(ab["pair_ratios"]),
                "step_ratio_ci90": bootstrap_ci90(ab["pair_ratios"]),
            },
        })  # fmt: skip
    return {"targets": {"step_ratio": 1.03, "ttfs_ratio": 1.2}, "pairs": rows}


# ---- 2-3. communication and memory of every layout, 5. scaling -------------------------------------------


def _group_sizes(layout: Any) -> dict[str, int]:
    from tessera.plan.estimate import expert_dp

    return {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp, "ep": layout.ep, "edp": expert_dp(layout),
            "embd": 2, "world": layout.world_size}  # fmt: skip


def comm_of(run_dir: Path, warmup: int) -> dict[str, Any]:
    """Measured wire bytes per step of the busiest rank vs the layout's theoretical minimum."""
    from tessera.models.hf import load_hf_config
    from tessera.plan.comm_estimate import minimum_wire_bytes, wire_factor
    from tessera.plan.facts import model_facts
    from tessera.plan.layout import layout_from_recipe
    from tessera.plan.measured import run_recipe
    from tessera.rundir import RunDir, read_jsonl

    rd = RunDir(run_dir)
    recipe = run_recipe(run_dir)
    layout = layout_from_recipe(recipe)
    f = model_facts(load_hf_config(recipe.model, vocab_size=recipe.data.vocab_size))
    least, formula = minimum_wire_bytes(
        f, layout, seq_len=recipe.data.seq_len, precision=recipe.train.precision
    )
    sizes = _group_sizes(layout)
    wire: dict[int, dict[int, float]] = {}  # rank -> step -> bytes sent
    payload: dict[int, dict[int, float]] = {}
    for line in read_jsonl(rd.comm):
        if line.get("phase") != "step" or line["step"] <= warmup:
            continue
        for o in line["ops"]:
            n = sizes.get(o["group"], layout.world_size)
            w = wire.setdefault(line["rank"], {})
            w[line["step"]] = w.get(line["step"], 0.0) + wire_factor(o["op"], n) * o["bytes"]
            p = payload.setdefault(line["rank"], {})
            p[line["step"]] = p.get(line["step"], 0.0) + o["bytes"]
    per_rank = {r: statistics.median(s.values()) for r, s in wire.items()}
    busiest = max(per_rank, key=per_rank.__getitem__)
    steady = [r for r in rd.read_metrics() if r["step"] > warmup]
    plan = json.loads(rd.plan.read_text())["chosen"]
    return {
        "layout": plan["layout"],
        "wire_bytes_per_step": per_rank[busiest],
        "busiest_rank": busiest,
        "payload_bytes_per_step": statistics.median(payload[busiest].values()),
        "planned_payload_bytes_per_step": sum(plan["comm_bytes_per_step"].values()),
        "minimum_wire_bytes_per_step": least,
        "minimum_formula": formula,
        "ratio_to_minimum": per_rank[busiest] / least if least else None,
        "comm_time_fraction": statistics.median(r["comm_time_s"] / r["step_time_s"] for r in steady),
        "median_step_s": statistics.median(r["step_time_s"] for r in steady),
    }


def memory_of(run_dir: Path) -> dict[str, Any]:
    """Measured bytes per rank / the planner's, for model states, activations and peak: the planner sizes
    the stage that needs the most (pipelines: first or last), so the ranks of that stage are compared."""
    from tessera.plan.hardware import load_hardware
    from tessera.plan.layout import layout_from_recipe
    from tessera.plan.measured import predicted, run_recipe

    summary = json.loads((run_dir / "summary.json").read_text())
    recipe = run_recipe(run_dir)
    layout = layout_from_recipe(recipe)
    mem = predicted(recipe, load_hardware("cpu-2core")).memory
    pp = {"only": None, "first": 0, "last": layout.pp - 1}[mem.stage]
    ranks = [r for r in range(layout.world_size) if pp is None or layout.coords(r)["pp"] == pp]
    held = summary["model_state_bytes_per_rank"]
    states = max(sum(held[r].get(k, 0) for k in ("params", "grads", "optimizer")) for r in ranks)
    acts = max(summary["activation_bytes_per_rank"][r] for r in ranks)
    peak = max(summary["peak_memory_bytes_per_rank"][r] for r in ranks)
    planned_states = mem.params + mem.grads + mem.optimizer
    return {
        "stage": mem.stage, "ranks": ranks,
        "model_state_bytes": states, "planned_model_state_bytes": planned_states,
        "model_state_ratio": states / planned_states,
        "activation_bytes": acts, "planned_activation_bytes": mem.activations_per_micro_batch,
        "activation_ratio": acts / mem.activations_per_micro_batch,
        "peak_bytes": peak, "planned_peak_bytes": mem.total, "peak_ratio": peak / mem.total,
    }  # fmt: skip


def bench_layouts(
    work: Path, quick: bool, scaling: bool
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    steps, warmup = (20, 5) if quick else (40, 5)
    comm, memory, scale = {}, {}, {}
    for name, (recipe, overrides) in LAYOUTS.items():
        _say(f"layout {name}: tessera run, 2 ranks")
        two = tessera_run(REPO / "recipes" / recipe, overrides, steps, work / f"layout-{name}", reuse=REUSE)
        comm[name] = comm_of(two.run_dir, warmup)
        memory[name] = memory_of(two.run_dir)
        if scaling and name in SCALING:
            _say(f"scaling {name}: the same global batch on 1 rank")
            one = tessera_run(REPO / "recipes" / recipe, [*overrides, *SCALING[name], "run.world_size=1"],
                              steps, work / f"scaling-{name}-1rank", reuse=REUSE)  # fmt: skip
            t1, t2 = one.median_step(warmup), two.median_step(warmup)
            scale[name] = {"step_s_1_rank": t1, "step_s_2_ranks": t2, "speedup": t1 / t2, "ideal_speedup": 2.0,
                           "efficiency": t1 / (2 * t2)}  # fmt: skip
    runs = {name: str(work / f"layout-{name}") for name in LAYOUTS}
    return {"steps": steps, "warmup_steps": warmup, "layouts": comm, "runs": runs}, {"layouts": memory}, scale


# ---- 6. calibration -------------------------------------------------------------------------------------


def bench_calibration(work: Path) -> dict[str, Any]:
    """Leave one out: for each acceptance layout, `cpu-2core` calibrated on the other runs of the pool
    predicts its step; and the profile calibrated on the whole pool, in sample."""
    from tessera.config.loader import load_recipe
    from tessera.launch.probe import measure
    from tessera.plan.hardware import load_hardware
    from tessera.plan.measured import calibrate, compare_to_run
    from tessera.plan.probe import profile_from

    base = load_hardware("cpu-2core")
    run = {n: work / f"layout-{n}" for n in POOL}
    whole, report = calibrate([run[n] for n in POOL], base)
    # `tessera plan --probe`: this machine measured for the default recipe, no run calibrated on
    _say("probe: tessera plan --probe's measurement, 2 ranks")
    recipe = load_recipe(str(REPO / "recipes" / "tiny-llama-cpu.yaml"), []).recipe
    measured = measure(recipe, world=2, device="cpu")
    probed, how = profile_from(measured, recipe, world=2, device="cpu")
    rows = {}
    for name in CHECKED:
        held, _ = calibrate([run[n] for n in POOL if n != name], base)
        out = compare_to_run(run[name], held)["terms"]["step"]
        ins = compare_to_run(run[name], whole)["terms"]["step"]
        stock = compare_to_run(run[name], base)["terms"]["step"]
        probe = compare_to_run(run[name], probed)["terms"]["step"]
        rows[name] = {
            "calibrated_on": [n for n in POOL if n != name], "measured_s": out["measured_s"],
            "held_out_predicted_s": out["predicted_s"], "held_out_ratio": out["predicted_s"] / out["measured_s"],
            "in_sample_ratio": ins["predicted_s"] / ins["measured_s"],
            "stock_profile_ratio": stock["predicted_s"] / stock["measured_s"],
            "probe_ratio": probe["predicted_s"] / probe["measured_s"],
        }  # fmt: skip
        _say(f"  {name}: predicted / measured step: probed {rows[name]['probe_ratio']:.2f}, held-out calibrated "
             f"{rows[name]['held_out_ratio']:.2f}, stock {rows[name]['stock_profile_ratio']:.2f}")  # fmt: skip
    fit = {k: v for k, v in report.items() if k != "runs"}
    profile = {"latency_s": whole.latency_s, "tp_latency_s": whole.tp_latency_s,
               "bandwidth": whole.intra_node_bandwidth, "engine_efficiency": whole.engine_efficiency,
               "grad_hook_s": whole.grad_hook_s}  # fmt: skip
    probe_record = {"seconds": measured["seconds"], "derivation": how,
                    "profile": {k: v for k, v in vars(probed).items() if v is not None}}  # fmt: skip
    return {"pool": list(POOL), "profile": profile, "fit": fit, "acceptance": 0.25, "layouts": rows,
            "probe": probe_record}  # fmt: skip


# ---- output --------------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    import importlib.metadata as md

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())  # fmt: skip
    mem = next(int(ln.split()[1]) * 1024 for ln in Path("/proc/meminfo").read_text().splitlines()
               if ln.startswith("MemTotal"))  # fmt: skip
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    # uncommitted changes to the code (not to the results doc or bench-results/, which the suite itself writes)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", ".", f":!{RESULTS_DOC}", ":!bench-results"],
                           cwd=REPO, capture_output=True, text=True).stdout.strip()  # fmt: skip
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem / 2**30, 1), "python": platform.python_version(),
        "versions": {p: md.version(p) for p in ("torch", "deepspeed", "megatron-core", "transformers")},
        "commit": commit.stdout.strip() + ("+uncommitted changes" if dirty else ""),
    }  # fmt: skip


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "—" if x is None else format(x, fmt)


def _pair_range(r: dict[str, Any]) -> str:
    pairs = r.get("pair_step_ratios")  # absent in results written before it was measured
    return f"{min(pairs):.2f}-{max(pairs):.2f}" if pairs else "—"


def _gaps(r: dict[str, Any]) -> str:
    g = r.get("between_steps_s")
    return f"{g['raw'] * 1e3:.1f} / {g['tessera'] * 1e3:.1f}" if g else "—"


def markdown(res: dict[str, Any]) -> str:
    m = res["machine"]
    v = ", ".join(f"{k} {x}" for k, x in m["versions"].items())
    out = [f"Measured {m['date']} on {m['cpu']} ({m['cores']} cores, {m['memory_gib']} GiB), Python "
           f"{m['python']}, {v}, commit {m['commit']}. Rerun: `make bench` (this section is rewritten).", ""]  # fmt: skip
    if m.get("rerun"):
        r = m["rerun"]
        out[0] += f" Re-run {r['date']} (commit {r['commit']}): {', '.join(r['items'])}."
    if "overhead" in res:
        out += ["**1. Overhead** — `tessera run` / the hand-written script, same launcher, recipe, weights and "
                "batches. Target ≤ 1.03 per step, ≤ 1.2 to first step.", "",
                "Launches alternate (ABBA BAAB, repeated); each neighbouring pair holds one launch of each side. "
                "*Step ratio*: the geometric mean over the pairs of the two launches' median step periods "
                "(wall clock between step ends after warm-up), with a bootstrap 90 % interval over the pairs "
                "and the pairs' range; *pooled*: the median of all periods of each side (the earlier "
                "headline; a poor estimate where the step switches between a fast and a slow mode). "
                "*Between steps*: the loop's time outside the timed step (metrics, logs, progress, stop "
                "rules). First step: from the rank process's start and from the command's.", "",
                "| model | layout | raw script | pairs | step ratio | 90 % interval | pair range | pooled step ms "
                "raw / tessera | pooled ratio | between steps ms raw / tessera | first step s raw / tessera "
                "(process) | ratio | ratio (command) |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for r in res["overhead"]["pairs"]:
            p, q = r["median_step_period_s"], r["time_to_first_step_process_s"]
            ci = r.get("step_ratio_ci90")  # absent in results written before it was measured
            pooled = r.get("pooled_step_ratio", p["tessera"] / p["raw"])
            out.append(f"| {r['model']} | {r['layout']} | `{Path(r['raw_script']).name}` | "
                       f"{len(r.get('pair_step_ratios', [])) or '—'} | {r['step_ratio']:.3f} | "
                       f"{f'{ci[0]:.3f}-{ci[1]:.3f}' if ci else '—'} | {_pair_range(r)} | "
                       f"{p['raw'] * 1e3:.1f} / {p['tessera'] * 1e3:.1f} | {pooled:.3f} | {_gaps(r)} | "
                       f"{q['raw']:.1f} / {q['tessera']:.1f} | {r['ttfs_process_ratio']:.2f} | "
                       f"{r['ttfs_command_ratio']:.2f} |")  # fmt: skip
        inproc = [r for r in res["overhead"]["pairs"] if r.get("in_process")]
        if inproc:
            own = all(r["in_process"].get("raw_objects") == "own" for r in inproc)
            what = ("the raw script's step and its loss all-reduce on the DeepSpeed engine / megatron model "
                    "and optimizer it builds itself, beside Tessera's" if own else
                    "the raw script's own step on the same engine")  # fmt: skip
            out += ["", "Step against step in one job (`tools/bench/step_ab.py`): Tessera's engine step "
                    f"(`engine.train_step`) and {what}, alternating (ABBA) in the same two rank processes, "
                    "so that the machine's load moves both alike; the loop between steps is the launch "
                    "pairs' *between steps* column.", "",
                    "| model | layout | step pairs | median step ms raw / tessera | step ratio | 90 % interval "
                    "| middle 80 % of pairs |", "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
            for r in inproc:
                a = r["in_process"]
                m, ci, pr = a["median_step_s"], a["step_ratio_ci90"], sorted(a["pair_ratios"])
                lo, hi = pr[int(0.1 * len(pr))], pr[int(0.9 * len(pr)) - 1]
                out.append(f"| {r['model']} | {r['layout']} | {a['pairs']} | {m['raw'] * 1e3:.1f} / "
                           f"{m['tessera'] * 1e3:.1f} | {a['step_ratio']:.3f} | {ci[0]:.3f}-{ci[1]:.3f} | "
                           f"{lo:.2f}-{hi:.2f} |")  # fmt: skip
        out.append("")
    if "comm" in res:
        out += ["**2. Communication** — bytes the busiest rank sends per step (counted collectives × the "
                "algorithm's wire factor) / the layout's theoretical minimum (bandwidth-optimal collectives, "
                "`minimum_wire_bytes`), and the step's share in collectives (median).", "",
                "| layout | sent MB/step | minimum MB | sent / minimum | minimum | comm share of step |",
                "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for name, r in res["comm"]["layouts"].items():
            out.append(f"| {name} | {r['wire_bytes_per_step'] / 1e6:.3f} | {r['minimum_wire_bytes_per_step'] / 1e6:.3f} "
                       f"| {_f(r['ratio_to_minimum'], '.2f')} | {r['minimum_formula']} | {r['comm_time_fraction']:.0%} |")  # fmt: skip
        out.append("")
    if "memory" in res:
        out += ["**3. Memory** — measured / planned per rank (the largest rank): model states, one micro-batch's "
                "activations (saved-tensor hooks), peak (on CPU the process RSS, ~0.45 GB of it libraries).", "",
                "| layout | model states | activations | peak |", "| --- | --- | --- | --- |"]  # fmt: skip
        for name, r in res["memory"]["layouts"].items():
            out.append(
                f"| {name} | {r['model_state_ratio']:.3f} | {r['activation_ratio']:.3f} | {r['peak_ratio']:.1f} |"
            )
        out.append("")
    if res.get("checkpoint"):
        c = res["checkpoint"]
        out += [
            "**4. Checkpoint I/O** — `tools/bench/checkpoint_io.py`:",
            "",
            "```",
            *c.get("table", []),
            "```",
            "",
        ]
    if "scaling" in res:
        out += ["**5. Scaling** — median step at 1 and 2 ranks, same global batch (1 rank runs 2 threads on the "
                "same 2 cores, so this is distributed vs threaded on one machine); ideal speedup 2.", "",
                "| layout | 1 rank ms | 2 ranks ms | speedup | efficiency |", "| --- | --- | --- | --- | --- |"]  # fmt: skip
        for name, r in res["scaling"].items():
            out.append(f"| {name} | {r['step_s_1_rank'] * 1e3:.1f} | {r['step_s_2_ranks'] * 1e3:.1f} | "
                       f"{r['speedup']:.2f} | {r['efficiency']:.2f} |")  # fmt: skip
        out.append("")
    if "calibration" in res:
        c, p = res["calibration"], res["calibration"]["profile"]
        eff = ", ".join(f"{k} {v:.3f}" for k, v in p["engine_efficiency"].items())
        out += [f"**6. Step time predicted / measured** — each layout predicted by `cpu-2core` calibrated on the "
                f"other runs of {', '.join(c['pool'])} (`tessera plan --calibrate`; leave one out), and in sample by "
                f"the profile calibrated on all of them (α {p['latency_s'] * 1e3:.2f} ms per message, TP / EP "
                f"{(p['tp_latency_s'] or 0) * 1e3:.2f} ms, {p['bandwidth'] / 1e9:.2f} GB/s, efficiency {eff}, "
                f"ZeRO-2 gradient hook {(p.get('grad_hook_s') or 0) * 1e3:.3f} ms per tensor per micro-batch "
                "before the last). "
                "Acceptance: within 25 %.", "",
                "| layout | measured ms | held out: predicted ms | held out: predicted / measured | in sample | "
                "stock `cpu-2core` |", "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for name, r in c["layouts"].items():
            out.append(f"| {name} | {r['measured_s'] * 1e3:.1f} | {r['held_out_predicted_s'] * 1e3:.1f} | "
                       f"{r['held_out_ratio']:.2f} | {r['in_sample_ratio']:.2f} | {r['stock_profile_ratio']:.2f} |")  # fmt: skip
        out.append("")
    return "\n".join(out)


def update_results_doc(section: str, doc: Path = REPO / RESULTS_DOC) -> None:
    """Replace what lies between the results markers of ``doc`` with ``section``."""
    text = doc.read_text()
    if text.count(RESULTS_BEGIN) != 1 or text.count(RESULTS_END) != 1:
        raise SystemExit(f"bench: {doc} needs one {RESULTS_BEGIN} and one {RESULTS_END} marker")
    head, rest = text.split(RESULTS_BEGIN, 1)
    tail = rest.split(RESULTS_END, 1)[1]
    doc.write_text(f"{head}{RESULTS_BEGIN}\n{section}\n{RESULTS_END}{tail}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=",".join(ITEMS), help="comma-separated items: " + ", ".join(ITEMS))
    ap.add_argument("--quick", action="store_true", help="fewer steps (a check that the suite runs)")
    ap.add_argument(
        "--pairs",
        type=int,
        default=LAUNCH_PAIRS,
        help=f"overhead: launch pairs per layout, a multiple of 4 (default {LAUNCH_PAIRS})",
    )
    ap.add_argument("--out", default=str(REPO / "bench-results"))
    ap.add_argument("--work", default=None, help="where the runs go (default: a temporary directory)")
    ap.add_argument(
        "--no-doc",
        "--no-readme",
        dest="no_doc",
        action="store_true",
        help=f"do not rewrite the results section of {RESULTS_DOC}",
    )
    ap.add_argument("--reuse", action="store_true", help="with --work: analyse the layout runs already there")
    args = ap.parse_args()
    global REUSE
    REUSE = args.reuse
    only = [x.strip() for x in args.only.split(",") if x.strip()]
    bad = [x for x in only if x not in ITEMS]
    if bad:
        ap.error(f"--only {','.join(bad)}: not a benchmark; choose from {', '.join(ITEMS)}")
    if args.pairs < 4 or args.pairs % 4:
        ap.error(f"--pairs {args.pairs}: the launches alternate in blocks of four pairs; use 4, 8, 12, ...")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(
        args.work
        or tempfile.mkdtemp(prefix="tessera-bench-", dir=REPO / "runs" if (REPO / "runs").is_dir() else None)
    )
    work.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"machine": machine()}
    if set(only) != set(ITEMS) and (out / "suite.json").is_file():  # a part: keep the other items' results
        old = json.loads((out / "suite.json").read_text())
        now = res["machine"]
        res = {
            **old,
            "machine": {
                **old["machine"],
                "rerun": {"items": only, "date": now["date"], "commit": now["commit"]},
            },
        }
    t0 = time.time()
    if "overhead" in only:
        res["overhead"] = bench_overhead(work, args.quick, args.pairs)
    if {"comm", "memory", "scaling", "calibration"} & set(only):
        comm, memory, scale = bench_layouts(work, args.quick, "scaling" in only)
        if "comm" in only:
            res["comm"] = comm
        if "memory" in only:
            res["memory"] = memory
        if "scaling" in only:
            res["scaling"] = scale
        if "calibration" in only:
            res["calibration"] = bench_calibration(work)
    if "checkpoint" in only:
        _say("checkpoint I/O (tools/bench/checkpoint_io.py)")
        _check(
            [sys.executable, str(REPO / "tools/bench/checkpoint_io.py"), "--out", str(out)],
            work / "checkpoint.log",
        )
        res["checkpoint"] = json.loads((out / "checkpoint_io.json").read_text())
    res["seconds"] = time.time() - t0
    for item in ITEMS:
        if item in res and item != "checkpoint":
            (out / f"{item}.json").write_text(json.dumps(res[item], indent=2))
    (out / "suite.json").write_text(json.dumps(res, indent=2))
    section = markdown(res)
    (out / "results.md").write_text(section + "\n")
    from suite_plot import plot_suite

    plot_suite(res, out / "suite.png")
    if not args.no_doc:
        update_results_doc(section)
    print(section)
    print(
        f"wrote {out}/ (suite.json, results.md, suite.png) in {res['seconds'] / 60:.1f} min; runs in {work}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
