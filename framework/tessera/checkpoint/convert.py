"""``tessera convert SRC --to hf --out DIR``: any Tessera checkpoint to a Hugging Face directory, verified.

The source is a ``step_*`` checkpoint directory or a run directory (meaning its ``latest``). The output
is what ``save_pretrained`` writes (``model.safetensors``, sharded with an index above 5 GB,
``config.json``, ``generation_config.json``) plus the run's tokenizer files, built in a temporary
directory beside ``--out`` and renamed at the end; the source is only read. Before the rename the output
is loaded back with ``from_pretrained`` and every tensor compared with the checkpoint's (bit-exact, or
exactly the requested dtype cast of it); the result goes into ``tessera_conversion.json`` in the output.
``config.json`` and ``generation_config.json`` carry the special-token ids of the run's tokenizer (a
model trained from scratch: exactly the tokenizer's; a pretrained one keeps those of its own that agree).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from tessera.atomic import write_json_atomic, write_text_atomic
from tessera.checkpoint.reader import hf_config_of, read_hf_state
from tessera.checkpoint.sources import is_hf_dir, resolve_source, tokenizer_dir_of
from tessera.checkpoint.verify import Side, compare, open_side, quiet_libraries
from tessera.errors import CheckpointError, RecipeError
from tessera.plan.layout import LAYOUT_AXES
from tessera.rundir import RunDir

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
REPORT = RunDir.CONVERSION


def check_out(out: Path) -> None:
    """``--out`` is new or an empty directory: a conversion never overwrites."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise RecipeError(
            "the output exists and is not an empty directory",
            field="--out",
            value=str(out),
            fix="give a new directory (conversion never overwrites)",
        )


def _pretrained_run(ckpt: Path) -> bool:
    """Whether the run that wrote ``ckpt`` started from a pretrained model (its recipe says so; a checkpoint
    outside its run directory counts as pretrained: its config's own ids are then kept where they agree)."""
    import yaml

    recipe = RunDir.of_checkpoint(ckpt).recipe
    try:
        model = (yaml.safe_load(recipe.read_text()) or {}).get("model") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return True
    return bool(model.get("pretrained", True))


def convert_to_hf(
    src: Path, out: Path, *, dtype: str = "fp32", verify: bool = True, prompts: int = 4
) -> dict[str, Any]:
    """Write the HF directory ``out`` from Tessera checkpoint ``src``; returns the conversion record
    (with ``tessera verify``'s report of the checkpoint against the output, unless ``verify`` is off)."""
    with quiet_libraries():  # no progress bars of save_pretrained / from_pretrained on the console
        return _convert_to_hf(Path(src), Path(out), dtype=dtype, verify=verify, prompts=prompts)


def _convert_to_hf(src: Path, out: Path, *, dtype: str, verify: bool, prompts: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tessera.data.tokenizer import token_ids
    from tessera.models.hf import set_token_ids

    check_out(out)
    ckpt = resolve_source(src)
    state, meta = read_hf_state(ckpt)
    # detached: ZeRO's merged fp32 state comes as parameters that require grad
    want = {k: v.detach().to(DTYPES[dtype]) for k, v in state.items()}
    cfg = hf_config_of(meta)
    tok = tokenizer_dir_of(ckpt)
    tokenizer = AutoTokenizer.from_pretrained(str(tok), local_files_only=True) if tok is not None else None
    ids = token_ids(tokenizer) if tokenizer is not None else None
    if ids is not None:  # before the model is built: its generation config copies them from cfg
        set_token_ids(cfg, ids, keep_own=_pretrained_run(ckpt))
    model = AutoModelForCausalLM.from_config(cfg).to(DTYPES[dtype])
    missing, unexpected = model.load_state_dict(want, strict=False, assign=True)  # no second copy
    tied = {k for k in missing if _is_tied(model, k)}
    if set(missing) - tied or unexpected:
        raise CheckpointError(
            f"checkpoint and model config disagree: missing {sorted(set(missing) - tied)[:4]}, "
            f"unexpected {sorted(unexpected)[:4]}",
            field="checkpoint",
            value=str(ckpt),
            fix="the checkpoint's meta.json model_config must describe the model it holds",
        )
    model.tie_weights()
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True, max_shard_size="5GB")
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        record: dict[str, Any] = {
            "source": str(ckpt),
            "step": meta["step"],
            "engine": meta["engine"],
            "sharding": meta["sharding"],
            "layout": meta["layout"],
            "dtype": dtype,
            "tokenizer": str(tok) if tok else None,
            "token_ids": {k: getattr(cfg, k, None) for k in ids} if ids is not None else None,
            "tensors": len(want),
            "verify": "skipped (--no-verify)",
        }
        if verify:
            source = Side(str(ckpt), "checkpoint", cfg, want, None, tok)
            written = open_side(tmp)
            written.label = f"{out} (as written, before the rename)"
            report = compare(source, written, prompts=prompts)
            record["verify"] = report
            if not report["ok"]:
                raise CheckpointError(
                    "the written HF directory does not verify against the checkpoint: "
                    + ", ".join(
                        [r["name"] for r in report["tensors"] if not r["equal"]][:4]
                        or [p for t in report["special_tokens"] for p in t["problems"]]
                        or ["logits"]
                    ),
                    field="--out",
                    value=str(out),
                    fix="report this as a bug (the output was not kept)",
                )
        write_json_atomic(tmp / REPORT, record)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return record


def _is_tied(model: Any, key: str) -> bool:
    out = model.get_output_embeddings()
    return (
        key.endswith("lm_head.weight")
        and out is not None
        and bool(getattr(model.config, "tie_word_embeddings", False))
    )


#: ``--layout`` keys: the parallel fields a layout is made of, and the world size
LAYOUT_FIELDS = (*LAYOUT_AXES, "zero", "zero_impl", "micro_batch")


def layout_overrides(spec: str | None, *, engine: str, source_world: int | None) -> list[str]:
    """Recipe overrides for ``--to ENGINE --layout k=v,...``. The world size is ``world_size`` when given,
    else dp x tp x pp when dp is given, else the source's (dp then follows from it)."""
    pairs: dict[str, str] = {}
    for item in filter(None, (spec or "").split(",")):
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        key = "world_size" if key == "world" else key
        if not sep or key not in (*LAYOUT_FIELDS, "world_size") or not value.strip():
            raise RecipeError(
                f"not a layout setting: {item!r}",
                field="--layout",
                value=spec,
                fix="comma-separated k=v with k in " + ", ".join((*LAYOUT_FIELDS, "world_size")),
            )
        pairs[key] = value.strip()
    out = [f"parallel.engine={engine}"] + [f"parallel.{k}={v}" for k, v in pairs.items() if k != "world_size"]
    if "world_size" in pairs:
        world = pairs["world_size"]
    elif "dp" in pairs or source_world is None:
        try:
            world = str(int(pairs.get("dp", 1)) * int(pairs.get("tp", 1)) * int(pairs.get("pp", 1)))
        except ValueError:
            raise RecipeError(
                "dp, tp and pp must be whole numbers", field="--layout", value=spec, fix="e.g. dp=2,tp=2"
            ) from None
    else:
        world = str(source_world)
        out.append("parallel.dp=auto")
    return [*out, f"run.world_size={world}"]


def source_recipe(src: Path, given: str | None) -> Path:
    """The recipe a converted checkpoint resumes with: ``--recipe``, else the source run's own."""
    if given is not None:
        return Path(given)
    if not is_hf_dir(src):
        run_recipe = RunDir.of_checkpoint(resolve_source(src)).recipe
        if run_recipe.is_file():
            return run_recipe
    raise RecipeError(
        "no recipe to resume the converted checkpoint with (an HF directory has none, nor a checkpoint "
        "outside its run directory)",
        field="--recipe",
        value=None,
        fix="pass --recipe R.yaml (data, optimizer and schedule of the run that will resume it)",
    )


def write_conversion_record(run_dir: Path, src: Path, to: str) -> dict[str, Any]:
    """``tessera_conversion.json`` of a ``--to ENGINE`` conversion: the ranks' reshard record and the full
    verify report (or that it was skipped)."""
    rd = RunDir(run_dir)
    manifest = rd.read_manifest()
    rec = dict(manifest.get("resharded") or {})
    ckpt = Path(rec.get("to", ""))
    report = rd.read_json_if_present(RunDir.reshard_report(ckpt.name))
    record = {"source": str(src), "to": to, "layout": manifest["layout"], **rec}
    record["verify"] = report if report is not None else "skipped (--no-verify)"
    rd.write_json(RunDir.CONVERSION, record)
    if not is_hf_dir(src) and RunDir.of_checkpoint(src).metrics.is_file():  # the curves continue
        history = [r for r in RunDir.of_checkpoint(src).read_metrics() if r["step"] <= rec.get("step", 0)]
        if history:
            write_text_atomic(rd.metrics, "".join(json.dumps(r, sort_keys=True) + "\n" for r in history))
    return record
