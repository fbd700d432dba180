"""What one device of a cluster can do, for the planner's estimates: a small typed profile read from YAML.

The planner never measures hardware; it multiplies formulas by these figures. Each profile in
``configs/hardware/`` cites where its numbers come from (vendor datasheets), so an estimate can be traced
back to a published figure and corrected in one place. Bandwidths are bytes/s *per device and per
direction*: that is what one rank can push through the link its collective runs on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from tessera.errors import RecipeError

DEVICES = ("cuda", "cpu")


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    """One device of a homogeneous cluster and the links between devices."""

    name: str
    #: "cuda" or "cpu" (one rank per core on CPU)
    device: str
    #: devices (ranks) per node: groups larger than this cross the inter-node network
    devices_per_node: int
    #: memory per device in bytes (for CPU: the host memory divided by the ranks sharing it)
    memory_bytes: int
    #: dense bf16 FLOP/s per device (for CPU the fp32 figure)
    peak_flops: float
    #: device-memory bandwidth in bytes/s (the optimizer step is bound by it)
    hbm_bandwidth: float
    #: bytes/s per device per direction inside a node (NVLink; shared memory on CPU)
    intra_node_bandwidth: float
    #: bytes/s per device per direction between nodes (InfiniBand / RoCE NIC per device)
    inter_node_bandwidth: float
    #: fixed cost of one collective call in seconds (0 = ignore latency)
    latency_s: float = 0.0
    #: fixed cost of one tensor- or expert-parallel collective, where it differs from ``latency_s``: those
    #: sit between two matmuls of a layer, so each also waits out the ranks' skew (a calibrated profile
    #: has it: ``tessera plan --calibrate`` on a TP or EP run); None = ``latency_s``
    tp_latency_s: float | None = None
    #: dense fp32 (non-tensor-core) FLOP/s per device for fp32 runs; None = use peak_flops
    peak_flops_fp32: float | None = None
    #: host memory per node in bytes (checked for CPU offload); None = offload is not planned
    host_memory_bytes: int | None = None
    #: device <-> host bytes/s per device per direction (PCIe); None = offload is not planned
    host_link_bandwidth: float | None = None
    #: host-memory bandwidth per node in bytes/s (the CPU Adam step of offload is bound by it)
    host_memory_bandwidth: float | None = None
    #: price of one device for one hour (any currency; the report quotes cost per 1B tokens); None = unknown
    price_per_device_hour: float | None = None
    #: the fraction of peak FLOP/s the model's matmuls reach on this device (a calibrated profile has
    #: it: ``tessera plan --calibrate``); None = the planner's default
    efficiency: float | None = None
    #: the same per engine, where a calibration measured it (``deepspeed``, ``ddp``, ``megatron``): each
    #: engine's own work per step - DeepSpeed's hooks and bucket copies, megatron-core's kernels (off CUDA
    #: its local spec's unfused ops) - counts in its compute time; an engine not listed uses ``efficiency``
    engine_efficiency: dict[str, float] | None = None
    #: seconds per parameter tensor of DeepSpeed's gradient hook on each micro-batch but the last of a
    #: step, at ZeRO 2-3 (which reduce every micro-batch's gradients; ZeRO 0-1 only the last one's): the
    #: hook's bookkeeping and bucket handling beside its copies (those are timed at ``hbm_bandwidth``). A
    #: calibrated profile has it (``tessera plan --calibrate`` on a ZeRO-2 run with accumulation); None = 0
    grad_hook_s: float | None = None
    #: whether data-parallel collectives run beside the backward (GPU streams, NCCL): False on CPU, where
    #: gloo's collectives and the backward share the cores, so every collective second is exposed
    comm_overlap: bool = True

    @property
    def can_offload(self) -> bool:
        """Whether the profile has the host figures an offload estimate needs (and offload means anything)."""
        return (
            self.device == "cuda"
            and self.host_memory_bytes is not None
            and self.host_link_bandwidth is not None
            and self.host_memory_bandwidth is not None
        )

    def latency_for(self, group: str) -> float:
        """Seconds per message of a collective on ``group`` ("tp" and "ep" may have their own)."""
        if group in ("tp", "ep") and self.tp_latency_s is not None:
            return self.tp_latency_s
        return self.latency_s

    def efficiency_for(self, engine: str) -> float | None:
        """The calibrated efficiency of ``engine`` (else the profile's ``efficiency``); None where the
        profile has none (the planner's default applies)."""
        return (self.engine_efficiency or {}).get(engine, self.efficiency)

    def peak_for(self, precision: str) -> float:
        """Peak FLOP/s for ``precision``: fp32 runs use the fp32 figure where the profile has one."""
        if precision == "fp32" and self.peak_flops_fp32 is not None:
            return self.peak_flops_fp32
        return self.peak_flops


_REQUIRED = (
    "name",
    "device",
    "devices_per_node",
    "memory_bytes",
    "peak_flops",
    "hbm_bandwidth",
    "intra_node_bandwidth",
    "inter_node_bandwidth",
)
_INTS = ("devices_per_node", "memory_bytes", "host_memory_bytes")
_OPTIONAL_ZERO_OK = ("latency_s", "tp_latency_s", "grad_hook_s")
_KNOWN = tuple(f.name for f in fields(HardwareProfile))


def _number(path: Path, key: str, value: Any) -> float:
    """A positive finite number; numeric strings are accepted because YAML 1.1 reads ``989e12`` as text."""
    fix = f"write {key} as a positive number, e.g. 989.0e+12 (bytes, bytes/s or FLOP/s)"
    if isinstance(value, bool):
        raise RecipeError(f"{path}: must be a number, not a boolean", field=key, value=value, fix=fix)
    if isinstance(value, str):
        try:
            value = float(value.replace("_", ""))
        except ValueError:
            raise RecipeError(f"{path}: not a number", field=key, value=value, fix=fix) from None
    if not isinstance(value, int | float) or not math.isfinite(value):
        raise RecipeError(f"{path}: not a finite number", field=key, value=value, fix=fix)
    if value < 0 or (value == 0 and key not in _OPTIONAL_ZERO_OK):
        raise RecipeError(f"{path}: must be positive", field=key, value=value, fix=fix)
    if key in _INTS:
        if float(value) != int(value):
            raise RecipeError(f"{path}: must be a whole number", field=key, value=value, fix=fix)
        return int(value)
    return float(value)


def _resolve(path: str | Path) -> Path:
    """A file path as given, else a profile name looked up in the project's ``configs/hardware/``."""
    p = Path(path)
    if p.is_file():
        return p
    from tessera.config.loader import project_root

    root = project_root(Path(__file__).resolve().parent) or project_root(Path.cwd())
    if root is not None and p.suffix == "" and (root / "configs" / "hardware" / f"{p}.yaml").is_file():
        return root / "configs" / "hardware" / f"{p}.yaml"
    known = sorted(q.stem for q in (root / "configs" / "hardware").glob("*.yaml")) if root else []
    raise RecipeError(
        "hardware profile not found",
        field="hardware",
        value=str(path),
        fix="give a YAML file path or one of: " + (", ".join(known) or "(no profiles in configs/hardware/)"),
    )


def load_hardware(path: str | Path) -> HardwareProfile:
    """Read and validate a hardware profile; every mistake names the key, the value and the fix."""
    p = _resolve(path)
    try:
        from tessera.config.loader import read_config_file  # regular file, size-bounded

        data = yaml.safe_load(read_config_file(p, field="hardware", what="hardware profile"))
    except yaml.YAMLError as e:
        raise RecipeError(
            f"{p}: not valid YAML: {e}", field="hardware", value=str(p), fix="fix the YAML syntax"
        ) from None
    if not isinstance(data, dict):
        raise RecipeError(
            f"{p}: a hardware profile must be a mapping of keys to values",
            field="hardware",
            value=type(data).__name__,
            fix="write `key: value` lines: " + ", ".join(_REQUIRED),
        )
    for key in data:
        if key not in _KNOWN:
            import difflib

            near = difflib.get_close_matches(str(key), _KNOWN, n=1)
            raise RecipeError(
                f"{p}: unknown key",
                field=str(key),
                value=data[key],
                fix=(f"did you mean {near[0]}? " if near else "") + "known keys: " + ", ".join(_KNOWN),
            )
    for key in _REQUIRED:
        if key not in data or data[key] is None:
            raise RecipeError(
                f"{p}: missing key",
                field=key,
                value=None,
                fix=f"add `{key}:` (see {HardwareProfile.__name__} in tessera/plan/hardware.py)",
            )
    kw: dict[str, Any] = {}
    for key, value in data.items():
        if value is None:
            continue
        if key == "name":
            kw[key] = str(value)
        elif key == "engine_efficiency":
            from tessera.tables.engines import ENGINE_NAMES

            if not isinstance(value, dict) or any(k not in ENGINE_NAMES for k in value):
                raise RecipeError(
                    f"{p}: must map engine names to efficiencies",
                    field=key,
                    value=value,
                    fix="engine_efficiency: {" + ", ".join(f"{e}: 0.1" for e in ENGINE_NAMES) + "}",
                )
            kw[key] = {k: _number(p, f"{key}.{k}", v) for k, v in value.items()}
        elif key == "comm_overlap":
            if not isinstance(value, bool):
                raise RecipeError(
                    f"{p}: must be true or false", field=key, value=value, fix="comm_overlap: false"
                )
            kw[key] = value
        elif key == "device":
            if value not in DEVICES:
                raise RecipeError(
                    f"{p}: unknown device", field=key, value=value, fix="use device: cuda or device: cpu"
                )
            kw[key] = value
        else:
            kw[key] = _number(p, key, value)
    return HardwareProfile(**kw)


def dump_profile(profile: HardwareProfile, path: Path, comments: list[str]) -> None:
    """Write ``profile`` as a YAML file :func:`load_hardware` reads, led by ``comments`` (each a ``#``
    line: where its figures came from). Atomic: a reader sees the old profile or the new one."""
    from dataclasses import asdict

    from tessera.atomic import write_text_atomic

    data = {k: v for k, v in asdict(profile).items() if v is not None}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, "\n".join(comments) + "\n" + yaml.safe_dump(data, sort_keys=False))
