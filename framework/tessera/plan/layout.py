"""`ParallelLayout`: the one validated parallel-state object of a run.

Computed once from a resolved recipe and passed down explicitly (engines, data sampler, manifest, plan).
Every rule that makes a layout impossible is checked here, before anything launches, and each failure
names the fields, the numbers and the fix.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from tessera.config.schema import Recipe
from tessera.errors import LayoutError, RecipeError

#: What each engine can run today. One table, read by validation and (later) the planner.
ENGINE_SUPPORT: dict[str, dict[str, Any]] = {
    "deepspeed": {"tp": False, "pp": False, "ep": False, "available": True},
    "megatron": {"tp": True, "pp": True, "ep": True, "available": False},
}


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """Degrees of parallelism and batch split for one run.

    world_size = dp * tp * pp; global_batch = micro_batch * grad_accum * dp.
    """

    engine: str
    world_size: int
    dp: int
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    zero: int = 0
    micro_batch: int = 1
    grad_accum: int = 1
    global_batch: int = 1
    offload_optimizer: bool = False
    offload_params: bool = False

    def __post_init__(self) -> None:
        if self.dp * self.tp * self.pp != self.world_size:
            raise LayoutError(
                f"dp*tp*pp = {self.dp}*{self.tp}*{self.pp} = {self.dp * self.tp * self.pp} "
                f"is not run.world_size = {self.world_size}",
                field="parallel.dp",
                value=self.dp,
                fix="set parallel.dp: auto, or make dp*tp*pp equal run.world_size",
            )
        if self.micro_batch * self.grad_accum * self.dp != self.global_batch:
            raise LayoutError(
                f"global_batch {self.global_batch} != micro_batch {self.micro_batch} x grad_accum "
                f"{self.grad_accum} x dp {self.dp} = {self.micro_batch * self.grad_accum * self.dp}",
                field="parallel.global_batch",
                value=self.global_batch,
                fix="make parallel.global_batch a multiple of micro_batch*dp, or drop grad_accum to derive it",
            )
        if self.ep > 1 and (self.dp * self.tp) % self.ep:
            raise LayoutError(
                f"ep={self.ep} does not divide dp*tp={self.dp * self.tp}",
                field="parallel.ep",
                value=self.ep,
                fix="set parallel.ep to a divisor of dp*tp",
            )

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def dp_rank(self, rank: int) -> int:
        """The data-parallel rank of global ``rank`` (the deepspeed engine: data-parallel over the world)."""
        if self.tp * self.pp != 1:
            raise NotImplementedError("rank order with model parallelism comes with the megatron engine")
        return rank

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        return (
            f"engine={self.engine} world={self.world_size} dp={self.dp} tp={self.tp} pp={self.pp} "
            f"ep={self.ep} zero={self.zero} micro_batch={self.micro_batch} grad_accum={self.grad_accum} "
            f"global_batch={self.global_batch}"
        )


def layout_from_recipe(recipe: Recipe) -> ParallelLayout:
    """Derive and validate the layout of ``recipe``; user mistakes raise LayoutError / RecipeError."""
    p, ws = recipe.parallel, recipe.run.world_size
    support = ENGINE_SUPPORT[p.engine]
    if not support["available"]:
        raise LayoutError(
            "this engine is not available yet in this version of Tessera",
            field="parallel.engine",
            value=p.engine,
            fix="use parallel.engine: deepspeed (ZeRO 0-3 data parallelism)",
        )
    for name in ("tp", "pp", "ep"):
        deg = getattr(p, name)
        if deg > 1 and not support[name]:
            raise LayoutError(
                f"engine '{p.engine}' cannot do {name} > 1 (it shards data-parallel only)",
                field=f"parallel.{name}",
                value=deg,
                fix=f"set parallel.{name}: 1 (tensor / pipeline / expert parallelism needs the megatron engine)",
            )
    if p.vpp > 1 and p.pp == 1:
        raise LayoutError(
            "virtual pipeline stages need pipeline parallelism",
            field="parallel.vpp",
            value=p.vpp,
            fix="set parallel.vpp: 1 or parallel.pp > 1",
        )
    model_par = p.tp * p.pp
    if ws % model_par:
        raise LayoutError(
            f"run.world_size={ws} is not divisible by tp*pp={model_par}",
            field="run.world_size",
            value=ws,
            fix=f"use a multiple of {model_par} ranks",
        )
    dp = ws // model_par if p.dp == "auto" else int(p.dp)
    mb = p.micro_batch
    if p.global_batch is None:
        ga = p.grad_accum or 1
        gb = mb * ga * dp
    else:
        gb = p.global_batch
        if p.grad_accum is None:
            if gb % (mb * dp):
                raise RecipeError(
                    f"global_batch {gb} is not divisible by micro_batch {mb} x dp {dp} = {mb * dp}, "
                    "so grad_accum cannot be derived",
                    field="parallel.global_batch",
                    value=gb,
                    fix=f"use a multiple of {mb * dp} (e.g. {max(1, gb // (mb * dp)) * mb * dp}) "
                    "or change parallel.micro_batch",
                )
            ga = gb // (mb * dp)
        else:
            ga = p.grad_accum
    return ParallelLayout(
        engine=p.engine,
        world_size=ws,
        dp=dp,
        tp=p.tp,
        pp=p.pp,
        vpp=p.vpp,
        ep=p.ep,
        zero=p.zero,
        micro_batch=mb,
        grad_accum=ga,
        global_batch=gb,
        offload_optimizer=p.offload_optimizer,
        offload_params=p.offload_params,
    )
