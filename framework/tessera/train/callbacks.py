"""The callbacks every run has, in the order the rank entry lists them (see :func:`default_callbacks`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tessera.train.loop import Callback, RunContext


class CommLogCallback(Callback):
    """``comm.jsonl``: the collectives of setup, of every step and of every checkpoint, per rank."""

    def on_run_start(self, ctx: RunContext) -> None:
        self.log = ctx.run_dir.comm_writer(ctx.rank)
        self.log.write("setup", 0, ctx.counter.pop_step())

    def on_step_end(self, ctx: RunContext, rec: dict[str, Any], ops: list[dict[str, Any]]) -> None:
        self.log.write("step", rec["step"], ops)

    def on_checkpoint(self, ctx: RunContext, step: int, path: Path) -> None:
        self.log.write("checkpoint", step, ctx.counter.pop_step())

    def on_eval(self, ctx: RunContext, step: int, ops: list[dict[str, Any]]) -> None:
        self.log.write("eval", step, ops)

    def on_run_end(self, ctx: RunContext) -> None:
        self.log.close()

    def on_failure(self, ctx: RunContext, exc: BaseException) -> None:
        if hasattr(self, "log"):
            self.log.close()


class MetricsCallback(Callback):
    """``metrics.jsonl`` (rank 0): one line per step; a resume first drops lines after the resumed step."""

    def on_run_start(self, ctx: RunContext) -> None:
        self.writer = ctx.run_dir.metrics_writer(resume_step=ctx.start_step if ctx.resumed else None)

    def on_step_end(self, ctx: RunContext, rec: dict[str, Any], ops: list[dict[str, Any]]) -> None:
        self.writer.write(rec)

    def on_run_end(self, ctx: RunContext) -> None:
        self.writer.close()

    def on_failure(self, ctx: RunContext, exc: BaseException) -> None:
        if hasattr(self, "writer"):
            self.writer.close()


class WandbCallback(Callback):
    """The W&B mirror (rank 0): the manifest as config, every step's metrics, the final loss."""

    def on_run_start(self, ctx: RunContext) -> None:
        from tessera.track.wandb_tracker import WandbTracker

        ctx.beat(phase="wandb start")  # its own start-up phase in the heartbeat (a server that never answers)
        self.tracker = WandbTracker(
            ctx.recipe.tracking.wandb, run_dir=ctx.run_dir, manifest=ctx.manifest, resume=ctx.resumed
        )
        ctx.beat(phase="run start")

    def on_step_end(self, ctx: RunContext, rec: dict[str, Any], ops: list[dict[str, Any]]) -> None:
        self.tracker.log(rec, rec["step"])

    def on_run_end(self, ctx: RunContext) -> None:
        last = ctx.records[-1] if ctx.records else {}
        evals = [r["eval_loss"] for r in ctx.records if r.get("eval_loss") is not None]
        self.tracker.summary(
            {"final_loss": last.get("loss"), "final_eval_loss": evals[-1] if evals else None}
        )
        self.tracker.log_files(
            f"manifest-{self.tracker.run_id}", "manifest", {ctx.run_dir.MANIFEST: ctx.run_dir.manifest}
        )
        self.tracker.finish()

    def on_failure(self, ctx: RunContext, exc: BaseException) -> None:
        if not hasattr(self, "tracker"):
            return
        from tessera.errors import RunStopped

        if isinstance(exc, RunStopped):
            self.tracker.summary({"stopped": str(exc), "exit_code": exc.code})
        self.tracker.finish(exit_code=getattr(exc, "code", 1))


class ProgressCallback(Callback):
    """Rank 0's live status: a rich bar on a terminal, one line per step otherwise."""

    def on_run_start(self, ctx: RunContext) -> None:
        from tessera.train.progress import Progress

        self.progress = Progress(enabled=ctx.is_rank0, total=ctx.total, start=ctx.start_step)

    def on_step_end(self, ctx: RunContext, rec: dict[str, Any], ops: list[dict[str, Any]]) -> None:
        self.progress.update(rec["step"], rec)
        if rec.get("eval_loss") is not None:
            self.progress.note(f"eval loss {rec['eval_loss']:.4f} at step {rec['step']} (held-out split)")

    def on_checkpoint(self, ctx: RunContext, step: int, path: Path) -> None:
        self.progress.note(f"checkpoint step {step}")

    def on_run_end(self, ctx: RunContext) -> None:
        self.progress.close()

    def on_failure(self, ctx: RunContext, exc: BaseException) -> None:
        if hasattr(self, "progress"):
            self.progress.close()


class CheckpointPolicy(Callback):
    """Save every ``checkpoint.every`` steps and after the last step (``checkpoint.at_end``). It runs
    before the metrics, so a step that saved says what the save cost the step loop: ``checkpoint_s``
    (the save call: waiting for the previous save, if still in flight, then the engine's save or, with
    ``checkpoint.async``, its snapshot) and ``checkpoint_wait_s`` (the waiting part); a step that ran
    while a save was still being written says ``checkpoint_writing``."""

    def on_step_end(self, ctx: RunContext, rec: dict[str, Any], ops: list[dict[str, Any]]) -> None:
        step, c = rec["step"], ctx.recipe.checkpoint
        if (c.every and step % c.every == 0) or (step == ctx.total and c.at_end) or ctx.pending_save:
            assert ctx.loop is not None
            t0 = time.perf_counter()
            try:
                ctx.loop.save_checkpoint(step)
            except Exception as e:  # the step itself trained: its line is written, then the loop raises
                ctx.stop = e
                return
            rec["checkpoint_s"] = time.perf_counter() - t0
            rec["checkpoint_wait_s"] = ctx.ckpt.waited_s
        elif ctx.ckpt.pending is not None and not ctx.ckpt.pending.writes.done():
            rec["checkpoint_writing"] = True  # this step ran beside a save's writes (rank 0: and commit)


def default_callbacks(ctx: RunContext, *, fault: Callback | None = None) -> list[Callback]:
    """The ordered list: fault injection (tests only), the comm log, the stop rules (NaN / Inf before
    anything records or saves the step; then preemption, time limit, throughput floor, loss spike, which
    mark the record), the checkpoint policy (which also saves the step a preemption or the time limit
    stopped at, and puts the save's time in the record), then metrics, W&B and progress on rank 0; the
    loop raises the stop last."""
    from tessera.train.stop import NonFiniteStop, StopRules

    rank0: list[Callback] = [MetricsCallback(), WandbCallback()] if ctx.is_rank0 else []
    head: list[Callback] = [fault] if fault is not None else []
    rules: list[Callback] = [NonFiniteStop(), StopRules()]
    return [*head, CommLogCallback(), *rules, CheckpointPolicy(), *rank0, ProgressCallback()]
