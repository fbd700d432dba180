"""The supported Hugging Face families, listed once.

Each entry says which HF ``model_type`` values the family covers, which megatron-core adapter builds it
(registered under that name in :mod:`tessera.models.megatron`, which checks at import that every family
here has one), the architecture facts the planner counts parameters and activations with, and where its
tiny CPU config and recipe live. What differs between families is data on the entry, so the planner's
``model_facts`` reads any family the same way.

Pure data with no heavy imports: the recipe schema, the model loader, the planner and the tests all read
it. Adding a family is one entry here, one adapter in ``models/megatron.py`` and its tiny config + recipe.

Any other causal LM that transformers can build (``AutoModelForCausalLM``) runs on the engines that train
the HF module itself (deepspeed, ddp) without an entry: :func:`family_of` gives it a *generic* family (no
megatron adapter); the planner then counts its parameters on the model built on the meta device and says
which estimates fall back to a generic formula (:data:`GENERIC_ESTIMATES`).
"""

from __future__ import annotations

import functools
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
    adapter: str | None  # key of its adapter in tessera.models.megatron.ADAPTERS; None: HF engines only
    #: the planner's formulas describe it exactly (parameters by tensor, activations measured per kernel);
    #: False: its parameters are counted on the model built on the meta device, its initial 1-D tensors
    #: and persistent buffers come from its own ``_init_weights``, and GENERIC_ESTIMATES say the rest
    formula: bool = True
    # where the HF config keeps the sizes (GPT-2 has its own names)
    hidden_key: str = "hidden_size"
    ffn_key: str = "intermediate_size"
    ffn_default: int = 0  # ffn = ffn_default x hidden when the key holds None (GPT-2's n_inner)
    positions_key: str | None = None  # learned absolute position embeddings; None for RoPE
    attn_dropout_key: str | None = "attention_dropout"
    hidden_dropout_key: str | None = None  # residual dropout, when the family has one
    topk_key: str | None = None  # mixture of experts: experts per token
    act_key: str = "hidden_act"  # the activation function
    # mixture of experts: the expert count, under the first of these keys the config has
    experts_keys: tuple[str, ...] = ("num_local_experts", "num_experts", "n_routed_experts")
    qk_norm: bool = False  # an RMSNorm on each query and key head (Qwen3: megatron's qk_layernorm)
    #: no adapter: what a megatron-core adapter of the family would need (the refusal names it)
    megatron_missing: str = "an adapter (declarative weight rules) in tessera.models.megatron"
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
    def generic(self) -> bool:
        return not self.formula

    @property
    def tiny_config(self) -> str:
        """The tiny CPU model config, relative to the repository root."""
        return f"configs/models/tiny-{self.name}.yaml"

    @property
    def tiny_recipe(self) -> str:
        """The tiny CPU recipe (deepspeed engine, 2 ranks), relative to the repository root."""
        return f"recipes/tiny-{self.name}-cpu.yaml"

    def experts(self, hf_cfg: Any) -> int:
        """The config's expert count (0: a dense model)."""
        for key in self.experts_keys:
            if getattr(hf_cfg, key, None):
                return int(getattr(hf_cfg, key))
        return 0

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
            qk_norm=self.qk_norm,
        )


# What a megatron-core adapter of these families would need (the refusal names it: adapter_for)
GEMMA3_MISSING = (
    "zero-centred RMSNorm weights (1 + w), sandwich norms after attention and MLP, scaled embeddings, "
    "alternating local / global attention with two RoPE bases and tanh-GeLU"
)
PHI3_MISSING = "fused qkv_proj / gate_up_proj weight rules and longrope / su RoPE scaling"
OLMO2_MISSING = "norms after attention and MLP (no pre-norm) and q/k RMSNorm over all heads at once"

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
        # Qwen3: an RMSNorm on every query and key head (megatron's qk_layernorm), head_dim given apart
        Family(name="qwen3", model_types=("qwen3",), adapter="qwen3", qk_norm=True),
        # Qwen3-MoE: every layer a mixture of experts of moe_intermediate_size, softmax top-k, no shared one
        Family(
            name="qwen3-moe",
            model_types=("qwen3_moe",),
            adapter="qwen3-moe",
            qk_norm=True,
            ffn_key="moe_intermediate_size",
            topk_key="num_experts_per_tok",
        ),
        # 2025-26 families the deepspeed and ddp engines train as HF modules, counted on the meta device;
        # each entry is its tiny config + recipe, tested against the single-process HF model
        # (tests/dist/test_families.py); megatron_missing: what an adapter would need
        *(
            Family(
                name=name,
                model_types=(mt,),
                adapter=None,
                formula=False,
                topk_key="num_experts_per_tok",
                megatron_missing=missing,
            )
            for name, mt, missing in (
                ("gemma3", "gemma3_text", GEMMA3_MISSING),
                ("phi3", "phi3", PHI3_MISSING),
                ("olmo2", "olmo2", OLMO2_MISSING),
            )
        ),
        # DeepSeek-V3: a megatron adapter (multi-latent attention, dense then MoE layers, sigmoid grouped
        # router with its correction bias, shared expert); no formula: counted on the meta device
        Family(
            name="deepseek-v3",
            model_types=("deepseek_v3",),
            adapter="deepseek-v3",
            formula=False,
            ffn_key="moe_intermediate_size",
            topk_key="num_experts_per_tok",
        ),
    )
}
FAMILY_NAMES: tuple[str, ...] = tuple(FAMILIES)
#: the families megatron-core builds (an adapter in tessera.models.megatron)
MEGATRON_FAMILIES: tuple[str, ...] = tuple(n for n, f in FAMILIES.items() if f.adapter is not None)
#: the families the planner's formulas describe exactly (the others are counted on the meta device)
FORMULA_FAMILIES: tuple[str, ...] = tuple(n for n, f in FAMILIES.items() if f.formula)
MODEL_TYPES: tuple[str, ...] = tuple(t for fam in FAMILIES.values() for t in fam.model_types)


#: the planner estimates that a family without an entry takes from a generic formula (the parameter and
#: tensor counts come from its model built on the meta device, exact)
GENERIC_ESTIMATES: tuple[str, ...] = (
    "activation memory (Korthikanti et al.'s dense-transformer formula from the config's sizes)",
    "compute time (6 x parameters x tokens; attention from the config's sizes)",
)


def family_of(model_type: str) -> Family:
    """The family covering HF ``model_type``: its entry, or a generic family (no megatron adapter) for any
    other causal LM transformers can build; a RecipeError naming the supported types otherwise."""
    for fam in FAMILIES.values():
        if model_type in fam.model_types:
            return fam
    if model_type in causal_lm_types():
        return _generic(model_type)
    raise RecipeError(
        "transformers has no causal LM of this model_type",
        field="model.hf_config.model_type",
        value=model_type,
        fix="use a model_type AutoModelForCausalLM builds (e.g. " + ", ".join(sorted(MODEL_TYPES)) + ")",
    )


@functools.cache
def causal_lm_types() -> frozenset[str]:
    """The ``model_type`` values transformers' ``AutoModelForCausalLM`` builds (read from its table)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@functools.cache
def _generic(model_type: str) -> Family:
    # every MoE config in transformers names its experts per token so; the expert count has three names
    return Family(name=model_type, model_types=(model_type,), adapter=None, formula=False,
                  topk_key="num_experts_per_tok")  # fmt: skip
