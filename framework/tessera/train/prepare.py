"""Preparing a run directory for its ranks: the checks that read the model's config, the data (tokenised
once), the plan record.

``tessera run`` checks what needs no model library (:func:`tessera.launch.runs.check_recipe`), writes the
recipe and launches at once; its ranks start with :data:`~tessera.rundir.PREPARE_FLAG`, and rank 0 does
the rest here (:func:`prepare_as_rank0`) while the others import their libraries and wait for
:data:`RunDir.PREPARED`. torch and transformers are then imported once per rank and never by the command
line process, whose import on a small machine would take the cores the launcher and the ranks start on.
A check that fails here is a rank's bad-input exit (code 2, the message on the console), and the launcher
stops the other ranks. ``tessera convert --to`` and ``--dry-run`` run the same checks in the command line
process (:func:`tessera.launch.runs.validate`).

Nothing here imports torch at module level: the command line imports this module.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tessera.config.loader import load_run_recipe, write_recipe
from tessera.config.schema import Recipe
from tessera.errors import RecipeError
from tessera.rundir import RunDir


def check_model(resolved: Any, device: str) -> Any:
    """The checks that read the model's config (transformers) or build the DeepSpeed config: the
    planner's layout for ``parallel: auto`` (written into ``resolved``: its recipe and plan), the layout
    against the model (heads, layers, experts per rank), the engine's checks before launch (its registry
    entry's ``prelaunch``: the user's DeepSpeed JSON), the vocabulary, the router. ``resolved``: a
    :class:`tessera.config.loader.ResolvedRecipe`. Returns the layout."""
    from tessera.plan.layout import layout_from_recipe
    from tessera.tables.engines import engine_hook

    if resolved.recipe.parallel.auto:
        from tessera.plan.search import apply_plan, hardware_for, plan_recipe

        r = resolved.recipe
        plan = plan_recipe(r, world_size=r.run.world_size, hardware=hardware_for(r, device=device))
        resolved.recipe = apply_plan(r, plan)
        resolved.plan = plan.to_json()
    recipe = resolved.recipe
    layout = layout_from_recipe(recipe)
    prelaunch = engine_hook(layout.engine, "prelaunch")
    if prelaunch is not None:  # the engine's own checks (the user's DeepSpeed JSON): before the first step
        prelaunch(recipe, layout, device=device, read_model=True)
    from tessera.models.hf import check_vocab, load_hf_config

    cfg = load_hf_config(recipe.model)
    if recipe.data.tokenizer == "bpe":
        check_vocab(cfg, recipe.data.vocab_size)
    if recipe.peft is not None:  # every target names linear modules of the model (on the meta device)
        from tessera.models.adapters import adapter_shapes

        hf_cfg = load_hf_config(recipe.model, vocab_size=recipe.data.vocab_size)
        adapter_shapes(hf_cfg, recipe.peft)
        if not layout.caps.hf_module:  # and have megatron linears (the family's weight rules say which)
            from tessera.models.megatron_lora import mcore_adapter

            mcore_adapter(hf_cfg, recipe.peft).rules(hf_cfg)
    if recipe.model.moe_aux_loss_coeff:
        from tessera.tables.families import family_of

        fam = family_of(cfg.model_type)
        if not fam.facts(cfg)["topk"]:
            raise RecipeError(
                f"a load-balancing loss needs a router, and this {cfg.model_type} model has no experts",
                field="model.moe_aux_loss_coeff",
                value=recipe.model.moe_aux_loss_coeff,
                fix="remove model.moe_aux_loss_coeff (or set it to 0) for a dense model",
            )
        if fam.generic and getattr(cfg, "router_aux_loss_coef", None) is None:
            # transformers gives router_aux_loss_coef to the families trained with the softmax router's
            # load-balancing loss on their router logits (Mixtral, Qwen3-MoE); DeepSeek-V3's sigmoid
            # router balances with its correction bias instead
            raise RecipeError(
                f"{cfg.model_type}'s router is not a softmax top-k one: the load-balancing loss Tessera "
                "computes from router logits does not apply",
                field="model.moe_aux_loss_coeff",
                value=recipe.model.moe_aux_loss_coeff,
                fix="remove model.moe_aux_loss_coeff for this family",
            )
    return layout


def plan_record(resolved: Any, layout: Any, device: str) -> dict[str, Any]:
    """plan.json: the planner's full answer for ``parallel: auto``; otherwise the estimates of the
    recipe's own layout (what the run should cost, against which comm.jsonl is read)."""
    if resolved.plan is not None:
        return {"source": "planner", **resolved.plan}
    from tessera.plan.search import estimate_layout, hardware_for

    hw = hardware_for(resolved.recipe, device=device)
    return {
        "source": "recipe",
        "chosen": estimate_layout(resolved.recipe, layout, hardware=hw, recompute=layout.recompute).to_json(),
    }


def prepare_run_dir(
    recipe: Recipe, run_dir: Path | RunDir, *, root: Path, progress: Callable[[], None] | None = None
):
    """The resolved recipe and the prepared data (tokenised and cached once, here, for every rank).
    Returns the data."""
    from tessera.data import prepare_data

    rd = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    write_recipe(recipe, rd)
    data = prepare_data(recipe.data, root=root, show_progress=True, progress=progress)
    rd.write_json(RunDir.DATA, data.record())
    return data


def prepare_as_rank0(
    run_dir: RunDir,
    *,
    phase: Callable[[str], None] = lambda name: None,
    progress: Callable[[], None] | None = None,
) -> tuple[Recipe, Any, Any]:
    """Rank 0 of a ``tessera run`` launch: the planner's layout for ``parallel: auto`` (the recipe is
    rewritten with it), the model checks, the data, plan.json; then :data:`RunDir.PREPARED` releases the
    other ranks. Returns the recipe as written, its layout and the data, which rank 0 then uses as they
    are (the other ranks read the recipe back). ``phase``: told "prepare" and "data prepare" (the
    heartbeat's phases, each bounded by the supervisor's ``stop.startup_timeout_s``); ``progress``: told of
    each piece of data prepared (so a long preparation that advances is not judged stuck)."""
    from tessera.config.loader import ResolvedRecipe
    from tessera.device import resolve_device

    phase("prepare")
    resolved = ResolvedRecipe(load_run_recipe(run_dir))
    device = resolve_device(resolved.recipe.run.device)
    layout = check_model(resolved, device)
    phase("data prepare")
    data = prepare_run_dir(resolved.recipe, run_dir, root=Path.cwd(), progress=progress)
    run_dir.write_json(RunDir.PLAN, plan_record(resolved, layout, device))
    seq_len = resolved.recipe.data.seq_len
    print(f"data: {len(data)} samples x {seq_len} tokens, vocab {data.vocab_size}", flush=True)
    run_dir.write_json(RunDir.PREPARED, {"by": "rank 0", "at": time.time()})
    return resolved.recipe, layout, data


def wait_prepared(run_dir: RunDir, *, phase: Callable[[str], None] = lambda name: None) -> None:
    """A rank other than 0 of a ``tessera run`` launch: import what its engine will need (while rank 0
    imports the same for its checks), then wait for rank 0 to prepare the run directory. The wait is
    bounded from outside: if rank 0 fails, the launcher stops this rank; if rank 0's preparation makes
    no progress for ``stop.startup_timeout_s``, the supervisor's watchdog stops the run naming rank 0
    (this rank's heartbeat says "wait prepare", which is not judged itself); if ``tessera run`` dies,
    the supervisor guard ends it."""
    import transformers.modeling_utils  # noqa: F401  (every engine builds or reads an HF model)

    from tessera.plan.layout import recipe_uses_deepspeed

    if recipe_uses_deepspeed(load_run_recipe(run_dir)):
        import deepspeed  # noqa: F401  (only the layouts DeepSpeed shards import it)

    phase("wait prepare")
    marker = run_dir / RunDir.PREPARED
    while not marker.is_file():
        time.sleep(0.02)
