"""Fault injection, to test recovery and to rehearse your own: ``TESSERA_FAULTS``.

A comma-separated list of faults, each ``kind[:key=value...]``:

    kill:rank=1:step=7          rank 1 SIGKILLs itself at the start of step 7 (a lost rank)
    kill:node=1:step=4          every rank of node 1 of a multi-node run does (a node's ranks lost)
    hang:rank=1:step=5          rank 1 stops inside step 5 and never returns (the hang watchdog's case)
    hang:rank=0:phase=checkpoint_load
                                rank 0 stops when it enters that start-up phase (heartbeat.STARTUP_PHASES,
                                ``_`` for a space): the start-up watchdog's case (stop.startup_timeout_s)
    slow:rank=1:factor=3        rank 1's forward passes take 3x as long (a straggler)
    crash_in_save:rank=0:step=4 rank 0 dies after writing its shards of step 4's checkpoint, before the
                                checkpoint is complete (``latest`` must keep pointing at the previous one)
    kill_in_save:rank=1:step=4:at=B
                                rank 1 SIGKILLs itself while step 4's checkpoint is written, once B bytes
                                of its files are (with ``checkpoint.async``, from the writer thread while
                                the steps go on); ``at=-1``: rank 0 after the rename, before ``latest``
    nan:step=6                  every rank's first parameter gets a NaN gradient in step 6
    nan_param:step=6            after step 6 every rank's first parameter is NaN (a non-finite save)
    spike:step=6:factor=30      after step 6 every rank's last parameter (the output head) is scaled by
                                30: the next loss jumps (a loss spike)
    sigterm:step=8              at the end of step 8, SIGTERM to the ``tessera run`` that started the
                                ranks (a preemption; without one, the preemption request is written)

``rank`` defaults to every rank; ``node`` (a multi-node run's node rank) picks every rank of that node. The older ``TESSERA_FAULT=nan_grad@N`` / ``nan_param@N`` still works.
Read once when a rank starts; each fault fires once per run directory (it is marked in
``faults.fired/`` before it acts, so a restarted run does not meet it again). Unset, nothing here runs;
set, the manifest records it, so a faulted run is never mistaken for a real one.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tessera.errors import RecipeError
from tessera.train.loop import Callback, RunContext

ENV = "TESSERA_FAULTS"
LEGACY_ENV = "TESSERA_FAULT"
KINDS = ("kill", "hang", "slow", "crash_in_save", "kill_in_save", "nan", "nan_param", "spike", "sigterm")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None = None
    step: int | None = None
    factor: float = 1.0
    phase: str | None = None  # a start-up phase (hang only)
    node: int | None = None  # every rank of this node of a multi-node run
    at: int | None = None  # kill_in_save: the bytes written first (-1: after the rename)

    @property
    def spec(self) -> str:
        parts = [self.kind] + [f"rank={self.rank}"] * (self.rank is not None)
        parts += [f"node={self.node}"] * (self.node is not None)
        parts += [f"step={self.step}"] * (self.step is not None)
        if self.phase is not None:
            parts.append(f"phase={self.phase.replace(' ', '_')}")
        parts += [f"factor={self.factor:g}"] * (self.kind in ("slow", "spike"))
        parts += [f"at={self.at}"] * (self.at is not None)
        return ":".join(parts)

    def here(self, rank: int, step: int | None = None) -> bool:
        if self.node is not None:
            from tessera.rundir import NODE_ENV

            if os.environ.get(NODE_ENV) != str(self.node):
                return False
        return (self.rank is None or self.rank == rank) and (step is None or self.step == step)


def _bad(spec: str, why: str) -> RecipeError:
    return RecipeError(
        f"cannot read the fault {spec!r}: {why}",
        field=ENV,
        value=spec,
        fix="write kind[:rank=R|node=N][:step=S][:factor=F][:phase=P][:at=B], kind one of "
        + ", ".join(KINDS),
    )


def parse_faults(text: str) -> list[Fault]:
    out = []
    for spec in (s.strip() for s in text.split(",") if s.strip()):
        if "@" in spec:  # the older form: nan_grad@3, nan_param@3
            kind, _, step = spec.partition("@")
            kind = {"nan_grad": "nan"}.get(kind, kind)
            if kind not in ("nan", "nan_param") or not step.isdigit():
                raise _bad(spec, "the kind@step form knows nan_grad and nan_param")
            out.append(Fault(kind, step=int(step)))
            continue
        kind, *kv = spec.split(":")
        if kind not in KINDS:
            raise _bad(spec, f"unknown kind {kind!r}")
        args: dict[str, Any] = {}
        for item in kv:
            key, _, val = item.partition("=")
            try:
                if key in ("rank", "step", "node") or (key == "at" and kind == "kill_in_save"):
                    args[key] = int(val)
                elif key == "factor":
                    args[key] = float(val)
                elif key == "phase" and kind == "hang":
                    from tessera.train.heartbeat import STARTUP_PHASES

                    args[key] = val.replace("_", " ")
                    if args[key] not in STARTUP_PHASES:
                        names = ", ".join(p.replace(" ", "_") for p in STARTUP_PHASES)
                        raise _bad(spec, f"unknown start-up phase {val!r} (one of {names})")
                else:
                    raise _bad(spec, f"unknown key {key!r}")
            except ValueError:
                raise _bad(spec, f"{key} must be a number, not {val!r}") from None
        needs_step = kind not in ("slow",) and not (kind == "hang" and "phase" in args)
        if needs_step and "step" not in args:
            raise _bad(spec, "it needs a step")
        if kind == "slow" and args.get("factor", 0) <= 1:
            raise _bad(spec, "slow needs factor > 1")
        if kind == "spike":
            args.setdefault("factor", 30.0)
        out.append(Fault(kind, **args))
    return out


def fault_from_env() -> FaultInjection | None:
    text = ",".join(v for v in (os.environ.get(ENV), os.environ.get(LEGACY_ENV)) if v)
    faults = parse_faults(text) if text else []
    return FaultInjection(faults) if faults else None


def _marker(run_dir: Any, f: Fault, rank: int) -> Path:
    """The fault's mark; a node's fault fires on each of its ranks, so it is marked per rank."""
    name = f.spec.replace(":", "_").replace("=", "-") + (f"_rank-{rank}" if f.node is not None else "")
    return run_dir / run_dir.FAULTS_FIRED / name


def _fire(run_dir: Any, f: Fault, rank: int, where: str) -> None:
    from tessera.atomic import write_text_atomic

    write_text_atomic(_marker(run_dir, f, rank), f"rank {rank} {where}\n")  # never through a link
    print(f"[tessera] fault injection: {f.spec} fires on rank {rank}", flush=True)


class FaultInjection(Callback):
    def __init__(self, faults: list[Fault]) -> None:
        self.faults = faults

    def describe(self) -> str:
        return ",".join(f.spec for f in self.faults)

    # ---- once per run directory ---------------------------------------------------------------------
    def _marker(self, ctx: RunContext, f: Fault) -> Path:
        return _marker(ctx.run_dir, f, ctx.rank)

    def _due(self, ctx: RunContext, f: Fault, kind: str, step: int | None = None) -> bool:
        return (
            f.kind == kind
            and f.phase is None
            and f.here(ctx.rank, step)
            and not _marker(ctx.run_dir, f, ctx.rank).exists()
        )

    def _fire(self, ctx: RunContext, f: Fault) -> None:
        _fire(ctx.run_dir, f, ctx.rank, f"at step {ctx.step}")

    def on_phase(self, run_dir: Any, rank: int, phase: str) -> None:
        """A rank entering a start-up phase (before any RunContext exists): a ``hang`` there stops it."""
        for f in self.faults:
            if (
                f.kind == "hang"
                and f.phase == phase
                and f.here(rank)
                and not _marker(run_dir, f, rank).exists()
            ):
                _fire(run_dir, f, rank, f"in phase {phase}")
                while True:  # outside any collective; the heartbeat thread keeps beating
                    time.sleep(3600)

    # ---- the faults ---------------------------------------------------------------------------------
    def _param(self, ctx: RunContext) -> torch.nn.Parameter:
        return next(p for m in ctx.engine.modules() for p in m.parameters() if p.requires_grad)

    def on_run_start(self, ctx: RunContext) -> None:
        for f in self.faults:
            if f.kind == "nan" and f.here(ctx.rank) and not self._marker(ctx, f).exists():

                def poison(grad: torch.Tensor, f: Fault = f) -> torch.Tensor:
                    return torch.full_like(grad, float("nan")) if ctx.step == f.step else grad

                self._param(ctx).register_hook(poison)
            if f.kind == "slow" and f.here(ctx.rank):
                self._slow_down(ctx, f)
            if f.kind == "crash_in_save" and f.here(ctx.rank):
                self._crash_in_save(ctx, f)
        kills = [f for f in self.faults if f.kind == "kill_in_save" and f.here(ctx.rank)]
        if kills:
            self._kill_in_save(ctx, kills)

    def on_step_start(self, ctx: RunContext, step: int) -> None:
        for f in self.faults:
            if self._due(ctx, f, "nan", step):
                self._fire(ctx, f)  # the hook set at run start poisons this step
            if self._due(ctx, f, "kill", step):
                self._fire(ctx, f)
                os.kill(os.getpid(), signal.SIGKILL)
            if self._due(ctx, f, "hang", step):
                self._fire(ctx, f)
                ctx.beat(phase="step")
                while True:  # inside the step, outside any collective; the peers wait for it
                    time.sleep(3600)

    def on_step_end(self, ctx: RunContext, rec: dict[str, Any], ops: list[dict[str, Any]]) -> None:
        step = rec["step"]
        for f in self.faults:
            if self._due(ctx, f, "nan_param", step):
                self._fire(ctx, f)
                with torch.no_grad():
                    self._param(ctx).fill_(float("nan"))
            if self._due(ctx, f, "spike", step):
                self._fire(ctx, f)
                last = [p for m in ctx.engine.modules() for p in m.parameters() if p.requires_grad][-1]
                with torch.no_grad():
                    last.mul_(f.factor)  # the output head (last parameter): the logits scale with it
            if f.kind == "sigterm" and ctx.rank == 0 and self._due(ctx, f, "sigterm", step):
                self._fire(ctx, f)
                self._preempt(ctx)

    def _preempt(self, ctx: RunContext) -> None:
        from tessera.train.guard import supervisor_pid

        pid = supervisor_pid()
        if pid is not None:
            os.kill(pid, signal.SIGTERM)  # tessera run writes the request, as for a real one
        else:
            from tessera.atomic import write_text_atomic

            write_text_atomic(ctx.run_dir / ctx.run_dir.PREEMPT, "fault injection\n")

    def _slow_down(self, ctx: RunContext, f: Fault) -> None:
        started: list[float] = []

        def pre(module: Any, args: Any) -> None:
            started.append(time.perf_counter())

        def post(module: Any, args: Any, out: Any) -> None:
            time.sleep((f.factor - 1.0) * (time.perf_counter() - started.pop()))

        for m in ctx.engine.modules():
            m.register_forward_pre_hook(pre)
            m.register_forward_hook(post)

    def _kill_in_save(self, ctx: RunContext, faults: list[Fault]) -> None:
        def watch(step: int, where: str, written: int) -> None:
            for f in faults:
                at = f.at if f.at is not None else 0
                point = where == "renamed" if at < 0 else where == "bytes" and written >= at
                if point and self._due(ctx, f, "kill_in_save", step):
                    _fire(ctx.run_dir, f, ctx.rank, f"while saving step {step} ({where}, {written} bytes)")
                    os.kill(os.getpid(), signal.SIGKILL)

        ctx.ckpt.watch = watch

    def _crash_in_save(self, ctx: RunContext, f: Fault) -> None:
        engine, real = ctx.engine, ctx.engine.save

        def save(path: Path) -> None:
            real(path)  # this rank's shards are written; the checkpoint is not complete yet
            if self._due(ctx, f, "crash_in_save", ctx.step):
                self._fire(ctx, f)
                os.kill(os.getpid(), signal.SIGKILL)

        engine.save = save
