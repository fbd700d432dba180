"""Per family, fp32: the tiny HF model and the megatron-core model with its converted weights give the
same logits at TP1 and TP2; and the two silent-failure traps of DeepSpeed over megatron are caught.

Runs on 2 real gloo ranks (TP1 = two data-parallel replicas, each checked on its own).
"""

from __future__ import annotations

import pytest
from helpers import REPO, run_on_ranks

from tessera.tables.families import MEGATRON_FAMILIES

pytestmark = pytest.mark.slow

FAMILIES = list(MEGATRON_FAMILIES)
# Llama 3.1+ RoPE scaling (rope_type llama3, factor 8): theta 500000 and head_dim 16 put frequencies on
# both sides of the rule's wavelength band at original_max_position_embeddings 8192
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# (base family, config changes, sequence): the scaled frequencies are the slow ones, so the variant runs
# the tiny model's whole 256 positions, where the scaling moves its logits well past the tolerance
VARIANTS = {"llama-rope-llama3": ("llama", {"rope_parameters": LLAMA3_ROPE}, 256)}


def _layout(tp: int, ep: int = 1):
    from tessera.plan.layout import ParallelLayout

    dp = 2 // tp
    return ParallelLayout(engine="megatron", world_size=2, dp=dp, tp=tp, ep=ep, global_batch=dp, zero_impl="megatron")


def _hf(family: str, changes: dict | None = None):
    import torch
    import yaml
    from transformers import AutoConfig, AutoModelForCausalLM

    d = yaml.safe_load((REPO / "configs" / "models" / f"tiny-{family}.yaml").read_text())["model"]["hf_config"]
    cfg = AutoConfig.for_model(d.pop("model_type"), **d, **(changes or {}))
    torch.manual_seed(7)
    return AutoModelForCausalLM.from_config(cfg).eval()


def logits_parity(families: list[str]) -> dict[str, dict[int, float]]:
    """Max |logits_megatron - logits_hf| per family and tp (sequence 64 > Mistral's window of 32)."""
    import torch
    import torch.distributed as dist

    from tessera.engines.megatron_engine import build_model_chunks, init_parallel_state, transformer_config

    out: dict[str, dict[int, float]] = {}
    for fam in families:
        base, changes, seq = VARIANTS.get(fam, (fam, None, 64))
        hf = _hf(base, changes)
        torch.manual_seed(11)
        ids = torch.randint(0, hf.config.vocab_size, (2, seq))
        with torch.no_grad():
            ref = hf(input_ids=ids).logits
        out[fam] = {}
        if changes:  # the variant changes the HF model's logits (so matching them is not the base's match)
            plain = _hf(base, {"rope_parameters": {"rope_type": "default", "rope_theta": LLAMA3_ROPE["rope_theta"]}})
            plain.load_state_dict(hf.state_dict())
            with torch.no_grad():
                out[fam]["moved"] = float((plain(input_ids=ids).logits - ref).abs().max())
        for tp in (1, 2):
            lay = _layout(tp)
            ps = init_parallel_state(lay, seed=0, device="cpu")
            cfg = transformer_config(hf.config, lay, seq_len=seq, precision="fp32", device="cpu")
            [model] = build_model_chunks(hf.config, hf.state_dict(), cfg, lay, ps)
            model.eval()
            pos = torch.arange(seq).unsqueeze(0).expand(2, -1)
            with torch.no_grad():
                shard = model(ids, pos, None)  # [b, s, vocab/tp]
            parts = [torch.empty_like(shard) for _ in range(tp)]
            dist.all_gather(parts, shard.contiguous(), group=ps.get_tensor_model_parallel_group())
            full = torch.cat(parts, dim=-1)[..., : hf.config.vocab_size]
            out[fam][tp] = float((full - ref).abs().max())
            ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def parity():
    return run_on_ranks(logits_parity, 2, [*FAMILIES, *VARIANTS])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tp", [1, 2])
def test_logits_match_hf(parity, family, tp):
    for rank_result in parity:
        assert rank_result[family][tp] <= 1e-5, rank_result[family]


@pytest.mark.parametrize("tp", [1, 2])
def test_llama3_rope_scaling_logits_match_hf(parity, tp):
    """Llama with rope_type llama3 (factor 8): megatron-core's llama3 rule gives HF's logits within 1e-5 at
    TP1 and TP2, where the scaling moves the logits of the same weights by more than ten times that (over
    256 positions; 2.4e-4 here): a model that ignored the scaling would fail."""
    for rank_result in parity:
        got = rank_result["llama-rope-llama3"]
        assert got[tp] <= 1e-5 and got["moved"] > 1e-4, got


def traps() -> dict[str, str]:
    """Build TP2 models and fall into each trap on purpose; return what the guards said."""
    import deepspeed
    import torch

    from tessera.engines.megatron_engine import (
        build_model_chunks,
        check_tp_attributes,
        init_parallel_state,
        transformer_config,
        verify_deepspeed_groups,
    )
    from tessera.models.megatron import Shard

    hf = _hf("llama")
    lay = _layout(2)
    ps = init_parallel_state(lay, seed=0, device="cpu")
    cfg = transformer_config(hf.config, lay, seq_len=64, precision="fp32", device="cpu")
    [model] = build_model_chunks(hf.config, hf.state_dict(), cfg, lay, ps)
    said = {}
    # trap 1: a TP-sharded weight that lost its tensor_model_parallel flag
    w = model.decoder.layers[0].self_attention.linear_qkv.weight
    w.tensor_model_parallel = False
    shard = Shard(tp=2, tp_rank=ps.get_tensor_model_parallel_rank())
    try:
        check_tp_attributes(model, hf.config, shard)
    except RuntimeError as e:
        said["attr"] = str(e)
    w.tensor_model_parallel = True
    # trap 2: DeepSpeed initialised without the mpu
    ds_cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 1}}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_cfg, mpu=None)
    try:
        verify_deepspeed_groups(engine, lay)
    except RuntimeError as e:
        said["mpu"] = str(e)
    ps.destroy_model_parallel()
    return said


def test_silent_failure_traps_are_caught():
    said = run_on_ranks(traps, 2)
    for s in said:
        assert "tensor_model_parallel attribute disagrees" in s["attr"]
        assert "decoder.layers.0.self_attention.linear_qkv.weight" in s["attr"]
        assert "DeepSpeed sees dp=2 mp=1, the layout is dp=1 tp=2" in s["mpu"]


ENGINE_CASES = {
    "megatron_tp2": ("tiny-llama-cpu-mcore-tp2.yaml", []),
    "megatron_pp2": ("tiny-llama-cpu-mcore-pp2.yaml", []),
    "mixtral_ep2": ("tiny-mixtral-cpu-mcore-ep2.yaml", []),
    "deepspeed_zero3": ("tiny-llama-cpu.yaml", ["parallel.zero=3"]),
    "deepspeed_zero2": ("tiny-llama-cpu.yaml", ["parallel.zero=2"]),
    "ddp": ("tiny-llama-cpu.yaml", ["parallel.engine=ddp", "parallel.zero=0"]),
}


def assembled_state_dicts() -> dict[str, dict[str, object]]:
    """Each engine built at step 0 on 2 ranks: every rank's ``state_dict()`` (HF names, the slice of the
    full tensor each holds) gathered on rank 0 and placed into full tensors, against the HF model built
    from the same seed. Returns, per case, the HF names that differ and those no rank covered."""
    import torch

    from tessera.comm.groups import all_gather_object
    from tessera.config.loader import load_recipe
    from tessera.engines.base import ModelSource, TensorSlice
    from tessera.tables.engines import engine_class
    from tessera.plan.layout import layout_from_recipe

    out: dict[str, dict[str, object]] = {}
    for name, (recipe_file, overrides) in ENGINE_CASES.items():
        recipe = load_recipe(REPO / "recipes" / recipe_file, [*overrides, "run.world_size=2", "run.device=cpu"]).recipe
        layout = layout_from_recipe(recipe)
        source = ModelSource.of(recipe, vocab_size=recipe.data.vocab_size)
        engine = engine_class(layout.engine)(source, recipe, layout, device="cpu")
        mine = {k: [TensorSlice(s.tensor.clone(), s.full_shape, s.index, s.flat) for s in v]
                for k, v in engine.state_dict().items()}  # fmt: skip
        gathered = all_gather_object(mine)
        engine.close()
        ref = dict(source.build_hf().named_parameters())
        full = {k: torch.full_like(v, float("nan")) for k, v in ref.items()}
        for part in gathered:
            for k, slices in part.items():
                for s in slices:
                    s.place(full[k])
        out[name] = {
            "differ": sorted(k for k in ref if not torch.equal(full[k], ref[k].detach()) and not full[k].isnan().any()),
            "uncovered": sorted(k for k in ref if full[k].isnan().any()),
            "flat": any(s.flat is not None for part in gathered for v in part.values() for s in v),
        }
    return out


def test_engine_state_dicts_cover_the_hf_model_exactly():
    """The protocol's state_dict(): for megatron TP2 / PP2 / EP2 (fused QKV and gate_up, vocab shards,
    stage placement, experts), DeepSpeed ZeRO-2 (replicas) and ZeRO-3 (flat partitions) and ddp, the
    slices of the two ranks rebuild every HF parameter exactly."""
    for rank_result in run_on_ranks(assembled_state_dicts, 2):
        for name, got in rank_result.items():
            assert got["differ"] == [] and got["uncovered"] == [], (name, got)
        assert rank_result["deepspeed_zero3"]["flat"] and not rank_result["deepspeed_zero2"]["flat"]
