"""Stop rules: callbacks that end a run when continuing would waste the cluster or the checkpoint."""

from __future__ import annotations

import math
from typing import Any

from tessera.errors import RunStopped, TrainingDiverged
from tessera.train.loop import Callback, RunContext


class NonFiniteStop(Callback):
    """NaN or Inf in the loss or the gradient norm ends the run before anything records or saves that
    step (exit code DIVERGED; ``latest`` keeps the last good checkpoint). A missing norm (``None``: the
    engine reports none) is not a divergence. Every rank sees the same global values, so all stop together."""

    def on_step_end(self, ctx: RunContext, rec: dict[str, Any], ops: list[dict[str, Any]]) -> None:
        bad = [k for k in ("loss", "grad_norm") if rec[k] is not None and not math.isfinite(rec[k])]
        if bad:
            ctx.records.pop()  # the diverged step is not a result
            what = ", ".join(f"{k} {rec[k]}" for k in bad)
            raise TrainingDiverged(f"step {rec['step']}: {what}")


class StopRules(Callback):
    """Preemption and the ``stop`` section's rules, decided together at every step end.

    Each rank computes its flags (a preemption request file exists; the loss's z-score against the
    trailing window stayed above the limit for ``patience`` steps; its own tokens/s averaged under the
    floor; the wall time passed ``max_time_s``), then every rank reads every rank's flags from the
    rendezvous store (a few bytes, no collective: Tessera's bookkeeping costs the training backend
    nothing) and so acts on the same step. A
    preemption and the time limit save a checkpoint of the step first; a spike or a throughput floor keep
    the last one. The run then ends with the rule's own exit code and a one-line diagnosis."""

    RULES = ("preempt", "time_limit", "throughput_floor", "loss_spike")
    # (the same exchange carries each rank's compute time: stragglers are named in the record)

    def on_run_start(self, ctx: RunContext) -> None:
        import time

        self.t0 = time.monotonic()
        self.losses: list[float] = []
        self.rates: list[float] = []
        self.spiking = 0
        self.compute: list[list[float]] = []
        self.warned = -(10**9)
        self.preempt_file = ctx.run_dir / ctx.run_dir.PREEMPT
        self.store = None
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size() > 1:
            self.store = dist.distributed_c10d._get_default_store()
            # this run's own keys: processes that run several runs (the tests) share one store, and every
            # rank counts each of its runs once, so all ranks derive the same generation
            self.generation = (self.store.add("tessera/stop/runs", 1) - 1) // ctx.world

    def _flags(self, ctx: RunContext, rec: dict[str, Any]) -> tuple[list[int], dict[str, str]]:
        import statistics
        import time

        s = ctx.recipe.stop
        why: dict[str, str] = {}
        if self.preempt_file.exists():
            why["preempt"] = f"preempted at step {rec['step']} (SIGTERM / SIGINT to tessera run)"
        if s.max_time_s is not None and time.monotonic() - self.t0 >= s.max_time_s:
            why["time_limit"] = f"stop.max_time_s={s.max_time_s:g} s reached at step {rec['step']}"
        if s.min_tokens_per_s is not None:
            self.rates.append(rec["tokens_per_s"])
            w = s.min_tokens_per_s.window
            if len(self.rates) >= 2 * w:  # the first window is warm-up
                mean = statistics.fmean(self.rates[-w:])
                if mean < s.min_tokens_per_s.value:
                    why["throughput_floor"] = (
                        f"rank {ctx.rank}: {mean:,.0f} tokens/s over the last {w} steps, under "
                        f"stop.min_tokens_per_s={s.min_tokens_per_s.value:,.0f} (step {rec['step']})"
                    )
        if s.loss_spike is not None:
            rule, loss = s.loss_spike, rec["loss"]
            past = self.losses[-rule.window :]
            if len(past) >= rule.window:
                mean, sd = statistics.fmean(past), statistics.pstdev(past)
                z = (loss - mean) / sd if sd > 0 else 0.0
                self.spiking = self.spiking + 1 if z > rule.zscore else 0
                if self.spiking >= rule.patience:
                    why["loss_spike"] = (
                        f"loss {loss:.4f} at step {rec['step']} is {z:.1f} standard deviations above the "
                        f"mean of the last {rule.window} steps ({mean:.4f}) for {self.spiking} steps "
                        f"(stop.loss_spike.zscore={rule.zscore:g})"
                    )
            self.losses.append(loss)
        return [int(r in why) for r in self.RULES], why

    def _stragglers(self, ctx: RunContext, rec: dict[str, Any], compute: list[float]) -> None:
        """Per-rank compute time (step time minus collectives) into the record; a rank whose mean over
        ``stop.straggler_window`` steps exceeds the ranks' median by ``stop.straggler_ratio`` is named."""
        import statistics

        rec["compute_time_s_per_rank"] = compute
        if len(compute) < 2:
            return
        self.compute.append(compute)
        w = ctx.recipe.stop.straggler_window
        if len(self.compute) < w:
            return
        means = [statistics.fmean(c[r] for c in self.compute[-w:]) for r in range(len(compute))]
        median = statistics.median(means)
        worst = max(range(len(means)), key=means.__getitem__)
        ratio = means[worst] / median if median > 0 else 1.0
        if ratio > ctx.recipe.stop.straggler_ratio:
            rec["straggler"] = {"rank": worst, "ratio": ratio}
            if ctx.is_rank0 and rec["step"] - self.warned >= w:  # once per window, not every step
                self.warned = rec["step"]
                print(
                    f"[tessera] warning: rank {worst} is a straggler: {means[worst] * 1e3:.1f} ms of compute "
                    f"per step over the last {w} steps, {ratio:.2f}x the median rank's {median * 1e3:.1f} ms",
                    flush=True,
                )

    def _agree(self, ctx: RunContext, step: int, mine: list[float]) -> list[list[float]]:
        """Every rank's values of this step, gathered through the rendezvous store (a ``set`` and a
        ``multi_get`` of small keys: ~0.2 ms where a gloo all-reduce costs ~2 ms on the 2-core test bed,
        and no collective on the training backend). A rank deletes its key of two steps back, which
        every rank has read by then (it waited for all keys of the step between)."""
        import json

        store = self.store
        if store is None:
            return [mine]
        key = f"tessera/stop/{self.generation}/{{step}}/{{rank}}"
        store.set(key.format(step=step, rank=ctx.rank), json.dumps(mine))
        keys = [key.format(step=step, rank=r) for r in range(ctx.world)]
        store.wait(keys)
        got = [json.loads(v) for v in store.multi_get(keys)]
        if step > 2:
            store.delete_key(key.format(step=step - 2, rank=ctx.rank))
        return got

    def on_step_end(self, ctx: RunContext, rec: dict[str, Any], ops: list[dict[str, Any]]) -> None:
        flags, why = self._flags(ctx, rec)
        # each rank's flags and its compute time; a rule fires when any rank raised it
        every = self._agree(ctx, rec["step"], [*flags, rec["compute_time_s"]])
        flags = [int(any(v[i] for v in every)) for i in range(len(flags))]
        self._stragglers(ctx, rec, [v[-1] for v in every])
        fired = [r for r, f in zip(self.RULES, flags) if f]
        if not fired:
            return
        rule = fired[0]
        from tessera.rundir import ExitCode

        code = {
            "preempt": ExitCode.PREEMPTED,
            "time_limit": ExitCode.TIME_LIMIT,
            "throughput_floor": ExitCode.THROUGHPUT_FLOOR,
            "loss_spike": ExitCode.LOSS_SPIKE,
        }[rule]
        if rule in ("preempt", "time_limit"):
            ctx.pending_save = True  # the checkpoint policy (last callback) saves, then the loop stops
        if rule == "preempt" and ctx.is_rank0:  # acted on (every rank agreed): a resume must not see it
            self.preempt_file.unlink(missing_ok=True)
        diagnosis = why.get(rule, f"{rule.replace('_', ' ')} (decided on another rank) at step {rec['step']}")
        rec["stopped"] = {"rule": rule, "exit_code": int(code), "diagnosis": diagnosis}  # metrics, W&B
        ctx.stop = RunStopped(diagnosis, code=int(code))
