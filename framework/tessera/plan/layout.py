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
    "megatron": {"tp": True, "pp": True, "ep": True, "available": True},
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
    sequence_parallel: bool = False
    zero_impl: str = "deepspeed"  # engine megatron: "megatron" (DistributedOptimizer) or "deepspeed"

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

    def coords(self, rank: int) -> dict[str, int]:
        """Position of global ``rank`` in the grid. Order (fastest first) tp, dp, pp: megatron-core's
        default "tp-cp-ep-dp-pp" without context parallelism (ep groups are carved out of dp x tp)."""
        return {"tp": rank % self.tp, "dp": (rank // self.tp) % self.dp, "pp": rank // (self.tp * self.dp)}

    def dp_rank(self, rank: int) -> int:
        """The data-parallel rank of global ``rank``: which slice of the global batch it reads."""
        return self.coords(rank)["dp"]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        return (
            f"engine={self.engine} world={self.world_size} dp={self.dp} tp={self.tp} pp={self.pp} "
            f"vpp={self.vpp} ep={self.ep} zero={self.zero}"
            + (
                f" zero_impl={self.zero_impl} sp={self.sequence_parallel}"
                if self.engine == "megatron"
                else ""
            )
            + f" micro_batch={self.micro_batch} grad_accum={self.grad_accum} global_batch={self.global_batch}"
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
    shape = None
    if p.engine == "megatron":
        from tessera.models.hf import load_hf_config
        from tessera.models.megatron import adapter_for

        hf_cfg = load_hf_config(recipe.model, vocab_size=recipe.data.vocab_size)
        adapter = adapter_for(hf_cfg.model_type)
        shape = adapter.shape(hf_cfg)
        adapter.transformer(hf_cfg, recipe.data.seq_len)  # what megatron-core cannot express fails here,
        adapter.gpt(hf_cfg)  # before launch, not on the ranks
    zero_impl, sp = resolve_auto(
        p.engine,
        zero=p.zero,
        tp=p.tp,
        zero_impl=p.zero_impl,
        sequence_parallel=p.sequence_parallel,
        sp_ok=shape is not None and shape.sequence_parallel_ok,
    )
    layout = ParallelLayout(
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
        sequence_parallel=bool(sp),
        zero_impl=zero_impl,
    )
    if shape is not None:
        check_megatron_layout(layout, shape)
    return layout


def resolve_auto(
    engine: str,
    *,
    zero: int,
    tp: int,
    zero_impl: str = "auto",
    sequence_parallel: bool | str = "auto",
    sp_ok: bool = False,
) -> tuple[str, bool]:
    """What ``parallel.zero_impl: auto`` and ``parallel.sequence_parallel: auto`` mean: megatron's own
    data parallelism for zero 0-1 and DeepSpeed for 2-3; SP where the layer spec has it (``sp_ok``),
    tp > 1 and megatron shards over dp. The deepspeed engine is always "deepspeed", without SP."""
    if engine != "megatron":
        return "deepspeed", bool(sequence_parallel is True)
    impl = zero_impl if zero_impl != "auto" else ("megatron" if zero <= 1 else "deepspeed")
    sp = sequence_parallel if sequence_parallel != "auto" else (sp_ok and tp > 1 and impl == "megatron")
    return impl, bool(sp)


def check_megatron_layout(layout: ParallelLayout, shape: Any) -> None:
    """Every combination the megatron engine cannot run, with its reason: the one place that decides.

    ``shape`` is the model's :class:`tessera.models.megatron.ModelShape`.
    """
    L, tp, pp, vpp, ep = layout, layout.tp, layout.pp, layout.vpp, layout.ep
    rules: list[tuple[bool, str, Any, str, str]] = [
        (
            shape.num_heads % tp != 0,
            "parallel.tp",
            tp,
            f"num_attention_heads={shape.num_heads} is not divisible by tp={tp}",
            "set parallel.tp to a divisor of the head count",
        ),
        (
            shape.num_query_groups % tp != 0,
            "parallel.tp",
            tp,
            f"num_key_value_heads={shape.num_query_groups} is not divisible by tp={tp} (each TP rank needs "
            "whole KV heads)",
            "set parallel.tp to a divisor of the KV head count",
        ),
        (
            shape.num_layers % (pp * vpp) != 0,
            "parallel.pp",
            pp,
            f"num_hidden_layers={shape.num_layers} is not divisible by pp*vpp={pp}*{vpp}={pp * vpp}",
            "choose pp and vpp whose product divides the layer count",
        ),
        (
            ep > 1 and shape.num_experts == 0,
            "parallel.ep",
            ep,
            "expert parallelism needs a mixture-of-experts model",
            "set parallel.ep: 1",
        ),
        (
            ep > 1 and shape.num_experts % ep != 0,
            "parallel.ep",
            ep,
            f"num_local_experts={shape.num_experts} is not divisible by ep={ep}",
            "set parallel.ep to a divisor of the expert count",
        ),
        (
            ep > 1 and L.dp % ep != 0,
            "parallel.ep",
            ep,
            f"ep={ep} does not divide dp={L.dp}: experts are tensor-parallel like the dense layers "
            "(megatron-core's default expert_tensor_parallel = tp), so expert groups are carved out of dp",
            "set parallel.ep to a divisor of dp (raise dp or lower tp)",
        ),
        (
            L.zero >= 2 and pp > 1,
            "parallel.zero",
            L.zero,
            f"ZeRO-{L.zero} shards gradients across micro-batches, which pipeline parallelism (pp={pp}) "
            "accumulates per stage; no engine composes them",
            "use parallel.zero: 1 (megatron's distributed optimizer) with pp > 1, or pp: 1",
        ),
        (
            L.zero_impl == "deepspeed" and pp > 1,
            "parallel.zero_impl",
            "deepspeed",
            "DeepSpeed ZeRO is composed with megatron-core only without pipeline parallelism",
            "set parallel.zero_impl: megatron (or auto) with parallel.zero 0 or 1",
        ),
        (
            L.zero_impl == "megatron" and L.zero >= 2,
            "parallel.zero",
            L.zero,
            "megatron-core's distributed optimizer shards optimizer state only (ZeRO-1)",
            "use parallel.zero_impl: deepspeed (or auto) for ZeRO-2/3, or parallel.zero: 1",
        ),
        (
            L.zero_impl == "deepspeed" and L.zero == 0,
            "parallel.zero_impl",
            "deepspeed",
            "DeepSpeed without ZeRO adds nothing to megatron's own data parallelism",
            "set parallel.zero_impl: auto (megatron DDP for zero 0)",
        ),
        (
            L.sequence_parallel and tp == 1,
            "parallel.sequence_parallel",
            True,
            "sequence parallelism splits the TP regions, and tp=1 has none",
            "set it to auto or false",
        ),
        (
            L.sequence_parallel and not shape.sequence_parallel_ok,
            "parallel.sequence_parallel",
            True,
            f"megatron-core's local layer spec has no sequence-parallel {shape.normalization} (it needs "
            "Apex's FusedLayerNorm, and RMSNorm needs TransformerEngine)",
            "set it to auto or false",
        ),
        (
            L.sequence_parallel and L.zero_impl == "deepspeed",
            "parallel.sequence_parallel",
            True,
            "DeepSpeed does not all-reduce the sequence-parallel norm gradients across TP ranks",
            "set parallel.sequence_parallel: false (or auto) with DeepSpeed ZeRO",
        ),
        (
            vpp > 1 and L.grad_accum % pp != 0,
            "parallel.grad_accum",
            L.grad_accum,
            f"the interleaved schedule needs the micro-batch count ({L.grad_accum}) divisible by pp={pp}",
            f"use a grad_accum multiple of {pp} (raise parallel.global_batch)",
        ),
        (
            L.offload_optimizer or L.offload_params,
            "parallel.offload_optimizer",
            True,
            "CPU offload is wired for the deepspeed engine only",
            "use parallel.engine: deepspeed for offload",
        ),
    ]
    for broken, field, value, why, fix in rules:
        if broken:
            raise LayoutError(why, field=field, value=value, fix=fix)
