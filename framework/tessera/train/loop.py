"""The step loop and the points where behaviour plugs into it.

:class:`TrainingLoop` runs the steps of one rank and calls an explicit, ordered list of
:class:`Callback` s at fixed points: run start, step start, step end, checkpoint, run end, failure. What
happens around a step (metrics, W&B, progress, the comm log, the checkpoint policy, stop rules, fault
injection) is a callback; the loop itself only feeds the engine and times the step.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tessera.config.schema import Recipe
from tessera.engines.base import MicroBatches
from tessera.engines.held import ACTIVATIONS
from tessera.plan.layout import ParallelLayout
from tessera.rundir import RunDir


@dataclass
class RunContext:
    """Everything one rank's run holds, built by the rank entry (:mod:`tessera.train.worker`)."""

    rank: int
    world: int
    run_dir: RunDir
    recipe: Recipe
    layout: ParallelLayout
    device: str
    engine: Any  # tessera.engines.base.Engine
    data: Any  # tessera.data prepared dataset
    sampler: Any  # tessera.data.StepSampler
    counter: Any  # tessera.comm.accounting.CommCounter
    ckpt: Any  # tessera.checkpoint.manager.CheckpointManager
    manifest: dict[str, Any]
    describe: dict[str, Any]  # what every checkpoint's meta.json says of the run (engine, layout, model)
    start_step: int = 0
    resumed: bool = False
    #: the held-out global batches (this rank's micro-batch indices into data.eval_*), None: no eval split
    eval_batches: list[list[list[int]]] | None = None
    #: model FLOPs of one step (the planner's formula) and the peak FLOP/s of one device: MFU per step
    model_flops_per_step: float | None = None
    peak_flops: float | None = None
    #: when this rank's process started (epoch seconds): time to first step
    process_start: float | None = None
    #: a stop rule / preemption decided at this step (raised after every callback heard the step), and
    #: whether the checkpoint policy must save this step first
    stop: Any = None
    pending_save: bool = False
    #: this rank's heartbeat (step and phase for the hang watchdog); None in code that runs no loop
    heartbeat: Any = None
    #: why this process exists, when the supervisor restarted the run (into the first metrics line)
    restart: dict[str, Any] | None = None
    #: where the initial weights came from (tessera.engines.base.ModelSource): the end of a run with
    #: adapters checks the frozen base against it
    source: Any = None

    def beat(self, **kw: Any) -> None:
        if self.heartbeat is not None:
            self.heartbeat.set(**kw)

    step: int = 0  # the step in progress (1-based), 0 before the first
    last_saved: int | None = None
    records: list[dict[str, Any]] = field(default_factory=list)
    loop: TrainingLoop | None = None

    @property
    def total(self) -> int:
        return self.recipe.train.steps

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


class Callback:
    """A behaviour at the loop's fixed points; every method is optional."""

    def on_run_start(self, ctx: RunContext) -> None: ...

    def on_step_start(self, ctx: RunContext, step: int) -> None: ...

    def on_step_end(self, ctx: RunContext, rec: dict[str, Any], ops: list[dict[str, Any]]) -> None: ...

    def on_checkpoint(self, ctx: RunContext, step: int, path: Path) -> None: ...

    def on_eval(self, ctx: RunContext, step: int, ops: list[dict[str, Any]]) -> None: ...

    def on_run_end(self, ctx: RunContext) -> None: ...

    def on_failure(self, ctx: RunContext, exc: BaseException) -> None: ...


class TrainingLoop:
    def __init__(self, ctx: RunContext, callbacks: list[Callback]) -> None:
        self.ctx = ctx
        self.callbacks = callbacks
        ctx.loop = self

    def _each(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self.ctx, *args)

    def run(self) -> list[dict[str, Any]]:
        """Steps ``start_step + 1 .. train.steps``; returns this rank's step records."""
        ctx = self.ctx
        self._each("on_run_start")
        try:
            for step in range(ctx.start_step + 1, ctx.total + 1):
                ctx.step = step
                ctx.beat(step=step, phase="data")
                self._each("on_step_start", step)
                rec, ops = self._step(step)
                if self._eval_due(step):
                    ctx.beat(phase="eval")
                    rec["eval_loss"] = self.evaluate()
                    self._each("on_eval", step, ctx.counter.pop_step())
                ctx.records.append(rec)
                ctx.beat(phase="step end")
                self._each("on_step_end", rec, ops)
                if ctx.stop is not None:
                    self.finish_saving()  # a preemption's grace period covers the save in flight
                    raise ctx.stop
        except BaseException as exc:
            from tessera.errors import TrainingDiverged

            if isinstance(exc, TrainingDiverged):  # every rank stops here together: the save before it
                with contextlib.suppress(Exception):  # (of finite state) completes; a failure of it
                    self.finish_saving()  # must not hide the divergence
            for cb in self.callbacks:  # every callback hears of it, even if one of them fails
                try:
                    cb.on_failure(ctx, exc)
                except Exception:
                    pass
            raise
        self.finish_saving()
        self._each("on_run_end")
        return ctx.records

    def _step(self, step: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        ctx = self.ctx
        data = ctx.data
        t_data = time.perf_counter()
        rows = ctx.sampler.next_step()
        epoch, picked = ctx.sampler.last_epoch, ctx.sampler.last_global_batch
        micro = MicroBatches(
            (data.rows.batch(i, epoch) for i in rows),
            counts=(float(data.rows.label_tokens(picked, epoch)), float(len(picked) * data.rows.seq_len)),
        )
        if ctx.sampler.source_tokens is not None:  # a blend: what each source gave this step
            per = data.rows.tokens_by_source(picked, epoch)
            ctx.sampler.source_tokens = [int(a + b) for a, b in zip(ctx.sampler.source_tokens, per)]
        data_s = time.perf_counter() - t_data
        ctx.beat(phase="step")
        cuda = ctx.device == "cuda"
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if not ctx.records:  # this process's first step: measure the activations autograd saves
            ACTIVATIONS.arm(ctx.engine.modules())
        try:
            res = ctx.engine.train_step(micro, step)
        finally:
            ACTIVATIONS.disarm()
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        ops = ctx.counter.pop_step()
        from tessera.train.metrics import peak_memory_bytes, step_split

        split = step_split(dt, res.optimizer_s, res.optimizer_comm_s, ops)

        rec = {
            "step": step,
            "loss": res.loss,
            "lr": res.lr,
            "grad_norm": res.grad_norm,
            "tokens": res.tokens,
            "tokens_per_s": res.input_tokens / dt if dt > 0 else float("nan"),
            "step_time_s": dt,
            "peak_memory_bytes": peak_memory_bytes(ctx.engine.device),
            "samples": ctx.layout.global_batch * step,
            "comm_bytes": sum(o["bytes"] for o in ops),
            "comm_time_s": split["comm_time_s"],
            "comm_fraction": split["comm_time_s"] / dt if dt > 0 else float("nan"),
            # where the step went: data (outside step_time_s), optimizer, communication, compute (the rest)
            "data_time_s": data_s,
            "optimizer_time_s": split["optimizer_time_s"],
            "compute_time_s": split["compute_time_s"],
            "wall_time": time.time(),
        }
        if ctx.sampler.source_tokens is not None:
            rec["tokens_by_source"] = dict(zip(ctx.data.rows.names, ctx.sampler.source_tokens))
        if res.moe_aux_loss is not None:  # the router load-balancing loss in the objective (not in "loss")
            rec["moe_aux_loss"] = res.moe_aux_loss
        if ctx.model_flops_per_step and ctx.peak_flops and dt > 0:
            rec["mfu"] = ctx.model_flops_per_step / (dt * ctx.peak_flops * ctx.world)
        if not ctx.records and ctx.process_start is not None:  # this process's first step
            rec["time_to_first_step_s"] = rec["wall_time"] - ctx.process_start
            if ctx.restart:
                rec["restart"] = ctx.restart
        return rec, ops

    def _eval_due(self, step: int) -> bool:
        every = self.ctx.recipe.train.eval_every
        return bool(self.ctx.eval_batches) and (step == self.ctx.total or (every > 0 and step % every == 0))

    def evaluate(self) -> float:
        """Eval loss on the held-out split: token-summed over every eval batch, divided by its tokens. The
        RNG state is left as it was, so a run with eval trains exactly like one without."""
        ctx = self.ctx
        data = ctx.data
        assert ctx.eval_batches
        loss_sum = tokens = 0.0
        devices = [ctx.engine.device] if ctx.device == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            for batch in ctx.eval_batches:
                micro = [data.eval_rows.batch(i) for i in batch]
                s, n = ctx.engine.eval_loss(micro)
                loss_sum, tokens = loss_sum + s, tokens + n
        return loss_sum / max(tokens, 1.0)

    def save_checkpoint(self, step: int) -> Path:
        """Save now (all ranks; with ``checkpoint.async`` the files are written in the background after
        this returns), then tell every callback. Returns what the step loop spent: in the save call, and
        of that, waiting for the save before it."""
        ctx = self.ctx
        ctx.beat(phase="checkpoint")
        manifest = {**ctx.manifest, "checkpoint_step": step}
        with self._saving(step):
            path = ctx.ckpt.save(
                step, ctx.engine, describe=ctx.describe, sampler=ctx.sampler.state_dict(), manifest=manifest,
                tick=self._tick,
            )  # fmt: skip
        ctx.last_saved = step
        ctx.beat(phase="step end")
        self._each("on_checkpoint", step, path)
        return path

    def finish_saving(self) -> None:
        """Wait for the save in flight, if any (every rank), before the run ends or stops."""
        ctx = self.ctx
        if ctx.ckpt.pending is None:
            return
        ctx.beat(phase="checkpoint write")
        with self._saving(ctx.step):
            ctx.ckpt.finish(self._tick)
        ctx.beat(phase="step end")

    def _tick(self) -> None:
        if self.ctx.heartbeat is not None:
            self.ctx.heartbeat.tick()  # the writer advances: a long save is not a hang

    @contextlib.contextmanager
    def _saving(self, step: int) -> Iterator[None]:
        """A full disk while saving (this save, or the one in flight before it) as one clear error."""
        ctx = self.ctx
        failing = ctx.ckpt.pending.step if ctx.ckpt.pending is not None else step
        try:
            yield
        except Exception as e:
            if not out_of_space(e, ctx.ckpt.root):
                raise
            from tessera.errors import CheckpointError

            raise CheckpointError(
                f"no space left on the device (ENOSPC): rank {ctx.rank} could not write the checkpoint of "
                f"step {failing}; the previous checkpoint is complete and `latest` still names it",
                field="checkpoint",
                value=str(ctx.ckpt.root),
                fix="free space or move run.out_dir to a larger disk, then --resume",
            ) from None


def out_of_space(exc: BaseException, where: Path) -> bool:
    """Whether a failed save ran out of disk: ENOSPC anywhere in the exception's chain, or any error while
    the checkpoint's file system is (nearly) full (torch's writer hides the errno behind "basic_ios::clear"
    or "unexpected pos")."""
    import errno
    import os

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        st = os.statvfs(where)
    except OSError:
        return False
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    return free < max(1 << 20, total // 100)
