"""The planner's pure parts: hardware profiles, parameter counts, ZeRO / activation / communication / FLOP /
bubble formulas with exact numbers, and layouts planned for known scenarios (no process group)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from helpers import REPO
from tessera.config.loader import validate_recipe
from tessera.config.schema import ModelSection
from tessera.errors import LayoutError, RecipeError
from tessera.models.hf import load_hf_config
from tessera.models.megatron import Shard, adapter_for
from tessera.models.weight_map import hf_to_mcore
from tessera.plan.comm_estimate import comm_bytes_by_op, comm_per_step, minimum_wire_bytes
from tessera.plan.estimate import (
    ZERO3_PERSISTENCE_THRESHOLD,
    GiB,
    Kernels,
    activation_bytes_per_layer,
    count_params,
    ddp_bucket_count,
    hf_tensor_numels,
    in_flight_microbatches,
    memory_per_rank,
    model_state_bytes,
    rank_params,
)
from tessera.plan.facts import ModelFacts, meta_tensors, model_facts
from tessera.plan.hardware import HardwareProfile, load_hardware
from tessera.plan.layout import ParallelLayout
from tessera.plan.search import fit_reason, plan
from tessera.plan.time_estimate import (
    bubble_fraction,
    flops_per_token,
    matmul_params,
    op_seconds,
    step_time,
)
from tessera.tables.engines import ENGINE_NAMES
from tessera.tables.families import FAMILIES, FAMILY_NAMES, GENERIC_ESTIMATES, MEGATRON_FAMILIES

HW = REPO / "configs" / "hardware"
H100 = load_hardware(HW / "h100-sxm-80g.yaml")
LLAMA3_8B = 8_030_261_248  # meta-llama/Meta-Llama-3-8B
LLAMA3_70B = 70_553_706_496  # meta-llama/Meta-Llama-3-70B
MIXTRAL = 46_702_792_704  # mistralai/Mixtral-8x7B-v0.1


def _section(name: str) -> ModelSection:
    return ModelSection(**yaml.safe_load((REPO / "configs" / "models" / f"{name}.yaml").read_text())["model"])


def _cfg(name: str, **changes):
    from transformers import AutoConfig

    d = yaml.safe_load((REPO / "configs" / "models" / f"{name}.yaml").read_text())["model"]["hf_config"]
    d.update(changes)
    return AutoConfig.for_model(d.pop("model_type"), **d)


def _llama70b():
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "llama",
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
    )


# ---- hardware profiles -------------------------------------------------------------------------------


def test_hardware_profiles_load_with_vendor_figures():
    h100, h200, a100, cpu = (
        load_hardware(HW / f"{n}.yaml") for n in ("h100-sxm-80g", "h200-141g", "a100-80g", "cpu-2core")
    )
    assert (h100.peak_flops, h100.memory_bytes, h100.hbm_bandwidth) == (989e12, 80_000_000_000, 3.35e12)
    assert (h100.intra_node_bandwidth, h100.inter_node_bandwidth, h100.devices_per_node) == (450e9, 50e9, 8)
    assert (h200.peak_flops, h200.memory_bytes, h200.hbm_bandwidth) == (989e12, 141_000_000_000, 4.8e12)
    assert (a100.peak_flops, a100.intra_node_bandwidth, a100.inter_node_bandwidth) == (312e12, 300e9, 25e9)
    assert cpu.device == "cpu" and cpu.devices_per_node == 2 and not cpu.can_offload and h100.can_offload
    assert load_hardware("h100-sxm-80g") == h100  # a bare name is looked up in configs/hardware/
    assert h100.peak_for("fp32") == 67e12 and cpu.peak_for("fp32") == cpu.peak_flops


GOOD = (HW / "h100-sxm-80g.yaml").read_text()


@pytest.mark.parametrize(
    "text,field,words",
    [
        (None, "hardware", "not found"),
        ("- 1\n- 2\n", "hardware", "mapping"),
        (GOOD.replace("peak_flops: 989.0e+12", ""), "peak_flops", "missing key"),
        (GOOD.replace("memory_bytes: 80.0e+9", "memory_bytes: 0"), "memory_bytes", "positive"),
        (GOOD.replace("memory_bytes: 80.0e+9", "memory_bytes: 80GB"), "memory_bytes", "not a number"),
        (GOOD.replace("hbm_bandwidth:", "hbm_bandwith:"), "hbm_bandwith", "unknown key"),
        (GOOD.replace("device: cuda", "device: tpu"), "device", "unknown device"),
    ],
)
def test_hardware_errors_name_key_value_and_fix(tmp_path, text, field, words):
    path = tmp_path / "hw.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(RecipeError) as e:
        load_hardware(path)
    assert e.value.field == field and words in e.value.message and e.value.fix
    if field == "hbm_bandwith":
        assert "did you mean hbm_bandwidth" in e.value.fix


def test_yaml_numbers_without_a_dot_are_accepted(tmp_path):
    (tmp_path / "hw.yaml").write_text(GOOD.replace("peak_flops: 989.0e+12", "peak_flops: 989e12"))
    assert load_hardware(tmp_path / "hw.yaml").peak_flops == 989e12


# ---- parameters --------------------------------------------------------------------------------------


TINY = sorted(p.stem for p in (REPO / "configs" / "models").glob("tiny-*.yaml"))


@pytest.mark.parametrize("name", TINY)
def test_param_count_equals_the_hf_model(name):
    from transformers import AutoModelForCausalLM

    cfg = _cfg(name)
    model = AutoModelForCausalLM.from_config(cfg)
    assert count_params(model_facts(cfg)) == sum(p.numel() for p in model.parameters())  # tied: once


def test_param_count_of_published_models():
    assert count_params(model_facts(_cfg("llama-3-8b"))) == LLAMA3_8B
    assert count_params(model_facts(_llama70b())) == LLAMA3_70B
    assert count_params(model_facts(_cfg("mixtral-8x7b"))) == MIXTRAL


@pytest.mark.parametrize(
    "name,recipe,published,meta",
    [
        # Qwen/Qwen3-8B ("8.2B") and Qwen/Qwen3-30B-A3B ("30.5B"): the model cards' totals; meta: the
        # parameters of the model transformers builds from the published config.json, on the meta device
        ("qwen3-8b", "qwen3-8b-pretrain-h100x8-zero3", 8.2e9, 8_190_735_360),
        ("qwen3-30b-a3b", "qwen3-30b-a3b-pretrain-h100x16-zero3", 30.5e9, 30_532_122_624),
    ],
)
def test_qwen3_plans_count_the_published_totals(name, recipe, published, meta, capsys):
    """`tessera plan` on the published Qwen3-8B and Qwen3-30B-A3B configs: the family's formula counts
    exactly the parameters of the model transformers builds on the meta device, the published totals
    within 0.5 %."""
    from tessera.cli import main

    f = model_facts(_cfg(name))
    assert not f.generic and count_params(f) == meta
    assert meta == sum(n for _, n in meta_tensors(_cfg(name).to_json_string()))
    assert abs(meta - published) <= 0.005 * published
    path = str(REPO / "recipes" / f"{recipe}.yaml")
    assert main(["plan", path, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["model"] == {
        "family": f.family,
        "parameters": meta,
        "counted_on": "the family's formula",
        "generic_estimates": [],
    }


@pytest.mark.parametrize("name", ["tiny-deepseek-v3", "tiny-gemma3"])
def test_families_without_a_formula_are_counted_on_the_meta_device(name, capsys):
    """A family without a formula: `tessera plan` counts the model built on the meta device and names the
    estimates that fall back to a generic formula."""
    from transformers import AutoModelForCausalLM

    from tessera.cli import main

    f = model_facts(_cfg(name))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_cfg(name))
    meta = sum(p.numel() for p in model.parameters())
    assert f.generic and count_params(f) == meta
    assert sorted(hf_tensor_numels(f)) == sorted(n for _, n in f.tensors)
    path = str(REPO / "recipes" / f"{name}-cpu.yaml")
    assert main(["plan", path, "--world-size", "2", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["model"] == {
        "family": f.family,
        "parameters": meta,
        "counted_on": "the model built on the meta device",
        "generic_estimates": list(GENERIC_ESTIMATES),
    }
    assert main(["plan", path, "--world-size", "2", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert f"{meta:,} parameters (counted on the model built on the meta device)" in out
    assert all(f"generic formula: {e}" in out for e in GENERIC_ESTIMATES)


def _mcore_numel(model, *, tp: int, pp: int, ep: int, vpp: int, pp_rank: int) -> int:
    cfg = model.config
    adapter, hf = adapter_for(cfg.model_type), model.state_dict()
    return sum(
        t.numel()
        for v in range(vpp)
        for t in hf_to_mcore(
            hf, adapter, cfg, Shard(tp=tp, pp=pp, pp_rank=pp_rank, vpp=vpp, vp_stage=v, ep=ep, etp=tp)
        ).values()
    )


@pytest.mark.parametrize(
    "family,tp,pp,ep,vpp,changes",
    [(f, 2, 1, 1, 1, {}) for f in MEGATRON_FAMILIES]
    + [(f, 1, 2, 1, 1, {}) for f in MEGATRON_FAMILIES]
    + [
        ("gpt2", 2, 2, 1, 1, {}),  # tied head: a second copy on the last stage
        ("qwen2", 2, 2, 1, 1, {}),
        ("llama", 2, 1, 1, 1, {"vocab_size": 511}),  # padded to 512 for tp 2
        ("llama", 1, 2, 1, 2, {"num_hidden_layers": 4}),
        ("mixtral", 1, 1, 2, 1, {}),
        ("mixtral", 2, 2, 2, 1, {}),
    ],
)
def test_rank_params_equal_the_megatron_shards(family, tp, pp, ep, vpp, changes):
    """Each rank's count equals the numel of the megatron state dict the weight map builds for it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_cfg(f"tiny-{family}", **changes))
    f = model_facts(model.config)
    for pp_rank in range(pp):
        got = rank_params(f, tp=tp, pp=pp, ep=ep, first=pp_rank == 0, last=pp_rank == pp - 1).total
        assert got == _mcore_numel(model, tp=tp, pp=pp, ep=ep, vpp=vpp, pp_rank=pp_rank)


# ---- model states ------------------------------------------------------------------------------------


def test_zero_formulas_bf16_and_fp32():
    psi, n = 8_000_000_000, 8
    bf = {z: model_state_bytes(psi, n, z, "bf16") for z in range(4)}
    assert bf[0] == {"params": 2 * psi, "grads": 2 * psi, "optimizer": 12 * psi}
    assert sum(bf[0].values()) == 16 * psi == 128_000_000_000
    assert sum(bf[1].values()) == 4 * psi + 12 * psi // n == 44_000_000_000
    assert sum(bf[2].values()) == 2 * psi + 14 * psi // n == 30_000_000_000
    assert sum(bf[3].values()) == 16 * psi // n == 16_000_000_000
    assert bf[2] == {"params": 2 * psi, "grads": 2 * psi // n, "optimizer": 12 * psi // n}
    fp = {z: sum(model_state_bytes(psi, n, z, "fp32").values()) for z in range(4)}
    assert fp == {0: 16 * psi, 1: 8 * psi + 8 * psi // n, 2: 4 * psi + 12 * psi // n, 3: 16 * psi // n}
    assert model_state_bytes(10, 4, 3, "bf16")["params"] == 2 * 3  # a shard is ceil(10 / 4) = 3 elements


# ---- activations -------------------------------------------------------------------------------------

GPT = ModelFacts(
    family="gpt2",
    hidden=1024,
    ffn=4096,
    num_layers=24,
    num_heads=16,
    num_kv_heads=16,
    head_dim=64,
    vocab_size=50304,
    norm="LayerNorm",
    gated_mlp=False,
    qkv_bias=True,
    proj_bias=True,
    mlp_bias=True,
    attn_dropout=True,
    hidden_dropout=True,
)


def test_activations_are_korthikanti_for_the_gpt_shape():
    s, b, h, a, t = 2048, 4, 1024, 16, 4
    sbh, stats = s * b * h, 16 * s * b  # two LayerNorms: fp32 mean + rstd per token

    def act(**kw):
        return activation_bytes_per_layer(GPT, seq_len=s, micro_batch=b, **kw)

    assert act() == sbh * 34 + 5 * a * s * s * b + stats  # sbh(34 + 5as/h)
    assert act(tp=t, sequence_parallel=True) == (sbh * 34 + 5 * a * s * s * b + stats) // t
    assert act(tp=t) == sbh * 10 + sbh * 24 // t + 5 * a * s * s * b // t + stats  # TP without SP
    assert act(tp=t, sequence_parallel=True, recompute="selective") == (34 * sbh + stats) // t
    assert (
        act(recompute="full") == 2 * sbh
        and act(tp=t, sequence_parallel=True, recompute="full") == 2 * sbh // t
    )
    assert act(precision="fp32") == 66 * sbh + 9 * a * s * s * b + stats  # masks stay 1 byte
    assert (
        act(kernels=Kernels(fused_attention=True)) == 34 * sbh + 4 * a * s * b + stats
    )  # flash: fp32 row stats


def test_activations_of_llama3_8b_gqa_swiglu_rmsnorm():
    f, s = model_facts(_cfg("llama-3-8b")), 8192
    sbh = s * 4096
    # norms 2*2 + QKV in 2 + MLP in 2 + Q 2 + K,V 2*2*(1024/4096) + proj in 2 + SwiGLU 4*2*(14336/4096) = 41
    assert activation_bytes_per_layer(f, seq_len=s, micro_batch=1, recompute="selective") == 41 * sbh + 8 * s
    assert activation_bytes_per_layer(f, seq_len=s, micro_batch=1) == 41 * sbh + 8 * s + 2 * 32 * s * s


def test_in_flight_microbatches_of_1f1b_and_interleaved():
    assert in_flight_microbatches(4, 1, 8) == 4 and in_flight_microbatches(4, 1, 2) == 2
    assert in_flight_microbatches(4, 1, 8, pp_rank=3) == 1 and in_flight_microbatches(1, 1, 8) == 1
    assert in_flight_microbatches(4, 2, 8) == 4 * (1 + 3 / (4 * 2))  # Korthikanti et al. Sec. 4.2.3


def test_memory_of_a_layout_adds_up():
    f = model_facts(_cfg("llama-3-8b"))
    lay = ParallelLayout(
        engine="deepspeed", world_size=8, dp=8, zero=0, micro_batch=1, grad_accum=8, global_batch=64
    )
    m = memory_per_rank(f, lay, seq_len=8192, precision="bf16", recompute="full")
    assert (m.params, m.grads, m.optimizer) == (2 * LLAMA3_8B, 2 * LLAMA3_8B, 12 * LLAMA3_8B)
    logits = 8192 * 128256
    assert m.buffers == logits * (2 + 4) + 2 * 500_000_000  # bf16 logits, fp32 copy + DeepSpeed's bucket
    # saved for backward per micro-batch: each layer's input, the final norm's input and normalized
    # value (paper kernels: the input only), the LM-head input, the loss's fp32 softmax
    sbh = 8192 * 4096
    assert m.activations_per_micro_batch == 32 * 2 * sbh + (2 * sbh + 4 * 8192) + 2 * sbh + logits * 4
    assert m.total == m.params + m.grads + m.optimizer + m.activations + m.buffers


# ---- communication, FLOPs, bubble, time ----------------------------------------------------------------


def _layout(**kw) -> ParallelLayout:
    kw.setdefault("micro_batch", 1)
    kw.setdefault("grad_accum", 1)
    dp = kw["world_size"] // (kw.get("tp", 1) * kw.get("pp", 1))
    return ParallelLayout(dp=dp, global_batch=kw["micro_batch"] * kw["grad_accum"] * dp, **kw)


def test_dp_comm_is_2psi_for_zero_0_to_2_and_3psi_for_zero3():
    f, psi = model_facts(_cfg("llama-3-8b")), LLAMA3_8B

    def comm(zero, ga=1):
        lay = _layout(engine="deepspeed", world_size=8, zero=zero, grad_accum=ga)
        return comm_bytes_by_op(comm_per_step(f, lay, seq_len=8192, precision="bf16"))

    assert comm(0) == {"all_reduce:dp": 2 * psi}
    assert comm(1) == {"reduce_scatter:dp": 2 * psi, "all_gather:dp": 2 * psi}  # same volume as all-reduce
    # 3 x 2Ψ, except that tensors under DeepSpeed's persistence threshold (the norms) are gathered once
    small = sum(n for n in hf_tensor_numels(f) if n < ZERO3_PERSISTENCE_THRESHOLD)
    assert small == 65 * 4096  # 2 norms x 32 layers + the final norm
    assert comm(3) == {"all_gather:dp": 2 * small + 2 * 2 * (psi - small), "reduce_scatter:dp": 2 * psi}
    assert comm(2, ga=4) == {"reduce_scatter:dp": 4 * 2 * psi, "all_gather:dp": 2 * psi}  # per micro-batch
    ops = comm_per_step(f, _layout(engine="deepspeed", world_size=8, zero=0), seq_len=8192, precision="bf16")
    assert ops[0].wire_bytes == 2 * 7 / 8 * 2 * psi  # ring all-reduce


def test_tp_pp_ep_comm_exact():
    f, s, m = model_facts(_cfg("llama-3-8b")), 4096, 8
    act = s * 4096 * 2
    lay = _layout(engine="megatron", world_size=8, tp=2, pp=2, zero=1, zero_impl="megatron", grad_accum=m)
    c = comm_bytes_by_op(comm_per_step(f, lay, seq_len=s, precision="bf16"))
    # 2 fwd + 2 bwd per layer, 16 layers per stage, + the vocab-parallel embedding on the first stage
    assert c["all_reduce:tp"] == (4 * 16 + 1) * m * act
    assert c["send:pp"] == c["recv:pp"] == m * act  # pp = 2: one boundary, each rank sends one way
    lay4 = _layout(engine="megatron", world_size=8, pp=4, zero=1, zero_impl="megatron", grad_accum=m)
    assert comm_bytes_by_op(comm_per_step(f, lay4, seq_len=s, precision="bf16"))["send:pp"] == 2 * m * act
    mx = model_facts(_cfg("mixtral-8x7b"))
    lay_ep = _layout(engine="megatron", world_size=8, ep=8, zero=1, zero_impl="megatron", grad_accum=m)
    c = comm_bytes_by_op(comm_per_step(mx, lay_ep, seq_len=s, precision="bf16"))
    assert c["all_to_all:ep"] == 4 * 32 * m * s * 2 * 4096 * 2  # dispatch + combine, fwd + bwd, topk 2
    assert "reduce_scatter:edp" not in c  # dp 8 / ep 8: one rank per expert-dp group


def test_flops_per_token_palm():
    f = model_facts(_cfg("llama-3-8b"))
    n = LLAMA3_8B - 128256 * 4096  # without the input embedding
    assert matmul_params(f) == n == 7_504_924_672
    assert flops_per_token(f, 8192) == 6 * n + 12 * 32 * 32 * 128 * 8192
    mx = model_facts(_cfg("mixtral-8x7b"))
    experts = 32 * 8 * 3 * 4096 * 14336
    assert matmul_params(mx) == MIXTRAL - 32000 * 4096 - experts * 6 // 8 == 12_748_853_248  # top-2 of 8


def test_bubble_fraction_values():
    assert bubble_fraction(1, 1, 8) == 0.0
    assert bubble_fraction(4, 1, 8) == 3 / 11  # (p-1)/(m+p-1)
    assert bubble_fraction(4, 2, 8) == 3 / 19  # (p-1)/(v*m+p-1)
    assert bubble_fraction(8, 1, 64) == 7 / 71


def test_step_time_of_one_rank_is_compute_plus_optimizer():
    f = model_facts(_cfg("llama-3-8b"))
    lay = _layout(engine="deepspeed", world_size=1, zero=0, grad_accum=4)
    t = step_time(f, lay, seq_len=2048, precision="bf16", recompute="none", hardware=H100, efficiency=0.5)
    flops = flops_per_token(f, 2048) * 4 * 2048
    assert t.compute_s == pytest.approx(flops / (989e12 * 0.5), rel=1e-12)
    assert t.optimizer_s == pytest.approx(LLAMA3_8B * 28 / 3.35e12, rel=1e-12)
    assert t.step_s == pytest.approx(t.compute_s + t.optimizer_s, rel=1e-12)
    assert t.mfu == pytest.approx(flops / (t.step_s * 989e12), rel=1e-12)


# ---- the ddp engine (torch DDP, full replicas) -------------------------------------------------------

TINY_LLAMA_PSI = 139_584


def _tiny_llama_facts():
    return model_facts(_cfg(Path(FAMILIES["llama"].tiny_config).stem))


def test_minimum_wire_bytes_is_the_textbook_volume_of_each_layout():
    f, psi = _tiny_llama_facts(), TINY_LLAMA_PSI

    def least(**kw) -> float:
        lay = _layout(world_size=2, grad_accum=2, micro_batch=4, **kw)
        return minimum_wire_bytes(f, lay, seq_len=64, precision="fp32")[0]

    e, n = 4, 2
    assert least(engine="ddp") == least(engine="deepspeed", zero=0) == 2 * (n - 1) / n * psi * e
    assert least(engine="deepspeed", zero=1) == 2 * (n - 1) / n * psi * e
    assert least(engine="deepspeed", zero=2) == (2 + 1) * (n - 1) / n * psi * e  # m = 2 reduce-scatters
    # every tensor of the tiny model is under DeepSpeed's persistence threshold: moved as under ZeRO-2
    assert least(engine="deepspeed", zero=3) == least(engine="deepspeed", zero=2)
    big = model_facts(_cfg("llama-3-8b"))
    lay = _layout(world_size=2, grad_accum=2, micro_batch=1, engine="deepspeed", zero=3)
    small = sum(x for x in hf_tensor_numels(big) if x < ZERO3_PERSISTENCE_THRESHOLD)
    assert minimum_wire_bytes(big, lay, seq_len=64, precision="bf16")[0] == pytest.approx(
        (3 * 2 * (LLAMA3_8B - small) + 3 * small) * 0.5 * 2, rel=1e-12
    )
    act = 64 * 4 * 64 * e  # s·b·h·e
    assert least(engine="megatron", tp=2) == (4 * 2 + 2) * 2 * act  # 2 layers, m = 2, 2(t-1)/t = 1
    assert least(engine="megatron", pp=2) == 2 * act  # each rank sends one tensor per micro-batch
    assert minimum_wire_bytes(f, _layout(world_size=1, engine="ddp"), seq_len=64, precision="fp32")[0] == 0


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_ddp_holds_an_fp32_replica_and_its_bucket_copy(precision):
    f, psi = _tiny_llama_facts(), TINY_LLAMA_PSI
    assert count_params(f) == psi
    lay = _layout(engine="ddp", world_size=2, grad_accum=2)
    assert lay.zero_impl == "ddp" and lay.etp == 1
    m = memory_per_rank(f, lay, seq_len=128, precision=precision)
    # torch AdamW on fp32 params (bf16 runs under autocast): the same 16Ψ in both precisions
    assert (m.params, m.grads, m.optimizer) == (4 * psi, 4 * psi, 8 * psi)
    e = 2 if precision == "bf16" else 4
    logits = 128 * 512 * (e + (4 if e < 4 else 0))  # the loss's logits (+ fp32 copy); its softmax is saved
    assert m.buffers == 4 * psi + logits  # + DDP's flat fp32 copy of every gradient
    assert "4Ψ" in m.formulas["buffers"] and m.formulas["model_states"].startswith("DDP fp32 replica")
    # activations as the deepspeed engine's (the same HF module)
    ds = memory_per_rank(
        f, _layout(engine="deepspeed", world_size=2, grad_accum=2), seq_len=128, precision=precision
    )
    assert m.activations == ds.activations


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_ddp_all_reduces_the_fp32_grads_once_per_step(precision):
    f, psi = _tiny_llama_facts(), TINY_LLAMA_PSI
    ops = comm_per_step(
        f, _layout(engine="ddp", world_size=2, grad_accum=4), seq_len=128, precision=precision
    )
    assert comm_bytes_by_op(ops) == {"all_reduce:dp": 4 * psi}  # no_sync on the first 3 micro-batches
    (op,) = ops
    assert (op.calls, op.messages, op.overlap) == (1, 1, "last_bwd")  # 558 kB: one bucket under 1 MiB
    assert f"{4 * psi:,} bytes" in op.formula
    one = comm_per_step(f, _layout(engine="ddp", world_size=1), seq_len=128, precision=precision)
    assert comm_bytes_by_op(one) == {}  # dp 1: nothing to reduce


def test_ddp_bucket_count_is_torchs_assignment():
    """The count equals what torch's reducer assigns (``_compute_bucket_assignment_by_size`` with DDP's
    default caps), for the gradients of Llama 3 8B in reverse parameter order and for edge cases."""
    import torch.distributed as dist

    def torch_count(nbytes: list[int]) -> int:
        tensors = [torch.empty(n // 4, device="meta") for n in nbytes]
        limits = [dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * 1024 * 1024]
        buckets, _ = dist._compute_bucket_assignment_by_size(tensors, limits, [False] * len(tensors))
        return len(buckets)

    grads = [4 * n for n in reversed(hf_tensor_numels(model_facts(_cfg("llama-3-8b"))))]
    cases = [grads, [4 * 262_144, 40], [4 * 262_143, 4, 40], [4] * 10, [100 * 2**20]]
    for nbytes in cases:
        assert ddp_bucket_count(nbytes) == torch_count(nbytes)
    assert 32 < ddp_bucket_count(grads) < len(grads)  # tensors > 25 MiB go alone, small ones share


def test_ddp_step_time_is_deepspeed_zero0s_in_fp32():
    """fp32: the same bytes, all-reduced once over the last backward, and the same optimizer step."""
    f = _tiny_llama_facts()
    cpu = load_hardware(HW / "cpu-2core.yaml")

    def t(engine):
        lay = _layout(engine=engine, world_size=2, grad_accum=2)
        return step_time(f, lay, seq_len=128, precision="fp32", recompute="none", hardware=cpu)

    assert t("ddp") == t("deepspeed")


def test_ddp_ties_go_to_the_engine_listed_first():
    cpu = load_hardware(HW / "cpu-2core.yaml")
    r = plan(_cfg("tiny-llama"), world_size=2, seq_len=128, global_batch=8, precision="fp32", hardware=cpu)
    order = [(c.layout.engine, c.layout.zero, c.layout.micro_batch) for c in r.candidates]
    for mb in (1, 2, 4):
        assert order.index(("deepspeed", 0, mb)) + 1 == order.index(("ddp", 0, mb))  # exact tie, fp32
    assert r.chosen is not None and r.chosen.layout.engine != "ddp"
    ddp = r.candidates[order.index(("ddp", 0, 1))].to_json()
    assert ddp["layout"]["zero_impl"] == "ddp" and "comm:all_reduce:dp" in ddp["formulas"]


# ---- scenarios -----------------------------------------------------------------------------------------


def _find(result, **want):
    want.setdefault("sp", 1)  # without Ulysses unless asked (a layout without the key has none)
    return [
        r
        for r in result.rejected
        if all(r.layout.get(k, 1 if k == "sp" else None) == v for k, v in want.items())
    ]


def _gib(reason: str) -> list[float]:
    return [float(x) for x in re.findall(r"([\d.]+) GiB", reason)]


def test_llama3_8b_on_8_h100():
    sec = _section("llama-3-8b")
    r = plan(
        load_hf_config(sec),
        world_size=8,
        seq_len=8192,
        global_batch=64,
        precision="bf16",
        hardware=H100,
        attn_implementation=sec.attn_implementation,
    )
    c = r.chosen
    assert c is not None and c.memory.total <= H100.memory_bytes
    assert c.layout.zero >= 1 or c.layout.tp * c.layout.pp > 1  # a plain replica cannot hold 8B + Adam
    (rej,) = _find(r, engine="deepspeed", zero=0, micro_batch=1, recompute="full", offload_optimizer=False)
    m = rej.memory
    assert m.params + m.grads + m.optimizer == 16 * LLAMA3_8B  # 128.5e9 bytes = 119.7 GiB of model states
    assert rej.reason == fit_reason(m.total, H100.memory_bytes)
    need, have, short = _gib(rej.reason)
    assert need >= 119.6 and have == 74.5 and short == pytest.approx(need - have, abs=0.11)
    assert set(r.to_json()) == {"model", "chosen", "candidates", "rejected"}
    j = json.loads(json.dumps(r.to_json()))["chosen"]
    assert {
        "layout",
        "memory_bytes_per_rank",
        "comm_bytes_per_step",
        "bubble_fraction",
        "step_time_s",
        "mfu",
    } <= set(j)
    assert {"dp", "tp", "pp", "vpp", "ep", "zero", "micro_batch", "engine", "recompute"} <= set(j["layout"])
    assert {"params", "grads", "optimizer", "activations", "total"} <= set(j["memory_bytes_per_rank"])
    assert j["formulas"]["model_states"].startswith(f"ZeRO-{c.layout.zero} bf16 Adam")
    assert j["formulas"]["flops_per_token"].startswith("6*N_active + 12*L*H*Q*T")
    times = [x.time.step_s for x in r.candidates]
    assert times == sorted(times) and 0 < c.time.mfu < 0.5


def test_llama_70b_on_64_h100_keeps_tp_inside_a_node():
    r = plan(_llama70b(), world_size=64, seq_len=4096, global_batch=512, precision="bf16", hardware=H100)
    c = r.chosen
    assert c is not None and c.memory.total <= H100.memory_bytes
    assert 1 < c.layout.tp <= H100.devices_per_node
    assert c.layout.pp > 1 or c.layout.zero == 3
    assert all(x.layout.tp <= 8 for x in r.candidates)  # never tp across nodes
    kv = _find(r, engine="megatron", tp=16)
    assert kv and all("num_key_value_heads=8 is not divisible by tp=16" in x.reason for x in kv)
    z2pp = _find(r, engine="megatron", tp=8, pp=2, zero=2)
    assert z2pp and "ZeRO-2 shards gradients" in z2pp[0].reason  # check_megatron_layout's rule, verbatim
    dp_only = _find(r, engine="deepspeed", zero=0)
    assert dp_only and all(x.reason.startswith("does not fit") for x in dp_only)


def test_tp_across_nodes_is_legal_but_loses_to_nvlink():
    """16 KV heads make tp=16 legal on 2 nodes; its all-reduces then run on the 50 GB/s NIC, not NVLink."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(
        "llama",
        hidden_size=6144,
        intermediate_size=16384,
        num_hidden_layers=48,
        num_attention_heads=48,
        num_key_value_heads=16,
        vocab_size=128256,
        tie_word_embeddings=False,
    )
    r = plan(cfg, world_size=16, seq_len=4096, global_batch=128, precision="bf16", hardware=H100)
    assert r.chosen is not None and r.chosen.layout.tp <= H100.devices_per_node
    tp16 = [x for x in r.candidates if x.layout.tp == 16]
    tp8 = [x for x in r.candidates if x.layout.tp == 8]
    assert tp16 and tp8 and tp16[0].time.step_s > 3 * tp8[0].time.step_s


def test_mixtral_8x7b_on_8_h100_needs_zero3_or_ep_and_offload():
    sec = _section("mixtral-8x7b")
    r = plan(
        load_hf_config(sec),
        world_size=8,
        seq_len=4096,
        global_batch=64,
        precision="bf16",
        hardware=H100,
        attn_implementation=sec.attn_implementation,
    )
    c = r.chosen
    assert c is not None and c.memory.total <= H100.memory_bytes
    assert c.layout.zero == 3 or c.layout.ep > 1
    # 16 bytes x 46.7e9 = 747 GB of model states > 8 x 80 GB: only offloading layouts can fit
    assert 8 * H100.memory_bytes < 16 * MIXTRAL
    assert all(x.layout.offload_optimizer for x in r.candidates)
    ep8 = _find(r, engine="megatron", ep=8, tp=1, pp=1, zero=1, recompute="full", micro_batch=1)
    assert ep8 and ep8[0].reason.startswith("does not fit")
    gap = _find(r, engine="megatron", ep=8, tp=8)
    assert gap and "ep=8 does not divide dp=1" in gap[0].reason  # expert-tp = tp needs ep | dp


def test_nothing_fits_reports_every_shortfall():
    cpu = load_hardware(HW / "cpu-2core.yaml")
    r = plan(_cfg("llama-3-8b"), world_size=2, seq_len=128, global_batch=2, precision="fp32", hardware=cpu)
    assert r.chosen is None and not r.candidates and r.to_json()["chosen"] is None
    (z3,) = _find(r, engine="deepspeed", zero=3, micro_batch=1, recompute="full")
    # DeepSpeed's real ZeRO-3 (engines/held.py): params, grads, fp32 master and Adam m+v sharded
    # (4+4+4+8)Ψ/N, plus the persistent norms (under the persistence threshold) whole on every rank
    held = z3.memory.params + z3.memory.grads + z3.memory.optimizer
    assert held == 20 * LLAMA3_8B // 2 + 4 * 65 * 4096
    assert z3.reason == fit_reason(z3.memory.total, cpu.memory_bytes)
    need, have, short = _gib(z3.reason)
    assert need == round(z3.memory.total / GiB, 1) and have == 11.8 and short > 48


def test_tiny_model_plans_on_this_cpu():
    cpu = load_hardware(HW / "cpu-2core.yaml")
    r = plan(_cfg("tiny-llama"), world_size=2, seq_len=128, global_batch=8, precision="fp32", hardware=cpu)
    c = r.chosen
    assert c is not None and c.time.step_s > 0 and c.memory.total < 1 * GiB
    assert {x.layout.engine for x in r.candidates} == set(ENGINE_NAMES)


def test_plan_refuses_unknown_options():
    with pytest.raises(RecipeError) as e:
        plan(
            _cfg("tiny-llama"),
            world_size=2,
            seq_len=8,
            global_batch=2,
            precision="bf16",
            hardware=H100,
            recompute=("some",),
        )
    assert e.value.field == "recompute"
    with pytest.raises(RecipeError) as e:
        plan(_cfg("tiny-llama"), world_size=2, seq_len=8, global_batch=2, precision="fp8", hardware=H100)
    assert e.value.field == "train.precision"


def test_profile_is_a_frozen_dataclass():
    with pytest.raises(AttributeError):
        H100.peak_flops = 1.0  # type: ignore[misc]
    assert isinstance(H100, HardwareProfile)


def test_hf_tensor_numels_are_the_hf_modules():
    from transformers import AutoModelForCausalLM

    for fam in FAMILY_NAMES:
        cfg = _cfg(f"tiny-{fam}")
        model = AutoModelForCausalLM.from_config(cfg)
        real = sorted(p.numel() for p in model.parameters())  # tied weights appear once
        assert sorted(hf_tensor_numels(model_facts(cfg))) == real, fam


def test_auto_takes_recompute_only_when_the_layout_fits_only_with_it():
    """`parallel: auto`: with device memory between what the best recompute layout and the best layout
    without recompute need, the chosen plan recomputes, and the recipe the ranks run says so; with
    room for both, the faster layout without recompute wins."""
    import dataclasses

    from tessera.config.loader import load_recipe
    from tessera.plan.search import apply_plan

    cfg, h100 = _cfg("llama-3-8b"), load_hardware("h100-sxm-80g")
    kw = dict(world_size=8, seq_len=8192, global_batch=64, precision="bf16", micro_batches=(1,))
    roomy = plan(cfg, hardware=dataclasses.replace(h100, memory_bytes=10**15), **kw)
    need = {rc: min(c.memory.total for c in roomy.candidates if c.recompute == rc) for rc in ("none", "full")}
    assert need["full"] < need["none"] and roomy.chosen.recompute == "none"
    tight = plan(
        cfg, hardware=dataclasses.replace(h100, memory_bytes=(need["full"] + need["none"]) // 2), **kw
    )
    assert tight.chosen is not None and tight.chosen.recompute != "none"
    assert all(c.recompute != "none" for c in tight.candidates)
    recipe = load_recipe(REPO / "recipes" / "llama3-8b-pretrain-h100x8-zero3.yaml").recipe
    applied = apply_plan(recipe, tight)
    assert applied.parallel.recompute == tight.chosen.recompute and not applied.parallel.auto
    # rank 0 goes on with `applied`; the other ranks read it back from recipe.resolved.yaml
    assert validate_recipe(yaml.safe_load(yaml.safe_dump(applied.to_dict(), sort_keys=False))) == applied


@pytest.mark.parametrize(
    "engine,zero,zero_impl,deepspeed",
    [
        ("deepspeed", 0, "auto", True),
        ("deepspeed", 2, "auto", True),
        ("ddp", 0, "auto", False),
        ("megatron", 1, "auto", False),
        ("megatron", 2, "auto", True),
        ("megatron", 1, "deepspeed", True),
        ("megatron", 0, "megatron", False),
    ],
)
def test_a_waiting_rank_knows_whether_deepspeed_shards_as_the_layout_will(engine, zero, zero_impl, deepspeed):
    """The ranks that wait for rank 0's preparation import DeepSpeed when the layout will use it,
    decided by the layout's own rule without reading the model."""
    from tessera.config.loader import load_recipe
    from tessera.plan.layout import layout_from_recipe, recipe_uses_deepspeed

    recipe = load_recipe(
        REPO / "recipes" / "tiny-llama-cpu.yaml",
        [f"parallel.engine={engine}", f"parallel.zero={zero}", f"parallel.zero_impl={zero_impl}"],
    ).recipe
    layout = layout_from_recipe(recipe)
    assert recipe_uses_deepspeed(recipe) is layout.uses_deepspeed is deepspeed


@pytest.mark.parametrize("engine", ["deepspeed", "ddp"])
def test_selective_recompute_is_refused_where_the_engine_cannot(engine):
    from tessera.config.loader import load_recipe
    from tessera.errors import LayoutError
    from tessera.plan.layout import layout_from_recipe

    recipe = load_recipe(
        REPO / "recipes" / "tiny-llama-cpu.yaml",
        [f"parallel.engine={engine}", "parallel.recompute=selective"],
    ).recipe
    with pytest.raises(LayoutError) as e:
        layout_from_recipe(recipe)
    assert e.value.field == "parallel.recompute" and e.value.value == "selective"
    assert "whole layers (full) only" in str(e.value) and "parallel.engine: megatron" in e.value.fix


def test_moe_under_tensor_parallelism_without_sp_is_refused_before_launch():
    """megatron-core raises in the first forward (MoE + TP needs sequence parallelism): a layout with
    sequence_parallel false is refused, naming the way out; with SP (or the experts split by ep) it runs."""
    from tessera.engines.megatron_layout import check_rules as check_megatron_layout

    shape = model_facts(_cfg("tiny-mixtral")).shape
    lay = _layout(engine="megatron", world_size=2, tp=2)
    with pytest.raises(
        LayoutError, match="MoE layers under tensor parallelism only with sequence parallelism"
    ):
        check_megatron_layout(lay, shape)
    check_megatron_layout(_layout(engine="megatron", world_size=2, ep=2), shape)  # experts split by ep: fine
    check_megatron_layout(_layout(engine="megatron", world_size=2, tp=2, sequence_parallel=True), shape)


def test_alpha_beta_fit_recovers_latency_and_bandwidth():
    """seconds = α·messages + β·wire bytes, fitted by least squares from counted calls (with noise)."""
    import random

    from tessera.plan.measured import _fit_alpha_beta

    rng = random.Random(0)
    alpha, beta = 60e-6, 1 / 4e9
    samples = []
    for _ in range(400):
        m, w = rng.choice([1, 2, 3]), rng.choice([16, 4096, 1e6, 4e6, 2e7])
        samples.append((m, w, (alpha * m + beta * w) * rng.uniform(0.95, 1.05)))
    a, b = _fit_alpha_beta(samples)
    assert abs(a - alpha) < 0.05 * alpha and abs(b - beta) < 0.05 * beta


def test_a_profile_without_comm_overlap_exposes_every_dp_second(tmp_path):
    """On CPU (gloo and the backward share the cores) the data-parallel collectives are all exposed."""
    import dataclasses

    f = _tiny_llama_facts()
    lay = _layout(engine="deepspeed", world_size=2, zero=2)
    cpu = load_hardware("cpu-2core")
    assert cpu.comm_overlap is False
    exposed = step_time(f, lay, seq_len=64, precision="fp32", recompute="none", hardware=cpu)
    hidden = step_time(
        f,
        lay,
        seq_len=64,
        precision="fp32",
        recompute="none",
        hardware=dataclasses.replace(cpu, comm_overlap=True),
    )
    ops = comm_per_step(f, lay, seq_len=64, precision="fp32")
    dp = sum(op_seconds(o, cpu) for o in ops if o.group == "dp")
    assert dp > 0 and exposed.dp_exposed_s == pytest.approx(dp) and hidden.dp_exposed_s < dp
    (tmp_path / "p.yaml").write_text(
        (REPO / "configs/hardware/cpu-2core.yaml").read_text() + "comm_overlap: 1\n"
    )
    with pytest.raises(RecipeError, match="true or false"):
        load_hardware(tmp_path / "p.yaml")


def test_each_engine_takes_its_own_efficiency_from_a_calibrated_profile(tmp_path):
    """An engine's own work per step (hooks, bucket copies, unfused kernels) counts in its compute time: a
    calibrated profile has one efficiency per engine it measured, the others use ``efficiency``."""
    import dataclasses

    f = _tiny_llama_facts()
    cpu = dataclasses.replace(
        load_hardware("cpu-2core"), efficiency=0.2, engine_efficiency={"megatron": 0.05, "ddp": 0.4}
    )

    def compute(**kw) -> float:  # the same global batch of 8 rows on 2 ranks
        lay = _layout(world_size=2, micro_batch=4, **kw)
        return step_time(f, lay, seq_len=64, precision="fp32", recompute="none", hardware=cpu).compute_s

    ds = compute(engine="deepspeed", zero=2)
    assert compute(engine="megatron", pp=2, grad_accum=2) == pytest.approx(4 * ds, rel=1e-12)
    assert compute(engine="ddp") == pytest.approx(ds / 2, rel=1e-12)
    (tmp_path / "p.yaml").write_text(
        (REPO / "configs/hardware/cpu-2core.yaml").read_text() + "engine_efficiency: {megatron: 0.05}\n"
    )
    assert load_hardware(tmp_path / "p.yaml").efficiency_for("megatron") == 0.05
    (tmp_path / "p.yaml").write_text(
        (REPO / "configs/hardware/cpu-2core.yaml").read_text() + "engine_efficiency: {fsdp: 0.05}\n"
    )
    with pytest.raises(RecipeError, match="engine names"):
        load_hardware(tmp_path / "p.yaml")


def test_zero2_pays_its_gradient_hooks_on_every_micro_batch_but_the_last():
    """DeepSpeed ZeRO 2-3 reduce every micro-batch's gradients (ZeRO 0-1 only the last one's): per
    micro-batch before the last, the profile's seconds per tensor for the 21 tensors of the tiny llama,
    and the gradients copied into the buckets and out (2 x 4Ψ bytes in fp32 at hbm_bandwidth)."""
    import dataclasses

    from tessera.plan.time_estimate import grad_hook_passes

    f, psi = _tiny_llama_facts(), TINY_LLAMA_PSI
    cpu = dataclasses.replace(load_hardware("cpu-2core"), grad_hook_s=1e-4)

    def times(**kw):
        lay = _layout(world_size=2, micro_batch=2, **kw)
        return lay, step_time(f, lay, seq_len=64, precision="fp32", recompute="none", hardware=cpu)

    lay, t = times(engine="deepspeed", zero=2, grad_accum=4)
    assert grad_hook_passes(lay) == 3
    assert t.grad_hooks_s == pytest.approx(3 * (21 * 1e-4 + 2 * 4 * psi / cpu.hbm_bandwidth), rel=1e-12)
    assert t.step_s == pytest.approx(
        t.compute_s + t.dp_exposed_s + t.optimizer_s + t.grad_hooks_s + t.tp_ep_s + t.pp_s, rel=1e-12
    )
    _, z3 = times(engine="deepspeed", zero=3, grad_accum=4)
    assert z3.grad_hooks_s == t.grad_hooks_s
    for kw in (
        dict(engine="deepspeed", zero=1, grad_accum=4),  # reduces the last micro-batch only
        dict(engine="deepspeed", zero=2, grad_accum=1),  # one micro-batch: it is the last
        dict(engine="ddp", grad_accum=4),
        dict(engine="megatron", zero=2, zero_impl="megatron", grad_accum=4),
    ):
        lay, other = times(**kw)
        assert grad_hook_passes(lay) == 0 and other.grad_hooks_s == 0.0, kw


def _synthetic_run(path: Path, overrides: list[str], truth) -> Path:
    """A finished run directory whose every steady step took what the planner predicts on ``truth`` (a
    profile standing for the machine), with no collectives counted."""
    from tessera.config.loader import load_recipe
    from tessera.plan.measured import predicted

    recipe = load_recipe(REPO / "recipes" / "tiny-llama-cpu.yaml", overrides).recipe
    t = predicted(recipe, truth).time
    path.mkdir()
    (path / "recipe.resolved.yaml").write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    rec = {"compute_time_s": t.compute_s + t.grad_hooks_s, "comm_time_s": t.dp_exposed_s}
    rec |= {"optimizer_time_s": t.optimizer_s, "step_time_s": t.step_s}
    lines = [json.dumps({"step": s, **rec}) for s in range(1, 13)]
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (path / "comm.jsonl").write_text("")
    return path


def test_calibration_fits_zero2s_hooks_from_a_run_with_accumulation(tmp_path):
    """The hooks are fitted apart from the efficiency when the engine has a run without them (ZeRO-1):
    both come back from runs made on a known profile, and the ZeRO-2 layout left out of the fit is
    predicted exactly. With ZeRO-2 runs alone the hooks stay in the efficiency (the base profile's
    grad_hook_s is kept)."""
    import dataclasses

    from tessera.plan.measured import calibrate, compare_to_run

    base = load_hardware("cpu-2core")
    truth = dataclasses.replace(base, engine_efficiency={"deepspeed": 0.25}, grad_hook_s=2e-4)
    runs = {
        name: _synthetic_run(tmp_path / name, overrides, truth)
        for name, overrides in {
            "zero1": ["parallel.zero=1"],
            "zero2": [],
            "zero2_mb2": ["parallel.micro_batch=2"],
        }.items()
    }
    fitted, report = calibrate([runs["zero1"], runs["zero2_mb2"]], base)
    assert fitted.engine_efficiency == {"deepspeed": pytest.approx(0.25, rel=1e-9)}
    assert fitted.grad_hook_s == pytest.approx(2e-4, rel=1e-6) and len(report["grad_hook_per_run"]) == 1
    step = compare_to_run(runs["zero2"], fitted)["terms"]["step"]
    assert step["predicted_s"] == pytest.approx(step["measured_s"], rel=1e-6)
    alone, report = calibrate([runs["zero2"], runs["zero2_mb2"]], base)
    assert alone.grad_hook_s is None and report["grad_hook_per_run"] == []
    assert alone.engine_efficiency["deepspeed"] < 0.25  # the hooks' seconds counted as compute


# ---- the plan table, recompute and offload in the search, the recipe's own layout -----------------------

PLAN_LINE = re.compile(
    r"^# plan \(tessera plan, ([\w-]+)\): ([\d.]+) GiB/rank, ([\d.]+) s/step, MFU ([\d.]+), bubble ([\d.]+)$",
    re.M,
)


def test_plan_table_headers_sit_over_their_cells():
    """The table's headers and each row's cells come from one list of columns: as many cells as headers,
    and a known candidate's cells under the right headers (the old table had no offload header, so
    "mem GiB/rank" sat over the micro-batch)."""
    from tessera.plan.table import COLUMNS, cells, headers

    r = plan(
        _cfg("llama-3-8b"),
        world_size=8,
        seq_len=8192,
        global_batch=64,
        precision="bf16",
        hardware=H100,
        engines=("deepspeed",),
        micro_batches=(1, 2),
    )
    names = headers()
    assert len(names) == len(set(names)) == len(COLUMNS)
    rows = [cells(i, c) for i, c in enumerate(r.candidates)]
    assert rows and all(len(row) == len(names) for row in rows)
    (i, c), *_ = [(i, c) for i, c in enumerate(r.candidates) if c.layout.offload_optimizer]
    row = dict(zip(names, rows[i], strict=True))
    assert row["mem GiB/rank"] == f"{c.memory.total / GiB:.1f}" and row["mb"] == str(c.layout.micro_batch)
    assert row["offload"] == ("opt+params" if c.layout.offload_params else "opt") and row["zero"] == "3"
    assert row["act GiB"] == f"{c.memory.activations / GiB:.1f}" and row["#"] == str(i + 1)
    assert (
        row["recompute"] == {"none": "-"}.get(c.recompute, c.recompute)
        and row["step s"] == f"{c.time.step_s:.3g}"
    )


def test_plan_cli_prints_each_value_under_its_header(capsys):
    """What `tessera plan` prints: the rendered rich table's header cells over the first row's cells."""
    from tessera.cli import main
    from tessera.config.loader import load_recipe
    from tessera.plan.search import plan_recipe

    recipe = REPO / "recipes" / "bench-llama-1b-h200.yaml"
    assert main(["plan", str(recipe), "--top", "2"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    head = next(x for x in lines if "mem GiB/rank" in x)
    first = lines[lines.index(head) + 2]
    table = dict(zip((h.strip() for h in head.strip("┃").split("┃")), (v.strip() for v in first.strip("│").split("│")), strict=True))  # fmt: skip
    best = plan_recipe(load_recipe(recipe).recipe, world_size=1, hardware=load_hardware("h200-141g")).chosen
    assert table["#"] == "1" and table["engine"] == best.layout.engine == "deepspeed"
    assert table["mem GiB/rank"] == f"{best.memory.total / GiB:.1f}" and table["mb"] == str(
        best.layout.micro_batch
    )
    assert table["offload"] == "-" and table["recompute"] == "-" and table["MFU"] == f"{best.time.mfu:.3f}"
    assert "recipe  the recipe's layout fits: 32.3 GiB of 131.3 GiB per rank, 0.24 s/step" in out


def test_recompute_is_searched_per_engine_and_priced():
    """plan_recipe searches none / selective / full where the engine runs it (selective on megatron only),
    and recompute's extra forward FLOPs are in the step time: full = one more forward of the layers,
    selective = the attention core's forward."""
    from tessera.config.loader import load_recipe
    from tessera.plan.search import plan_recipe
    from tessera.plan.time_estimate import recompute_flops_per_token

    recipe = load_recipe(REPO / "recipes" / "llama3-8b-pretrain-h100x8-tp2-pp2.yaml").recipe
    r = plan_recipe(recipe, world_size=8, hardware=H100)
    seen = {(c.layout.engine, c.recompute) for c in r.candidates}
    assert {("megatron", "selective"), ("megatron", "full"), ("deepspeed", "full")} <= seen
    assert ("deepspeed", "selective") not in seen and ("ddp", "selective") not in seen
    assert all(c.layout.recompute == c.recompute for c in r.candidates)  # the layout says what it runs
    f = model_facts(_cfg("llama-3-8b"))
    same = {}
    for c in r.candidates:
        key = (
            c.layout.engine,
            c.layout.dp,
            c.layout.tp,
            c.layout.pp,
            c.layout.vpp,
            c.layout.zero,
            c.layout.micro_batch,
        )
        same.setdefault(key, {})[c.recompute] = c
    trio = next(v for v in same.values() if {"none", "selective", "full"} <= set(v))
    none, sel, full = trio["none"], trio["selective"], trio["full"]
    base = flops_per_token(f, 8192)
    for c, rc in ((sel, "selective"), (full, "full")):
        extra = recompute_flops_per_token(f, 8192, rc)
        assert c.time.compute_s == pytest.approx(none.time.compute_s * (base + extra) / base, rel=1e-12)
        assert c.time.recompute_s == pytest.approx(c.time.compute_s * extra / (base + extra), rel=1e-12)
        assert c.time.mfu < none.time.mfu and c.memory.activations < none.memory.activations
    assert recompute_flops_per_token(f, 8192, "selective") == 4 * 32 * 32 * 128 * 8192
    assert full.memory.activations < sel.memory.activations


def test_offload_pays_the_host_link_and_the_cpu_adam_step():
    """ZeRO-3 on 8 x H100: optimizer offload adds the CPU Adam step (28 bytes a parameter at 1/8 of the
    node's host-memory bandwidth) and the bf16 parameters' copy back up the 55 GB/s link to the step,
    the fp32 gradients' copy down hides behind the last backward; parameter offload copies the partition
    up every forward and backward. At equal step time the layout with less offload ranks first."""
    from tessera.plan.estimate import largest_shard
    from tessera.plan.search import rank_key

    f = model_facts(_cfg("llama-3-8b"))
    kw = dict(seq_len=8192, precision="bf16", recompute="none", hardware=H100)
    base = dict(engine="deepspeed", world_size=8, zero=3, grad_accum=8)
    plain = step_time(f, _layout(**base), **kw)
    opt = step_time(f, _layout(**base, offload_optimizer=True), **kw)
    both = step_time(f, _layout(**base, offload_optimizer=True, offload_params=True), **kw)
    shard = -(-largest_shard(f, _layout(**base)).total // 8)
    assert H100.host_link_bandwidth == 55e9 and H100.host_memory_bandwidth == 614e9
    cpu_adam, up, down = shard * 28 / (614e9 / 8), 2 * shard / 55e9, 4 * shard / 55e9
    assert opt.optimizer_s == pytest.approx(cpu_adam + up, rel=1e-12)
    assert opt.step_s - plain.step_s == pytest.approx(cpu_adam + up - plain.optimizer_s, rel=1e-9)
    assert opt.host_link_s == pytest.approx(down + up, rel=1e-12) and plain.host_link_s == 0.0
    assert both.host_link_s == pytest.approx(down + up + 2 * 8 * 2 * shard / 55e9, rel=1e-12)
    cpu = load_hardware(HW / "cpu-2core.yaml")
    assert cpu.host_link_bandwidth == 5e9 and not cpu.can_offload  # recorded, and no offload planned on CPU
    r = plan(_cfg("llama-3-8b"), world_size=8, seq_len=8192, global_batch=64, precision="bf16",
             hardware=H100, engines=("deepspeed",), micro_batches=(1,), attn_implementation="sdpa")  # fmt: skip
    assert [rank_key(c) for c in r.candidates] == sorted(rank_key(c) for c in r.candidates)
    z3 = [c for c in r.candidates if c.layout.zero == 3 and c.recompute == "none" and c.layout.sp == 1]
    assert [(c.layout.offload_optimizer, c.layout.offload_params) for c in z3[:2]] == [
        (True, False),
        (True, True),
    ]
    assert z3[0].time.step_s == z3[1].time.step_s  # the parameters' copies hide in each pass's window


def _recipe_fit(name: str, *overrides: str):
    from tessera.config.loader import load_recipe
    from tessera.plan.search import check_recipe_layout, hardware_for

    r = load_recipe(REPO / "recipes" / name, list(overrides)).recipe
    return check_recipe_layout(r, hardware=hardware_for(r, device="cuda"))


def test_every_gpu_recipe_fits_by_the_planner_with_the_plan_in_its_header():
    """Each shipped GPU recipe's own layout fits its hardware profile per the planner, and the plan line
    of its comment header carries the planner's figures (memory per rank, step time, MFU, bubble)."""
    from tessera.config.loader import load_recipe

    gpu = [p for p in sorted((REPO / "recipes").glob("*.yaml")) if load_recipe(p).recipe.run.device == "cuda"]
    assert len(gpu) >= 6 and (REPO / "recipes" / "llama3-70b-pretrain-h100x64-zero3.yaml") in gpu
    for path in gpu:
        fit = _recipe_fit(path.name)
        assert fit.fits, f"{path.name}: {fit.message()}"
        (line,) = PLAN_LINE.findall(path.read_text())
        c = fit.estimate
        assert line == (
            fit.hardware.name,
            f"{c.memory.total / GiB:.1f}",
            f"{c.time.step_s:.3g}",
            f"{c.time.mfu:.3f}",
            f"{c.bubble:.3f}",
        ), path.name


@pytest.mark.parametrize(
    ("recipe", "overrides", "need", "first_fix"),
    [
        ("llama3-8b-pretrain-h100x8-zero3.yaml", ["parallel.offload_optimizer=false"], 75.4,
         ["parallel.offload_optimizer=true"]),
        ("llama3-8b-pretrain-h100x8-tp2-pp2.yaml", ["parallel.recompute=none"], 119.4,  # SP on at tp 2 (auto)
         ["parallel.recompute=selective"]),
    ],
)  # fmt: skip
def test_a_recipe_layout_that_does_not_fit_says_which_change_makes_it_fit(recipe, overrides, need, first_fix):
    """The issue's two 8B layouts: what they need of the 74.5 GiB, and the one-field changes that fit,
    fastest first, each with the figures the recipe with that override really gets."""
    fit = _recipe_fit(recipe, *overrides)
    assert not fit.fits and round(fit.estimate.memory.total / GiB, 1) == need
    assert fit.fixes and [f.text for f in fit.fixes[:1]] == first_fix
    msg = fit.message()
    assert msg.startswith(f"the recipe's layout does not fit: it needs {need} GiB of 74.5 GiB per rank; set ")
    for fix in fit.fixes:
        again = _recipe_fit(recipe, *overrides, *fix.text.split())
        assert again.fits and again.estimate.memory.total == fix.estimate.memory.total
        assert again.estimate.time.step_s == fix.estimate.time.step_s
    shown = fit.fixes[:3]
    assert msg.endswith(" or ".join(
        f"{f.text} ({f.estimate.memory.total / GiB:.1f} GiB, {f.estimate.time.step_s:.3g} s/step)" for f in shown
    ))  # fmt: skip
    j = json.loads(json.dumps(fit.to_json()))
    assert j["fits"] is False and j["message"] == msg and j["fixes"][0]["overrides"]


def test_plan_json_says_whether_the_recipes_layout_fits(capsys):
    """`tessera plan --json`: the recipe's layout with its verdict and fixes next to the search."""
    from tessera.cli import main

    recipe = REPO / "recipes" / "bench-llama-1b-h200.yaml"
    assert main(["plan", str(recipe), "parallel.engine=megatron", "data.seq_len=8192", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    own = out["recipe_layout"]
    assert own["fits"] is False and own["problem"].startswith("does not fit: needs")
    assert (
        own["estimate"]["layout"]["engine"] == "megatron" and own["estimate"]["layout"]["recompute"] == "none"
    )
    assert own["fixes"][0]["overrides"] == {"parallel.recompute": "selective"}
    assert own["fixes"][0]["memory_total_bytes"] <= own["device_memory_bytes"]
