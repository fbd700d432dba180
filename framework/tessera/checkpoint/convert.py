"""``tessera convert SRC --to hf --out DIR``: any Tessera checkpoint to a Hugging Face directory, verified.

The source is a ``step_*`` checkpoint directory or a run directory (meaning its ``latest``). The output
is what ``save_pretrained`` writes (``model.safetensors``, sharded with an index above 5 GB,
``config.json``, ``generation_config.json``) plus the run's tokenizer files, built in a temporary
directory beside ``--out`` and renamed at the end; the source is only read. Before the rename the output
is loaded back with ``from_pretrained`` and every tensor compared with the checkpoint's (bit-exact, or
exactly the requested dtype cast of it); the result goes into ``tessera_conversion.json`` in the output.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from tessera.atomic import write_json_atomic
from tessera.checkpoint.manager import CheckpointManager
from tessera.checkpoint.reader import hf_config_of, read_hf_state
from tessera.errors import CheckpointError, RecipeError
from tessera.rundir import RunDir

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
REPORT = "tessera_conversion.json"


def resolve_source(src: Path) -> Path:
    """A checkpoint directory, or a run directory's latest checkpoint."""
    src = Path(src)
    if (src / "meta.json").is_file():
        return src
    rd = RunDir(src)
    if rd.checkpoints.is_dir():
        latest = CheckpointManager(rd.checkpoints, keep=1, rank=0, world_size=1).latest()
        if latest is not None:
            return latest
    raise CheckpointError(
        "not a Tessera checkpoint (no meta.json) nor a run directory with checkpoints",
        field="SRC",
        value=str(src),
        fix="give a checkpoints/step_NNNNNN directory or a run directory",
    )


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise RecipeError(
            "the output exists and is not an empty directory",
            field="--out",
            value=str(out),
            fix="give a new directory (conversion never overwrites)",
        )


def _tokenizer_dir(ckpt: Path) -> Path | None:
    """The tokenizer the run trained with: its run directory's prepared-data record names it."""
    record = RunDir(ckpt.parent.parent).read_json_if_present(RunDir.DATA)
    path = Path(record["tokenizer_dir"]) if record and record.get("tokenizer_dir") else None
    return path if path is not None and path.is_dir() else None


def convert_to_hf(src: Path, out: Path, *, dtype: str = "fp32") -> dict[str, Any]:
    """Write the HF directory ``out`` from Tessera checkpoint ``src``; returns the verification report."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    _check_out(out)
    ckpt = resolve_source(src)
    state, meta = read_hf_state(ckpt)
    want = {k: v.to(DTYPES[dtype]) for k, v in state.items()}
    cfg = hf_config_of(meta)
    model = AutoModelForCausalLM.from_config(cfg).to(DTYPES[dtype])
    missing, unexpected = model.load_state_dict(want, strict=False)
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
        tok = _tokenizer_dir(ckpt)
        if tok is not None:
            AutoTokenizer.from_pretrained(str(tok)).save_pretrained(tmp)
        report = verify_hf_dir(tmp, want)
        report.update(source=str(ckpt), step=meta["step"], engine=meta["engine"], sharding=meta["sharding"],
                      layout=meta["layout"], dtype=dtype, tokenizer=str(tok) if tok else None)  # fmt: skip
        write_json_atomic(tmp / REPORT, report)
        if not report["ok"]:
            raise CheckpointError(
                f"the written HF directory does not reload equal: {report['mismatched'][:4]}",
                field="--out",
                value=str(out),
                fix="report this as a bug (the output was not kept)",
            )
        if out.exists():
            out.rmdir()  # empty, checked above
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return report


def _is_tied(model: Any, key: str) -> bool:
    out = model.get_output_embeddings()
    return (
        key.endswith("lm_head.weight")
        and out is not None
        and bool(getattr(model.config, "tie_word_embeddings", False))
    )


def verify_hf_dir(path: Path, want: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Load ``path`` with ``from_pretrained`` and compare every tensor with ``want`` (key coverage,
    shapes, dtypes, bit equality)."""
    from transformers import AutoModelForCausalLM

    got = AutoModelForCausalLM.from_pretrained(
        str(path), local_files_only=True, dtype=next(iter(want.values())).dtype
    )
    have = got.state_dict()  # tied weights under both names
    missing = sorted(set(want) - set(have))
    mismatched = sorted(
        k
        for k in want
        if k in have and (have[k].shape != want[k].shape or not torch.equal(have[k].detach(), want[k]))
    )
    comparable = [k for k in want if k in have and have[k].shape == want[k].shape]
    diffs = [float((have[k].detach().float() - want[k].float()).abs().max()) for k in comparable]
    return {
        "ok": not missing and not mismatched,
        "tensors": len(want),
        "missing": missing,
        "mismatched": mismatched,
        "max_abs_diff": max(diffs, default=0.0),
        "files": sorted(p.name for p in Path(path).iterdir()),
    }

