"""The baseline comparison: pre-registration, what each run measured, and the verdict.

``tessera compare`` (orchestrated in :mod:`tessera.launch.compare`) runs the naive data-parallel baseline
with K seeds and the candidate, then calls :func:`judge` on the run directories. Everything here reads
files (``metrics.jsonl``, ``summary.json``, ``manifest.json``, ``plan.json``); nothing runs a model.

Definitions (the report quotes them):

- Timing statistics leave out the first ``acceptance.warmup_steps`` steps of each run.
- Steady-state tokens/s: input tokens of the timed steps over their summed step time.
- Time to first step: the rank-0 process start to the end of step 1 (``time_to_first_step_s`` of step 1).
- Noise floor at step s: the seed-to-seed standard deviation of the baseline runs (ddof 1), as the root
  of the across-seed variance averaged over steps s-4..s+4 (one step's spread of 2 seeds is too noisy).
- A band around the same-seed baseline: ``rel`` x |baseline|, ``abs``, ``noise_floor_multiple`` x the
  noise floor; with several forms given the widest applies. Measured: the largest |candidate - baseline|
  as a share of the band (<= 1 passes), and the first step outside it.
- Ratios are candidate / baseline, the baseline value being the mean over its seeds (time, memory) or
  the same-seed run (eval loss).
- Seed spread of a cost ratio (step time p50, tokens/s, cost per 1B tokens, peak memory, time to first
  step): the seed-to-seed standard deviation (ddof 1, the noise floor's statistic) of the baseline runs'
  values over their mean, i.e. of the baseline's own ratios to itself. Two identical baselines 1.58x apart
  give a spread of 0.32: a candidate's ratio means nothing closer to a threshold than that.
- A cost threshold T is judged with ``h`` = :data:`RATIO_SPREAD_MULTIPLE` x the spread: ``ratio >= T``
  holds when ratio - h >= T, is refuted when ratio + h < T, and is "not distinguishable" in between
  (``<=`` mirrored). The effect against the baseline: a win or a loss when |ratio - 1| > h, else "not
  distinguishable". Verdict: FAIL if any check is refuted (or could not be measured), PASS if every check
  holds, else INCONCLUSIVE.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from tessera.errors import TesseraError, preview
from tessera.plan.layout import MODEL_AXES
from tessera.rundir import RunDir
from tessera.tables.engines import BASELINE_ENGINE, ENGINES

NOISE_WINDOW = 4  # steps either side averaged into the noise floor
#: a cost ratio is distinguishable from a threshold (or from 1) when it differs by more than this many seed
#: spreads; fixed here and written into every pre-registration (``ratio_spread_multiple``)
RATIO_SPREAD_MULTIPLE = 1.0
HOLDS, REFUTED, NOT_DISTINGUISHABLE, NOT_MEASURED = "holds", "refuted", "not distinguishable", "not measured"


def thresholds_of(acceptance: dict[str, Any]) -> dict[str, Any]:
    """The thresholds that are set (an unset one is not checked); ``warmup_steps`` is kept apart."""
    return {k: v for k, v in acceptance.items() if v is not None and k != "warmup_steps"}


# ---- runs ----------------------------------------------------------------------------------------------


@dataclass
class RunData:
    """What one finished run left in its directory."""

    role: str  # candidate | baseline | scaling
    path: Path
    seed: int
    world: int
    metrics: list[dict[str, Any]]
    summary: dict[str, Any]
    manifest: dict[str, Any]
    plan: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def read(cls, path: Path, role: str) -> RunData:
        rd = RunDir(path)
        missing = [n for n in (RunDir.METRICS, RunDir.SUMMARY, RunDir.MANIFEST) if not (path / n).is_file()]
        if missing:
            raise TesseraError(
                f"{path} is not a finished run (no {', '.join(missing)})",
                field="--runs",
                value=str(path),
                fix="give run directories of finished `tessera run`s",
            )
        manifest = rd.read_manifest()
        plan = (rd.read_json_if_present(RunDir.PLAN) or {}).get("chosen") or {}
        return cls(
            role=role,
            path=path,
            seed=int(manifest.get("seed", 0)),
            world=int(manifest.get("world_size", 1)),
            metrics=rd.read_metrics(),
            summary=rd.read_summary(),
            manifest=manifest,
            plan=plan,
        )

    @property
    def name(self) -> str:
        return self.path.name

    def series(self, key: str) -> dict[int, float]:
        return {r["step"]: float(r[key]) for r in self.metrics if r.get(key) is not None}


#: What a candidate and its baselines must share for a verdict to mean anything: manifest keys (the
#: dotted keys of :func:`tessera.evidence.manifest.diff_manifests`, matched by prefix) and their names.
#: These change the work itself - other tokens, another model, another number of tokens per step or per
#: rank, another device - so no ratio or band between the runs measures the layout: refused (exit 2).
#: Everything else may differ: the layout and engine are what is compared, and a change of optimizer,
#: precision or attention kernel is a claim the loss band then judges (a 1 % higher learning rate fails
#: it). ``data.files`` (paths, sizes) is left out: the data's content and data hashes cover it.
SAME_WORK: tuple[tuple[str, str], ...] = (
    ("data.", "the data (content / data hash, samples, seq_len, packing, eval split)"),
    ("tokenizer_hash", "the tokenizer"),
    ("recipe.model.", "the model config"),
    ("recipe.peft", "the adapters (a LoRA run's baseline trains the same adapters)"),
    ("layout.global_batch", "the global batch"),
    ("world_size", "the world size"),
    ("device", "the device"),
)
_FREE = ("data.files", "recipe.model.attn_implementation")


def check_same_work(cand: RunData, baselines: list[RunData]) -> None:
    """Refuse runs that differ beyond the compared layout (see :data:`SAME_WORK`), naming every key.

    Unequal ``train.steps`` is refused too unless both runs use a constant learning rate: the cosine
    and linear schedules decay over ``train.steps``, so every step after warmup trained at another LR and
    even the common steps are not the same experiment. Runs with equal ``train.steps`` that recorded
    unequal numbers of steps (one stopped early, or crashed) are judged on their common steps instead
    (:func:`common_steps`). The first baseline is the band's reference: it must have the candidate's
    seed."""
    from tessera.evidence.manifest import diff_manifests

    for base in baselines:
        diffs = [
            (key, a, b)
            for key, a, b in diff_manifests(cand.manifest, base.manifest)
            if key.startswith(tuple(p for p, _ in SAME_WORK)) and not key.startswith(_FREE)
        ]
        ca, ba = (r.manifest.get("recipe") or {} for r in (cand, base))
        steps = [
            ((x.get("train") or {}).get("steps"), (x.get("optim") or {}).get("schedule")) for x in (ca, ba)
        ]
        if steps[0][0] != steps[1][0] and not steps[0][1] == steps[1][1] == "constant":
            diffs.append(("recipe.train.steps", steps[0][0], steps[1][0]))
        if base is baselines[0] and cand.seed != base.seed:
            diffs.append(("seed", cand.seed, base.seed))
        if not diffs:
            continue
        named = ", ".join(dict.fromkeys(_what_differs(key) for key, *_ in diffs))
        lines = "\n".join(
            f"    {key}: {preview(a, 120)} (candidate) vs {preview(b, 120)}" for key, a, b in diffs
        )
        raise TesseraError(
            f"baseline {base.name} differs from candidate {cand.name} beyond the compared layout, in "
            f"{named}; no ratio or band between them would measure the layout:\n{lines}",
            field="--runs",
            value=str(base.path),
            fix="compare runs of the same data, tokenizer, model, global batch, world size, device and "
            "train.steps, the first baseline with the candidate's seed (`tessera manifest diff "
            f"{cand.path} {base.path}` lists every difference)",
        )


def _what_differs(key: str) -> str:
    if key == "recipe.train.steps":
        return "train.steps (the LR schedule decays over it)"
    if key == "seed":
        return "the seed of the first (same-seed) baseline"
    return next(label for prefix, label in SAME_WORK if key.startswith(prefix))


def common_steps(runs: list[RunData]) -> tuple[list[RunData], dict[str, Any] | None]:
    """Runs cut to the steps all of them recorded (1..the shortest run's last step), and a statement of
    the difference for the verdict (None when every run recorded the same steps). Every statistic - the
    bands, the timing, the final eval loss - then comes from the same steps of every run."""
    last = {r.name: max((int(m["step"]) for m in r.metrics), default=0) for r in runs}
    n = min(last.values())
    if n == 0:
        empty = next(r for r in runs if last[r.name] == 0)
        raise TesseraError(
            f"run {empty.name} recorded no step: there is nothing to compare",
            field="--runs",
            value=str(empty.path),
            fix="give runs that trained at least one step",
        )
    if len(set(last.values())) == 1:
        return runs, None
    cut = [replace(r, metrics=[m for m in r.metrics if m["step"] <= n]) for r in runs]
    recorded = ", ".join(f"{name} {k} steps" for name, k in last.items())
    note = f"runs of unequal length: judged on steps 1-{n}, the steps every run recorded ({recorded})"
    return cut, {"steps_compared": n, "steps_recorded": last, "note": note}


def percentiles(values: list[float]) -> dict[str, float]:
    """p50 / p95 / p99 / max (numpy's default linear interpolation) and the mean."""
    a = np.asarray(values, dtype=np.float64)
    return {
        "p50": float(np.percentile(a, 50)),
        "p95": float(np.percentile(a, 95)),
        "p99": float(np.percentile(a, 99)),
        "max": float(a.max()),
        "mean": float(a.mean()),
    }


def timed(run: RunData, warmup: int) -> list[dict[str, Any]]:
    """The steps timing statistics use: after the warmup (all but the first if the run is shorter)."""
    steps = [r for r in run.metrics if r["step"] > warmup]
    return steps or run.metrics[1:] or run.metrics


def run_stats(run: RunData, *, warmup: int, price_per_device_hour: float | None = None) -> dict[str, Any]:
    """Everything the report says of one run."""
    steps = timed(run, warmup)
    times = [r["step_time_s"] for r in steps]
    total_t = sum(times)
    inputs = sum(r["tokens_per_s"] * r["step_time_s"] for r in steps)
    tps = inputs / total_t if total_t > 0 else float("nan")
    first = next((r for r in run.metrics if r["step"] == 1), None)
    wall = sum(r["step_time_s"] + r.get("data_time_s", 0.0) for r in steps)
    where = {
        part: sum(r.get(f"{part}_time_s", 0.0) for r in steps) / wall if wall > 0 else float("nan")
        for part in ("compute", "comm", "optimizer", "data")
    }
    plan = run.plan or {}
    breakdown = plan.get("step_time_breakdown_s") or {}
    planned_comm_s = sum(breakdown.get(k, 0.0) for k in ("dp_exposed_s", "tp_ep_s", "pp_s"))
    device_hour = tps / run.world * 3600 if math.isfinite(tps) else float("nan")
    evals = run.series("eval_loss")
    mfu = [r["mfu"] for r in steps if r.get("mfu") is not None]
    return {
        "run": run.name,
        "role": run.role,
        "seed": run.seed,
        "world_size": run.world,
        "engine": run.manifest.get("layout", {}).get("engine"),
        "layout": run.manifest.get("layout", {}),
        "steps": len(run.metrics),
        "timed_steps": [steps[0]["step"], steps[-1]["step"]] if steps else None,
        "step_time_s": percentiles(times) if times else None,
        "tokens_per_s": tps,
        "time_to_first_step_s": first.get("time_to_first_step_s") if first else None,
        "peak_memory_bytes_per_rank": run.summary.get("peak_memory_bytes_per_rank") or [],
        "comm_bytes_per_step": float(np.mean([r["comm_bytes"] for r in steps])) if steps else None,
        "comm_fraction": percentiles([r["comm_fraction"] for r in steps]) if steps else None,
        "planned_comm_bytes_per_step": sum((plan.get("comm_bytes_per_step") or {}).values()) or None,
        "planned_comm_fraction": planned_comm_s / plan["step_time_s"] if plan.get("step_time_s") else None,
        "planned_step_time_s": plan.get("step_time_s"),
        "mfu": percentiles(mfu) if mfu else None,
        "tokens_per_device_hour": device_hour,
        "cost_per_1b_tokens": price_per_device_hour * 1e9 / device_hour
        if price_per_device_hour and device_hour
        else None,
        "where_the_time_went": where,
        "final_loss": run.metrics[-1]["loss"] if run.metrics else None,
        "final_eval_loss": evals[max(evals)] if evals else None,
    }


# ---- bands and the verdict -----------------------------------------------------------------------------


def seed_spread(values: list[float]) -> float | None:
    """The seed-to-seed spread of one quantity over the baseline runs: the standard deviation with ddof 1
    (one statistic for the loss noise floor and the cost ratios); None with fewer than two values."""
    if len(values) < 2:
        return None
    return float(np.std(np.asarray(values, dtype=np.float64), ddof=1))


def noise_floor(baselines: list[RunData], key: str) -> dict[int, float]:
    """Per step: the seed-to-seed spread of ``key`` over the baseline runs (see the module docstring);
    empty with fewer than two seeds."""
    if len(baselines) < 2:
        return {}
    series = [b.series(key) for b in baselines]
    steps = sorted(set.intersection(*(set(s) for s in series)))
    # one step's spread of 2 seeds is too noisy: the variance is averaged over the window, then rooted
    var = {s: seed_spread([x[s] for x in series]) ** 2 for s in steps}  # type: ignore[operator]
    out = {}
    for i, s in enumerate(steps):
        window = steps[max(0, i - NOISE_WINDOW) : i + NOISE_WINDOW + 1]
        out[s] = math.sqrt(sum(var[w] for w in window) / len(window))
    return out


def band_check(
    cand: dict[int, float], ref: dict[int, float], floor: dict[int, float], tol: dict[str, Any]
) -> dict[str, Any]:
    """The candidate's curve against the band around the reference, step by step."""
    worst = {"share": 0.0, "step": None, "diff": 0.0, "width": None}
    first_out = None
    widths = {}
    for s in sorted(set(cand) & set(ref)):
        forms = []
        if tol.get("rel") is not None:
            forms.append(tol["rel"] * abs(ref[s]))
        if tol.get("abs") is not None:
            forms.append(tol["abs"])
        if tol.get("noise_floor_multiple") is not None and s in floor:
            forms.append(tol["noise_floor_multiple"] * floor[s])
        if not forms:
            continue
        width = max(forms)
        widths[s] = width
        diff = abs(cand[s] - ref[s])
        share = diff / width if width > 0 else (0.0 if diff == 0 else math.inf)
        if share > worst["share"] or worst["step"] is None:
            worst = {"share": share, "step": s, "diff": diff, "width": width}
        if share > 1.0 and first_out is None:
            first_out = s
    return {
        "measured": worst["share"],
        "worst_step": worst["step"],
        "max_abs_diff": max((abs(cand[s] - ref[s]) for s in widths), default=0.0),
        "first_step_outside": first_out,
        "steps_checked": len(widths),
        "width": widths,
    }


#: the cost ratios the report states, each with its seed spread: (name, what of a run's statistics, the
#: better direction, the threshold that judges it if any)
COST_RATIOS: tuple[tuple[str, str, str, str | None], ...] = (
    ("step_time_p50", "median step time", "lower", None),
    ("throughput", "steady-state throughput", "higher", "throughput_ratio_min"),
    ("cost_per_1b_tokens", "cost per 1B tokens", "lower", None),
    ("peak_memory", "largest per-rank peak memory", "lower", "peak_memory_ratio_max"),
    ("time_to_first_step", "time to first step", "lower", "time_to_first_step_ratio_max"),
)


def _cost_value(stats: dict[str, Any], name: str) -> float | None:
    """One run's value of a cost ratio's quantity (None where the run did not measure it)."""
    if name == "step_time_p50":
        return (stats["step_time_s"] or {}).get("p50")
    if name == "throughput":
        return stats["tokens_per_s"]
    if name == "cost_per_1b_tokens":
        return stats["cost_per_1b_tokens"]
    if name == "peak_memory":
        return (
            float(max(stats["peak_memory_bytes_per_rank"])) if stats["peak_memory_bytes_per_rank"] else None
        )
    return stats["time_to_first_step_s"]


def _finite(v: float | None) -> bool:
    return v is not None and math.isfinite(v)


def cost_ratio(
    candidate: float | None,
    baselines: list[float | None],
    *,
    better: str,
    multiple: float = RATIO_SPREAD_MULTIPLE,
) -> dict[str, Any]:
    """candidate / the baselines' mean, with the baseline's seed spread: the standard deviation (ddof 1)
    of its own runs' ratios to their mean (:func:`seed_spread`), and the effect judged against it: a
    "win" or "loss" (by ``better``: "higher" or "lower") only where |ratio - 1| > ``multiple`` x spread;
    inside it the runs cannot tell the candidate from the baseline."""
    vals = [float(v) for v in baselines if _finite(v)]
    mean = float(np.mean(vals)) if vals else None
    ratio = float(candidate) / mean if _finite(candidate) and mean else None
    own = [v / mean for v in vals] if mean else []
    spread = seed_spread(own)
    half = multiple * spread if spread is not None else None
    if ratio is None:
        effect = NOT_MEASURED
    elif half is None:
        effect = "no spread (one baseline run)"
    elif abs(ratio - 1.0) > half:
        effect = "win" if (ratio > 1.0) == (better == "higher") else "loss"
    else:
        effect = NOT_DISTINGUISHABLE
    return {
        "candidate": float(candidate) if _finite(candidate) else None,
        "baseline_mean": mean,
        "baseline_values": vals,
        "ratio": ratio,
        "baseline_ratios": own,  # the baseline's own run-to-run ratios, for scale
        "spread": spread,
        "half_width": half,
        "better": better,
        "effect": effect,
    }


def judge_ratio(measured: float | None, threshold: float, op: str, half_width: float | None) -> str:
    """A ratio against its threshold, ``half_width`` being its noise (multiple x seed spread; None or 0:
    the value alone): "holds" when the whole interval measured +- half_width satisfies ``op threshold``,
    "refuted" when none of it does, "not distinguishable" when the threshold lies inside it."""
    if not _finite(measured):
        return NOT_MEASURED
    h = half_width or 0.0
    lo, hi = measured - h, measured + h  # type: ignore[operator]
    if op == ">=":
        return HOLDS if lo >= threshold else REFUTED if hi < threshold else NOT_DISTINGUISHABLE
    return HOLDS if hi <= threshold else REFUTED if lo > threshold else NOT_DISTINGUISHABLE


def verdict_of(outcomes: list[str]) -> str:
    """FAIL if any check is refuted or was not measured; PASS if every check holds (and there is one);
    otherwise INCONCLUSIVE: nothing refuted, but some ratio lies within the baseline's seed spread of its
    threshold."""
    if not outcomes or any(o in (REFUTED, NOT_MEASURED) for o in outcomes):
        return "FAIL"
    return "PASS" if all(o == HOLDS for o in outcomes) else "INCONCLUSIVE"


def _check(
    name: str,
    measured: float | None,
    threshold: float,
    op: str,
    *,
    half_width: float | None = None,
    **extra: Any,
) -> dict[str, Any]:
    outcome = judge_ratio(measured, threshold, op, half_width)
    return {
        "threshold_name": name,
        "measured": measured,
        "threshold": threshold,
        "op": op,
        "outcome": outcome,
        "half_width": half_width,
        "passed": outcome == HOLDS,
        "refutes_claim": outcome in (REFUTED, NOT_MEASURED),
        **extra,
    }


def _num(x: float) -> str:
    return format(x, ".4g")


def _layout_name(layout: dict[str, Any]) -> str:
    """A layout as the field names it: "DeepSpeed ZeRO-2", "megatron-core TP2 PP2", "DDP". An engine is
    named by the libraries that do its work (its registry entry's ``libraries``); the baseline engine by
    the last word of them alone ("torch DDP" -> "DDP"), the name every comparison calls it by."""
    engine = layout.get("engine") or "?"
    if engine == BASELINE_ENGINE:
        return _BASELINE_NAME
    parts = [ENGINES[engine].libraries if engine in ENGINES else engine]
    parts += [f"{a.upper()}{layout[a]}" for a in MODEL_AXES if (layout.get(a) or 1) > 1]
    if layout.get("zero"):
        parts.append(f"ZeRO-{layout['zero']}")
    if layout.get("sequence_parallel") is True and (layout.get("tp") or 1) > 1:
        parts.append("SP")
    offload = [k for k in ("optimizer", "params") if layout.get(f"offload_{k}")]
    if offload:
        parts.append(f"offload {'+'.join(offload)}")
    return " ".join(parts)


#: the naive data-parallel baseline, as claims name it
_BASELINE_NAME = ENGINES[BASELINE_ENGINE].libraries.split()[-1]


def _band_words(tol: dict[str, Any], unit: str) -> str:
    forms = []
    if tol.get("abs") is not None:
        forms.append(f"{_num(tol['abs'])} {unit}".rstrip())
    if tol.get("rel") is not None:
        forms.append(f"{_num(tol['rel'])}x its value")
    if tol.get("noise_floor_multiple") is not None:
        forms.append(f"{_num(tol['noise_floor_multiple'])}x the seed-to-seed spread")
    return " or ".join(forms) + (" (the widest)" if len(forms) > 1 else "")


def claim_sentence(
    acceptance: dict[str, Any], cand_layout: dict[str, Any], world: int, base_layout: dict[str, Any]
) -> str:
    """The claim under test in one sentence, from the registered thresholds and the two layouts: what a
    PASS asserts and any refuted threshold denies."""
    th = thresholds_of(acceptance)
    base = _layout_name(base_layout)
    who = f"the {base} baseline" if base_layout.get("engine") == BASELINE_ENGINE else f"the baseline ({base})"
    words: dict[str, Callable[[Any], str]] = {  # each threshold's clause, in the sentence's order
        "loss_tolerance": lambda v: f"loss within {_band_words(v, 'nats')}",
        "grad_norm_tolerance": lambda v: f"grad norm within {_band_words(v, '')}",
        "eval_loss_ratio_max": lambda v: f"final eval loss within {_num(v)}x",
        "throughput_ratio_min": lambda v: f">= {_num(v)}x its throughput",
        "peak_memory_ratio_max": lambda v: f"<= {_num(v)}x its peak memory per rank",
        "time_to_first_step_ratio_max": lambda v: f"<= {_num(v)}x its time to first step",
    }
    clauses = {k: say(th[k]) for k, say in words.items() if k in th}
    cost_names = {threshold for *_, threshold in COST_RATIOS}
    quality = [c for k, c in clauses.items() if k not in cost_names]
    costs = [c for k, c in clauses.items() if k in cost_names]

    def listed(items: list[str]) -> str:
        return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]

    text = f"Claim: {_layout_name(cand_layout)} on {world} rank{'s' if world != 1 else ''}"
    if quality:
        text += f" reaches {who}'s {listed(quality)}"
        if costs:
            text += f", at {listed(costs)}"
    else:
        text += f" runs at {listed(costs).replace(' its ', ' the ')} of {who}"
    return text + "."


def judge(
    acceptance: dict[str, Any],
    cand: RunData,
    baselines: list[RunData],
    *,
    scaling: RunData | None = None,
    price_per_device_hour: float | None = None,
    spread_multiple: float = RATIO_SPREAD_MULTIPLE,
) -> dict[str, Any]:
    """Statistics of every run, every cost ratio with its seed spread, and the verdict: each set
    threshold measured and judged (a cost ratio against its spread, see the module docstring)."""
    warmup = int(acceptance.get("warmup_steps") or 0)
    runs = [cand, *baselines, *([scaling] if scaling else [])]
    stats = {r.name: run_stats(r, warmup=warmup, price_per_device_hour=price_per_device_hour) for r in runs}
    cs, bs = stats[cand.name], [stats[b.name] for b in baselines]
    ref = baselines[0]  # the same seed as the candidate
    ratios = {
        name: {
            "what": what,
            **cost_ratio(
                _cost_value(cs, name),
                [_cost_value(b, name) for b in bs],
                better=better,
                multiple=spread_multiple,
            ),
        }
        for name, what, better, _ in COST_RATIOS
    }
    checks = []
    th = thresholds_of(acceptance)
    for name, _, better, threshold in COST_RATIOS:
        if threshold in th:
            r = ratios[name]
            checks.append(
                _check(
                    threshold,
                    r["ratio"],
                    th[threshold],
                    ">=" if better == "higher" else "<=",
                    half_width=r["half_width"],
                    spread=r["spread"],
                )
            )
    bands = {}
    for key, name in (("loss", "loss_tolerance"), ("grad_norm", "grad_norm_tolerance")):
        if name not in th:
            continue
        band = band_check(cand.series(key), ref.series(key), noise_floor(baselines, key), th[name])
        bands[key] = band
        extra = {k: band[k] for k in ("worst_step", "max_abs_diff", "first_step_outside", "steps_checked")}
        checks.append(_check(name, band["measured"], 1.0, "<=", tolerance=th[name], **extra))
    if "eval_loss_ratio_max" in th:
        # at the last step both evaluated (the runs' final evals may lie at different steps)
        ce, re_ = cand.series("eval_loss"), ref.series("eval_loss")
        at = max(set(ce) & set(re_), default=None)
        checks.append(
            _check(
                "eval_loss_ratio_max",
                _ratio(ce[at], re_[at]) if at is not None else None,
                th["eval_loss_ratio_max"],
                "<=",
                eval_step=at,
            )
        )
    scaling_eff = None
    if scaling is not None:
        one = stats[scaling.name]["tokens_per_s"]
        scaling_eff = _ratio(cs["tokens_per_s"], one * cand.world) if one else None
    return {
        "verdict": verdict_of([c["outcome"] for c in checks]),
        "claim": claim_sentence(
            acceptance, cand.manifest.get("layout") or {}, cand.world, ref.manifest.get("layout") or {}
        ),
        "checks": checks,
        "cost_ratios": ratios,
        "ratio_spread_multiple": spread_multiple,
        "first_divergent_step": {k: b["first_step_outside"] for k, b in bands.items()},
        "bands": bands,
        "noise_floor": {k: noise_floor(baselines, k) for k in ("loss", "grad_norm") if len(baselines) >= 2},
        "scaling_efficiency": scaling_eff,
        "runs": stats,
        "candidate": cand.name,
        "baselines": [b.name for b in baselines],
        "scaling_run": scaling.name if scaling else None,
        "warmup_steps": warmup,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b:
        return None
    return float(a) / float(b)
