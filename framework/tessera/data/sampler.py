"""A deterministic, resumable distributed sampler that is invariant to the parallel layout.

The unit is the optimizer step, not the micro-batch: global step ``s`` consumes the same set of ``G``
samples (``G = micro_batch * grad_accum * dp_size``) whatever the layout, so dp1 x ga2 and dp2 x ga1 at the
same global batch see identical data and their losses are comparable step by step. Only the split of
that set across ranks and micro-batches depends on the layout:

    epoch e:   perm_e = randperm(num_samples, generator seeded with seed + e)
    step s:    global batch = perm_e[s*G : (s+1)*G]        (the incomplete last batch is dropped)
    rank r, micro-batch k:  global batch[(k*dp_size + r)*micro_batch : +micro_batch]

The position is three integers (epoch, step in epoch, consumed samples), so a checkpoint resumes
exactly, mid-epoch or at an epoch boundary.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from tessera.data._cache import randperm
from tessera.errors import CheckpointError, DataError, LayoutError

if TYPE_CHECKING:
    from tessera.plan.layout import ParallelLayout


class StepSampler:
    """Per optimizer step, the sample indices one data-parallel rank consumes, micro-batch by micro-batch."""

    def __init__(
        self,
        num_samples: int,
        *,
        global_batch: int,
        micro_batch: int,
        grad_accum: int,
        dp_rank: int,
        dp_size: int,
        seed: int = 0,
        shuffle: bool = True,
    ):
        if micro_batch < 1 or grad_accum < 1 or dp_size < 1:
            raise ValueError(
                f"micro_batch, grad_accum, dp_size must be >= 1: {micro_batch}, {grad_accum}, {dp_size}"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
        if micro_batch * grad_accum * dp_size != global_batch:
            raise LayoutError(
                f"micro_batch {micro_batch} x grad_accum {grad_accum} x dp {dp_size} "
                f"= {micro_batch * grad_accum * dp_size}, not the global batch",
                field="parallel.global_batch",
                value=global_batch,
                fix="make parallel.global_batch = micro_batch * grad_accum * dp, or leave one of them unset",
            )
        if num_samples < global_batch:
            raise DataError(
                f"only {num_samples} samples, fewer than one global batch of {global_batch}",
                field="parallel.global_batch",
                value=global_batch,
                fix=f"lower parallel.global_batch / micro_batch to at most {num_samples}, "
                "or get more samples (raise data.max_docs, lower data.seq_len, add data.files)",
            )
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.grad_accum = grad_accum
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.step_in_epoch = 0
        self.consumed_samples = 0
        self._perm: tuple[int, Any] | None = None  # (epoch, permutation), the one in use
        #: where the permutations are saved and mapped from (the data cache); None: held in memory
        self.perm_cache: Path | None = None
        #: tokens trained on per source of a blend since the run began (kept in the position, so a resumed
        #: run counts on); None for one source
        self.source_tokens: list[int] | None = None

    @classmethod
    def for_layout(
        cls, num_samples: int, layout: ParallelLayout, *, rank: int, seed: int, shuffle: bool = True
    ) -> StepSampler:
        """The sampler of global ``rank`` in ``layout`` (batch split and dp rank come from the layout)."""
        return cls(
            num_samples,
            global_batch=layout.global_batch,
            micro_batch=layout.micro_batch,
            grad_accum=layout.grad_accum,
            dp_rank=layout.dp_rank(rank),
            dp_size=layout.dp,
            seed=seed,
            shuffle=shuffle,
        )

    @classmethod
    def for_data(cls, data: Any, layout: ParallelLayout, *, rank: int, seed: int) -> StepSampler:
        """The sampler of a run's prepared data: rows with an order of their own (a blend) are taken in
        sequence and told the seed; a blend's sampler counts the tokens of each source."""
        rows = data.rows
        rows.set_seed(seed)
        sampler = cls.for_layout(len(rows), layout, rank=rank, seed=seed, shuffle=not rows.own_order)
        sampler.perm_cache = rows.perm_cache
        if len(rows.names) > 1:
            sampler.source_tokens = [0] * len(rows.names)
        return sampler

    @property
    def steps_per_epoch(self) -> int:
        """Full global batches per pass over the data."""
        return self.num_samples // self.global_batch

    @property
    def global_step(self) -> int:
        """Optimizer steps taken since the start of training (over all epochs)."""
        return self.epoch * self.steps_per_epoch + self.step_in_epoch

    def _permutation(self, epoch: int) -> Any:
        """The epoch's permutation (an explicit generator keeps it independent of torch's global RNG),
        mapped from ``perm_cache`` when the data has one (see :func:`tessera.data._cache.randperm`)."""
        if self._perm is None or self._perm[0] != epoch:
            if self.shuffle:
                self._perm = (epoch, randperm(self.num_samples, self.seed + epoch, self.perm_cache))
            else:
                self._perm = (epoch, range(self.num_samples))
        return self._perm[1]

    def _global_batch(self, epoch: int, step_in_epoch: int) -> Any:
        start = step_in_epoch * self.global_batch
        return self._permutation(epoch)[start : start + self.global_batch]

    def epoch_of(self, step: int) -> int:
        """The pass over the data that global step ``step`` (counted from 0) belongs to."""
        return step // self.steps_per_epoch

    def peek_global(self, step: int) -> list[int]:
        """All ``G`` sample indices of global step ``step`` (counted from 0 over all epochs); no state change."""
        epoch, s = divmod(step, self.steps_per_epoch)
        return [int(i) for i in self._global_batch(epoch, s)]

    def next_step(self) -> list[list[int]]:
        """This rank's ``grad_accum`` micro-batches (``micro_batch`` indices each) for the next step."""
        batch = [int(i) for i in self._global_batch(self.epoch, self.step_in_epoch)]
        micro = self.split(batch)
        #: every rank's indices of the step just taken (each rank knows them: the order is seeded)
        self.last_global_batch = batch
        #: the pass over the data they belong to (a blend reads other rows of a source in each pass)
        self.last_epoch = self.epoch
        self.step_in_epoch += 1
        self.consumed_samples += self.global_batch
        if self.step_in_epoch == self.steps_per_epoch:
            self.epoch += 1
            self.step_in_epoch = 0
        return micro

    def split(self, batch: list[int]) -> list[list[int]]:
        """This rank's ``grad_accum`` micro-batches of one global batch of ``G`` indices."""
        mb = self.micro_batch
        return [
            batch[(k * self.dp_size + self.dp_rank) * mb : (k * self.dp_size + self.dp_rank + 1) * mb]
            for k in range(self.grad_accum)
        ]

    def eval_batches(self, num_eval: int, *, max_samples: int) -> list[list[list[int]]]:
        """The held-out rows in order, as whole global batches split like a training step (so every layout
        evaluates the same rows): at most ``max_samples`` rows, the incomplete last batch dropped."""
        g = self.global_batch
        used = min(num_eval, max_samples) // g * g
        if used == 0:
            raise DataError(
                f"the eval split has {num_eval} rows (capped at data.eval.max_samples={max_samples}), "
                f"fewer than one global batch of {g}",
                field="data.eval.fraction",
                value=num_eval,
                fix=f"raise data.eval.fraction (and data.eval.max_samples) to give at least {g} eval rows",
            )
        return [self.split(list(range(c, c + g))) for c in range(0, used, g)]

    def __iter__(self):
        """Endless: steps continue into new epochs; the training loop decides when to stop."""
        while True:
            yield self.next_step()

    def state_dict(self) -> dict[str, Any]:
        """The position, as JSON-serialisable ints (layout-free: any layout can resume from it)."""
        return {
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "consumed_samples": self.consumed_samples,
            "seed": self.seed,
            "global_batch": self.global_batch,
            "num_samples": self.num_samples,
        } | ({"source_tokens": list(self.source_tokens)} if self.source_tokens is not None else {})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume exactly where ``state`` was taken; refuse a state from a different data order."""
        checks = {
            "global_batch": "resume with the global batch of the checkpointed run (parallel.global_batch)",
            "seed": "resume with the seed of the checkpointed run (train.seed)",
            "num_samples": "resume with the data section of the checkpointed run, or start a fresh run",
        }
        for key, fix in checks.items():
            if key not in state and key != "num_samples":  # num_samples is informative, may be absent
                raise CheckpointError(f"sampler state has no {key!r}", field=f"sampler.{key}", fix=fix)
            if key in state and int(state[key]) != getattr(self, key):
                raise CheckpointError(
                    f"checkpoint was taken with {key}={state[key]}, this run has {getattr(self, key)}",
                    field=f"sampler.{key}",
                    value=state[key],
                    fix=fix,
                )
        epoch, step = int(state["epoch"]), int(state["step_in_epoch"])
        if epoch < 0 or not 0 <= step < self.steps_per_epoch:
            raise CheckpointError(
                f"sampler position epoch={epoch} step_in_epoch={step} is outside "
                f"0..{self.steps_per_epoch - 1} steps per epoch",
                field="sampler.step_in_epoch",
                value=step,
                fix="the checkpoint does not belong to this data; resume with the data section it was taken with",
            )
        self.epoch, self.step_in_epoch = epoch, step
        self.consumed_samples = int(state.get("consumed_samples", self.global_step * self.global_batch))
        if self.source_tokens is not None and "source_tokens" in state:
            self.source_tokens = [int(t) for t in state["source_tokens"]]
