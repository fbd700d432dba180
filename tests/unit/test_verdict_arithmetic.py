"""The comparison's arithmetic on hand-made run directories: bands, the noise floor, ratios, the
pre-registration's integrity, and bad input refused before any run starts."""

from __future__ import annotations

import json
import math
import os
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


# ---- the comparison directory: created exclusively, never overwritten -------------------------------------


def test_two_compares_on_one_out_exactly_one_proceeds(tmp_path):
    """Contenders started at once on one --out (new, or existing and empty): exactly one claims it, every
    other is refused naming --out, and the claim stays held until released."""
    import threading

    from tessera.evidence.compare import CLAIM, claim_comparison_dir

    for trial in range(6):
        out = tmp_path / f"cmp{trial}"
        if trial % 2:
            out.mkdir()  # an existing empty directory is accepted too
        barrier, won, lost = threading.Barrier(6), [], []

        def contend(out=out, barrier=barrier, won=won, lost=lost):
            barrier.wait()
            try:
                won.append(claim_comparison_dir(out))
            except TesseraError as refused:
                lost.append(refused)

        threads = [threading.Thread(target=contend) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1 and len(lost) == 5, (won, lost)
        for e in lost:
            assert e.field == "--out" and e.value == str(out)
            assert e.message.startswith("the comparison directory is taken: ")
            assert "give a new directory with --out" in e.fix
        # a compare that comes later, while the winner still runs, is told so
        with pytest.raises(
            TesseraError, match=r"another tessera compare is writing into it now \(pid \d+ started"
        ):
            claim_comparison_dir(out)
        won[0].release()
        assert (out / CLAIM).read_text().startswith(f"pid {os.getpid()} started ")


def test_an_existing_comparison_or_any_non_empty_dir_is_refused_untouched(tmp_path, capsys):
    from tessera.evidence.compare import CLAIM, claim_comparison_dir

    out = tmp_path / "done"
    with claim_comparison_dir(out):
        preregister(out, {"acceptance": {"throughput_ratio_min": 0.9}})
        (out / "verdict.json").write_text('{"verdict": "PASS"}\n')
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    assert set(before) == {CLAIM, "preregistration.json", "preregistration.sha256", "verdict.json"}
    with pytest.raises(TesseraError) as e:
        claim_comparison_dir(out)
    assert e.value.render() == (
        f"--out = '{out}': the comparison directory is taken: it holds a finished comparison "
        "(preregistration.json and verdict.json)\n  fix: give a new directory with --out (a comparison's "
        "pre-registration, runs and verdict are never reused or overwritten)"
    )
    (out / "verdict.json").unlink()
    with pytest.raises(TesseraError, match="a pre-registered comparison without a verdict"):
        claim_comparison_dir(out)
    with pytest.raises(TesseraError, match="taken: it holds a pre-registered comparison"):
        preregister(out, {"acceptance": {"throughput_ratio_min": 0.1}})  # never replaced, even when called
    assert {f.name: f.read_bytes() for f in out.iterdir()} == {
        k: v for k, v in before.items() if k != "verdict.json"
    }
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(TesseraError, match=r"taken: it is not empty \(notes.txt\)"):
        claim_comparison_dir(other)
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(TesseraError, match="--out exists and is not a directory"):
        claim_comparison_dir(afile)
    assert (other / "notes.txt").read_text() == "mine" and afile.read_text() == "x"
    # through the CLI: exit 2, the files of the finished comparison byte for byte as they were
    recipe = "model: {hf_config: {model_type: llama}}\nacceptance: {loss_tolerance: {abs: 1.0}}\n"
    c = fake_run(tmp_path / "c", seed=1, loss=[1.0] * 4, step_s=[0.1] * 4)
    (c / RunDir.RECIPE).write_text(recipe)
    b = fake_run(tmp_path / "b", seed=1, loss=[1.0] * 4, step_s=[0.1] * 4)
    (b / RunDir.RECIPE).write_text(recipe)
    (out / "verdict.json").write_bytes(before["verdict.json"])
    assert main(["compare", "--runs", str(c), str(b), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"tessera: error: --out = '{out}': the comparison directory is taken: it holds a finished" in err
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before


def test_a_compare_failing_before_its_registration_leaves_no_trace(tmp_path):
    from tessera.evidence.compare import claim_comparison_dir

    out = tmp_path / "new"
    with pytest.raises(RuntimeError), claim_comparison_dir(out):
        raise RuntimeError("disk full")
    assert not out.exists()
    claim_comparison_dir(out).release()  # usable again


# ---- runs of unequal length or unequal work ------------------------------------------------------------


def test_unequal_runs_are_judged_on_their_common_steps(tmp_path):
    from tessera.evidence.compare import common_steps

    loss = [6.0 - 0.1 * i for i in range(8)]
    cand = RunData.read(fake_run(tmp_path / "c", seed=1, loss=loss, step_s=[0.1] * 8), "candidate")
    base = RunData.read(fake_run(tmp_path / "b", seed=1, loss=loss[:6], step_s=[0.2] * 6), "baseline")
    runs, note = common_steps([cand, base])
    assert note == {
        "steps_compared": 6,
        "steps_recorded": {"c": 8, "b": 6},
        "note": "runs of unequal length: judged on steps 1-6, the steps every run recorded (c 8 steps, b 6 steps)",
    }
    assert [len(r.metrics) for r in runs] == [6, 6] and runs[1].metrics == base.metrics
    res = judge(
        {"warmup_steps": 0, "loss_tolerance": {"abs": 1e-9}, "eval_loss_ratio_max": 1.5}, *runs[:1], runs[1:]
    )
    checks = {c["threshold_name"]: c for c in res["checks"]}
    assert checks["loss_tolerance"]["steps_checked"] == 6 and res["runs"]["c"]["steps"] == 6
    # the candidate's final eval (step 8) is cut: no common eval step, so the ratio is not measured
    assert checks["eval_loss_ratio_max"]["eval_step"] is None and not checks["eval_loss_ratio_max"]["passed"]
    assert common_steps([cand, cand]) == ([cand, cand], None)


def _manifest(**over) -> dict:
    m = {
        "seed": 1, "world_size": 2, "device": "cpu", "tokenizer_hash": "t" * 64,
        "layout": {"engine": "ddp", "global_batch": 16, "world_size": 2},
        "data": {"content_hash": "c" * 64, "data_hash": "d" * 64, "seq_len": 64, "files": [{"path": "/a"}]},
        "recipe": {"model": {"hf_config": {"model_type": "llama", "hidden_size": 64}, "attn_implementation": "eager"},
                   "train": {"steps": 8}, "optim": {"schedule": "cosine", "lr": 1e-3}},
    }  # fmt: skip
    for dotted, v in over.items():
        cur = m
        *parents, last = dotted.split("__")
        for p in parents:
            cur = cur[p]
        cur[last] = v
    return m


def _with_manifest(path: Path, role: str, **over) -> RunData:
    fake_run(path, seed=1, loss=[1.0] * 4, step_s=[0.1] * 4)
    (path / RunDir.MANIFEST).write_text(json.dumps(_manifest(**over)))
    return RunData.read(path, role)


@pytest.mark.parametrize(
    ("over", "named", "shown"),
    [
        ({"data__data_hash": "e" * 64}, "the data (content / data hash", f"data.data_hash: '{'d' * 64}' (candidate) vs '{'e' * 64}'"),
        ({"tokenizer_hash": "u" * 64}, "in the tokenizer;", f"tokenizer_hash: '{'t' * 64}' (candidate) vs '{'u' * 64}'"),
        ({"data__seq_len": 128}, "the data (", "data.seq_len: 64 (candidate) vs 128"),
        ({"recipe__model__hf_config__hidden_size": 128}, "the model config", "recipe.model.hf_config.hidden_size: 64 (candidate) vs 128"),
        ({"layout__global_batch": 32}, "the global batch", "layout.global_batch: 16 (candidate) vs 32"),
        ({"world_size": 4}, "the world size", "world_size: 2 (candidate) vs 4"),
        ({"recipe__train__steps": 6}, "train.steps (the LR schedule decays over it)", "recipe.train.steps: 8 (candidate) vs 6"),
        ({"seed": 2}, "the seed of the first (same-seed) baseline", "seed: 1 (candidate) vs 2"),
    ],
)  # fmt: skip
def test_runs_of_other_work_are_refused_naming_what_differs(tmp_path, over, named, shown):
    from tessera.evidence.compare import check_same_work

    cand = _with_manifest(tmp_path / "cand", "candidate")
    base = _with_manifest(tmp_path / "base", "baseline", **over)
    if "seed" in over:  # RunData.seed comes from the manifest
        assert base.seed == 2
    with pytest.raises(TesseraError) as e:
        check_same_work(cand, [base])
    msg = e.value.render()
    assert msg.startswith(
        f"--runs = '{base.path}': baseline base differs from candidate cand beyond the compared layout, in "
    )
    assert named in msg and shown in msg and f"tessera manifest diff {cand.path} {base.path}" in msg


def test_what_may_differ_between_candidate_and_baseline(tmp_path):
    """The layout, the optimizer, the attention kernel, data file paths; train.steps under a constant LR."""
    from tessera.evidence.compare import check_same_work

    cand = _with_manifest(tmp_path / "cand", "candidate")
    base = _with_manifest(
        tmp_path / "base", "baseline", layout__engine="deepspeed", recipe__optim__lr=2e-3,
        recipe__model__attn_implementation="sdpa", data__files=[{"path": "/elsewhere/a"}],
    )  # fmt: skip
    check_same_work(cand, [base])
    const = {"recipe__optim__schedule": "constant"}
    c2 = _with_manifest(tmp_path / "c2", "candidate", **const)
    b2 = _with_manifest(tmp_path / "b2", "baseline", recipe__train__steps=6, **const)
    check_same_work(c2, [b2])  # the same LR at every step: judged on the common steps
    other_seed = _with_manifest(tmp_path / "b3", "baseline", seed=2)
    check_same_work(cand, [base, other_seed])  # only the first baseline is the same-seed reference
