"""``tessera compare``: the candidate recipe against the naive data-parallel baseline, under thresholds
registered before the first run starts.

Order: validate both recipes -> write ``preregistration.json`` + its sha256 -> run the baseline with K
seeds, the candidate, and (``--scaling``) the candidate on one rank, one after the other, each a normal
run directory under the comparison directory whose manifest quotes the pre-registration hash -> check
the pre-registration is unchanged -> :func:`tessera.evidence.compare.judge` -> report, verdict, W&B.
Exit code 0 for PASS, 1 for FAIL (or a run that failed), 2 for bad input.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

from tessera.errors import RecipeError, TesseraError
from tessera.evidence.compare import (
    COST_RATIOS,
    RATIO_SPREAD_MULTIPLE,
    RunData,
    check_same_work,
    common_steps,
    judge,
    thresholds_of,
)
from tessera.evidence.registration import claim_comparison_dir, preregister, read_preregistration
from tessera.launch.runs import start_run, validate
from tessera.rundir import RunDir
from tessera.tables.engines import BASELINE_ENGINE

#: layout fields a naive DDP baseline resets (everything but the data-parallel split)
_DDP_BASELINE = {
    "parallel.auto": "false",
    "parallel.engine": BASELINE_ENGINE,
    "parallel.zero": "0",
    "parallel.zero_impl": "auto",
    "parallel.dp": "auto",
    "parallel.tp": "1",
    "parallel.pp": "1",
    "parallel.vpp": "1",
    "parallel.ep": "1",
    "parallel.sequence_parallel": "auto",
    "parallel.offload_optimizer": "false",
    "parallel.offload_params": "false",
    "parallel.deepspeed_config": "null",
    "parallel.grad_accum": "null",
}


def ddp_baseline_overrides(layout: Any) -> list[str]:
    """The same model, data, global batch and ranks under engine ``ddp``: full replicas, dp = world
    size; the micro-batch is the candidate's where it divides the batch, else the largest that does."""
    world, g = layout.world_size, layout.global_batch
    mb = layout.micro_batch
    while g % (mb * world):
        mb -= 1
    if mb < 1:
        raise RecipeError(
            f"a global batch of {g} cannot be split over {world} data-parallel ranks",
            field="parallel.global_batch",
            value=g,
            fix=f"use a global batch divisible by {world} (the baseline is data-parallel over every rank)",
        )
    return [f"{k}={v}" for k, v in _DDP_BASELINE.items()] + [
        f"parallel.global_batch={g}",
        f"parallel.micro_batch={mb}",
    ]


def _model(recipe: Any) -> dict[str, Any]:
    """The model section but the attention kernel (a kernel is a claim the loss band judges)."""
    return recipe.model.model_dump(exclude={"attn_implementation"})


def _same_work(cand: Any, base: Any, cand_layout: Any, base_layout: Any) -> None:
    """A baseline recipe must train the same model, data, batch, steps and devices, or the ratios mean nothing."""
    pairs = [
        ("data", cand.data.model_dump(), base.data.model_dump()),
        ("model", _model(cand), _model(base)),
        ("peft", cand.peft, base.peft),
        ("train.steps", cand.train.steps, base.train.steps),
        ("run.world_size", cand_layout.world_size, base_layout.world_size),
        ("parallel.global_batch", cand_layout.global_batch, base_layout.global_batch),
        ("run.device", cand.run.device, base.run.device),
    ]
    for name, a, b in pairs:
        if a != b:
            raise RecipeError(
                f"the baseline differs from the candidate in {name}: a comparison needs the same work",
                field=name,
                value=b if not isinstance(b, dict) else f"(another {name} section)",
                fix=f"make the baseline's {name} equal the candidate's ({a if not isinstance(a, dict) else f'its {name} section'})",
            )


def _check_thresholds(recipe: Any, seeds: int) -> dict[str, Any]:
    acc = recipe.acceptance.model_dump()
    th = thresholds_of(acc)
    if not th:
        raise RecipeError(
            "the recipe's acceptance section sets no threshold: nothing the runs measure could refute the claim",
            field="acceptance",
            value=None,
            fix="set at least one of throughput_ratio_min, peak_memory_ratio_max, time_to_first_step_ratio_max, "
            "loss_tolerance, grad_norm_tolerance, eval_loss_ratio_max",
        )
    for name in ("loss_tolerance", "grad_norm_tolerance"):
        if (th.get(name) or {}).get("noise_floor_multiple") is not None and seeds < 2:
            raise RecipeError(
                "a noise floor needs at least two baseline seeds",
                field="--seeds",
                value=seeds,
                fix=f"pass --seeds 2 or more, or give acceptance.{name} as rel / abs",
            )
    cost = [t for _, _, _, t in COST_RATIOS if t in th]
    if cost and seeds < 2:
        raise RecipeError(
            f"{', '.join(cost)} {'is' if len(cost) == 1 else 'are'} judged against the baseline's "
            "seed-to-seed spread, which needs at least two baseline runs",
            field="--seeds",
            value=seeds,
            fix="pass --seeds 2 or more (with --runs: two or more baseline runs), or unset "
            + ", ".join(f"acceptance.{t}" for t in cost),
        )
    if "eval_loss_ratio_max" in th and recipe.data.eval.fraction <= 0:
        raise RecipeError(
            "acceptance.eval_loss_ratio_max needs a held-out split",
            field="data.eval.fraction",
            value=recipe.data.eval.fraction,
            fix="set data.eval.fraction (e.g. 0.05), or drop eval_loss_ratio_max",
        )
    return acc


def _stamp() -> str:
    return datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


def _hardware(recipe: Any, device: str) -> dict[str, Any]:
    """The hardware profile the runs' plans were estimated with (the recipe's, else the device's
    default): its name, whether ``tessera plan --calibrate`` fitted it to a machine (only then is the
    planner's step time a prediction of seconds), and its price (the report's cost per 1B tokens)."""
    from tessera.plan.search import hardware_for

    hw = hardware_for(recipe, device=device)
    return {
        "name": hw.name,
        "calibrated": hw.efficiency is not None or bool(hw.engine_efficiency),
        "price_per_device_hour": hw.price_per_device_hour,
    }


def run_comparison(
    recipe_path: str,
    overrides: list[str],
    *,
    baseline: str = BASELINE_ENGINE,
    seeds: int = 2,
    out: str | None = None,
    scaling: bool = False,
) -> int:
    from tessera.config.loader import recipe_hash
    from tessera.evidence.manifest import git_state

    if seeds < 1:
        raise RecipeError("--seeds must be at least 1", field="--seeds", value=seeds, fix="pass --seeds 2")
    resolved, layout, device = validate(recipe_path, overrides)
    recipe = resolved.recipe
    acceptance = _check_thresholds(recipe, seeds)
    if baseline == BASELINE_ENGINE:
        base_path, base_over = recipe_path, [*overrides, *ddp_baseline_overrides(layout)]
    else:
        if not Path(baseline).is_file():
            raise RecipeError(
                f"--baseline is neither '{BASELINE_ENGINE}' nor a recipe file",
                field="--baseline",
                value=baseline,
                fix=f"pass --baseline {BASELINE_ENGINE} or the path of a baseline recipe",
            )
        base_path, base_over = baseline, list(overrides)
    b_resolved, b_layout, _ = validate(base_path, base_over)
    _same_work(recipe, b_resolved.recipe, layout, b_layout)
    out_dir = Path(out or f"runs/compare-{recipe.run.name or Path(recipe_path).stem}-{_stamp()}").resolve()
    seed0 = recipe.train.seed
    plan = [("baseline", base_path, base_over, seed0 + i, f"baseline-seed{seed0 + i}") for i in range(seeds)]
    plan.append(("candidate", recipe_path, list(overrides), seed0, f"candidate-seed{seed0}"))
    if scaling:
        one = ["run.world_size=1", "parallel.dp=auto", "parallel.tp=1", "parallel.pp=1", "parallel.vpp=1"]
        one += ["parallel.ep=1", "parallel.grad_accum=null", f"parallel.global_batch={layout.global_batch}"]
        validate(recipe_path, [*overrides, *one])
        plan.append(("scaling", recipe_path, [*overrides, *one], seed0, "scaling-1rank"))
    git, _ = git_state()
    record = {
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "registered_before_runs": True,
        "acceptance": acceptance,
        "ratio_spread_multiple": RATIO_SPREAD_MULTIPLE,
        "candidate": {"recipe": recipe_path, "overrides": overrides, "recipe_hash": recipe_hash(recipe)},
        "baseline": {
            "kind": BASELINE_ENGINE if baseline == BASELINE_ENGINE else "recipe",
            "recipe": base_path,
            "overrides": base_over,
            "recipe_hash": recipe_hash(b_resolved.recipe),
        },
        "seeds": [seed0 + i for i in range(seeds)],
        "scaling": scaling,
        "runs": [{"role": r, "seed": s, "dir": name} for r, _, _, s, name in plan],
        "git_commit": git["commit"],
    }
    # --out is claimed (created exclusively, locked) for the whole comparison: never another's
    with claim_comparison_dir(out_dir):
        sha = preregister(out_dir, record)
        print(f"pre-registered: {out_dir / 'preregistration.json'} (sha256 {sha})")
        for i, (role, path, over, seed, name) in enumerate(plan, 1):
            print(f"[compare] run {i}/{len(plan)}: {role} seed {seed} -> {out_dir / name}", flush=True)
            rc, _ = start_run(
                path,
                [*over, f"train.seed={seed}", f"run.out_dir={out_dir / name}", f"run.name={name}"],
                launch_record={"preregistration_sha256": sha, "comparison": str(out_dir)},
            )
            if rc != 0:
                print(f"tessera: compare: the {role} run {name} failed (exit code {rc}); no verdict")
                return rc
        runs = [RunData.read(out_dir / n, r) for r, _, _, _, n in plan]
        return _judge_and_report(out_dir, recipe, device, runs)


def compare_existing(runs: list[str], *, acceptance_file: str | None, out: str | None) -> int:
    """``--runs CANDIDATE BASELINE [BASELINE ...]``: judge finished runs; the thresholds come from the
    candidate's recipe or ``acceptance_file``, registered now (the report says: after the runs)."""
    import yaml

    from tessera.config.loader import load_run_recipe, read_config_file, safe_yaml
    from tessera.config.schema import AcceptanceSection
    from tessera.device import resolve_device

    if len(runs) < 2:
        raise TesseraError(
            "--runs needs the candidate and at least one baseline run",
            field="--runs",
            value=" ".join(runs),
            fix="pass --runs CANDIDATE_DIR BASELINE_DIR [BASELINE_DIR ...]",
        )
    paths = [Path(r).resolve() for r in runs]
    for p in paths:
        if not (p / RunDir.RECIPE).is_file():
            raise TesseraError(
                "not a run directory", field="--runs", value=str(p), fix="give directories of `tessera run`s"
            )
    names = [p.name for p in paths]
    if len(set(names)) < len(names):  # the report and verdict.json key every run by its directory name
        twice = next(n for n in names if names.count(n) > 1)
        raise TesseraError(
            f"two of the runs have the directory name {twice!r} (or one run is given twice)",
            field="--runs",
            value=" ".join(str(p) for p in paths if p.name == twice),
            fix="give each run once; copy a run to a directory of another name to compare it",
        )
    roles = [("candidate", paths[0]), *(("baseline", p) for p in paths[1:])]
    read = [RunData.read(p, role) for role, p in roles]
    check_same_work(read[0], read[1:])  # before --out is made: a refusal leaves nothing behind
    recipe = load_run_recipe(RunDir(paths[0]))
    if acceptance_file:
        try:
            raw = safe_yaml(
                read_config_file(acceptance_file, field="--acceptance", what="acceptance"),
                where=acceptance_file,
            )
        except FileNotFoundError:
            raise TesseraError(
                "the acceptance file does not exist",
                field="--acceptance",
                value=acceptance_file,
                fix="give a YAML file of acceptance thresholds",
            ) from None
        except yaml.YAMLError as e:
            raise TesseraError(
                f"cannot read the acceptance file ({e})",
                field="--acceptance",
                value=acceptance_file,
                fix="give a YAML file of acceptance thresholds",
            ) from None
        raw = raw.get("acceptance", raw) if isinstance(raw, dict) else raw
        from tessera.config.loader import validate_recipe

        recipe = validate_recipe({**recipe.to_dict(), "acceptance": raw})
    assert isinstance(recipe.acceptance, AcceptanceSection)
    acceptance = _check_thresholds(recipe, len(paths) - 1)
    out_dir = Path(out or f"runs/compare-{paths[0].name}-{_stamp()}").resolve()
    with claim_comparison_dir(out_dir):
        preregister(
            out_dir,
            {
                "created": datetime.datetime.now().isoformat(timespec="seconds"),
                "registered_before_runs": False,
                "acceptance": acceptance,
                "ratio_spread_multiple": RATIO_SPREAD_MULTIPLE,
                "candidate": {"run": str(paths[0])},
                "baseline": {"kind": "runs", "runs": [str(p) for p in paths[1:]]},
                "seeds": None,
            },
        )
        return _judge_and_report(out_dir, recipe, resolve_device(recipe.run.device), read, check_runs=False)


def _judge_and_report(
    out_dir: Path, recipe: Any, device: str, runs: list[RunData], *, check_runs: bool = True
) -> int:
    from tessera.evidence.report import write_report

    prereg, sha = read_preregistration(out_dir)  # unchanged since before the runs
    if check_runs:
        for r in runs:
            if r.manifest.get("preregistration_sha256") != sha:
                raise TesseraError(
                    f"run {r.name} was not made under this pre-registration",
                    field="preregistration_sha256",
                    value=r.manifest.get("preregistration_sha256"),
                    fix="run the comparison again into a new --out directory",
                )
    check_same_work(next(r for r in runs if r.role == "candidate"), [r for r in runs if r.role == "baseline"])
    runs, unequal = common_steps(runs)  # every statistic from the steps all runs recorded
    cand = next(r for r in runs if r.role == "candidate")
    baselines = [r for r in runs if r.role == "baseline"]
    scaling = next((r for r in runs if r.role == "scaling"), None)
    hardware = _hardware(recipe, device)
    result = judge(
        prereg["acceptance"],
        cand,
        baselines,
        scaling=scaling,
        price_per_device_hour=hardware["price_per_device_hour"],
        # as registered before the runs (a comparison registered before this rule existed: the default)
        spread_multiple=prereg.get("ratio_spread_multiple", RATIO_SPREAD_MULTIPLE),
    )
    result["unequal_length"] = unequal
    result["hardware"] = hardware
    files = write_report(out_dir, prereg, sha, result, runs)
    wandb_dir = _mirror_to_wandb(recipe, out_dir, prereg, sha, result, files, runs)
    _print_verdict(result, out_dir, files, runs, wandb_dir)
    return 0 if result["verdict"] == "PASS" else 1


def _mirror_to_wandb(recipe, out_dir, prereg, sha, result, files, runs) -> str | None:
    from tessera.track.wandb_tracker import log_comparison

    return log_comparison(
        recipe.tracking.wandb,
        out_dir=out_dir,
        config={"preregistration": prereg, "preregistration_sha256": sha},
        summary={
            "verdict": result["verdict"],
            "claim": result["claim"],
            "thresholds": prereg["acceptance"],
            **{f"measured/{c['threshold_name']}": c["measured"] for c in result["checks"]},
            **{f"outcome/{c['threshold_name']}": c["outcome"] for c in result["checks"]},
            **{f"ratio/{k}": r["ratio"] for k, r in result["cost_ratios"].items()},
            **{f"spread/{k}": r["spread"] for k, r in result["cost_ratios"].items()},
            "scaling_efficiency": result["scaling_efficiency"],
        },
        files=files,
        manifests={r.name: r.path / RunDir.MANIFEST for r in runs},
    )


def _print_verdict(result, out_dir: Path, files: list[Path], runs: list[RunData], wandb_dir) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    con.width = max(con.width, 120)  # threshold names whole
    unequal = result.get("unequal_length")
    print(result["claim"], flush=True)  # one line, whatever the terminal's width
    table = Table(title=f"verdict: {result['verdict']}", caption=unequal["note"] if unequal else None)
    for col in ("threshold", "measured ± spread", "threshold value", "outcome", "first step outside"):
        table.add_column(col)
    color = {"holds": "green", "not distinguishable": "yellow"}
    for c in result["checks"]:
        measured = "n/a" if c["measured"] is None else f"{c['measured']:.4g}"
        if c.get("half_width") is not None:
            measured += f" ± {c['half_width']:.2g}"
        table.add_row(
            c["threshold_name"],
            measured,
            f"{c['op']} {c['threshold']:.4g}",
            f"[{color.get(c['outcome'], 'bold red')}]{c['outcome']}[/]",
            str(c.get("first_step_outside") or "-"),
        )
    con.print(table)
    if result["verdict"] == "INCONCLUSIVE":
        close = [c["threshold_name"] for c in result["checks"] if c["outcome"] == "not distinguishable"]
        one = len(close) == 1
        print(
            f"inconclusive: {', '.join(close)} {'lies' if one else 'lie'} within the baseline's seed spread of "
            f"{'its threshold' if one else 'their thresholds'}; more baseline seeds or longer runs narrow the spread"
        )
    if result.get("scaling_efficiency") is not None:
        con.print(f"scaling efficiency against one rank: {result['scaling_efficiency']:.1%}")
    print(f"VERDICT: {result['verdict']}" + (f"  ({unequal['note']})" if unequal else ""))
    print(f"report:       {out_dir / 'report.md'}")
    print(f"verdict:      {out_dir / 'verdict.json'}")
    print(f"plots:        {', '.join(str(f) for f in files if f.suffix == '.png')}")
    for r in runs:
        s = r.summary
        print(f"{r.role:<10}    {r.path}  (checkpoint {s.get('last_checkpoint')}, W&B {s.get('wandb_dir')})")
    if wandb_dir:
        print(f"W&B compare:  {wandb_dir}  (upload with: wandb sync {wandb_dir})")
