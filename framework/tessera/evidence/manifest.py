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

from tessera.atomic import sha256_bytes

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


def _git(args: list[str], where: Path) -> str:
    return subprocess.run(
        ["git", *args], cwd=where, capture_output=True, text=True, timeout=10, check=True
    ).stdout


def git_state(cwd: Path | None = None) -> tuple[dict[str, Any], str]:
    """(commit, dirty flag and the sha256 of the uncommitted diff of tracked files; the diff itself) of
    the checkout Tessera runs from (None values and an empty diff outside a git work tree)."""
    where = cwd or Path(__file__).resolve().parent
    try:
        commit = _git(["rev-parse", "HEAD"], where).strip()
        diff = _git(["diff", "HEAD", "--no-color", "--no-ext-diff"], where)
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None, "diff_sha256": None}, ""
    return {
        "commit": commit,
        "dirty": bool(diff),
        "diff_sha256": sha256_bytes(diff.encode()) if diff else None,
    }, diff


#: environment variables that change numerics or communication, recorded in the manifest
ENV_PREFIXES = ("CUDA_", "NCCL_", "OMP_", "TORCH_", "DS_", "PYTORCH_", "CUBLAS_", "MKL_", "GLOO_", "NVIDIA_")
ENV_NAMES = ("PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")
_SECRET_MARKS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "CREDENTIAL")
REDACTED = "<redacted>"


def environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """The numerics / communication environment, secrets redacted: any name containing KEY, TOKEN,
    SECRET, PASSWORD or CREDENTIAL keeps its name, never its value."""
    env = dict(os.environ if env is None else env)
    out = {}
    for name in sorted(env):
        if (
            name.startswith(ENV_PREFIXES)
            or name in ENV_NAMES
            or any(m in name.upper() for m in _SECRET_MARKS)
        ):
            secret = any(m in name.upper() for m in _SECRET_MARKS)
            out[name] = REDACTED if secret else env[name]
    return out


def installed_packages() -> dict[str, str]:
    """Every installed distribution and its version (the environment the numbers came from)."""
    out = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            out[name.lower()] = dist.version
    return dict(sorted(out.items()))


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


def _smi_gpus() -> list[dict[str, Any]]:
    """The node's GPUs from ``nvidia-smi`` (a node agent does not import torch)."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.splitlines():
        name, _, mib = line.rpartition(",")
        if name and mib.strip().isdigit():
            gpus.append({"name": name.strip(), "memory_bytes": int(mib) * 2**20})
    return gpus


def host_facts(gpus: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """This machine: host name, CPU, cores, memory, GPUs (``gpus`` given, else from nvidia-smi)."""
    return {
        "hostname": platform.node(),
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "memory_bytes": _memory_bytes(),
        "gpus": _smi_gpus() if gpus is None else gpus,
        "platform": platform.platform(),
    }


def hardware() -> dict[str, Any]:
    import torch

    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"name": p.name, "memory_bytes": p.total_memory})
    return host_facts(gpus)


def topology(world_size: int, hostfile: str | None, nodes: int | None = None) -> dict[str, Any]:
    """Nodes (``nodes``: known from the launch, else a hostfile's lines), devices per node and the
    interconnect where it is known (NCCL's transport choice is not visible before the first
    collective, so GPU runs say "nccl")."""
    import torch

    if nodes is None and hostfile and Path(hostfile).is_file():
        nodes = sum(1 for ln in Path(hostfile).read_text().splitlines() if ln.split("#", 1)[0].strip())
    nodes = nodes or 1
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {
        "nodes": nodes,
        "ranks": world_size,
        "devices_per_node": gpus or world_size // max(nodes, 1),
        "device_kind": "cuda" if gpus else "cpu",
        "interconnect": "nccl" if gpus else ("gloo over TCP (loopback)" if nodes == 1 else "gloo over TCP"),
    }


def weights_digest(named: Any) -> str:
    """sha256 over (name, dtype, shape, bytes) of tensors in name order: the same on every layout.
    ``named``: (name, tensor) pairs, or a Mapping (read one tensor at a time, in name order)."""
    import hashlib
    from collections.abc import Mapping

    import torch

    h = hashlib.sha256()
    pairs = (
        ((k, named[k]) for k in sorted(named))
        if isinstance(named, Mapping)
        else sorted(named, key=lambda kv: kv[0])
    )
    for name, t in pairs:
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def files_digest(paths: list[Path]) -> str:
    """sha256 over (file name, sha256 of its bytes) of weight files, streamed."""
    from tessera.atomic import sha256_file

    return sha256_bytes("".join(f"{p.name}:{sha256_file(p)}\n" for p in sorted(paths)).encode())


def tokenizer_record(recipe: dict[str, Any], tokenizer_dir: str, tokenizer_hash: str) -> dict[str, Any]:
    """Which tokenizer a run used: ``source`` "model" (the pretrained model directory's own), "bpe"
    (trained on the corpus) or "dir" (another local directory), where it is and the sha256 of its files
    (``tokenizer_hash``)."""
    from tessera.config.schema import same_dir

    model, data = recipe.get("model") or {}, recipe.get("data") or {}
    spec = data.get("tokenizer")
    if spec in ("bpe", "auto"):  # auto: resolved by the recipe schema, a bare data section's is bpe
        source = "bpe"
    elif model.get("pretrained") and model.get("path") and spec and same_dir(spec, model["path"]):
        source = "model"
    else:
        source = "dir"
    return {"source": source, "path": tokenizer_dir, "sha256": tokenizer_hash}


def nodes_record(rd: Any, world: int) -> list[dict[str, Any]] | None:
    """The manifest's ``nodes``: each node of a multi-node run (``rd``: its RunDir), its host, hardware
    and ranks, from the node agents' files and the ranks' pid files; None on one node."""
    import json

    def read(path: Path) -> dict[str, Any]:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    control = read(rd.control)
    if not control.get("members") or not rd.rank_node(0):
        return None
    ranks: dict[int, list[int]] = {}
    for r in range(world):
        where = rd.rank_node(r)
        if where is not None:
            ranks.setdefault(where[0], []).append(r)
    out = []
    for k, member in sorted((int(k), v) for k, v in control["members"].items()):
        state = read(rd.node_file(k))
        if state.get("id") == member:  # the agent of this run, not a file of an earlier one
            out.append({"node": k, "host": state.get("host"), "ranks": ranks.get(k, []),
                        "hardware": state.get("hardware")})  # fmt: skip
    return out


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
    hostfile: str | None = None,
    tokenizer_dir: str | None = None,
) -> tuple[dict[str, Any], str]:
    """Build the manifest on rank 0 (cheap: no tensor work, two git calls). Returns it and the
    uncommitted git diff, which is saved beside it (the manifest holds its hash). ``tokenizer_dir``: where
    the run's tokenizer is (the manifest's ``tokenizer`` record, :func:`tokenizer_record`)."""
    git, diff = git_state()
    tokenizer = None if tokenizer_dir is None else tokenizer_record(recipe, tokenizer_dir, tokenizer_hash)
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "recipe": recipe,
        "recipe_hash": recipe_hash,
        "git": git,
        "versions": {"python": sys.version.split()[0], **{p: _version(p) for p in _PACKAGES}},
        "packages": installed_packages(),
        "environment": environment(),
        "hardware": hardware(),
        "hardware_probe": _probe(device, world_size),
        "topology": topology(world_size, hostfile),
        "device": device,
        "world_size": world_size,
        "layout": layout,
        "seed": seed,
        "data": data_fingerprint,
        "tokenizer_hash": tokenizer_hash,
        "tokenizer": tokenizer,
        "launcher_command": launcher_command,
        "hostfile": hostfile,
    }
    return manifest, diff


def _probe(device: str, world_size: int) -> dict[str, Any] | None:
    """This host's ``tessera plan --probe`` at this world size (its profile's figures and path), if any."""
    from tessera.plan.probe import probe_record

    return probe_record(device, world_size)


# keys that differ between two launches of the same experiment and mean nothing for the numbers: the
# host, the launch (ports, paths), what the run did after it started, and what is derived from recorded
# inputs (the plan follows from config + hardware)
_VOLATILE = {
    "launcher_command", "hardware.hostname", "checkpoint_step", "resumed_from", "resharded", "plan", "restarts", "stopped",
    "tokens_by_source",
    "fault_injection", "environment.MASTER_ADDR", "environment.MASTER_PORT", "environment.WORLD_SIZE",
    "tokenizer.path",  # where the cache or the checkout is; tokenizer.sha256 pins what it holds
}  # fmt: skip
#: top-level manifest key -> the group a difference is reported under
GROUPS = {
    "git": "code", "versions": "environment", "packages": "environment", "environment": "environment",
    "recipe": "config", "recipe_hash": "config", "layout": "config", "seed": "config", "world_size": "config",
    "data": "data", "tokenizer_hash": "data", "tokenizer": "data", "hardware": "hardware", "topology": "hardware",
    "device": "hardware", "hostfile": "hardware", "nodes": "hardware", "hardware_probe": "hardware", "launch_mode": "hardware", "manifest_version": "code", "initial_weights": "data",
    "preregistration_sha256": "config",
}  # fmt: skip


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


def grouped_diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, list[tuple[str, Any, Any]]]:
    """:func:`diff_manifests` grouped as code, config, data, environment, hardware (other: the rest)."""
    out: dict[str, list[tuple[str, Any, Any]]] = {}
    for key, va, vb in diff_manifests(a, b):
        out.setdefault(GROUPS.get(key.split(".", 1)[0], "other"), []).append((key, va, vb))
    return out


def short(value: Any, limit: int = 60) -> str:
    """A value for a one-line diff."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
