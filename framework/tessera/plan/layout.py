"""`ParallelLayout`: the one validated parallel-state object of a run.

Computed once from a resolved recipe and passed down explicitly (engines, data sampler, manifest, plan).
Every rule that makes a layout impossible is checked before anything launches, and each failure names the
fields, the numbers and the fix: here the rules every engine shares (the capability rule set of
:mod:`tessera.tables.engines`) and the batch arithmetic; the rules of one engine that need the model (heads,
layers, experts per rank) in the module its registry entry names (``layout_checks``), called from here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from tessera.config.schema import Recipe
from tessera.errors import LayoutError, RecipeError
from tessera.tables.engines import (
    CAPABILITY_RULES,
    ENGINE_NAMES,
    ENGINES,
    ZERO_IMPLS,
    Capabilities,
    ZeroImpl,
    capabilities,
    engine_hook,
)

#: the degrees of parallelism of a layout, in the order they are spelled everywhere (names, tags, tables)
LAYOUT_AXES: tuple[str, ...] = ("dp", "tp", "pp", "vpp", "ep", "sp")
#: the axes that split the model or the sequence (all but dp)
MODEL_AXES: tuple[str, ...] = LAYOUT_AXES[1:]


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """Degrees of parallelism and batch split for one run: every axis, so that a checkpoint can store
    ``to_dict()`` and rebuild the layout with ``ParallelLayout(**d)``.

    world_size = dp * tp * pp * sp; global_batch = micro_batch * grad_accum * dp. Experts are split over
    ep x etp ranks carved out of dp x tp. The sp (Ulysses) ranks of one group read the same samples, each a
    slice of every sequence. The engine's capabilities (``tables/engines.py``) are checked
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
    #: Ulysses sequence-parallel degree: each sequence split over sp ranks (engines with ``caps.sp``)
    sp: int = 1
    #: DeepSpeed's TiledMLP / the LM head and loss over sequence tiles / checkpoint offload to the host
    tiled_mlp: bool = False
    tiled_loss: bool = False
    offload_activations: bool = False

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
        check_capabilities(self.engine, self)
        if self.etp < 1 or (self.etp > 1 and not self.caps.tp):
            raise LayoutError(
                f"engine '{self.engine}' cannot split experts over etp={self.etp} ranks",
                field="layout.etp",
                value=self.etp,
                fix="leave etp at its default (0 = tp)",
            )
        if self.dp * self.tp * self.pp * self.sp != self.world_size:
            axes = "dp*tp*pp" + ("*sp" if self.sp > 1 else "")
            sizes = "*".join(str(getattr(self, a)) for a in axes.split("*"))
            raise LayoutError(
                f"{axes} = {sizes} = {self.dp * self.tp * self.pp * self.sp} "
                f"is not run.world_size = {self.world_size}",
                field="parallel.dp",
                value=self.dp,
                fix=f"set parallel.dp: auto, or make {axes} equal run.world_size",
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
    def sharding(self) -> ZeroImpl:
        """Who shards this layout's data-parallel state, as facts (its ``zero_impl``'s entry in
        :data:`tessera.tables.engines.ZERO_IMPLS`): what the estimates count by."""
        return ZERO_IMPLS[self.zero_impl]

    @property
    def uses_deepspeed(self) -> bool:
        """DeepSpeed shards this layout's data-parallel state (every ``deepspeed`` engine layout; a
        ``megatron`` one with ``zero_impl: deepspeed``); the others never import it."""
        return self.sharding.deepspeed

    @property
    def data_ranks(self) -> int:
        """Ranks that shard the data-parallel state and reduce the gradients: dp, times sp under Ulysses
        (DeepSpeed's sequence-data-parallel group holds the sp ranks too, dividing the sum by dp)."""
        return self.dp * self.sp

    @property
    def long_sequences(self) -> bool:
        """One of DeepSpeed's long-sequence components runs: Ulysses, a tiled MLP or loss, checkpoint
        offload (the deepspeed engine's objective is then :class:`tessera.engines.ulysses.LongSequences`)."""
        return self.sp > 1 or self.tiled_mlp or self.tiled_loss or self.offload_activations

    def axes_of(self, ranks: Iterable[int]) -> str:
        """The name of a group of ``ranks``: the axes its members differ on (``dp``, ``tp``, ``sp``, or
        combinations like ``tp+dp``); ``world`` for all ranks varying on more than one axis, ``self`` for
        one rank. What the comm accounting names a group by, and the planner its collectives."""
        ranks = list(ranks)
        coords = [self.coords(r) for r in ranks]
        varying = [ax for ax in ("sp", "tp", "dp", "pp") if len({c[ax] for c in coords}) > 1]
        if len(varying) > 1 and len(ranks) == self.world_size:
            return "world"
        return "+".join(varying) or "self"  # a world that is one axis (pp=2 on 2 ranks) is named by it

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
        """Position of global ``rank`` in the grid. Order (fastest first) sp, tp, dp, pp: megatron-core's
        default "tp-cp-ep-dp-pp" without context parallelism (ep groups are carved out of dp x tp), under
        DeepSpeed's Ulysses groups of consecutive ranks (``parallel_state_sp``: sp rank = rank % sp)."""
        r = rank // self.sp
        return {
            "sp": rank % self.sp,
            "tp": r % self.tp,
            "dp": (r // self.tp) % self.dp,
            "pp": r // (self.tp * self.dp),
        }

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
        axes = [*LAYOUT_AXES, *(["etp"] if caps.ep else []), "zero"]
        axes = [a for a in axes if a != "sp" or caps.sp]
        axes += (["zero_impl"] if len(caps.zero_impls) > 1 else []) + (
            ["sequence_parallel"] if caps.tp else []
        )
        text = f"engine={self.engine} world={self.world_size} "
        text += " ".join(
            f"{'seq_parallel' if a == 'sequence_parallel' else a}={getattr(self, a)}" for a in axes
        )
        offload = [k for k in ("optimizer", "params", "activations") if getattr(self, f"offload_{k}")]
        text += f" offload={'+'.join(offload)}" if offload else ""
        text += f" recompute={self.recompute}" if self.recompute != "none" else ""
        tiled = [k for k in ("mlp", "loss") if getattr(self, f"tiled_{k}")]
        text += f" tiled={'+'.join(tiled)}" if tiled else ""
        return (
            text
            + f" micro_batch={self.micro_batch} grad_accum={self.grad_accum} global_batch={self.global_batch}"
        )


def check_capabilities(engine: str, parallel: Any) -> None:
    """Refuse what ``engine`` cannot run at all, by its row of the capability table: the rules every
    engine shares (:data:`tessera.tables.engines.CAPABILITY_RULES`, in their order; a rule without a
    refusal is left to a more precise rule here). ``parallel``: a layout or a recipe's parallel section
    (each rule's key is one of its attributes). What depends on the model or on combinations is the
    engine's own ``layout_checks``."""
    spec = ENGINES[engine]
    for rule in CAPABILITY_RULES:
        value = getattr(parallel, rule.key)
        if rule.refusal is not None and not rule.allows(spec.caps, value):
            why, fix = rule.refusal(spec, value)
            raise LayoutError(why, field=f"parallel.{rule.key}", value=value, fix=fix)


def batch_split(recipe: Recipe) -> tuple[int, int, int, int]:
    """The part of the layout that needs no model, checked: the engine's capabilities, the world size
    against tp x pp, the batch arithmetic. Returns (dp, micro_batch, grad_accum, global_batch)."""
    p, ws = recipe.parallel, recipe.run.world_size
    check_capabilities(p.engine, p)
    if p.vpp > 1 and p.pp == 1:
        raise LayoutError(
            "virtual pipeline stages need pipeline parallelism",
            field="parallel.vpp",
            value=p.vpp,
            fix="set parallel.vpp: 1 or parallel.pp > 1",
        )
    model_par = p.tp * p.pp * p.sp
    if ws % model_par:
        axes = "tp*pp" + ("*sp" if p.sp > 1 else "")
        raise LayoutError(
            f"run.world_size={ws} is not divisible by {axes}={model_par}",
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
    """Derive and validate the layout of ``recipe``; user mistakes raise LayoutError / RecipeError.

    An engine whose layout rules need the model (its entry's ``layout_checks``) reads it first: what the
    engine cannot express fails before the layout is derived, and the model's shape says whether its layers
    have sequence parallelism (``sequence_parallel: auto``); its rules then judge the layout."""
    p, ws = recipe.parallel, recipe.run.world_size
    dp, mb, ga, gb = batch_split(recipe)
    checks = engine_hook(p.engine, "layout_checks")
    shape = checks(recipe) if checks is not None else None
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
        sp=p.sp,
        tiled_mlp=p.tiled_mlp,
        tiled_loss=p.tiled_loss,
        offload_activations=p.offload_activations,
    )
    if checks is not None:
        checks(recipe, layout, shape=shape)
    if layout.sp > 1:
        from tessera.models.hf import load_hf_config
        from tessera.plan.facts import model_facts

        f = model_facts(load_hf_config(recipe.model, vocab_size=recipe.data.vocab_size))
        check_ulysses(layout, num_heads=f.num_heads, num_kv_heads=f.num_kv_heads)
    return layout


def check_ulysses(layout: ParallelLayout, *, num_heads: int, num_kv_heads: int) -> None:
    """What Ulysses sequence parallelism needs of the model (DeepSpeed's ``UlyssesSPAttentionHF``): the
    attention heads split evenly over the sp ranks, and the KV heads too, or replicated evenly (sp a
    multiple of them). The layout and the planner call it; the recipe's own rules (sdpa, no packed
    document boundaries, a sequence cut into sp equal slices) are the schema's."""
    sp = layout.sp
    if sp == 1:
        return
    fits = [k for k in range(2, num_heads + 1) if _ulysses_ok(k, num_heads, num_kv_heads)]
    hint = f"parallel.sp: {' or '.join(map(str, fits[:4]))}" if fits else "parallel.sp: 1"
    if num_heads % sp:
        raise LayoutError(
            f"{num_heads} attention heads cannot be split over parallel.sp={sp} ranks",
            field="parallel.sp",
            value=sp,
            fix=f"use {hint} (with run.world_size a multiple of it)",
        )
    if not _ulysses_ok(sp, num_heads, num_kv_heads):
        raise LayoutError(
            f"{num_kv_heads} KV heads can neither be split over parallel.sp={sp} ranks nor replicated evenly "
            "(sp a multiple of them)",
            field="parallel.sp",
            value=sp,
            fix=f"use {hint} (with run.world_size a multiple of it)",
        )


def _ulysses_ok(sp: int, heads: int, kv: int) -> bool:
    return heads % sp == 0 and (kv % sp == 0 or sp % kv == 0)


def recipe_uses_deepspeed(recipe: Recipe) -> bool:
    """:attr:`ParallelLayout.uses_deepspeed` before the layout is derived (a rank that waits while rank 0
    checks the model): the same rule (:func:`resolve_auto`), without reading the model. For ``parallel:
    auto`` the planner has not chosen yet: whether DeepSpeed is one of the engine's implementations."""
    p = recipe.parallel
    if p.auto:
        return capabilities(p.engine).runs_deepspeed
    return ZERO_IMPLS[resolve_auto(p.engine, zero=p.zero, tp=p.tp, zero_impl=p.zero_impl)[0]].deepspeed


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
    first of the engine's implementations that runs the stage (:attr:`ZeroImpl.stages`; megatron: its own
    data parallelism for zero 0-1, DeepSpeed for 2-3); SP where the layer spec has it (``sp_ok``), tp > 1
    and the implementation reduces the sequence-parallel norm gradients (:attr:`ZeroImpl.sequence_parallel`:
    megatron's)."""
    impls = capabilities(engine).zero_impls
    if len(impls) == 1:
        return impls[0], bool(sequence_parallel is True)
    if zero_impl == "auto":
        zero_impl = next((i for i in impls if zero in ZERO_IMPLS[i].stages), impls[0])
    sp = (
        sequence_parallel
        if sequence_parallel != "auto"
        else (sp_ok and tp > 1 and ZERO_IMPLS[zero_impl].sequence_parallel)
    )
    return zero_impl, bool(sp)
