"""Hugging Face causal LMs from an inline config dict or a local directory, one registered family each.

A family entry says which HF ``model_type`` values it covers. The megatron adapters (issue 3) hang off
the same registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tessera.config.schema import FAMILIES, ModelSection
from tessera.errors import RecipeError


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]


_REGISTRY: dict[str, Family] = {}


def register_family(name: str, *, model_types: tuple[str, ...]) -> Callable[[type], type]:
    """Class decorator: ``@register_family("llama", model_types=("llama",))`` on an adapter class."""

    def deco(cls: type) -> type:
        _REGISTRY[name] = Family(name=name, model_types=model_types)
        cls.family = _REGISTRY[name]
        return cls

    return deco


@register_family("llama", model_types=("llama",))
class LlamaFamily: ...


@register_family("qwen2", model_types=("qwen2",))
class Qwen2Family: ...


@register_family("mistral", model_types=("mistral",))
class MistralFamily: ...


@register_family("gpt2", model_types=("gpt2",))
class GPT2Family: ...


@register_family("mixtral", model_types=("mixtral",))
class MixtralFamily: ...


assert set(_REGISTRY) == set(FAMILIES)  # schema and registry list the same families


def family_of(model_type: str) -> Family:
    for fam in _REGISTRY.values():
        if model_type in fam.model_types:
            return fam
    raise RecipeError(
        "model family not supported",
        field="model.hf_config.model_type",
        value=model_type,
        fix="use one of " + ", ".join(sorted(t for f in _REGISTRY.values() for t in f.model_types)),
    )


def load_hf_config(section: ModelSection, *, vocab_size: int | None = None):
    """The ``transformers`` config of the recipe's model; ``vocab_size`` fills a missing one."""
    from transformers import AutoConfig

    if section.hf_config is not None:
        cfg_dict = dict(section.hf_config)
        model_type = cfg_dict.pop("model_type")
        family_of(model_type)
        if vocab_size is not None and "vocab_size" not in cfg_dict:
            cfg_dict["vocab_size"] = vocab_size
        try:
            cfg = AutoConfig.for_model(model_type, **cfg_dict)
        except (TypeError, ValueError) as e:
            raise RecipeError(
                f"transformers rejects this config: {e}",
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
        try:
            cfg = AutoConfig.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as e:
            raise RecipeError(
                f"cannot read an HF config there: {e}",
                field="model.path",
                value=str(path),
                fix="point at a directory with config.json",
            ) from None
        family_of(cfg.model_type)
    return cfg


def check_vocab(cfg, tokenizer_vocab: int) -> None:
    if cfg.vocab_size < tokenizer_vocab:
        raise RecipeError(
            f"the model's vocab_size {cfg.vocab_size} is smaller than the tokenizer's {tokenizer_vocab}",
            field="model.hf_config.vocab_size",
            value=cfg.vocab_size,
            fix=f"set model.hf_config.vocab_size >= {tokenizer_vocab} or data.vocab_size <= {cfg.vocab_size}",
        )


def build_model(
    section: ModelSection, *, seed: int, vocab_size: int | None = None, dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """The HF causal LM, initialised from ``seed`` (same weights on every rank and every layout)."""
    from transformers import AutoModelForCausalLM

    cfg = load_hf_config(section, vocab_size=vocab_size)
    if vocab_size is not None:
        check_vocab(cfg, vocab_size)
    torch.manual_seed(seed)
    if section.pretrained:
        model = AutoModelForCausalLM.from_pretrained(
            section.path, local_files_only=True, dtype=dtype, attn_implementation=section.attn_implementation
        )
    else:
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=section.attn_implementation)
        model.to(dtype)
    return model
