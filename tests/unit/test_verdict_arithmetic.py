"""The comparison's arithmetic on hand-made run directories: bands, the noise floor, ratios, the
pre-registration's integrity, and bad input refused before any run starts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from tessera.cli import main
from tessera.errors import TesseraError
from tessera.evidence.compare import (
    RunData,
    band_check,
    judge,
    noise_floor,
    preregister,
    read_preregistration,
    run_stats,
)
from tessera.rundir import RunDir


def fake_run(path: Path, *, seed: int, loss: list[float], step_s: list[float], tokens: int = 1000,
             peaks: tuple[int, ...] = (100, 90), world: int = 2, engine: str = "ddp", ttfs: float = 5.0) -> Path:  # fmt: skip
    """A finished run directory as the ranks leave it (metrics, summary, manifest), made by hand."""
    path.mkdir(parents=True)
    rd = RunDir(path)
    lines = []
    for i, (lo, t) in enumerate(zip(loss, step_s), 1):
        rec = {
            "step": i,
            "loss": lo,
            "grad_norm": 1.0 + lo / 10,
            "step_time_s": t,
            "tokens_per_s": tokens / t,
        }
        rec.update(comm_bytes=10, comm_fraction=0.2, compute_time_s=0.7 * t, comm_time_s=0.2 * t)
        rec.update(optimizer_time_s=0.1 * t, data_time_s=0.1 * t, mfu=0.01)
        if i == 1:
            rec["time_to_first_step_s"] = ttfs
        if i == len(loss):
            rec["eval_loss"] = lo + 0.1
        lines.append(json.dumps(rec))
    rd.metrics.write_text("\n".join(lines) + "\n")
    rd.write_json(RunDir.SUMMARY, {"peak_memory_bytes_per_rank": list(peaks), "last_checkpoint": None})
    rd.write_json(RunDir.MANIFEST, {"seed": seed, "world_size": world, "layout": {"engine": engine}})
    return path


def test_band_widest_form_and_first_step_outside():
    ref = {1: 10.0, 2: 10.0, 3: 10.0, 4: 10.0}
    cand = {1: 10.0, 2: 10.0005, 3: 10.002, 4: 10.0}
    got = band_check(cand, ref, {}, {"rel": 1e-4})  # width 1e-3
    assert got["first_step_outside"] == 3 and got["worst_step"] == 3
    assert got["measured"] == pytest.approx(2.0) and got["max_abs_diff"] == pytest.approx(0.002)
    # abs widens the band: the widest form applies
    assert band_check(cand, ref, {}, {"rel": 1e-4, "abs": 0.003})["first_step_outside"] is None
    # k x noise floor per step
    got = band_check(cand, ref, {1: 1.0, 2: 1.0, 3: 0.001, 4: 1.0}, {"noise_floor_multiple": 1.0})
    assert got["first_step_outside"] == 3 and got["measured"] == pytest.approx(2.0)


def test_noise_floor_is_the_windowed_seed_spread(tmp_path):
    losses = [[1.0 + 0.1 * s + 0.01 * k * s for s in range(12)] for k in range(3)]
    runs = [RunData.read(fake_run(tmp_path / f"b{k}", seed=k, loss=lo, step_s=[0.1] * 12), "baseline") for k, lo in enumerate(losses)]  # fmt: skip
    floor = noise_floor(runs, "loss")
    var = [float(np.var([lo[s] for lo in losses], ddof=1)) for s in range(12)]
    for step in (1, 6, 12):
        i = step - 1
        window = var[max(0, i - 4) : i + 5]
        assert floor[step] == pytest.approx(math.sqrt(sum(window) / len(window)), rel=1e-12)
    assert noise_floor(runs[:1], "loss") == {}  # one seed: no floor


def test_judge_ratios_and_percentiles(tmp_path):
    rng = np.random.default_rng(0)
    t_base = list(0.05 + 0.01 * rng.random(40))
    t_cand = list(0.04 + 0.01 * rng.random(40))
    loss = [6.0 - 0.01 * i for i in range(40)]
    cand = RunData.read(fake_run(tmp_path / "c", seed=1, loss=loss, step_s=t_cand, peaks=(80, 70), engine="deepspeed", ttfs=6.0), "candidate")  # fmt: skip
    b1 = RunData.read(fake_run(tmp_path / "b1", seed=1, loss=loss, step_s=t_base), "baseline")
    b2 = RunData.read(fake_run(tmp_path / "b2", seed=2, loss=[x + 0.05 for x in loss], step_s=t_base), "baseline")  # fmt: skip
    acc = {"warmup_steps": 5, "throughput_ratio_min": 1.0, "peak_memory_ratio_max": 0.8}
    acc.update(time_to_first_step_ratio_max=1.1, loss_tolerance={"rel": 1e-6}, eval_loss_ratio_max=1.0)
    res = judge(acc, cand, [b1, b2])
    checks = {c["threshold_name"]: c for c in res["checks"]}
    expect_tps = 1000 * 35 / sum(t_cand[5:]) / (1000 * 35 / sum(t_base[5:]))
    assert checks["throughput_ratio_min"]["measured"] == pytest.approx(expect_tps, rel=1e-12)
    assert checks["peak_memory_ratio_max"]["measured"] == pytest.approx(0.8)
    assert checks["peak_memory_ratio_max"]["passed"]  # <= holds at equality
    assert checks["time_to_first_step_ratio_max"]["measured"] == pytest.approx(1.2)
    assert not checks["time_to_first_step_ratio_max"]["passed"] and res["verdict"] == "FAIL"
    assert checks["loss_tolerance"]["measured"] == 0.0 and checks["eval_loss_ratio_max"]["passed"]
    st = res["runs"]["c"]["step_time_s"]
    for q in (50, 95, 99):  # numpy's own percentiles of the timed steps
        assert st[f"p{q}"] == float(np.percentile(t_cand[5:], q))
    assert st["max"] == max(t_cand[5:])
    where = res["runs"]["c"]["where_the_time_went"]
    assert where["compute"] == pytest.approx(0.7 / 1.1) and sum(where.values()) == pytest.approx(1.0)
    # one threshold set just beyond the measured value: FAIL, naming it and the value measured
    res2 = judge({**acc, "time_to_first_step_ratio_max": None, "throughput_ratio_min": expect_tps * 1.001}, cand, [b1, b2])  # fmt: skip
    failed = [c for c in res2["checks"] if not c["passed"]]
    assert [c["threshold_name"] for c in failed] == ["throughput_ratio_min"]
    assert failed[0]["measured"] == pytest.approx(expect_tps, rel=1e-12) and failed[0]["refutes_claim"]


def test_run_stats_cost_per_token(tmp_path):
    run = RunData.read(fake_run(tmp_path / "r", seed=1, loss=[1.0] * 10, step_s=[0.5] * 10), "baseline")
    s = run_stats(run, warmup=2, price_per_device_hour=2.0)
    assert s["tokens_per_s"] == pytest.approx(2000.0)
    assert s["tokens_per_device_hour"] == pytest.approx(2000.0 / 2 * 3600)
    assert s["cost_per_1b_tokens"] == pytest.approx(2.0 * 1e9 / (1000.0 * 3600))


def test_preregistration_cannot_change_after_registration(tmp_path):
    sha = preregister(tmp_path, {"acceptance": {"throughput_ratio_min": 0.9}})
    rec, got = read_preregistration(tmp_path)
    assert got == sha and rec["acceptance"]["throughput_ratio_min"] == 0.9
    assert (tmp_path / "preregistration.sha256").read_text() == f"{sha}  preregistration.json\n"
    p = tmp_path / "preregistration.json"
    p.write_text(p.read_text().replace("0.9", "0.5"))
    with pytest.raises(TesseraError) as e:
        read_preregistration(tmp_path)
    assert "cannot change after the runs start" in str(e.value)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["acceptance.loss_tolerance.noise_floor_multiple=3", "--seeds", "1"], "--seeds"),
        (["data.eval.fraction=0"], "data.eval.fraction"),
        (["--baseline", "nope.yaml"], "--baseline"),
        (["--seeds", "0"], "--seeds"),
    ],
)
def test_bad_input_is_refused_before_any_run(tmp_path, capsys, args, field):
    out = tmp_path / "cmp"
    assert main(["compare", "recipes/tiny-llama-cpu.yaml", *args, "--out", str(out)]) == 2
    assert field in capsys.readouterr().err
    assert not out.exists()  # nothing registered, nothing started


def test_no_threshold_is_refused(tmp_path, capsys):
    unset = [f"acceptance.{k}=null" for k in ("loss_tolerance", "grad_norm_tolerance", "eval_loss_ratio_max",
             "throughput_ratio_min", "peak_memory_ratio_max", "time_to_first_step_ratio_max")]  # fmt: skip
    assert main(["compare", "recipes/tiny-llama-cpu.yaml", *unset, "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "acceptance" in err and "could refute" in err
