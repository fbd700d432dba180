"""The planner against measurement: a run's step split into the planner's terms, and a hardware profile
calibrated from runs.

``tessera plan R.yaml --measured RUN_DIR`` prints, per term (compute, communication, bubble, optimizer,
step), what the planner predicts for the run's layout on the profile and what the run measured: medians
over the steady steps of ``metrics.jsonl`` (``compute_time_s`` is the step minus its counted collectives
and its optimizer step, so framework time and pipeline waits outside collectives land there; the bubble
is not measured apart) and, per collective, the calls and seconds of ``comm.jsonl`` beside the
planner's message count and its α + n·β time.

``tessera plan --calibrate RUN_DIR... --hardware X`` fits what the profile's figures cannot know:
α (seconds per message) and β (seconds per wire byte) by least squares over the data-parallel and
pipeline collectives the runs counted (per op and group, the median step); each engine's efficiency (the planner's FLOPs over the
measured compute time: an engine's own work per step - hooks, bucket copies, unfused kernels - counts
there; an engine's runs without ZeRO 2-3's extra gradient hooks where it has any); the seconds per tensor
of those hooks (DeepSpeed ZeRO-2 runs with accumulation: their compute beyond that efficiency and the
bucket copies, per tensor per micro-batch before the last); a TP / EP collective's own α (the step time of such runs beyond the rest of the prediction, per
message: those sit between a layer's matmuls, so they cost the ranks' skew too); and the optimizer's
effective memory bandwidth (the planner's bytes over the measured optimizer time), each the median over
the runs. It writes a new profile with them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from tessera.errors import RecipeError
from tessera.plan.hardware import HardwareProfile, dump_profile
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
    return terms_of(_steady(RunDir(run_dir).read_metrics(), warmup))


def terms_of(steps: list[dict[str, Any]]) -> dict[str, float | None]:
    """Median seconds per term over steps' records (``step_time_s``, ``comm_time_s``, ...: the loop's)."""

    def med(key: str) -> float:
        return statistics.median(float(r.get(key) or 0.0) for r in steps)

    return {
        "compute": med("compute_time_s"),
        "communication": med("comm_time_s"),
        "bubble": None,
        "optimizer": med("optimizer_time_s"),
        "step": med("step_time_s"),
    }


def measured_ops(run_dir: Path, warmup: int = WARMUP_STEPS) -> dict[str, dict[str, float]]:
    """Per ``op:group`` of the steady steps on rank 0: median calls, bytes and seconds per step."""
    steps = [
        (line["step"], line["ops"])
        for line in read_jsonl(RunDir(run_dir).comm)
        if line.get("phase") == "step" and line.get("rank") == 0 and line["step"] > warmup
    ]
    return ops_of(steps)


def ops_of(steps: list[tuple[int, list[dict[str, Any]]]]) -> dict[str, dict[str, float]]:
    """Per ``op:group``: the median calls, bytes and seconds per step over ``(step, counted ops)`` (the
    comm accounting's ``pop_step`` of each step; a step may come in several parts)."""
    rows: dict[int, dict[str, dict[str, float]]] = {}
    for step, ops in steps:
        per = rows.setdefault(step, {})
        for o in ops:
            d = per.setdefault(f"{o['op']}:{o['group']}", {"calls": 0.0, "bytes": 0.0, "seconds": 0.0})
            d["calls"] += o["count"]
            d["bytes"] += o["bytes"]
            d["seconds"] += o["seconds"]
    keys = sorted({k for per in rows.values() for k in per})
    zero = {"calls": 0.0, "bytes": 0.0, "seconds": 0.0}
    return {
        k: {f: statistics.median(per.get(k, zero)[f] for per in rows.values()) for f in zero} for k in keys
    }


@dataclass(frozen=True)
class Observation:
    """One layout's measured steady step in the planner's terms: a finished run's (:meth:`of_run`), or the
    short engine runs of ``tessera plan --probe`` (:mod:`tessera.plan.probe_engines`)."""

    label: str
    recipe: Any
    terms: dict[str, float | None]
    ops: dict[str, dict[str, float]]

    @classmethod
    def of_run(cls, run_dir: Path, flag: str = "--calibrate") -> Observation:
        return cls(str(run_dir), run_recipe(run_dir, flag), measured_terms(run_dir), measured_ops(run_dir))


def predicted(recipe: Any, hardware: HardwareProfile) -> Any:
    """The planner's :class:`~tessera.plan.search.Candidate` for the recipe's own layout."""
    from tessera.plan.layout import layout_from_recipe
    from tessera.plan.search import estimate_layout

    layout = layout_from_recipe(recipe)
    return estimate_layout(recipe, layout, hardware=hardware, recompute=layout.recompute)


def predicted_terms(candidate: Any) -> dict[str, float]:
    t = candidate.time
    return {
        "compute": t.compute_s + t.grad_hooks_s,  # measured compute holds the engine's hooks
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
    if alpha < 0 or beta < 0:
        # non-negative least squares: the optimum lies on a boundary - all latency or all bandwidth,
        # whichever fits the calls better (a few calls of two sizes can make the free fit negative)
        fits = [(float(y.sum() / a[:, 0].sum()), 0.0), (0.0, float((a[:, 1] @ y) / (a[:, 1] @ a[:, 1])))]
        alpha, beta = min(fits, key=lambda f: float(np.sum((a @ np.array(f) - y) ** 2)))
    return float(alpha), float(beta)


def _tp_only_efficiency(
    runs: list[tuple[Any, Any, dict[str, float | None], float]], known: dict[str, float], hw: HardwareProfile
) -> dict[str, float]:
    """The efficiency of an engine measured only in runs with TP / EP collectives, whose compute time
    also holds those collectives' disturbance: with two or more such runs, step = compute at efficiency 1
    / e + messages x α_TP + the rest, solved for 1/e and α_TP by least squares; with one, its measured
    compute (the disturbance then stays in the efficiency)."""
    import numpy as np

    from tessera.plan.time_estimate import DEFAULT_EFFICIENCY

    out: dict[str, float] = {}
    by_engine: dict[str, list[tuple[Any, Any, dict[str, float | None], float]]] = {}
    for run in runs:
        if run[3] and run[1].layout.engine not in known:
            by_engine.setdefault(run[1].layout.engine, []).append(run)
    for engine, mine in by_engine.items():
        one = replace(hw, engine_efficiency={**known, engine: 1.0}, tp_latency_s=0.0)
        rows, y = [], []
        for recipe, _, meas, critical in mine:
            t = predicted(recipe, one).time
            rows.append([t.compute_s / (1 - t.bubble_s / max(t.step_s, 1e-12)), critical])
            y.append(float(meas["step"] or 0.0) - (t.step_s - t.compute_s - t.bubble_s))
        inv = 0.0
        if len(mine) >= 2:
            (inv, alpha), *_ = np.linalg.lstsq(np.array(rows), np.array(y), rcond=None)
            inv = inv if alpha >= 0 else 0.0
        if inv > 0:
            out[engine] = float(1.0 / inv)
        else:  # one run, or no solution: its measured compute
            _, cand, meas, _ = mine[0]
            used = hw.efficiency_for(engine) or DEFAULT_EFFICIENCY
            out[engine] = used * cand.time.compute_s / float(meas["compute"] or cand.time.compute_s)
    return out


def calibrate(
    runs_or_observed: list[Path] | list[Observation],
    hardware: HardwareProfile,
    *,
    extra_samples: list[tuple[float, float, float]] | None = None,
) -> tuple[HardwareProfile, dict[str, Any]]:
    """A profile with α, β, each engine's efficiency, a TP / EP collective's own α and the optimizer's
    bandwidth fitted from the runs (see the module doc); returns it and what each figure was fitted from.

    In order: α and β by least squares over the data-parallel and pipeline collectives (per op and group,
    rank 0's median step); the optimizer's
    bandwidth; each engine's efficiency (planner FLOPs / measured compute) from its runs without TP / EP
    collectives where it has any (else :func:`_tp_only_efficiency`), leaving out the runs with ZeRO 2-3's
    extra gradient hooks where the engine has others; ``grad_hook_s`` from the ZeRO-2 runs with
    accumulation (their compute beyond that efficiency and the bucket copies, per tensor per hook pass,
    :func:`tessera.plan.time_estimate.grad_hook_seconds`); then the TP / EP α: what the step of a run with
    them took beyond the rest of the prediction, per TP / EP message (median over those runs). A TP
    collective sits between two matmuls of a layer, so besides its own time it costs the ranks' skew and
    the disturbance of the computation around it; only the step as a whole measures that.

    ``runs_or_observed``: run directories or :class:`Observation` s; ``extra_samples``: more
    (messages, wire bytes, seconds) for the α / β fit (the probe's own collectives)."""
    from tessera.plan.comm_estimate import wire_factor
    from tessera.plan.time_estimate import DEFAULT_EFFICIENCY, grad_hook_passes

    observed = [o if isinstance(o, Observation) else Observation.of_run(o) for o in runs_or_observed]
    samples: list[tuple[float, float, float]] = list(extra_samples or [])
    runs: list[
        tuple[Path, Any, dict[str, float | None], float]
    ] = []  # (dir, candidate, measured, TP/EP msgs)
    bandwidth = []
    for obs in observed:
        recipe = obs.recipe
        cand = predicted(recipe, hardware)
        sizes = {o.group: o.group_size for o in cand.comm_ops}
        # per op:group, rank 0's median step (a call that waited out another rank's checkpoint or
        # straggling is no link time); a receive waits for the sender's compute too; TP / EP: fitted below
        for key, o in obs.ops.items():
            op, group = key.split(":", 1)
            if op == "recv" or group in ("tp", "ep") or not o["calls"]:
                continue
            n = sizes.get(group, cand.layout.world_size)
            samples.append((o["calls"], wire_factor(op, n) * o["bytes"], o["seconds"]))
        meas = obs.terms
        critical = sum(o.calls * o.messages for o in cand.comm_ops if o.group in ("tp", "ep"))
        runs.append((recipe, cand, meas, critical))
        if meas["optimizer"] and cand.time.optimizer_s:
            bandwidth.append(hardware.hbm_bandwidth * cand.time.optimizer_s / meas["optimizer"])
    if not runs or not any(m["compute"] for _, _, m, _ in runs):
        raise RecipeError(
            "the runs counted no steady steps to fit from",
            field="--calibrate",
            value=", ".join(o.label for o in observed),
            fix=f"give runs of more than {WARMUP_STEPS} steps",
        )
    alpha, beta = _fit_alpha_beta(samples) if samples else (hardware.latency_s, 0.0)
    efficiency: dict[str, list[float]] = {}
    plain = [r for r in runs if r[2]["compute"] and not r[3]]  # the runs without TP / EP collectives
    # an engine's efficiency from its runs without ZeRO 2-3's extra gradient hooks where it has any (the
    # hooks are fitted below); an engine with only such runs keeps the hooks in its efficiency
    no_hooks = {cand.layout.engine for _, cand, _, _ in plain if not grad_hook_passes(cand.layout)}
    for _, cand, meas, _ in plain:
        engine = cand.layout.engine
        if engine in no_hooks and grad_hook_passes(cand.layout):
            continue
        used = hardware.efficiency_for(engine) or DEFAULT_EFFICIENCY
        compute = float(meas["compute"] or 0.0) - cand.time.grad_hooks_s
        efficiency.setdefault(engine, []).append(used * cand.time.compute_s / max(compute, 1e-9))
    engines = {k: statistics.median(v) for k, v in efficiency.items()}
    engines.update(_tp_only_efficiency(runs, engines, hardware))
    fitted = replace(
        hardware,
        name=f"{hardware.name}-calibrated",
        latency_s=alpha,
        tp_latency_s=0.0,
        intra_node_bandwidth=1.0 / beta if beta > 0 else hardware.intra_node_bandwidth,
        efficiency=statistics.median(engines.values()),
        engine_efficiency=engines,
        hbm_bandwidth=statistics.median(bandwidth) if bandwidth else hardware.hbm_bandwidth,
    )
    hooks = []  # seconds per tensor: ZeRO-2 runs' compute beyond the fitted efficiency and the copies
    for recipe, cand, meas, _ in plain:
        if cand.layout.zero == 2 and grad_hook_passes(cand.layout) and cand.layout.engine in no_hooks:
            t0 = predicted(recipe, replace(fitted, grad_hook_s=0.0)).time
            per_second = (
                predicted(recipe, replace(fitted, grad_hook_s=1.0)).time.grad_hooks_s - t0.grad_hooks_s
            )
            rest = float(meas["compute"] or 0.0) - t0.compute_s - t0.grad_hooks_s
            hooks.append(max(0.0, rest / per_second))
    fitted = replace(fitted, grad_hook_s=statistics.median(hooks) if hooks else hardware.grad_hook_s)
    residual = []
    for recipe, _, meas, critical in runs:
        if critical and meas["step"]:
            rest = predicted_terms(predicted(recipe, fitted))["step"]
            residual.append(max(0.0, (meas["step"] - rest) / critical))
    fitted = replace(fitted, tp_latency_s=statistics.median(residual) if residual else None)
    report = {
        "runs": [o.label for o in observed],
        "messages_fitted": len(samples),
        "latency_s": alpha,
        "tp_latency_s": fitted.tp_latency_s,
        "tp_latency_per_run": residual,
        "seconds_per_wire_byte": beta,
        "efficiency_per_run": efficiency,  # by engine
        "grad_hook_s": fitted.grad_hook_s,
        "grad_hook_per_run": hooks,
        "optimizer_bandwidth_per_run": bandwidth,
    }
    return fitted, report


def write_profile(profile: HardwareProfile, path: Path, report: dict[str, Any]) -> None:
    """The profile as YAML, led by comments saying what it was calibrated from."""
    head = [
        f"# {profile.name}: calibrated by `tessera plan --calibrate` from {len(report['runs'])} run(s):",
        *(f"#   {r}" for r in report["runs"]),
        f"# latency_s (alpha) and intra_node_bandwidth (1/beta): least squares over {report['messages_fitted']} "
        "counted data-parallel / pipeline calls;",
        "# engine_efficiency: planner FLOPs / measured compute time per engine (efficiency: their median);",
        "# grad_hook_s: ZeRO-2 runs' compute beyond the efficiency and the bucket copies, per tensor per hook pass;",
        "# tp_latency_s: the step time of TP / EP runs beyond the rest of the prediction, per TP / EP message;",
        "# hbm_bandwidth: the optimizer's effective bandwidth (planner bytes / measured optimizer time).",
        "# Medians over the runs.",
    ]
    dump_profile(profile, path, head)
