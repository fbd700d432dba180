"""The supported Hugging Face families, listed once.

Each entry says which HF ``model_type`` values the family covers, which megatron-core adapter builds it
(registered under that name in :mod:`tessera.models.megatron`, which checks at import that every family
here has one), the architecture facts the planner counts parameters and activations with, and where its
tiny CPU config and recipe live. What differs between families is data on the entry, so the planner's
``model_facts`` reads any family the same way.

Pure data with no heavy imports: the recipe schema, the model loader, the planner and the tests all read
it. Adding a family is one entry here, one adapter in ``models/megatron.py`` and its tiny config + recipe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tessera.errors import RecipeError

#: A per-family flag: a constant, or the name of the HF config key that holds it (a missing key is False).
Flag = bool | str


@dataclass(frozen=True, kw_only=True)
class Family:
    """One HF family: its model types, its megatron adapter, and the facts of its architecture."""

    name: str
    model_types: tuple[str, ...]
    adapter: str  # key of its adapter in tessera.models.megatron.ADAPTERS
    # where the HF config keeps the sizes (GPT-2 has its own names)
    hidden_key: str = "hidden_size"
    ffn_key: str = "intermediate_size"
    ffn_default: int = 0  # ffn = ffn_default x hidden when the key holds None (GPT-2's n_inner)
    positions_key: str | None = None  # learned absolute position embeddings; None for RoPE
    attn_dropout_key: str | None = "attention_dropout"
    hidden_dropout_key: str | None = None  # residual dropout, when the family has one
    topk_key: str | None = None  # mixture of experts: experts per token
    act_key: str = "hidden_act"  # the activation function
    # architecture
    norm: str = "RMSNorm"  # "RMSNorm" (weight) or "LayerNorm" (weight + bias)
    gated_mlp: bool = True  # SwiGLU: gate and up projections
    fused_qkv: bool = False  # the HF module keeps q, k, v in one tensor (GPT-2's Conv1D c_attn)
    qkv_bias: Flag = "attention_bias"
    proj_bias: Flag = "attention_bias"  # attention output projection
    mlp_bias: Flag = "mlp_bias"
    # initial weights (tessera.models.init): tensors whose name ends so start at std / sqrt(2 n_layer)
    scaled_init: tuple[str, ...] = ()

    @property
    def tiny_config(self) -> str:
        """The tiny CPU model config, relative to the repository root."""
        return f"configs/models/tiny-{self.name}.yaml"

    @property
    def tiny_recipe(self) -> str:
        """The tiny CPU recipe (deepspeed engine, 2 ranks), relative to the repository root."""
        return f"recipes/tiny-{self.name}-cpu.yaml"

    def flag(self, hf_cfg: Any, value: Flag) -> bool:
        return value if isinstance(value, bool) else bool(getattr(hf_cfg, value, False))

    def facts(self, hf_cfg: Any) -> dict[str, Any]:
        """The architecture facts of ``hf_cfg`` that the family decides (the planner's ModelFacts fields
        besides the adapter's shape)."""
        c = hf_cfg
        hidden = int(getattr(c, self.hidden_key))
        ffn = getattr(c, self.ffn_key, None)

        def dropout(key: str | None) -> bool:
            return key is not None and float(getattr(c, key, 0.0) or 0.0) > 0

        return dict(
            hidden=hidden,
            ffn=int(ffn) if ffn is not None else self.ffn_default * hidden,
            norm=self.norm,
            gated_mlp=self.gated_mlp,
            fused_qkv=self.fused_qkv,
            qkv_bias=self.flag(c, self.qkv_bias),
            proj_bias=self.flag(c, self.proj_bias),
            mlp_bias=self.flag(c, self.mlp_bias),
            positions=int(getattr(c, self.positions_key)) if self.positions_key else 0,
            attn_dropout=dropout(self.attn_dropout_key),
            hidden_dropout=dropout(self.hidden_dropout_key),
            topk=int(getattr(c, self.topk_key, 0) or 0) if self.topk_key else 0,
            activation=str(getattr(c, self.act_key, "silu")),
        )


FAMILIES: dict[str, Family] = {
    fam.name: fam
    for fam in (
        Family(name="llama", model_types=("llama",), adapter="llama"),
        # q/k/v carry a bias, o_proj does not
        Family(name="qwen2", model_types=("qwen2",), adapter="qwen2", qkv_bias=True, proj_bias=False),
        Family(name="mistral", model_types=("mistral",), adapter="mistral"),
        Family(
            name="gpt2",
            model_types=("gpt2",),
            adapter="gpt2",
            hidden_key="n_embd",
            ffn_key="n_inner",
            ffn_default=4,
            positions_key="n_positions",
            attn_dropout_key="attn_pdrop",
            act_key="activation_function",
            hidden_dropout_key="resid_pdrop",
            norm="LayerNorm",
            gated_mlp=False,
            fused_qkv=True,
            qkv_bias=True,
            proj_bias=True,
            mlp_bias=True,
            scaled_init=("c_proj.weight",),  # the residual projections, as GPT-2 scales them
        ),
        Family(name="mixtral", model_types=("mixtral",), adapter="mixtral", topk_key="num_experts_per_tok"),
    )
}
FAMILY_NAMES: tuple[str, ...] = tuple(FAMILIES)
MODEL_TYPES: tuple[str, ...] = tuple(t for fam in FAMILIES.values() for t in fam.model_types)


def family_of(model_type: str) -> Family:
    """The family covering HF ``model_type``; a RecipeError naming the supported types otherwise."""
    for fam in FAMILIES.values():
        if model_type in fam.model_types:
            return fam
    raise RecipeError(
        "model family not supported",
        field="model.hf_config.model_type",
        value=model_type,
        fix="use one of " + ", ".join(sorted(MODEL_TYPES)),
    )
