"""`tessera plan --probe` for real: two gloo ranks on this machine measure it and run each engine's own
steps, the profile it writes is one the planner reads, and its figures are the machine's (positive, finite,
consistent with each other); the engines' collectives are the ones the planner counts for their layouts."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from helpers import REPO
from tessera.config.loader import load_recipe
from tessera.plan.hardware import load_hardware
from tessera.plan.measured import ops_of, predicted
from tessera.plan.probe import OPS, SIZES
from tessera.plan.probe_engines import STEPS, runnable

pytestmark = pytest.mark.slow


def test_probe_writes_a_profile_of_this_machine(tmp_path):
    out = tmp_path / "probe.yaml"
    cmd = [
        sys.executable,
        "-m",
        "tessera.cli",
        "plan",
        "recipes/tiny-llama-cpu.yaml",
        "--probe",
        "--out",
        str(out),
    ]
    # longer than the probe's own deadline (10 x its budget), which stops its ranks itself
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=420)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    profile = load_hardware(out)
    measured = json.loads(out.with_suffix(".json").read_text())
    assert [r["rank"] for r in measured["ranks"]] == [0, 1]
    for r in measured["ranks"]:  # every rank ran every collective at every size
        assert sorted((c["op"], c["bytes"]) for c in r["collectives"]) == sorted(
            (o, n) for o in OPS for n in SIZES
        )
    figures = [profile.peak_flops, profile.efficiency, profile.hbm_bandwidth, profile.latency_s,
               profile.intra_node_bandwidth]  # fmt: skip
    assert all(math.isfinite(x) and x > 0 for x in figures), figures
    assert profile.efficiency <= 1.0  # the model's FLOP/s never beat the matmul's it was divided by
    # bigger messages take longer: the fit's β is what the 16 MiB all-reduce says
    ar = {c["bytes"]: c["seconds"] for c in measured["ranks"][0]["collectives"] if c["op"] == "all_reduce"}
    assert ar[SIZES[-1]] > ar[SIZES[0]]
    assert "--hardware" in p.stdout and "probed in" in p.stdout
    # every engine built and stepped on both ranks; each fitted from its own steps
    for r in measured["ranks"]:
        assert [(e["label"], e.get("error"), len(e.get("steps", []))) for e in r["engines"]] == [
            (label, None, STEPS) for label in ("ddp", "deepspeed-zero2", "megatron-pp", "megatron-tp")
        ]
    assert set(profile.engine_efficiency) == {"ddp", "deepspeed", "megatron"}
    assert all(0 < e <= 1 for e in profile.engine_efficiency.values()), profile.engine_efficiency
    # fitted (a median of residuals clipped at 0: on a loaded machine it may be 0, never None)
    assert (
        profile.tp_latency_s is not None
        and profile.tp_latency_s >= 0
        and math.isfinite(profile.hbm_bandwidth)
    )
    # the TP and PP collectives counted in the engines' steps are the planner's for those layouts
    recipe = load_recipe("recipes/tiny-llama-cpu.yaml", []).recipe
    layouts = dict(runnable(recipe, 2)[0])
    for e in measured["ranks"][0]["engines"]:
        counted = {k: v["calls"] for k, v in ops_of([(s["step"], s["ops"]) for s in e["steps"]]).items()}
        planned: dict[str, int] = {}
        for o in predicted(layouts[e["label"]], profile).comm_ops:
            planned[o.key] = planned.get(o.key, 0) + o.calls * o.messages
        model_axes = {k: v for k, v in planned.items() if k.split(":")[1] in ("tp", "pp")}
        assert {k: counted.get(k) for k in model_axes} == model_axes, (e["label"], counted, planned)
        if e["label"] == "megatron-tp":
            assert model_axes["all_gather:tp"] > 0
    plan = subprocess.run([sys.executable, "-m", "tessera.cli", "plan", "recipes/tiny-llama-cpu.yaml",
                           "--hardware", str(out), "--json"], cwd=REPO, capture_output=True, text=True)  # fmt: skip
    assert plan.returncode == 0 and json.loads(plan.stdout)["chosen"] is not None
