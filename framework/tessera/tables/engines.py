"""Which engines exist and everything that is specific to each: the engine registry.

Pure data with no heavy imports, on the ground floor, so that every layer can read it without importing
engine code: the recipe schema takes the engine names from it, the recipe loader and the layout rules
read one capability rule set (:data:`CAPABILITY_RULES`), the planner counts model states by the ZeRO
implementation's facts (:data:`ZERO_IMPLS`), and the worker, the checkpoint reader, the launcher's checks
and the resharding path reach an engine's code only through the dotted names of its entry (imported when
used: DeepSpeed / megatron-core only where that engine runs). Nothing outside ``engines/`` and this table
compares an engine name or a checkpoint's sharding string.

Adding an engine is one module under ``engines/`` (or anywhere importable) plus one entry: here for the
engines Tessera ships, or :func:`register` called by a module named in ``TESSERA_ENGINES`` (comma-
separated; imported when this table is) or by an entry point of the group ``tessera.engines`` whose
object is an :class:`EngineSpec`.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: the environment variable naming modules that register engines of their own (imported at load)
PLUGIN_ENV = "TESSERA_ENGINES"
#: the entry-point group whose objects are :class:`EngineSpec` s of installed packages
ENTRY_POINT_GROUP = "tessera.engines"


@dataclass(frozen=True, kw_only=True)
class ZeroImpl:
    """Who shards the data-parallel state, as facts the planner and the layout rules read (never the name)."""

    name: str
    #: the ZeRO stages it runs: what ``zero_impl: auto`` picks from
    stages: tuple[int, ...]
    #: DeepSpeed ZeRO: the run imports DeepSpeed, takes ``parallel.deepspeed_config``, and its state, buckets
    #: and collectives are counted the DeepSpeed way (two parameter groups, persistent small tensors)
    deepspeed: bool = False
    #: no sharding at all: a full replica per rank, fp32 gradients all-reduced once per step in torch DDP's
    #: buckets, which the reducer holds as a flat copy
    replicas: bool = False
    #: all-reduces megatron-core's sequence-parallel norm gradients over the TP group (DeepSpeed does not)
    sequence_parallel: bool = False
    summary: str


ZERO_IMPLS: dict[str, ZeroImpl] = {
    z.name: z
    for z in (
        ZeroImpl(
            name="deepspeed",
            stages=(0, 1, 2, 3),
            deepspeed=True,
            summary="DeepSpeed ZeRO 0-3 (optimizer states, gradients, parameters), with CPU offload",
        ),
        ZeroImpl(
            name="megatron",
            stages=(0, 1),
            sequence_parallel=True,
            summary="megatron-core DDP, and its DistributedOptimizer for ZeRO-1 (optimizer state only)",
        ),
        ZeroImpl(name="ddp", stages=(0,), replicas=True, summary="torch DDP: full replicas, nothing sharded"),
    )
}


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What an engine can run. The layout rules refuse anything outside it, the planner enumerates
    only inside it."""

    tp: bool = False  # tensor parallelism (and sequence parallelism where the layer spec has it)
    pp: bool = False  # pipeline parallelism, with virtual stages (interleaved 1F1B)
    ep: bool = False  # expert parallelism for mixture-of-experts families
    zero: tuple[int, ...] = (0,)  # ZeRO stages it can shard data-parallel state with
    offload: bool = False  # DeepSpeed CPU offload of optimizer states / parameters (ZeRO 1-3 / 3)
    #: who shards the data-parallel state (keys of :data:`ZERO_IMPLS`), first entry = the default
    zero_impls: tuple[str, ...] = ("deepspeed",)
    #: trains the HF module itself (HF tensor granularity; its gradient checkpointing is per layer), as
    #: opposed to megatron-core's GPTModel built from the HF config (fused QKV / gate-up, dense vs expert)
    hf_module: bool = True
    recompute: tuple[str, ...] = ("none",)  # activation recompute granularities the engine runs
    #: Ulysses sequence parallelism, tiled MLP / loss and checkpoint offload on the HF module (DeepSpeed's
    #: ALST components: the heads split over the sp group by all-to-all, every token's work otherwise local)
    sp: bool = False

    @property
    def runs_deepspeed(self) -> bool:
        """One of its sharding implementations is DeepSpeed's (a DeepSpeed JSON can apply)."""
        return any(ZERO_IMPLS[i].deepspeed for i in self.zero_impls)


@dataclass(frozen=True, kw_only=True)
class CapabilityRule:
    """One ``parallel.<key>`` an engine may not be able to run: whether ``caps`` allows ``value``, the
    value the engine falls back to, and the refusal's words. The recipe loader reads these to fit an
    inherited value to a newly chosen engine; the layout rules read them to refuse a given one."""

    key: str
    allows: Callable[[Capabilities, Any], bool]
    default: Callable[[Capabilities], Any]
    #: the refusal: (why, fix) from (engine spec, value); None = refused by a more precise layout rule
    refusal: Callable[[EngineSpec, Any], tuple[str, str]] | None = None


def adapters_refusal(engine: str, zero_impl: str) -> Any:
    """Why adapters cannot train under ``engine`` with ``zero_impl`` (a RecipeError to raise), or None.
    Adapters on megatron-core's linears train under megatron's own data parallelism: DeepSpeed ZeRO over
    its modules would not sum the adapters' sequence-parallel gradients over TP."""
    from tessera.errors import RecipeError

    impl = ZERO_IMPLS.get(zero_impl)
    if ENGINES[engine].caps.hf_module or impl is None or not impl.deepspeed:
        return None
    return RecipeError(
        f"adapters on engine '{engine}' train under megatron's own data parallelism only",
        field="parallel.zero_impl",
        value=zero_impl,
        fix="parallel.zero_impl=megatron (ZeRO-1 is its distributed optimizer), or parallel.engine: "
        "deepspeed for ZeRO 2-3 over the HF module",
    )


def engines_with(test: Callable[[Capabilities], bool]) -> str:
    """The engines whose capabilities pass ``test``, as "a or b" (for the fix of a refusal)."""
    return " or ".join(n for n, spec in ENGINES.items() if test(spec.caps))


_AXIS_WORDS = {"tp": "tensor parallelism", "pp": "pipeline parallelism", "ep": "expert parallelism"}


def _axis_rule(key: str) -> CapabilityRule:
    return CapabilityRule(
        key=key,
        allows=lambda c, v: getattr(c, key) or v <= 1,
        default=lambda c: 1,
        refusal=lambda s, v: (
            f"engine '{s.name}' cannot do {key} > 1 ({s.summary})",
            f"set parallel.{key}: 1, or use parallel.engine: "
            f"{engines_with(lambda c: getattr(c, key))} for {_AXIS_WORDS[key]}",
        ),
    )


def _offload_refusal(s: EngineSpec, v: Any) -> tuple[str, str]:
    where = engines_with(lambda c: c.offload)
    return f"CPU offload is wired for the {where} engine only", f"use parallel.engine: {where} for offload"


def _zero_refusal(s: EngineSpec, zero: Any) -> tuple[str, str]:
    caps = s.caps
    if caps.zero == (0,):
        why = f"engine '{s.name}' has no ZeRO sharding ({s.summary})"
    else:
        why = f"engine '{s.name}' runs ZeRO stages {', '.join(map(str, caps.zero))} only"
    nearest = max((z for z in caps.zero if z <= zero), default=min(caps.zero))
    return why, (
        f"set parallel.zero: {nearest}, or use parallel.engine: "
        f"{engines_with(lambda c: zero in c.zero)} for ZeRO-{zero}"
    )


def _recompute_refusal(s: EngineSpec, recompute: Any) -> tuple[str, str]:
    caps = s.caps
    how = (
        "HF gradient checkpointing, which recomputes whole layers (full) only"
        if caps.hf_module
        else "no activation recompute"
    )
    return f"engine '{s.name}' recomputes activations with {how}", (
        f"set parallel.recompute: {' or '.join(caps.recompute)}, or use parallel.engine: "
        f"{engines_with(lambda c: recompute in c.recompute)} for {recompute} recompute"
    )


def _sp_refusal(s: EngineSpec, sp: Any) -> tuple[str, str]:
    where = engines_with(lambda c: c.sp)
    if s.caps.tp:  # megatron-core splits long sequences its own way
        return (
            f"engine '{s.name}' has no Ulysses sequence parallelism ({s.summary})",
            f"set parallel.sp: 1 and split the sequence with megatron's own sequence parallelism "
            f"(parallel.tp: {sp} with parallel.sequence_parallel: true), or use parallel.engine: {where} "
            f"with parallel.sp: {sp}",
        )
    return (
        f"engine '{s.name}' has no Ulysses sequence parallelism ({s.summary})",
        f"set parallel.sp: 1, or use parallel.engine: {where} (e.g. parallel.zero: 2 with parallel.sp: {sp})",
    )


def _alst_rule(key: str, what: str) -> CapabilityRule:
    """A switch of DeepSpeed's long-sequence components (tiled MLP / loss, checkpoint offload)."""
    return CapabilityRule(
        key=key,
        allows=lambda c, v: c.sp or not v,
        default=lambda c: False,
        refusal=lambda s, v: (
            f"engine '{s.name}' has no {what} (DeepSpeed's long-sequence components on the HF module)",
            f"set parallel.{key}: false, or use parallel.engine: {engines_with(lambda c: c.sp)}",
        ),
    )


#: the one capability -> recipe-field rule set, in the order the layout rules check them
CAPABILITY_RULES: tuple[CapabilityRule, ...] = (
    _axis_rule("tp"),
    _axis_rule("pp"),
    _axis_rule("ep"),
    # virtual stages without pipeline stages: the layout's own rule says it more precisely
    CapabilityRule(key="vpp", allows=lambda c, v: c.pp or v == 1, default=lambda c: 1),
    CapabilityRule(
        key="offload_optimizer",
        allows=lambda c, v: c.offload or not v,
        default=lambda c: False,
        refusal=_offload_refusal,
    ),
    CapabilityRule(
        key="offload_params",
        allows=lambda c, v: c.offload or not v,
        default=lambda c: False,
        refusal=_offload_refusal,
    ),
    CapabilityRule(
        key="zero", allows=lambda c, v: v in c.zero, default=lambda c: c.zero[0], refusal=_zero_refusal
    ),
    CapabilityRule(
        key="recompute",
        allows=lambda c, v: v in c.recompute,
        default=lambda c: "none",
        refusal=_recompute_refusal,
    ),
    CapabilityRule(key="sp", allows=lambda c, v: c.sp or v <= 1, default=lambda c: 1, refusal=_sp_refusal),
    _alst_rule("tiled_mlp", "tiled MLP"),
    _alst_rule("tiled_loss", "tiled loss"),
    _alst_rule("offload_activations", "activation checkpoint offload"),
    CapabilityRule(
        key="zero_impl",
        allows=lambda c, v: v == "auto" or v in c.zero_impls,
        default=lambda c: "auto",
        refusal=lambda s, v: (
            f"engine '{s.name}' shards data-parallel state with {' or '.join(s.caps.zero_impls)} only",
            "set parallel.zero_impl: auto",
        ),
    ),
)


@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    """One engine: where its code is and what only it knows. Every reference is a dotted name
    ``"module:attribute"`` (or a module for ``module``), imported when it is used (:func:`hook`)."""

    name: str
    module: str  # where the class lives (imported only when a rank builds the engine)
    cls: str
    caps: Capabilities
    summary: str
    #: the libraries that do its work, in the words of a claim ("over DeepSpeed ZeRO-2")
    libraries: str
    #: its offline checkpoint reader: an object with ``weights(ckpt, meta)``, ``moment(ckpt, meta, kind)``
    #: and ``adam_step(ckpt, meta)`` (:class:`tessera.engines.base.CheckpointReader`)
    reader: str
    #: ``fn(recipe, layout=None, *, shape=None) -> shape``: the layout rules that need the model (heads,
    #: layers, experts per rank); raises LayoutError. Without a layout it reads the model (what the engine
    #: cannot express fails there; the shape's ``sequence_parallel_ok`` decides ``sequence_parallel: auto``);
    #: with a layout, the rules; the planner passes the shape it has (recipe None). None: the capability
    #: rules are all.
    layout_checks: str | None = None
    #: ``fn(recipe, layout, *, device, read_model)``: what its launch needs checked before any rank starts
    #: (the DeepSpeed JSON); ``read_model`` False when the model's config must not be read yet
    prelaunch: str | None = None
    #: ``fn(meta, layout) -> bool``: the engine loads checkpoint ``meta`` at ``layout`` itself, resharding
    #: it (``Engine.load_resharded``), with no layout-free stage. None: always through the stage.
    reshard_on_load: str | None = None
    #: ``fn(recipe, layout, *, from_hf) -> class | None``: the class that writes a ``tessera convert`` at
    #: that layout without the model in memory (built as the engine is), from an HF directory (``from_hf``)
    #: or from a checkpoint's layout-free stage, or None: the engine itself
    writer: str | None = None


ENGINES: dict[str, EngineSpec] = {
    spec.name: spec
    for spec in (
        EngineSpec(
            name="deepspeed",
            module="tessera.engines.deepspeed_engine",
            cls="DeepSpeedEngine",
            caps=Capabilities(
                zero=(0, 1, 2, 3),
                offload=True,
                zero_impls=("deepspeed",),
                recompute=("none", "full"),
                sp=True,
            ),
            summary="the HF module under DeepSpeed ZeRO 0-3 data parallelism, with CPU offload and Ulysses "
            "sequence parallelism",
            libraries="DeepSpeed",
            reader="tessera.engines.zero_reader:READER",
            prelaunch="tessera.engines.ds_config:check_before_launch",
            writer="tessera.engines.zero_writer:writer_for",
        ),
        EngineSpec(
            name="megatron",
            module="tessera.engines.megatron_engine",
            cls="MegatronEngine",
            caps=Capabilities(
                tp=True,
                pp=True,
                ep=True,
                zero=(0, 1, 2, 3),
                zero_impls=("megatron", "deepspeed"),
                hf_module=False,
                recompute=("none", "selective", "full"),
            ),
            summary="megatron-core GPTModel: TP / SP / PP / EP; ZeRO-1 by its distributed optimizer, "
            "ZeRO 1-3 by DeepSpeed over its dp group (pp = 1)",
            libraries="megatron-core",
            reader="tessera.engines.megatron_reader:READER",
            layout_checks="tessera.engines.megatron_layout:check_layout",
            prelaunch="tessera.engines.megatron_layout:check_before_launch",
            reshard_on_load="tessera.engines.megatron_reader:reshards_on_load",
            writer="tessera.engines.megatron_writer:writer_for",
        ),
        EngineSpec(
            name="ddp",
            module="tessera.engines.ddp",
            cls="DDPEngine",
            caps=Capabilities(zero=(0,), zero_impls=("ddp",), recompute=("none", "full")),
            summary="the naive baseline: a full HF replica per rank, torch DistributedDataParallel with "
            "its defaults, torch AdamW",
            libraries="torch DDP",
            reader="tessera.engines.ddp_reader:READER",
        ),
    )
}
#: the engine of the naive data-parallel baseline every comparison is judged against
BASELINE_ENGINE = "ddp"


def register(spec: EngineSpec) -> None:
    """Add an engine (a plugin's): one entry, checked like the shipped ones."""
    if spec.name in ENGINES and ENGINES[spec.name] != spec:
        raise ValueError(f"engine {spec.name!r} is registered twice")
    unknown = [i for i in spec.caps.zero_impls if i not in ZERO_IMPLS]
    if unknown:
        raise ValueError(
            f"engine {spec.name!r}: unknown zero_impls {unknown}; known: {', '.join(ZERO_IMPLS)}"
        )
    ENGINES[spec.name] = spec


def _load_plugins() -> None:
    for mod in filter(None, (m.strip() for m in os.environ.get(PLUGIN_ENV, "").split(","))):
        importlib.import_module(mod)
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        register(ep.load())


_load_plugins()
ENGINE_NAMES: tuple[str, ...] = tuple(ENGINES)


def capabilities(engine: str) -> Capabilities:
    return ENGINES[engine].caps


def hook(ref: str) -> Any:
    """The object a dotted ``"module:attribute"`` of an entry names (its module imported now)."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def engine_hook(engine: str, what: str) -> Any | None:
    """Engine ``engine``'s ``what`` (``reader``, ``layout_checks``, ``prelaunch``, ``reshard_on_load``, ``writer``),
    imported; None where the entry has none."""
    ref = getattr(ENGINES[engine], what)
    return hook(ref) if ref else None


def engine_class(engine: str) -> Any:
    """The engine's class (imports its module: DeepSpeed / megatron-core only when that engine runs)."""
    spec = ENGINES[engine]
    return getattr(importlib.import_module(spec.module), spec.cls)
