"""`tessera compare` end to end: the default recipe (ZeRO-2) against the naive DDP baseline with two
seeds and the one-rank scaling run, through the real CLI and launcher, with secrets planted in the
environment; then the same runs judged again (`--runs`) under thresholds set just beyond what was
measured, and a candidate with a planted defect (a 1 % higher learning rate)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml

from helpers import REPO, free_port, read_metrics, read_wandb_records
from tessera.rundir import RunDir

pytestmark = pytest.mark.slow

TESSERA = [sys.executable, "-m", "tessera.cli"]
RECIPE = "recipes/tiny-llama-cpu.yaml"
STEPS = 30
SECRETS = {
    "WANDB_API_KEY": "planted-wandb-key-5c1f0e9d2b7a",
    "HF_TOKEN": "hf_plantedtoken0123456789abcdef",
    "MY_DB_PASSWORD": "planted-db-password-93ab",
}
# the default recipe's thresholds, loosened where 30 steps on a shared 2-core machine are noisy; each
# can still refute the claim (the measured values are far inside them only for an honest candidate)
COMMON = [f"train.steps={STEPS}", "train.eval_every=10", "acceptance.throughput_ratio_min=0.2",
          "acceptance.peak_memory_ratio_max=2.0", "acceptance.time_to_first_step_ratio_max=5.0"]  # fmt: skip


def tessera(*args: str, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*TESSERA, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare") / "cmp"
    env = {**os.environ, **SECRETS}
    p = tessera("compare", RECIPE, *COMMON, f"run.master_port={free_port()}", "--scaling", "--out", str(out), env=env)  # fmt: skip
    return out, p


def _key(item) -> str:
    """A W&B record item's key (the core writes plain keys as a one-element nested key)."""
    return item.key or "/".join(item.nested_key)


def _verdict(out) -> dict:
    return json.loads((out / "verdict.json").read_text())


CLAIM = (
    "Claim: DeepSpeed ZeRO-2 on 2 ranks reaches the DDP baseline's loss within 0.01x the seed-to-seed spread, "
    "grad norm within 0.1x the seed-to-seed spread and final eval loss within 1.001x, at >= 0.2x its "
    "throughput, <= 2x its peak memory per rank and <= 5x its time to first step."
)
BASES, CAND = ("baseline-seed1234", "baseline-seed1235"), "candidate-seed1234"
#: each cost ratio's quantity in a run's statistics, and the threshold that judges it
COST = {
    "step_time_p50": (lambda s: s["step_time_s"]["p50"], None),
    "throughput": (lambda s: s["tokens_per_s"], "throughput_ratio_min"),
    "cost_per_1b_tokens": (lambda s: s["cost_per_1b_tokens"], None),
    "peak_memory": (lambda s: max(s["peak_memory_bytes_per_rank"]), "peak_memory_ratio_max"),
    "time_to_first_step": (lambda s: s["time_to_first_step_s"], "time_to_first_step_ratio_max"),
}


def test_honest_thresholds_pass(comparison):
    out, p = comparison
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    v = _verdict(out)
    assert v["verdict"] == "PASS" and "VERDICT: PASS" in p.stdout
    names = [c["threshold_name"] for c in v["checks"]]
    assert names == ["throughput_ratio_min", "peak_memory_ratio_max", "time_to_first_step_ratio_max",
                     "loss_tolerance", "grad_norm_tolerance", "eval_loss_ratio_max"]  # fmt: skip
    assert all(c["outcome"] == "holds" and c["passed"] and not c["refutes_claim"] for c in v["checks"])
    # the claim under test in one sentence: first in the output and at the top of the report
    report = (out / "report.md").read_text().splitlines()
    assert v["claim"] == CLAIM and CLAIM in p.stdout.splitlines() and report[2] == f"**{CLAIM}**"
    assert report[4] == "**Verdict: PASS**"
    assert v["first_divergent_step"] == {"loss": None, "grad_norm": None}
    # the pre-registration was written before the runs, its hash is quoted by the report and every run
    prereg = (out / "preregistration.json").read_bytes()
    import hashlib

    sha = hashlib.sha256(prereg).hexdigest()
    assert (out / "preregistration.sha256").read_text().split()[0] == sha == v["preregistration_sha256"]
    assert sha in (out / "report.md").read_text()
    runs = ["baseline-seed1234", "baseline-seed1235", "candidate-seed1234", "scaling-1rank"]
    for name in runs:
        m = RunDir(out / name).read_manifest()
        assert m["preregistration_sha256"] == sha
        assert m["initial_weights"]["from"] == "seed" and m["data"]["eval"]["sha256"]
        assert os.path.getmtime(out / name / "manifest.json") > os.path.getmtime(out / "preregistration.json")
    # the same initial weights and eval split for the same seed, whatever the engine and ranks
    same = [
        RunDir(out / n).read_manifest() for n in ("baseline-seed1234", "candidate-seed1234", "scaling-1rank")
    ]
    assert len({m["initial_weights"]["sha256"] for m in same}) == 1
    assert len({m["data"]["eval"]["sha256"] for m in same}) == 1
    # the printed paths: report, plots, checkpoints and W&B runs
    for f in ("report.md", "verdict.json", "loss.png", "grad_norm.png", "step_time.png", "memory.png",
              "comm_fraction.png", "where.png"):  # fmt: skip
        assert (out / f).stat().st_size > 500 and str(out / f) in p.stdout
    assert "checkpoints/step_000030" in p.stdout and "W&B compare:" in p.stdout


def test_cost_ratios_carry_the_baseline_seed_spread(comparison):
    """Every cost ratio: candidate / the baselines' mean, with the standard deviation (ddof 1) of the
    baseline seeds' own ratios to their mean; a cost threshold holds only when the whole interval ratio ±
    spread meets it; the effect is a win / loss only outside the spread."""
    out, _ = comparison
    v = _verdict(out)
    k = v["ratio_spread_multiple"]
    assert k == 1.0 == json.loads((out / "preregistration.json").read_text())["ratio_spread_multiple"]
    checks = {c["threshold_name"]: c for c in v["checks"]}
    for name, (value, threshold) in COST.items():
        r, b = v["cost_ratios"][name], [value(v["runs"][n]) for n in BASES]
        mean = (b[0] + b[1]) / 2
        assert r["ratio"] == pytest.approx(value(v["runs"][CAND]) / mean, rel=1e-12), name
        assert r["baseline_ratios"] == pytest.approx([b[0] / mean, b[1] / mean], rel=1e-12)
        assert r["spread"] == pytest.approx(abs(b[0] - b[1]) / math.sqrt(2) / mean, rel=1e-9)  # sd of two
        win = (r["ratio"] > 1) == (name == "throughput")
        assert r["effect"] == ("not distinguishable" if abs(r["ratio"] - 1) <= k * r["spread"] else "win" if win else "loss")  # fmt: skip
        if threshold:
            c = checks[threshold]
            assert c["measured"] == r["ratio"] and c["half_width"] == pytest.approx(
                k * r["spread"], rel=1e-12
            )
            edge = c["measured"] - c["half_width"] if c["op"] == ">=" else -(c["measured"] + c["half_width"])
            assert edge >= (c["threshold"] if c["op"] == ">=" else -c["threshold"])  # the whole interval
    assert v["hardware"] == {"name": "cpu-2core", "calibrated": False, "price_per_device_hour": 0.03}
    report = (out / "report.md").read_text()
    assert "| cost per 1B tokens (price units) |" in report
    assert "Cost per 1B tokens: price units per 1B tokens, at 0.03 per device-hour (price_per_device_hour of hardware profile cpu-2core, in the currency it is written in)." in report  # fmt: skip
    tps = v["cost_ratios"]["throughput"]
    own = ", ".join(f"{x:.3f}" for x in tps["baseline_ratios"])
    assert f"| {tps['ratio']:.4f} | {own} | {tps['spread']:.3g} | {tps['effect']} |" in report


def test_plots_say_what_they_leave_out(comparison):
    """The notes drawn on the plots (also the PNGs' Description): the planner's line from an
    uncalibrated profile, the zero differences a log axis cannot draw."""
    from PIL import Image

    out, _ = comparison
    notes = {
        n: Image.open(out / f"{n}.png").text.get("Description") for n in ("step_time", "loss", "grad_norm")
    }
    assert notes["step_time"] == (
        "planner's line: from the uncalibrated hardware profile cpu-2core (datasheet figures, not\nthis "
        "machine's: `tessera plan --calibrate` fits the profile to runs here)"
    )
    for key in ("loss", "grad_norm"):
        c, b = ({r["step"]: r[key] for r in read_metrics(out / n)} for n in (CAND, BASES[0]))
        zeros = sum(c[s] == b[s] for s in c)
        same = " (identical curves)" if zeros == STEPS else ""
        assert notes[key] == f"zero differences are not drawn on this log axis: |candidate - {BASES[0]}| = 0 at {zeros} of {STEPS} steps{same}"  # fmt: skip


def test_eval_loss_is_held_out_and_layout_free(comparison):
    out, _ = comparison
    cand, base = read_metrics(out / "candidate-seed1234"), read_metrics(out / "baseline-seed1234")
    steps = [r["step"] for r in cand if "eval_loss" in r]
    assert steps == [10, 20, 30] == [r["step"] for r in base if "eval_loss" in r]
    for a, b in zip((r for r in cand if "eval_loss" in r), (r for r in base if "eval_loss" in r)):
        assert abs(a["eval_loss"] - b["eval_loss"]) <= 1e-5 * b["eval_loss"]
    assert cand[-1]["eval_loss"] < cand[9]["eval_loss"]  # it learns what it never trained on
    assert "final eval loss" in (out / "report.md").read_text()


def test_report_percentiles_are_numpys(comparison):
    out, _ = comparison
    v = _verdict(out)
    report = (out / "report.md").read_text()
    warm = v["warmup_steps"]
    for name, stats in v["runs"].items():
        times = [r["step_time_s"] for r in read_metrics(out / name) if r["step"] > warm]
        for q in (50, 95, 99):
            assert stats["step_time_s"][f"p{q}"] == float(np.percentile(times, q))
        assert stats["step_time_s"]["max"] == max(times)
        row = " / ".join(f"{stats['step_time_s'][k] * 1e3:.1f}" for k in ("p50", "p95", "p99", "max"))
        assert f"| {name} |" in report and row in report
        assert abs(sum(stats["where_the_time_went"].values()) - 1.0) < 1e-9
    # scaling efficiency: tokens/s at 2 ranks over 2 x tokens/s at one, from the same statistics
    eff = v["runs"]["candidate-seed1234"]["tokens_per_s"] / (2 * v["runs"]["scaling-1rank"]["tokens_per_s"])
    assert v["scaling_efficiency"] == pytest.approx(eff, rel=1e-12) and 0.05 < eff < 1.5


def test_planted_secrets_appear_nowhere(comparison):
    out, _ = comparison
    files = [f for f in out.rglob("*") if f.is_file()]
    assert any(".wandb" in f.name for f in files) and len(files) > 50
    for f in files:
        blob = f.read_bytes()
        for name, value in SECRETS.items():
            assert value.encode() not in blob, f"{name}'s value is in {f}"
    env = RunDir(out / "candidate-seed1234").read_manifest()["environment"]
    assert {k: env[k] for k in SECRETS} == dict.fromkeys(SECRETS, "<redacted>")


def test_wandb_offline_runs_read_back(comparison):
    out, _ = comparison
    [cmp_run] = list((out / "wandb").glob("offline-run-*"))
    recs = read_wandb_records(cmp_run)
    summary = {
        _key(u): json.loads(u.value_json) for r in recs if r.HasField("summary") for u in r.summary.update
    }
    v = _verdict(out)
    assert summary["verdict"] == "PASS" and summary["thresholds"] == v["thresholds"]
    assert summary["claim"] == CLAIM and summary["outcome/throughput_ratio_min"] == "holds"
    assert summary["spread/throughput"] == pytest.approx(v["cost_ratios"]["throughput"]["spread"])
    assert summary["measured/loss_tolerance"] == pytest.approx(v["checks"][3]["measured"])
    [run_rec] = [r.run for r in recs if r.HasField("run")]
    config = {_key(u): json.loads(u.value_json) for u in run_rec.config.update}
    assert config["preregistration_sha256"] == v["preregistration_sha256"]
    [art] = [r.artifact for r in recs if r.HasField("artifact")]
    paths = {c.path for c in art.manifest.contents}
    assert {"report.md", "verdict.json", "loss.png", "manifests/candidate-seed1234.json"} <= paths
    # a training run: the manifest as config, eval loss logged, the manifest as an artifact
    [run_dir] = list((out / "candidate-seed1234" / "wandb").glob("offline-run-*"))
    recs = read_wandb_records(run_dir)
    [run_rec] = [r.run for r in recs if r.HasField("run")]
    config = {_key(u): json.loads(u.value_json) for u in run_rec.config.update}
    assert config["recipe_hash"] == RunDir(out / "candidate-seed1234").read_manifest()["recipe_hash"]
    history = [json.loads(i.value_json) for r in recs if r.HasField("history") for i in r.history.item if _key(i) == "eval_loss"]  # fmt: skip
    assert len(history) == 3
    assert any(r.HasField("artifact") and r.artifact.type == "manifest" for r in recs)


def test_thresholds_inside_and_beyond_the_spread(comparison, tmp_path, capsys):
    """The same runs judged again (`--runs`, W&B off) under thresholds read back from verdict.json: a
    throughput threshold just beyond its measured ratio but inside the seed spread is "not
    distinguishable" (INCONCLUSIVE alone, refuting nothing); a memory threshold just beyond the interval
    ratio ± spread, and a loss band shrunk below the measured share, refute the claim (FAIL)."""
    from tessera.cli import main

    out, _ = comparison
    v = _verdict(out)
    measured = {c["threshold_name"]: c for c in v["checks"]}
    tps, mem = measured["throughput_ratio_min"], measured["peak_memory_ratio_max"]
    assert tps["half_width"] > tps["measured"] * 1e-4  # two runs of one recipe never time alike
    copies = [str(d) for d in _copies(out, tmp_path)]
    acc = dict(v["thresholds"])
    acc["throughput_ratio_min"] = tps["measured"] * 1.0001
    f = tmp_path / "inside.yaml"
    f.write_text(yaml.safe_dump({"acceptance": acc}))
    assert (
        main(["compare", "--runs", *copies, "--acceptance", str(f), "--out", str(tmp_path / "inside")]) == 1
    )
    printed = capsys.readouterr().out
    inside = _verdict(tmp_path / "inside")
    assert inside["verdict"] == "INCONCLUSIVE" and "VERDICT: INCONCLUSIVE" in printed
    assert [(c["threshold_name"], c["outcome"], c["refutes_claim"]) for c in inside["checks"] if not c["passed"]] == [
        ("throughput_ratio_min", "not distinguishable", False)
    ]  # fmt: skip
    assert (
        "inconclusive: throughput_ratio_min lies within the baseline's seed spread of its threshold"
        in printed
    )
    # beyond the spread: the memory ratio's whole interval above the threshold; the loss band shrunk so that
    # the largest measured share lands just above 1
    acc["peak_memory_ratio_max"] = (mem["measured"] - mem["half_width"]) * 0.999
    k = acc["loss_tolerance"]["noise_floor_multiple"] * measured["loss_tolerance"]["measured"] * 0.999
    acc["loss_tolerance"] = {"noise_floor_multiple": k}
    f.write_text(yaml.safe_dump({"acceptance": acc}))
    assert main(["compare", "--runs", *copies, "--acceptance", str(f), "--out", str(tmp_path / "again")]) == 1
    printed = capsys.readouterr().out
    again = _verdict(tmp_path / "again")
    failed = {c["threshold_name"]: c for c in again["checks"] if not c["passed"]}
    assert {n: c["outcome"] for n, c in failed.items()} == {
        "throughput_ratio_min": "not distinguishable", "peak_memory_ratio_max": "refuted", "loss_tolerance": "refuted"
    }  # fmt: skip
    assert failed["peak_memory_ratio_max"]["measured"] == mem["measured"] and failed["peak_memory_ratio_max"]["refutes_claim"]  # fmt: skip
    first = failed["loss_tolerance"]["first_step_outside"]
    assert first is not None and first <= measured["loss_tolerance"]["worst_step"]
    assert (
        failed["loss_tolerance"]["measured"] == pytest.approx(1 / 0.999)
        and again["first_divergent_step"]["loss"] == first
    )
    assert "VERDICT: FAIL" in printed and "peak_memory_ratio_max" in printed
    report = (tmp_path / "again" / "report.md").read_text()
    assert f"| peak_memory_ratio_max | {mem['measured']:.4g} | {mem['half_width']:.3g} | <= " in report
    assert "| refuted | yes |" in report and "| not distinguishable | no |" in report
    assert (
        json.loads((tmp_path / "again" / "preregistration.json").read_text())["registered_before_runs"]
        is False
    )


def test_planted_defect_fails_the_loss_tolerance(comparison, tmp_path, capsys):
    """The candidate with a learning rate 1 % above the baseline's, judged against the same baseline
    runs: the loss leaves its band, at a reported step; without the defect it passed (above)."""
    from tessera.cli import main

    out, _ = comparison
    lr = yaml.safe_load((out / "candidate-seed1234" / "recipe.resolved.yaml").read_text())["optim"]["lr"]
    bad = tmp_path / "lr_plus_1pct"
    p = tessera("run", RECIPE, *COMMON, f"optim.lr={lr * 1.01}", f"run.out_dir={bad}",
                f"run.master_port={free_port()}", "tracking.wandb.mode=disabled")  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    runs = [str(bad), str(out / "baseline-seed1234"), str(out / "baseline-seed1235")]
    assert main(["compare", "--runs", *runs, "--out", str(tmp_path / "judged")]) == 1, capsys.readouterr()
    v = _verdict(tmp_path / "judged")
    loss = next(c for c in v["checks"] if c["threshold_name"] == "loss_tolerance")
    assert not loss["passed"] and loss["refutes_claim"] and loss["measured"] > 1
    assert loss["outcome"] == "refuted" and v["verdict"] == "FAIL"
    first = v["first_divergent_step"]["loss"]
    assert isinstance(first, int) and 2 <= first <= STEPS  # step 1's loss precedes any update
    assert f"first step outside: {first}" in (tmp_path / "judged" / "report.md").read_text()


# ---- a comparison is never overwritten; runs of unequal length or other work ----------------------------

RUNS = ("candidate-seed1234", "baseline-seed1234", "baseline-seed1235")


def _copies(out, tmp_path) -> list:
    """The fixture's runs copied (without checkpoints and W&B), W&B off in the candidate's recipe: these
    checks judge in process and need no W&B run."""
    import shutil

    dst = []
    for name in RUNS:
        d = tmp_path / f"copy-{name}"
        shutil.copytree(out / name, d, ignore=shutil.ignore_patterns(RunDir.CHECKPOINTS, RunDir.WANDB))
        dst.append(d)
    rec = dst[0] / RunDir.RECIPE
    r = yaml.safe_load(rec.read_text())
    r["tracking"]["wandb"]["mode"] = "disabled"
    rec.write_text(yaml.safe_dump(r, sort_keys=False))
    return dst


def _snapshot(d) -> dict:
    return {str(f.relative_to(d)): f.read_bytes() for f in sorted(d.rglob("*")) if f.is_file()}


def test_a_finished_comparison_is_never_overwritten(comparison, tmp_path, capsys):
    """Both forms of compare into the fixture's finished comparison: exit 2 before anything is written,
    naming --out as a finished comparison; every file of it byte for byte as it was."""
    from tessera.cli import main

    out, _ = comparison
    before = _snapshot(out)
    runs = [str(out / n) for n in RUNS]
    expect = f"tessera: error: --out = '{out}': the comparison directory is taken: it holds a finished comparison (preregistration.json and verdict.json)\n  fix: give a new directory with --out"  # fmt: skip
    assert main(["compare", "--runs", *runs, "--out", str(out)]) == 2
    assert expect in capsys.readouterr().err
    assert main(["compare", str(REPO / RECIPE), *COMMON, "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert expect in captured.err and "pre-registered" not in captured.out  # no run was started
    assert _snapshot(out) == before


def test_a_compare_running_on_out_refuses_a_second(comparison, tmp_path, capsys):
    from tessera.cli import main
    from tessera.evidence.registration import claim_comparison_dir

    out, _ = comparison
    busy = tmp_path / "busy"
    with claim_comparison_dir(busy):  # as a first compare holds it while its runs train
        assert main(["compare", "--runs", *map(str, _copies(out, tmp_path)), "--out", str(busy)]) == 2
        err = capsys.readouterr().err
        assert f"--out = '{busy}': the comparison directory is taken: another tessera compare is writing into it now (pid {os.getpid()} started" in err  # fmt: skip
        assert sorted(p.name for p in busy.iterdir()) == ["compare.lock"]


def test_runs_of_unequal_length_are_judged_on_their_common_steps(comparison, tmp_path, capsys):
    """The candidate's metrics cut to 24 of 30 steps (as a run killed at step 24 leaves them): judged on
    steps 1-24 of every run, and the verdict, the report and the printed verdict say so."""
    from tessera.cli import main

    out, _ = comparison
    cand, b1, b2 = _copies(out, tmp_path)
    lines = (cand / RunDir.METRICS).read_text().splitlines()
    assert len(lines) == STEPS
    (cand / RunDir.METRICS).write_text("\n".join(lines[:24]) + "\n")
    acc = tmp_path / "acc.yaml"
    acc.write_text("acceptance: {loss_tolerance: {abs: 1.0}, eval_loss_ratio_max: 2.0}\n")
    judged = tmp_path / "judged"
    assert main(["compare", "--runs", str(cand), str(b1), str(b2), "--acceptance", str(acc), "--out", str(judged)]) == 0  # fmt: skip
    v = _verdict(judged)
    note = (
        f"runs of unequal length: judged on steps 1-24, the steps every run recorded ({cand.name} 24 steps, "
        f"{b1.name} 30 steps, {b2.name} 30 steps)"
    )
    assert v["verdict"] == "PASS"
    assert v["unequal_length"] == {"steps_compared": 24, "steps_recorded": {cand.name: 24, b1.name: 30, b2.name: 30}, "note": note}  # fmt: skip
    assert {name: s["steps"] for name, s in v["runs"].items()} == {cand.name: 24, b1.name: 24, b2.name: 24}
    checks = {c["threshold_name"]: c for c in v["checks"]}
    assert checks["loss_tolerance"]["steps_checked"] == 24
    assert checks["eval_loss_ratio_max"]["eval_step"] == 20  # the candidate's eval at 30 was cut
    assert f"Note: {note}." in (judged / "report.md").read_text()
    assert f"VERDICT: PASS  ({note})" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        ({"data.data_hash": "0" * 64, "tokenizer_hash": "1" * 64},
         ["in the data (content / data hash, samples, seq_len, packing, eval split), the tokenizer;",
          "(candidate) vs '" + "0" * 64 + "'", "tokenizer_hash: '", "(candidate) vs '" + "1" * 64 + "'"]),
        ({"recipe.train.steps": 24}, ["in train.steps (the LR schedule decays over it);",
                                      f"recipe.train.steps: {STEPS} (candidate) vs 24"]),
        ({"layout.global_batch": 32}, ["in the global batch;", "layout.global_batch: 16 (candidate) vs 32"]),
    ],
    ids=["data-and-tokenizer-hash", "train-steps", "global-batch"],
)  # fmt: skip
def test_runs_of_other_work_are_refused(comparison, tmp_path, capsys, edit, words):
    """A baseline whose manifest records other data, tokenizer, steps or batch: exit 2 naming each key and
    both values, before --out is made."""
    from tessera.cli import main

    out, _ = comparison
    cand, b1, b2 = _copies(out, tmp_path)
    m = json.loads((b1 / RunDir.MANIFEST).read_text())
    for dotted, value in edit.items():
        *parents, last = dotted.split(".")
        cur = m
        for p in parents:
            cur = cur[p]
        cur[last] = value
    (b1 / RunDir.MANIFEST).write_text(json.dumps(m))
    judged = tmp_path / "judged"
    assert main(["compare", "--runs", str(cand), str(b1), str(b2), "--out", str(judged)]) == 2
    err = capsys.readouterr().err
    assert f"tessera: error: --runs = '{b1}': baseline {b1.name} differs from candidate {cand.name} beyond the compared layout" in err  # fmt: skip
    for w in words:
        assert w in err, (w, err)
    assert "fix: compare runs of the same data, tokenizer, model, global batch, world size, device and train.steps" in err  # fmt: skip
    assert "Traceback" not in err and not judged.exists()
