"""What the planner knows of a model: :class:`ModelFacts`, read once from the HF config.

Its own module, below the estimates and the activation accounting that both read it (the arrows go one way:
``activations`` and ``estimate`` import this, never each other's facts).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from tessera.models.megatron import ModelShape, adapter_for, missing_adapter
from tessera.tables.families import Family, family_of


@dataclass(frozen=True)
class ModelFacts:
    """Everything the estimates need to know of a model: the adapter's shape plus the facts its family entry
    (:mod:`tessera.tables.families`) reads from the HF config."""

    family: str
    hidden: int
    ffn: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    norm: str = "RMSNorm"  # "RMSNorm" (weight) or "LayerNorm" (weight + bias)
    gated_mlp: bool = True  # SwiGLU: fc1 is [gate; up] (2·ffn outputs)
    fused_qkv: bool = False  # the HF module keeps q, k, v in one tensor (GPT-2's Conv1D)
    qkv_bias: bool = False
    proj_bias: bool = False  # attention output projection bias
    mlp_bias: bool = False
    positions: int = 0  # learned absolute position embeddings (GPT-2 n_positions); 0 for RoPE
    tied: bool = False
    num_experts: int = 0
    topk: int = 0
    attn_dropout: bool = False
    hidden_dropout: bool = False
    activation: str = "silu"  # the HF activation function (hidden_act; GPT-2's activation_function)
    qk_norm: bool = False  # an RMSNorm per query / key head (head_dim weights each)
    shape: ModelShape | None = None  # what an engine's layout checks read (megatron-core's)
    #: a family without an entry: its parameter tensors (name, elements), unique, in the module's order,
    #: from the model built on the meta device; the parameter counts are these, not the formula's
    tensors: tuple[tuple[str, int], ...] = ()
    #: a meta-counted family with a megatron adapter: its HF config (JSON), whose megatron shards the weight
    #: map gives exactly (:func:`meta_shard_numels`)
    config_json: str = ""
    #: with a ``peft`` section: the element counts of the trained adapter tensors (the rest is a frozen
    #: base); empty when every weight trains
    adapters: tuple[int, ...] = ()
    #: for each of ``adapters``: whether megatron splits it over TP (B of a column-parallel site, A of a
    #: row-parallel one); and per adapted megatron linear (its name, "experts." first for a routed expert's:
    #: "linear_qkv"), its split ("col" | "row") and how many targets it holds
    adapters_tp: tuple[bool, ...] = ()
    #: for each of ``adapters``: whether it belongs to the routed experts (megatron: split over EP)
    adapters_ep: tuple[bool, ...] = ()
    adapter_sites: tuple[tuple[str, str, int], ...] = ()
    adapter_rank: int = 0

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def generic(self) -> bool:
        """Counted on the meta-device model (the family has no formula): see GENERIC_ESTIMATES."""
        return bool(self.tensors)


def model_facts(hf_cfg: Any) -> ModelFacts:
    """The :class:`ModelFacts` of an HF config: the family adapter's shape plus the family entry's facts;
    for a family without an entry, the shape read from the config's common keys and the parameter tensors
    of the model built on the meta device."""
    fam = family_of(hf_cfg.model_type)
    tensors: tuple[tuple[str, int], ...] = ()
    shape = adapter_for(hf_cfg.model_type).shape(hf_cfg) if fam.adapter else generic_shape(hf_cfg, fam)
    config_json = ""
    if fam.generic:
        as_json = hf_cfg.to_json_string()
        tensors = meta_tensors(as_json)
        config_json = as_json if fam.adapter else ""
    facts = fam.facts(hf_cfg)
    if not shape.num_experts:
        facts["topk"] = 0
    return ModelFacts(
        family=fam.name,
        num_layers=shape.num_layers,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_query_groups,
        head_dim=shape.head_dim,
        vocab_size=shape.vocab_size,
        tied=shape.tied,
        num_experts=shape.num_experts,
        shape=shape,
        tensors=tensors,
        config_json=config_json,
        **facts,
    )


def generic_shape(c: Any, fam: Family) -> ModelShape:
    """The shape of a causal LM without a family entry, from the keys transformers' configs share (their
    ``attribute_map`` gives GPT-2-style names these too). No megatron-core adapter builds it."""
    heads = int(c.num_attention_heads)
    return ModelShape(
        num_layers=int(c.num_hidden_layers),
        num_heads=heads,
        num_query_groups=int(getattr(c, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(c, "head_dim", None) or c.hidden_size // heads),
        vocab_size=int(c.vocab_size),
        num_experts=fam.experts(c),
        tied=bool(getattr(c, "tie_word_embeddings", False)),
        normalization="LayerNorm" if "layer_norm_eps" in c.to_dict() else "RMSNorm",
        megatron_adapter=False,
        missing_adapter=missing_adapter(c.model_type),
    )


@functools.lru_cache(maxsize=4)
def _meta_model(config_json: str) -> tuple[Any, Any]:
    """(HF config, model) of an HF config's JSON, the model built on the meta device: shapes, no memory.
    Built once per config for the counts and the megatron shards below."""
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    d = json.loads(config_json)
    cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    with torch.device("meta"):
        return cfg, AutoModelForCausalLM.from_config(cfg)


@functools.lru_cache(maxsize=16)
def meta_tensors(config_json: str) -> tuple[tuple[str, int], ...]:
    """(name, elements) of every parameter tensor of the model of an HF config (its JSON), built on the
    meta device: exact counts for any family, no memory. A tied head is one tensor, counted once."""
    return tuple((n, p.numel()) for n, p in _meta_model(config_json)[1].named_parameters())


@functools.lru_cache(maxsize=64)
def meta_shard_numels(
    config_json: str, tp: int, pp: int, pp_rank: int, ep: int, etp: int
) -> tuple[int, int, int, int]:
    """(dense, expert, largest layer, embedding) elements of one megatron rank of a meta-counted family
    with an adapter: the weight map run on the HF model built on the meta device (no memory), so every
    split it makes (TP, PP, EP, vocabulary padding, replicated tensors) is counted as the engine holds it."""
    from tessera.models.megatron import Shard
    from tessera.models.weight_map import hf_to_mcore

    cfg, model = _meta_model(config_json)
    shard = Shard(tp=tp, pp=pp, pp_rank=pp_rank, ep=ep, etp=etp)
    sd = hf_to_mcore(model.state_dict(), adapter_for(cfg.model_type), cfg, shard)
    expert = sum(t.numel() for k, t in sd.items() if ".local_experts." in k)
    layers: dict[str, int] = {}
    for k, t in sd.items():
        m = _LAYER.search(k) if k.startswith("decoder.layers.") else None
        if m is not None:
            layers[m.group(1)] = layers.get(m.group(1), 0) + t.numel()
    emb = sum(
        t.numel() for k, t in sd.items() if k in ("embedding.word_embeddings.weight", "output_layer.weight")
    )
    return sum(t.numel() for t in sd.values()) - expert, expert, max(layers.values(), default=0), emb


_LAYER = re.compile(r"\.(\d+)\.")


def layer_numels(f: ModelFacts) -> dict[int, int]:
    """Elements per transformer layer of a meta-counted model (the first numbered module in a name)."""
    out: dict[int, int] = {}
    for name, n in f.tensors:
        m = _LAYER.search(name)
        if m is not None:
            out[int(m.group(1))] = out.get(int(m.group(1)), 0) + n
    return out


def with_adapters(f: ModelFacts, hf_cfg: Any, peft: Any) -> ModelFacts:
    """``f`` with the recipe's adapters (:mod:`tessera.models.adapters`, counted on the meta-device model);
    ``f`` itself without a ``peft`` section."""
    if peft is None:
        return f
    import dataclasses
    import math

    from tessera.models.adapters import adapter_shapes, section_dict

    shapes = adapter_shapes(hf_cfg, peft)
    split: dict[str, bool] = {}
    experts: set[str] = set()
    sites: tuple[tuple[str, str, int], ...] = ()
    if family_of(hf_cfg.model_type).adapter is not None:
        from tessera.errors import RecipeError
        from tessera.models.megatron import adapter_for
        from tessera.models.megatron_lora import lora_rules
        from tessera.models.megatron_lora import sites as megatron_sites

        try:
            found = megatron_sites(adapter_for(hf_cfg.model_type), hf_cfg, section_dict(peft))
        except RecipeError:  # not on megatron (the engine refuses it there, naming the field)
            found = []
        sites = tuple(
            (("experts." if s.expert else "") + s.mcore.rsplit(".", 1)[-1], s.split, len(s.targets))
            for s in found
        )
        for site in found:
            for rule in lora_rules(site):
                split[str(rule.hf).replace("*", "")] = rule.split != "repl"
                if site.expert:
                    experts.add(str(rule.hf).replace("*", ""))
    numels = tuple(math.prod(s) for s in shapes.values())
    tp = tuple(split.get(_layerless(n), False) for n in shapes)
    ep = tuple(_layerless(n) in experts for n in shapes)
    rank = int(section_dict(peft)["r"])
    return dataclasses.replace(
        f, adapters=numels, adapters_tp=tp, adapters_ep=ep, adapter_sites=sites, adapter_rank=rank
    )


def _layerless(name: str) -> str:
    """``model.layers.3.self_attn.q_proj.lora_A.weight`` -> ``model.layers..self_attn.q_proj.lora_A.weight``."""
    return re.sub(r"\.layers\.\d+\.", ".layers..", name)
