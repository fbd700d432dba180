"""The comparison's report: ``verdict.json``, ``report.md`` and its PNGs, written into the comparison
directory from :func:`tessera.evidence.compare.judge`'s result."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tessera.atomic import atomic_file, write_text_atomic
from tessera.evidence.compare import RunData, timed
from tessera.evidence.registration import REPORT, VERDICT

PLOTS = ("loss.png", "grad_norm.png", "step_time.png", "memory.png", "comm_fraction.png", "where.png")
FLOPS_NOTE = (
    "MFU = model FLOPs per step / (step time x peak FLOP/s x ranks); model FLOPs per token = "
    "6*N + 12*L*H*Q*T (PaLM, Chowdhery et al. 2022, App. B; N without input embeddings), x tokens per step"
)


def write_report(
    out: Path, prereg: dict[str, Any], sha: str, result: dict[str, Any], runs: list[RunData]
) -> list[Path]:
    """verdict.json, the PNGs and report.md; returns the files written."""
    verdict = {
        "verdict": result["verdict"],
        "preregistration_sha256": sha,
        "thresholds": prereg["acceptance"],
        **{k: v for k, v in result.items() if k not in ("bands", "noise_floor")},
    }
    write_text_atomic(out / VERDICT, json.dumps(verdict, indent=2, sort_keys=True, default=str) + "\n")
    pngs = plot_comparison(out, result, runs)
    write_text_atomic(out / REPORT, render_markdown(prereg, sha, result, pngs))
    return [out / VERDICT, out / REPORT, *pngs]


def _fmt(v: Any, spec: str = ".4g") -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def cost_unit(hardware: dict[str, Any] | None) -> str:
    """The unit of "cost per 1B tokens": the currency of the hardware profile's price, named with it."""
    hw = hardware or {}
    if not hw.get("price_per_device_hour"):
        return "n/a: the hardware profile has no price_per_device_hour"
    return (
        f"price units per 1B tokens, at {hw['price_per_device_hour']:g} per device-hour "
        f"(price_per_device_hour of hardware profile {hw['name']}, in the currency it is written in)"
    )


#: the unit each cost ratio's quantity is shown in: (scale, unit)
_COST_UNITS = {
    "step_time_p50": (1e3, "ms"),
    "throughput": (1.0, "tokens/s"),
    "cost_per_1b_tokens": (1.0, "price units"),
    "peak_memory": (2.0**-20, "MiB"),
    "time_to_first_step": (1.0, "s"),
}


def render_markdown(prereg: dict[str, Any], sha: str, result: dict[str, Any], pngs: list[Path]) -> str:
    runs = result["runs"]
    cand = result["candidate"]
    k = result.get("ratio_spread_multiple", 1.0)
    lines = [
        f"# Comparison: {cand} against {', '.join(result['baselines'])}",
        "",
        f"**{result['claim']}**",
        "",
        f"**Verdict: {result['verdict']}**",
        "",
        *([f"Note: {result['unequal_length']['note']}.", ""] if result.get("unequal_length") else []),
        f"Pre-registration: `preregistration.json`, sha256 `{sha}`"
        + ("" if prereg.get("registered_before_runs", True) else " (registered after the runs existed)"),
        "",
        f"| threshold | measured | ± {k:g} x seed spread | threshold | outcome | refutes the claim |",
        "|---|---|---|---|---|---|",
    ]
    for c in result["checks"]:
        extra = ""
        if c.get("first_step_outside") is not None:
            extra = f" (first step outside: {c['first_step_outside']})"
        elif "worst_step" in c:
            extra = (
                f" (largest share at step {c['worst_step']}; max abs diff {_fmt(c['max_abs_diff'], '.3g')})"
            )
        half = c.get("half_width")
        lines.append(
            f"| {c['threshold_name']} | {_fmt(c['measured'])}{extra} | "
            f"{'-' if half is None else _fmt(half, '.3g')} | {c['op']} {_fmt(c['threshold'])} | "
            f"{c['outcome']} | {'yes' if c['refutes_claim'] else 'no'} |"
        )
    lines += [
        "",
        f"Timing leaves out the first {result['warmup_steps']} steps. Loss and grad-norm checks measure the "
        "largest |candidate - baseline| as a share of the band (<= 1 holds) against the same-seed baseline. "
        f"A cost ratio is judged against the baseline's seed spread (± {k:g} x the standard deviation, ddof 1, "
        "of the baseline runs' values over their mean, fixed in the pre-registration): it holds when the "
        "whole interval ratio ± spread meets the threshold, is refuted when none of it does, and is not "
        "distinguishable when the threshold lies inside it. PASS: every check holds; FAIL: one is refuted; "
        "INCONCLUSIVE: none is refuted, but one is not distinguishable.",
        "",
        "## Cost ratios and their seed spread",
        "",
        "Candidate / the mean of the baseline seeds. The baseline seeds' own ratios to their mean show how "
        "far two runs of the same recipe differ here; an effect is a win or a loss only where "
        f"|ratio - 1| exceeds {k:g} x the spread.",
        "",
        "| quantity | candidate | baseline mean (seeds) | ratio | baseline seeds / their mean | seed spread "
        "| effect |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in result["cost_ratios"].items():
        scale, unit = _COST_UNITS[name]
        vals = ", ".join(_fmt(v * scale, ".4g") for v in r["baseline_values"])
        own = ", ".join(_fmt(v, ".3f") for v in r["baseline_ratios"])
        cand_v = None if r["candidate"] is None else r["candidate"] * scale
        base_v = None if r["baseline_mean"] is None else r["baseline_mean"] * scale
        lines.append(
            f"| {r['what']} ({unit}) | {_fmt(cand_v, '.4g')} | {_fmt(base_v, '.4g')} ({vals or 'n/a'}) "
            f"| {_fmt(r['ratio'], '.4f')} | {own or 'n/a'} | {_fmt(r['spread'], '.3g')} | {r['effect']} |"
        )
    lines += [
        "",
        f"Cost per 1B tokens: {cost_unit(result.get('hardware'))}.",
        "",
        "## Runs",
        "",
        "| run | role | seed | engine | step time p50 / p95 / p99 / max (ms) | tokens/s | time to first step (s) "
        "| peak memory per rank (MiB) | final loss | final eval loss |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in runs.items():
        st = s["step_time_s"] or {}
        pct = " / ".join(_fmt(st.get(k, 0) * 1e3, ".1f") for k in ("p50", "p95", "p99", "max"))
        mem = ", ".join(f"{m / 2**20:.0f}" for m in s["peak_memory_bytes_per_rank"])
        lines.append(
            f"| {name} | {s['role']} | {s['seed']} | {s['engine']} | {pct} | {_fmt(s['tokens_per_s'], '.0f')} "
            f"| {_fmt(s['time_to_first_step_s'], '.1f')} | {mem} | {_fmt(s['final_loss'])} "
            f"| {_fmt(s['final_eval_loss'])} |"
        )
    lines += [
        "",
        "## Where the compute went",
        "",
        "Share of each timed step's wall time (data loading + step). Communication is the time in counted "
        "collectives (torch DDP's all-reduce runs in flight during backward: for the baseline it is an upper "
        "bound of the exposed part); optimizer excludes its own collectives; compute is the rest.",
        "",
        "| run | compute | communication | optimizer | data | comm bytes / step (measured / planned) "
        "| comm fraction p50 (measured / planned) | MFU p50 | tokens per device-hour "
        "| cost per 1B tokens (price units) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in runs.items():
        w = s["where_the_time_went"]
        cf = s["comm_fraction"] or {}
        lines.append(
            f"| {name} | {w['compute']:.1%} | {w['comm']:.1%} | {w['optimizer']:.1%} | {w['data']:.1%} "
            f"| {_fmt(s['comm_bytes_per_step'], '.4g')} / {_fmt(s['planned_comm_bytes_per_step'], '.4g')} "
            f"| {_fmt(cf.get('p50'), '.3f')} / {_fmt(s['planned_comm_fraction'], '.3f')} "
            f"| {_fmt((s['mfu'] or {}).get('p50'), '.3f')} | {_fmt(s['tokens_per_device_hour'], '.4g')} "
            f"| {_fmt(s['cost_per_1b_tokens'], '.4g')} |"
        )
    lines += ["", FLOPS_NOTE + "."]
    if result.get("scaling_efficiency") is not None:
        lines += [
            "",
            f"Scaling efficiency of {cand} against the same recipe on one rank ({result['scaling_run']}): "
            f"**{result['scaling_efficiency']:.1%}** (tokens/s at N ranks / (N x tokens/s at one rank)).",
        ]
    lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in pngs]
    lines += [
        "",
        "## Reproduce",
        "",
        "Each run directory holds `manifest.json` (code, config, data, environment, hardware) and "
        "`recipe.resolved.yaml`; `tessera manifest diff RUN_A RUN_B` shows what differs between two.",
        "",
    ]
    return "\n".join(lines)


def plot_comparison(out: Path, result: dict[str, Any], runs: list[RunData]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, MaxNLocator, NullFormatter, ScalarFormatter

    written: list[Path] = []
    cand = next(r for r in runs if r.role == "candidate")
    ref = next(r for r in runs if r.role == "baseline")
    warmup = result["warmup_steps"]

    def save(fig: Any, name: str, note: str | None = None) -> None:
        """``note``: what the plot says beside its data, also the PNG's Description (a reader can check it)."""
        fig.tight_layout()
        try:  # savefig to a path would follow a link there: the bytes go to a temporary, renamed over it
            with atomic_file(out / name) as f:
                fig.savefig(f, format="png", dpi=110, metadata={"Description": note} if note else None)
        finally:
            plt.close(fig)
        written.append(out / name)

    blues = iter(["#1f5fa8", "#5b9bd5", "#9dc3e6", "#2e8bc0", "#b4d4ee"])
    colors = {
        r.name: "C3" if r.role == "candidate" else "C2" if r.role == "scaling" else next(blues) for r in runs
    }

    def style(r: RunData) -> dict[str, Any]:
        if r.role == "candidate":
            return {"color": colors[r.name], "linewidth": 1.6, "label": f"candidate {r.name}", "zorder": 3}
        label = f"1 rank {r.name}" if r.role == "scaling" else f"baseline {r.name}"
        return {"color": colors[r.name], "linewidth": 1.0, "alpha": 0.85, "label": label}

    for key, name, unit in (
        ("loss", "loss.png", "loss (nats per token)"),
        ("grad_norm", "grad_norm.png", "grad norm (pre-clip)"),
    ):
        fig, (ax, dax) = plt.subplots(2, 1, figsize=(7, 7), sharex=True, height_ratios=[3, 2])
        for r in runs:
            s = r.series(key)
            if s:
                ax.plot(list(s), list(s.values()), **style(r))
        evals = cand.series("eval_loss") if key == "loss" else {}
        if evals:
            ax.plot(
                list(evals), list(evals.values()), "s", color="C3", markersize=5, label="candidate eval loss"
            )
            revals = ref.series("eval_loss")
            ax.plot(
                list(revals),
                list(revals.values()),
                "o",
                mfc="none",
                color=colors[ref.name],
                label="baseline eval loss",
            )
        # below, on a log scale: |candidate - same-seed baseline| against the band's half-width, and the
        # seed-to-seed spread of the baseline for scale (a layout change should sit far below it)
        refs, cs = ref.series(key), cand.series(key)
        steps = sorted(set(refs) & set(cs))

        diff_steps, diffs = _absdiff(cs, refs)
        dax.plot(diff_steps, diffs, color="C3", linewidth=1.2, marker=".", label=f"|candidate - {ref.name}|")
        # a log axis has no zero: say how many steps are missing from the line (all of them when the
        # candidate matches the baseline exactly, which would otherwise read as "no data")
        zeros = len(steps) - len(diff_steps)
        zero_note = (
            f"zero differences are not drawn on this log axis: |candidate - {ref.name}| = 0 at {zeros} of "
            f"{len(steps)} steps" + (" (identical curves)" if steps and not diff_steps else "")
        )
        dax.set_title(zero_note, fontsize=8)
        band = result.get("bands", {}).get(key)
        if band and band["width"]:
            bs = [s for s in steps if s in band["width"]]
            dax.fill_between(
                bs,
                0,
                [band["width"][s] for s in bs],
                color="C0",
                alpha=0.2,
                label="tolerance band (half-width)",
            )
            first = band["first_step_outside"]
            if first is not None:
                for a in (ax, dax):
                    a.axvline(
                        first,
                        color="k",
                        linestyle=":",
                        label=f"first step outside: {first}" if a is dax else None,
                    )
        for b in (r for r in runs if r.role == "baseline" and r is not ref):
            dax.plot(
                *_absdiff(b.series(key), refs),
                color=colors[b.name],
                linewidth=0.8,
                alpha=0.8,
                label=f"|{b.name} - {ref.name}| (seed spread)",
            )
        dax.set_yscale("log")
        dax.set_ylabel(f"|difference| ({key.replace('_', ' ')})")
        dax.set_xlabel("step")
        dax.xaxis.set_major_locator(MaxNLocator(integer=True))
        dax.grid(alpha=0.3, which="both")
        # below the panel: inside, it covers the band or a curve whatever the corner
        dax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncols=2)
        ax.set_ylabel(unit)
        ax.set_title(f"{key.replace('_', ' ')}: candidate against the baseline seeds")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        save(fig, name, zero_note)

    fig, ax = plt.subplots(figsize=(7, 4.6))
    times = {r.name: [x["step_time_s"] * 1e3 for x in timed(r, warmup)] for r in runs}
    planned = cand.plan.get("step_time_s")
    # one set of bins for every run (and the planner's line), so the bars compare; geometric on a log axis,
    # so that one slow step (a checkpoint, a neighbour's burst) does not squeeze the rest into one bin
    every = [t for ts in times.values() for t in ts if t > 0] + ([planned * 1e3] if planned else [])
    edges = np.geomspace(min(every) * 0.95, max(every) * 1.05, 41) if every else 40
    for r in runs:
        p50 = (result["runs"][r.name]["step_time_s"] or {}).get("p50")
        ax.hist(
            times[r.name],
            bins=edges,
            alpha=0.5,
            color=style(r)["color"],
            label=f"{r.name} (p50 {_fmt(p50 * 1e3 if p50 is not None else None, '.1f')} ms)",
        )
    hw = result.get("hardware") or {}
    uncalibrated = bool(planned) and hw.get("calibrated") is False
    if planned:
        profile = (
            f"{'uncalibrated' if uncalibrated else 'calibrated'} profile {hw['name']}" if hw else "profile"
        )
        ax.axvline(
            planned * 1e3,
            color="C3",
            linestyle="--",
            label=f"planner, candidate: {planned * 1e3:.1f} ms ({profile})",
        )
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("step time (ms, log scale)")
    ax.set_ylabel("steps")
    title = f"step-time distribution (first {warmup} steps left out)"
    planner_note = None
    if uncalibrated:  # datasheet figures rank layouts; they do not predict this machine's seconds
        planner_note = (
            f"planner's line: from the uncalibrated hardware profile {hw['name']} (datasheet figures, "
            "not\nthis machine's: `tessera plan --calibrate` fits the profile to runs here)"
        )
        title += "\n" + planner_note
    ax.set_title(title, fontsize=9 if uncalibrated else None)
    # below the axes: inside, it would sit on the tallest bars
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=2)
    save(fig, "step_time.png", planner_note)

    fig, ax = plt.subplots(figsize=(8.5, 4))
    width = 0.8 / len(runs)
    for i, r in enumerate(runs):
        mib = [m / 2**20 for m in (r.summary.get("peak_memory_bytes_per_rank") or [])]
        ax.bar(
            [k + i * width for k in range(len(mib))],
            mib,
            width=width,
            color=style(r)["color"],
            alpha=0.4 + 0.6 * (r.role == "candidate"),
            label=r.name,
        )
    ranks = max(r.world for r in runs)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(ranks)], [str(k) for k in range(ranks)])
    ax.set_xlabel("rank")
    ax.set_ylabel("peak memory (MiB)")
    ax.set_title("peak memory per rank (CPU: process RSS; GPU: allocated)")
    # outside the axes, right: inside it sits on top of the tallest bars whatever the corner
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    save(fig, "memory.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        s = r.series("comm_fraction")
        ax.plot(list(s), [v * 100 for v in s.values()], **style(r))
        stats = result["runs"][r.name]
        if stats.get("planned_comm_fraction") is not None:
            ax.axhline(
                stats["planned_comm_fraction"] * 100,
                color=style(r)["color"],
                linestyle="--",
                linewidth=1,
                label=f"planner: {r.name}",
            )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("communication (% of step time)")
    ax.set_title("communication time per step against the planner's prediction")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save(fig, "comm_fraction.png")

    fig, ax = plt.subplots(figsize=(7, 1.8 + 0.5 * len(runs)))
    parts = ("compute", "comm", "optimizer", "data")
    names = [r.name for r in runs]
    left = [0.0] * len(runs)
    for j, part in enumerate(parts):
        vals = [result["runs"][n]["where_the_time_went"][part] * 100 for n in names]
        ax.barh(names, vals, left=left, color=f"C{j}", label=part)
        left = [a + b for a, b in zip(left, vals)]
    ax.set_xlabel("share of step wall time (%)")
    ax.set_title("where the compute went (timed steps)")
    ax.set_xlim(0, 100)
    ax.legend(fontsize=7, ncols=4, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    save(fig, "where.png")
    return written


def _absdiff(other: dict[int, float], ref: dict[int, float]) -> tuple[list[int], list[float]]:
    """Steps and |other - ref| where they differ (a log axis has no zero)."""
    pts = [(s, abs(other[s] - ref[s])) for s in sorted(set(other) & set(ref)) if other[s] != ref[s]]
    return [p[0] for p in pts], [p[1] for p in pts]
