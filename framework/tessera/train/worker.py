"""One rank of a run: ``python -m tessera.train.worker --run-dir DIR [--resume]``.

Started by the ``deepspeed`` launcher or ``torchrun`` (which set RANK / LOCAL_RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT), or by the test harness with the same variables. Reads the run directory that
``tessera run`` prepared and trains: set up (device, comm accounting, the checkpoint to resume from,
verified before anything loads it, data, engine, manifest) -> the step loop with its callbacks
(:mod:`tessera.train.loop`) -> tear down (summary, plots).

Each rank writes ``logs/rank_NNNNN.pid`` when it starts and ``logs/rank_NNNNN.exit`` when it ends, so
that the launcher side can tell which rank died (a SIGKILLed rank leaves no exit file).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tessera.checkpoint.reshard import layout_tag
from tessera.checkpoint.sources import is_hf_dir
from tessera.config.loader import load_run_recipe, recipe_hash
from tessera.config.schema import Recipe
from tessera.device import resolve_device
from tessera.errors import CheckpointError, RunStopped, TesseraError, TrainingDiverged
from tessera.plan.layout import ParallelLayout
from tessera.rundir import NODE_ENV, ORDERLY_EXITS, PREPARE_FLAG, ExitCode, RunDir
from tessera.train.loop import RunContext, TrainingLoop
from tessera.train.resharding import engine_reshards_on_load, import_reshard, stage_on_rank0
from tessera.train.resume import base_record, check_resume_adapters, resume_point


@dataclass(frozen=True)
class Start:
    """How a rank starts: fresh, or ``resume`` from the run's latest checkpoint (resharded when its
    layout differs, unless ``same_layout``; refused on a changed manifest with ``strict``), or only
    ``convert_from`` a checkpoint / HF directory into this run's first checkpoint (``verify``: check the
    written checkpoint against its source)."""

    resume: bool = False
    same_layout: bool = False
    strict: bool = False
    resume_from: Path | None = None  # --resume-from: this checkpoint instead of the latest
    convert_from: Path | None = None
    verify: bool = True
    prepare: bool = False  # a tessera run launch: rank 0 prepares the run dir, the others wait for it


def _rank_env() -> tuple[int, int, int]:
    return (
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("LOCAL_RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
    )


# ---- set up --------------------------------------------------------------------------------------------


def init_distributed(device: str, layout: ParallelLayout) -> None:
    """torch.distributed on gloo (CPU) or NCCL (CUDA), through DeepSpeed where it shards the layout (its
    comm layer then owns the group), directly otherwise: a rank that never uses DeepSpeed does not
    import it (~1.3 s of its start on two cores). The timeout bounds a hang on a dead peer."""
    backend, timeout = ("nccl" if device == "cuda" else "gloo"), datetime.timedelta(minutes=5)
    if layout.uses_deepspeed:
        import deepspeed

        deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
    elif not dist.is_initialized():  # the test harness keeps one group across runs
        dist.init_process_group(backend=backend, timeout=timeout)


def _layout(recipe: Recipe, world: int, layout: ParallelLayout | None = None) -> ParallelLayout:
    """The recipe's layout (``layout``: derived already, by rank 0's preparation), checked against the
    number of ranks the launcher started."""
    from tessera.plan.layout import layout_from_recipe

    layout = layout if layout is not None else layout_from_recipe(recipe)
    if layout.world_size != world:
        raise TesseraError(
            f"the launcher started {world} ranks",
            field="run.world_size",
            value=layout.world_size,
            fix="launch through `tessera run` or match the world size",
        )
    return layout


def _load_data(run_dir: RunDir, recipe: Recipe):
    """Rank 0 of a `tessera run` launch prepared the data (data.json); without it, every rank prepares (the
    data cache's lock lets one build while the others wait)."""
    from tessera.data import load_prepared, prepare_data

    if run_dir.data.is_file():
        return load_prepared(run_dir.read_json(RunDir.DATA))
    return prepare_data(recipe.data, root=Path.cwd())


def _manifest(
    recipe: Recipe, layout: ParallelLayout, data: Any, run_dir: RunDir, device: str
) -> dict[str, Any]:
    from tessera.evidence.manifest import capture_manifest

    launch = run_dir.read_json_if_present(RunDir.LAUNCH) or {}
    manifest, diff = capture_manifest(
        recipe=recipe.to_dict(),
        recipe_hash=recipe_hash(recipe),
        layout=layout.to_dict(),
        data_fingerprint=data.fingerprint,
        tokenizer_hash=data.tokenizer_hash,
        tokenizer_dir=data.tokenizer_dir,
        launcher_command=launch.get("command"),
        world_size=layout.world_size,
        seed=recipe.train.seed,
        device=device,
        hostfile=recipe.run.hostfile,
    )
    if diff and _rank_env()[0] == 0:  # the uncommitted code, beside the manifest that holds its hash
        from tessera.atomic import write_text_atomic

        write_text_atomic(run_dir / RunDir.GIT_DIFF, diff)
    plan = run_dir.read_json_if_present(RunDir.PLAN)
    if plan is not None:  # what the layout should cost (tessera run writes it)
        manifest["plan"] = plan.get("chosen")
    if launch.get("cluster"):  # a multi-node run: the mode, and every node with its ranks and hardware
        from tessera.evidence.manifest import nodes_record, topology

        manifest["launch_mode"] = launch["cluster"]["mode"]
        manifest["nodes"] = nodes_record(run_dir, layout.world_size)

        manifest["topology"] = topology(layout.world_size, None, nodes=launch["cluster"]["nnodes"])
    if launch.get("preregistration_sha256"):  # a run of `tessera compare`: the thresholds it is judged by
        manifest["preregistration_sha256"] = launch["preregistration_sha256"]
    return manifest


def _history(
    manifest: dict[str, Any], run_dir: RunDir, source: Any, resume_from: Path | None, *, rank: int
) -> dict[str, Any] | None:
    """The run's initial weights and its restarts: a fresh run records what it built; a resume keeps
    the first launch's record (its weights came from the checkpoint) and adds one restart, as does an
    automatic restart that started over (a rank lost before the first checkpoint was complete: ``from``
    is None). Returns the supervisor's record when this launch is an automatic restart."""
    # an automatic restart says why (launch.json's "restart", from the supervisor); a manual resume not
    why = (run_dir.read_json_if_present(RunDir.LAUNCH) or {}).get("restart") or {}
    restarted = resume_from is not None or "attempt" in why
    before = run_dir.read_json_if_present(RunDir.MANIFEST) if restarted else None
    if resume_from is not None and before and before.get("initial_weights"):
        manifest["initial_weights"] = before["initial_weights"]
    else:
        manifest["initial_weights"] = source.initial_weights() if rank == 0 else None  # rank 0 writes it
    restarts = list((before or {}).get("restarts", []))
    if restarted:
        at = datetime.datetime.now().isoformat(timespec="seconds")
        restarts.append({"from": resume_from.name if resume_from is not None else None, "at": at, **why})
    manifest["restarts"] = restarts
    return restarts[-1] if restarted and "attempt" in restarts[-1] else None


def setup(run_dir: RunDir, start: Start, heartbeat: Any = None) -> tuple[RunContext, Any]:
    """Everything up to the first step; returns the context and the fault injection (None unless set).
    A resume whose checkpoint has another layout reshards it first (unless ``start.same_layout``);
    ``start.convert_from`` (a checkpoint or an HF directory) is resharded into this run's first
    checkpoint."""
    from tessera.checkpoint.manager import CheckpointManager
    from tessera.comm.accounting import group_namer, install
    from tessera.comm.shm import use_venv_build_tools
    from tessera.data import StepSampler
    from tessera.engines.base import ModelSource
    from tessera.models.adapters import section_dict
    from tessera.tables.engines import engine_class, engine_hook
    from tessera.train.faults import fault_from_env

    use_venv_build_tools()  # DeepSpeed's CPU comm op as make setup built it, not rebuilt here
    rank, local_rank, world = _rank_env()
    fault = fault_from_env()

    def phase(name: str) -> None:
        """Enter a start-up phase (heartbeat.STARTUP_PHASES): the heartbeat says it at once, and the
        supervisor bounds each phase by stop.startup_timeout_s; a fault injected there fires."""
        if heartbeat is not None:
            heartbeat.set(phase=name)
        if fault is not None:
            fault.on_phase(run_dir, rank, name)

    recipe, layout, data = None, None, None
    if start.prepare:  # a tessera run launch: rank 0 prepares the run dir while the others wait
        from tessera.train.prepare import prepare_as_rank0, wait_prepared

        if rank == 0:
            tick = heartbeat.tick if heartbeat is not None else None
            recipe, layout, data = prepare_as_rank0(run_dir, phase=phase, progress=tick)
        else:
            wait_prepared(run_dir, phase=phase)
    recipe = recipe if recipe is not None else load_run_recipe(run_dir)
    device = resolve_device(recipe.run.device)
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    layout = _layout(recipe, world, layout)
    # count every collective from here on, before DeepSpeed / megatron-core bind torch.distributed names
    counter = install(group_namer(layout))
    phase("rendezvous")
    init_distributed(device, layout)
    ckpt = CheckpointManager(
        run_dir.checkpoints, keep=recipe.checkpoint.keep, rank=rank, world_size=world,
        background=recipe.checkpoint.async_,
    )  # fmt: skip
    resume_from, reshard = None, False
    if start.resume:
        phase("checkpoint verify")
        *point, reshard = resume_point(
            ckpt, layout, run_dir, same_layout=start.same_layout, chosen=start.resume_from
        )
        resume_from = (point[0], point[1])
    src = start.convert_from
    hf_source = src is not None and is_hf_dir(src)
    if src is not None and not hf_source:
        phase("checkpoint verify")
        resume_from, reshard = (src, ckpt.verify(src, any_world=True)), True
    if resume_from is not None:
        check_resume_adapters(resume_from[1], recipe, resume_from[0])
    stage_dir = None
    if reshard and not engine_reshards_on_load(resume_from[1], layout):  # type: ignore[index]
        phase("reshard")
        stage_dir = stage_on_rank0(resume_from[0], run_dir)  # type: ignore[index]

    phase("data load")
    data = data if data is not None else _load_data(run_dir, recipe)
    phase("model build")
    source = ModelSource.of(
        recipe, vocab_size=data.vocab_size, weights=src if hf_source else stage_dir, token_ids=data.token_ids
    )
    cls = engine_class(layout.engine)
    if src is not None:  # `tessera convert`: the engine's writer where it has one
        writer = engine_hook(layout.engine, "writer")
        cls = (writer(recipe, layout, from_hf=hf_source) if writer is not None else None) or cls
    engine = cls(source, recipe, layout, device=device)
    counter.namer = group_namer(layout, engine.named_groups())
    sampler = StepSampler.for_data(data, layout, rank=rank, seed=recipe.train.seed)
    manifest = _manifest(recipe, layout, data, run_dir, device)
    if fault is not None:
        manifest["fault_injection"] = fault.describe()
    ctx = RunContext(
        rank=rank,
        world=world,
        run_dir=run_dir,
        recipe=recipe,
        layout=layout,
        device=device,
        engine=engine,
        data=data,
        sampler=sampler,
        counter=counter,
        ckpt=ckpt,
        manifest=manifest,
        describe={
            "engine": layout.engine,
            "sharding": engine.sharding,
            "layout": layout.to_dict(),
            "precision": recipe.train.precision,
            "model_config": json.loads(source.hf_config().to_json_string()),
            "tokenizer_hash": data.tokenizer_hash,
            "data_fingerprint": {k: v for k, v in data.fingerprint.items() if k != "files"},
            "peft": section_dict(recipe.peft),
        },
        resumed=start.resume,
        heartbeat=heartbeat,
        source=source,
    )
    # the run's history before a resume compares manifests (else initial_weights would read as changed)
    ctx.restart = _history(
        manifest, run_dir, source, resume_from[0] if resume_from and src is None else None, rank=rank
    )
    if recipe.peft is not None and rank == 0:  # checkpoints hold the adapters and name their base
        ctx.describe["base"] = base_record(source, manifest, resume_from, same_run=src is None)
    if hf_source:
        phase("reshard")
        import_reshard(ctx, None, src, tag=None, verify=start.verify, release=True)  # type: ignore[arg-type]
    elif reshard:
        assert resume_from is not None
        phase("reshard")
        tag = None if src is not None else layout_tag(layout.to_dict())
        resume_from = import_reshard(
            ctx, resume_from, stage_dir, tag=tag, verify=start.verify, release=src is not None
        )
    if resume_from is not None and src is None:
        phase("checkpoint load")
        _restore(ctx, *resume_from, strict=start.strict)
    phase("run start")
    manifest["resumed_from"] = str(resume_from[0]) if resume_from else None
    _evidence_inputs(ctx, data, device)
    if rank == 0:
        run_dir.write_json(RunDir.MANIFEST, manifest)
    return ctx, fault


def _evidence_inputs(ctx: RunContext, data: Any, device: str) -> None:
    """What the loop needs to measure beyond the loss: the eval batches, the FLOPs of a step and the
    device's peak (MFU), and when this process started (time to first step)."""
    import psutil

    from tessera.plan.search import hardware_for

    recipe = ctx.recipe
    if data.eval_rows is not None:
        ctx.eval_batches = ctx.sampler.eval_batches(
            len(data.eval_rows), max_samples=recipe.data.eval.max_samples
        )
    plan = ctx.manifest.get("plan") or {}
    ctx.model_flops_per_step = plan.get("model_flops_per_step")
    ctx.peak_flops = hardware_for(recipe, device=device).peak_for(recipe.train.precision)
    ctx.process_start = psutil.Process().create_time()


def _restore(ctx: RunContext, path: Path, meta: dict[str, Any], *, strict: bool = False) -> None:
    """Load the checkpoint; say what changed since it was written (code, config, data, environment,
    hardware: one line per key), or with ``strict`` refuse a change that is not hardware."""
    from tessera.evidence.manifest import grouped_diff, short

    manifest_file = path / RunDir.MANIFEST
    groups = (
        grouped_diff(json.loads(manifest_file.read_text()), ctx.manifest) if manifest_file.is_file() else {}
    )
    if strict:
        changed = [(g, k) for g, rows in groups.items() if g != "hardware" for k, _, _ in rows]
        if changed:
            g, k = changed[0]
            raise CheckpointError(
                f"--strict: the {g} changed since {path.name} was written ({k}"
                + (f" and {len(changed) - 1} more" if len(changed) > 1 else "")
                + ")",
                field=k,
                value=str(path),
                fix="resume without --strict, or restore what changed (see: tessera manifest diff)",
            )
    ctx.sampler.load_state_dict(ctx.ckpt.load(path, meta, ctx.engine))
    ctx.start_step = ctx.last_saved = int(meta["step"])
    if ctx.is_rank0 and groups:
        lines = [f"  {g:<11} {k}: {short(a)} -> {short(b)}" for g, rows in groups.items() for k, a, b in rows]
        print(f"[tessera] resuming {path.name}; the manifest changed since:\n" + "\n".join(lines), flush=True)


# ---- tear down -----------------------------------------------------------------------------------------


def finish(ctx: RunContext, *, stopped: RunStopped | None = None) -> None:
    """Peaks and model states of every rank; rank 0 writes summary.json and the plots (and, for a run a
    stop rule or a preemption ended, the diagnosis into the summary and the manifest)."""
    from tessera.comm.groups import all_gather_int, all_gather_object
    from tessera.train.metrics import peak_memory_bytes, plot_run

    engine = ctx.engine
    held = all_gather_object(engine.held_state())  # model states each rank really holds, for the plan check
    frozen = _frozen_base_check(ctx)
    from tessera.engines.held import ACTIVATIONS

    activations = all_gather_object(ACTIVATIONS.per_micro_batch)  # None: no step ran in this process
    engine.close()
    peaks = all_gather_int(peak_memory_bytes(engine.device))
    if not ctx.is_rank0:
        return
    records = ctx.run_dir.read_metrics()
    pngs = plot_run(ctx.run_dir.path, records, peaks, held, activations)
    tokens = ctx.sampler.source_tokens  # a blend: what each source gave, since the run began
    seen = {} if tokens is None else {"tokens_by_source": dict(zip(ctx.data.rows.names, tokens))}
    latest = ctx.ckpt.latest() if ctx.last_saved is not None else None
    ctx.run_dir.write_json(
        RunDir.SUMMARY,
        {
            "run_dir": str(ctx.run_dir.path),
            "last_checkpoint": str(latest) if latest else None,
            "wandb_dir": _wandb_dir(ctx),
            "final_loss": records[-1]["loss"] if records else None,
            "steps": ctx.total,
            "peak_memory_bytes_per_rank": peaks,
            "model_state_bytes_per_rank": held,
            # bytes autograd saved for backward in one micro-batch's forward (the first step of a process)
            "activation_bytes_per_rank": activations,
            "plots": [str(p) for p in pngs],
            "stopped": None if stopped is None else {"diagnosis": str(stopped), "exit_code": stopped.code},
            "restarts": ctx.manifest.get("restarts", []),
        }
        | seen
        | ({"frozen_base": frozen} if frozen is not None else {}),
    )
    if stopped is not None:
        ctx.manifest["stopped"] = {"diagnosis": str(stopped), "exit_code": stopped.code}
    if stopped is not None or seen:
        ctx.manifest.update(seen)
        ctx.run_dir.write_json(RunDir.MANIFEST, ctx.manifest)


def _frozen_base_check(ctx: RunContext) -> dict[str, Any] | None:
    """With adapters: the frozen base every rank holds, compared bit for bit with where it came from (the
    ranks share the reading: :func:`tessera.models.adapters.check_frozen_base`); None without adapters."""
    if ctx.recipe.peft is None or ctx.source is None:
        return None
    import dataclasses

    from tessera.comm.groups import all_gather_object
    from tessera.models.adapters import check_frozen_base, checkers, whole_base_tensors

    # the base as the recipe names it (a resharding stage the engine was built from is gone by now)
    base = dataclasses.replace(ctx.source, weights=None).tensors()
    state = ctx.engine.state_dict()
    who = checkers(all_gather_object(whole_base_tensors(state)))
    with torch.no_grad():
        mine = check_frozen_base(state, base, rank=ctx.rank, checker=who)
    parts = all_gather_object(mine)
    differ = sorted({n for p in parts for n in p["differ"]})
    return {"tensors_checked": sum(p["tensors"] for p in parts), "unchanged": not differ, "differ": differ}


def _wandb_dir(ctx: RunContext) -> str | None:
    from tessera.train.callbacks import WandbCallback

    assert ctx.loop is not None
    return next((cb.tracker.dir for cb in ctx.loop.callbacks if isinstance(cb, WandbCallback)), None)


def train(run_dir: str | Path, start: Start = Start(), heartbeat: Any = None) -> list[dict[str, Any]]:
    """Train this rank; returns its per-step records. ``start.convert_from``: only reshard that checkpoint
    (or HF directory) into this run directory's first checkpoint (``tessera convert --to ENGINE``)."""
    from tessera.train.callbacks import default_callbacks

    ctx, fault = setup(RunDir(run_dir), start, heartbeat)
    if start.convert_from is not None:
        if ctx.engine is not None:  # (let go after the save by import_reshard where it resharded)
            ctx.engine.close()
        if ctx.is_rank0:
            ctx.run_dir.write_json(RunDir.MANIFEST, ctx.manifest)
        return []
    loop = TrainingLoop(ctx, default_callbacks(ctx, fault=fault))
    try:
        records = loop.run()
    except RunStopped as stop:  # every rank stopped at the same step: finish in step, then exit its code
        finish(ctx, stopped=stop)
        raise
    except BaseException:
        ctx.engine.close()
        raise
    finish(ctx)
    return records


# ---- the rank entry ------------------------------------------------------------------------------------


def run_rank(run_dir: str | Path, start: Start = Start(), *, keep_process_group: bool = False) -> int:
    """Entry of one rank with status files and a log; returns the exit code.

    ``keep_process_group``: leave the process group up for another run in this process (the test
    harness runs several layouts per set of ranks) when this one ended in step with the other ranks;
    DeepSpeed caches its groups, so a process group once destroyed cannot serve a later
    ``deepspeed.initialize``."""
    rd = RunDir(run_dir)
    rank, _, _ = _rank_env()
    try:  # a full disk, or a link planted where a rank file goes: one line, no log to write it to
        node = os.environ.get(NODE_ENV)  # set by the node's agent on a multi-node run
        rd.mark_rank_started(rank, os.getpid(), None if node is None else int(node))
        log = rd.open_rank_log(rank)
    except TesseraError as e:
        sys.stderr.write(f"[rank {rank}] error: {e.render()}\n")
        rd.mark_rank_exited(rank, int(ExitCode.USER_ERROR))
        return int(ExitCode.USER_ERROR)
    from tessera.train.guard import guard_rank

    guard_rank(lambda: rd.mark_rank_exited(rank, int(ExitCode.TERMINATED)))
    if rank != 0:  # rank 0 keeps the console (progress bar); the others log to their file only
        os.dup2(log.fileno(), sys.stdout.fileno())
        os.dup2(log.fileno(), sys.stderr.fileno())
    elif not os.environ.get("TESSERA_VERBOSE"):
        _quiet_console(log)
    code = ExitCode.OK

    def _on_term(signum, frame):  # the launcher stops the survivors when a peer failed
        # once: DeepSpeed's launcher and the supervisor both send SIGTERM, and a second SystemExit raised
        # inside the clean-up below would skip the exit file and leave through the interpreter's exit,
        # whose atexit hooks (W&B's service teardown, its service already stopped) print tracebacks; a
        # clean-up that hangs is SIGKILLed by the supervisor after 5 s
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(ExitCode.TERMINATED)

    def report(msg: str) -> None:
        log.write(msg)
        if rank == 0:
            sys.stderr.write(msg)

    before = signal.signal(signal.SIGTERM, _on_term)
    from tessera.comm.accounting import install
    from tessera.train.heartbeat import Heartbeat

    heartbeat = Heartbeat(rd.rank_file(rank, "heartbeat"), rank, install())
    try:
        train(rd.path, start, heartbeat)
    except SystemExit as e:
        code = int(e.code) if isinstance(e.code, int) else ExitCode.FAILED
    except TesseraError as e:
        code = ExitCode.USER_ERROR
        report(f"[rank {rank}] error: {e.render()}\n")
    except TrainingDiverged as e:
        code = ExitCode.DIVERGED
        report(f"[rank {rank}] training diverged: {e}; the last good checkpoint is kept\n")
    except RunStopped as e:
        code = ExitCode(e.code)
        if rank == 0:
            report(f"[tessera] stopped: {e} (exit code {int(code)} {code.name})\n")
    except Exception as e:
        from tessera.atomic import disk_error

        if disk_error(e):  # a write the file system refused, inside a library: one line, like ours
            code = ExitCode.USER_ERROR
            report(
                f"[rank {rank}] error: the file system refused a write ({disk_error(e)}): {e}\n"
                "  fix: free space (or quota) there, or move run.out_dir to a larger disk; then --resume\n"
            )
        else:
            code = ExitCode.FAILED
            report(f"[rank {rank}] failed:\n{traceback.format_exc()}")
    finally:
        # the rank is ending: how is said first, and a SIGTERM from here on (DeepSpeed's launcher stops
        # the other ranks as soon as one exits non-zero, e.g. a peer's preemption exit) can no longer
        # raise inside the clean-up and leave without the exit file ("died without exiting"); a clean-up
        # that hangs is SIGKILLed by the supervisor, its exit file already written
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        rd.mark_rank_exited(rank, int(code))
        if dist.is_initialized() and not (keep_process_group and code in ORDERLY_EXITS):
            try:
                dist.destroy_process_group()
            except Exception:  # a peer already gone; the exit code says what happened
                pass
            from tessera.comm.shm import release_shared_memory

            # DeepSpeed's CPU all-reduce segments of this rendezvous (never unlinked by DeepSpeed)
            release_shared_memory(os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""))
        heartbeat.close()
        log.close()
        signal.signal(signal.SIGTERM, before)  # a test harness's process goes on to its next run
    return int(code)


def _quiet_console(log: Any) -> None:
    """Rank 0's console carries Tessera's lines; library warnings (deprecations, config advice) go to its
    log file instead (``--verbose`` keeps them on the console)."""
    import logging
    import warnings

    def to_log(message, category, filename, lineno, file=None, line=None) -> None:
        log.write(warnings.formatwarning(message, category, filename, lineno, line))

    warnings.showwarning = to_log
    for name in ("transformers", "deepspeed", "DeepSpeed", "megatron", "torch.distributed"):
        lg = logging.getLogger(name)
        lg.setLevel(logging.ERROR)


def exit_process(code: int) -> None:
    """Leave without interpreter teardown: every file is written and flushed by now, and C++ threads of
    the comm backends (gloo, DeepSpeed's shm op) intermittently abort the process ("terminate called
    without an active exception") while static destructors run, turning a finished rank into a crash."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tessera.train.worker")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--same-layout", action="store_true", help="refuse to reshard a checkpoint at resume")
    ap.add_argument("--convert-from", default=None, help="reshard this checkpoint / HF dir, no training")
    ap.add_argument("--no-verify", action="store_true", help="do not verify a resharded checkpoint")
    ap.add_argument("--strict", action="store_true", help="refuse to resume when the manifest changed")
    ap.add_argument("--resume-from", default=None, help="resume from this checkpoint, not the latest")
    ap.add_argument(PREPARE_FLAG, action="store_true", help="rank 0 prepares the run dir, the others wait")
    ap.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    args = ap.parse_args(argv)
    if not (Path(args.run_dir) / RunDir.RECIPE).is_file():  # the launcher line of `tessera run --dry-run`
        ap.error(
            f"--run-dir = {args.run_dir!r}: not a run directory (no {RunDir.RECIPE}); the ranks read the "
            "directory `tessera run` writes before it launches them: start runs with `tessera run R.yaml`"
        )
    start = Start(
        resume=args.resume,
        same_layout=args.same_layout,
        strict=args.strict,
        resume_from=Path(args.resume_from) if args.resume_from else None,
        convert_from=Path(args.convert_from) if args.convert_from else None,
        verify=not args.no_verify,
        prepare=args.prepare,
    )
    exit_process(run_rank(args.run_dir, start))


if __name__ == "__main__":
    main()
