"""``tessera plan``: rank the layouts of a recipe's model (the planner's table, the chosen layout, the
rejected ones with their reasons); ``--measured RUN`` sets the prediction beside what a run measured,
``--calibrate RUN...`` fits a hardware profile to runs. The command's side of :mod:`tessera.plan`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tessera.errors import RecipeError


def _console():
    from rich.console import Console

    return Console()


def plan_target(args: argparse.Namespace) -> tuple[Any, int, str]:
    """The recipe ``tessera plan`` is asked about, its world size and device."""
    from tessera.config.loader import load_recipe
    from tessera.device import resolve_device

    if args.recipe is None:
        raise RecipeError(
            "which recipe?", field="recipe", value=None, fix="tessera plan R.yaml [--measured RUN_DIR]"
        )
    recipe = load_recipe(args.recipe, args.overrides).recipe
    ws = args.world_size or recipe.run.world_size
    if ws < 1:
        raise RecipeError(
            "world size must be >= 1", field="--world-size", value=ws, fix="pass a positive count"
        )
    # planning needs no device: a cuda recipe is planned on its GPU profile from any machine
    return recipe, ws, recipe.run.device if recipe.run.device != "auto" else resolve_device("auto")


def cmd_plan(args: argparse.Namespace) -> int:
    from rich.table import Table

    from tessera.plan.hardware import load_hardware
    from tessera.plan.probe import find_probe
    from tessera.plan.search import DEFAULT_HARDWARE, check_recipe_layout, plan_recipe
    from tessera.plan.table import cells, columns_for

    if args.calibrate:
        return _plan_calibrate(args)
    recipe, ws, device = plan_target(args)
    probed = find_probe(device, ws)
    hw_name = args.hardware or recipe.run.hardware or probed or DEFAULT_HARDWARE[device]
    hw = load_hardware(hw_name)
    if not (args.hardware or recipe.run.hardware or probed or args.json):
        _console().print(
            f"[dim]hardware: the stock profile {hw.name} (datasheet figures, not this machine's); "
            f"`tessera plan {args.recipe} --probe` measures this machine in ~30 s[/]",
            highlight=False,
            soft_wrap=True,
        )
    if args.measured:
        return _plan_measured(args, hw)
    result = plan_recipe(recipe, world_size=ws, hardware=hw)
    if not recipe.parallel.auto:
        result.recipe_layout = check_recipe_layout(recipe, hardware=hw, world_size=ws)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
        return 0
    con = _console()
    con.width = max(con.width, 160)
    m = result.model
    con.print(
        f"[bold]model[/]   {m['family']}: {m['parameters']:,} parameters (counted on {m['counted_on']})",
        highlight=False,
    )
    if m.get("adapter_parameters"):
        a, peft = m["adapter_parameters"], recipe.peft
        con.print(
            f"[bold]adapters[/] {peft.method} r={peft.r} on {', '.join(peft.target_modules)}: {a:,} trained "
            f"parameters ({100 * a / m['parameters']:.2f} %); the base's {m['parameters']:,} frozen "
            "(parameters only: no gradients, no optimizer state)",
            highlight=False,
        )
    for what in m["generic_estimates"]:
        con.print(f"  generic formula: {what}", highlight=False)
    table = Table(title=f"{args.recipe} on {ws} x {hw.name} ({len(result.candidates)} layouts fit)")
    shown = result.candidates[: args.top]
    columns = columns_for(shown)
    for col in columns:  # headers and cells from the one list: they cannot drift apart
        table.add_column(col.header, justify=col.justify)
    for i, c in enumerate(shown):
        table.add_row(*cells(i, c, columns), style="bold green" if i == 0 else None)
    con.print(table)
    if result.chosen is None:
        con.print("[bold red]nothing fits[/]")
    else:
        con.print(f"[bold]chosen[/]  {result.chosen.layout.describe()}", soft_wrap=True)
    own = result.recipe_layout
    if own is not None:
        style = "bold green" if own.fits else "bold red"
        con.print(f"[{style}]recipe[/]  {own.message(result.chosen)}", soft_wrap=True, highlight=False)
    if result.rejected:
        con.print(f"[bold]rejected[/] {len(result.rejected)} layouts, e.g.:")
    seen: set[str] = set()
    for r in result.rejected:
        head = r.reason.split(":")[0]
        if head in seen:
            continue
        seen.add(head)
        lay = r.layout
        con.print(
            f"  {lay.get('engine')} dp={lay.get('dp')} tp={lay.get('tp')} pp={lay.get('pp')} "
            f"ep={lay.get('ep')} zero={lay.get('zero')}"
            + (f" recompute={lay['recompute']}" if lay.get("recompute", "none") != "none" else "")
            + f": {r.reason}",
            soft_wrap=True,
        )
    return 0


def _plan_measured(args: argparse.Namespace, hw: Any) -> int:
    """Predicted against measured per term and per collective, for the layout the run ran."""
    from rich.table import Table

    from tessera.plan.measured import TERMS, compare_to_run

    cmp = compare_to_run(Path(args.measured), hw)
    if args.json:
        print(json.dumps(cmp, indent=2))
        return 0
    con = _console()
    con.width = max(con.width, 110)
    table = Table(title=f"{cmp['layout']} on {hw.name}: planner vs {args.measured} (median of steady steps)")
    for col in ("term", "predicted ms", "measured ms", "measured / predicted"):
        table.add_column(col, justify="left" if col == "term" else "right")
    for k in TERMS:
        p, m = cmp["terms"][k]["predicted_s"], cmp["terms"][k]["measured_s"]
        ratio = f"{m / p:.2f}" if m is not None and p else "-"
        table.add_row(k, f"{p * 1e3:.2f}", "not measured apart" if m is None else f"{m * 1e3:.2f}", ratio)
    con.print(table)
    ops = Table(title="collectives per step: α + n·β against the counted calls (rank 0)")
    for col in ("op:group", "messages pred.", "calls meas.", "MB pred.", "MB meas.", "ms pred.", "ms meas."):
        ops.add_column(col, justify="left" if col == "op:group" else "right")
    pred, meas = cmp["ops"]["predicted"], cmp["ops"]["measured"]
    zero = {"calls": 0.0, "bytes": 0.0, "seconds": 0.0}
    for key in sorted(set(pred) | set(meas)):
        p, m = pred.get(key, zero), meas.get(key, zero)
        ops.add_row(
            key,
            f"{p['calls']:g}",
            f"{m['calls']:g}",
            f"{p['bytes'] / 1e6:.3f}",
            f"{m['bytes'] / 1e6:.3f}",
            f"{p['seconds'] * 1e3:.2f}",
            f"{m['seconds'] * 1e3:.2f}",
        )
    con.print(ops)
    con.print(
        "compute = step - counted collectives - optimizer step (framework time and pipeline waits outside "
        "collectives included); the bubble is not measured apart."
    )
    return 0


def _plan_calibrate(args: argparse.Namespace) -> int:
    from tessera.plan.hardware import load_hardware
    from tessera.plan.measured import calibrate, write_profile

    if not args.hardware:
        raise RecipeError(
            "--calibrate fits a profile: which one?",
            field="--hardware",
            value=None,
            fix="tessera plan --calibrate RUN_DIR... --hardware cpu-2core",
        )
    base = load_hardware(args.hardware)
    runs = [Path(args.recipe)] if args.recipe else []
    runs += [Path(r) for r in args.calibrate]
    fitted, report = calibrate(runs, base)
    out = Path(args.out or f"{fitted.name}.yaml")
    write_profile(fitted, out, report)
    print(
        f"{fitted.name}: latency {fitted.latency_s * 1e6:.1f} us per message"
        + (
            f" ({fitted.tp_latency_s * 1e6:.1f} us per TP / EP message)"
            if fitted.tp_latency_s is not None
            else ""
        )
        + ", "
        f"{fitted.intra_node_bandwidth / 1e9:.2f} GB/s, efficiency "
        + ", ".join(f"{e} {v:.3f}" for e, v in (fitted.engine_efficiency or {}).items())
        + ", "
        f"optimizer bandwidth {fitted.hbm_bandwidth / 1e9:.2f} GB/s, from {report['messages_fitted']} "
        f"collective calls of {len(runs)} run(s) -> {out}"
    )
    return 0
