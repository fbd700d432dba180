"""`tessera plan --probe`'s arithmetic: the profile made from measurements (synthetic here; the real
probe runs in tests/dist/test_probe_run.py), where it is kept, and what a run's manifest says of it."""

from __future__ import annotations

import pytest

from tessera.config.loader import load_recipe
from tessera.plan.comm_estimate import wire_factor
from tessera.plan.facts import model_facts
from tessera.plan.hardware import load_hardware
from tessera.plan.probe import OPS, SIZES, find_probe, probe_path, probe_record, profile_from, write_profile
from tessera.plan.time_estimate import ADAM_BYTES_PER_PARAM, flops_per_token

ALPHA, BETA = 3e-4, 1 / 2e9  # seconds per call, seconds per wire byte


def synthetic(recipe, world=2):
    from tessera.models.hf import load_hf_config

    tokens = recipe.parallel.micro_batch * recipe.data.seq_len
    flops = flops_per_token(model_facts(load_hf_config(recipe.model, vocab_size=recipe.data.vocab_size)),
                            recipe.data.seq_len) * tokens  # fmt: skip
    rank = {
        "matmul_flops": 40e9, "fwd_bwd_s": flops / 10e9, "adam_s": 1e5 * ADAM_BYTES_PER_PARAM / 7e9,
        "params": 100_000,
        "collectives": [{"op": op, "bytes": n, "seconds": ALPHA + BETA * wire_factor(op, world) * n}
                        for op in OPS for n in SIZES],
    }  # fmt: skip
    setting = {
        "seq_len": recipe.data.seq_len,
        "tokens": tokens,
        "hidden": 64,
        "width": 128,
        "precision": "fp32",
    }
    return {"ranks": [{**rank, "rank": r} for r in range(world)], "setting": setting, "seconds": 12.0}


@pytest.fixture
def recipe():
    return load_recipe("recipes/tiny-llama-cpu.yaml", []).recipe


def test_the_profile_holds_what_was_measured(recipe, tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_HARDWARE_DIR", str(tmp_path))
    profile, how = profile_from(synthetic(recipe), recipe, world=2, device="cpu")
    assert profile.peak_flops == profile.peak_flops_fp32 == pytest.approx(40e9)
    assert profile.efficiency == pytest.approx(10e9 / 40e9)  # the model's FLOP/s over the matmul's
    assert profile.hbm_bandwidth == pytest.approx(7e9)  # 28 bytes a parameter over the AdamW step
    assert profile.latency_s == pytest.approx(ALPHA) and profile.tp_latency_s == pytest.approx(ALPHA)
    assert profile.intra_node_bandwidth == pytest.approx(2e9)
    assert profile.engine_efficiency is None and profile.grad_hook_s is None  # not probed: not kept
    assert set(how) >= {"peak_flops", "efficiency", "hbm_bandwidth", "latency_s"}
    assert find_probe("cpu", 2) is None and probe_record("cpu", 2) is None
    write_profile(profile, how, synthetic(recipe), probe_path("cpu", 2))
    assert find_probe("cpu", 2) == probe_path("cpu", 2) and find_probe("cpu", 4) is None
    assert load_hardware(probe_path("cpu", 2)) == profile  # the planner reads what was written
    record = probe_record("cpu", 2)
    assert record["profile"]["latency_s"] == pytest.approx(ALPHA) and record["derivation"] == how
    probe_path("cpu", 2).write_text("latency_s: [oops\n")
    assert "error" in probe_record("cpu", 2)  # a damaged probe is named in the manifest, never a crash


def test_plan_uses_this_hosts_probe_and_says_how_to_get_one(recipe, tmp_path, monkeypatch, capsys):
    from tessera.cli import main

    monkeypatch.setenv("TESSERA_HARDWARE_DIR", str(tmp_path))
    assert main(["plan", "recipes/tiny-llama-cpu.yaml", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "--probe" in out and "cpu-2core" in out
    profile, how = profile_from(synthetic(recipe), recipe, world=2, device="cpu")
    write_profile(profile, how, synthetic(recipe), probe_path("cpu", 2))
    assert main(["plan", "recipes/tiny-llama-cpu.yaml", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert profile.name in out and "--probe" not in out


def _engine_steps(recipe, profile, world=2):
    """Steps of the probe's engine layouts exactly as the planner predicts them on ``profile``: each term
    its prediction, each collective its predicted calls, bytes and α + n·β seconds."""
    from tessera.plan.measured import predicted, predicted_terms
    from tessera.plan.probe_engines import STEPS, runnable
    from tessera.plan.time_estimate import op_seconds

    engines = []
    for label, r in runnable(recipe, world)[0]:
        cand = predicted(r, profile)
        t = predicted_terms(cand)
        ops = [{"op": o.op, "group": o.group, "count": o.calls * o.messages, "bytes": o.payload_bytes,
                "seconds": op_seconds(o, profile)} for o in cand.comm_ops]  # fmt: skip
        # a pipeline's bubble is spent waiting in its receives: counted as communication, as in a run
        split = {"step_time_s": t["step"], "comm_time_s": t["step"] - t["compute"] - t["optimizer"],
                 "optimizer_time_s": t["optimizer"], "compute_time_s": t["compute"]}  # fmt: skip
        engines.append({"label": label, "steps": [{"step": n, **split, "ops": ops} for n in range(STEPS)]})
    return engines


def test_the_engines_steps_give_each_engine_its_efficiency(recipe, monkeypatch, tmp_path):
    """Engine steps made from the planner's own prediction at known efficiencies, TP α and optimizer
    bandwidth: the probe's profile recovers each of them (the fit is --calibrate's, here on observations
    that are not runs)."""
    from dataclasses import replace

    from tessera.plan.probe_engines import runnable

    monkeypatch.setenv("TESSERA_HARDWARE_DIR", str(tmp_path))
    measured = synthetic(recipe)
    hardware_only, _ = profile_from(measured, recipe, world=2, device="cpu")
    truth = replace(hardware_only, engine_efficiency={"ddp": 0.2, "deepspeed": 0.12, "megatron": 0.09},
                    tp_latency_s=1.5e-3, hbm_bandwidth=1.1e9)  # fmt: skip
    labels = [label for label, _ in runnable(recipe, 2)[0]]
    assert labels == ["ddp", "deepspeed-zero2", "megatron-pp", "megatron-tp"]
    engines = _engine_steps(recipe, truth)
    engines.append({"label": "broken", "error": "RuntimeError: no such engine here"})
    measured["ranks"][0]["engines"] = engines
    measured["setting"]["refused"] = {"megatron-ep": "parallel.ep: not this model"}
    profile, how = profile_from(measured, recipe, world=2, device="cpu")
    assert profile.engine_efficiency == pytest.approx(truth.engine_efficiency, rel=1e-6)
    assert profile.tp_latency_s == pytest.approx(1.5e-3, rel=1e-6)
    assert profile.hbm_bandwidth == pytest.approx(1.1e9, rel=1e-6)
    assert profile.latency_s == pytest.approx(ALPHA, rel=1e-6)  # the same α, β in both kinds of samples
    assert profile.intra_node_bandwidth == pytest.approx(2e9, rel=1e-6)
    assert profile.name == hardware_only.name
    for engine in ("ddp 0.200", "deepspeed 0.120", "megatron 0.090"):
        assert engine in how["engine_efficiency"]
    assert (
        "megatron-ep: parallel.ep" in how["engines_left_out"]
        and "broken: RuntimeError" in how["engines_left_out"]
    )


def test_the_probe_layouts_are_the_recipe_on_each_engine():
    """Each engine's probe layout keeps the recipe's model, data and micro-batch, at one micro-batch per
    data-parallel rank (W under pipelining); a layout this model cannot run is refused with its reason."""
    from tessera.plan.layout import layout_from_recipe
    from tessera.plan.probe_engines import runnable

    r = load_recipe("recipes/tiny-llama-cpu.yaml", []).recipe
    ok, refused = runnable(r, 2)
    layouts = {label: layout_from_recipe(x) for label, x in ok}
    assert not refused
    got = {k: (v.engine, v.dp, v.tp, v.pp, v.zero, v.micro_batch, v.grad_accum) for k, v in layouts.items()}
    assert got == {
        "ddp": ("ddp", 2, 1, 1, 0, 4, 1),
        "deepspeed-zero2": ("deepspeed", 2, 1, 1, 2, 4, 1),
        "megatron-pp": ("megatron", 1, 1, 2, 0, 4, 2),
        "megatron-tp": ("megatron", 1, 2, 1, 0, 4, 1),
    }
    assert all(x.model == r.model and x.data == r.data for _, x in ok)
    # 3 ranks: tiny Llama's 4 heads do not split 3 ways, nor its 2 layers into 3 stages
    ok3, refused3 = runnable(r, 3)
    assert [label for label, _ in ok3] == ["ddp", "deepspeed-zero2"]
    assert set(refused3) == {"megatron-pp", "megatron-tp"}
    assert all(refused3.values())


def test_the_probe_leaves_out_the_engine_layouts_that_do_not_fit():
    """Llama-3 8B on 8 H100s: a DDP replica, ZeRO-2 and 8 pipeline stages of full-width layers do not fit
    80 GB by the planner's memory estimate, so the probe does not build them; TP 8 does."""
    from tessera.plan.probe_engines import runnable

    r = load_recipe("recipes/llama3-8b-pretrain-h100x8-zero3.yaml", []).recipe
    ok, refused = runnable(r, 8, "cuda")
    assert [label for label, _ in ok] == ["megatron-tp"]
    assert set(refused) == {"ddp", "deepspeed-zero2", "megatron-pp"}
    assert all(reason.startswith("does not fit: needs") for reason in refused.values()), refused
