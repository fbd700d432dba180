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
    run_stats,
)
from tessera.evidence.registration import preregister, read_preregistration
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
    err = capsys.readouterr().err
    assert field in err
    if "noise_floor_multiple" in args[0]:  # named before the cost ratios' need of two seeds
        assert "a noise floor needs at least two baseline seeds" in err
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

    from tessera.evidence.registration import CLAIM, claim_comparison_dir

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
    from tessera.evidence.registration import CLAIM, claim_comparison_dir

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
    from tessera.evidence.registration import claim_comparison_dir

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


# ---- cost ratios against the baseline's seed spread; the claim ----------------------------------------


def test_seed_spread_is_one_statistic_for_the_noise_floor_and_the_ratios(tmp_path):
    from tessera.evidence.compare import seed_spread

    assert seed_spread([1.0, 1.58]) == pytest.approx(0.58 / math.sqrt(2), rel=1e-12)
    assert seed_spread([0.9, 1.0, 1.1]) == pytest.approx(0.1, rel=1e-12)
    assert seed_spread([1.0]) is None and seed_spread([]) is None
    # a constant gap between two seeds: the noise floor at every step is that same spread
    runs = [RunData.read(fake_run(tmp_path / f"b{k}", seed=k, loss=[5.0 + 0.3 * k] * 12, step_s=[0.1] * 12), "baseline") for k in range(2)]  # fmt: skip
    floor = noise_floor(runs, "loss")
    assert sorted(floor) == list(range(1, 13))
    assert list(floor.values()) == pytest.approx([seed_spread([5.0, 5.3])] * 12, rel=1e-12)  # 0.3 / sqrt 2


def test_cost_ratio_carries_the_spread_of_the_baselines_own_ratios():
    from tessera.evidence.compare import cost_ratio

    # three baseline seeds at 900 / 1000 / 1100 tokens/s: their own ratios 0.9 / 1.0 / 1.1, spread 0.1
    got = cost_ratio(1150.0, [900.0, 1000.0, 1100.0], better="higher")
    assert got["ratio"] == pytest.approx(1.15, rel=1e-12) and got["baseline_mean"] == pytest.approx(1000.0)
    assert got["baseline_ratios"] == pytest.approx([0.9, 1.0, 1.1], rel=1e-12)
    assert got["spread"] == pytest.approx(0.1, rel=1e-12) and got["half_width"] == pytest.approx(0.1)
    assert got["effect"] == "win"  # 1.15 - 1 > 0.1
    assert cost_ratio(1050.0, [900.0, 1000.0, 1100.0], better="higher")["effect"] == "not distinguishable"
    assert cost_ratio(850.0, [900.0, 1000.0, 1100.0], better="higher")["effect"] == "loss"
    assert cost_ratio(850.0, [900.0, 1000.0, 1100.0], better="higher", multiple=2.0)["effect"] == "not distinguishable"  # fmt: skip
    # two identical baselines 1.58x apart in median step time (issue 30): a candidate as fast as the faster
    # one reads as a 0.775x step time, yet lies inside the baseline's own spread of 0.318
    step = cost_ratio(0.1, [0.1, 0.158], better="lower")
    assert step["ratio"] == pytest.approx(100 / 129, rel=1e-12)
    assert step["baseline_ratios"] == pytest.approx([100 / 129, 158 / 129], rel=1e-12)
    assert step["spread"] == pytest.approx(58 / 129 / math.sqrt(2), rel=1e-12)  # 0.31792
    assert step["effect"] == "not distinguishable"
    assert cost_ratio(0.1, [0.2, 0.21], better="lower")["effect"] == "win"  # lower step time
    assert cost_ratio(2.0, [1.0], better="lower")["effect"] == "no spread (one baseline run)"
    assert cost_ratio(None, [1.0, 1.1], better="lower")["effect"] == "not measured"


@pytest.mark.parametrize(
    ("measured", "threshold", "op", "half", "outcome"),
    [
        (1.15, 1.1, ">=", 0.1, "not distinguishable"),  # 1.05 < 1.1 <= 1.25
        (1.15, 1.0, ">=", 0.1, "holds"),  # 1.05 >= 1.0
        (1.15, 1.3, ">=", 0.1, "refuted"),  # 1.25 < 1.3
        (1.5, 1.0, ">=", 0.5, "holds"),  # the interval's edge on the threshold holds
        (1.15, 1.1, ">=", 0.0, "holds"),  # no spread: the value alone
        (1.15, 1.2, ">=", None, "refuted"),
        (1.2, 1.25, "<=", 0.1, "not distinguishable"),  # 1.1 <= 1.25 < 1.3
        (1.2, 1.35, "<=", 0.1, "holds"),
        (1.2, 1.05, "<=", 0.1, "refuted"),  # 1.1 > 1.05
        (None, 1.0, ">=", 0.1, "not measured"),
        (float("nan"), 1.0, "<=", 0.1, "not measured"),
    ],
)
def test_a_ratio_is_judged_against_its_spread(measured, threshold, op, half, outcome):
    from tessera.evidence.compare import judge_ratio

    assert judge_ratio(measured, threshold, op, half) == outcome


def test_verdict_of_the_outcomes():
    from tessera.evidence.compare import verdict_of

    assert verdict_of(["holds", "holds"]) == "PASS"
    assert verdict_of(["holds", "not distinguishable"]) == "INCONCLUSIVE"
    assert verdict_of(["not distinguishable", "refuted"]) == "FAIL"
    assert verdict_of(["holds", "not measured"]) == "FAIL"
    assert verdict_of([]) == "FAIL"  # nothing checked cannot pass


def test_judge_a_candidate_inside_the_baselines_spread_is_inconclusive(tmp_path):
    """The same candidate (0.1 s per step) against two baselines 1.58x apart (0.1 and 0.158 s) and against
    two that agree (0.12 and 0.121 s), under throughput_ratio_min 1.1: by its value alone it passes both;
    against the spread it passes only where the baselines agree."""
    loss = [6.0 - 0.01 * i for i in range(10)]

    def read(name, role, seed, t):
        return RunData.read(fake_run(tmp_path / name, seed=seed, loss=loss, step_s=[t] * 10), role)

    cand = read("c", "candidate", 1, 0.1)
    acc = {"warmup_steps": 0, "throughput_ratio_min": 1.1, "peak_memory_ratio_max": 1.0, "loss_tolerance": {"abs": 1e-9}}  # fmt: skip
    wide = judge(acc, cand, [read("b1", "baseline", 1, 0.1), read("b2", "baseline", 2, 0.158)])
    tps = {c["threshold_name"]: c for c in wide["checks"]}["throughput_ratio_min"]
    assert tps["measured"] == pytest.approx(158 / 129, rel=1e-12)  # 1.2248: above 1.1 by value
    assert tps["spread"] == pytest.approx(58 / 129 / math.sqrt(2), rel=1e-12)
    assert tps["half_width"] == pytest.approx(58 / 129 / math.sqrt(2), rel=1e-12)  # 1 x the spread
    assert tps["outcome"] == "not distinguishable" and not tps["passed"] and not tps["refutes_claim"]
    assert wide["verdict"] == "INCONCLUSIVE" and wide["ratio_spread_multiple"] == 1.0
    ratios = wide["cost_ratios"]
    assert ratios["throughput"]["effect"] == ratios["step_time_p50"]["effect"] == "not distinguishable"
    assert ratios["step_time_p50"]["ratio"] == pytest.approx(100 / 129, rel=1e-12)
    assert ratios["peak_memory"]["spread"] == 0.0 and ratios["peak_memory"]["effect"] == "not distinguishable"
    assert ratios["cost_per_1b_tokens"]["ratio"] is None  # no price given
    tight = judge(acc, cand, [read("b3", "baseline", 1, 0.12), read("b4", "baseline", 2, 0.121)])
    tps = {c["threshold_name"]: c for c in tight["checks"]}["throughput_ratio_min"]
    assert tps["measured"] == pytest.approx(1.2049792531120331, rel=1e-12)  # 10000 / mean(8333.3, 8264.5)
    assert tps["spread"] == pytest.approx(0.0058681060679382, rel=1e-9)
    assert tps["outcome"] == "holds" and tight["verdict"] == "PASS"
    assert tight["cost_ratios"]["throughput"]["effect"] == "win"


@pytest.mark.parametrize(
    ("acceptance", "layout", "world", "claim"),
    [
        ({"loss_tolerance": {"abs": 0.02}, "throughput_ratio_min": 1.1}, {"engine": "deepspeed", "zero": 2, "dp": 2, "tp": 1}, 2,
         "Claim: DeepSpeed ZeRO-2 on 2 ranks reaches the DDP baseline's loss within 0.02 nats, at >= 1.1x its throughput."),
        ({"throughput_ratio_min": 0.9, "peak_memory_ratio_max": 0.6}, {"engine": "megatron", "tp": 2, "pp": 2, "vpp": 1, "zero": 0, "sequence_parallel": True}, 4,
         "Claim: megatron-core TP2 PP2 SP on 4 ranks runs at >= 0.9x the throughput and <= 0.6x the peak memory per rank of the DDP baseline."),
        ({"warmup_steps": 5, "loss_tolerance": {"noise_floor_multiple": 0.01, "rel": 1e-4}, "grad_norm_tolerance": {"noise_floor_multiple": 0.1},
          "eval_loss_ratio_max": 1.001, "time_to_first_step_ratio_max": 2.0, "throughput_ratio_min": None},
         {"engine": "deepspeed", "zero": 3, "offload_optimizer": True}, 8,
         "Claim: DeepSpeed ZeRO-3 offload optimizer on 8 ranks reaches the DDP baseline's loss within 0.0001x its value or "
         "0.01x the seed-to-seed spread (the widest), grad norm within 0.1x the seed-to-seed spread and final eval loss "
         "within 1.001x, at <= 2x its time to first step."),
    ],
    ids=["zero2-loss-throughput", "megatron-costs-only", "offload-quality-and-ttfs"],
)  # fmt: skip
def test_the_claim_under_test_in_one_sentence(acceptance, layout, world, claim):
    from tessera.evidence.compare import claim_sentence

    assert claim_sentence(acceptance, layout, world, {"engine": "ddp", "dp": world}) == claim


def test_cost_ratio_thresholds_need_two_baseline_seeds(tmp_path, capsys):
    """A throughput, memory or start-up threshold is judged against the baseline's seed spread: one seed
    has none, refused before anything is registered (the loss bands here are rel / abs, which need none)."""
    out = tmp_path / "cmp"
    args = ["acceptance.loss_tolerance={rel: 0.0001}", "acceptance.grad_norm_tolerance=null", "--seeds", "1"]
    assert main(["compare", "recipes/tiny-llama-cpu.yaml", *args, "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        "tessera: error: --seeds = 1: throughput_ratio_min, peak_memory_ratio_max, time_to_first_step_ratio_max "
        "are judged against the baseline's seed-to-seed spread, which needs at least two baseline runs\n"
        "  fix: pass --seeds 2 or more (with --runs: two or more baseline runs), or unset "
        "acceptance.throughput_ratio_min, acceptance.peak_memory_ratio_max, acceptance.time_to_first_step_ratio_max\n"
    )
    assert not out.exists()


def test_cost_per_1b_tokens_has_its_unit():
    from tessera.evidence.report import cost_unit

    assert cost_unit({"name": "cpu-2core", "calibrated": False, "price_per_device_hour": 0.03}) == (
        "price units per 1B tokens, at 0.03 per device-hour (price_per_device_hour of hardware profile "
        "cpu-2core, in the currency it is written in)"
    )
    assert cost_unit({"name": "h100-sxm-80g", "price_per_device_hour": None}) == (
        "n/a: the hardware profile has no price_per_device_hour"
    )
