"""The megatron engine's layout rules that need the model, and its checks before launch: what its registry
entry (:mod:`tessera.tables.engines`) names as ``layout_checks`` and ``prelaunch``.

megatron-core's GPTModel is built from the HF config by the family's adapter, so whether a layout runs
depends on the model (heads and KV heads per TP rank, layers per pipeline chunk, experts per EP rank,
sequence parallelism in its local layer spec) and on combinations only this engine has (ZeRO by its
distributed optimizer or by DeepSpeed over its dp group). Every such rule is here, the one place that
decides; what the engine cannot run at all (e.g. CPU offload) is the capability rule set's.

Used before launch by the command line and the planner: nothing here imports megatron-core, and torch /
transformers only when the model's config is read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tessera.errors import LayoutError
from tessera.tables.engines import engines_with

if TYPE_CHECKING:
    from tessera.config.schema import Recipe
    from tessera.models.megatron import ModelShape
    from tessera.plan.layout import ParallelLayout


def read_shape(recipe: Recipe) -> ModelShape:
    """The model's shape, read from its HF config by the family's adapter; what megatron-core cannot
    express (the adapter's TransformerConfig and GPTModel arguments) fails here, before launch, not on the
    ranks. A family without an adapter gets its generic shape, which :func:`check_rules` refuses."""
    from tessera.models.hf import load_hf_config
    from tessera.models.megatron import adapter_for
    from tessera.tables.families import family_of

    hf_cfg = load_hf_config(recipe.model, vocab_size=recipe.data.vocab_size)
    fam = family_of(hf_cfg.model_type)
    if fam.adapter is None:
        from tessera.plan.facts import generic_shape

        return generic_shape(hf_cfg, fam)
    adapter = adapter_for(hf_cfg.model_type)
    shape = adapter.shape(hf_cfg)
    adapter.transformer(hf_cfg, recipe.data.seq_len)
    adapter.gpt(hf_cfg)
    return shape


def check_layout(
    recipe: Recipe | None, layout: ParallelLayout | None = None, *, shape: ModelShape | None = None
) -> ModelShape:
    """The registry's ``layout_checks``. :func:`tessera.plan.layout.layout_from_recipe` calls it twice:
    without a layout first, which reads the model (:func:`read_shape`) before the layout is derived (its
    ``sequence_parallel: auto`` needs the shape's ``sequence_parallel_ok``), then with the layout and that
    shape (:func:`check_rules`). The planner passes the shape it has already (``recipe`` None), so no
    candidate reads the config again. Returns the shape."""
    if shape is None:
        if recipe is None:
            raise ValueError("check_layout needs the recipe or the model's shape")
        shape = read_shape(recipe)
    if layout is not None:
        check_rules(layout, shape)
    return shape


def check_before_launch(recipe: Recipe, layout: ParallelLayout, *, device: str, read_model: bool) -> None:
    """The registry's ``prelaunch``: the user's DeepSpeed JSON (``parallel.deepspeed_config``), checked by
    the function that merges it on the ranks. Only where the model's config may be read (rank 0, a dry
    run): a megatron layout is derived from the model, so the command line leaves it to rank 0."""
    if not read_model:
        return
    from tessera.engines.ds_config import build_ds_config

    build_ds_config(recipe, layout, device=device, read_model=True)


def check_rules(layout: ParallelLayout, shape: ModelShape) -> None:
    """Every combination the megatron engine cannot run with this model, with its reason."""
    L, tp, pp, vpp, ep = layout, layout.tp, layout.pp, layout.vpp, layout.ep
    rules: list[tuple[bool, str, Any, str, str]] = [
        (
            not shape.megatron_adapter,
            "parallel.engine",
            "megatron",
            f"megatron-core has no adapter for {shape.missing_adapter}",
            f"use parallel.engine: {engines_with(lambda c: c.hf_module)} (they train the HF module of any "
            "causal LM)",
        ),
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
            "megatron-core trains MoE layers under tensor parallelism only with sequence parallelism",
            "set parallel.sequence_parallel: true (or auto), or split the experts with parallel.ep (tp: 1)",
        ),
        (
            L.sequence_parallel and tp == 1,
            "parallel.sequence_parallel",
            True,
            "sequence parallelism splits the TP regions, and tp=1 has none",
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
            shape.qk_norm and tp > 1 and L.zero_impl == "deepspeed",
            "parallel.zero_impl",
            "deepspeed",
            "each TP rank normalises its own query / key heads, and DeepSpeed does not all-reduce those "
            "norms' gradients across TP ranks (megatron's finalize_model_grads does)",
            "set parallel.zero: 0 or 1 (megatron's data parallelism), or parallel.tp: 1, or use "
            "parallel.engine: deepspeed",
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
