"""The two registries: the engine capability table as the layout rules apply it, and the family registry
as the schema, the loader and the planner read it (no process group)."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from helpers import DEFAULT_RECIPE, REPO
from tessera.config.loader import load_recipe
from tessera.config.schema import ModelSection
from tessera.errors import LayoutError, RecipeError
from tessera.models.hf import load_hf_config
from tessera.models.megatron import ADAPTERS, adapter_for
from tessera.plan.estimate import count_params
from tessera.plan.facts import model_facts
from tessera.plan.layout import ParallelLayout, layout_from_recipe
from tessera.tables.engines import ENGINE_NAMES, capabilities
from tessera.tables.families import FAMILIES, FAMILY_NAMES, MEGATRON_FAMILIES, MODEL_TYPES, family_of

MCORE = REPO / "recipes" / "tiny-llama-cpu-mcore-tp2.yaml"

# ---- engine capabilities -----------------------------------------------------------------------------

REFUSED = [
    # (recipe, overrides, field, words in the message, words in the fix)
    (
        DEFAULT_RECIPE,
        ["parallel.engine=ddp", "parallel.zero=0", "parallel.tp=2"],
        "parallel.tp",
        ["engine 'ddp' cannot do tp > 1", "naive baseline"],
        ["parallel.tp: 1", "parallel.engine: megatron"],
    ),
    (
        DEFAULT_RECIPE,
        ["parallel.engine=ddp", "parallel.zero=0", "parallel.pp=2"],
        "parallel.pp",
        ["engine 'ddp' cannot do pp > 1"],
        ["parallel.pp: 1", "parallel.engine: megatron"],
    ),
    (
        DEFAULT_RECIPE,
        ["parallel.engine=ddp", "parallel.zero=2"],
        "parallel.zero",
        ["engine 'ddp' has no ZeRO sharding", "naive baseline"],
        ["set parallel.zero: 0", "parallel.engine: deepspeed"],
    ),
    (
        DEFAULT_RECIPE,
        ["parallel.engine=ddp", "parallel.zero=1", "parallel.offload_optimizer=true"],
        "parallel.offload_optimizer",
        ["CPU offload is wired for the deepspeed engine only"],
        ["parallel.engine: deepspeed"],
    ),
    (
        DEFAULT_RECIPE,
        ["parallel.engine=ddp", "parallel.zero=0", "parallel.zero_impl=deepspeed"],
        "parallel.zero_impl",
        ["engine 'ddp' shards data-parallel state with ddp only"],
        ["parallel.zero_impl: auto"],
    ),
    (
        DEFAULT_RECIPE,
        ["parallel.tp=2"],
        "parallel.tp",
        ["engine 'deepspeed' cannot do tp > 1"],
        ["parallel.engine: megatron"],
    ),
    (
        DEFAULT_RECIPE,
        ["parallel.zero_impl=megatron"],
        "parallel.zero_impl",
        ["engine 'deepspeed' shards data-parallel state with deepspeed only"],
        ["auto"],
    ),
    (
        MCORE,
        ["parallel.zero=3", "parallel.offload_params=true"],
        "parallel.offload_params",
        ["CPU offload is wired for the deepspeed engine only"],
        ["use parallel.engine: deepspeed for offload"],
    ),
]


@pytest.mark.parametrize(
    ("recipe", "overrides", "field", "why", "fix"), REFUSED, ids=[str(r[1]) for r in REFUSED]
)
def test_capability_refusals_name_field_value_and_fix(recipe, overrides, field, why, fix):
    r = load_recipe(recipe, overrides).recipe
    with pytest.raises(LayoutError) as e:
        layout_from_recipe(r)
    assert e.value.field == field
    for w in why:
        assert w in e.value.message, (w, e.value.message)
    for w in fix:
        assert w in (e.value.fix or ""), (w, e.value.fix)


def test_a_layout_outside_its_engines_capabilities_cannot_be_built():
    with pytest.raises(LayoutError, match="cannot do tp > 1"):
        ParallelLayout(engine="ddp", world_size=2, dp=1, tp=2)
    with pytest.raises(LayoutError, match="has no ZeRO sharding"):
        ParallelLayout(engine="ddp", world_size=2, dp=2, global_batch=2, zero=1)
    with pytest.raises(LayoutError, match="unknown engine"):
        ParallelLayout(engine="fsdp", world_size=1, dp=1)


def test_ddp_recipe_layout_and_auto_choices():
    lay = layout_from_recipe(load_recipe(DEFAULT_RECIPE, ["parallel.engine=ddp", "parallel.zero=0"]).recipe)
    assert (lay.engine, lay.dp, lay.zero, lay.zero_impl, lay.etp) == ("ddp", 2, 0, "ddp", 1)
    assert "zero_impl" not in lay.describe() and "etp" not in lay.describe()
    assert layout_from_recipe(load_recipe(DEFAULT_RECIPE).recipe).zero_impl == "deepspeed"
    # megatron keeps its rule: its own data parallelism for ZeRO 0-1, DeepSpeed for 2-3
    for zero, impl in ((0, "megatron"), (1, "megatron"), (2, "deepspeed"), (3, "deepspeed")):
        assert ParallelLayout(engine="megatron", world_size=2, dp=1, tp=2, zero=zero).zero_impl == impl


def test_layout_dict_has_every_axis_and_round_trips():
    lay = layout_from_recipe(load_recipe(MCORE).recipe)
    d = lay.to_dict()
    assert {"dp", "tp", "pp", "vpp", "ep", "etp", "zero", "zero_impl"} <= set(d)
    assert d["etp"] == lay.tp == 2  # megatron-core's default expert_tensor_parallel_size
    assert ParallelLayout(**d) == lay
    assert "etp=2" in lay.describe()
    ds = layout_from_recipe(load_recipe(DEFAULT_RECIPE).recipe)
    assert ds.etp == 1 and ParallelLayout(**ds.to_dict()) == ds


def test_schema_takes_the_engine_names_from_the_table():
    for name in ENGINE_NAMES:
        assert load_recipe(
            DEFAULT_RECIPE, [f"parallel.engine={name}", "parallel.zero=0"]
        ).recipe.parallel.engine
    with pytest.raises(RecipeError) as e:
        load_recipe(DEFAULT_RECIPE, ["parallel.engine=fsdp"])
    assert all(n in str(e.value) for n in ENGINE_NAMES)


def test_every_engine_can_run_plain_data_parallelism():
    """The table's invariant the planner and the fixes rely on: ZeRO-0 and one sharding implementation."""
    for name in ENGINE_NAMES:
        caps = capabilities(name)
        assert 0 in caps.zero and caps.zero_impls and "none" in caps.recompute


def test_every_entry_hook_resolves_and_the_registry_checks_a_new_entry(tmp_path):
    """Every dotted name of every shipped entry imports to a callable (reader: a CheckpointReader); a
    checkpoint of an engine nobody registered is one error naming the engine and the plugin variable; a
    second entry under a taken name, or one naming an unknown ZeRO implementation, is refused."""
    from tessera.checkpoint.reader import reader_of
    from tessera.engines.base import CheckpointReader
    from tessera.errors import CheckpointError
    from tessera.tables.engines import ENGINES, PLUGIN_ENV, Capabilities, EngineSpec, engine_hook, register

    for name, spec in ENGINES.items():
        assert isinstance(engine_hook(name, "reader"), CheckpointReader), name
        for what in ("layout_checks", "prelaunch", "reshard_on_load"):
            assert getattr(spec, what) is None or callable(engine_hook(name, what)), (name, what)
    with pytest.raises(CheckpointError) as e:
        reader_of(tmp_path, {"engine": "nosuch"})
    assert "'nosuch'" in e.value.message and PLUGIN_ENV in e.value.fix
    taken = dataclasses.replace(ENGINES["ddp"], summary="another ddp")
    with pytest.raises(ValueError, match="registered twice"):
        register(taken)
    odd = EngineSpec(
        name="odd", module="m", cls="C", caps=Capabilities(zero_impls=("fsdp",)), summary="", libraries="",
        reader="m:R",
    )  # fmt: skip
    with pytest.raises(ValueError, match="unknown zero_impls"):
        register(odd)
    assert "odd" not in ENGINES


# ---- families ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_every_family_has_its_tiny_config_recipe_and_adapter_if_megatron_builds_it(name):
    fam = FAMILIES[name]
    section = ModelSection(**yaml.safe_load((REPO / fam.tiny_config).read_text())["model"])
    cfg = load_hf_config(section)
    assert cfg.model_type in fam.model_types and family_of(cfg.model_type) is fam
    assert model_facts(cfg).family == name
    recipe = load_recipe(REPO / fam.tiny_recipe).recipe
    assert load_hf_config(recipe.model).model_type in fam.model_types
    if name in MEGATRON_FAMILIES:
        assert fam.adapter in ADAPTERS and adapter_for(cfg.model_type) is ADAPTERS[fam.adapter]
        return
    assert fam.adapter is None and fam.generic
    with pytest.raises(RecipeError) as e:  # refused before launch, naming the engines that run it
        adapter_for(cfg.model_type)
    assert e.value.field == "parallel.engine" and e.value.value == "megatron"
    assert "deepspeed" in e.value.fix and "ddp" in e.value.fix


def test_any_causal_lm_transformers_builds_is_a_generic_family_and_others_are_refused():
    """A model_type without an entry that AutoModelForCausalLM builds (here Falcon) gets a generic family
    (no adapter, counted on the meta device); one it does not build (ViT) is refused naming the field."""
    fam = family_of("falcon")
    assert fam.generic and fam.adapter is None and fam.model_types == ("falcon",)
    with pytest.raises(RecipeError) as e:
        family_of("vit")
    assert e.value.field == "model.hf_config.model_type" and e.value.value == "vit"
    assert "AutoModelForCausalLM" in e.value.fix and all(t in e.value.fix for t in MODEL_TYPES)
    with pytest.raises(ValueError, match="needs a model_type"):
        ModelSection(hf_config={"hidden_size": 8})


def test_model_facts_come_from_the_family_entry(monkeypatch):
    """The planner reads the family's data, not its name: a qwen2 entry without the q/k/v bias counts
    exactly the parameters of a model without them."""
    from tessera.tables import families

    d = yaml.safe_load((REPO / FAMILIES["qwen2"].tiny_config).read_text())["model"]["hf_config"]
    cfg = load_hf_config(ModelSection(hf_config=d))
    f = model_facts(cfg)
    assert (f.qkv_bias, f.proj_bias, f.gated_mlp, f.norm) == (True, False, True, "RMSNorm")
    h, kv = f.hidden, f.num_kv_heads * f.head_dim
    no_bias = dataclasses.replace(FAMILIES["qwen2"], qkv_bias=False)
    monkeypatch.setitem(families.FAMILIES, "qwen2", no_bias)
    assert count_params(model_facts(cfg)) == count_params(f) - f.num_layers * (h + 2 * kv)
    g = model_facts(
        load_hf_config(
            ModelSection(**yaml.safe_load((REPO / FAMILIES["gpt2"].tiny_config).read_text())["model"])
        )
    )
    assert (g.norm, g.gated_mlp, g.fused_qkv, g.positions, g.ffn) == (
        "LayerNorm",
        False,
        True,
        256,
        4 * g.hidden,
    )
