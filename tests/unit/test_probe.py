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
