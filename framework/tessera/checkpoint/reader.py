"""Any Tessera checkpoint as full HF tensors, without the engine that wrote it.

``meta.json`` (format v2) says the engine, its sharding and the layout; the engine's registry entry names
its offline reader (:class:`tessera.engines.base.CheckpointReader`), which reads the format with the
format's own machinery: the ddp engine's safetensors; DeepSpeed's ``zero_to_fp32`` for ZeRO 1-3 and the
module file for ZeRO-0 (:mod:`tessera.engines.zero_reader`); megatron-core's ``dist_checkpointing``
through torch's distributed-checkpoint reader (:mod:`tessera.engines.megatron_reader`). The checkpoint is
verified (checksums, the static scan of its pickles) before anything reads it, and every pickle is then
loaded with ``weights_only=True`` and the allow-list of :mod:`tessera.safeload`: nothing in a checkpoint
runs code.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from tessera.checkpoint.index import FORMAT_VERSION, verify_or_raise
from tessera.engines.base import CheckpointReader
from tessera.errors import CheckpointError
from tessera.models.adapters import canonical
from tessera.models.hf import hf_config_of
from tessera.tables.engines import ENGINES, PLUGIN_ENV, engine_hook
from tessera.tensorfile import TensorView

__all__ = [
    "base_tensors",
    "hf_config_of",
    "hf_tensors",
    "read_adam_step",
    "read_hf_moment",
    "read_hf_state",
    "reader_of",
]


def reader_of(ckpt: Path, meta: dict[str, Any]) -> CheckpointReader:
    """The offline reader of the engine that wrote checkpoint ``ckpt`` (its registry entry's)."""
    engine = meta.get("engine")
    if engine not in ENGINES:
        raise CheckpointError(
            f"the checkpoint was written by engine {engine!r}, which is not registered here",
            field="checkpoint",
            value=str(ckpt),
            fix=f"register its plugin: name the module that registers engine {engine!r} in the "
            f"{PLUGIN_ENV} environment variable (or install the package whose entry point does)",
        )
    return engine_hook(engine, "reader")


def read_hf_state(ckpt: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(HF state dict in fp32, meta) of checkpoint directory ``ckpt``, verified first."""
    view, meta = hf_tensors(ckpt)
    return {k: view[k] for k in view}, meta


def hf_tensors(ckpt: Path) -> tuple[TensorView, dict[str, Any]]:
    """(HF tensors in fp32, meta) of checkpoint directory ``ckpt``, verified first: a mapping that reads
    each tensor when it is asked for where the engine's reader does (megatron's: one group of tensors
    held at a time, so an export in HF order never holds the model), else over the read state."""
    ckpt = Path(ckpt)
    meta = verify_or_raise(ckpt)
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            "a v1 checkpoint does not say which engine and layout wrote it",
            field="checkpoint",
            value=str(ckpt),
            fix="resume it once with this release (its next checkpoint is v2), then convert that",
        )
    name = names_of(meta)
    weights: Mapping[str, torch.Tensor] = reader_of(ckpt, meta).weights(ckpt, meta)
    if meta.get("peft") is not None:  # a checkpoint of adapters: the base is the one meta.json names
        state = {name(k): v for k, v in weights.items()}
        base = base_tensors(ckpt, meta)
        weights, name = {**{k: base[k] for k in base if k not in state}, **state}, str
    # as save_pretrained writes it: a tied head is the embedding, not a second tensor (DeepSpeed's merge
    # adds it back as a shared parameter)
    tied = bool(getattr(hf_config_of(meta), "tie_word_embeddings", False))
    names = {name(k): k for k in weights if not (tied and name(k).endswith("lm_head.weight"))}
    return TensorView(weights, names, torch.float32), meta


def base_tensors(ckpt: Path, meta: dict[str, Any]) -> Mapping[str, torch.Tensor]:
    """The frozen base of a checkpoint of adapters, as its meta.json names it (``base``): the pretrained
    directory, whose weight files must still have the recorded sha256, or the seeded rule."""
    from tessera.evidence.manifest import files_digest
    from tessera.models.hf import hf_dir_tensors
    from tessera.models.init import INIT_RULE, SeededWeights

    base = meta.get("base") or {}
    if base.get("from") == "files":
        d = Path(base["path"])
        files = sorted(d.glob("*.safetensors")) or sorted(d.glob("*.bin"))
        if not files or files_digest(files) != base.get("sha256"):
            raise CheckpointError(
                "the checkpoint holds adapters only, and its base model is gone or has changed since "
                f"(sha256 of {d} differs from the one recorded)",
                field="checkpoint",
                value=str(ckpt),
                fix=f"restore the base model the run trained on at {d} (meta.json 'base' records its sha256)",
            )
        return hf_dir_tensors(d)
    if base.get("from") == "seed" and base.get("rule") == INIT_RULE:
        return SeededWeights(hf_config_of(meta), int(base["seed"]))
    raise CheckpointError(
        "the checkpoint holds adapters only and does not say which base they belong to",
        field="checkpoint",
        value=str(ckpt),
        fix="its meta.json needs 'base' (written by this release); resume the run once to write one",
    )


def read_hf_moment(ckpt: Path, meta: dict[str, Any], kind: str) -> TensorView | None:
    """One Adam moment (``exp_avg`` or ``exp_avg_sq``) of every trainable parameter, keyed by HF name, in
    fp32, each read when asked for where the engine's reader reads lazily; None where the format's moments
    are not readable offline (DeepSpeed's bf16 / fp16 optimizer wrappers without ZeRO). One kind at a
    time, so a caller never holds the weights and both moments together. ``ckpt`` is verified."""
    ckpt = Path(ckpt)
    moment = reader_of(ckpt, meta).moment(ckpt, meta, kind)
    name = names_of(meta)
    return None if moment is None else TensorView(moment, {name(k): k for k in moment})


def names_of(meta: dict[str, Any]) -> Any:
    """Module name -> canonical name of a checkpoint's tensors (the names its engine's modules have: with
    adapters peft's, positional for fused experts; :mod:`tessera.models.adapters`)."""
    if meta.get("peft") is None:
        return canonical
    from tessera.models.adapters import peft_names

    return peft_names(hf_config_of(meta), meta["peft"]).canonical


def read_adam_step(ckpt: Path, meta: dict[str, Any]) -> int:
    """The optimizer's update count. Every Tessera step is one update (fp16 loss scaling, which skips
    updates, is refused), so where the format keeps it per parameter it is checked against the step."""
    ckpt = Path(ckpt)
    return reader_of(ckpt, meta).adam_step(ckpt, meta)
