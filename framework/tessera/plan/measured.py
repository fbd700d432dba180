"""The planner against measurement: a run's step split into the planner's terms, and a hardware profile
calibrated from runs.

``tessera plan R.yaml --measured RUN_DIR`` prints, per term (compute, communication, bubble, optimizer,
step), what the planner predicts for the run's layout on the profile and what the run measured: medians
over the steady steps of ``metrics.jsonl`` (``compute_time_s`` is the step minus its counted collectives
and its optimizer step, so framework time and pipeline waits outside collectives land there; the bubble
is not measured apart) and, per collective, the calls and seconds of ``comm.jsonl`` beside the
planner's message count and its α + n·β time.

``tessera plan --calibrate RUN_DIR... --hardware X`` fits what the profile's figures cannot know:
α (seconds per message) and β (seconds per wire byte) by least squares over every data-parallel and
pipeline collective call the runs counted; a TP / EP collective's own α (the median call beyond its
bytes' time: those sit between a layer's matmuls and wait out the ranks' skew); the matmul efficiency
(the planner's FLOPs over the measured compute time; one for the HF modules, one for megatron-core's,
which run other kernels) and the optimizer's effective memory bandwidth (the planner's bytes over the
measured optimizer time), each the median over the runs. It writes a new profile with them.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import yaml

from tessera.errors import RecipeError
from tessera.plan.hardware import HardwareProfile
from tessera.rundir import RunDir, read_jsonl

TERMS = ("compute", "communication", "bubble", "optimizer", "step")
#: steps left out at the start of a run (warm-up: allocator, first collectives, lazy optimizer state)
WARMUP_STEPS = 5


def _steady(records: list[dict[str, Any]], warmup: int) -> list[dict[str, Any]]:
    steps = [r for r in records if "step_time_s" in r]
    return [r for r in steps if r["step"] > warmup] or steps


def run_recipe(run_dir: Path, flag: str = "--measured") -> Any:
    """The resolved recipe a run ran with (``flag``: the option that named the directory)."""
    from tessera.config.loader import validate_recipe

    rd = RunDir(run_dir)
    if not rd.recipe.is_file() or not rd.metrics.is_file():
        raise RecipeError(
            "not a finished run directory (no recipe.resolved.yaml or metrics.jsonl)",
            field=flag,
            value=str(run_dir),
            fix="give the directory of a run that made steps (runs/<name>)",
        )
    return validate_recipe(yaml.safe_load(rd.recipe.read_text()))


def measured_terms(run_dir: Path, warmup: int = WARMUP_STEPS) -> dict[str, float | None]:
    """Median seconds per term over the run's steady steps (rank 0's metrics line)."""
    steady = _steady(RunDir(run_dir).read_metrics(), warmup)

    def med(key: str) -> float:
        return statistics.median(float(r.get(key) or 0.0) for r in steady)

    return {
        "compute": med("compute_time_s"),
        "communication": med("comm_time_s"),
        "bubble": None,
        "optimizer": med("optimizer_time_s"),
        "step": med("step_time_s"),
    }


def measured_ops(run_dir: Path, warmup: int = WARMUP_STEPS) -> dict[str, dict[str, float]]:
    """Per ``op:group`` of the steady steps on rank 0: median calls, bytes and seconds per step."""
    rows: dict[int, dict[str, dict[str, float]]] = {}
    for line in read_jsonl(RunDir(run_dir).comm):
        if line.get("phase") != "step" or line.get("rank") != 0 or line["step"] <= warmup:
            continue
        per = rows.setdefault(line["step"], {})
        for o in line["ops"]:
            d = per.setdefault(f"{o['op']}:{o['group']}", {"calls": 0.0, "bytes": 0.0, "seconds": 0.0})
            d["calls"] += o["count"]
            d["bytes"] += o["bytes"]
            d["seconds"] += o["seconds"]
    keys = sorted({k for per in rows.values() for k in per})
    zero = {"calls": 0.0, "bytes": 0.0, "seconds": 0.0}
    return {
        k: {f: statistics.median(per.get(k, zero)[f] for per in rows.values()) for f in zero} for k in keys
    }


def predicted(recipe: Any, hardware: HardwareProfile) -> Any:
    """The planner's :class:`~tessera.plan.search.Candidate` for the recipe's own layout."""
    from tessera.plan.layout import layout_from_recipe
    from tessera.plan.search import estimate_layout

    layout = layout_from_recipe(recipe)
    return estimate_layout(recipe, layout, hardware=hardware, recompute=layout.recompute)


def predicted_terms(candidate: Any) -> dict[str, float]:
    t = candidate.time
    return {
        "compute": t.compute_s,
        "communication": t.tp_ep_s + t.pp_s + t.dp_exposed_s,
        "bubble": t.bubble_s,
        "optimizer": t.optimizer_s,
        "step": t.step_s,
    }


def compare_to_run(run_dir: Path, hardware: HardwareProfile) -> dict[str, Any]:
    """Predicted against measured, per term and per collective (``op:group``)."""
    from tessera.plan.time_estimate import op_seconds

    recipe = run_recipe(run_dir)
    cand = predicted(recipe, hardware)
    pred, meas = predicted_terms(cand), measured_terms(run_dir)
    ops_pred: dict[str, dict[str, float]] = {}
    for o in cand.comm_ops:
        d = ops_pred.setdefault(o.key, {"calls": 0.0, "bytes": 0.0, "seconds": 0.0})
        d["calls"] += o.calls * o.messages
        d["bytes"] += o.payload_bytes
        d["seconds"] += op_seconds(o, hardware)
    return {
        "run_dir": str(run_dir),
        "hardware": hardware.name,
        "layout": cand.layout.describe(),
        "terms": {k: {"predicted_s": pred[k], "measured_s": meas[k]} for k in TERMS},
        "ops": {"predicted": ops_pred, "measured": measured_ops(run_dir)},
    }


# ---- calibration ---------------------------------------------------------------------------------------


def _fit_alpha_beta(samples: list[tuple[float, float, float]]) -> tuple[float, float]:
    """Least squares of seconds = α·messages + β·wire bytes (both ≥ 0) over (messages, wire, seconds)."""
    import numpy as np

    a = np.array([[m, w] for m, w, _ in samples], dtype=float)
    y = np.array([s for _, _, s in samples], dtype=float)
    (alpha, beta), *_ = np.linalg.lstsq(a, y, rcond=None)
    if beta <= 0:  # no bandwidth signal (tiny messages only): all latency
        alpha, beta = float(y.sum() / a[:, 0].sum()), 0.0
    if alpha <= 0:
        alpha, beta = 0.0, float((a[:, 1] @ y) / (a[:, 1] @ a[:, 1]))
    return float(alpha), float(beta)


def calibrate(run_dirs: list[Path], hardware: HardwareProfile) -> tuple[HardwareProfile, dict[str, Any]]:
    """A profile with α, β, the matmul efficiency and the optimizer's bandwidth fitted from the runs (see
    the module doc); returns it and what each figure was fitted from."""
    from tessera.plan.estimate import wire_factor
    from tessera.plan.time_estimate import DEFAULT_EFFICIENCY

    samples: list[tuple[float, float, float]] = []
    critical: list[tuple[float, float, float]] = []  # the TP / EP collectives, between a layer's matmuls
    efficiency: dict[str, list[float]] = {"hf": [], "megatron": []}  # by the modules the layout runs
    bandwidth = []
    for run_dir in run_dirs:
        recipe = run_recipe(run_dir, "--calibrate")
        cand = predicted(recipe, hardware)
        layout = cand.layout
        sizes = {o.group: o.group_size for o in cand.comm_ops}
        for line in read_jsonl(RunDir(run_dir).comm):
            if line.get("phase") != "step" or line["step"] <= WARMUP_STEPS:
                continue
            for o in line["ops"]:
                if o["op"] == "recv":  # a receive waits for the sender's compute too: not a link time
                    continue
                n = sizes.get(o["group"], layout.world_size)
                sample = (float(o["count"]), wire_factor(o["op"], n) * o["bytes"], float(o["seconds"]))
                (critical if o["group"] in ("tp", "ep") else samples).append(sample)
        meas = measured_terms(run_dir)
        t = cand.time
        hf = layout.caps.hf_module
        used = hardware.efficiency_for(hf) or DEFAULT_EFFICIENCY
        if meas["compute"]:
            efficiency["hf" if hf else "megatron"].append(used * t.compute_s / meas["compute"])
        if meas["optimizer"] and t.optimizer_s:
            bandwidth.append(hardware.hbm_bandwidth * t.optimizer_s / meas["optimizer"])
    if not (samples or critical) or not any(efficiency.values()):
        raise RecipeError(
            "the runs counted no steady steps to fit from",
            field="--calibrate",
            value=", ".join(map(str, run_dirs)),
            fix=f"give runs of more than {WARMUP_STEPS} steps",
        )
    alpha, beta = _fit_alpha_beta(samples or critical)
    # a TP / EP collective's own α: what its calls took beyond their bytes' time (median per message)
    tp_alpha = (
        max(0.0, statistics.median((sec - beta * wire) / msgs for msgs, wire, sec in critical))
        if critical and samples
        else None
    )
    # each kind of module its own efficiency; a kind no run measured takes the other's
    eff = {k: statistics.median(v) for k, v in efficiency.items() if v}
    hf_eff = eff.get("hf", eff.get("megatron"))
    fitted = replace(
        hardware,
        name=f"{hardware.name}-calibrated",
        latency_s=alpha,
        tp_latency_s=tp_alpha,
        intra_node_bandwidth=1.0 / beta if beta > 0 else hardware.intra_node_bandwidth,
        efficiency=hf_eff,
        megatron_efficiency=eff.get("megatron", hf_eff),
        hbm_bandwidth=statistics.median(bandwidth) if bandwidth else hardware.hbm_bandwidth,
    )
    report = {
        "runs": [str(d) for d in run_dirs],
        "messages_fitted": len(samples) + len(critical),
        "latency_s": alpha,
        "tp_latency_s": tp_alpha,
        "tp_messages_fitted": len(critical),
        "seconds_per_wire_byte": beta,
        "efficiency_per_run": efficiency,  # by module kind: "hf", "megatron"
        "optimizer_bandwidth_per_run": bandwidth,
    }
    return fitted, report


def write_profile(profile: HardwareProfile, path: Path, report: dict[str, Any]) -> None:
    """The profile as YAML, led by comments saying what it was calibrated from."""
    data = {k: v for k, v in asdict(profile).items() if v is not None}
    head = [
        f"# {profile.name}: calibrated by `tessera plan --calibrate` from {len(report['runs'])} run(s):",
        *(f"#   {r}" for r in report["runs"]),
        f"# latency_s (alpha) and intra_node_bandwidth (1/beta): least squares over {report['messages_fitted']} "
        "counted collective calls (tp_latency_s: the median TP / EP call beyond its bytes); efficiency (HF modules) and megatron_efficiency: planner FLOPs / measured",
        "# compute time; hbm_bandwidth: the",
        "# optimizer's effective bandwidth (planner bytes / measured optimizer time). Medians over the runs.",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(head) + "\n" + yaml.safe_dump(data, sort_keys=False))
