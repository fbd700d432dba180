"""``tessera plan R.yaml --probe``: measure the machine a recipe will run on, in about 30 s, and write what
was measured as a hardware profile the planner uses from then on. This module makes the profile and
keeps it; the ranks that measure are started by :mod:`tessera.launch.probe`.

The stock profiles (``configs/hardware/``) hold datasheet figures; on a machine unlike the datasheet (a
2-core VM, a shared node) they predict steps several times too fast until someone calibrates by hand
(``--calibrate`` needs finished runs). The probe measures, on the recipe's world size of ranks started
here (gloo on CPU, NCCL on GPU, one rank per device or per core as a run places them, every rank at once
so that they compete for the machine as a run's ranks do):

- the **FLOP/s of a matmul at the model's shapes** (a micro-batch's tokens x hidden x the MLP's width,
  in the recipe's precision): the profile's peak (``peak_flops``, ``peak_flops_fp32`` for fp32 recipes);
- the **model's own forward + backward** (the recipe's HF model built from its config, no engine, one
  micro-batch): the planner's FLOPs for it over its time, divided by that peak, is the profile's
  ``efficiency`` (attention, norms, activations, autograd: what a layer costs beyond its matmuls; the
  engines' steps below replace it per engine);
- an **AdamW step** over the model's parameters (torch's foreach kernel): the planner counts 28 bytes of
  memory traffic per parameter, so 28·N over its time is the kernel's bandwidth (recorded; the engines'
  optimizer steps below set ``hbm_bandwidth``);
- **all-reduce, all-gather and all-to-all** over the real backend at sizes from 4 KiB to 16 MiB: α
  (seconds per call: ``latency_s``, ``tp_latency_s``) and β (seconds per wire byte: the
  ``intra_node_bandwidth``) by least squares, with the planner's own wire-byte counts.

- **each engine's own steps** (:mod:`tessera.plan.probe_engines`: DDP, DeepSpeed ZeRO-2, megatron-core
  PP and TP at this world size, built as `tessera run` builds them, ~0.2-1.8 s each on 2 CPU ranks): what
  an engine does around the matmuls (hooks, bucket copies, schedules, its optimizer's path) is most of a
  small model's step and no micro-benchmark sees it. ``--calibrate``'s fit on these steps gives each
  engine's ``efficiency``, the optimizer's effective ``hbm_bandwidth``, the TP collectives' own α
  (``tp_latency_s``), and α / β over the engines' data-parallel collectives together with the ones above.

The profile goes to ``~/.cache/tessera/hardware/probe-<host>-<device>-<world>r.yaml`` (or ``--out``;
the directory moves with ``TESSERA_HARDWARE_DIR``) with the raw measurements beside it (``.json``).
``tessera plan`` and ``tessera run`` on this host pick it up when no profile is named; the run's manifest
records it.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import statistics
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

#: message sizes of the collectives, bytes (fp32 elements x 4)
SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20)
OPS = ("all_reduce", "all_gather", "all_to_all")
#: seconds the whole probe aims at (start-up of the ranks included)
BUDGET_S = 30.0
#: of those, what the engines' steps take (:mod:`tessera.plan.probe_engines`), measured on 2 CPU ranks
ENGINES_S = 8.0


def probe_dir() -> Path:
    return Path(os.environ.get("TESSERA_HARDWARE_DIR") or Path.home() / ".cache" / "tessera" / "hardware")


def probe_path(device: str, world: int) -> Path:
    """Where this host's probe of ``world`` ranks on ``device`` is kept."""
    return probe_dir() / f"probe-{socket.gethostname()}-{device}-{world}r.yaml"


def find_probe(device: str, world: int) -> Path | None:
    path = probe_path(device, world)
    return path if path.is_file() else None


def profile_from(
    measured: dict[str, Any], recipe: Any, *, world: int, device: str
) -> tuple[Any, dict[str, Any]]:
    """The hardware profile the measurements make (the device's stock profile with the measured figures
    in place of its datasheet ones), and the derivation of each figure."""
    from tessera.models.hf import load_hf_config
    from tessera.plan.comm_estimate import wire_factor
    from tessera.plan.facts import model_facts
    from tessera.plan.hardware import load_hardware
    from tessera.plan.measured import _fit_alpha_beta
    from tessera.plan.search import DEFAULT_HARDWARE
    from tessera.plan.time_estimate import ADAM_BYTES_PER_PARAM, flops_per_token

    ranks = measured["ranks"]
    s = measured["setting"]
    base = load_hardware(DEFAULT_HARDWARE[device])
    peak = statistics.median(r["matmul_flops"] for r in ranks)
    facts = model_facts(load_hf_config(recipe.model, vocab_size=recipe.data.vocab_size))
    model_flops = flops_per_token(facts, s["seq_len"]) * s["tokens"]
    achieved = statistics.median(model_flops / r["fwd_bwd_s"] for r in ranks)
    bandwidth = statistics.median(ADAM_BYTES_PER_PARAM * r["params"] / r["adam_s"] for r in ranks)
    how: dict[str, Any] = {
        "peak_flops": f"matmul {s['tokens']}x{s['hidden']} @ {s['hidden']}x{s['width']} ({s['precision']}): "
        f"{peak / 1e9:.2f} GFLOP/s (median over {world} ranks at once)",
        "efficiency": f"the model's forward + backward of one micro-batch: {achieved / 1e9:.2f} GFLOP/s of the "
        f"planner's FLOPs = {achieved / peak:.3f} of that peak",
        "hbm_bandwidth": f"AdamW (foreach) over {ranks[0]['params']:,} parameters: {bandwidth / 1e9:.2f} GB/s "
        f"at the planner's {ADAM_BYTES_PER_PARAM} bytes a parameter",
    }
    changes: dict[str, Any] = {
        "name": f"probe-{socket.gethostname()}",
        "efficiency": min(1.0, achieved / peak),
        "engine_efficiency": None,
        "grad_hook_s": None,
        "hbm_bandwidth": bandwidth,
    }
    if s["precision"] == "fp32":
        changes["peak_flops_fp32"] = peak
        if device == "cpu":
            changes["peak_flops"] = peak
    else:
        changes["peak_flops"] = peak
    samples = [
        (1.0, wire_factor(c["op"], world) * c["bytes"], c["seconds"])
        for c in ranks[0]["collectives"]  # every rank took part in each; rank 0's times
    ]
    if samples:
        alpha, beta = _fit_alpha_beta(samples)
        changes["latency_s"] = alpha
        changes["tp_latency_s"] = alpha
        if beta > 0:
            changes["intra_node_bandwidth"] = 1.0 / beta
        how["latency_s"] = (
            f"α of all-reduce / all-gather / all-to-all at {len(SIZES)} sizes: {alpha * 1e6:.1f} µs"
        )
        how["intra_node_bandwidth"] = (
            f"1/β of the same fit: {1.0 / beta / 1e9:.2f} GB/s" if beta > 0 else "kept"
        )
        changes["devices_per_node"] = max(base.devices_per_node, world)
    profile = replace(base, **changes)
    return _with_engines(profile, how, measured, recipe, world, device, samples)


def _with_engines(
    profile: Any,
    how: dict[str, Any],
    measured: dict[str, Any],
    recipe: Any,
    world: int,
    device: str,
    samples: list[Any],
) -> tuple[Any, dict[str, Any]]:
    """The profile with what the engines' own steps say (:mod:`tessera.plan.probe_engines`), fitted as
    ``--calibrate`` fits runs: each engine's efficiency, the optimizer's bandwidth, α / β over the engines'
    data-parallel collectives and the probe's own, the TP collectives' α."""
    from tessera.plan.measured import calibrate
    from tessera.plan.probe_engines import observations

    observed = observations(measured, recipe, world, device)
    failed = {e["label"]: e["error"] for e in measured["ranks"][0].get("engines", []) if e.get("error")}
    refused = {**measured["setting"].get("refused", {}), **failed}
    if refused:
        how["engines_left_out"] = "; ".join(f"{k}: {v}" for k, v in refused.items())
    if not observed:
        return profile, how
    fitted, report = calibrate(observed, profile, extra_samples=samples)
    name = profile.name
    profile = replace(fitted, name=name)
    steps = {o.label.removeprefix("probe:"): o.terms["step"] for o in observed}
    how["engine_efficiency"] = (
        "planner FLOPs / compute of each engine's own steps ("
        + ", ".join(f"{k} {v * 1e3:.1f} ms a step" for k, v in steps.items() if v is not None)
        + "): "
        + ", ".join(f"{k} {v:.3f}" for k, v in (profile.engine_efficiency or {}).items())
    )
    how["efficiency"] = (
        f"the median of the engines' efficiencies below, {profile.efficiency:.3f} (the planner's default for "
        f"an engine not probed; {how['efficiency']})"
    )
    how["hbm_bandwidth"] = (
        f"the engines' optimizer steps: {profile.hbm_bandwidth / 1e9:.2f} GB/s at the planner's bytes "
        f"(the AdamW kernel alone: {how['hbm_bandwidth']})"
    )
    how["latency_s"] = (
        f"α over the probe's collectives and the engines' data-parallel ones "
        f"({report['messages_fitted']} samples): {profile.latency_s * 1e6:.1f} µs"
    )
    how["intra_node_bandwidth"] = (
        f"1/β of the same fit: {profile.intra_node_bandwidth / 1e9:.2f} GB/s"
        if report["seconds_per_wire_byte"] > 0
        else f"kept, {profile.intra_node_bandwidth / 1e9:.2f} GB/s (the fit found no cost per byte)"
    )
    if profile.tp_latency_s is not None and any(o.label == "probe:megatron-tp" for o in observed):
        how["tp_latency_s"] = (
            f"the TP layout's step beyond the rest of the prediction, per TP message: "
            f"{profile.tp_latency_s * 1e6:.1f} µs"
        )
    return profile, how


def write_profile(profile: Any, how: dict[str, Any], measured: dict[str, Any], path: Path) -> None:
    """The profile as YAML (the derivations as comments) and the raw measurements beside it as JSON."""
    from tessera.atomic import write_json_atomic
    from tessera.plan.hardware import dump_profile

    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    head = [f"# measured by `tessera plan --probe` on {socket.gethostname()} at {stamp}"]
    head += [f"# {k}: {v}" for k, v in how.items()]
    head.append(
        "# the engines' figures come from a few steps of random tokens at the probe's layouts: "
        "`tessera plan --calibrate RUN...` fits them from finished runs of your own"
    )
    dump_profile(profile, path, head)
    write_json_atomic(path.with_suffix(".json"), {**measured, "derivation": how, "written": stamp})


def probe_record(device: str, world: int) -> dict[str, Any] | None:
    """What a run's manifest says of this host's probe: the profile's path and figures (None: no probe)."""
    path = find_probe(device, world)
    if path is None:
        return None
    from tessera.plan.hardware import load_hardware

    try:
        figures = {k: v for k, v in asdict(load_hardware(path)).items() if v is not None}
        extra = (
            json.loads(path.with_suffix(".json").read_text()) if path.with_suffix(".json").is_file() else {}
        )
    except Exception as e:  # a damaged probe file is named, never a crash of the run
        return {"path": str(path), "error": f"{type(e).__name__}: {str(e)[:200]}"}
    return {
        "path": str(path),
        "written": extra.get("written"),
        "profile": figures,
        "derivation": extra.get("derivation"),
    }
