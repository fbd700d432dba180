"""Resharding: a Tessera checkpoint of any engine and layout into another one, proven before it is used.

Every change of engine or layout passes through one layout-free form, the **stage**: the HF-named fp32
weights (an HF directory: ``config.json`` + ``model.safetensors``), each Adam moment in its own
safetensors file, and the step, optimizer step count and sampler position (``tessera_stage.json``).
Rank 0 writes it offline from the source checkpoint with the formats' own readers
(:mod:`tessera.checkpoint.reader`: DeepSpeed's zero_to_fp32 merge, megatron-core's dist_checkpointing
through torch's DCP reader, the ddp engine's safetensors), one kind at a time, so no process holds the
weights and both moments at once. The target layout's ranks then build their engine with the stage as
initial weights (each rank reads only the tensors its chunks hold), take their share of the moments
through the engines' own machinery (DeepSpeed's tensor-fragment API, the weight map + megatron's
optimizer ranges) and save an ordinary checkpoint. That checkpoint is then read back offline and
compared with the stage by ``tessera verify``: weights and moments bit-exact, logits within 1e-5.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tessera.atomic import write_json_atomic
from tessera.checkpoint.reader import (
    hf_config_of,
    hf_tensors,
    read_adam_step,
    read_hf_moment,
)
from tessera.checkpoint.sources import tokenizer_dir_of
from tessera.engines.base import Moments
from tessera.engines.optim import MOMENTS
from tessera.errors import CheckpointError
from tessera.plan.layout import LAYOUT_AXES, MODEL_AXES
from tessera.tables.engines import ENGINES, ZERO_IMPLS
from tessera.tensorfile import LazyTensors, TensorView, write_safetensors

STAGE_INFO = "tessera_stage.json"
WEIGHTS = "model.safetensors"
#: the layout keys whose change is a reshard (world size follows from them)
LAYOUT_KEYS = ("engine", *LAYOUT_AXES, "zero", "zero_impl")


def layout_changes(saved: dict[str, Any] | None, now: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, saved value, new value) for every layout key that differs."""
    if not isinstance(saved, dict):
        return []
    return [(k, saved.get(k), now[k]) for k in LAYOUT_KEYS if k in saved and saved.get(k) != now[k]]


def layout_tag(layout: dict[str, Any]) -> str:
    """A short name for a layout, used in the resharded step directory's name: the engine, dp, every
    model axis above 1, the ZeRO stage, and who shards the data-parallel state where the engine has a
    choice and it is not the engine's default (``ds`` for DeepSpeed, else the implementation's name)."""
    parts = [str(layout["engine"]), f"dp{layout['dp']}"]
    parts += [f"{k}{layout[k]}" for k in MODEL_AXES if int(layout.get(k, 1)) > 1]
    parts.append(f"z{layout['zero']}")
    impl = _chosen_zero_impl(layout)
    if impl is not None:
        parts.append("ds" if impl in ZERO_IMPLS and ZERO_IMPLS[impl].deepspeed else impl)
    return "-".join(parts)


def _chosen_zero_impl(layout: dict[str, Any]) -> str | None:
    """The layout's ``zero_impl`` where its engine has a choice of several and this is not the first (its
    default); None otherwise."""
    spec, impl = ENGINES.get(str(layout["engine"])), layout.get("zero_impl")
    choices = spec.caps.zero_impls if spec is not None else ()
    if len(choices) < 2 or impl not in choices[1:]:
        return None
    return str(impl)


def stage(ckpt: Path, out: Path) -> dict[str, Any]:
    """Write the stage of checkpoint ``ckpt`` into the new directory ``out`` (one process, offline), each
    file one tensor at a time from the source's readers (lazy where the engine's reader is: megatron's,
    DeepSpeed ZeRO 1-3's), so no more than one tensor of the source is held; under
    :func:`~tessera.hostmem.lean_construction`, which returns each freed tensor to the system."""
    from tessera.hostmem import lean_construction

    with lean_construction():
        return _stage(ckpt, out)


def _stage(ckpt: Path, out: Path) -> dict[str, Any]:
    state, meta = hf_tensors(ckpt)  # verified first
    moments_missing = "moments cannot be read offline from this format, so resharding would drop them"
    out.mkdir(parents=True)
    hf_config_of(meta).save_pretrained(out)
    _write_streamed(out / WEIGHTS, state)
    names = set(state)
    del state
    for kind in MOMENTS:
        moment = read_hf_moment(ckpt, meta, kind)
        if moment is None:
            raise CheckpointError(
                f"{meta['sharding']}: the Adam {moments_missing}",
                field="checkpoint",
                value=str(ckpt),
                fix="resume it on its own layout (--same-layout), or export only the weights (--to hf)",
            )
        if not set(moment) <= names:  # internal: a reader's names must be the weights' names
            raise RuntimeError(f"moments for unknown parameters: {sorted(set(moment) - names)[:3]}")
        _write_streamed(out / f"{kind}.safetensors", moment)
        del moment
    info = {
        "source": str(ckpt),
        "step": int(meta["step"]),
        "adam_step": read_adam_step(ckpt, meta),
        "sampler": meta["sampler"],
        "engine": meta["engine"],
        "sharding": meta["sharding"],
        "layout": meta["layout"],
        "world_size": meta["world_size"],
        "peft": meta.get("peft"),  # adapters: staged beside the base, by canonical name
    }
    write_json_atomic(out / STAGE_INFO, info)
    return info


def _write_streamed(path: Path, tensors: TensorView) -> None:
    """``tensors`` as the safetensors file :func:`~tessera.tensorfile.save_tensors` writes, each tensor read
    from the (lazy) view as it is written, after a header made from the shapes the view knows."""
    layout = {k: (tuple(shape), dtype) for k, (shape, dtype) in tensors.shapes().items()}
    with open(path, "xb") as f:
        write_safetensors(f, tensors, {"tessera": "{}"}, layout=layout)


def stage_moments(stage_dir: Path) -> Moments:
    return {k: LazyTensors([Path(stage_dir) / f"{k}.safetensors"]) for k in MOMENTS}


def verify_against_stage(stage_dir: Path, written: Path, *, prompts: int = 2) -> dict[str, Any]:
    """``tessera verify`` of the stage (what the source checkpoint holds) against checkpoint ``written``,
    both read offline. Moments are compared one kind at a time."""
    from tessera.checkpoint.verify import Side, compare, open_side

    stage_dir = Path(stage_dir)
    info = json.loads((stage_dir / STAGE_INFO).read_text())
    cfg = hf_config_of({"model_config": json.loads((stage_dir / "config.json").read_text())})
    src = Side(
        label=f"{info['source']} (staged)",
        kind="checkpoint",
        config=cfg,
        state=LazyTensors([stage_dir / WEIGHTS]),  # read tensor by tensor as the comparison goes
        moments=stage_moments(stage_dir).get,
        tokenizer_dir=tokenizer_dir_of(Path(written)),
        peft=info.get("peft"),
    )
    return compare(src, open_side(Path(written)), prompts=prompts)


def summary_of(report: dict[str, Any]) -> dict[str, Any]:
    """The verdict of a verify report in a few numbers (for manifests and the console)."""
    t = report["tensors"]
    opt, lg = report.get("optimizer"), report.get("logits")
    return {
        "ok": report["ok"],
        "tensors_equal": f"{sum(r['equal'] for r in t)}/{len(t)}",
        "weights_max_abs_diff": max((r["max_abs_diff"] or 0.0 for r in t), default=0.0),
        "moments_equal": None if opt is None else opt["ok"],
        "moments_compared": None if opt is None else opt["compared"],
        "logits_max_abs_diff": None if lg is None else lg["max_abs_diff"],
        "logits_mean_kl": None if lg is None else lg["mean_kl"],
    }


def remove_stage(stage_dir: Path) -> None:
    shutil.rmtree(stage_dir, ignore_errors=True)
