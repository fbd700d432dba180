"""One rank of a run: ``python -m tessera.train.worker --run-dir DIR [--resume]``.

Started by the ``deepspeed`` launcher or ``torchrun`` (which set RANK / LOCAL_RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT), or by the test helper with the same variables. Reads
``DIR/recipe.resolved.yaml`` written by ``tessera run`` and trains: data -> engine -> loop ->
checkpoints -> manifest / metrics / W&B on rank 0.

Each rank writes ``logs/rank_NNNNN.pid`` when it starts and ``logs/rank_NNNNN.exit`` when it ends, so
that the launcher side can tell which rank died (a SIGKILLed rank leaves no exit file).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

from tessera.comm.groups import all_gather_int
from tessera.config.loader import recipe_hash, validate_recipe
from tessera.config.schema import Recipe
from tessera.errors import EXIT_USER_ERROR, TesseraError

RECIPE_FILE = "recipe.resolved.yaml"
DATA_RECORD = "data.json"  # the prepared data the ranks read (written by prepare_run_dir)
EXIT_DIVERGED = 3
TERMINATED = 143  # what a rank stopped by SIGTERM reports (128 + 15)


class TrainingDiverged(RuntimeError):
    """Loss or grad norm became NaN / Inf; the last good checkpoint is kept."""


def resolve_device(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise TesseraError(
            "no CUDA device is visible",
            field="run.device",
            value=requested,
            fix="use run.device: cpu or auto",
        )
    return requested


def load_run_recipe(run_dir: Path) -> Recipe:
    return validate_recipe(yaml.safe_load((run_dir / RECIPE_FILE).read_text()))


def write_run_recipe(recipe: Recipe, run_dir: Path) -> Path:
    from tessera.checkpoint.manager import write_text_atomic

    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / RECIPE_FILE
    write_text_atomic(path, yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    return path


def prepare_run_dir(recipe: Recipe, run_dir: Path, *, root: Path):
    """What every launch does before any rank starts: the resolved recipe and the prepared data
    (tokenised and cached once, here; data errors surface before launch). Returns the data."""
    from tessera.checkpoint.manager import write_json_atomic
    from tessera.data import prepare_data

    write_run_recipe(recipe, run_dir)
    data = prepare_data(recipe.data, root=root)
    write_json_atomic(run_dir / DATA_RECORD, data.record())
    return data


def _rank_env() -> tuple[int, int, int]:
    return (
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("LOCAL_RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
    )


def _init_distributed(device: str) -> None:
    import deepspeed

    # DS picks gloo for the CPU accelerator and nccl for CUDA; the timeout bounds a hang on a dead peer
    deepspeed.init_distributed(
        dist_backend="nccl" if device == "cuda" else "gloo", timeout=datetime.timedelta(minutes=5)
    )


def build_engine(model: torch.nn.Module, recipe: Recipe, layout, *, device: str):
    if layout.engine == "megatron":
        from tessera.engines.megatron_engine import MegatronEngine

        return MegatronEngine(model, recipe, layout, device=device, seq_len=recipe.data.seq_len)
    from tessera.engines.deepspeed_engine import DeepSpeedEngine

    return DeepSpeedEngine(model, recipe, layout, device=device)


def train(run_dir: Path, *, resume: bool = False) -> list[dict[str, Any]]:
    """Train this rank; returns the per-step records (complete on rank 0)."""
    from tessera.checkpoint.manager import CheckpointManager, write_json_atomic
    from tessera.data import StepSampler, load_prepared, prepare_data
    from tessera.evidence.manifest import capture_manifest, diff_manifests
    from tessera.models.hf import build_model
    from tessera.plan.layout import layout_from_recipe
    from tessera.train.metrics import MetricsWriter, peak_memory_bytes, plot_run
    from tessera.train.progress import Progress

    recipe = load_run_recipe(run_dir)
    rank, local_rank, world = _rank_env()
    device = resolve_device(recipe.run.device)
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    layout = layout_from_recipe(recipe)
    if layout.world_size != world:
        raise TesseraError(
            f"the launcher started {world} ranks",
            field="run.world_size",
            value=layout.world_size,
            fix="launch through `tessera run` or match the world size",
        )
    # count every collective from here on, before DeepSpeed / megatron-core bind torch.distributed names
    from tessera.comm.accounting import CommLog, group_namer, install

    counter = install(group_namer(layout))
    _init_distributed(device)

    # `tessera run` prepared the data once before launch; without it, every rank prepares (the data
    # cache's lock lets one build while the others wait)
    record = run_dir / DATA_RECORD
    if record.is_file():
        data = load_prepared(json.loads(record.read_text()))
    else:
        data = prepare_data(recipe.data, root=Path.cwd())

    # built in fp32 from the seed on every rank, so every layout and both engines start equal (DeepSpeed
    # casts to bf16 itself; the megatron engine converts this model into its shards)
    model = build_model(recipe.model, seed=recipe.train.seed, vocab_size=data.vocab_size)
    engine = build_engine(model, recipe, layout, device=device)
    counter.namer = group_namer(layout, engine.named_groups())
    comm_log = CommLog(run_dir / "comm.jsonl", rank=rank)
    comm_log.write("setup", 0, counter.pop_step())
    sampler = StepSampler.for_layout(len(data), layout, rank=rank, seed=recipe.train.seed)
    ckpt = CheckpointManager(
        run_dir / "checkpoints", keep=recipe.checkpoint.keep, rank=rank, world_size=world
    )

    launch_info = {}
    if (run_dir / "launch.json").is_file():
        launch_info = json.loads((run_dir / "launch.json").read_text())
    manifest = capture_manifest(
        recipe=recipe.to_dict(),
        recipe_hash=recipe_hash(recipe),
        layout=layout.to_dict(),
        data_fingerprint=data.fingerprint,
        tokenizer_hash=data.tokenizer_hash,
        launcher_command=launch_info.get("command"),
        world_size=world,
        seed=recipe.train.seed,
        device=device,
    )

    start_step = 0
    resumed_from = None
    if resume:
        latest = ckpt.latest()
        if latest is None:
            raise TesseraError(
                "--resume found no complete checkpoint",
                field="run.out_dir",
                value=str(run_dir),
                fix="run without --resume to start fresh",
            )
        meta = ckpt.load(latest, engine)
        start_step = int(meta["step"])
        sampler.load_state_dict(meta["client_state"]["sampler"])
        resumed_from = str(latest)
        old = json.loads((latest / "manifest.json").read_text())
        changed = diff_manifests(old, manifest)
        if rank == 0 and changed:
            print(
                f"[tessera] resuming with {len(changed)} manifest difference(s): "
                + "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changed[:8]),
                flush=True,
            )
    manifest["resumed_from"] = resumed_from
    if (run_dir / "plan.json").is_file():  # what the layout should cost (tessera run writes it)
        manifest["plan"] = json.loads((run_dir / "plan.json").read_text()).get("chosen")

    tracker = None
    writer = None
    if rank == 0:
        write_json_atomic(run_dir / "manifest.json", manifest)
        from tessera.track.wandb_tracker import WandbTracker

        tracker = WandbTracker(recipe.tracking.wandb, run_dir=run_dir, manifest=manifest, resume=resume)
        writer = MetricsWriter(run_dir / "metrics.jsonl", resume_step=start_step if resume else None)

    records: list[dict[str, Any]] = []
    total = recipe.train.steps
    every = recipe.checkpoint.every
    progress = Progress(enabled=rank == 0, total=total, start=start_step)
    last_saved = start_step if resume else None
    try:
        for step in range(start_step + 1, total + 1):
            micro = [
                {"input_ids": data.input_ids[idx], "labels": data.labels[idx]} for idx in sampler.next_step()
            ]
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            res = engine.train_step(micro, step)
            if device == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            ops = counter.pop_step()
            comm_log.write("step", step, ops)
            comm_s = sum(o["seconds"] for o in ops)
            if not math.isfinite(res.loss) or math.isinf(res.grad_norm):
                raise TrainingDiverged(f"step {step}: loss {res.loss}, grad norm {res.grad_norm}")
            rec = {
                "step": step,
                "loss": res.loss,
                "lr": res.lr,
                "grad_norm": res.grad_norm,
                "tokens": res.tokens,
                "tokens_per_s": res.input_tokens / dt if dt > 0 else float("nan"),
                "step_time_s": dt,
                "peak_memory_bytes": peak_memory_bytes(engine.device),
                "samples": layout.global_batch * step,
                "comm_bytes": sum(o["bytes"] for o in ops),
                "comm_time_s": comm_s,
                "comm_fraction": comm_s / dt if dt > 0 else float("nan"),
            }
            records.append(rec)
            if rank == 0:
                writer.write(rec)  # type: ignore[union-attr]
                tracker.log(rec, step)  # type: ignore[union-attr]
                progress.update(step, rec)
            if (every and step % every == 0) or (step == total and recipe.checkpoint.at_end):
                state = {"step": step, "sampler": sampler.state_dict()}
                manifest["checkpoint_step"] = step
                ckpt.save(step, engine, client_state=state, manifest=manifest)
                comm_log.write("checkpoint", step, counter.pop_step())
                last_saved = step
                progress.note(f"checkpoint step {step}")
    finally:
        progress.close()
        comm_log.close()
    engine.close()
    peaks = all_gather_int(peak_memory_bytes(engine.device))
    held = [None] * world  # model states each rank really holds (engines/held.py), for the plan check
    if dist.is_initialized() and world > 1:
        dist.all_gather_object(held, getattr(engine, "held_state_bytes", None))
    else:
        held = [getattr(engine, "held_state_bytes", None)]
    if rank == 0:
        writer.close()  # type: ignore[union-attr]
        from tessera.train.metrics import read_metrics

        all_records = read_metrics(run_dir / "metrics.jsonl")
        pngs = plot_run(run_dir, all_records, peaks)
        summary = {
            "run_dir": str(run_dir),
            "last_checkpoint": str(ckpt.latest()) if last_saved is not None else None,
            "wandb_dir": tracker.dir if tracker else None,
            "final_loss": all_records[-1]["loss"] if all_records else None,
            "steps": total,
            "peak_memory_bytes_per_rank": peaks,
            "model_state_bytes_per_rank": held,
            "plots": [str(p) for p in pngs],
        }
        write_json_atomic(run_dir / "summary.json", summary)
        tracker.summary({"final_loss": summary["final_loss"]})  # type: ignore[union-attr]
        tracker.finish()  # type: ignore[union-attr]
    return records


def _status_file(run_dir: Path, rank: int, kind: str) -> Path:
    return run_dir / "logs" / f"rank_{rank:05d}.{kind}"


def run_rank(run_dir: str | Path, resume: bool = False, *, keep_process_group: bool = False) -> int:
    """Entry of one rank with status files and a log; returns the exit code.

    ``keep_process_group``: leave the process group up for another run in this process (the test
    harness runs several layouts per set of ranks); DeepSpeed caches its groups, so a process group
    once destroyed cannot serve a later ``deepspeed.initialize``."""
    run_dir = Path(run_dir)
    rank, _, _ = _rank_env()
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    _status_file(run_dir, rank, "pid").write_text(f"{os.getpid()}\n")
    log_path = logs / f"rank_{rank:05d}.log"
    log = open(log_path, "a", buffering=1)
    if rank != 0:  # rank 0 keeps the console (progress bar); the others log to their file only
        os.dup2(log.fileno(), sys.stdout.fileno())
        os.dup2(log.fileno(), sys.stderr.fileno())
    code = 0

    def _on_term(signum, frame):  # the launcher stops the survivors when a peer failed
        raise SystemExit(TERMINATED)

    signal.signal(signal.SIGTERM, _on_term)
    try:
        train(run_dir, resume=resume)
    except SystemExit as e:
        code = int(e.code) if isinstance(e.code, int) else 1
    except TesseraError as e:
        code = EXIT_USER_ERROR
        msg = f"[rank {rank}] error: {e.render()}\n"
        log.write(msg)
        if rank == 0:
            sys.stderr.write(msg)
    except TrainingDiverged as e:
        code = EXIT_DIVERGED
        msg = f"[rank {rank}] training diverged: {e}; the last good checkpoint is kept\n"
        log.write(msg)
        if rank == 0:
            sys.stderr.write(msg)
    except Exception:
        code = 1
        tb = traceback.format_exc()
        log.write(f"[rank {rank}] failed:\n{tb}")
        if rank == 0:
            sys.stderr.write(tb)
    finally:
        if dist.is_initialized() and not (keep_process_group and code == 0):
            try:
                dist.destroy_process_group()
            except Exception:  # a peer already gone; the exit code says what happened
                pass
        _status_file(run_dir, rank, "exit").write_text(f"{code}\n")
        log.close()
    return code


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
    ap.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    args = ap.parse_args(argv)
    exit_process(run_rank(args.run_dir, resume=args.resume))


if __name__ == "__main__":
    main()
