"""A user's DeepSpeed JSON in the form HF Trainer users carry ("auto" values): filled from the recipe,
accepted by DeepSpeed's own config parser, or refused before launch with every offending key at once."""

from __future__ import annotations

import json
from typing import Any

import pytest

from helpers import DEFAULT_RECIPE, REPO
from tessera.config.loader import load_recipe
from tessera.engines.ds_config import (
    SECTIONS,
    _deep_merge,
    build_ds_config,
    fill_user_ds_config,
    recipe_ds_config,
)
from tessera.errors import RecipeError
from tessera.launch.runs import check_recipe
from tessera.plan.layout import layout_from_recipe

ZERO2 = REPO / "configs" / "deepspeed" / "hf-zero2-auto.json"
ZERO3 = REPO / "configs" / "deepspeed" / "hf-zero3-auto.json"
# what the fixtures need from the tiny recipe (ZeRO-2, no offload, cosine): the HF files offload and warm
# up to a constant learning rate; the tiny Llama's hidden size is 64
ZERO2_RECIPE = [
    f"parallel.deepspeed_config={ZERO2}",
    "parallel.offload_optimizer=true",
    "optim.schedule=constant",
]
ZERO3_RECIPE = [
    f"parallel.deepspeed_config={ZERO3}",
    "parallel.zero=3",
    "parallel.offload_optimizer=true",
    "parallel.offload_params=true",
    "optim.schedule=constant",
    "optim.weight_decay=0.1",
    "train.precision=bf16",
]


def _autos(node: Any, path: str = "") -> list[str]:
    if isinstance(node, dict):
        return [a for k, v in node.items() for a in _autos(v, f"{path}.{k}" if path else k)]
    return [path] if node == "auto" else []


def _built(overrides: list[str]) -> tuple[Any, Any, dict[str, Any]]:
    r = load_recipe(DEFAULT_RECIPE, overrides).recipe
    lay = layout_from_recipe(r)
    return r, lay, build_ds_config(r, lay, device="cpu")


def test_hf_zero3_auto_json_is_filled_from_the_recipe():
    r, lay, cfg = _built(ZERO3_RECIPE)
    assert _autos(json.loads(ZERO3.read_text())) != [] and _autos(cfg) == []
    # the keys HF fills, each equal to the recipe's value (and its literal number for this recipe)
    assert cfg["train_micro_batch_size_per_gpu"] == lay.micro_batch == 4
    assert cfg["gradient_accumulation_steps"] == lay.grad_accum == 2
    assert cfg["train_batch_size"] == lay.global_batch == 16
    assert cfg["gradient_clipping"] == r.optim.grad_clip == 1.0
    assert cfg["bf16"] == {"enabled": True}
    assert cfg["fp16"] == {
        "enabled": False,
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    }
    z = cfg["zero_optimization"]
    assert (z["reduce_bucket_size"], z["stage3_prefetch_bucket_size"]) == (64 * 64, int(0.9 * 64 * 64))
    assert z["stage3_param_persistence_threshold"] == 10 * 64
    assert z["stage"] == 3 and z["offload_optimizer"] == z["offload_param"] == {
        "device": "cpu",
        "pin_memory": True,
    }
    # the user's own settings pass through; the sections Tessera runs itself are not handed to DeepSpeed
    assert (z["sub_group_size"], z["stage3_max_live_parameters"], cfg["steps_per_print"]) == (1e9, 1e9, 2000)
    assert "optimizer" not in cfg and "scheduler" not in cfg
    filled = fill_user_ds_config(json.loads(ZERO3.read_text()), r, lay, hidden_size=64)
    assert filled["optimizer"] == {
        "type": "AdamW",
        "params": {"lr": r.optim.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
    }
    assert filled["scheduler"]["params"] == {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 3e-3,
        "warmup_num_steps": 10,
    }


def test_a_cosine_scheduler_section_means_the_recipes_cosine():
    r = load_recipe(DEFAULT_RECIPE).recipe  # cosine from 3e-3 to 3e-4 after 10 warmup steps, 200 steps
    user = {
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {"total_num_steps": "auto", "warmup_min_ratio": "auto", "warmup_num_steps": "auto",
                       "cos_min_ratio": "auto", "warmup_type": "linear"},
        }
    }  # fmt: skip
    params = fill_user_ds_config(user, r, layout_from_recipe(r), hidden_size=None)["scheduler"]["params"]
    assert params == {
        "total_num_steps": 200,
        "warmup_min_ratio": 0.0,
        "warmup_num_steps": 10,
        "cos_min_ratio": pytest.approx(0.1, rel=1e-12),
        "warmup_type": "linear",
    }


def test_every_setting_tessera_cannot_take_is_refused_at_once_before_launch(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(
        json.dumps(
            {
                "train_batch_size": 32,  # the recipe's global batch is 16
                "gradient_clipping": "auto",  # fine: filled
                "bf16": {"enabled": True},  # the recipe trains in fp32
                "optimizer": {"type": "Lamb", "params": {"lr": "auto", "max_coeff": 10.0}},
                "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": "auto"}},
                # the hidden-size key has a source (the model), read on the ranks, not here
                "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "sub_group_size": "auto"},
            }
        )
    )
    with pytest.raises(RecipeError) as e:  # the command line's check, before any rank starts
        check_recipe(str(DEFAULT_RECIPE), [f"parallel.deepspeed_config={ds}"])
    lines = str(e.value).splitlines()
    assert lines[0] == f"parallel.deepspeed_config = {str(ds)!r}: 6 DeepSpeed settings Tessera cannot take"
    problems = [ln for ln in lines[1:] if not ln.startswith("    fix: ")]
    assert problems == [
        "  train_batch_size = 32: the recipe says parallel.global_batch = 16",
        "  bf16.enabled = True: the recipe says train.precision = 'fp32'",
        "  optimizer.type = 'Lamb': Tessera trains with AdamW (optim.name: adamw), which it builds and hands "
        "to DeepSpeed itself",
        "  optimizer.params.max_coeff = 10.0: no recipe field sets it: Tessera builds the optimizer from the "
        "recipe",
        "  scheduler.type = 'OneCycle': Tessera sets the learning rate itself; it runs WarmupLR, "
        "WarmupDecayLR, WarmupCosineLR shapes (optim.schedule: constant, linear, cosine), not this one",
        "  zero_optimization.sub_group_size = 'auto': \"auto\" here has no recipe field to fill it from",
    ]
    assert len(lines) == 1 + 2 * len(problems)  # each with its fix
    assert lines[2] == (
        '    fix: write "auto" there (Tessera fills it from parallel.global_batch), remove it, or change '
        "parallel.global_batch in the recipe to match"
    )


def test_the_merged_config_is_accepted_by_deepspeeds_own_parser():
    """DeepSpeed's ``DeepSpeedConfig`` parses the config as ``deepspeed.initialize`` does. Without a
    process group it takes a world size of 1 (its ``__init__`` catches the failed ``dist.get_rank()``),
    so the recipes here run on one rank: the batch arithmetic it checks is then exact."""
    from deepspeed.runtime.config import DeepSpeedConfig

    for overrides in (ZERO2_RECIPE, ZERO3_RECIPE):
        r, lay, cfg = _built([*overrides, "run.world_size=1"])
        parsed = DeepSpeedConfig(cfg)
        assert (
            (parsed.train_batch_size, parsed.gradient_accumulation_steps) == (16, lay.grad_accum) == (16, 4)
        )
        assert parsed.zero_optimization_stage == r.parallel.zero
        assert parsed.gradient_clipping == 1.0 and parsed.bfloat16_config.enabled == (
            r.train.precision == "bf16"
        )
    assert parsed.zero_config.reduce_bucket_size == 64 * 64  # ZeRO-3 fixture: filled from the hidden size
    # the config as it was merged before (the user's "auto" copied over the recipe's values): the crash
    # the issue reported, 34 s into a run; this parser would have caught it
    user = json.loads(ZERO3.read_text())
    old = _deep_merge(
        recipe_ds_config(r, lay, device="cpu"), {k: v for k, v in user.items() if k not in SECTIONS}
    )
    with pytest.raises(TypeError, match="'>' not supported between instances of 'str' and 'int'"):
        DeepSpeedConfig(old)
