"""Recipes: layering, overrides, provenance, derived values and every bad-input message."""

from __future__ import annotations

import json

import pytest

from helpers import DEFAULT_RECIPE, REPO
from tessera.cli import main
from tessera.config.loader import load_recipe, parse_override
from tessera.errors import LayoutError, RecipeError
from tessera.plan.layout import layout_from_recipe


def test_default_recipe_resolves_with_provenance():
    r = load_recipe(DEFAULT_RECIPE)
    assert r.recipe.parallel.zero == 2 and r.recipe.run.world_size == 2
    assert r.source_of("parallel.zero") == "configs/deepspeed/zero2.yaml"
    assert r.source_of("model.hf_config") == "configs/models/tiny-llama.yaml"
    assert r.source_of("parallel.micro_batch") == "recipes/tiny-llama-cpu.yaml"
    assert r.source_of("optim.eps") == "default"
    lay = layout_from_recipe(r.recipe)
    assert (lay.dp, lay.grad_accum, lay.global_batch) == (2, 2, 16)


def test_overrides_win_and_are_recorded():
    r = load_recipe(DEFAULT_RECIPE, ["parallel.zero=3", "optim.lr=3e-4", "run.world_size=1"])
    assert r.recipe.parallel.zero == 3 and r.recipe.optim.lr == pytest.approx(3e-4)
    assert r.source_of("parallel.zero") == "override parallel.zero=3"
    assert layout_from_recipe(r.recipe).grad_accum == 4  # same global batch, one rank


def test_parse_override_types():
    assert parse_override("a.b=3") == ("a.b", 3)
    assert parse_override("a.b=3e-4")[1] == pytest.approx(3e-4)
    assert parse_override("a.b=null") == ("a.b", None)
    assert parse_override("a.b=[x, y]") == ("a.b", ["x", "y"])
    with pytest.raises(RecipeError):
        parse_override("nonsense")


def test_recipe_hash_changes_with_values():
    assert load_recipe(DEFAULT_RECIPE).hash() != load_recipe(DEFAULT_RECIPE, ["train.seed=1"]).hash()
    assert load_recipe(DEFAULT_RECIPE).hash() == load_recipe(DEFAULT_RECIPE).hash()


def test_include_cycle_and_missing_include(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("include: b.yaml\n")
    b.write_text("include: a.yaml\n")
    with pytest.raises(RecipeError, match="include cycle"):
        load_recipe(a)
    a.write_text("include: nowhere.yaml\n")
    with pytest.raises(RecipeError, match=r"nowhere\.yaml"):
        load_recipe(a)


def _run_cli(capsys, *args):
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


BAD = [
    # (overrides, words the message must contain)
    (["parallel.zeroo=3"], ["parallel.zeroo", "unknown field", "did you mean 'parallel.zero'"]),
    (["parallel.zero=two"], ["parallel.zero", "'two'", "integer"]),
    (["parallel.zero=4"], ["parallel.zero", "4", "0, 1, 2 or 3"]),
    (["run.world_size=0"], ["run.world_size", "0", ">= 1"]),
    (["parallel.global_batch=15"], ["parallel.global_batch", "15", "micro_batch 4", "dp 2", "= 8"]),
    (
        ["parallel.global_batch=16", "parallel.grad_accum=3"],
        ["global_batch 16", "micro_batch 4", "grad_accum 3", "dp 2"],
    ),
    (["parallel.tp=2"], ["parallel.tp", "2", "cannot do tp > 1", "fix:"]),
    (["parallel.pp=2"], ["parallel.pp", "2", "cannot do pp > 1"]),
    (
        ["parallel.engine=megatron", "parallel.tp=4", "run.world_size=4"],
        ["parallel.tp", "4", "num_key_value_heads=2"],
    ),
    (["data.source=files", "data.files=[/nonexistent/x.txt]"], ["data.files", "/nonexistent/x.txt"]),
    (["train.precision=fp16", "run.device=cpu"], ["train.precision", "fp16", "bf16 or fp32"]),
    (["parallel.offload_params=true"], ["offload_params", "zero: 3"]),
    (["model.hf_config.model_type=bert"], ["model_type", "bert", "llama"]),
]


@pytest.mark.parametrize(("overrides", "words"), BAD, ids=[b[0][0] for b in BAD])
def test_bad_input_exits_2_with_field_value_fix(capsys, overrides, words):
    code, _, err = _run_cli(capsys, "run", str(DEFAULT_RECIPE), *overrides, "--dry-run")
    assert code == 2
    for w in words:
        assert w in err, (w, err)
    assert "Traceback" not in err


def test_bad_input_has_no_traceback_in_a_real_process(tmp_path):
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-m", "tessera.cli", "run", str(DEFAULT_RECIPE), "parallel.zero=7"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert p.returncode == 2
    assert "parallel.zero = 7" in p.stderr and "Traceback" not in p.stderr


def test_run_dir_that_is_a_file_is_refused(tmp_path, capsys):
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    code, _, err = _run_cli(capsys, "run", str(DEFAULT_RECIPE), f"run.out_dir={f}")
    assert code == 2 and "run.out_dir" in err and "existing file" in err


def test_user_deepspeed_json_conflict_names_both(tmp_path, capsys):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "reduce_bucket_size": 1000}}))
    code, _, err = _run_cli(
        capsys, "run", str(DEFAULT_RECIPE), f"parallel.deepspeed_config={ds}", "--dry-run"
    )
    assert code == 2 and "parallel.zero" in err and "zero_optimization.stage = 3" in err
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": 1000}}))
    code, _, err = _run_cli(
        capsys, "run", str(DEFAULT_RECIPE), f"parallel.deepspeed_config={ds}", "--dry-run"
    )
    assert code == 0, err
    ds.write_text(json.dumps({"optimizer": {"type": "Adam"}}))
    code, _, err = _run_cli(
        capsys, "run", str(DEFAULT_RECIPE), f"parallel.deepspeed_config={ds}", "--dry-run"
    )
    assert code == 2 and "'optimizer'" in err


def test_user_deepspeed_json_is_merged():
    from tessera.engines.zero import build_ds_config

    r = load_recipe(DEFAULT_RECIPE).recipe
    lay = layout_from_recipe(r)
    cfg = build_ds_config(r, lay, device="cpu")
    assert cfg["train_batch_size"] == 16 and cfg["gradient_accumulation_steps"] == 2
    assert cfg["zero_optimization"]["stage"] == 2


def test_config_show_lists_sources(capsys):
    code, out, _ = _run_cli(capsys, "config", "show", str(DEFAULT_RECIPE), "parallel.zero=3")
    assert code == 0
    assert "override parallel.zero=3" in out and "configs/models/tiny-llama.yaml" in out
    assert "default" in out and "derived" in out
    code, out, _ = _run_cli(capsys, "config", "show", str(DEFAULT_RECIPE), "--json")
    doc = json.loads(out)
    assert doc["parallel.zero"] == {"value": 2, "source": "configs/deepspeed/zero2.yaml"}
    assert doc["derived"]["grad_accum"] == 2


def test_layout_rules():
    r = load_recipe(DEFAULT_RECIPE, ["run.world_size=3"]).recipe
    with pytest.raises(RecipeError, match="global_batch 16 is not divisible"):
        layout_from_recipe(r)
    r = load_recipe(DEFAULT_RECIPE, ["parallel.dp=4"]).recipe
    with pytest.raises(LayoutError, match="dp\\*tp\\*pp"):
        layout_from_recipe(r)


def test_every_recipe_loads_and_validates():
    from tessera.models.hf import load_hf_config

    recipes = sorted((REPO / "recipes").glob("*.yaml"))
    assert recipes
    for path in recipes:
        r = load_recipe(path).recipe
        layout_from_recipe(r)
        cfg = load_hf_config(r.model)
        assert cfg.vocab_size > 0
