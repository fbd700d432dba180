"""Adapters (issue 34) without processes: names, initial values, the recipe's peft section, the planner."""

from __future__ import annotations

import math

import pytest
import torch

from tessera.config.loader import load_recipe
from tessera.config.schema import ModelSection, PeftSection
from tessera.engines.base import ModelSource, TensorSlice
from tessera.errors import CheckpointError, RecipeError
from tessera.models.adapters import (
    adapter_shapes,
    base_of,
    canonical,
    check_frozen_base,
    checkers,
    from_peft_key,
    is_adapter,
    named_parameters,
    peft_key,
    whole_base_tensors,
)

TINY = dict(
    model_type="llama",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
)
SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DEFAULT = "recipes/tiny-llama-cpu.yaml"


def source(**peft) -> ModelSource:
    section = PeftSection(**peft) if peft else None
    return ModelSource(section=ModelSection(hf_config=TINY), vocab_size=128, seed=3, peft=section)


@pytest.mark.parametrize(
    ("module_name", "name"),
    [
        ("model.layers.0.self_attn.q_proj.base_layer.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("model.layers.0.self_attn.q_proj.lora_A.default.weight", "model.layers.0.self_attn.q_proj.lora_A.weight"),
        ("model.layers.1.mlp.down_proj.lora_magnitude_vector.default.weight",
         "model.layers.1.mlp.down_proj.lora_magnitude_vector"),
        ("lm_head.original_module.weight", "lm_head.weight"),
        ("lm_head.modules_to_save.default.weight", "lm_head.modules_to_save.weight"),
        ("model.norm.weight", "model.norm.weight"),
    ],
)  # fmt: skip
def test_canonical_names_and_peft_keys_round_trip(module_name, name):
    """peft's module names -> one name per tensor; adapters <-> adapter_model.safetensors keys."""
    assert canonical(module_name) == name
    if is_adapter(name):
        key = peft_key(name)
        assert key.startswith("base_model.model.") and ".default" not in key
        assert from_peft_key(key) == name
        assert base_of(name).endswith(".weight") and not is_adapter(base_of(name))


def test_adapters_start_as_the_identity_with_layout_free_values():
    """B = 0 (the adapted model is the base at step 0), A uniform(+-1/sqrt(fan_in)) from the tensor's name
    and the seed (not peft's draw from the global RNG), DoRA's magnitude the base's row norms, a module to
    save a copy of the base module; only adapters train."""
    torch.manual_seed(0)
    lora = source(method="dora", r=4, target_modules=SEVEN, modules_to_save=["lm_head"]).build_hf()
    torch.manual_seed(99)  # another global RNG state: the same values
    again = source(method="dora", r=4, target_modules=SEVEN, modules_to_save=["lm_head"]).build_hf()
    plain = source().build_hf()
    named = dict(named_parameters(lora))
    assert {n for n, p in named.items() if p.requires_grad} == set(
        adapter_shapes(
            plain.config, PeftSection(method="dora", r=4, target_modules=SEVEN, modules_to_save=["lm_head"])
        )
    )
    assert len([n for n in named if ".lora_A." in n]) == 2 * 7
    for n, p in named.items():
        assert torch.equal(p, dict(named_parameters(again))[n]), n
        if ".lora_B." in n:
            assert not p.any()
        elif ".lora_A." in n:
            bound = 1 / math.sqrt(p.shape[1])
            assert 0.8 * bound < float(p.abs().max()) <= bound
        elif n.endswith("lora_magnitude_vector"):
            assert torch.allclose(p, plain.get_parameter(base_of(n)).norm(dim=1), rtol=0, atol=1e-6)
        elif ".modules_to_save." in n:
            assert torch.equal(p, plain.get_parameter(base_of(n)))
        else:
            assert not p.requires_grad and torch.equal(p, plain.get_parameter(n)), n
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert float((lora(input_ids=ids).logits - plain(input_ids=ids).logits).abs().max()) <= 1e-6


def test_a_changed_frozen_base_is_found():
    """The end-of-run check reads the base the engine holds against its source: equal passes; one element
    off, in a whole tensor or a ZeRO-3 partition, is named."""
    src = source(r=4)
    model = src.build_hf()
    state = {n: [TensorSlice.whole(p.detach())] for n, p in named_parameters(model)}
    tensors = src.tensors()
    one = checkers([whole_base_tensors(state)])
    assert check_frozen_base(state, tensors, rank=0, checker=one) == {"tensors": 21, "differ": []}
    name = "model.layers.1.self_attn.q_proj.weight"
    with torch.no_grad():
        model.get_submodule("model.layers.1.self_attn.q_proj").base_layer.weight[3, 5] += 1e-7
    assert check_frozen_base(state, tensors, rank=0, checker=one)["differ"] == [name]
    full = tensors[name].reshape(-1).clone()
    full[7] += 1e-3
    part = TensorSlice(tensor=full[0:100], full_shape=(64, 64), flat=(0, 100))
    assert check_frozen_base({name: [part]}, tensors, rank=1, checker={})["differ"] == [name]
    # replicas: two ranks check different whole tensors, together each once
    two = checkers([whole_base_tensors(state)] * 2)
    shares = [check_frozen_base(state, tensors, rank=r, checker=two)["tensors"] for r in (0, 1)]
    assert sum(shares) == 21 and min(shares) >= 10
    # pipeline stages: a tensor only one rank holds is checked by that rank
    first = {n: v for n, v in state.items() if "layers.0." in n or "embed" in n}
    rest = {n: v for n, v in state.items() if n not in first}
    split = checkers([whole_base_tensors(first), whole_base_tensors(rest)])
    got = [
        check_frozen_base(s, tensors, rank=r, checker=split)["tensors"] for r, s in enumerate((first, rest))
    ]
    assert got == [len(whole_base_tensors(first)), len(whole_base_tensors(rest))] and sum(got) == 21


@pytest.mark.parametrize(
    ("overrides", "field", "words"),
    [
        (["peft.r=0"], "peft.r", "the adapter rank must be positive"),
        (["peft.r=-4"], "peft.r", "the adapter rank must be positive"),
        (["peft.target_modules=[]"], "peft.target_modules", "no target modules"),
        (["peft.method=ia3"], "peft.method", ""),
        (
            ["peft.r=8", "parallel.engine=megatron", "parallel.zero=2", "parallel.zero_impl=deepspeed"],
            "parallel.zero_impl",
            "megatron's own data parallelism",
        ),
    ],
)
def test_bad_adapter_settings_name_the_field(overrides, field, words):
    with pytest.raises(RecipeError) as e:
        load_recipe(DEFAULT, overrides)
    assert e.value.field == field and words in e.value.message


@pytest.mark.parametrize(
    ("model", "target", "words"),
    [
        (TINY, "qq_proj", "LlamaForCausalLM has no module named 'qq_proj'"),
        (TINY, "embed_tokens.weight", "has no module named"),
        ({**TINY, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}, "gate_proj",
         "the experts keep gate and up in one tensor"),
    ],
)  # fmt: skip
def test_an_unknown_target_module_is_refused_naming_it(model, target, words):
    from transformers import AutoConfig

    cfg = dict(model)
    hf = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with pytest.raises(RecipeError) as e:
        adapter_shapes(hf, PeftSection(target_modules=["q_proj", target]))
    assert e.value.field == "peft.target_modules" and e.value.value == target and words in e.value.message
    assert ("q_proj" if target != "gate_proj" else "up_proj") in e.value.fix


def test_resuming_with_other_adapters_is_refused():
    from pathlib import Path

    from tessera.models.adapters import section_dict
    from tessera.train.resume import check_resume_adapters

    recipe = load_recipe(DEFAULT, ["peft.r=8"]).recipe
    meta = {"peft": section_dict(recipe.peft)}
    check_resume_adapters(meta, recipe, Path("step_000005"))
    with pytest.raises(CheckpointError) as e:
        check_resume_adapters({"peft": {**meta["peft"], "r": 16}}, recipe, Path("step_000005"))
    assert e.value.field == "peft.r" and "peft.r=16" in e.value.message
    with pytest.raises(CheckpointError) as e:
        check_resume_adapters({}, recipe, Path("step_000005"))
    assert e.value.field == "peft" and "trains every weight" in e.value.message


def test_the_8b_lora_plans_split_base_and_adapters():
    """r=16 on the seven projections of Llama 3 8B: 41,943,040 trained parameters; the bf16 base is
    parameters only (whole on 1 GPU, 1/8 under ZeRO-3), the adapters' states Adam's 16 bytes a parameter
    (bf16 param + grad, fp32 master + m + v) sharded by the stage."""
    from tessera.plan.search import check_recipe_layout, hardware_for

    GiB = 2**30
    base = 8_030_261_248
    for name, frozen in (
        ("llama3-8b-lora-h100x1.yaml", 2 * base),
        ("llama3-8b-lora-h100x8-zero3.yaml", 2 * math.ceil(base / 8)),
    ):
        r = load_recipe(f"recipes/{name}").recipe
        fit = check_recipe_layout(r, hardware=hardware_for(r, device="cuda"))
        mem = fit.estimate.memory
        assert fit.fits, (name, fit.message())
        persistent = mem.frozen - frozen  # ZeRO-3 keeps tensors under 1e5 elements whole (the norms)
        assert 0 <= persistent < 0.001 * frozen, name
        a = 41_943_040
        n = 8 if "zero3" in name else 1
        # ZeRO-3 keeps the adapter tensors under 1e5 elements (most: r x 4096) whole on every rank too
        from tessera.models.hf import load_hf_config

        shapes = adapter_shapes(load_hf_config(r.model), r.peft)
        assert sum(math.prod(x) for x in shapes.values()) == a
        whole = sum(math.prod(x) for x in shapes.values() if math.prod(x) < 100_000) if n > 1 else 0
        assert whole == 19_922_944 or n == 1
        assert mem.params - mem.frozen == pytest.approx(2 * (a / n + whole), rel=0.01), name
        assert mem.grads == pytest.approx(2 * a / n, rel=0.01) and mem.optimizer == pytest.approx(
            12 * a / n, rel=0.01
        )
        assert mem.frozen / GiB == pytest.approx(frozen / GiB, rel=0.001)


@pytest.mark.parametrize(
    ("peft", "field", "value", "words"),
    [
        (
            {"target_modules": ["q_proj", "lm_head"]},
            "peft.target_modules",
            "lm_head",
            "no linear of the layers",
        ),
        (
            {"target_modules": ["embed_tokens"]},
            "peft.target_modules",
            "embed_tokens",
            "no linear of the layers",
        ),
        ({"method": "dora"}, "peft.method", "dora", "DoRA"),
        ({"dropout": 0.1}, "peft.dropout", 0.1, "dropout"),
        ({"modules_to_save": ["lm_head"]}, "peft.modules_to_save", ["lm_head"], "modules trained in full"),
    ],
)
def test_what_megatron_cannot_adapt_is_refused_naming_the_field(peft, field, value, words):
    """The megatron targets come from the family's weight rules: q/k/v/o and gate/up/down of the layers;
    the LM head, embeddings, DoRA, dropout and modules to save are refused, naming the field and value."""
    from transformers import AutoConfig

    from tessera.models.adapters import section_dict
    from tessera.models.megatron import adapter_for
    from tessera.models.megatron_lora import sites

    cfg = dict(TINY)
    hf = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with pytest.raises(RecipeError) as e:
        sites(adapter_for("llama"), hf, section_dict(PeftSection(**peft)))
    assert (e.value.field, e.value.value) == (field, value) and words in e.value.message
    found = sites(adapter_for("llama"), hf, section_dict(PeftSection(target_modules=SEVEN)))
    assert [(s.mcore, s.split, [t for t, _ in s.targets]) for s in found] == [
        ("decoder.layers.*.self_attention.linear_qkv", "col", ["q_proj", "k_proj", "v_proj"]),
        ("decoder.layers.*.self_attention.linear_proj", "row", ["o_proj"]),
        ("decoder.layers.*.mlp.linear_fc1", "col", ["gate_proj", "up_proj"]),
        ("decoder.layers.*.mlp.linear_fc2", "row", ["down_proj"]),
    ]


def test_expert_adapters_are_peft_packing_and_reshard_exactly():
    """Mixtral's fused experts: gate/up/down targets become peft's LoRA on gate_up_proj and down_proj (one
    per expert: A's rows e*r.., B's columns e, e+E, ...). Expert e's block through the weight map is the
    block whose product is peft's own delta of that expert, and every TP / EP shard put back together
    gives the packed tensors bit for bit."""
    from transformers import AutoConfig

    from tessera.models.adapters import section_dict
    from tessera.models.megatron import Shard
    from tessera.models.megatron_lora import mcore_adapter
    from tessera.models.weight_map import hf_to_mcore, mcore_to_hf

    cfg = dict(TINY, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
    src = ModelSource(
        section=ModelSection(hf_config=cfg),
        vocab_size=128,
        seed=3,
        peft=PeftSection(r=4, target_modules=SEVEN),
    )
    model = src.build_hf()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in named_parameters(model):
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=gen))
    state = {n: p.detach().clone() for n, p in named_parameters(model)}
    wrapper = model.get_submodule("model.layers.0.mlp.experts.base_layer")  # peft's inner: gate_up_proj
    assert type(wrapper).__name__ == "ParamWrapper" and wrapper.parameter_name == "gate_up_proj"
    delta = wrapper.get_delta_weight("default")  # (E, 2I, H): peft's own expert deltas
    hf = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    adapter = mcore_adapter(hf, section_dict(PeftSection(r=4, target_modules=SEVEN)))
    key = "decoder.layers.0.mlp.experts.local_experts.{}.linear_fc1_lora.gate_up_proj.lora_{}.weight"
    shards = {}
    for ep_rank in (0, 1):
        for tp_rank in (0, 1):
            sh = Shard(tp=2, tp_rank=tp_rank, ep=2, ep_rank=ep_rank, etp=2, etp_rank=tp_rank)
            shards[sh] = hf_to_mcore(state, adapter, hf, sh)
    scale = 16.0 / 4  # peft's scaling: alpha / r
    for e in range(4):
        sh0, sh1 = (Shard(tp=2, tp_rank=t, ep=2, ep_rank=e // 2, etp=2, etp_rank=t) for t in (0, 1))
        a = shards[sh0][key.format(e % 2, "A")]
        b0, b1 = shards[sh0][key.format(e % 2, "B")], shards[sh1][key.format(e % 2, "B")]
        half = delta.shape[1] // 2
        gate = torch.cat([b0[: half // 2], b1[: half // 2]]) @ a * scale
        up = torch.cat([b0[half // 2 :], b1[half // 2 :]]) @ a * scale
        assert torch.allclose(torch.cat([gate, up]), delta[e], atol=1e-5), e
    back = mcore_to_hf(shards, adapter, hf, adapters_only=False)
    for n, t in state.items():
        if ".experts." in n and ".lora_" in n:
            assert torch.equal(back[n], t), n


def test_a_resume_names_the_base_its_checkpoint_was_trained_on(tmp_path):
    """A resume takes the base record of the checkpoint it continues (no second hash of the base), and
    refuses a recipe whose base is another directory, or another seed for a base drawn from the config."""
    from pathlib import Path

    from tessera.train.resume import base_record

    seeded = source(r=4)
    fresh = {"initial_weights": {"from": "seed", "seed": 3, "rule": "x"}}
    assert base_record(seeded, fresh, None, same_run=True) == fresh["initial_weights"]
    meta = {"base": {"from": "seed", "seed": 3, "rule": "x"}}
    assert base_record(seeded, {}, (Path("c"), meta), same_run=True) == meta["base"]
    with pytest.raises(CheckpointError) as e:
        base_record(ModelSource(**{**seeded.__dict__, "seed": 4}), {}, (Path("c"), meta), same_run=True)
    assert e.value.field == "train.seed" and "seed 3" in e.value.message
    (tmp_path / "a").mkdir()
    pre = ModelSection(path=str(tmp_path / "a"), pretrained=True)
    on_dir = ModelSource(section=pre, vocab_size=128, seed=3, peft=PeftSection(r=4))
    saved = {"base": {"from": "files", "path": str(tmp_path / "a"), "sha256": "0" * 64}}
    assert base_record(on_dir, {}, (Path("c"), saved), same_run=True) == saved["base"]
    moved = {"base": {**saved["base"], "path": str(tmp_path / "b")}}
    with pytest.raises(CheckpointError) as e:
        base_record(on_dir, {}, (Path("c"), moved), same_run=True)
    assert e.value.field == "model.path" and str(tmp_path / "b") in e.value.fix
