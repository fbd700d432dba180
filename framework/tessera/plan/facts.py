"""What the planner knows of a model: :class:`ModelFacts`, read once from the HF config.

Its own module, below the estimates and the activation accounting that both read it (the arrows go one way:
``activations`` and ``estimate`` import this, never each other's facts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tessera.models.megatron import ModelShape, adapter_for
from tessera.tables.families import family_of


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
    shape: ModelShape | None = None  # what an engine's layout checks read (megatron-core's)

    @property
    def moe(self) -> bool:
        return self.num_experts > 0


def model_facts(hf_cfg: Any) -> ModelFacts:
    """The :class:`ModelFacts` of an HF config: the family adapter's shape plus the family entry's facts."""
    fam = family_of(hf_cfg.model_type)
    shape = adapter_for(hf_cfg.model_type).shape(hf_cfg)
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
        **facts,
    )
