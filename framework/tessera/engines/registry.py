"""Which engines exist and what each one can run: the one capability table.

Pure data with no heavy imports, so that every layer can read it: the recipe schema takes the engine
names from it, the layout rules and the planner take the capabilities, and the worker builds an engine
through :func:`engine_class` without ever branching on its name. Adding an engine is one module under
``engines/`` plus one entry here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What an engine can run. The layout rules refuse anything outside it, the planner enumerates
    only inside it."""

    tp: bool = False  # tensor parallelism (and sequence parallelism where the layer spec has it)
    pp: bool = False  # pipeline parallelism, with virtual stages (interleaved 1F1B)
    ep: bool = False  # expert parallelism for mixture-of-experts families
    zero: tuple[int, ...] = (0,)  # ZeRO stages it can shard data-parallel state with
    offload: bool = False  # DeepSpeed CPU offload of optimizer states / parameters (ZeRO 1-3 / 3)
    #: who shards the data-parallel state, first entry = the default: "deepspeed" (DeepSpeed ZeRO and its
    #: accounting), "megatron" (megatron-core DDP / DistributedOptimizer), "ddp" (torch DDP, full replicas)
    zero_impls: tuple[str, ...] = ("deepspeed",)
    #: trains the HF module itself (HF tensor granularity; its gradient checkpointing is per layer), as
    #: opposed to megatron-core's GPTModel built from the HF config (fused QKV / gate-up, dense vs expert)
    hf_module: bool = True
    recompute: tuple[str, ...] = ("none",)  # activation recompute granularities the engine runs


@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    name: str
    module: str  # where the class lives (imported only when a rank builds the engine)
    cls: str
    caps: Capabilities
    summary: str


ENGINES: dict[str, EngineSpec] = {
    spec.name: spec
    for spec in (
        EngineSpec(
            name="deepspeed",
            module="tessera.engines.deepspeed_engine",
            cls="DeepSpeedEngine",
            caps=Capabilities(
                zero=(0, 1, 2, 3), offload=True, zero_impls=("deepspeed",), recompute=("none", "full")
            ),
            summary="the HF module under DeepSpeed ZeRO 0-3 data parallelism, with CPU offload",
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
        ),
        EngineSpec(
            name="ddp",
            module="tessera.engines.ddp",
            cls="DDPEngine",
            caps=Capabilities(zero=(0,), zero_impls=("ddp",), recompute=("none", "full")),
            summary="the naive baseline: a full HF replica per rank, torch DistributedDataParallel with "
            "its defaults, torch AdamW",
        ),
    )
}
ENGINE_NAMES: tuple[str, ...] = tuple(ENGINES)


def capabilities(engine: str) -> Capabilities:
    return ENGINES[engine].caps


def engine_class(engine: str) -> Any:
    """The engine's class (imports its module: DeepSpeed / megatron-core only when that engine runs)."""
    spec = ENGINES[engine]
    return getattr(importlib.import_module(spec.module), spec.cls)
