"""The HF <-> megatron-core weight map (pure functions, no process group) and the megatron layout rules."""

from __future__ import annotations

import itertools

import pytest
import torch
import yaml

from helpers import REPO
from tessera.config.loader import load_recipe
from tessera.errors import LayoutError
from tessera.models.megatron import Shard, adapter_for, layer_range, padded_vocab
from tessera.models.weight_map import hf_keys_covered, hf_to_mcore, mcore_to_hf
from tessera.plan.layout import layout_from_recipe
from tessera.tables.families import FAMILIES, MEGATRON_FAMILIES


def _hf(family: str, **changes):
    from transformers import AutoConfig, AutoModelForCausalLM

    d = yaml.safe_load((REPO / FAMILIES[family].tiny_config).read_text())["model"]["hf_config"]
    d.update(changes)
    cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    torch.manual_seed(3)
    return AutoModelForCausalLM.from_config(cfg)


def _all_shards(tp: int, pp: int, vpp: int, ep: int) -> list[Shard]:
    return [
        Shard(tp=tp, tp_rank=t, pp=pp, pp_rank=p, vpp=vpp, vp_stage=v, ep=ep, ep_rank=e, etp=tp, etp_rank=t)
        for t, p, v, e in itertools.product(range(tp), range(pp), range(vpp), range(ep))
    ]


def _roundtrip(model, tp, pp, vpp, ep):
    cfg = model.config
    adapter = adapter_for(cfg.model_type)
    hf = model.state_dict()
    chunks = {s: hf_to_mcore(hf, adapter, cfg, s) for s in _all_shards(tp, pp, vpp, ep)}
    return hf, chunks, mcore_to_hf(chunks, adapter, cfg)


LAYOUTS = [(1, 1, 1, 1), (2, 1, 1, 1), (1, 2, 1, 1), (2, 2, 1, 1), (1, 2, 2, 1)]


CASES = [(f, *lay) for f in MEGATRON_FAMILIES for lay in LAYOUTS] + [
    ("mixtral", 1, 1, 1, 2),
    ("mixtral", 2, 1, 1, 2),
]


@pytest.mark.parametrize("family,tp,pp,vpp,ep", CASES)
def test_hf_to_megatron_to_hf_is_bit_exact(family, tp, pp, vpp, ep):
    layers = 4 if vpp > 1 else 2
    key = "n_layer" if family == "gpt2" else "num_hidden_layers"
    model = _hf(family, **{key: layers})
    hf, _, back = _roundtrip(model, tp, pp, vpp, ep)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert set(back) == set(hf) - tied
    for k, v in back.items():
        assert torch.equal(v, hf[k]), k  # bit-exact
    assert hf_keys_covered(adapter_for(model.config.model_type), model.config) == set(hf) - tied


def test_tp_shards_are_the_megatron_layouts():
    """QKV interleaved per query group, fc1 as [gate_r; up_r], rows split per rank, layers per stage."""
    model = _hf("llama")
    hf = model.state_dict()
    a, cfg = adapter_for("llama"), model.config
    r0 = hf_to_mcore(hf, a, cfg, Shard(tp=2, tp_rank=0))
    r1 = hf_to_mcore(hf, a, cfg, Shard(tp=2, tp_rank=1))
    q, k, v = (hf[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
    d = 16  # head_dim = 64 / 4; 2 query groups of 2 heads: rank 1 owns group 1
    assert torch.equal(
        r1["decoder.layers.0.self_attention.linear_qkv.weight"],
        torch.cat([q[2 * d : 4 * d], k[d : 2 * d], v[d : 2 * d]]),
    )
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(r0["decoder.layers.0.mlp.linear_fc1.weight"], torch.cat([gate[:64], up[:64]]))
    o = hf["model.layers.0.self_attn.o_proj.weight"]
    assert torch.equal(r1["decoder.layers.0.self_attention.linear_proj.weight"], o[:, 32:])
    assert torch.equal(r0["decoder.final_layernorm.weight"], hf["model.norm.weight"])  # replicated
    last = hf_to_mcore(hf, a, cfg, Shard(pp=2, pp_rank=1))
    assert "embedding.word_embeddings.weight" not in last and "output_layer.weight" in last
    assert torch.equal(
        last["decoder.layers.0.input_layernorm.weight"], hf["model.layers.1.input_layernorm.weight"]
    )


def test_experts_split_across_ep_ranks():
    model = _hf("mixtral")
    hf = model.state_dict()
    r1 = hf_to_mcore(hf, adapter_for("mixtral"), model.config, Shard(ep=2, ep_rank=1))
    gu = hf["model.layers.0.mlp.experts.gate_up_proj"]  # [experts, 2*ffn, hidden]
    assert torch.equal(r1["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"], gu[2])
    assert "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight" not in r1


def test_vocab_padding_to_multiple_of_tp_and_back():
    model = _hf("llama", vocab_size=510)
    hf, chunks, back = _roundtrip(model, 4, 1, 1, 1)
    assert padded_vocab(510, 4) == 512
    shard = chunks[Shard(tp=4, tp_rank=3, etp=4, etp_rank=3)]["embedding.word_embeddings.weight"]
    assert shard.shape == (128, 64) and torch.count_nonzero(shard[-2:]) == 0  # the two padded rows
    assert torch.equal(back["model.embed_tokens.weight"], hf["model.embed_tokens.weight"])


def test_virtual_stages_interleave_layers():
    from tessera.models.megatron import ModelShape

    s = ModelShape(num_layers=8, num_heads=4, num_query_groups=2, head_dim=16, vocab_size=512)
    got = {
        (p, v): list(layer_range(s, Shard(pp=2, pp_rank=p, vpp=2, vp_stage=v)))
        for p in range(2)
        for v in range(2)
    }
    assert got == {(0, 0): [0, 1], (1, 0): [2, 3], (0, 1): [4, 5], (1, 1): [6, 7]}


# ---- layouts the megatron engine refuses, each with its reason ------------------------------------

BASE = REPO / "recipes" / "tiny-llama-cpu-mcore-tp2.yaml"
MIX = REPO / "recipes" / "tiny-mixtral-cpu-mcore-ep2.yaml"
LLAMA4 = REPO / "recipes" / "tiny-llama4l-cpu-mcore-pp2-vpp2.yaml"
BAD = [
    (
        BASE,
        ["run.world_size=8", "parallel.tp=8"],
        "parallel.tp",
        "num_attention_heads=4 is not divisible by tp=8",
    ),
    (
        BASE,
        ["run.world_size=4", "parallel.tp=4"],
        "parallel.tp",
        "num_key_value_heads=2 is not divisible by tp=4",
    ),
    (
        BASE,
        ["parallel.tp=1", "parallel.pp=2", "parallel.vpp=2"],
        "parallel.pp",
        "num_hidden_layers=2 is not divisible by pp*vpp=2*2=4",
    ),
    (
        MIX,
        ["run.world_size=8", "parallel.ep=8", "parallel.global_batch=32"],
        "parallel.ep",
        "num_local_experts=4 is not divisible by ep=8",
    ),
    (
        BASE,
        ["parallel.tp=1", "parallel.ep=2"],
        "parallel.ep",
        "expert parallelism needs a mixture-of-experts",
    ),
    (
        BASE,
        ["parallel.tp=1", "parallel.pp=2", "parallel.zero=3"],
        "parallel.zero",
        "ZeRO-3 shards gradients across micro-batches",
    ),
    (
        BASE,
        ["parallel.tp=1", "parallel.pp=2", "parallel.zero=1", "parallel.zero_impl=deepspeed"],
        "parallel.zero_impl",
        "only without pipeline parallelism",
    ),
    (
        BASE,
        ["parallel.zero=2", "parallel.zero_impl=megatron"],
        "parallel.zero",
        "distributed optimizer shards optimizer state only",
    ),
    (
        BASE,
        ["parallel.zero=0", "parallel.zero_impl=deepspeed"],
        "parallel.zero_impl",
        "DeepSpeed without ZeRO adds nothing",
    ),
    (
        BASE,
        ["parallel.zero=2", "parallel.sequence_parallel=true"],
        "parallel.sequence_parallel",
        "DeepSpeed does not all-reduce the sequence-parallel norm gradients",
    ),
    (
        REPO / "recipes" / "tiny-qwen3-cpu.yaml",
        ["parallel.engine=megatron", "parallel.tp=2", "parallel.zero=2"],
        "parallel.zero_impl",
        "DeepSpeed does not all-reduce those norms' gradients across TP ranks",
    ),
    (
        REPO / "recipes" / "tiny-gemma3-cpu.yaml",
        ["parallel.engine=megatron", "parallel.zero=0"],
        "parallel.engine",
        "megatron-core has no adapter for gemma3_text: it would need zero-centred RMSNorm weights",
    ),
    (
        BASE,
        ["parallel.tp=1", "parallel.sequence_parallel=true"],
        "parallel.sequence_parallel",
        "tp=1 has none",
    ),
    (
        LLAMA4,
        ["parallel.micro_batch=8", "parallel.global_batch=8"],
        "parallel.grad_accum",
        "the interleaved schedule needs the micro-batch count (1) divisible by pp=2",
    ),
    (
        BASE,
        ["parallel.zero=1", "parallel.offload_optimizer=true"],
        "parallel.offload_optimizer",
        "CPU offload is wired for the deepspeed engine only",
    ),
    (MIX, ["parallel.ep=4", "run.world_size=2"], "parallel.ep", "ep=4 does not divide dp*tp=2"),
    (MIX, ["run.world_size=4", "parallel.tp=2", "parallel.ep=4"], "parallel.ep", "ep=4 does not divide dp=2"),
]


@pytest.mark.parametrize("recipe,overrides,field,text", BAD)
def test_rejected_layouts_name_field_and_reason(recipe, overrides, field, text):
    r = load_recipe(recipe, overrides).recipe
    with pytest.raises(LayoutError) as e:
        layout_from_recipe(r)
    assert e.value.field == field
    assert text in str(e.value), str(e.value)
    assert e.value.fix  # every refusal says what to do instead


def test_auto_choices():
    lay = layout_from_recipe(load_recipe(BASE, ["parallel.zero=2"]).recipe)
    assert (lay.zero_impl, lay.sequence_parallel) == ("deepspeed", False)
    lay = layout_from_recipe(load_recipe(BASE, ["parallel.zero=1"]).recipe)
    assert (lay.zero_impl, lay.sequence_parallel) == ("megatron", True)  # tp 2: SP (SequenceParallelNorm)
    lay = layout_from_recipe(load_recipe(REPO / "recipes" / "tiny-llama-cpu4-mcore-tp2-pp2.yaml").recipe)
    assert [lay.coords(r) for r in (0, 1, 2, 3)] == [
        {"sp": 0, "tp": 0, "dp": 0, "pp": 0},
        {"sp": 0, "tp": 1, "dp": 0, "pp": 0},
        {"sp": 0, "tp": 0, "dp": 0, "pp": 1},
        {"sp": 0, "tp": 1, "dp": 0, "pp": 1},
    ]


def _adapter_kwargs(**changes):
    from transformers import AutoConfig

    d = yaml.safe_load((REPO / "configs" / "models" / "tiny-llama.yaml").read_text())["model"]["hf_config"]
    d.update(changes)
    cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    a = adapter_for(cfg.model_type)
    return a.transformer(cfg, 64), a.gpt(cfg)


def test_rope_and_window_mapping():
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    }
    _, gpt = _adapter_kwargs(rope_parameters=llama3)
    assert (gpt["rotary_base"], gpt["rope_scaling"], gpt["rope_scaling_factor"]) == (500000, True, 8.0)
    tr, _ = _adapter_kwargs(model_type="mistral", sliding_window=32)
    assert tr["window_size"] == (31, 0)  # HF: the 32 most recent keys, the query's own included
    tr, _ = _adapter_kwargs(model_type="mistral", sliding_window=4096)
    assert "window_size" not in tr  # wider than the sequence: plain causal attention


@pytest.mark.parametrize(
    "changes,field",
    [
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}},
            "model.hf_config.rope_scaling.rope_type",
        ),
        (
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 2.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                    "rope_theta": 500000.0,
                }
            },
            "model.hf_config.rope_scaling.low_freq_factor",
        ),
        ({"hidden_act": "gelu"}, "model.hf_config.hidden_act"),
        ({"mlp_bias": True}, "model.hf_config.mlp_bias"),
    ],
)
def test_what_megatron_cannot_express_is_refused(changes, field):
    from tessera.errors import RecipeError

    with pytest.raises(RecipeError) as e:
        _adapter_kwargs(**changes)
    assert e.value.field == field and "megatron-core cannot express this" in str(e.value)


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"rms_norm_eps": 1e-5}, "model.hf_config.rms_norm_eps"),  # HF's latent norms keep 1e-6
        ({"rope_interleave": False}, "model.hf_config.rope_interleave"),
        ({"norm_topk_prob": False}, "model.hf_config.norm_topk_prob"),
        ({"num_experts_per_tok": 4, "n_group": 2, "topk_group": 1}, "model.hf_config.topk_group"),
        ({"num_key_value_heads": 2}, "model.hf_config.num_key_value_heads"),
    ],
)
def test_what_deepseek_v3_on_megatron_cannot_express_is_refused(changes, field):
    """Each of these gives other numbers on megatron-core's MLA / router than in HF's module: refused, naming
    the field, before launch; the tiny config itself maps (and plain RoPE: MLATransformerConfig's own
    default would be YaRN x40)."""
    from transformers import AutoConfig

    from tessera.errors import RecipeError

    tiny = REPO / "configs" / "models" / "tiny-deepseek-v3.yaml"
    d = yaml.safe_load(tiny.read_text())["model"]["hf_config"]
    adapter = adapter_for("deepseek_v3")
    ok = adapter.transformer(AutoConfig.for_model(**{**d}), 64)
    assert ok["rope_type"] == "rope" and ok["moe_layer_freq"] == [0, 1, 1, 1]
    assert ok["moe_router_bias_update_rate"] == 0.0 and ok["moe_router_enable_expert_bias"]
    d.update(changes)
    with pytest.raises(RecipeError) as e:
        adapter.transformer(AutoConfig.for_model(**d), 64)
    assert e.value.field == field and "megatron-core cannot express this" in str(e.value)


def test_a_pipeline_stage_reads_only_its_own_tensors(tmp_path):
    """``model.pretrained`` under PP and TP: the weights come from a lazy reader, and a chunk asks it only
    for the parts it holds: a stage never reads another stage's tensors, a TP rank reads only its rows or
    columns (the elements read are exactly the elements it holds)."""
    from tessera.models.hf import hf_dir_tensors

    model = _hf("llama", num_hidden_layers=4)
    model.save_pretrained(tmp_path, safe_serialization=True)
    lazy = hf_dir_tensors(tmp_path)
    assert type(lazy).__name__ == "LazyTensors"  # nothing read yet

    class Recording(dict):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.read, self.elements = inner, [], 0

        def __getitem__(self, k):
            return self.part(k, ())

        def part(self, k, index):
            self.read.append(k)
            t = self.inner.part(k, index)
            self.elements += t.numel()
            return t

        def shape_of(self, k):
            return self.inner.shape_of(k)

        def __contains__(self, k):
            return k in self.inner

    a, cfg = adapter_for("llama"), model.config
    for tp in (1, 2):
        rec = Recording(lazy)
        local = hf_to_mcore(rec, a, cfg, Shard(tp=tp, tp_rank=tp - 1, etp=tp, etp_rank=tp - 1))
        assert rec.elements == sum(t.numel() for t in local.values())
    for stage, mine in ((0, {0, 1}), (1, {2, 3})):
        rec = Recording(lazy)
        local = hf_to_mcore(rec, a, cfg, Shard(pp=2, pp_rank=stage))
        layers = {int(k.split(".")[2]) for k in rec.read if k.startswith("model.layers.")}
        assert layers == mine and len(rec.read) == len(set(rec.read))  # each tensor read once
        assert ("model.embed_tokens.weight" in rec.read) == (stage == 0)
        assert ("lm_head.weight" in rec.read) == (stage == 1)
        ref = hf_to_mcore(model.state_dict(), a, cfg, Shard(pp=2, pp_rank=stage))
        assert local.keys() == ref.keys() and all(torch.equal(local[k], ref[k]) for k in ref)
