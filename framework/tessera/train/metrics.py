"""Peak memory per rank, and the PNG plots of a run at its end (``metrics.jsonl`` is written through
:class:`tessera.rundir.RunDir`)."""

from __future__ import annotations

import resource
import sys
from pathlib import Path
from typing import Any

import torch

from tessera.atomic import atomic_file
from tessera.rundir import RunDir


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated accelerator memory, or this process's peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def step_split(
    seconds: float, optimizer_s: float, optimizer_comm_s: float, ops: list[dict[str, Any]]
) -> dict[str, float]:
    """Where a step's ``seconds`` went: its counted collectives (``ops``: the comm accounting's
    ``pop_step``), its optimizer step without the collectives inside it (those count as communication),
    and compute, the rest (framework time and pipeline waits outside collectives included)."""
    comm = sum(o["seconds"] for o in ops)
    optimizer = max(optimizer_s - optimizer_comm_s, 0.0)
    return {
        "step_time_s": seconds,
        "comm_time_s": comm,
        "optimizer_time_s": optimizer,
        "compute_time_s": max(seconds - comm - optimizer, 0.0),
    }


def plot_run(
    run_dir: Path,
    records: list[dict[str, Any]],
    memory_per_rank: list[int] | None = None,
    held: list[dict[str, int]] | None = None,
    activations: list[int | None] | None = None,
) -> list[Path]:
    """loss.png, step_time.png (distribution), memory.png (per rank: the peak, the model states held and
    the activations one micro-batch saved, each measured, beside the planner's prediction); returns the
    files written."""
    if not records:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def figure(name: str, title: str, xlabel: str, ylabel: str, draw) -> None:
        fig, ax = plt.subplots(figsize=(6, 4.2 if name == memory_png else 3.5))
        draw(ax)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        fig.tight_layout()
        try:  # savefig to a path would follow a link there: the bytes go to a temporary, renamed over it
            with atomic_file(run_dir / name) as f:
                fig.savefig(f, format="png", dpi=110)
        finally:
            plt.close(fig)
        out.append(run_dir / name)

    out: list[Path] = []
    steps = [r["step"] for r in records]
    losses = [r["loss"] for r in records]
    loss_png, time_png, memory_png = RunDir.PLOTS
    evals = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]

    def loss_curve(ax) -> None:
        from matplotlib.ticker import MaxNLocator

        ax.plot(steps, losses, marker=".", label="training loss (the step's batch)")
        if evals:
            ax.plot(*zip(*evals), "s", color="C3", label="eval loss (held-out split)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)

    figure(loss_png, f"loss — {run_dir.name}", "step", "loss (nats per token)", loss_curve)
    times = [r["step_time_s"] for r in records[1:]] or [records[0]["step_time_s"]]  # step 1 includes warmup
    plan = RunDir(run_dir).read_json_if_present(RunDir.PLAN) or {}
    predicted = (plan.get("chosen") or {}).get("step_time_s")

    def step_times(ax) -> None:
        from matplotlib.ticker import MaxNLocator

        ax.hist(times, bins=min(30, max(5, len(times) // 2)), label="measured")
        if predicted:  # what the planner said this layout's step should cost on the run's hardware profile
            ax.axvline(predicted, color="C3", linestyle="--", label=f"planner: {predicted * 1e3:.1f} ms")
        ax.axvline(sorted(times)[len(times) // 2], color="k", linewidth=1, label="measured median")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # whole steps
        ax.legend(fontsize=8)

    figure(time_png, "step-time distribution (first step excluded)", "step time (s)", "steps", step_times)
    if memory_per_rank:
        predicted_mem = (plan.get("chosen") or {}).get("memory_bytes_per_rank") or {}
        figure(
            memory_png,
            "memory per rank: measured (bars) and planned (dashes)",
            "rank",
            "MiB (log scale)",
            lambda ax: _memory_bars(ax, memory_per_rank, held, activations, predicted_mem),
        )
    return out


def _memory_bars(
    ax: Any,
    peaks: list[int],
    held: list[dict[str, int]] | None,
    activations: list[int | None] | None,
    predicted: dict[str, int],
) -> None:
    """Grouped bars per rank (peak; model states held; activations saved by one micro-batch) on a log
    axis, each with the planner's figure for it as a dash over its bar."""
    series = [("peak (GPU: allocator; CPU: process RSS, libraries included)", peaks, predicted.get("total"))]
    if held:
        states = [sum(h.get(k, 0) for k in ("params", "grads", "optimizer")) for h in held]
        planned = sum(predicted.get(k, 0) for k in ("params", "grads", "optimizer")) or None
        series.append(("model states held", states, planned))
        if any(h.get("frozen") for h in held):  # adapters: how much of it is the frozen base
            frozen = [h.get("frozen", 0) for h in held]
            series.append(
                ("of which the frozen base (adapters train)", frozen, predicted.get("frozen") or None)
            )
    if activations and all(a is not None for a in activations):
        series.append(
            ("activations, one micro-batch", activations, predicted.get("activations_per_micro_batch"))
        )
    width = 0.8 / len(series)
    ranks = range(len(peaks))
    for i, (label, values, planned) in enumerate(series):
        xs = [r - 0.4 + width * (i + 0.5) for r in ranks]
        ax.bar(xs, [v / 2**20 for v in values], width=width * 0.9, color=f"C{i}", label=label)
        if planned:
            ax.hlines(
                [planned / 2**20] * len(xs),
                [x - width / 2 for x in xs],
                [x + width / 2 for x in xs],
                colors="k",
                linestyles="--",
                linewidth=1.5,
            )
    ax.plot([], [], "k--", label="planner")
    ax.set_yscale("log")
    ax.set_xticks(list(ranks))  # whole ranks
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
