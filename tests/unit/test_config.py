"""Recipes: layering, overrides, provenance, derived values and every bad-input message."""

from __future__ import annotations

import json

import pytest

from helpers import DEFAULT_RECIPE, REPO
from tessera.cli import main
from tessera.config.loader import load_recipe, parse_override, recipe_with
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


def test_a_validated_recipe_takes_overrides_as_the_command_line_does():
    """recipe_with: the same recipe as load_recipe with the same overrides, an engine switched by them
    included (the ZeRO-2 recipe's zero=2 is not an override, so the ddp engine takes its default)."""
    base = load_recipe(DEFAULT_RECIPE).recipe
    for overrides in (
        ["parallel.engine=ddp"],
        ["parallel.engine=megatron", "parallel.tp=2", "optim.lr=1e-3"],
    ):
        assert recipe_with(base, overrides) == load_recipe(DEFAULT_RECIPE, overrides).recipe
    assert recipe_with(base, ["parallel.engine=ddp"]).parallel.zero == 0
    assert recipe_with(base, []) == base
    with pytest.raises(RecipeError, match=r"micro_batch"):
        recipe_with(base, ["parallel.micro_batch=0"])


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
    (["model.hf_config.model_type=vit"], ["model_type", "vit", "AutoModelForCausalLM"]),
    # strict types: a boolean is never a number, a number never a boolean, 8.0 never 8
    (
        ["parallel.zero=true"],
        ["parallel.zero = True: Input should be a valid integer (true / false is a boolean, not a number)"],
    ),
    (
        ["run.world_size=true"],
        ["run.world_size = True: Input should be a valid integer (true / false is a boolean"],
    ),
    (
        ["checkpoint.every=false"],
        ["checkpoint.every = False: Input should be a valid integer (true / false is a"],
    ),
    (["optim.lr=true"], ["optim.lr = True: Input should be a valid number (true / false is a boolean"]),
    (["train.steps=8.0"], ["train.steps = 8.0: Input should be a valid integer"]),
    (
        ["run.bind_cores_to_rank=1"],
        ["run.bind_cores_to_rank = 1: Input should be a valid boolean (write true or false)"],
    ),
    (
        ["parallel.dp=true"],
        [
            "parallel.dp = True: Input should be a valid integer (true / false is a boolean, not a number) or 'auto'"
        ],
    ),
    (["optim.betas=[true, 0.9]"], ["optim.betas = True: Input should be a valid number"]),
    (["run.name='3'", "train.seed='7'"], ["train.seed = '7': Input should be a valid integer"]),
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
    ds.write_text(json.dumps({"optimizer": {"type": "Lamb"}}))  # Tessera builds AdamW itself
    code, _, err = _run_cli(
        capsys, "run", str(DEFAULT_RECIPE), f"parallel.deepspeed_config={ds}", "--dry-run"
    )
    assert code == 2 and "optimizer.type = 'Lamb'" in err and "Traceback" not in err


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


def test_strict_keeps_what_a_recipe_legitimately_writes(tmp_path):
    """An int where a float is expected, YAML 1.2 floats (3e-4) in a file, overrides typed by YAML."""
    r = load_recipe(DEFAULT_RECIPE, ["optim.lr=1", "parallel.zero=3", "run.name='3'", "stop.max_time_s=60"])
    assert r.recipe.optim.lr == 1.0 and isinstance(r.recipe.optim.lr, float)
    assert r.recipe.parallel.zero == 3 and r.recipe.run.name == "3" and r.recipe.stop.max_time_s == 60.0
    assert parse_override("parallel.zero=2") == ("parallel.zero", 2)
    assert parse_override("a.b='3e-4'") == ("a.b", "3e-4")  # quoted: the string the user wrote
    f = tmp_path / "r.yaml"
    f.write_text(f"include: {DEFAULT_RECIPE}\noptim: {{lr: 3e-4, min_lr: 1e-5, betas: [0.9, 1]}}\n")
    o = load_recipe(f).recipe.optim
    assert (o.lr, o.min_lr, o.betas) == (3e-4, 1e-5, (0.9, 1.0))


@pytest.mark.parametrize(
    ("text", "shown"),
    [("include: 5\n", "include = 5"), ("include: [configs/models/tiny-llama.yaml, 7]\n", "include = ['configs/models/tiny-llama.yaml', 7]"),
     ("include: {a: 1}\n", "include = {'a': 1}"), ("include: ['']\n", "include = ['']")],
)  # fmt: skip
def test_include_must_name_files(tmp_path, capsys, text, shown):
    f = tmp_path / "r.yaml"
    f.write_text(text + "model: {hf_config: {model_type: llama}}\n")
    code, _, err = _run_cli(capsys, "config", "show", str(f))
    assert code == 2 and "Traceback" not in err
    assert f"tessera: error: {shown}: include must be a file name or a list of file names (in {f})" in err
    assert "fix: e.g. include: [configs/models/tiny-llama.yaml, configs/deepspeed/zero2.yaml]" in err


def test_non_regular_and_oversized_inputs_are_refused(tmp_path, capsys):
    """A device, a FIFO or a directory as the recipe, an include, the DeepSpeed JSON or the hostfile is
    named and refused without being read (a FIFO never blocks); so is a recipe over the size limit."""
    import os

    from tessera.config.loader import MAX_CONFIG_BYTES

    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    cases = {
        "/dev/zero": "recipe = '/dev/zero': the recipe file is a character device, not a regular file",
        str(fifo): f"recipe = '{fifo}': the recipe file is a FIFO, not a regular file",
        str(tmp_path): f"recipe = '{tmp_path}': the recipe file is a directory, not a regular file",
    }
    for path, msg in cases.items():
        code, _, err = _run_cli(capsys, "config", "show", path)
        assert code == 2 and msg in err and "fix: give the path of a regular recipe file" in err, err
    inc = tmp_path / "inc.yaml"
    inc.write_text(f"include: [{fifo}]\n")
    code, _, err = _run_cli(capsys, "config", "show", str(inc))
    assert code == 2 and f"include = '{fifo}': the included file is a FIFO, not a regular file" in err
    big = tmp_path / "big.yaml"
    big.write_text("# padding\n" * (MAX_CONFIG_BYTES // 10 + 1))
    code, _, err = _run_cli(capsys, "config", "show", str(big))
    assert MAX_CONFIG_BYTES == 1 << 20 and code == 2
    assert (
        f"recipe = '{big}': the recipe file is over the size limit of 1,048,576 bytes (1,048,580 bytes; "
        in err
    )
    for override, msg in [
        (
            "parallel.deepspeed_config=/dev/zero",
            "parallel.deepspeed_config = '/dev/zero': the DeepSpeed config file is a character device",
        ),
        (f"run.hostfile={fifo}", f"run.hostfile = '{fifo}': the host file is a FIFO, not a regular file"),
    ]:
        code, _, err = _run_cli(capsys, "run", str(DEFAULT_RECIPE), override, "--dry-run")
        assert code == 2 and msg in err and "Traceback" not in err, err


def test_every_shipped_layer_validates_strictly(tmp_path):
    """Every recipe layer under configs/ over the tiny model, every hardware profile, and every recipe
    written back the way a run directory keeps it (recipe.resolved.yaml) validate under strict types."""
    import yaml

    from tessera.config.loader import validate_recipe
    from tessera.plan.hardware import load_hardware

    layers = sorted(p for p in (REPO / "configs").rglob("*.yaml") if p.parent.name != "hardware")
    assert len(layers) >= 15
    for layer in layers:
        f = tmp_path / "r.yaml"
        f.write_text(f"include: [{REPO / 'configs/models/tiny-llama.yaml'}, {layer}]\n")
        load_recipe(f)
    for profile in (REPO / "configs" / "hardware").glob("*.yaml"):
        load_hardware(profile)
    for path in sorted((REPO / "recipes").glob("*.yaml")):
        r = load_recipe(path).recipe
        assert validate_recipe(yaml.safe_load(yaml.safe_dump(r.to_dict(), sort_keys=False))) == r


# ---- the tokenizer of a pretrained model; special-token ids (issue 30, items 2 and 5) --------------------

PRETRAINED = ["model.hf_config=null", "model.pretrained=true"]
BPE_IDS = {"bos_token_id": None, "eos_token_id": 0, "pad_token_id": 1}  # Tessera's trained BPE


def _model_dir(path, *, tokenizer: bool = True, **config):
    """A directory as save_pretrained leaves it, as far as the recipe checks read it (no weights)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    if tokenizer:
        (path / "tokenizer.json").write_text("{}")
        (path / "tokenizer_config.json").write_text("{}")
    return path


def test_a_pretrained_model_defaults_to_its_own_tokenizer(tmp_path):
    """`model.hf_config=null` clears the inline config an include gives; `data.tokenizer: auto` (the
    stdlib data layer's and the default) is then the model directory, and bpe for a model trained from
    scratch; the resolved recipe the ranks read resolves to itself."""
    import yaml

    from tessera.config.loader import validate_recipe

    d = _model_dir(tmp_path / "model")
    r = load_recipe(DEFAULT_RECIPE, [*PRETRAINED, f"model.path={d}"])
    assert r.recipe.model.hf_config is None and r.recipe.model.path == str(d)
    assert r.source_of("model.hf_config") == "override model.hf_config=null"
    assert r.recipe.data.tokenizer == str(d) and r.recipe.data.tokenizer_override is False
    assert validate_recipe(yaml.safe_load(yaml.safe_dump(r.recipe.to_dict(), sort_keys=False))) == r.recipe
    assert load_recipe(DEFAULT_RECIPE).recipe.data.tokenizer == "bpe"
    random_init = load_recipe(DEFAULT_RECIPE, ["model.hf_config=null", f"model.path={d}"]).recipe
    assert random_init.data.tokenizer == "bpe"  # a config directory without its weights: from scratch
    same = load_recipe(
        DEFAULT_RECIPE, [*PRETRAINED, f"model.path={d}/", f"data.tokenizer={tmp_path}/./model"]
    )
    assert same.recipe.data.tokenizer == f"{tmp_path}/./model"  # the model's own, spelled otherwise


@pytest.mark.parametrize("other", ["bpe", "dir"])
def test_another_tokenizer_for_a_pretrained_model_needs_the_override(tmp_path, other):
    d = _model_dir(tmp_path / "model")
    spec = "bpe" if other == "bpe" else str(_model_dir(tmp_path / "tok"))
    given = [*PRETRAINED, f"model.path={d}", f"data.tokenizer={spec}"]
    with pytest.raises(RecipeError) as e:
        load_recipe(DEFAULT_RECIPE, given)
    what = "a BPE trained on this corpus" if other == "bpe" else f"the tokenizer in {spec}"
    assert (e.value.field, e.value.value) == ("data.tokenizer", spec)
    assert e.value.message == (
        f"model.pretrained loads the weights of {d}, which were trained with that directory's tokenizer; "
        f"{what} gives other token ids to the same embeddings"
    )
    assert e.value.fix == (
        "data.tokenizer=auto (the model's own tokenizer), or keep it and set data.tokenizer_override=true "
        f"if this tokenizer is the one {d} was trained with"
    )
    r = load_recipe(DEFAULT_RECIPE, [*given, "data.tokenizer_override=true"]).recipe
    assert r.data.tokenizer == spec and r.data.tokenizer_override is True


def test_a_pretrained_model_without_its_tokenizer_is_refused_before_launch(tmp_path, capsys):
    d = _model_dir(tmp_path / "model", tokenizer=False)
    code, _, err = _run_cli(capsys, "run", str(DEFAULT_RECIPE), *PRETRAINED, f"model.path={d}", "--dry-run")
    assert code == 2 and "Traceback" not in err
    assert err.splitlines() == [
        f"tessera: error: data.tokenizer = '{d}': no tokenizer files (tokenizer.json, tokenizer_config.json, "
        "vocab/merges, *.model) in the directory (a model saved without its tokenizer; data.tokenizer "
        "defaults to a pretrained model.path's own)",
        f"  fix: save the tokenizer this model was trained with into {d} (tokenizer.save_pretrained), or set "
        "data.tokenizer to its directory (with data.tokenizer_override=true when model.pretrained)",
    ]


def test_both_model_sources_name_the_override_that_clears_one(tmp_path):
    d = _model_dir(tmp_path / "model")
    with pytest.raises(RecipeError) as e:
        load_recipe(DEFAULT_RECIPE, [f"model.path={d}"])  # the include's inline config stays
    assert (e.value.field, e.value.value) == ("model.path", str(d))
    assert e.value.message.endswith("; both are set")
    assert e.value.fix == (
        "to use the directory, clear the inline config with the override model.hf_config=null "
        "(or `hf_config: null` under model:); to use the inline config, model.path=null"
    )
    assert load_recipe(DEFAULT_RECIPE, [f"model.path={d}", "model.hf_config=null"]).recipe.model.path == str(
        d
    )


def test_a_model_from_scratch_gets_its_tokenizers_special_token_ids(tmp_path):
    """The config (and the generation config a model copies from it) of a model trained from scratch
    names the tokenizer's bos / eos / pad, not its family's defaults (Llama: bos 1 = the BPE's pad,
    eos 2); a pretrained model keeps its own."""
    import torch
    from transformers import AutoModelForCausalLM

    from tessera.config.schema import ModelSection
    from tessera.models.hf import load_hf_config

    section = load_recipe(DEFAULT_RECIPE).recipe.model
    assert (load_hf_config(section).bos_token_id, load_hf_config(section).eos_token_id) == (1, 2)
    cfg = load_hf_config(section, token_ids=BPE_IDS)
    with torch.device("meta"):
        gen = AutoModelForCausalLM.from_config(cfg).generation_config
    for c in (cfg, gen):
        assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (None, 0, 1)
    d = _model_dir(tmp_path / "model", bos_token_id=6, eos_token_id=7, hidden_size=8, num_attention_heads=2)
    own = load_hf_config(ModelSection(path=str(d), pretrained=True), token_ids=BPE_IDS)
    assert (own.bos_token_id, own.eos_token_id, own.pad_token_id) == (6, 7, None)


def test_special_token_ids_written_and_checked_against_the_tokenizer():
    from types import SimpleNamespace

    from tessera.models.hf import set_token_ids, token_id_conflicts

    # a pretrained config keeps what agrees: an id the tokenizer lacks, an eos list holding its eos
    cfg = SimpleNamespace(bos_token_id=9, eos_token_id=[5, 0], pad_token_id=None)
    set_token_ids(cfg, BPE_IDS, keep_own=True)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (9, [5, 0], 1)
    cfg = SimpleNamespace(bos_token_id=1, eos_token_id=2, pad_token_id=None)
    set_token_ids(cfg, BPE_IDS, keep_own=True)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, 0, 1)
    set_token_ids(cfg, BPE_IDS)  # from scratch: exactly the tokenizer's
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (None, 0, 1)

    old_export = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}
    assert token_id_conflicts("config.json", old_export, BPE_IDS) == [
        "config.json eos_token_id=2, the tokenizer's eos_token is 0"
    ]
    assert token_id_conflicts("config.json", {"eos_token_id": 0, "pad_token_id": 3}, BPE_IDS) == [
        "config.json pad_token_id=3, the tokenizer's pad_token is 1"
    ]
    assert token_id_conflicts("config.json", {"pad_token_id": 1}, BPE_IDS) == [
        "config.json eos_token_id=None, the tokenizer's eos_token is 0"
    ]
    assert token_id_conflicts("generation_config.json", {"pad_token_id": 1}, BPE_IDS) == []
    assert token_id_conflicts("config.json", {"bos_token_id": 1, "eos_token_id": [7, 0]}, BPE_IDS) == []


def test_the_manifest_names_the_tokenizer_used():
    from tessera.evidence.manifest import capture_manifest, tokenizer_record

    def source(model: dict, tok: str) -> str:
        return tokenizer_record({"model": model, "data": {"tokenizer": tok}}, "/t", "h")["source"]

    pretrained = {"path": "models/m", "pretrained": True}
    assert [source(pretrained, "models/m"), source(pretrained, "./models/m/"), source(pretrained, "tok")] == [
        "model", "model", "dir"
    ]  # fmt: skip
    assert source({"hf_config": {"model_type": "llama"}}, "bpe") == "bpe"
    assert source({"path": "models/m", "pretrained": False}, "models/m") == "dir"
    recipe = {"model": pretrained, "data": {"tokenizer": "models/m"}}
    m, _ = capture_manifest(recipe=recipe, recipe_hash="r", layout={}, data_fingerprint={}, tokenizer_hash="h",
                            launcher_command=None, world_size=1, seed=0, device="cpu", tokenizer_dir="/abs/m")  # fmt: skip
    assert (
        m["tokenizer"] == {"source": "model", "path": "/abs/m", "sha256": "h"} and m["tokenizer_hash"] == "h"
    )
