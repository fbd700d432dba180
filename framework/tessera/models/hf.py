"""Hugging Face causal LMs from an inline config dict or a local directory.

Which families exist is :mod:`tessera.tables.families` (listed once); :func:`family_of` is re-exported
here for the callers that load models.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from tessera.config.schema import ModelSection
from tessera.errors import RecipeError
from tessera.tables.families import Family, family_of

__all__ = [
    "Family",
    "check_vocab",
    "empty_model",
    "family_of",
    "fill_from",
    "load_hf_config",
    "set_token_ids",
    "token_id_conflicts",
]


def load_hf_config(
    section: ModelSection, *, vocab_size: int | None = None, token_ids: Mapping[str, int | None] | None = None
):
    """The ``transformers`` config of the recipe's model; ``vocab_size`` fills a missing one. ``token_ids``
    (the run's tokenizer's bos / eos / pad) replace the config's for a model trained from scratch: its
    family's defaults (Llama's bos 1, eos 2) name other tokens of Tessera's BPE (eos 0, pad 1), and an
    export would carry them into generate, which then never stops. A pretrained model keeps its own."""
    from huggingface_hub.errors import StrictDataclassError  # transformers' config validation
    from transformers import AutoConfig

    if section.hf_config is not None:
        cfg_dict = dict(section.hf_config)
        model_type = cfg_dict.pop("model_type")
        family_of(model_type)
        if vocab_size is not None and "vocab_size" not in cfg_dict:
            cfg_dict["vocab_size"] = vocab_size
        try:
            cfg = AutoConfig.for_model(model_type, **cfg_dict)
        except (TypeError, ValueError, StrictDataclassError) as e:
            why = e.__cause__ if isinstance(e, StrictDataclassError) and e.__cause__ else e
            raise RecipeError(
                f"transformers rejects this config: {why}",
                field="model.hf_config",
                value=model_type,
                fix="fix the named key of model.hf_config",
            ) from None
    else:
        path = Path(section.path)  # type: ignore[arg-type]
        if not path.exists():
            raise RecipeError(
                "model path not found",
                field="model.path",
                value=str(path),
                fix="give a local config.json or a directory holding one",
            )
        cfg = read_dir_config(path)
        family_of(cfg.model_type)
    if token_ids is not None and not section.pretrained:
        set_token_ids(cfg, token_ids)
    return cfg


def set_token_ids(cfg: Any, ids: Mapping[str, int | None], *, keep_own: bool = False) -> None:
    """Write a tokenizer's special-token ids into an HF config (a model built from it then copies them
    into its generation config). ``keep_own`` (a pretrained model's config): only ids that disagree with
    the tokenizer change; an id the tokenizer does not define (Qwen's bos) and an eos list that holds the
    tokenizer's eos (Llama 3.1's stop tokens) stay. The pad id also sets the embedding's ``padding_idx``
    in HF modules (no gradient for that row): it is the tokenizer's own pad, never eos standing in."""
    for key, want in ids.items():  # tessera.data.tokenizer.token_ids: bos, eos, pad by their config names
        if keep_own and (want is None or _agrees(getattr(cfg, key, None), want)):
            continue
        setattr(cfg, key, want)


def _agrees(have: Any, want: int) -> bool:
    return have == want or (isinstance(have, list | tuple) and want in have)


def token_id_conflicts(where: str, cfg: Mapping[str, Any], ids: Mapping[str, int | None]) -> list[str]:
    """Where a config's (``config.json``'s or ``generation_config.json``'s ``where``) special-token ids
    disagree with its tokenizer's, one line each naming both values: eos must be the tokenizer's (or a
    list holding it: generate stops on it); bos and pad, where both give one, must be equal."""
    out = []
    for key, want in ids.items():
        have = cfg.get(key)
        if want is None or (have is None and key != "eos_token_id") or _agrees(have, want):
            continue
        if have is None and where != "config.json":
            continue  # generation_config.json without eos falls back to config.json's
        out.append(f"{where} {key}={have}, the tokenizer's {key.removesuffix('_id')} is {want}")
    return out


def read_dir_config(path: Path) -> Any:
    """The HF config of a local directory (or config.json); an unreadable one names the path."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, StrictDataclassError) as e:
        raise RecipeError(
            f"cannot read an HF config there: {e}",
            field="model.path",
            value=str(path),
            fix="point at a directory with config.json",
        ) from None


def check_vocab(cfg, tokenizer_vocab: int) -> None:
    if cfg.vocab_size < tokenizer_vocab:
        raise RecipeError(
            f"the model's vocab_size {cfg.vocab_size} is smaller than the tokenizer's {tokenizer_vocab}",
            field="model.hf_config.vocab_size",
            value=cfg.vocab_size,
            fix=f"set model.hf_config.vocab_size >= {tokenizer_vocab} or data.vocab_size <= {cfg.vocab_size}",
        )


def empty_model(
    cfg: Any,
    *,
    attn_implementation: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: Any = "cpu",
) -> torch.nn.Module:
    """The HF model of ``cfg`` made directly in ``dtype`` on ``device``, its parameters not initialised
    (HF's own init would only be overwritten): fill them with :func:`fill_from`. Non-persistent buffers
    (RoPE frequencies) are computed by the modules as usual."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with no_init_weights(), torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation, dtype=dtype)
    model.tie_weights()  # part of HF's init_weights, which no_init_weights skips
    return model


def fill_from(
    model: torch.nn.Module,
    tensors: Mapping[str, torch.Tensor],
    *,
    where: str,
    shape_of: Callable[[torch.Tensor], tuple[int, ...]] = lambda t: tuple(t.shape),
    copy: Callable[[torch.Tensor, str], Any] | None = None,
) -> None:
    """Copy HF-named ``tensors`` into ``model``'s parameters and persistent buffers one tensor at a time
    (``tensors`` may read lazily). Every tensor of the model must be there with its shape, and nothing
    else (a tied ``lm_head.weight`` may be absent or present). ``shape_of`` / ``copy(param, name)``: for
    parameters that hold only a part of themselves (ZeRO-3 partitions read only their part)."""
    from tessera.errors import CheckpointError
    from tessera.models.adapters import name_map
    from tessera.models.init import shape_of as source_shape

    # by canonical name: an adapter's wrappers (peft's base_layer, its adapter name) are not in the name
    canon = name_map(model)
    names = {canon[n] for n in model.state_dict()}
    own = {canon[n]: p for n, p in model.named_parameters()}
    own.update((canon[n], b) for n, b in model.named_buffers() if canon.get(n) in names)
    fix = "give weights written for this model config (model.hf_config / model.path)"
    missing = sorted(set(own) - set(tensors))
    extra = sorted(set(tensors) - names)
    if missing or extra:
        raise CheckpointError(
            f"the weights do not fit the model: missing {missing[:3]}, unexpected {extra[:3]}",
            field="model.path",
            value=where,
            fix=fix,
        )
    with torch.no_grad():
        for name, t in own.items():
            src_shape = source_shape(tensors, name)
            if src_shape != shape_of(t):
                raise CheckpointError(
                    f"{name} has shape {list(src_shape)}, the model's is {list(shape_of(t))}",
                    field="model.path",
                    value=where,
                    fix=fix,
                )
            if copy is not None:
                copy(t, name)
            else:
                t.copy_(tensors[name])


def model_tensor_names(cfg: Any) -> set[str]:
    """The state-dict names of the HF model of ``cfg`` (built on the meta device: no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return set(AutoModelForCausalLM.from_config(cfg).state_dict())


def hf_dir_tensors(path: Path, *, extra: set[str] | None = None) -> Mapping[str, torch.Tensor]:
    """The weights of an HF directory under the model's own tensor names. Read lazily, one tensor per
    access, when its safetensors use those names; otherwise through ``from_pretrained`` (transformers'
    own key conversion, in memory): a ``.bin`` checkpoint (``weights_only``), or a layout that
    ``save_pretrained`` still writes in its legacy form (Mixtral's per-expert ``w1``/``w2``/``w3``, which
    the model holds fused). ``extra``: more names the files may hold (a resharding stage's adapters beside
    the base, by canonical name)."""
    from transformers import AutoModelForCausalLM

    from tessera.errors import CheckpointError
    from tessera.tensorfile import LazyTensors

    path = Path(path)
    cfg = read_dir_config(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():  # a sharded checkpoint: every shard it lists must be there
        import json

        for shard in sorted(set(json.loads(index.read_text()).get("weight_map", {}).values())):
            if not (path / shard).is_file():
                raise CheckpointError(
                    "a weight shard listed in model.safetensors.index.json is missing",
                    field="model.path",
                    value=str(path / shard),
                    fix="restore the file, or save the model again with save_pretrained",
                )
    files = sorted(path.glob("*.safetensors"))
    if files:
        lazy = LazyTensors(files)  # a damaged header is an error naming the file
        if set(lazy) <= model_tensor_names(cfg) | (extra or set()):
            return lazy
    elif not list(path.glob("pytorch_model*.bin")):
        raise CheckpointError(
            "the weights are missing (no *.safetensors, no pytorch_model*.bin)",
            field="model.path",
            value=str(path / "model.safetensors"),
            fix="give a directory written by save_pretrained, or restore its weight files",
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32)
    except Exception as e:  # transformers' own errors for unreadable weights
        raise CheckpointError(
            f"transformers cannot load these weights ({type(e).__name__}: {str(e)[:160]})",
            field="model.path",
            value=str(path),
            fix="give a directory written by save_pretrained",
        ) from None
    return {k: v.detach() for k, v in model.state_dict().items()}


def hf_config_of(meta: Mapping[str, Any]) -> Any:
    """The HF config a Tessera checkpoint records (``meta.json``'s ``model_config``, format v2): what its
    offline readers map the engine's tensors back to HF names with."""
    from transformers import AutoConfig

    cfg = dict(meta["model_config"])
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg)
