"""Starting runs from the command line's side: check a recipe before launch, write its run directory's
recipe and launch record, start the ranks through the launcher and wait (``tessera run``, ``tessera
convert --to ENGINE`` and each run of ``tessera compare`` go through here); rank 0 of a ``tessera run``
launch prepares the rest (:mod:`tessera.train.prepare`)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

from tessera.errors import RecipeError, TesseraError
from tessera.rundir import PREPARE_FLAG, RunDir


def _console():
    from rich.console import Console

    return Console()


def check_recipe(path: str, overrides: list[str], *, here: bool = True):
    """The checks that need no model library (torch, transformers): the recipe's schema and overrides,
    the device, the precision, the engine of a DeepSpeed JSON and the layout's arithmetic (world size,
    batch). ``tessera run`` launches the ranks after these; its rank 0 checks the model
    (:mod:`tessera.train.prepare`). ``here``: False for a run on other machines (``tessera slurm`` on a
    login node without GPUs): ``run.device`` is taken as written, ``auto`` as cuda. Returns (resolved,
    device)."""
    from tessera.config.loader import load_recipe
    from tessera.device import resolve_device
    from tessera.plan.layout import batch_split
    from tessera.tables.engines import ENGINES, engine_hook, engines_with

    resolved = load_recipe(path, overrides)
    recipe = resolved.recipe
    from tessera.data.tokenizer import check_tokenizer_dir

    check_tokenizer_dir(recipe.data, root=Path.cwd())  # a pretrained model.path without its tokenizer
    device = resolve_device(recipe.run.device) if here else recipe.run.device.replace("auto", "cuda")
    if recipe.train.precision == "fp16" and device == "cpu":
        raise RecipeError(
            "fp16 does not exist on the CPU",
            field="train.precision",
            value="fp16",
            fix="use train.precision: bf16 or fp32 on CPU",
        )
    engine = recipe.parallel.engine
    spec = ENGINES[engine]
    if recipe.parallel.deepspeed_config and not spec.caps.runs_deepspeed:
        raise RecipeError(
            f"engine '{engine}' does not run DeepSpeed, so a DeepSpeed JSON would be ignored",
            field="parallel.deepspeed_config",
            value=recipe.parallel.deepspeed_config,
            fix="remove parallel.deepspeed_config, or use parallel.engine: "
            + engines_with(lambda c: c.runs_deepspeed),
        )
    if not recipe.parallel.auto:  # the planner's layout is checked by the planner
        batch_split(recipe)
        if recipe.parallel.deepspeed_config and spec.prelaunch and spec.layout_checks is None:
            # the engine's checks of the user's JSON (the function that merges it on the ranks, which also
            # read the model's hidden size); a layout derived from the model (the engine has layout_checks)
            # needs the model's config, so rank 0 checks that one
            from tessera.plan.layout import layout_from_recipe

            engine_hook(engine, "prelaunch")(
                recipe, layout_from_recipe(recipe), device=device, read_model=False
            )
    return resolved, device


def validate(path: str, overrides: list[str]):
    """Everything about the recipe that can be checked before launch, cheaply (the data files are checked
    where they are read: by ``load_corpus`` on a dry run, by ``prepare_run_dir`` otherwise); returns
    (resolved, layout, device)."""
    from tessera.train.prepare import check_model

    resolved, device = check_recipe(path, overrides)
    return resolved, check_model(resolved, device), device


def run_dir_of(recipe, recipe_path: str) -> Path:
    name = recipe.run.name or Path(recipe_path).stem
    return Path(recipe.run.out_dir) if recipe.run.out_dir else Path("runs") / name


def resume_point(index, run_dir: Path, *, resume: bool, resume_from: str | None, same_layout: bool,
                 strict: bool) -> Path | None:  # fmt: skip
    """Before launch: the checkpoint ``--resume`` reads (it must exist), or for a fresh run a directory
    without checkpoints (a fresh run would mix with them)."""
    if not resume:
        if same_layout or strict:
            flag = "--same-layout" if same_layout else "--strict"
            raise TesseraError(f"{flag} only applies to --resume", field=flag, value=True, fix="add --resume")
        if index.complete():
            raise TesseraError(
                "this run directory already holds checkpoints; a fresh run would mix with them",
                field="run.out_dir",
                value=str(run_dir),
                fix="pass --resume to continue it, or set run.out_dir (or run.name) to a new directory",
            )
        return None
    latest = index.pick(resume_from)
    if latest is None:
        raise TesseraError(
            "--resume found no complete checkpoint",
            field="run.out_dir",
            value=str(run_dir),
            fix="run without --resume to start fresh",
        )
    return latest


def check_resume_inputs(ckpt: Path, meta: dict[str, Any], recipe: Any, *, accept_data_change: bool) -> None:
    """Before launch: the data a resume would read is the data the checkpoint was trained on. The corpus
    content hash, the tokenizer hash and the prepared-data hash (corpus + tokenizer + seq_len, packing,
    eval split) recorded with the checkpoint are compared with the ones the recipe's data section gives
    now, from the files alone (:func:`tessera.data.identity.data_identity`; a BPE not trained yet has no
    hash to compare, its corpus does). A change is refused unless ``accept_data_change``, which continues
    with a warning naming both hashes. The sampler's seed and global batch are compared here too: the
    ranks check them again, but only after ~30 s of start-up."""
    from tessera.data.identity import data_identity
    from tessera.errors import CheckpointError

    sampler = meta.get("sampler") if isinstance(meta.get("sampler"), dict) else {}
    now = {"seed": recipe.train.seed, "global_batch": recipe.parallel.global_batch}
    fields = {"seed": "train.seed", "global_batch": "parallel.global_batch"}
    for key, value in now.items():
        was = sampler.get(key)
        if was is not None and value is not None and was != value:
            raise CheckpointError(
                f"{ckpt.name} was taken with {key}={was}, this run has {value}: the data order would change",
                field=fields[key],
                value=value,
                fix=f"resume with {fields[key]}={was}, or start a fresh run (another run.out_dir)",
            )
    recorded = dict(meta.get("data_fingerprint") or {})
    if not recorded:  # checkpoints older than the data fingerprint in meta.json: the run's manifest copy
        manifest = ckpt / RunDir.MANIFEST
        try:
            import json

            recorded = dict(json.loads(manifest.read_text()).get("data") or {})
        except (OSError, ValueError, AttributeError):
            recorded = {}
    recorded["tokenizer_hash"] = meta.get("tokenizer_hash")
    current = data_identity(recipe.data, root=Path.cwd())
    changed = [
        (what, recorded.get(key), current[key])
        for key, what in (
            ("content_hash", "corpus content hash"),
            ("tokenizer_hash", "tokenizer hash"),
            ("data_hash", "prepared data hash (corpus, tokenizer, seq_len, packing, eval split)"),
        )
        if recorded.get(key) and current[key] and recorded[key] != current[key]
    ]
    if not changed:
        return
    what = "; ".join(f"{w}: {a} in {ckpt.name}, {b} now" for w, a, b in changed)
    if accept_data_change:
        print(f"tessera: warning: --accept-data-change: resuming on other data ({what})", file=sys.stderr)
        return
    raise CheckpointError(
        f"the data changed since {ckpt.name} was written ({what})",
        field="data",
        value=[e.path for e in recipe.data.sources]
        or (recipe.data.files if recipe.data.source == "files" else recipe.data.source),
        fix="restore the data files and tokenizer the run was trained on, or pass --accept-data-change "
        "to continue on the new data",
    )


def start_run(
    recipe_path: str,
    overrides: list[str],
    *,
    resume: bool = False,
    same_layout: bool = False,
    strict: bool = False,
    dry_run: bool = False,
    launch_record: dict[str, Any] | None = None,
    resume_from: str | None = None,
    accept_data_change: bool = False,
    node_rank: int | None = None,
    nnodes: int | None = None,
    rdzv_endpoint: str | None = None,
) -> tuple[int, RunDir | None]:
    """``tessera run``: check the recipe, start the ranks and wait. This process runs the checks that need
    no model library (:func:`check_recipe`, the run directory, the checksums of the checkpoint a resume
    reads), writes the recipe and the launch record, and starts the launcher; rank 0 checks the model and
    prepares the data and the plan while the other ranks start (:mod:`tessera.train.prepare`), so that
    torch and transformers are imported by the ranks only. A dry run does every check here.
    ``launch_record``: extra keys of launch.json (``tessera compare`` records its pre-registration hash
    there, which the manifest copies). ``accept_data_change``: resume although the data or tokenizer
    hash differs from the checkpoint's (:func:`check_resume_inputs`). ``node_rank`` / ``nnodes`` /
    ``rdzv_endpoint``: this node of a multi-node launch (:mod:`tessera.launch.modes`; under SLURM they
    come from its variables): node 0 does all of the above and supervises, another node's ``tessera
    run`` checks the recipe and then starts its ranks when node 0 says (:mod:`tessera.launch.agent`).
    Returns the exit code and the run dir (None on a node other than 0: node 0 reports the run)."""
    from tessera.checkpoint.index import CheckpointIndex
    from tessera.config.loader import write_recipe
    from tessera.launch.modes import build_command, rendezvous_port, resolve_cluster

    resolved, device = check_recipe(recipe_path, overrides)
    recipe = resolved.recipe
    cluster = resolve_cluster(recipe, node_rank=node_rank, nnodes=nnodes, rdzv_endpoint=rdzv_endpoint)
    run_dir = run_dir_of(recipe, recipe_path).resolve()
    rd = RunDir(run_dir)
    from tessera.launch.agent import slurm_hostfile

    hostfile = slurm_hostfile(rd, recipe, cluster)
    for note in resolved.notes:
        print(f"tessera: note: {note}", file=sys.stderr)
    if resume_from is not None:
        resume = True
    flags = (("--same-layout",) if same_layout else ()) + (("--strict",) if strict else ())
    flags += (
        ("--resume-from", str(Path(resume_from).resolve() if Path(resume_from).exists() else resume_from))
        if resume_from
        else ()
    )
    con = _console()
    if dry_run:
        from tessera.data.corpus import sample_corpus
        from tessera.train.prepare import check_model

        layout = check_model(resolved, device)  # for parallel: auto, resolved.recipe is the planned one
        cmd, env = build_command(
            resolved.recipe, run_dir, resume=resume, device=device, worker_args=(*flags, PREPARE_FLAG),
            cluster=cluster, hostfile=hostfile,
        )  # fmt: skip
        # the first records of each file through the ranks' reader: a wrong text_field fails now;
        # data.sources: each found, an indexed dataset's header checked against its files
        if recipe.data.sources:
            from tessera.data.sources import describe_sources

            sample = describe_sources(recipe.data, root=Path.cwd())
        else:
            sample = sample_corpus(recipe.data, root=Path.cwd())
        again = [*_tessera_command(), "run", recipe_path, *overrides]
        again += ["--resume"] if resume and resume_from is None else []
        again += [*flags, *(["--accept-data-change"] if accept_data_change else [])]
        con.print(f"[bold]layout[/]  {layout.describe()}")
        con.print(f"[bold]device[/]  {device}")
        con.print(f"[bold]data[/]    {_describe_sample(recipe.data, sample)}", soft_wrap=True)
        con.print(f"[bold]run dir[/] {run_dir}")
        if cluster.nnodes > 1:
            con.print(f"[bold]nodes[/]   {describe_cluster(cluster)}", soft_wrap=True)
        con.print("[bold]run it with[/] (these checks, then the launch below):")
        print(shlex.join(again))  # plain prints: one copy-pasteable line each
        con.print(
            "[bold]the launcher will receive[/] (started by `tessera run` once it has written the run "
            "directory; not runnable on its own"
            + (", and its port is picked again at launch" if _port_picked_at_launch(recipe) else "")
            + "):",
            soft_wrap=True,
        )
        print(_printable(cmd, env))
        return 0, rd
    if run_dir.exists() and not run_dir.is_dir():
        raise TesseraError(
            "the run directory is an existing file",
            field="run.out_dir",
            value=str(run_dir),
            fix="point run.out_dir at a directory (new or an earlier run of this recipe)",
        )
    _check_writable(run_dir)
    if cluster.agents and cluster.node_rank > 0:  # another node: node 0 checks, records and decides
        from tessera.launch.agent import follow

        return follow(recipe, rd, cluster, device), None
    port = rendezvous_port(recipe, cluster)
    cmd, env = build_command(
        recipe, run_dir, resume=resume, device=device, worker_args=(*flags, PREPARE_FLAG), port=port,
        cluster=cluster, hostfile=hostfile,
    )  # fmt: skip
    printable = _printable(cmd, env)
    with rd.locked() as stale:
        if stale:
            print(f"tessera: warning: {stale}", file=sys.stderr)
            release_killed_run(rd)
        index = CheckpointIndex(rd.checkpoints, world_size=recipe.run.world_size)
        chosen = resume_point(
            index, run_dir, resume=resume, resume_from=resume_from, same_layout=same_layout, strict=strict
        )
        # every file of it matches its checksum before anything launches (the ranks verify again)
        if chosen is not None:
            meta = index.verify(chosen, any_world=not same_layout)
            check_resume_inputs(chosen, meta, recipe, accept_data_change=accept_data_change)
        elif accept_data_change:
            raise TesseraError(
                "--accept-data-change only applies to --resume",
                field="--accept-data-change",
                value=True,
                fix="add --resume",
            )
        write_recipe(recipe, rd)
        launch = {"command": printable, "argv": sys.argv, "resume": resume, **(launch_record or {})}
        if cluster.nnodes > 1:
            launch["cluster"] = cluster.to_dict()
        rd.write_json(RunDir.LAUNCH, launch)
        if cluster.nnodes > 1:
            con.print(f"[bold]nodes[/]  {describe_cluster(cluster)}", soft_wrap=True)
        con.print(f"[bold]launch[/] {printable}", soft_wrap=True)  # one line: copy-pasteable
        from tessera.launch.supervise import supervise_run  # supervision never imports runs.py back

        return supervise_run(
            recipe, rd, device=device, flags=flags, launch=launch, resume=resume, cluster=cluster, port=port
        ), rd


def describe_cluster(cluster: Any) -> str:
    """One line on a multi-node launch: mode, nodes, this node."""
    hosts = f" ({', '.join(cluster.hosts)})" if cluster.hosts else ""
    return (
        f"{cluster.nnodes} nodes{hosts}, {'/'.join(map(str, cluster.slots))} ranks per node, mode "
        f"{cluster.mode}; this is node {cluster.node_rank}"
        + (" (it supervises the others)" if cluster.agents and cluster.node_rank == 0 else "")
    )


def _port_picked_at_launch(recipe: Any) -> bool:
    """``run.master_port: auto`` on one machine: a free port is picked when the command is built."""
    r = recipe.run
    return (
        r.master_port == "auto" and not r.hostfile and r.master_addr in ("127.0.0.1", "localhost", "0.0.0.0")
    )


def _tessera_command() -> list[str]:
    """How to call ``tessera`` from a shell here: the console script on PATH, else this interpreter's."""
    import shutil

    from tessera.launch.modes import venv_bin

    script = venv_bin("tessera")
    on_path = shutil.which("tessera")
    if on_path and Path(on_path).resolve() == Path(script).resolve():
        return ["tessera"]
    return [script] if Path(script).is_file() else [sys.executable, "-m", "tessera.cli"]


def _describe_sample(section: Any, sample: Any) -> str:
    """One line on what a dry run read of the data."""
    if section.sources:
        return f"{len(sample)} source(s): " + "; ".join(sample)
    if section.source == "stdlib":
        return f"{len(sample.files)} source files of the Python standard library"
    formats = ", ".join(sorted(set(sample.formats)))
    head = f"{len(sample.files)} file(s) ({formats}); the first records of each read as the ranks read them: "
    if set(sample.formats) == {"text"}:  # a text file's document is the whole file: its lines were read
        return head + f"{sample.records} lines decoded"
    return head + f"{sample.records} records, data.text_field {section.text_field!r} holds text"


def _printable(cmd: list[str], env: dict[str, str]) -> str:
    """The launch command as a shell line, with its environment additions in front."""
    env_txt = " ".join(f"{k}={v}" for k, v in env.items())
    return (env_txt + " " if env_txt else "") + shlex.join(cmd)


def release_killed_run(rd: RunDir) -> None:
    """What a killed ``tessera run`` could not clean up: DeepSpeed's shared-memory all-reduce segments of
    its rendezvous (~138 MB in /dev/shm for 2 ranks), found by the port in its ``launch.json``."""
    import shlex

    from tessera.comm.shm import release_shared_memory
    from tessera.launch.launcher import rendezvous_of

    before = rd.read_json_if_present(RunDir.LAUNCH) or {}
    try:
        where = rendezvous_of(shlex.split(str(before.get("command", ""))))
    except ValueError:  # an unreadable record: nothing to release by name
        return
    if where is not None:
        release_shared_memory(*where)


def _check_writable(run_dir: Path) -> None:
    """The run directory can be created and written, checked before anything starts."""
    import os

    from tessera.atomic import DiskFull, write_bytes_atomic

    probe = run_dir / f".write-test-{os.getpid()}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(probe, b"\n", durable=False)  # a byte: a disk with no room left fails here
        probe.unlink()
    except (OSError, DiskFull) as e:
        raise TesseraError(
            f"the run directory cannot be written: {e.reason if isinstance(e, DiskFull) else e.strerror or e}",
            field="run.out_dir",
            value=str(run_dir),
            fix="point run.out_dir (or run.name under runs/) at a writable directory",
        ) from None
