"""`ParallelLayout`: the one validated parallel-state object of a run.

Computed once from a resolved recipe and passed down explicitly (engines, data sampler, manifest, plan).
Every rule that makes a layout impossible is checked here, before anything launches, and each failure
names the fields, the numbers and the fix.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from tessera.config.schema import Recipe
from tessera.tables.engines import ENGINE_NAMES, ENGINES, Capabilities, capabilities
from tessera.errors import LayoutError, RecipeError

#: ZeRO stages each data-parallel sharding implementation can run: what ``zero_impl: auto`` picks from
#: (megatron-core's DistributedOptimizer shards optimizer state only; torch DDP shards nothing)
ZERO_IMPL_STAGES: dict[str, tuple[int, ...]] = {"deepspeed": (0, 1, 2, 3), "megatron": (0, 1), "ddp": (0,)}

#: the degrees of parallelism of a layout, in the order they are spelled everywhere (names, tags, tables)
LAYOUT_AXES: tuple[str, ...] = ("dp", "tp", "pp", "vpp", "ep")
#: the axes that split the model (all but dp)
MODEL_AXES: tuple[str, ...] = LAYOUT_AXES[1:]

_AXIS_NAMES = {"tp": "tensor parallelism", "pp": "pipeline parallelism", "ep": "expert parallelism"}


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """Degrees of parallelism and batch split for one run: every axis, so that a checkpoint can store
    ``to_dict()`` and rebuild the layout with ``ParallelLayout(**d)``.

    world_size = dp * tp * pp; global_batch = micro_batch * grad_accum * dp. Experts are split over
    ep x etp ranks carved out of dp x tp. The engine's capabilities (``tables/engines.py``) are checked
    on construction, so a layout its engine cannot run does not exist.
    """

    engine: str
    world_size: int
    dp: int
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    #: expert tensor-parallel degree; 0 = megatron-core's default, tp (1 for the engines without TP)
    etp: int = 0
    zero: int = 0
    micro_batch: int = 1
    grad_accum: int = 1
    global_batch: int = 1
    offload_optimizer: bool = False
    offload_params: bool = False
    sequence_parallel: bool = False
    #: who shards the data-parallel state (one of the engine's ``zero_impls``); "auto" = :func:`resolve_auto`
    zero_impl: str = "auto"
    #: activation recompute: none | selective | full (one of the engine's ``recompute``)
    recompute: str = "none"

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise LayoutError(
                "unknown engine",
                field="parallel.engine",
                value=self.engine,
                fix="use one of " + ", ".join(ENGINE_NAMES),
            )
        if self.zero_impl == "auto":
            object.__setattr__(self, "zero_impl", resolve_auto(self.engine, zero=self.zero, tp=self.tp)[0])
        if self.etp == 0:
            object.__setattr__(self, "etp", self.tp)
        check_capabilities(
            self.engine,
            tp=self.tp,
            pp=self.pp,
            ep=self.ep,
            zero=self.zero,
            offload_optimizer=self.offload_optimizer,
            offload_params=self.offload_params,
            zero_impl=self.zero_impl,
            recompute=self.recompute,
        )
        if self.etp < 1 or (self.etp > 1 and not self.caps.tp):
            raise LayoutError(
                f"engine '{self.engine}' cannot split experts over etp={self.etp} ranks",
                field="layout.etp",
                value=self.etp,
                fix="leave etp at its default (0 = tp)",
            )
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
    def uses_deepspeed(self) -> bool:
        """DeepSpeed shards this layout's data-parallel state (every ``deepspeed`` engine layout; a
        ``megatron`` one with ``zero_impl: deepspeed``); the others never import it."""
        return self.zero_impl == "deepspeed"

    @property
    def caps(self) -> Capabilities:
        """What this layout's engine can run (its entry in the capability table)."""
        return capabilities(self.engine)

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
        """One line for logs and the CLI: every axis the engine has (etp with EP, the sharding
        implementation where the engine has a choice, SP with TP), offload and recompute when on, the batch
        split."""
        caps = self.caps
        axes = ["dp", "tp", "pp", "vpp", "ep"] + (["etp"] if caps.ep else []) + ["zero"]
        axes += (["zero_impl"] if len(caps.zero_impls) > 1 else []) + (
            ["sequence_parallel"] if caps.tp else []
        )
        text = f"engine={self.engine} world={self.world_size} "
        text += " ".join(f"{'sp' if a == 'sequence_parallel' else a}={getattr(self, a)}" for a in axes)
        offload = [k for k in ("optimizer", "params") if getattr(self, f"offload_{k}")]
        text += f" offload={'+'.join(offload)}" if offload else ""
        text += f" recompute={self.recompute}" if self.recompute != "none" else ""
        return (
            text
            + f" micro_batch={self.micro_batch} grad_accum={self.grad_accum} global_batch={self.global_batch}"
        )


def _engines_with(test: Any) -> str:
    """The engines whose capabilities pass ``test``, as "a or b" (for the fix of a refusal)."""
    return " or ".join(n for n, spec in ENGINES.items() if test(spec.caps))


def check_capabilities(
    engine: str,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    zero: int = 0,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    zero_impl: str = "auto",
    recompute: str = "none",
) -> None:
    """Refuse what ``engine`` cannot run at all, by its row of the capability table: the rules every
    engine shares. What depends on the model or on combinations (megatron's) is :func:`check_megatron_layout`."""
    spec = ENGINES[engine]
    caps = spec.caps
    for name, deg in (("tp", tp), ("pp", pp), ("ep", ep)):
        if deg > 1 and not getattr(caps, name):
            raise LayoutError(
                f"engine '{engine}' cannot do {name} > 1 ({spec.summary})",
                field=f"parallel.{name}",
                value=deg,
                fix=f"set parallel.{name}: 1, or use parallel.engine: "
                f"{_engines_with(lambda c, n=name: getattr(c, n))} for {_AXIS_NAMES[name]}",
            )
    if (offload_optimizer or offload_params) and not caps.offload:
        where = _engines_with(lambda c: c.offload)
        raise LayoutError(
            f"CPU offload is wired for the {where} engine only",
            field="parallel.offload_optimizer" if offload_optimizer else "parallel.offload_params",
            value=True,
            fix=f"use parallel.engine: {where} for offload",
        )
    if zero not in caps.zero:
        if caps.zero == (0,):
            why = f"engine '{engine}' has no ZeRO sharding ({spec.summary})"
        else:
            why = f"engine '{engine}' runs ZeRO stages {', '.join(map(str, caps.zero))} only"
        nearest = max((z for z in caps.zero if z <= zero), default=min(caps.zero))
        raise LayoutError(
            why,
            field="parallel.zero",
            value=zero,
            fix=f"set parallel.zero: {nearest}, or use parallel.engine: "
            f"{_engines_with(lambda c: zero in c.zero)} for ZeRO-{zero}",
        )
    if recompute not in caps.recompute:
        how = (
            "HF gradient checkpointing, which recomputes whole layers (full) only"
            if caps.hf_module
            else "no activation recompute"
        )
        raise LayoutError(
            f"engine '{engine}' recomputes activations with {how}",
            field="parallel.recompute",
            value=recompute,
            fix=f"set parallel.recompute: {' or '.join(caps.recompute)}, or use parallel.engine: "
            f"{_engines_with(lambda c: recompute in c.recompute)} for {recompute} recompute",
        )
    if zero_impl != "auto" and zero_impl not in caps.zero_impls:
        raise LayoutError(
            f"engine '{engine}' shards data-parallel state with {' or '.join(caps.zero_impls)} only",
            field="parallel.zero_impl",
            value=zero_impl,
            fix="set parallel.zero_impl: auto",
        )


def batch_split(recipe: Recipe) -> tuple[int, int, int, int]:
    """The part of the layout that needs no model, checked: the engine's capabilities, the world size
    against tp x pp, the batch arithmetic. Returns (dp, micro_batch, grad_accum, global_batch)."""
    p, ws = recipe.parallel, recipe.run.world_size
    check_capabilities(
        p.engine,
        tp=p.tp,
        pp=p.pp,
        ep=p.ep,
        zero=p.zero,
        offload_optimizer=p.offload_optimizer,
        offload_params=p.offload_params,
        zero_impl=p.zero_impl,
        recompute=p.recompute,
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
    return dp, mb, ga, gb


def layout_from_recipe(recipe: Recipe) -> ParallelLayout:
    """Derive and validate the layout of ``recipe``; user mistakes raise LayoutError / RecipeError."""
    p, ws = recipe.parallel, recipe.run.world_size
    caps = capabilities(p.engine)
    dp, mb, ga, gb = batch_split(recipe)
    shape = None
    if not caps.hf_module:  # megatron-core's GPTModel, built from the HF config by the family's adapter
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
        etp=p.tp,  # megatron-core's default expert_tensor_parallel_size
        zero=p.zero,
        micro_batch=mb,
        grad_accum=ga,
        global_batch=gb,
        offload_optimizer=p.offload_optimizer,
        offload_params=p.offload_params,
        sequence_parallel=bool(sp),
        zero_impl=zero_impl,
        recompute=p.recompute,
    )
    if shape is not None:
        check_megatron_layout(layout, shape)
    return layout


def recipe_uses_deepspeed(recipe: Recipe) -> bool:
    """:attr:`ParallelLayout.uses_deepspeed` before the layout is derived (a rank that waits while rank 0
    checks the model): the same rule (:func:`resolve_auto`), without reading the model. For ``parallel:
    auto`` the planner has not chosen yet: whether DeepSpeed is one of the engine's implementations."""
    p = recipe.parallel
    if p.auto:
        return "deepspeed" in capabilities(p.engine).zero_impls
    return resolve_auto(p.engine, zero=p.zero, tp=p.tp, zero_impl=p.zero_impl)[0] == "deepspeed"


def resolve_auto(
    engine: str,
    *,
    zero: int,
    tp: int,
    zero_impl: str = "auto",
    sequence_parallel: bool | str = "auto",
    sp_ok: bool = False,
) -> tuple[str, bool]:
    """What ``parallel.zero_impl: auto`` and ``parallel.sequence_parallel: auto`` mean. An engine with one
    sharding implementation uses it (deepspeed: "deepspeed", ddp: "ddp"), without SP. Otherwise auto is the
    first of the engine's implementations that runs the stage (megatron: its own data parallelism for
    zero 0-1, DeepSpeed for 2-3); SP where the layer spec has it (``sp_ok``), tp > 1 and megatron shards
    over dp."""
    impls = capabilities(engine).zero_impls
    if len(impls) == 1:
        return impls[0], bool(sequence_parallel is True)
    if zero_impl == "auto":
        zero_impl = next((i for i in impls if zero in ZERO_IMPL_STAGES.get(i, ())), impls[0])
    sp = sequence_parallel if sequence_parallel != "auto" else (sp_ok and tp > 1 and zero_impl == "megatron")
    return zero_impl, bool(sp)


def check_megatron_layout(layout: ParallelLayout, shape: Any) -> None:
    """Every combination the megatron engine cannot run, with its reason: the one place that decides
    (what the engine cannot run at all, e.g. CPU offload, is in :func:`check_capabilities`).

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
            ep > 1 and (L.dp * tp) % (ep * L.etp) != 0,
            "parallel.ep",
            ep,
            f"ep={ep} does not divide dp={L.dp}: experts are tensor-parallel like the dense layers "
            "(megatron-core's default expert_tensor_parallel = tp), so expert groups are carved out of dp"
            if L.etp == tp
            else f"ep*etp={ep}*{L.etp} does not divide dp*tp={L.dp * tp}",
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
            shape.num_experts > 0 and tp > 1 and not L.sequence_parallel,
            "parallel.tp",
            tp,
            "megatron-core trains MoE layers under tensor parallelism only with sequence parallelism"
            + (
                ""
                if shape.sequence_parallel_ok
                else f", which its local spec has not for {shape.normalization}"
            ),
            "split the experts with parallel.ep instead (tp: 1), or train on the deepspeed engine"
            if not shape.sequence_parallel_ok
            else "set parallel.sequence_parallel: true",
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
    ]
    for broken, field, value, why, fix in rules:
        if broken:
            raise LayoutError(why, field=field, value=value, fix=fix)
