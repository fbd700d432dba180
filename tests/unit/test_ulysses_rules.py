"""Ulysses sequence parallelism before launch (issue 35): the layout axis, the refusals of what cannot run
(exit 2 naming the field and a layout that works), the planner's all-to-all and activation terms, and the
8B 128K recipe's plan."""

from __future__ import annotations

import json

import pytest

from helpers import REPO
from tessera.cli import main

LONG = REPO / "recipes" / "tiny-llama-long-cpu.yaml"
BIG = REPO / "recipes" / "llama3-8b-128k-h100x8-zero3-sp8.yaml"
GiB = 1 << 30

BAD = [
    # (overrides, words the message must contain: the field, the value and a layout that works)
    (["parallel.sp=3", "run.world_size=3", "data.seq_len=4095", "run.bind_cores_to_rank=false"],
     ["parallel.sp = 3", "4 attention heads cannot be split over parallel.sp=3", "parallel.sp: 2 or 4"]),
    (["data.seq_len=4095"],
     ["data.seq_len = 4095", "cannot be cut into parallel.sp=2 equal slices", "a multiple of 2 (e.g. 4096)"]),
    (["parallel.engine=megatron", "parallel.sp=2"],
     ["parallel.sp = 2", "engine 'megatron' has no Ulysses sequence parallelism",
      "parallel.tp: 2 with parallel.sequence_parallel: true", "parallel.engine: deepspeed with parallel.sp: 2"]),
    (["parallel.engine=ddp", "parallel.sp=2", "parallel.zero=0"],
     ["parallel.sp = 2", "engine 'ddp' has no Ulysses", "parallel.engine: deepspeed (e.g. parallel.zero: 2"]),
    (["model.attn_implementation=eager"],
     ["model.attn_implementation = 'eager'", "set model.attn_implementation: sdpa, or parallel.sp: 1"]),
    (["data.document_boundaries=true"],
     ["data.document_boundaries = True", "documents packed in a row would see each other", "data.packing: false"]),
    (["parallel.sp=1", "parallel.engine=ddp", "parallel.zero=0", "parallel.tiled_mlp=true"],
     ["parallel.tiled_mlp = True", "engine 'ddp' has no tiled MLP", "parallel.engine: deepspeed"]),
    (["parallel.offload_activations=true"],
     ["parallel.offload_activations = True", "set parallel.recompute: full"]),
    (["parallel.sp=2", "run.world_size=3", "run.bind_cores_to_rank=false"],
     ["run.world_size = 3", "not divisible by tp*pp*sp=2"]),
]  # fmt: skip


@pytest.mark.parametrize(("overrides", "words"), BAD, ids=[" ".join(b[0]) for b in BAD])
def test_what_ulysses_cannot_run_exits_2_naming_the_field(capsys, overrides, words):
    code = main(["run", str(LONG), *overrides, "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)


def test_zero3_under_sp_keeps_deepspeeds_reduce_scatter(capsys, tmp_path):
    """deepspeed 0.19.8 averages ZeRO-3 gradients over dp*sp on its reduce-scatter path (the engine scales
    for it); a JSON turning it off would average some buckets over dp: refused."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "reduce_scatter": False}}))
    code = main(["run", str(LONG), "parallel.zero=3", f"parallel.deepspeed_config={ds}", "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and "parallel.deepspeed_config" in err and "reduce_scatter" in err, err


def test_the_layout_puts_sp_fastest():
    """DeepSpeed's sp groups are consecutive ranks: sp rank = rank % sp; the samples follow dp."""
    from tessera.plan.layout import ParallelLayout

    lay = ParallelLayout(engine="deepspeed", world_size=8, dp=2, sp=4, zero=3, micro_batch=1, grad_accum=2,
                         global_batch=4)  # fmt: skip
    assert [lay.coords(r)["sp"] for r in range(8)] == [0, 1, 2, 3] * 2
    assert [lay.dp_rank(r) for r in range(8)] == [0] * 4 + [1] * 4
    assert lay.data_ranks == 8 and "sp=4" in lay.describe() and "seq_parallel" not in lay.describe()


def _facts(kv: int):
    from transformers import LlamaConfig

    from tessera.plan.facts import model_facts

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=kv,
                      num_hidden_layers=2, vocab_size=512)  # fmt: skip
    return model_facts(cfg)


@pytest.mark.parametrize(("sp", "kv", "kv_heads_sent"), [(2, 2, 2), (4, 2, 4), (4, 4, 4)])
def test_the_all_to_alls_per_layer(sp, kv, kv_heads_sent):
    """q and the output e·b·(s/sp)·a·d, k and v e·b·(s/sp)·max(g, sp)·d (fewer KV heads than sp:
    replicated), 4 forward + 4 backward per layer and micro-batch; one position-id gather per forward."""
    from tessera.plan.comm_estimate import comm_bytes_by_op, comm_per_step, ulysses_ops
    from tessera.plan.layout import ParallelLayout

    lay = ParallelLayout(engine="deepspeed", world_size=sp, dp=1, sp=sp, zero=2, micro_batch=2, grad_accum=3,
                         global_batch=6)  # fmt: skip
    f, s, e = _facts(kv), 1024, 4
    ulysses = comm_bytes_by_op(ulysses_ops(f, lay, seq_len=s, e=e))
    local = s // sp
    per_layer = 2 * (2 * e * 2 * local * 4 * 16 + 2 * e * 2 * local * kv_heads_sent * 16)
    assert ulysses == {"all_to_all:sp": per_layer * 2 * 3, "all_gather:sp": 2 * s * 8 * 2 * 3}
    got = comm_bytes_by_op(comm_per_step(f, lay, seq_len=s, precision="fp32", backend="gloo"))
    assert got["all_to_all:sp"] == ulysses["all_to_all:sp"]
    assert got["all_reduce:sp"] == 4 * sum(_numels(f)) * 3  # ZeRO-2's fp32 gradients, every micro-batch


def _numels(f):
    from tessera.plan.estimate import hf_tensor_numels

    return hf_tensor_numels(f)


def test_the_8b_128k_recipe_fits_on_8_h100(capsys):
    """ZeRO-3 + sp8 at 131,072 tokens: the recipe's layout fits in 80 GB, and the planner's own search
    picks sp8 too (nothing else fits a 128K sequence on 8 ranks)."""
    assert main(["plan", str(BIG), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    own = out["recipe_layout"]
    assert own["fits"] is True
    layout = own["estimate"]["layout"]
    assert (layout["sp"], layout["zero"], layout["tiled_mlp"], layout["tiled_loss"]) == (8, 3, True, True)
    assert own["estimate"]["memory_bytes_per_rank"]["total"] < 80 * GiB
    assert out["chosen"]["layout"]["sp"] == 8
