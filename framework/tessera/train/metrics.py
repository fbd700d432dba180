"""Per-step metrics: ``metrics.jsonl`` (rank 0), peak memory per rank, and PNG plots at the end."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any

import torch


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated accelerator memory, or this process's peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


class MetricsWriter:
    """Appends one JSON line per step; on resume drops lines after the resumed step first."""

    def __init__(self, path: Path, *, resume_step: int | None):
        self.path = path
        if resume_step is not None and path.is_file():
            kept = [
                ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= resume_step
            ]
            path.write_text("".join(ln + "\n" for ln in kept))
        elif resume_step is None and path.exists():
            path.unlink()
        self._f = open(path, "a")

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record, sort_keys=True) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]


def plot_run(
    run_dir: Path, records: list[dict[str, Any]], memory_per_rank: list[int] | None = None
) -> list[Path]:
    """loss.png, step_time.png (distribution), memory.png (peak per rank); returns the files written."""
    if not records:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out: list[Path] = []
    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [r["loss"] for r in records], marker=".")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"loss — {run_dir.name}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(run_dir / "loss.png", dpi=110)
    plt.close(fig)
    out.append(run_dir / "loss.png")

    times = [r["step_time_s"] for r in records[1:]] or [records[0]["step_time_s"]]  # step 1 includes warmup
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist(times, bins=min(30, max(5, len(times) // 2)))
    ax.set_xlabel("step time (s)")
    ax.set_ylabel("steps")
    ax.set_title("step-time distribution (first step excluded)")
    fig.tight_layout()
    fig.savefig(run_dir / "step_time.png", dpi=110)
    plt.close(fig)
    out.append(run_dir / "step_time.png")

    if memory_per_rank:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.bar(range(len(memory_per_rank)), [m / 2**20 for m in memory_per_rank])
        ax.set_xlabel("rank")
        ax.set_ylabel("peak memory (MiB)")
        ax.set_title("peak memory per rank")
        fig.tight_layout()
        fig.savefig(run_dir / "memory.png", dpi=110)
        plt.close(fig)
        out.append(run_dir / "memory.png")
    return out
