"""The benchmark suite's figure: one panel per measured item, each ratio beside its target or ideal."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _bars(
    ax: Any, labels: list[str], values: list[float], target: float, target_label: str, ylabel: str
) -> None:
    xs = range(len(labels))
    ax.bar(xs, values, color="#4c72b0", width=0.6)
    ax.axhline(target, color="#c44e52", linestyle="--", linewidth=1.2, label=target_label)
    for x, v in zip(xs, values, strict=True):
        ax.annotate(f"{v:.2f}", (x, v), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, max([target, *values]) * 1.18)  # room for the value labels above the bars
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3)


def _overhead(ax: Any, rows: list[dict[str, Any]]) -> None:
    """Ratios near 1 on a zoomed axis: each layout's paired estimate with its 90 % interval, and every launch
    pair beside it (the machine's noise), against the 3 % target."""
    xs = range(len(rows))
    est = [r["step_ratio"] for r in rows]
    ci = [r.get("step_ratio_ci90") or [v, v] for r, v in zip(rows, est, strict=True)]
    ax.errorbar(list(xs), est, yerr=[[v - c[0] for v, c in zip(est, ci, strict=True)],
                [c[1] - v for v, c in zip(est, ci, strict=True)]], fmt="o", color="#4c72b0", ecolor="black",
                capsize=5, markersize=7, linewidth=1.2, label="launch pairs' geometric mean, 90 % interval")  # fmt: skip
    for x, v, c in zip(xs, est, ci, strict=True):  # above the interval's upper cap
        ax.annotate(f"{v:.3f}", (x, c[1]), xytext=(0, 3), textcoords="offset points", ha="center", va="bottom",
                    fontsize=8, color="#4c72b0")  # fmt: skip
    pairs = [(x, r["pair_step_ratios"]) for x, r in zip(xs, rows, strict=True) if r.get("pair_step_ratios")]
    for n, (x, pr) in enumerate(pairs):
        ax.plot([x + 0.25] * len(pr), pr, "o", color="#888888", markersize=3.5, alpha=0.8,
                label="each launch pair" if n == 0 else None)  # fmt: skip
    inproc = [(x, r["in_process"]) for x, r in zip(xs, rows, strict=True) if r.get("in_process")]
    if inproc:  # the same comparison a step apart in one job
        v = [a["step_ratio"] for _, a in inproc]
        ax.errorbar([x - 0.22 for x, _ in inproc], v,
                    yerr=[[a["step_ratio"] - a["step_ratio_ci90"][0] for _, a in inproc],
                          [a["step_ratio_ci90"][1] - a["step_ratio"] for _, a in inproc]],
                    fmt="D", color="#dd8452", ecolor="#dd8452", capsize=4, markersize=6, linewidth=1.2,
                    label="step vs step in one job, 90 % interval")  # fmt: skip
        for (x, a), val in zip(inproc, v, strict=True):
            ax.annotate(f"{val:.3f}", (x - 0.22, a["step_ratio_ci90"][0]), xytext=(0, -3), textcoords="offset points",
                        ha="center", va="top", fontsize=8, color="#dd8452")  # fmt: skip
    ax.axhline(1.0, color="black", linewidth=0.8, alpha=0.5)
    ax.axhline(1.03, color="#c44e52", linestyle="--", linewidth=1.2, label="target 1.03")
    seen = est + [c for cc in ci for c in cc] + [p for _, pr in pairs for p in pr]
    seen += [c for _, a in inproc for c in a["step_ratio_ci90"]]
    ax.set_ylim(min(0.9, min(seen) - 0.05), max(1.1, max(seen)) + 0.11)  # headroom: the legend
    ax.set_xlim(-0.5, len(rows) - 0.5)
    ax.set_xticks(
        list(xs), [f"{r['model']} {r['layout']}" for r in rows], rotation=30, ha="right", fontsize=8
    )
    ax.set_ylabel("step period, tessera / raw script")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3)


def plot_suite(res: dict[str, Any], path: Path) -> None:
    """Overhead, bytes sent vs the minimum, memory vs the plan, scaling, step time vs the planner."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [k for k in ("overhead", "comm", "memory", "scaling", "calibration") if res.get(k)]
    if not panels:
        return
    widths = [1.5 if k == "overhead" else 1.0 for k in panels]  # the overhead panel holds three series
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * sum(widths), 4.2), squeeze=False,
                             gridspec_kw={"width_ratios": widths})  # fmt: skip
    for ax, key in zip(axes[0], panels, strict=True):
        if key == "overhead":
            _overhead(ax, res[key]["pairs"])
            ax.set_title("1. Overhead over the raw engines")
        elif key == "comm":
            rows = res[key]["layouts"]
            _bars(ax, list(rows), [r["ratio_to_minimum"] or 0.0 for r in rows.values()], 1.0,
                  "theoretical minimum", "bytes sent per step / minimum")  # fmt: skip
            ax.set_title("2. Communication volume")
        elif key == "memory":
            rows = res[key]["layouts"]
            xs = list(range(len(rows)))
            for i, (k, lab) in enumerate(
                (("model_state_ratio", "model states"), ("activation_ratio", "activations"))
            ):
                ax.bar(
                    [x + (i - 0.5) * 0.35 for x in xs], [r[k] for r in rows.values()], width=0.35, label=lab
                )
            ax.axhline(1.0, color="#c44e52", linestyle="--", linewidth=1.2, label="planner")
            ax.set_xticks(xs, list(rows), rotation=30, ha="right", fontsize=8)
            ax.set_ylabel("measured bytes per rank / planned")
            ratios = [r[k] for r in rows.values() for k in ("model_state_ratio", "activation_ratio")]
            ax.set_ylim(min(0.8, min(ratios) - 0.05), max(1.2, max(ratios) + 0.05))
            ax.legend(fontsize=8, loc="upper left")
            ax.grid(axis="y", alpha=0.3)
            ax.set_title("3. Memory against the planner")
        elif key == "scaling":
            rows = res[key]
            _bars(ax, list(rows), [r["speedup"] for r in rows.values()], 2.0, "ideal (2 ranks)",
                  "speedup, 1 rank / 2 ranks step time")  # fmt: skip
            ax.set_title("5. Scaling 1 → 2 ranks")
        else:
            rows = res[key]["layouts"]
            labels = list(rows)
            _bars(ax, labels, [r["held_out_ratio"] for r in rows.values()], 1.0, "= measured",
                  "predicted / measured step")  # fmt: skip
            ax.plot(range(len(labels)), [r["in_sample_ratio"] for r in rows.values()], "k_", markersize=22,
                    markeredgewidth=2, label="in sample (calibrated on all)")  # fmt: skip
            ax.axhspan(0.75, 1.25, color="#55a868", alpha=0.15, label="±25 %")
            ax.legend(fontsize=8, loc="upper left")
            ax.set_title("6. Planner step time, each layout held out")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
