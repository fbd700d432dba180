"""The reproducibility manifest: everything needed to say what a run was, and to run it again.

Written to ``<run_dir>/manifest.json``, copied into every checkpoint and handed to W&B as the run
config. ``diff_manifests`` tells what changed between two runs (or between a checkpoint and a resume).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

MANIFEST_VERSION = 1
_PACKAGES = (
    "torch",
    "deepspeed",
    "megatron-core",
    "transformers",
    "datasets",
    "tokenizers",
    "wandb",
    "numpy",
)


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_state(cwd: Path | None = None) -> dict[str, Any]:
    """Commit and dirty flag of the checkout Tessera runs from (None outside a git work tree)."""
    where = cwd or Path(__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=where,
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout.strip()
        )
        return {"commit": commit, "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def hardware() -> dict[str, Any]:
    import torch

    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"name": p.name, "memory_bytes": p.total_memory})
    return {
        "hostname": platform.node(),
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "memory_bytes": _memory_bytes(),
        "gpus": gpus,
        "platform": platform.platform(),
    }


def capture_manifest(
    *,
    recipe: dict[str, Any],
    recipe_hash: str,
    layout: dict[str, Any],
    data_fingerprint: dict[str, Any],
    tokenizer_hash: str,
    launcher_command: list[str] | str | None,
    world_size: int,
    seed: int,
    device: str,
) -> dict[str, Any]:
    """Build the manifest on rank 0 (cheap: no tensor work, one git call)."""
    return {
        "manifest_version": MANIFEST_VERSION,
        "recipe": recipe,
        "recipe_hash": recipe_hash,
        "git": git_state(),
        "versions": {"python": sys.version.split()[0], **{p: _version(p) for p in _PACKAGES}},
        "hardware": hardware(),
        "device": device,
        "world_size": world_size,
        "layout": layout,
        "seed": seed,
        "data": data_fingerprint,
        "tokenizer_hash": tokenizer_hash,
        "launcher_command": launcher_command,
    }


# keys that differ between two launches of the same experiment and mean nothing for the numbers
_VOLATILE = {"launcher_command", "hardware.hostname", "checkpoint_step", "resumed_from"}


def diff_manifests(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[tuple[str, Any, Any]]:
    """Dotted keys whose values differ, as (key, a, b); volatile keys are left out."""
    out: list[tuple[str, Any, Any]] = []
    for k in sorted(set(a) | set(b)):
        key = f"{prefix}{k}"
        if key in _VOLATILE:
            continue
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += diff_manifests(va, vb, key + ".")
        elif va != vb:
            out.append((key, va, vb))
    return out
