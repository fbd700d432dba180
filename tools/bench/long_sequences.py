"""Long sequences on this machine: Ulysses sequence parallelism (`parallel.sp`, DeepSpeed's ALST) and tiled
MLP / loss (`parallel.tiled_mlp`, `parallel.tiled_loss`), each figure measured beside the planner's.

For each sequence length (2048, 4096, 8192 tokens; --seqs), the tiny Llama of recipes/tiny-llama-long-cpu.yaml
(`data.seq_len` and `model.hf_config.max_position_embeddings` overridden) runs through `tessera run` as a user
types it, at the same global batch of 2 one-sample micro-batches, in three layouts:

    sp1         1 rank, the whole sequence, tiled off (2 micro-batches accumulated)
    sp2         2 ranks, each sequence split over both (dp 1 x sp 2), tiled off
    sp2_tiled   the same, tiled MLP and loss on

Per run: the median steady step (`step_time_s` of rank 0 after the warm-up steps), the peak memory per rank
(summary.json `peak_memory_bytes_per_rank`: on CPU the process's peak RSS, libraries included), the bytes
autograd saved in one micro-batch's forward per rank (summary.json `activation_bytes_per_rank`) and the
all-to-all payload on the sp group per step (comm.jsonl, rank 0); beside each, the planner's figure for the
run's own layout (`estimate_layout` on the run's resolved recipe and the `cpu-2core` profile, as
tests/helpers.py::assert_activations_match_plan computes it): `memory.activations_per_micro_batch`,
`memory.total` (model states + activations: no libraries), `time.step_s`, `comm_bytes["all_to_all:sp"]`.
Then the ratios sp2 / sp1 and sp2_tiled / sp2 of each, measured and planned, per sequence length, and the
MiB the peak moves by beside the planner's total (the RSS holds ~0.45 GB of libraries the planner does not
count, so its ratio sits near 1). The machine may be shared: the CPU other processes took during each run
(/proc/stat less the run's own) is recorded, and step times taken above 10 % of the cores are starred.

Writes bench-results/long_sequences.json and bench-results/long_sequences.png (--out).

    python tools/bench/long_sequences.py [--quick] [--seqs 2048,4096] [--out bench-results] [--work DIR [--reuse]]

--quick: 2048 and 4096 tokens, 4 steps a run (1 of warm-up) instead of 8 (2).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from suite import REPO, Steps, _say, machine, tessera_run

RECIPE = REPO / "recipes" / "tiny-llama-long-cpu.yaml"
SEQS = (2048, 4096, 8192)
QUICK_SEQS = (2048, 4096)
#: (steps a run, warm-up steps left out of the median)
STEPS, QUICK_STEPS = (8, 2), (4, 1)
HARDWARE = "cpu-2core"
TILED_OFF = ["parallel.tiled_mlp=false", "parallel.tiled_loss=false"]
TILED_ON = ["parallel.tiled_mlp=true", "parallel.tiled_loss=true"]
#: layout -> overrides; the recipe's global batch 2 of micro-batch 1 holds for all three (2 accumulated)
LAYOUTS: dict[str, list[str]] = {
    "sp1": ["run.world_size=1", "parallel.sp=1", *TILED_OFF],
    "sp2": ["run.world_size=2", "parallel.sp=2", *TILED_OFF],
    "sp2_tiled": ["run.world_size=2", "parallel.sp=2", *TILED_ON],
}
#: the ratios reported: (name, numerator layout, denominator layout)
PAIRS = (("sp2/sp1", "sp2", "sp1"), ("sp2_tiled/sp2", "sp2_tiled", "sp2"))
#: the figures compared in the ratios: measured key, planned key
RATIO_KEYS = {
    "peak_memory": ("peak_memory_bytes", "planned_total_bytes"),
    "activations": ("activation_bytes", "planned_activation_bytes"),
    "step_time": ("step_s", "planned_step_s"),
}
MIB = 2**20


def seq_overrides(seq: int) -> list[str]:
    """The sequence length of the data and the positions of the model (a dotted override into hf_config)."""
    return [f"data.seq_len={seq}", f"model.hf_config.max_position_embeddings={seq}"]


def _a2a_per_step(run_dir: Path, warmup: int, rank: int = 0) -> float | None:
    """Median payload bytes ``rank`` sent in all-to-alls on the sp group per steady step (None: none)."""
    from tessera.rundir import RunDir

    per_step: dict[int, float] = {}
    for line in RunDir(run_dir).read_comm():
        if line.get("phase") != "step" or line["rank"] != rank or line["step"] <= warmup:
            continue
        sent = sum(o["bytes"] for o in line["ops"] if o["op"] == "all_to_all" and o["group"] == "sp")
        per_step[line["step"]] = per_step.get(line["step"], 0.0) + sent
    sent_steps = [b for b in per_step.values() if b]
    return statistics.median(sent_steps) if sent_steps else None


def measure(steps: Steps, warmup: int) -> dict[str, Any]:
    """One finished run's figures (rank 0's steps, summary.json, comm.jsonl) beside the planner's for the
    same resolved recipe and layout."""
    import yaml

    from tessera.config.loader import validate_recipe
    from tessera.plan.hardware import load_hardware
    from tessera.plan.layout import layout_from_recipe
    from tessera.plan.search import estimate_layout
    from tessera.rundir import RunDir

    assert steps.run_dir is not None
    rd = RunDir(steps.run_dir)
    recipe = validate_recipe(yaml.safe_load(rd.recipe.read_text()))
    layout = layout_from_recipe(recipe)
    est = estimate_layout(recipe, layout, hardware=load_hardware(HARDWARE), recompute=layout.recompute)
    summary = rd.read_summary()
    peaks = [int(b) for b in summary["peak_memory_bytes_per_rank"]]
    acts = [int(b) for b in summary["activation_bytes_per_rank"]]
    steady = [r["step_time_s"] for r in steps.records if r["step"] > warmup]
    return {
        "run_dir": str(steps.run_dir),
        "world_size": layout.world_size,
        "dp": layout.dp,
        "sp": layout.sp,
        "grad_accum": layout.grad_accum,
        "tiled_mlp": layout.tiled_mlp,
        "tiled_loss": layout.tiled_loss,
        "seq_len": recipe.data.seq_len,
        "tokens_per_step": steps.records[-1]["tokens"],
        "final_loss": summary["final_loss"],
        # time: rank 0's timed steps after the warm-up
        "step_s": steps.median_step(warmup),
        "step_s_steady": steady,
        "planned_step_s": est.time.step_s,
        # memory per rank: the largest rank's figure is the one compared
        "peak_memory_bytes_per_rank": peaks,
        "peak_memory_bytes": max(peaks),
        "planned_total_bytes": est.memory.total,
        "activation_bytes_per_rank": acts,
        "activation_bytes": max(acts),
        "planned_activation_bytes": est.memory.activations_per_micro_batch,
        "activation_ratio_to_plan": max(acts) / est.memory.activations_per_micro_batch,
        "planned_memory_bytes_per_rank": est.memory.to_json(),
        # communication: the Ulysses all-to-alls
        "all_to_all_sp_bytes_per_step": _a2a_per_step(steps.run_dir, warmup),
        "planned_all_to_all_sp_bytes_per_step": est.comm_bytes.get("all_to_all:sp", 0),
        "planned_comm_bytes_per_step": dict(est.comm_bytes),
    }


def ratios(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """sp2 / sp1 and sp2_tiled / sp2 of each figure, measured and planned (layouts missing: left out)."""
    out: dict[str, dict[str, float]] = {}
    for name, num, den in PAIRS:
        if num not in runs or den not in runs:
            continue
        a, b = runs[num], runs[den]
        out[name] = {}
        for what, (meas, plan) in RATIO_KEYS.items():
            out[name][what] = a[meas] / b[meas]
            out[name][f"planned_{what}"] = a[plan] / b[plan]
        # on CPU the peak is the process's RSS, ~0.45 GB of it libraries the planner does not count: the
        # bytes it moves by are what compares with the planner's total
        out[name]["peak_memory_change_bytes"] = a["peak_memory_bytes"] - b["peak_memory_bytes"]
        out[name]["planned_peak_memory_change_bytes"] = a["planned_total_bytes"] - b["planned_total_bytes"]
    return out


def _cpu_seconds() -> tuple[float, float]:
    """(CPU seconds the whole machine has been busy since boot, CPU seconds of this process's finished
    children): their growth over a run, less the run's own, is what other processes took meanwhile."""
    import resource

    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = sum(fields[:3]) + sum(fields[5:7])  # user nice system, irq softirq (not idle, iowait, steal)
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return busy / os.sysconf("SC_CLK_TCK"), ru.ru_utime + ru.ru_stime


#: other processes' share of the cores during a run above which its times are flagged (shared machine)
BUSY_FLAG = 0.10


def bench(seqs: list[int], steps: int, warmup: int, work: Path, reuse: bool = False) -> dict[str, Any]:
    """Every (sequence length, layout) run and its figures; the ratios per sequence length."""
    runs: dict[str, dict[str, Any]] = {}
    for seq in seqs:
        runs[str(seq)] = {}
        for name, overrides in LAYOUTS.items():
            _say(f"long sequences: {seq} tokens, {name}")
            t0, (busy0, own0) = time.time(), _cpu_seconds()
            got = tessera_run(RECIPE, [*seq_overrides(seq), *overrides], steps, work / f"seq{seq}-{name}",
                              reuse=reuse)  # fmt: skip
            (busy1, own1), wall = _cpu_seconds(), time.time() - t0
            r = runs[str(seq)][name] = measure(got, warmup)
            r["command_s"] = wall
            # the machine is shared: the CPU other processes used while this command ran, as a share of
            # all cores (a step time measured beside someone else's tests is slower than the layout's own)
            other = max(0.0, busy1 - busy0 - (own1 - own0)) / (wall * (os.cpu_count() or 1))
            r["other_processes_cpu_share"] = (
                None if got.launched != got.launched else other
            )  # reused: not run
    return {
        "recipe": str(RECIPE.relative_to(REPO)),
        "hardware_profile": HARDWARE,
        "seqs": seqs,
        "steps": steps,
        "warmup_steps": warmup,
        "layouts": LAYOUTS,
        "runs": runs,
        "ratios": {seq: ratios(r) for seq, r in runs.items()},
        "work": str(work),
    }


# ---- output --------------------------------------------------------------------------------------------


def _mib(b: float | None) -> str:
    return "—" if b is None else f"{b / MIB:.1f}"


def table(res: dict[str, Any]) -> str:
    """The runs, each figure beside the planner's, and the ratios measured beside the planned ones."""
    out = [
        "| seq | layout | ranks | step s (plan) | peak RSS MiB/rank (plan: states + acts) | activations MiB/rank "
        "(plan) | acts / plan | all-to-all sp MiB/step (plan) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for seq, runs in res["runs"].items():
        for name, r in runs.items():
            busy = (r.get("other_processes_cpu_share") or 0.0) > BUSY_FLAG
            peaks = " / ".join(_mib(b) for b in r["peak_memory_bytes_per_rank"])
            acts = " / ".join(_mib(b) for b in r["activation_bytes_per_rank"])
            a2a = r["all_to_all_sp_bytes_per_step"]
            out.append(
                f"| {seq} | {name} | {r['world_size']} | {r['step_s']:.3f}{'*' if busy else ''} ({r['planned_step_s']:.3f}) | "
                f"{peaks} ({_mib(r['planned_total_bytes'])}) | {acts} ({_mib(r['planned_activation_bytes'])}) | "
                f"{r['activation_ratio_to_plan']:.3f} | {_mib(a2a)} ({_mib(r['planned_all_to_all_sp_bytes_per_step'])}) |"
            )
    flagged = [f"{s} {n} ({r['other_processes_cpu_share']:.0%})" for s, rs in res["runs"].items()
               for n, r in rs.items() if (r.get("other_processes_cpu_share") or 0.0) > BUSY_FLAG]  # fmt: skip
    if flagged:
        out += [
            "",
            f"* other processes used more than {BUSY_FLAG:.0%} of the cores during: {', '.join(flagged)}",
        ]
    out += [
        "",
        "| seq | ratio | peak RSS / rank (plan) | peak RSS change MiB (plan) | activations / rank (plan) "
        "| step time (plan) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for seq, pairs in res["ratios"].items():
        for name, q in pairs.items():
            cells = [f"{q[w]:.3f} ({q[f'planned_{w}']:.3f})" for w in RATIO_KEYS]
            cells.insert(
                1,
                f"{q['peak_memory_change_bytes'] / MIB:+.1f} ({q['planned_peak_memory_change_bytes'] / MIB:+.1f})",
            )
            out.append(f"| {seq} | {name} | {' | '.join(cells)} |")
    return "\n".join(out)


COLORS = {"sp1": "#4c72b0", "sp2": "#dd8452", "sp2_tiled": "#55a868"}
LABELS = {"sp1": "sp1 (1 rank)", "sp2": "sp2 (2 ranks)", "sp2_tiled": "sp2 + tiled MLP/loss"}


def plot(res: dict[str, Any], path: Path) -> None:
    """Three panels against the sequence length: activations per rank (measured and planned), peak RSS per
    rank (measured), step time (measured and planned)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import NullFormatter, NullLocator

    seqs = [int(s) for s in res["runs"]]
    panels = [
        ("activation_bytes", "planned_activation_bytes", 1 / MIB,
         "activations per rank, one micro-batch (MiB)", "Saved for backward"),
        ("peak_memory_bytes", None, 1 / MIB, "peak RSS per rank (MiB)", "Peak host memory (largest rank, measured)"),
        ("step_s", "planned_step_s", 1.0, "step time (s)", "Optimizer step (median, global batch 2)"),
    ]  # fmt: skip
    fig, axes = plt.subplots(1, len(panels), figsize=(15.5, 5.0))
    for ax, (meas, plan, scale, ylabel, title) in zip(axes, panels, strict=True):
        for name in LAYOUTS:
            pts = [(int(s), r[name]) for s, r in res["runs"].items() if name in r]
            xs = [s for s, _ in pts]
            ax.plot(xs, [r[meas] * scale for _, r in pts], "o-", color=COLORS[name], linewidth=1.8, markersize=6,
                    label=LABELS[name])  # fmt: skip
            if plan:
                ax.plot(xs, [r[plan] * scale for _, r in pts], "--", color=COLORS[name], linewidth=1.3,
                        marker="x", markersize=6, alpha=0.85)  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(seqs, [str(s) for s in seqs])
        ax.set_xlim(min(seqs) / 1.25, max(seqs) * 1.25)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=11)
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if plan:  # from 0: the ratios between the layouts read off the heights
            ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.05)
            handles += [Line2D([], [], color="black", marker="o", linestyle="-"),
                        Line2D([], [], color="black", marker="x", linestyle="--")]  # fmt: skip
            labels += [
                "measured",
                "planner (cpu-2core)" + (": sp2 = sp2 + tiled" if meas == "step_s" else ""),
            ]
        else:  # ~0.45 GiB of it libraries: zoomed on the differences
            lo, hi = ax.get_ylim()
            ax.set_ylim(lo - 0.1 * (hi - lo), hi + 0.35 * (hi - lo))  # headroom: the legend
        ax.legend(handles, labels, fontsize=8.5, loc="upper left")
    m = res["machine"]
    fig.suptitle(
        f"Ulysses SP and tiled MLP/loss: tiny Llama (2 layers, hidden 64; {res['recipe']}), "
        f"{m['cores']}-core CPU ({m['cpu']}), {res['steps']} steps, {res['warmup_steps']} of warm-up",
        fontsize=11.5,
    )
    note = ("Peak RSS includes the process's libraries (~0.45 GiB); the planner's total counts model states and "
            "activations only, so it is left out of the middle panel (see the JSON).")  # fmt: skip
    busy = [r["other_processes_cpu_share"] for rs in res["runs"].values() for r in rs.values()
            if (r.get("other_processes_cpu_share") or 0.0) > BUSY_FLAG]  # fmt: skip
    if busy:
        note += (
            f" Step times measured while other processes used {min(busy):.0%}-{max(busy):.0%} of the cores."
        )
    fig.text(0.5, 0.005, note, ha="center", fontsize=8.5, color="#555555")
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2048 and 4096 tokens, fewer steps")
    ap.add_argument("--seqs", default=None, help="comma-separated sequence lengths (default 2048,4096,8192)")
    ap.add_argument("--out", default=str(REPO / "bench-results"))
    ap.add_argument("--work", default=None, help="where the runs go (default: a new directory under runs/)")
    ap.add_argument("--reuse", action="store_true", help="with --work: analyse the runs already there")
    args = ap.parse_args()
    seqs = [int(s) for s in args.seqs.split(",")] if args.seqs else list(QUICK_SEQS if args.quick else SEQS)
    steps, warmup = QUICK_STEPS if args.quick else STEPS
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs_dir = REPO / "runs" if (REPO / "runs").is_dir() else None
    work = Path(args.work or tempfile.mkdtemp(prefix="tessera-long-seq-", dir=runs_dir))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    res: dict[str, Any] = {"machine": machine(), **bench(seqs, steps, warmup, work, reuse=args.reuse)}
    res["seconds"] = time.time() - t0
    (out / "long_sequences.json").write_text(json.dumps(res, indent=2))
    plot(res, out / "long_sequences.png")
    print(table(res))
    print(
        f"wrote {out}/long_sequences.json, {out}/long_sequences.png in {res['seconds'] / 60:.1f} min; runs in {work}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
