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


def plot_suite(res: dict[str, Any], path: Path) -> None:
    """Overhead, bytes sent vs the minimum, memory vs the plan, scaling, step time vs the planner."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [k for k in ("overhead", "comm", "memory", "scaling", "calibration") if res.get(k)]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2), squeeze=False)
    for ax, key in zip(axes[0], panels, strict=True):
        if key == "overhead":
            rows = res[key]["pairs"]
            _bars(ax, [f"{r['model']} {r['layout']}" for r in rows], [r["step_ratio"] for r in rows], 1.03,
                  "target 1.03", "step period, tessera / raw script")  # fmt: skip
            spread = [(i, r) for i, r in enumerate(rows) if r.get("pair_step_ratios")]
            if spread:  # how far neighbouring launches' medians differ: the machine's noise beside the ratio
                lo = [r["step_ratio"] - min(r["pair_step_ratios"]) for _, r in spread]
                hi = [max(r["pair_step_ratios"]) - r["step_ratio"] for _, r in spread]
                ax.errorbar([i for i, _ in spread], [r["step_ratio"] for _, r in spread], yerr=[lo, hi],
                            fmt="none", ecolor="black", capsize=4, linewidth=1,
                            label="neighbouring launches, min-max")  # fmt: skip
                ax.set_ylim(0, max(1.03, *(max(r["pair_step_ratios"]) for _, r in spread)) * 1.18)
                ax.legend(fontsize=8, loc="upper left")
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
