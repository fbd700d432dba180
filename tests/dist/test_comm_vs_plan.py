"""What the runs really communicate (comm.jsonl, counted by wrapping torch.distributed) against what the
planner predicts for the same layout (plan.estimate), on the tiny recipes, per op and group."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
import yaml
from helpers import REPO, train_runs

from tessera.config.loader import validate_recipe
from tessera.plan.hardware import load_hardware
from tessera.plan.layout import layout_from_recipe
from tessera.plan.search import estimate_layout

pytestmark = pytest.mark.slow

R = REPO / "recipes"
LLAMA = R / "tiny-llama-cpu.yaml"
# name -> (recipe, overrides, the ops the prediction must match, relative tolerance)
CASES = {
    **{f"zero{z}": (LLAMA, [f"parallel.zero={z}"], "dp", 0.02) for z in (0, 1, 2, 3)},
    "tp2": (R / "tiny-llama-cpu-mcore-tp2.yaml", [], "tp", 0.02),
    "pp2": (R / "tiny-llama-cpu-mcore-pp2.yaml", [], "pp", 0.0),
    "ep2": (R / "tiny-mixtral-cpu-mcore-ep2.yaml", [], "ep", 0.10),
}
STEP = 2  # a steady-state step (step 1 is the same, but keep clear of any first-step setup)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    base = tmp_path_factory.mktemp("comm")
    specs = {base / k: (rec, ["train.steps=3", *ov], False) for k, (rec, ov, _, _) in CASES.items()}
    train_runs(specs, world=2)
    hw = load_hardware("cpu-2core")
    out = {}
    for d in specs:
        recipe = validate_recipe(yaml.safe_load((d / "recipe.resolved.yaml").read_text()))
        est = estimate_layout(recipe, layout_from_recipe(recipe), hardware=hw).comm_bytes
        per_rank: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for line in (d / "comm.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if rec["phase"] == "step" and rec["step"] == STEP:
                for o in rec["ops"]:
                    per_rank[rec["rank"]][f"{o['op']}:{o['group']}"] += o["bytes"]
        out[d.name] = (est, per_rank)
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_measured_bytes_match_the_prediction(measured, name):
    est, per_rank = measured[name]
    _, _, group, tol = CASES[name]
    predicted = {k: v for k, v in est.items() if k.endswith(f":{group}") and v}
    assert predicted, est  # the prediction has ops on this group
    for rank in (0, 1):
        got = per_rank[rank]
        for key, want in predicted.items():
            assert abs(got.get(key, 0) - want) <= tol * want, (rank, key, got.get(key, 0), want)
        # nothing sizeable on this group goes unpredicted (our scalar token / loss sums are bytes)
        other = sum(v for k, v in got.items() if k.endswith(f":{group}") and k not in predicted)
        assert other <= 0.01 * sum(predicted.values()), (rank, dict(got))
