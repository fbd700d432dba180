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

import contextlib
import json
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from tessera.atomic import write_json_atomic, write_text_atomic
from tessera.checkpoint.reader import hf_config_of, hf_tensors, read_hf_state
from tessera.checkpoint.sources import is_hf_dir, resolve_source, tokenizer_dir_of
from tessera.checkpoint.verify import Side, compare, open_side, quiet_libraries, release
from tessera.errors import CheckpointError, RecipeError
from tessera.models.adapters import section_dict
from tessera.plan.layout import LAYOUT_AXES
from tessera.rundir import RunDir
from tessera.tensorfile import TensorView

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
    src: Path, out: Path, *, dtype: str = "fp32", verify: bool = True, prompts: int = 4, merge: bool = False
) -> dict[str, Any]:
    """Write the HF directory ``out`` from Tessera checkpoint ``src``; returns the conversion record
    (with ``tessera verify``'s report of the checkpoint against the output, unless ``verify`` is off).
    ``merge``: a checkpoint of adapters, merged into its base by peft (``merge_and_unload``)."""
    from tessera.hostmem import lean_construction

    # no progress bars on the console; every tensor the export frees is given back (one group at a time)
    with quiet_libraries(), lean_construction():
        return _convert_to_hf(Path(src), Path(out), dtype=dtype, verify=verify, prompts=prompts, merge=merge)


def _convert_to_hf(
    src: Path, out: Path, *, dtype: str, verify: bool, prompts: int, merge: bool
) -> dict[str, Any]:
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tessera.data.tokenizer import token_ids
    from tessera.models.hf import set_token_ids

    check_out(out)
    ckpt = resolve_source(src)
    view, meta = hf_tensors(ckpt)
    adapters = meta.get("peft")
    if adapters is not None and not merge:
        raise RecipeError(
            "the checkpoint holds adapters on a frozen base; an HF directory holds plain weights",
            field="--to",
            value="hf",
            fix="add --merge (the adapters merged into the base), or --to peft (the adapters alone)",
        )
    if merge and adapters is None:
        raise RecipeError(
            "--merge merges adapters, and this checkpoint has none (its run trained every weight)",
            field="--merge",
            value=True,
            fix="drop --merge",
        )
    unmerged = None
    want: Mapping[str, torch.Tensor]
    if adapters is not None:
        state = dict(view)
        unmerged = Side(str(ckpt), "checkpoint", hf_config_of(meta), state, None, tokenizer_dir_of(ckpt),
                        peft=adapters)  # fmt: skip
        # detached: peft's merge returns parameters
        want = {
            k: v.detach().to(DTYPES[dtype])
            for k, v in merged_state(hf_config_of(meta), adapters, state).items()
        }
    else:  # read as written, one group of tensors at a time where the checkpoint's reader can
        want = TensorView(view, dtype=DTYPES[dtype])
    cfg = hf_config_of(meta)
    tok = tokenizer_dir_of(ckpt)
    tokenizer = AutoTokenizer.from_pretrained(str(tok), local_files_only=True) if tok is not None else None
    ids = token_ids(tokenizer) if tokenizer is not None else None
    if ids is not None:  # before the model is built: its generation config copies them from cfg
        set_token_ids(cfg, ids, keep_own=_pretrained_run(ckpt))
    with init_empty_weights():  # the model's names, shapes and configs; no weights
        model = AutoModelForCausalLM.from_config(cfg).to(DTYPES[dtype])
    expected = {k: tuple(t.shape) for k, t in model.state_dict().items()}
    missing = {k for k in expected if k not in want and not _is_tied(model, k)}
    unexpected = set(want) - set(expected)
    shapes = (
        want.shapes() if isinstance(want, TensorView) else {k: (t.shape, t.dtype) for k, t in want.items()}
    )
    wrong = sorted(k for k in set(want) & set(expected) if tuple(shapes[k][0]) != expected[k])
    if missing or unexpected or wrong:
        raise CheckpointError(
            f"checkpoint and model config disagree: missing {sorted(missing)[:4]}, "
            f"unexpected {sorted(unexpected)[:4]}, other shapes {wrong[:4]}",
            field="checkpoint",
            value=str(ckpt),
            fix="the checkpoint's meta.json model_config must describe the model it holds",
        )
    with written_into(out) as tmp:
        write_pretrained(model, tmp, want)
        release(want)  # the last group the reader held
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        record: dict[str, Any] = {
            **source_record(ckpt, meta),
            "dtype": dtype,
            "tokenizer": str(tok) if tok else None,
            "token_ids": {k: getattr(cfg, k, None) for k in ids} if ids is not None else None,
            "tensors": len(want),
            "merged": section_dict(adapters),
            "verify": "skipped (--no-verify)",
        }
        if verify:
            source = Side(str(ckpt), "checkpoint", cfg, want, None, tok)
            written = open_side(tmp)
            written.label = f"{out} (as written, before the rename)"
            report = compare(source, written, prompts=prompts)
            if unmerged is not None:  # the merged model against the checkpoint's own (base + adapters)
                report["logits_vs_adapters"] = logits_only(unmerged, written, prompts=max(prompts, 1))
                report["ok"] = report["ok"] and report["logits_vs_adapters"]["ok"]
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
    return record


def write_pretrained(
    model: Any, out: Path, tensors: Mapping[str, torch.Tensor], *, max_shard_size: str = "5GB"
) -> None:
    """What ``model.save_pretrained(out)`` writes (``config.json`` with the dtype and architecture it
    records, ``generation_config.json``, ``model.safetensors`` or 5 GB shards named and indexed as it names
    them), the weights taken from ``tensors`` one at a time in the model's order: ``model`` may hold no
    weights (meta), and a lazy ``tensors`` is never read whole. By hand because save_pretrained gathers the
    whole state dict first (huggingface_hub's ``save_torch_state_dict`` too); its shard plan is
    huggingface_hub's own (``split_torch_state_dict_into_shards``), and a test compares the two outputs."""
    from huggingface_hub import split_torch_state_dict_into_shards

    from tessera.tensorfile import write_safetensors

    out.mkdir(parents=True, exist_ok=True)
    dtype = next(iter(model.parameters())).dtype
    model.config.dtype = str(dtype).split(".")[1]
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out)
    if model.can_generate():
        model.generation_config.save_pretrained(out)
    layout = {k: (tuple(t.shape), t.dtype) for k, t in model.state_dict().items() if k in tensors}
    plan = split_torch_state_dict_into_shards(
        {k: torch.empty(shape, dtype=dt, device="meta") for k, (shape, dt) in layout.items()},
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=max_shard_size,
    )
    for name, keys in plan.filename_to_tensors.items():
        with open(out / name, "wb") as f:
            write_safetensors(f, tensors, {"format": "pt"}, layout={k: layout[k] for k in keys})
    if plan.is_sharded:
        index = {
            "metadata": {"total_parameters": model.num_parameters(), **plan.metadata},
            "weight_map": plan.tensor_to_filename,
        }
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def merged_state(
    hf_cfg: Any, adapters: dict[str, Any], state: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The HF state of the base with the adapters merged in, by peft itself: the model with its adapters
    (canonical names loaded), ``merge_and_unload`` (fp32)."""
    from peft import get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from tessera.models.adapters import is_adapter, lora_config, peft_names

    model = AutoModelForCausalLM.from_config(hf_cfg).float()
    base = {k: v for k, v in state.items() if not is_adapter(k)}
    missing, unexpected = model.load_state_dict(base, strict=False)
    if [k for k in missing if not _is_tied(model, k)] or unexpected:  # internal: read_hf_state's names
        raise RuntimeError(f"base does not fit its config: {missing[:3]} {unexpected[:3]}")
    model.tie_weights()
    names = peft_names(hf_cfg, adapters)
    pm = get_peft_model(model, lora_config(adapters, model))
    result = set_peft_model_state_dict(pm, {names.peft_key(k): v for k, v in state.items() if is_adapter(k)})
    if [k for k in result.unexpected_keys if "lora" in k or "modules_to_save" in k]:  # internal
        raise RuntimeError(f"adapter keys peft did not take: {result.unexpected_keys[:3]}")
    merged = pm.merge_and_unload()
    return {k: v.detach() for k, v in merged.state_dict().items()}


def logits_only(a: Side, b: Side, *, prompts: int) -> dict[str, Any]:
    """``tessera verify``'s logits check alone (two models whose tensors differ by construction: the base
    with its adapters, and their merge)."""
    from tessera.checkpoint.verify import compare_logits

    with torch.no_grad():
        return compare_logits(a, b, prompts)


def convert_to_peft(src: Path, out: Path, *, verify: bool = True, prompts: int = 4) -> dict[str, Any]:
    """Write the PEFT adapter directory ``out`` (``adapter_config.json`` + ``adapter_model.safetensors``,
    peft's own config class and key names, and the run's tokenizer) from a checkpoint of adapters, verified:
    loaded back with ``PeftModel.from_pretrained`` on its base, tensors bit-exact and logits within 1e-5 of
    the checkpoint's."""
    with quiet_libraries():
        return _convert_to_peft(Path(src), Path(out), verify=verify, prompts=prompts)


def _convert_to_peft(src: Path, out: Path, *, verify: bool, prompts: int) -> dict[str, Any]:
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from tessera.checkpoint.verify import open_side
    from tessera.models.adapters import is_adapter, lora_config, meta_model, peft_names

    check_out(out)
    ckpt = resolve_source(src)
    state, meta = read_hf_state(ckpt)
    adapters = meta.get("peft")
    if adapters is None:
        raise RecipeError(
            "the checkpoint holds no adapters (its run trained every weight)",
            field="--to",
            value="peft",
            fix="export the whole model with --to hf",
        )
    base = meta.get("base") or {}
    base_dir = base.get("path") if base.get("from") == "files" else None
    hf_cfg = hf_config_of(meta)
    names = peft_names(hf_cfg, adapters)
    cfg = lora_config(adapters, meta_model(hf_cfg, adapters))
    cfg.base_model_name_or_path = base_dir
    cfg.task_type = "CAUSAL_LM"
    tensors = {names.peft_key(k): v.detach().float().contiguous() for k, v in state.items() if is_adapter(k)}
    with written_into(out) as tmp:
        tmp.mkdir(parents=True)
        cfg.save_pretrained(str(tmp))
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        tok = tokenizer_dir_of(ckpt)
        if tok is not None:
            AutoTokenizer.from_pretrained(str(tok), local_files_only=True).save_pretrained(tmp)
        record: dict[str, Any] = {
            **source_record(ckpt, meta),
            "peft": adapters,
            "base": base,
            "tensors": len(tensors),
            "verify": "skipped (--no-verify)",
        }
        if verify:
            source = open_side(ckpt)
            if base_dir is not None:  # as the ecosystem loads it: PeftModel.from_pretrained on the base
                written = open_side(tmp)
            else:  # a base built from a seed has no directory to name: the adapters on the checkpoint's base
                written = Side(str(tmp), "peft", source.config, _adapter_state(tmp, source.state, names), None,
                               None, peft=adapters)  # fmt: skip
            written.label = f"{out} (as written, before the rename)"
            report = compare(source, written, prompts=prompts)
            record["verify"] = report
            if not report["ok"]:
                raise CheckpointError(
                    "the written adapter does not verify against the checkpoint: "
                    + ", ".join([r["name"] for r in report["tensors"] if not r["equal"]][:4] or ["logits"]),
                    field="--out",
                    value=str(out),
                    fix="report this as a bug (the output was not kept)",
                )
        write_json_atomic(tmp / REPORT, record)
    return record


def _adapter_state(adapter_dir: Path, base: Any, names: Any) -> dict[str, torch.Tensor]:
    from tessera.models.adapters import is_adapter
    from tessera.tensorfile import load_tensors

    written = {
        names.from_peft_key(k): v for k, v in load_tensors(adapter_dir / "adapter_model.safetensors").items()
    }
    return {**{k: v for k, v in base.items() if not is_adapter(k)}, **written}


@contextlib.contextmanager
def written_into(out: Path) -> Iterator[Path]:
    """A temporary directory beside ``out`` to write an export into, renamed to ``out`` when the block
    ends without an error (``out`` is new or an empty directory: :func:`check_out`); removed otherwise, so
    a failed conversion leaves nothing at ``out``."""
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        yield tmp
        if out.exists():
            out.rmdir()  # empty, checked before
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def source_record(ckpt: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """What an export's record says of the checkpoint it came from."""
    return {k: meta[k] for k in ("step", "engine", "sharding", "layout")} | {"source": str(ckpt)}


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
