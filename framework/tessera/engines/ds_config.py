"""The DeepSpeed JSON of a run: built from the recipe, with the user's own JSON (``parallel.deepspeed_config``)
merged under it. One function, :func:`build_ds_config`, both checks the user's JSON and merges it, so the
check before launch and the config DeepSpeed receives cannot disagree.

A user's JSON may say ``"auto"`` (the form HF Trainer users carry): as in transformers' DeepSpeed
integration (``HfTrainerDeepSpeedConfig.trainer_config_process`` / ``trainer_config_finalize``), it means
"fill this from the training arguments", here from the recipe. Every key HF fills is filled (batch sizes,
gradient clipping, bf16/fp16, the optimizer's and the scheduler's parameters, ZeRO's hidden-size based
bucket sizes), plus the ZeRO stage and offload devices, which the recipe also sets. An explicit value that
disagrees with the recipe, an ``"auto"`` no recipe field can fill, an optimizer or scheduler Tessera does not
run: all are refused together in one :class:`~tessera.errors.RecipeError`, before launch.

The ``optimizer`` and ``scheduler`` sections are checked against the recipe, then left out of the config
DeepSpeed receives: Tessera builds its own optimizer (torch AdamW or DeepSpeed's Adam, from ``optim.*``,
without weight decay on 1-D tensors) and passes it to ``deepspeed.initialize``, which then ignores an
``optimizer`` section; and Tessera sets the learning rate before every step as a function of the step
(:mod:`tessera.engines.optim`, so a resumed run follows the same schedule), where a DeepSpeed scheduler
built from the section would be a second writer of the same learning rate. An AdamW section with ``"auto"``
parameters therefore means the recipe's optimizer, and a scheduler section of the recipe's shape means the
recipe's schedule.

Nothing here imports torch: the command line checks a recipe with it before launching ranks.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tessera.config.schema import Recipe
from tessera.errors import RecipeError, preview
from tessera.plan.layout import ParallelLayout

AUTO = "auto"
FIELD = "parallel.deepspeed_config"

#: DeepSpeed keys HF fills from the model's hidden size (``trainer_config_finalize``); no recipe field
#: sets them, and an explicit value is the user's tuning, not a conflict
HIDDEN_SIZE_KEYS: dict[tuple[str, ...], Callable[[int], int]] = {
    ("zero_optimization", "reduce_bucket_size"): lambda h: h * h,
    ("zero_optimization", "stage3_prefetch_bucket_size"): lambda h: int(0.9 * h * h),
    ("zero_optimization", "stage3_param_persistence_threshold"): lambda h: 10 * h,
}

#: DeepSpeed's optimizer types that are Tessera's optimizer: both AdamW (DeepSpeed's ``Adam`` is too, with
#: its default ``adam_w_mode: true``); DeepSpeed compares type names case-insensitively
ADAMW_TYPES = ("adam", "adamw")

#: DeepSpeed's scheduler type -> the recipe's ``optim.schedule`` of the same shape after the warmup
SCHEDULES = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}


@dataclass(frozen=True)
class Source:
    """Where Tessera's value of one DeepSpeed key comes from: the recipe field(s) it is named by in
    messages, the value in DeepSpeed's terms, and whether an explicit user value must equal it (HF's
    ``fill_match``) or may differ (``fill_only``)."""

    field: str
    value: Any
    must_match: bool = True
    #: the recipe's own value, as a message shows it (``value`` when None: the same in both terms)
    recipe_value: Any = None
    #: for a value no recipe field changes (Tessera's own): why it is what it is, said instead
    fixed: str | None = None

    def says(self) -> str:
        return f"{self.field} = {preview(self.value if self.recipe_value is None else self.recipe_value)}"


def _same(theirs: Any, ours: Any) -> bool:
    """Does the user's JSON value mean the recipe's (JSON has no tuples; 3e-3 and 0.003 are one number)?"""
    if isinstance(theirs, bool) or isinstance(ours, bool):
        return type(theirs) is type(ours) and theirs == ours
    if isinstance(theirs, int | float) and isinstance(ours, int | float):
        return math.isclose(theirs, ours, rel_tol=1e-9, abs_tol=0.0)
    if isinstance(theirs, list | tuple) and isinstance(ours, list | tuple):
        return len(theirs) == len(ours) and all(_same(a, b) for a, b in zip(theirs, ours, strict=True))
    return theirs == ours


def _offload_same(theirs: Any, ours: Any) -> bool:
    # the recipe says on or off; the JSON names a device ("cpu", "nvme") or "none"
    return (theirs != "none") == (ours != "none")


def recipe_sources(recipe: Recipe, layout: ParallelLayout, hidden_size: int | None) -> dict[tuple, Source]:
    """Tessera's value of every top-level DeepSpeed key the recipe sets (the keys HF's integration fills
    from ``TrainingArguments``, and the ZeRO stage and offload the recipe also decides). The
    hidden-size based keys only when ``hidden_size`` is known (the model's config has been read)."""
    o, p = recipe.optim, recipe.train.precision
    src: dict[tuple, Source] = {
        # DeepSpeed checks train_batch_size = micro x grad-accum x dp, as the layout does
        ("train_micro_batch_size_per_gpu",): Source("parallel.micro_batch", layout.micro_batch),
        ("gradient_accumulation_steps",): Source("parallel.grad_accum", layout.grad_accum),
        ("train_batch_size",): Source("parallel.global_batch", layout.global_batch),
        ("gradient_clipping",): Source("optim.grad_clip", o.grad_clip),
        ("bf16", "enabled"): Source("train.precision", p == "bf16", recipe_value=p),
        ("fp16", "enabled"): Source("train.precision", p == "fp16", recipe_value=p),
        ("zero_optimization", "stage"): Source("parallel.zero", layout.zero),
        ("zero_optimization", "offload_optimizer", "device"): Source(
            "parallel.offload_optimizer",
            "cpu" if layout.offload_optimizer else "none",
            recipe_value=layout.offload_optimizer,
        ),
        ("zero_optimization", "offload_param", "device"): Source(
            "parallel.offload_params",
            "cpu" if layout.offload_params else "none",
            recipe_value=layout.offload_params,
        ),
    }
    if layout.sp > 1:  # what zero.Init sizes the batch check by (deepspeed.initialize reads the mpu's)
        src[("sequence_parallel_size",)] = Source("parallel.sp", layout.sp)
    if hidden_size is not None:  # HF's sizes: reduce h^2, ZeRO-3 prefetch 0.9 h^2, persistence 10 h
        for path, size in HIDDEN_SIZE_KEYS.items():
            src[path] = Source("model (its hidden size)", size(hidden_size), must_match=False)
    return src


def optimizer_sources(recipe: Recipe) -> dict[str, Source]:
    """``optimizer.params`` keys -> the recipe's AdamW (HF fills lr, betas, eps, weight_decay)."""
    o = recipe.optim
    return {
        "lr": Source("optim.lr", o.lr),
        "betas": Source("optim.betas", list(o.betas)),
        "eps": Source("optim.eps", o.eps),
        "weight_decay": Source("optim.weight_decay", o.weight_decay),
        "adam_w_mode": Source("optim.name", True, fixed="both of Tessera's optimizers decouple weight decay"),
    }


def scheduler_sources(recipe: Recipe, kind: str) -> dict[str, Source]:
    """``scheduler.params`` keys of DeepSpeed's ``kind`` -> the recipe's schedule (:func:`tessera.engines.
    optim.lr_factor`: a linear warmup from 0 to ``optim.lr`` over ``optim.warmup_steps``, then the
    decay). HF fills warmup_min_lr (0), warmup_max_lr, warmup_num_steps, total_num_steps."""
    o = recipe.optim
    warmup = {
        "warmup_num_steps": Source("optim.warmup_steps", o.warmup_steps),
        "warmup_type": Source("optim.warmup_steps", "linear", fixed="Tessera's warmup is linear"),
    }
    if kind == "WarmupCosineLR":  # ratios of optim.lr
        return {
            **warmup,
            "warmup_min_ratio": Source("optim.warmup_steps", 0.0, fixed="Tessera's warmup starts at 0"),
            "cos_min_ratio": Source("optim.min_lr / optim.lr", o.min_lr / o.lr),
            "total_num_steps": Source("train.steps", recipe.train.steps),
        }
    src = {
        **warmup,
        "warmup_min_lr": Source("optim.warmup_steps", 0.0, fixed="Tessera's warmup starts at 0"),
        "warmup_max_lr": Source("optim.lr", o.lr),
    }
    if kind == "WarmupDecayLR":
        src["total_num_steps"] = Source("train.steps", recipe.train.steps)
    return src


class _Problems:
    """Everything in the user's JSON that Tessera cannot take, collected to be refused at once."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, key: str, value: Any, why: str, fix: str) -> None:
        self.lines.append(f"  {key} = {preview(value)}: {why}\n    fix: {fix}")

    def conflict(self, key: str, theirs: Any, src: Source) -> None:
        if src.fixed:
            self.add(key, theirs, src.fixed, 'write "auto" there, or remove it')
            return
        self.add(
            key,
            theirs,
            f"the recipe says {src.says()}",
            f'write "auto" there (Tessera fills it from {src.field}), remove it, or change {src.field} '
            "in the recipe to match",
        )

    def raise_if_any(self, user_path: str) -> None:
        if not self.lines:
            return
        n = len(self.lines)
        err = RecipeError(
            f"{FIELD} = {preview(user_path)}: {n} DeepSpeed setting{'s' * (n != 1)} Tessera cannot take\n"
            + "\n".join(self.lines)
        )
        err.field, err.value, err.framed = FIELD, user_path, True
        raise err


def _fill(node: dict[str, Any], key: str, src: Source, dotted: str, problems: _Problems) -> None:
    """HF's ``fill_match`` / ``fill_only``: ``"auto"`` becomes Tessera's value; an explicit value must
    mean the same where the recipe decides it."""
    theirs = node[key]
    if theirs == AUTO:
        node[key] = src.value
        return
    same = _offload_same if key == "device" else _same
    if src.must_match and not same(theirs, src.value):
        problems.conflict(dotted, theirs, src)


def _fill_section(
    section: str, user: dict[str, Any], sources: dict[str, Source], problems: _Problems
) -> None:
    params = user[section].get("params", {})
    if not isinstance(params, dict):
        problems.add(f"{section}.params", params, "not a JSON object", f"give {section}.params as an object")
        return
    for key in list(params):
        if key in sources:
            _fill(params, key, sources[key], f"{section}.params.{key}", problems)
        else:
            problems.add(
                f"{section}.params.{key}",
                params[key],
                f"no recipe field sets it: Tessera builds the {section} from the recipe",
                f"remove it from the JSON (the recipe's optim.* decide the {section})",
            )
    for key in user[section]:
        if key not in ("type", "params"):
            problems.add(
                f"{section}.{key}",
                user[section][key],
                f"no recipe field sets it: Tessera builds the {section} from the recipe",
                "remove it from the JSON",
            )


def _check_optimizer(user: dict[str, Any], recipe: Recipe, problems: _Problems) -> None:
    kind = user["optimizer"].get("type")
    if not isinstance(kind, str) or kind.lower() not in ADAMW_TYPES:
        problems.add(
            "optimizer.type",
            kind,
            f"Tessera trains with AdamW (optim.name: {recipe.optim.name}), which it builds and hands to "
            "DeepSpeed itself",
            'write "type": "AdamW", or remove the optimizer section (optim.* in the recipe set the optimizer)',
        )
    _fill_section("optimizer", user, optimizer_sources(recipe), problems)


def _check_scheduler(user: dict[str, Any], recipe: Recipe, problems: _Problems) -> None:
    kind = user["scheduler"].get("type")
    o = recipe.optim
    ours = {v: k for k, v in SCHEDULES.items()}[o.schedule]
    fix = (
        f"remove the scheduler section (the recipe's {o.schedule} schedule runs; DeepSpeed's {ours} has its "
        "shape)"
    )
    if kind not in SCHEDULES:
        problems.add(
            "scheduler.type",
            kind,
            f"Tessera sets the learning rate itself; it runs {', '.join(SCHEDULES)} shapes "
            "(optim.schedule: constant, linear, cosine), not this one",
            fix,
        )
        return
    if SCHEDULES[kind] != o.schedule:
        problems.add(
            "scheduler.type",
            kind,
            f"DeepSpeed's {kind} is a {SCHEDULES[kind]} schedule after warmup; the recipe's optim.schedule "
            f"is {o.schedule}",
            f"set optim.schedule: {SCHEDULES[kind]} in the recipe, or {fix}",
        )
    elif kind == "WarmupDecayLR" and o.min_lr:
        problems.add(
            "scheduler.type",
            kind,
            "DeepSpeed's WarmupDecayLR decays to warmup_min_lr, where the warmup starts (0); the recipe "
            f"decays to optim.min_lr = {o.min_lr}",
            "set optim.min_lr: 0 in the recipe, or remove the scheduler section (the recipe's schedule runs)",
        )
    _fill_section("scheduler", user, scheduler_sources(recipe, kind), problems)


#: the sections Tessera checks against the recipe and then runs itself (not handed to DeepSpeed)
SECTIONS = {"optimizer": _check_optimizer, "scheduler": _check_scheduler}


def _leftover_autos(node: Any, path: tuple[str, ...], skip: set[tuple], problems: _Problems) -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            _leftover_autos(v, (*path, k), skip, problems)
    elif node == AUTO and path not in skip:
        problems.add(
            ".".join(path),
            node,
            '"auto" here has no recipe field to fill it from',
            "give a value (see DeepSpeed's config documentation), or remove the key (DeepSpeed's default)",
        )


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def recipe_ds_config(recipe: Recipe, layout: ParallelLayout, *, device: str) -> dict[str, Any]:
    """The DeepSpeed JSON the recipe alone gives."""
    zero: dict[str, Any] = {"stage": layout.zero}
    if layout.zero > 0:
        # contiguous, deterministic buckets; overlap only helps where there is a separate comm stream
        zero.update(contiguous_gradients=True, overlap_comm=device == "cuda", reduce_scatter=True)
    if layout.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": device == "cuda"}
    if layout.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": device == "cuda"}
    sources = recipe_sources(recipe, layout, None)
    top = {path[0]: sources[path].value for path in sources if len(path) == 1}
    return {
        **top,  # batch sizes and clipping
        "zero_optimization": zero,
        "bf16": {"enabled": recipe.train.precision == "bf16"},
        "fp16": {"enabled": recipe.train.precision == "fp16"},
        "steps_per_print": 10**9,  # Tessera logs; keep DeepSpeed's own step printing quiet
        "wall_clock_breakdown": False,
        # torch's AdamW with offload is allowed (bit-exact resume, no JIT op build)
        "zero_force_ds_cpu_optimizer": False,
    }


def read_user_ds_config(path: str) -> dict[str, Any]:
    from tessera.config.loader import read_config_file  # regular file, size-bounded

    try:
        user = json.loads(read_config_file(path, field=FIELD, what="DeepSpeed config"))
    except FileNotFoundError:
        raise RecipeError(
            "DeepSpeed config file not found",
            field=FIELD,
            value=path,
            fix="give the path of an existing JSON file",
        ) from None
    except json.JSONDecodeError as e:
        raise RecipeError(
            f"not valid JSON: {e}", field=FIELD, value=path, fix="fix the JSON syntax"
        ) from None
    if not isinstance(user, dict):
        raise RecipeError(
            "a DeepSpeed config is a JSON object", field=FIELD, value=path, fix="give a JSON object ({...})"
        )
    return user


def fill_user_ds_config(
    user: dict[str, Any],
    recipe: Recipe,
    layout: ParallelLayout,
    *,
    hidden_size: int | None,
    user_path: str = "<dict>",
) -> dict[str, Any]:
    """A copy of ``user`` checked against the recipe, its ``"auto"`` values filled (the optimizer and
    scheduler sections too). Raises one RecipeError listing every setting Tessera cannot take.
    ``hidden_size`` None: the model's config is not read (the check before launch); the hidden-size based
    ``"auto"`` keys are then left as they are (the model always gives them)."""
    user = json.loads(json.dumps(user))  # a deep copy: the caller's dict stays as read
    problems = _Problems()
    for path, src in recipe_sources(recipe, layout, hidden_size).items():
        node: Any = user
        for part in path[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and path[-1] in node:
            _fill(node, path[-1], src, ".".join(path), problems)
    for section, check in SECTIONS.items():
        if section not in user:
            continue
        if not isinstance(user[section], dict):
            problems.add(
                section, user[section], "not a JSON object", f"give {section} as an object, or remove it"
            )
            continue
        check(user, recipe, problems)
    pending = set() if hidden_size is not None else set(HIDDEN_SIZE_KEYS)
    _leftover_autos({k: v for k, v in user.items() if k not in SECTIONS}, (), pending, problems)
    problems.raise_if_any(user_path)
    return user


def model_hidden_size(recipe: Recipe) -> int:
    """The hidden size HF's integration reads (``hidden_size``, else the largest of ``hidden_sizes``, also
    under ``text_config``)."""
    from tessera.models.hf import load_hf_config

    cfg = load_hf_config(recipe.model, vocab_size=recipe.data.vocab_size)
    for c in (cfg, getattr(cfg, "text_config", None)):
        if getattr(c, "hidden_size", None):
            return int(c.hidden_size)
        if getattr(c, "hidden_sizes", None):
            return int(max(c.hidden_sizes))
    raise RecipeError(
        "the model's config has no hidden_size, from which DeepSpeed's bucket sizes are filled",
        field=FIELD,
        value=recipe.parallel.deepspeed_config,
        fix='replace "auto" in ' + ", ".join(".".join(k) for k in HIDDEN_SIZE_KEYS) + " with numbers",
    )


def build_ds_config(
    recipe: Recipe, layout: ParallelLayout, *, device: str, read_model: bool = True
) -> dict[str, Any]:
    """The DeepSpeed JSON for this run: the recipe's values, and the user's JSON merged under them, its
    ``"auto"`` values filled from the recipe. ``read_model=False`` (the command line's check before
    launch, which imports no model library): the hidden-size based ``"auto"`` keys are left unfilled."""
    cfg = recipe_ds_config(recipe, layout, device=device)
    user_path = recipe.parallel.deepspeed_config
    if user_path is None:
        return cfg
    user = read_user_ds_config(user_path)
    hidden = None
    if read_model and any(_get(user, k) == AUTO for k in HIDDEN_SIZE_KEYS):
        hidden = model_hidden_size(recipe)
    filled = fill_user_ds_config(user, recipe, layout, hidden_size=hidden, user_path=user_path)
    # the optimizer and scheduler sections have been checked against the recipe; Tessera runs its own
    merged = _deep_merge(cfg, {k: v for k, v in filled.items() if k not in SECTIONS})
    if layout.sp > 1 and layout.zero == 3 and not merged["zero_optimization"].get("reduce_scatter", True):
        # deepspeed 0.19.8 averages ZeRO-3 gradients over dp*sp on its reduce-scatter path; the engine
        # multiplies the loss scale by sp for it (engines/ulysses.py). Without reduce-scatter, buckets up to
        # reduce_bucket_size are averaged over dp and larger ones over dp*sp: no one scale is right
        raise RecipeError(
            "ZeRO-3 with Ulysses sequence parallelism needs DeepSpeed's reduce-scatter of the gradients",
            field="parallel.deepspeed_config",
            value=f"{user_path}: zero_optimization.reduce_scatter=false",
            fix="remove zero_optimization.reduce_scatter from the JSON (Tessera sets it true), or parallel.sp: 1",
        )
    return merged


def _get(d: Any, path: tuple[str, ...]) -> Any:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def check_before_launch(recipe: Recipe, layout: ParallelLayout, *, device: str, read_model: bool) -> None:
    """The deepspeed engine's registry ``prelaunch``: the DeepSpeed JSON built (and the user's checked) by
    the function that builds it on the ranks, so a conflict is an error before any rank starts.
    ``read_model=False`` (the command line, which imports no model library): the hidden-size based
    ``"auto"`` keys are left to rank 0's check."""
    build_ds_config(recipe, layout, device=device, read_model=read_model)
