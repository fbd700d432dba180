"""The ``tessera`` command.

    tessera run R.yaml [key=value ...] [--resume [--same-layout] [--strict] [--accept-data-change]] [--dry-run]
                [--node-rank K [--nnodes N] [--rdzv-endpoint HOST:PORT]]
    tessera slurm R.yaml [key=value ...] --nodes N [--partition P] [--time T] [...] [--dry-run]
    tessera compare R.yaml [key=value ...] [--baseline ddp|B.yaml] [--seeds K] [--scaling] [--out DIR]
    tessera compare --runs CANDIDATE BASELINE [...] [--acceptance FILE] [--out DIR]
    tessera plan R.yaml [key=value ...] --world-size N [--hardware X] [--json]
    tessera plan R.yaml --probe [--out FILE]
    tessera convert SRC --to hf|peft|deepspeed|megatron|ddp [--merge] [--layout k=v,...] [--recipe R.yaml] --out DIR
                    [--dtype fp32|bf16] [--no-verify] [--prompts N]
    tessera verify A B [--prompts N] [--json]
    tessera manifest show RUN | tessera manifest diff RUN_A RUN_B [--json]
    tessera config show R.yaml [key=value ...]
    tessera data prepare SRC... --tokenizer T --out DIR [--workers N] [--text-field F] [--format F]

Overrides (``key=value``) may stand before or after the flags. ``run --dry-run`` makes every check a
launch makes (the data too: the first records of each file, read as the ranks read them), then prints
the ``tessera run`` line to copy and the launcher command that line will start.

User mistakes (recipe, override, layout, data, checkpoint) exit with code 2 and a short message that
names the field, the value and the fix; no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tessera.errors import RecipeError, TesseraError
from tessera.launch.runs import start_run
from tessera.rundir import ExitCode, RunDir


def _console():
    from rich.console import Console

    return Console()


def cmd_run(args: argparse.Namespace) -> int:
    if args.verbose:
        import os

        from tessera.launch.launcher import VERBOSE_ENV

        os.environ[VERBOSE_ENV] = "1"
    rc, rd = start_run(
        args.recipe,
        args.overrides,
        resume=args.resume,
        same_layout=args.same_layout,
        strict=args.strict,
        dry_run=args.dry_run,
        resume_from=args.resume_from,
        accept_data_change=args.accept_data_change,
        node_rank=args.node_rank,
        nnodes=args.nnodes,
        rdzv_endpoint=args.rdzv_endpoint,
    )
    if rc != 0 or args.dry_run or rd is None:  # rd None: another node than 0, which reports the run
        return rc
    s = rd.read_json_if_present(RunDir.SUMMARY)
    if s is not None:
        _console().print(f"[bold green]done[/]  final loss {s['final_loss']:.4f}")
        # plain prints: paths must stay copy-pasteable (rich would wrap them)
        print(f"run dir:          {s['run_dir']}")
        print(f"last checkpoint:  {s['last_checkpoint']}")
        print(f"W&B offline run:  {s['wandb_dir'] or 'none (tracking.wandb.mode: disabled)'}")
        if s.get("wandb_dir"):
            print(f"                  (upload with: wandb sync {s['wandb_dir']})")
        print(f"plots:            {', '.join(s['plots'])}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from tessera.launch.compare import compare_existing, run_comparison

    if args.runs:
        if args.recipe or args.overrides:
            raise TesseraError(
                "--runs compares finished runs; a recipe would start new ones",
                field="--runs",
                value=" ".join(args.runs),
                fix="drop the recipe, or drop --runs",
            )
        return compare_existing(args.runs, acceptance_file=args.acceptance, out=args.out)
    if not args.recipe:
        raise TesseraError(
            "compare needs a recipe or --runs", field="recipe", value=None, fix="tessera compare R.yaml"
        )
    if args.acceptance:
        raise TesseraError(
            "--acceptance only applies to --runs (a new comparison registers the recipe's acceptance section)",
            field="--acceptance",
            value=args.acceptance,
            fix="put the thresholds in the recipe's acceptance section, or pass them as overrides",
        )
    return run_comparison(
        args.recipe,
        args.overrides,
        baseline=args.baseline,
        seeds=args.seeds,
        out=args.out,
        scaling=args.scaling,
    )


def cmd_plan(args: argparse.Namespace) -> int:
    if args.probe and not args.calibrate:  # starts ranks and engines: the launch side
        from tessera.launch.probe import cmd_probe

        return cmd_probe(args)
    from tessera.plan.command import cmd_plan as plan

    return plan(args)


def cmd_convert(args: argparse.Namespace) -> int:
    from tessera.checkpoint.convert import convert_to_hf
    from tessera.tables.engines import ENGINE_NAMES

    if args.merge and args.to != "hf":
        raise RecipeError(
            "--merge writes an HF directory (the adapters merged into the base)",
            field="--merge",
            value=True,
            fix="use --to hf --merge, or drop --merge",
        )
    if args.to not in ("hf", "peft"):
        return _convert_to_layout(args)
    if args.layout or args.recipe:
        raise RecipeError(
            f"--layout and --recipe describe an engine checkpoint; an {args.to} directory has neither",
            field="--layout" if args.layout else "--recipe",
            value=args.layout or args.recipe,
            fix="drop it, or convert --to " + " | ".join(ENGINE_NAMES),
        )
    if args.to == "peft":
        return _convert_to_peft(args)
    rec = convert_to_hf(
        Path(args.src),
        Path(args.out),
        dtype=args.dtype or "fp32",
        verify=not args.no_verify,
        prompts=args.prompts,
        merge=args.merge,
    )
    print(
        f"converted {rec['source']} (step {rec['step']}, {rec['sharding']}) -> {args.out}: {rec['tensors']} tensors"
    )
    print(f"tokenizer: {rec['tokenizer'] or 'none found beside the checkpoint'}")
    if rec.get("token_ids"):  # what generate stops on, as written to config.json and generation_config.json
        print("special tokens: " + ", ".join(f"{k} {v}" for k, v in rec["token_ids"].items()))
    if isinstance(rec["verify"], dict):
        from tessera.checkpoint.verify import render

        render(rec["verify"])
    else:
        print(f"verify: {rec['verify']}")
    return 0


def _convert_to_peft(args: argparse.Namespace) -> int:
    """``--to peft``: the adapters of a LoRA / DoRA checkpoint as a PEFT adapter directory, verified."""
    from tessera.checkpoint.convert import convert_to_peft

    if args.dtype not in (None, "fp32"):
        raise RecipeError(
            "adapters are exported in fp32", field="--dtype", value=args.dtype, fix="drop --dtype"
        )
    rec = convert_to_peft(Path(args.src), Path(args.out), verify=not args.no_verify, prompts=args.prompts)
    base = rec["base"].get("path") or f"the seeded base (seed {rec['base'].get('seed')}; no directory)"
    print(f"converted {rec['source']} (step {rec['step']}, {rec['sharding']}) -> {args.out}: "
          f"{rec['tensors']} adapter tensors ({rec['peft']['method']}, r={rec['peft']['r']}) on {base}")  # fmt: skip
    if isinstance(rec["verify"], dict):
        from tessera.checkpoint.verify import render

        render(rec["verify"])
    else:
        print(f"verify: {rec['verify']}")
    return 0


def _convert_to_layout(args: argparse.Namespace) -> int:
    """``--to deepspeed|megatron|ddp``: the target layout's ranks (on this machine) reshard the source into
    a new run directory's first checkpoint and verify it (:func:`tessera.launch.convert.convert_to_layout`)."""
    from tessera.launch.convert import convert_to_layout

    rc, rec = convert_to_layout(
        Path(args.src),
        Path(args.out),
        to=args.to,
        layout=args.layout,
        recipe=args.recipe,
        dtype=args.dtype,
        verify=not args.no_verify,
    )
    if rec is None:
        return rc
    out = Path(args.out).resolve()
    print(f"converted {rec['source']} -> {out / RunDir.CHECKPOINTS / Path(rec['to']).name}")
    print(f"resume it with:  tessera run {out / RunDir.RECIPE} --resume")
    if isinstance(rec["verify"], dict):
        from tessera.checkpoint.verify import render

        render(rec["verify"])
        return 0 if rec["verify"]["ok"] else 1
    print(f"verify: {rec['verify']}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from tessera.checkpoint.verify import compare, open_side, render

    report = compare(open_side(Path(args.a)), open_side(Path(args.b)), prompts=args.prompts)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        render(report)
    return 0 if report["ok"] else 1


def _read_manifest(path: str) -> dict[str, Any]:
    p = Path(path)
    f = p / RunDir.MANIFEST if p.is_dir() else p
    try:
        return json.loads(f.read_text())
    except FileNotFoundError:
        raise TesseraError(
            "no manifest.json there", field="RUN", value=str(p), fix="give a run directory or a checkpoint"
        ) from None
    except json.JSONDecodeError as e:
        raise TesseraError(
            f"manifest.json is not JSON ({e})", field="RUN", value=str(f), fix="restore it"
        ) from None


def cmd_data_prepare(args: argparse.Namespace) -> int:
    """Text sources -> a megatron-core indexed dataset + dataset.json (:mod:`tessera.data.prepare`)."""
    from tessera.data.prepare import prepare_dataset

    rec = prepare_dataset(
        args.sources,
        tokenizer=args.tokenizer,
        out=Path(args.out),
        workers=args.workers,
        text_field=args.text_field,
        fmt=args.format,
        show_progress=sys.stderr.isatty(),
        no_assistant=args.no_assistant,
    )
    if rec.get("up_to_date"):
        print(f"{args.out}: up to date ({rec['documents']:,} documents, {rec['tokens']:,} tokens)")
        return 0
    mb = sum(s["bytes"] for s in rec["sources"]) / 1e6
    skipped = "".join(
        f", {n:,} skipped ({why.replace('_', ' ')})" for why, n in rec.get("skipped", {}).items() if n
    )
    print(
        f"prepared {args.out}: {rec['documents']:,} documents, {rec['tokens']:,} tokens from {mb:,.1f} MB "
        f"in {rec['seconds']:.1f} s ({mb / max(rec['seconds'], 1e-9):,.1f} MB/s, {rec['workers']} workers)"
        + skipped
    )
    return 0


def cmd_manifest_show(args: argparse.Namespace) -> int:
    print(json.dumps(_read_manifest(args.run), indent=2, sort_keys=True))
    return 0


def cmd_manifest_diff(args: argparse.Namespace) -> int:
    """Exit 0 whether or not they differ (a diff is an answer, not a failure)."""
    from tessera.evidence.manifest import grouped_diff, short

    groups = grouped_diff(_read_manifest(args.run_a), _read_manifest(args.run_b))
    if args.json:
        rows = {g: [{"key": k, "a": a, "b": b} for k, a, b in r] for g, r in groups.items()}
        print(json.dumps(rows, default=str))
        return 0
    if not groups:
        print("no differences (volatile keys such as the host and the launch command are left out)")
    for group in ("code", "config", "data", "environment", "hardware", "other"):
        for key, a, b in groups.get(group, []):
            print(f"{group:<11} {key}: {short(a)} -> {short(b)}")
    return 0


def _fmt(v: Any) -> str:
    if isinstance(v, dict):
        return json.dumps(v, sort_keys=True)
    return repr(v) if isinstance(v, str) else str(v)


def cmd_config_show(args: argparse.Namespace) -> int:
    from rich.table import Table

    from tessera.config.loader import flatten, load_recipe
    from tessera.plan.layout import layout_from_recipe

    resolved = load_recipe(args.recipe, args.overrides)
    layout = layout_from_recipe(resolved.recipe)
    flat = flatten(resolved.recipe.to_dict())
    if args.json:
        out = {k: {"value": v, "source": resolved.source_of(k)} for k, v in flat.items()}
        out["derived"] = layout.to_dict()  # type: ignore[assignment]
        print(json.dumps(out, indent=2, default=str))
        return 0
    table = Table(title=f"resolved recipe: {args.recipe}", show_lines=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    table.add_column("set by")
    for k, v in flat.items():
        src = resolved.source_of(k)
        table.add_row(k, _fmt(v), src if src != "default" else "[dim]default[/]")
    for k in ("dp", "grad_accum", "global_batch"):
        table.add_row(
            f"parallel.{k} (derived)",
            str(getattr(layout, k)),
            "[cyan]derived: global_batch = micro_batch x grad_accum x dp[/]",
        )
    con = _console()
    con.width = max(con.width, 140)
    con.print(table)
    return 0


class _IntermixedParser(argparse.ArgumentParser):
    """A verb's parser that takes its positionals (the recipe, the overrides) on either side of its flags:
    ``tessera run R.yaml --dry-run train.steps=3`` (argparse's ``parse_known_intermixed_args``). A parser
    with sub-commands (``manifest``, ``config``) parses as usual: argparse refuses to intermix those."""

    _intermixing = False

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        nested = any(a.nargs in (argparse.PARSER, argparse.REMAINDER) for a in self._get_positional_actions())
        if nested or self._intermixing:  # parse_known_intermixed_args calls back here for its two passes
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


def cmd_slurm(args: argparse.Namespace) -> int:
    from tessera.launch.slurm import slurm_command

    return slurm_command(args)


def build_parser() -> argparse.ArgumentParser:
    from tessera.tables.engines import BASELINE_ENGINE, ENGINE_NAMES

    ap = argparse.ArgumentParser(prog="tessera", description="distributed training recipes for HF models")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_IntermixedParser)
    r = sub.add_parser("run", help="train a recipe on N ranks")
    r.add_argument("recipe")
    r.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.zero=3 optim.lr=3e-4")
    r.add_argument("--resume", action="store_true", help="continue from the run dir's latest checkpoint")
    r.add_argument(
        "--same-layout",
        action="store_true",
        help="with --resume: refuse a checkpoint of another layout instead of resharding it",
    )
    r.add_argument(
        "--strict",
        action="store_true",
        help="with --resume: refuse when code, config, data or environment changed since the checkpoint",
    )
    r.add_argument(
        "--accept-data-change",
        action="store_true",
        help="with --resume: continue although the data or tokenizer hash differs from the checkpoint's",
    )
    r.add_argument(
        "--resume-from",
        default=None,
        metavar="STEP_DIR",
        help="resume from this checkpoint of the run (a checkpoints/step_* dir or its name), not the latest",
    )
    r.add_argument(
        "--dry-run",
        action="store_true",
        help="every check, the data's first records included; print the layout and the commands; start nothing",
    )
    r.add_argument(
        "--verbose", action="store_true", help="launcher INFO lines and library warnings on the console too"
    )
    r.add_argument(
        "--node-rank",
        type=int,
        default=None,
        metavar="K",
        help="multi-node: this node's rank, one `tessera run` per node (deepspeed --no_ssh with run.hostfile, "
        "or torchrun with --nnodes); node 0 supervises. Under SLURM it comes from SLURM_NODEID",
    )
    r.add_argument("--nnodes", type=int, default=None, metavar="N", help="torchrun across nodes: how many")
    r.add_argument(
        "--rdzv-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="torchrun's c10d rendezvous (default run.master_addr:run.master_port)",
    )
    r.set_defaults(fn=cmd_run)
    sl = sub.add_parser("slurm", help="write (and submit) the sbatch script of a multi-node run")
    sl.add_argument("recipe")
    sl.add_argument("overrides", nargs="*", help="dotted overrides, passed to every node's tessera run")
    sl.add_argument(
        "--nodes", type=int, required=True, help="nodes to allocate (run.world_size / nodes each)"
    )
    sl.add_argument("--partition", default=None)
    sl.add_argument("--time", default=None, help="time limit, e.g. 04:00:00")
    sl.add_argument("--account", default=None)
    sl.add_argument("--qos", default=None)
    sl.add_argument(
        "--gpus-per-node", type=int, default=None, help="default: ranks per node on cuda, none on cpu"
    )
    sl.add_argument("--cpus-per-task", type=int, default=None)
    sl.add_argument("--job-name", default=None, help="default run.name or the recipe's file name")
    sl.add_argument("--resume", action="store_true", help="every node's tessera run gets --resume")
    sl.add_argument("--dry-run", action="store_true", help="print the script; write and submit nothing")
    sl.set_defaults(fn=cmd_slurm)
    cp = sub.add_parser(
        "compare", help="the recipe against the naive data-parallel baseline, under pre-registered thresholds"
    )
    cp.add_argument("recipe", nargs="?", default=None)
    cp.add_argument("overrides", nargs="*", help="dotted overrides, applied to candidate and baseline")
    cp.add_argument(
        "--baseline",
        default=BASELINE_ENGINE,
        help=f"'{BASELINE_ENGINE}' (engine {BASELINE_ENGINE}, same ranks) or a baseline recipe",
    )
    cp.add_argument(
        "--seeds",
        type=int,
        default=2,
        help="baseline seeds (the noise floor and the cost ratios' spread need 2 or more)",
    )
    cp.add_argument(
        "--out",
        default=None,
        help="comparison directory: new or empty, never overwritten (default runs/compare-<name>-<time>)",
    )
    cp.add_argument(
        "--scaling", action="store_true", help="also run the recipe on one rank (scaling efficiency)"
    )
    cp.add_argument("--runs", nargs="+", default=None, help="CANDIDATE BASELINE [...]: judge finished runs")
    cp.add_argument("--acceptance", default=None, help="with --runs: a YAML file of acceptance thresholds")
    cp.set_defaults(fn=cmd_compare)
    pl = sub.add_parser("plan", help="rank the layouts of a recipe's model on N devices")
    pl.add_argument("recipe", nargs="?", default=None)
    pl.add_argument("overrides", nargs="*")
    pl.add_argument("--world-size", type=int, default=None, help="devices (default run.world_size)")
    pl.add_argument("--hardware", default=None, help="profile name in configs/hardware/ or a path")
    pl.add_argument("--json", action="store_true", help='{"chosen", "candidates", "rejected"} on stdout')
    pl.add_argument("--top", type=int, default=15, help="rows of the table")
    pl.add_argument(
        "--measured",
        default=None,
        metavar="RUN_DIR",
        help="predicted vs measured per term for a finished run",
    )
    pl.add_argument(
        "--calibrate",
        nargs="+",
        default=None,
        metavar="RUN_DIR",
        help="fit the --hardware profile's latency, bandwidth, efficiency from runs; writes a new profile",
    )
    pl.add_argument(
        "--probe",
        action="store_true",
        help="measure this machine (~30 s: matmul FLOP/s at the model's shapes, memory bandwidth, the "
        "collectives at the world size) and write it as this host's hardware profile",
    )
    pl.add_argument("--out", default=None, help="with --calibrate / --probe: the profile file to write")
    pl.set_defaults(fn=cmd_plan)
    cv = sub.add_parser(
        "convert",
        help="a checkpoint or HF directory to HF or to an engine checkpoint at any layout, verified",
    )
    cv.add_argument(
        "src", help="a checkpoints/step_NNNNNN directory, a run directory (its latest), or an HF directory"
    )
    cv.add_argument(
        "--to",
        required=True,
        choices=["hf", "peft", *ENGINE_NAMES],
        help="target format (peft: a LoRA / DoRA checkpoint's adapters as a PEFT adapter directory)",
    )
    cv.add_argument(
        "--merge", action="store_true", help="with --to hf: merge a checkpoint's adapters into its base"
    )
    cv.add_argument(
        "--layout",
        default=None,
        help="target layout for an engine, e.g. dp=2,zero=3 or tp=2,pp=2,world_size=4",
    )
    cv.add_argument(
        "--recipe", default=None, help="recipe the converted run resumes with (default: the source run's)"
    )
    cv.add_argument("--out", required=True, help="new (or empty) output directory")
    cv.add_argument(
        "--dtype",
        default=None,
        choices=["fp32", "bf16"],
        help="dtype of the written weights (--to hf, default fp32) or the training precision (engines: "
        "default the source run's)",
    )
    cv.add_argument("--no-verify", action="store_true", help="skip `tessera verify` of the output (recorded)")
    cv.add_argument("--prompts", type=int, default=4, help="prompts for the logits check of the verification")
    cv.set_defaults(fn=cmd_convert)
    vf = sub.add_parser("verify", help="compare two models: HF directories or Tessera checkpoints")
    vf.add_argument("a")
    vf.add_argument("b")
    vf.add_argument(
        "--prompts", type=int, default=4, help="fixed prompts for the logits comparison (0: none)"
    )
    vf.add_argument("--json", action="store_true", help="the full report as JSON on stdout")
    vf.set_defaults(fn=cmd_verify)
    mf = sub.add_parser("manifest", help="a run's reproducibility manifest, and what differs between two")
    msub = mf.add_subparsers(dest="manifest_command", required=True)
    ms = msub.add_parser("show", help="the manifest of a run directory (or a checkpoint)")
    ms.add_argument("run")
    ms.set_defaults(fn=cmd_manifest_show)
    md = msub.add_parser("diff", help="differences grouped as code, config, data, environment, hardware")
    md.add_argument("run_a")
    md.add_argument("run_b")
    md.add_argument("--json", action="store_true")
    md.set_defaults(fn=cmd_manifest_diff)
    c = sub.add_parser("config", help="recipe tools")
    csub = c.add_subparsers(dest="config_command", required=True)
    show = csub.add_parser("show", help="the resolved recipe and which layer set each value")
    show.add_argument("recipe")
    show.add_argument("overrides", nargs="*")
    show.add_argument("--json", action="store_true")
    show.set_defaults(fn=cmd_config_show)
    d = sub.add_parser("data", help="data tools")
    dsub = d.add_subparsers(dest="data_command", required=True)
    dp = dsub.add_parser(
        "prepare",
        help="tokenize text sources into a megatron-core indexed dataset (.bin/.idx + dataset.json)",
    )
    dp.add_argument("sources", nargs="+", metavar="SRC", help="text / jsonl / parquet / Arrow files, globs, "
                    "or datasets save_to_disk directories")  # fmt: skip
    dp.add_argument("--tokenizer", required=True, help="a local tokenizer (or model) directory")
    dp.add_argument("--out", required=True, help="the dataset directory to write (atomically)")
    dp.add_argument("--workers", type=int, default=None, help="tokenizing processes (default: all cores)")
    dp.add_argument("--text-field", default="text", help="the field / column holding the text")
    dp.add_argument(
        "--format",
        default="auto",
        choices=["auto", "text", "jsonl", "parquet", "arrow", "chat", "prompt_completion"],
        help="file format (auto: by extension), or rows of chat messages / prompt + completion (with a loss mask)",
    )
    dp.add_argument(
        "--no-assistant",
        default="error",
        choices=["error", "skip"],
        help="a chat row without an assistant turn: refuse it, or skip it (counted in dataset.json)",
    )
    dp.set_defaults(fn=cmd_data_prepare)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except TesseraError as e:
        print(f"tessera: error: {e.render()}", file=sys.stderr)
        return ExitCode.USER_ERROR


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
