"""HF families on megatron-core: config adapters and the declarative HF <-> megatron weight map.

One adapter per family of :mod:`tessera.tables.families`, registered by decorator under the name the
family entry gives (checked at import). An adapter turns the HF config into the model-shape
part of a megatron-core ``TransformerConfig`` plus ``GPTModel`` arguments, refuses what megatron-core's
local (non-TransformerEngine) layer spec cannot express, and lists its weight :class:`Rule` s. The
conversion itself lives in :mod:`tessera.models.weight_map`.

Layouts inside a rule, for tensor-parallel degree tp:
- ``qkv``: megatron's fused QKV interleaves per query group: for each group g, the rows of its
  ``heads/groups`` query heads, then its key head, then its value head. A TP rank owns groups
  ``[r*G/tp, (r+1)*G/tp)``, i.e. a contiguous slice of the interleaved tensor.
- ``gate_up``: the gated MLP's fc1 is ``[gate_r; up_r]`` on rank r (each half split separately), so
  the full tp=1 tensor is ``[gate; up]`` but a TP shard is not a slice of it.
- ``vocab``: embedding / output rows padded with zeros to a multiple of tp (removed on the way back).
- layers: chunk (pp_rank, vp_stage) holds global layers ``vp*L/vpp + pp_rank*L/(pp*vpp)`` onward,
  renumbered from 0; experts: EP rank e holds global experts ``[e*E/ep, (e+1)*E/ep)``, renumbered.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tessera.errors import RecipeError
from tessera.tables.families import FAMILIES, family_of

# split kinds
REPL, COL, ROW, VOCAB = "repl", "col", "row", "vocab"


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's "gelu_new" (tanh approximation)."""
    return F.gelu(x, approximate="tanh")


@dataclass(frozen=True)
class Rule:
    """One megatron tensor and where it comes from in HF.

    ``mcore`` / ``hf`` are key patterns: ``*`` is the layer index, ``#`` the expert index. ``hf`` is a
    tuple when several HF tensors fuse into one (qkv: q, k, v; gate_up: gate, up). ``fuse`` is
    ``None``, ``"qkv"``, ``"gate_up"`` (from two tensors) or ``"gate_up_fused"`` (HF already stores
    ``[gate; up]``). ``hf_expert_dim``: HF keeps all experts in one tensor, indexed on dim 0.
    ``transpose``: HF stores the weight as ``(in, out)`` (GPT-2's Conv1D). ``stage``: where the tensor
    lives in a pipeline: ``"first"``, ``"last"``, ``"layer"`` or ``"output"`` (the LM head: last stage,
    and with tied embeddings only when the last stage is not also the first). ``layers``: a model whose
    first layers are dense and the rest mixtures of experts (DeepSeek-V3) gives each kind its rules.
    """

    mcore: str
    hf: str | tuple[str, ...]
    split: str = REPL
    fuse: str | None = None
    transpose: bool = False
    hf_expert_dim: bool = False
    stage: str = "layer"
    #: which layers have it: "all", "dense" (the first ``ModelShape.dense_layers``) or "moe" (the others)
    layers: str = "all"
    #: a persistent buffer, not a parameter (no optimizer moments: skipped where the HF side has none)
    buffer: bool = False
    #: per-expert blocks packed in one 2-D HF tensor, as peft packs a LoRA of fused experts: "rows" (expert
    #: e is rows [e*k, (e+1)*k)) or "cols" (expert e is every E-th column from e: peft's (out, r, E) order)
    hf_experts: str | None = None


@dataclass(frozen=True)
class Shard:
    """Which part of the model one megatron model chunk holds."""

    tp: int = 1
    tp_rank: int = 0
    pp: int = 1
    pp_rank: int = 0
    vpp: int = 1
    vp_stage: int = 0
    ep: int = 1
    ep_rank: int = 0
    etp: int = 1  # expert tensor parallelism (megatron's default: = tp)
    etp_rank: int = 0

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0 and self.vp_stage == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1 and self.vp_stage == self.vpp - 1


@dataclass(frozen=True)
class ModelShape:
    """What conversion needs to know of the model."""

    num_layers: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    num_experts: int = 0
    tied: bool = False
    normalization: str = "RMSNorm"
    megatron_adapter: bool = True  # False: a family without one (the megatron engine refuses it)
    #: without an adapter: "MODEL_TYPE: it would need ..." (what the refusal names)
    missing_adapter: str = ""
    qk_norm: bool = False  # per-head q/k norms: replicated over TP, their gradients summed over it
    dense_layers: int = 0  # a MoE model's first layers that are dense (DeepSeek-V3's first_k_dense_replace)
    mla: bool = False  # multi-latent attention (DeepSeek-V3)

    @property
    def sequence_parallel_ok(self) -> bool:
        """Whether megatron-core can run the model with sequence parallelism: every family with an adapter
        (its norms: Apex's FusedLayerNorm where installed, else engines.megatron_build's
        SequenceParallelNorm, whose gradients finalize_model_grads all-reduces over TP)."""
        return self.megatron_adapter


def padded_vocab(vocab_size: int, tp: int) -> int:
    return int(math.ceil(vocab_size / tp) * tp)


def layer_range(shape: ModelShape, shard: Shard) -> range:
    """Global layer indices of the chunk (megatron's even split, virtual stages interleaved)."""
    per_chunk = shape.num_layers // (shard.pp * shard.vpp)
    start = shard.vp_stage * (shape.num_layers // shard.vpp) + shard.pp_rank * per_chunk
    return range(start, start + per_chunk)


def expert_range(shape: ModelShape, shard: Shard) -> range:
    per = shape.num_experts // shard.ep
    return range(shard.ep_rank * per, (shard.ep_rank + 1) * per)


# ---- the adapters --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Adapter:
    """HF config -> megatron-core config and weight rules, for one family."""

    family: str
    transformer: Callable[[Any, int], dict[str, Any]]  # (hf_cfg, seq_len) -> TransformerConfig kwargs
    gpt: Callable[[Any], dict[str, Any]]  # hf_cfg -> GPTModel kwargs
    rules: Callable[[Any], list[Rule]]
    shape: Callable[[Any], ModelShape]


ADAPTERS: dict[str, Adapter] = {}


def register_adapter(family: str) -> Callable[[Callable[[], Adapter]], Callable[[], Adapter]]:
    """Decorator on a zero-argument factory returning the family's :class:`Adapter`."""

    def deco(factory: Callable[[], Adapter]) -> Callable[[], Adapter]:
        ADAPTERS[family] = factory()
        return factory

    return deco


def missing_adapter(model_type: str) -> str:
    """What the megatron engine's refusal of a family without an adapter says after "no adapter for"."""
    return f"{model_type}: it would need {family_of(model_type).megatron_missing} (adapters: {', '.join(ADAPTERS)})"


def adapter_for(model_type: str) -> Adapter:
    """The adapter of the family covering HF ``model_type``; a RecipeError for a type without one."""
    fam = family_of(model_type)
    if fam.adapter is None:
        from tessera.tables.engines import engines_with

        raise RecipeError(
            f"megatron-core has no adapter for {missing_adapter(model_type)}",
            field="parallel.engine",
            value="megatron",
            fix=f"use parallel.engine: {engines_with(lambda c: c.hf_module)} (they train the HF module of any "
            "causal LM)",
        )
    return ADAPTERS[fam.adapter]


def _refuse(key: str, value: Any, why: str, fix: str) -> None:
    raise RecipeError(f"megatron-core cannot express this: {why}", field=key, value=value, fix=fix)


def _rope(cfg: Any) -> dict[str, Any]:
    """RoPE theta and scaling from ``rope_parameters`` (transformers v5) or the legacy fields."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    out: dict[str, Any] = {"position_embedding_type": "rope", "rotary_base": int(theta)}
    if float(int(theta)) != float(theta):
        _refuse(
            "model.hf_config.rope_theta", theta, "GPTModel takes an integer rotary base", "use an integer"
        )
    if kind == "llama3":
        # megatron-core applies the Llama-3.x rule with its fixed constants; accept exactly those
        fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        for k, v in fixed.items():
            if float(params.get(k, v)) != v:
                _refuse(
                    f"model.hf_config.rope_scaling.{k}",
                    params.get(k),
                    f"megatron-core fixes {k}={v}",
                    f"set {k}: {v} or use parallel.engine: deepspeed",
                )
        out.update(rope_scaling=True, rope_scaling_factor=float(params.get("factor", 8.0)))
    elif kind != "default":
        _refuse(
            "model.hf_config.rope_scaling.rope_type",
            kind,
            "only default and llama3 RoPE are mapped",
            "use parallel.engine: deepspeed for this RoPE variant",
        )
    return out


def _head_rule(c: Any, embedding: str) -> Rule:
    """The LM head: HF's ``lm_head``, or the input ``embedding`` when the config ties them."""
    return Rule("output_layer.weight", embedding if c.tie_word_embeddings else "lm_head.weight", VOCAB,
                stage="output")  # fmt: skip


def _outer_rules(c: Any) -> list[Rule]:
    """The rules every RMSNorm decoder shares: embedding, final norm, LM head (tied or not), the two
    per-layer norms."""
    L, A = "decoder.layers.*.", "model.layers.*."
    return [
        Rule("embedding.word_embeddings.weight", "model.embed_tokens.weight", VOCAB, stage="first"),
        Rule("decoder.final_layernorm.weight", "model.norm.weight", stage="last"),
        _head_rule(c, "model.embed_tokens.weight"),
        Rule(L + "input_layernorm.weight", A + "input_layernorm.weight"),
        Rule(L + "pre_mlp_layernorm.weight", A + "post_attention_layernorm.weight"),
    ]


def _mlp_rules(mcore: str, hf: str, layers: str = "all") -> list[Rule]:
    """A SwiGLU MLP: HF's gate / up / down projections under ``hf``, megatron's fc1 ([gate; up]) and fc2
    under ``mcore``."""
    return [
        Rule(
            mcore + "linear_fc1.weight",
            (hf + "gate_proj.weight", hf + "up_proj.weight"),
            COL,
            fuse="gate_up",
            layers=layers,
        ),
        Rule(mcore + "linear_fc2.weight", hf + "down_proj.weight", ROW, layers=layers),
    ]


def _expert_rules(layers: str = "all") -> list[Rule]:
    """The router and the routed experts (HF keeps every expert in one ``[gate; up]`` and one down tensor)."""
    L, M = "decoder.layers.*.", "model.layers.*.mlp."
    E = L + "mlp.experts.local_experts.#."
    return [
        Rule(L + "mlp.router.weight", M + "gate.weight", layers=layers),
        Rule(
            E + "linear_fc1.weight",
            M + "experts.gate_up_proj",
            COL,
            fuse="gate_up_fused",
            hf_expert_dim=True,
            layers=layers,
        ),
        Rule(E + "linear_fc2.weight", M + "experts.down_proj", ROW, hf_expert_dim=True, layers=layers),
    ]


def _llama_like(family: str, *, qkv_bias: bool = False, moe: bool = False, qk_norm: bool = False) -> Adapter:
    """Llama, Qwen2, Mistral, Mixtral, Qwen3, Qwen3-MoE: RMSNorm, SwiGLU, RoPE, GQA; optional qkv bias, MoE
    (softmax top-k renormalised, or not: ``norm_topk_prob``), an RMSNorm per query / key head."""
    fam = FAMILIES[family]

    def shape(c: Any) -> ModelShape:
        heads = c.num_attention_heads
        return ModelShape(
            num_layers=c.num_hidden_layers,
            num_heads=heads,
            num_query_groups=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
            vocab_size=c.vocab_size,
            num_experts=fam.experts(c) if moe else 0,
            tied=bool(c.tie_word_embeddings),
            qk_norm=qk_norm,
        )

    def transformer(c: Any, seq_len: int) -> dict[str, Any]:
        if getattr(c, "hidden_act", "silu") != "silu":
            _refuse(
                "model.hf_config.hidden_act",
                c.hidden_act,
                "the gated MLP is mapped with SiLU only",
                "use hidden_act: silu",
            )
        if getattr(c, "attention_bias", False) and not qkv_bias:
            _refuse(
                "model.hf_config.attention_bias",
                True,
                "o_proj bias is not mapped",
                "set attention_bias: false",
            )
        if getattr(c, "mlp_bias", False):
            _refuse("model.hf_config.mlp_bias", True, "MLP biases are not mapped", "set mlp_bias: false")
        s = shape(c)
        kw: dict[str, Any] = dict(
            num_layers=s.num_layers,
            hidden_size=c.hidden_size,
            ffn_hidden_size=c.intermediate_size,
            num_attention_heads=s.num_heads,
            num_query_groups=s.num_query_groups,
            kv_channels=s.head_dim,
            normalization="RMSNorm",
            layernorm_epsilon=c.rms_norm_eps,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=qkv_bias,
            hidden_dropout=0.0,
            attention_dropout=float(getattr(c, "attention_dropout", 0.0)),
            qk_layernorm=qk_norm,
        )
        window = getattr(c, "sliding_window", None)
        use_window = getattr(c, "use_sliding_window", True)
        if window is not None and use_window and window < seq_len:
            if getattr(c, "max_window_layers", None) not in (None, s.num_layers) and family == "qwen2":
                _refuse(
                    "model.hf_config.max_window_layers",
                    c.max_window_layers,
                    "per-layer windows are not mapped",
                    "set use_sliding_window: false",
                )
            # HF: a query attends the `window` most recent keys, itself included; megatron: (left, right)
            kw["window_size"] = (int(window) - 1, 0)
        if moe:
            every = getattr(c, "decoder_sparse_step", 1)
            if every != 1 or getattr(c, "mlp_only_layers", None):
                _refuse(
                    "model.hf_config.decoder_sparse_step"
                    if every != 1
                    else "model.hf_config.mlp_only_layers",
                    every if every != 1 else c.mlp_only_layers,
                    "dense layers between the MoE layers are not mapped",
                    "set decoder_sparse_step: 1 and mlp_only_layers: [], or use parallel.engine: deepspeed",
                )
            kw.update(
                num_moe_experts=s.num_experts,
                moe_ffn_hidden_size=getattr(c, fam.ffn_key),
                moe_router_topk=c.num_experts_per_tok,
                moe_router_score_function="softmax",
                # renormalised (Mixtral; Qwen3-MoE's norm_topk_prob): top-k on logits then softmax == HF's
                # softmax, top-k, renorm; not renormalised: softmax over all experts, then top-k
                moe_router_pre_softmax=not getattr(c, "norm_topk_prob", True),
                # the load-balancing loss only with model.moe_aux_loss_coeff (engines.megatron_build)
                moe_router_load_balancing_type="none",
                moe_aux_loss_coeff=0.0,
                moe_token_dispatcher_type="alltoall",
                moe_router_dtype="fp32",
                moe_grouped_gemm=False,
            )
        return kw

    def gpt(c: Any) -> dict[str, Any]:
        return {"share_embeddings_and_output_weights": bool(c.tie_word_embeddings), **_rope(c)}

    def rules(c: Any) -> list[Rule]:
        L, A = "decoder.layers.*.", "model.layers.*."
        out = [
            *_outer_rules(c),
            Rule(
                L + "self_attention.linear_qkv.weight",
                tuple(A + f"self_attn.{x}_proj.weight" for x in "qkv"),
                COL,
                fuse="qkv",
            ),
            Rule(L + "self_attention.linear_proj.weight", A + "self_attn.o_proj.weight", ROW),
        ]
        if qk_norm:  # head_dim weights, the same on every TP rank (their gradients summed over TP)
            out += [
                Rule(L + f"self_attention.{x}_layernorm.weight", A + f"self_attn.{x}_norm.weight")
                for x in "qk"
            ]
        if qkv_bias:
            out.append(
                Rule(
                    L + "self_attention.linear_qkv.bias",
                    tuple(A + f"self_attn.{x}_proj.bias" for x in "qkv"),
                    COL,
                    fuse="qkv",
                )
            )
        out += _expert_rules() if moe else _mlp_rules(L + "mlp.", A + "mlp.")
        return out

    return Adapter(family=family, transformer=transformer, gpt=gpt, rules=rules, shape=shape)


@register_adapter("llama")
def _llama() -> Adapter:
    return _llama_like("llama")


@register_adapter("mistral")
def _mistral() -> Adapter:
    return _llama_like("mistral")


@register_adapter("qwen2")
def _qwen2() -> Adapter:
    return _llama_like("qwen2", qkv_bias=True)


@register_adapter("mixtral")
def _mixtral() -> Adapter:
    return _llama_like("mixtral", moe=True)


@register_adapter("qwen3")
def _qwen3() -> Adapter:
    return _llama_like("qwen3", qk_norm=True)


@register_adapter("qwen3-moe")
def _qwen3_moe() -> Adapter:
    return _llama_like("qwen3-moe", moe=True, qk_norm=True)


def _deepseek_rope(c: Any) -> dict[str, Any]:
    """DeepSeek-V3's RoPE on megatron's MLA: plain (``rope_type="rope"``; MLATransformerConfig's own default
    is YaRN x40) or its YaRN, field by field (the same frequencies, cos / sin and softmax scales as HF's)."""
    params = dict(getattr(c, "rope_parameters", None) or {})
    kind = params.get("rope_type", "default")
    theta = float(params.get("rope_theta", getattr(c, "rope_theta", 10000.0)))
    out: dict[str, Any] = {"rotary_base": theta}
    if kind == "default":
        return {
            **out,
            "rope_type": "rope",
            "rotary_scaling_factor": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.0,
        }
    if kind == "yarn":
        return {
            **out,
            "rope_type": "yarn",
            "rotary_scaling_factor": float(params["factor"]),
            "original_max_position_embeddings": int(params["original_max_position_embeddings"]),
            "beta_fast": float(params.get("beta_fast", 32.0)),
            "beta_slow": float(params.get("beta_slow", 1.0)),
            "mscale": float(params.get("mscale", 1.0)),
            "mscale_all_dim": float(params.get("mscale_all_dim", 0.0)),
        }
    _refuse(
        "model.hf_config.rope_scaling.rope_type",
        kind,
        "only default and yarn RoPE are mapped for multi-latent attention",
        "use parallel.engine: deepspeed for this RoPE variant",
    )
    raise AssertionError  # unreachable: _refuse raises


@register_adapter("deepseek-v3")
def _deepseek_v3() -> Adapter:
    """DeepSeek-V3: multi-latent attention (megatron-core's MLASelfAttention, local spec), the first
    ``first_k_dense_replace`` layers dense, then MoE layers with a sigmoid router (grouped top-k, its
    ``e_score_correction_bias`` as megatron's ``expert_bias``, routed scaling) and a shared expert. Every
    weight copies as it is (megatron's MLA de-interleaves the RoPE dims as HF's ``rope_interleave`` does)."""

    def shape(c: Any) -> ModelShape:
        heads = c.num_attention_heads
        return ModelShape(
            num_layers=c.num_hidden_layers,
            num_heads=heads,
            num_query_groups=heads,
            head_dim=c.qk_nope_head_dim + c.qk_rope_head_dim,
            vocab_size=c.vocab_size,
            num_experts=c.n_routed_experts,
            tied=bool(c.tie_word_embeddings),
            dense_layers=min(int(c.first_k_dense_replace), c.num_hidden_layers),
            mla=True,
        )

    def transformer(c: Any, seq_len: int) -> dict[str, Any]:
        def no(key: str, value: Any, why: str, fix: str) -> None:
            _refuse(f"model.hf_config.{key}", value, why, fix + ", or use parallel.engine: deepspeed")

        if getattr(c, "hidden_act", "silu") != "silu":
            no("hidden_act", c.hidden_act, "the gated MLP is mapped with SiLU only", "use silu")
        if getattr(c, "attention_bias", False):
            no("attention_bias", True, "megatron's MLA projections have no bias", "set attention_bias: false")
        if (c.num_key_value_heads or c.num_attention_heads) != c.num_attention_heads:
            no("num_key_value_heads", c.num_key_value_heads, "MLA has one latent, no query groups",
               "set it to num_attention_heads")  # fmt: skip
        if not getattr(c, "rope_interleave", True):
            no("rope_interleave", False, "megatron's MLA always de-interleaves the RoPE dims",
               "set rope_interleave: true (DeepSeek-V3's)")  # fmt: skip
        if float(c.rms_norm_eps) != 1e-6:
            # HF builds q_a_layernorm / kv_a_layernorm with eps 1e-6 whatever rms_norm_eps says; megatron
            # gives them layernorm_epsilon: only 1e-6 gives the same numbers
            no("rms_norm_eps", c.rms_norm_eps, "HF fixes the latent norms' eps at 1e-6", "set 1e-6")
        topk, groups, group_topk = c.num_experts_per_tok, c.n_group or 1, c.topk_group or 1
        if topk > 1 and not c.norm_topk_prob:
            no("norm_topk_prob", False, "megatron renormalises the top-k weights for top-k > 1", "set true")
        if topk == 1 and c.norm_topk_prob:
            no("norm_topk_prob", True, "megatron does not renormalise a single expert's weight", "set false")
        if groups > 1 and topk // group_topk != 2:
            # a group's score: megatron sums its best topk // group_topk experts, HF its best 2
            no("topk_group", c.topk_group, "megatron scores a group by its best num_experts_per_tok / "
               "topk_group experts, HF by its best 2", "keep num_experts_per_tok = 2 x topk_group")  # fmt: skip
        s = shape(c)
        shared = (c.n_shared_experts or 0) * c.moe_intermediate_size
        return dict(
            num_layers=s.num_layers,
            hidden_size=c.hidden_size,
            ffn_hidden_size=c.intermediate_size,  # the dense layers
            num_attention_heads=s.num_heads,
            num_query_groups=s.num_heads,
            multi_latent_attention=True,
            q_lora_rank=c.q_lora_rank,
            kv_lora_rank=c.kv_lora_rank,
            qk_head_dim=c.qk_nope_head_dim,
            qk_pos_emb_head_dim=c.qk_rope_head_dim,
            v_head_dim=c.v_head_dim,
            qk_layernorm=True,  # MLA's q / kv latent norms (IdentityOp without it)
            **_deepseek_rope(c),
            normalization="RMSNorm",
            layernorm_epsilon=c.rms_norm_eps,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            hidden_dropout=0.0,
            attention_dropout=float(getattr(c, "attention_dropout", 0.0)),
            num_moe_experts=s.num_experts,
            moe_layer_freq=[0 if i < s.dense_layers else 1 for i in range(s.num_layers)],
            moe_ffn_hidden_size=c.moe_intermediate_size,
            moe_shared_expert_intermediate_size=shared or None,
            moe_shared_expert_gate=False,
            moe_router_topk=topk,
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_bias_update_rate=0.0,  # HF never moves e_score_correction_bias
            moe_router_num_groups=groups if groups > 1 else None,
            moe_router_group_topk=group_topk if groups > 1 else None,
            moe_router_topk_scaling_factor=float(c.routed_scaling_factor),
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="alltoall",
            moe_router_dtype="fp32",
            moe_grouped_gemm=False,
        )

    def gpt(c: Any) -> dict[str, Any]:
        # MLA builds its own rotary embedding from the config; GPTModel's is unused
        theta = float(_deepseek_rope(c)["rotary_base"])
        return {
            "share_embeddings_and_output_weights": bool(c.tie_word_embeddings),
            "position_embedding_type": "rope",
            "rotary_base": int(theta),
        }

    def rules(c: Any) -> list[Rule]:
        L, A = "decoder.layers.*.", "model.layers.*."
        S, H = L + "self_attention.", A + "self_attn."
        out = [
            *_outer_rules(c),
            # the down projections replicated over TP (engines.megatron_build.layer_spec says why)
            Rule(S + "linear_kv_down_proj.weight", H + "kv_a_proj_with_mqa.weight"),
            Rule(S + "kv_layernorm.weight", H + "kv_a_layernorm.weight"),
            Rule(S + "linear_kv_up_proj.weight", H + "kv_b_proj.weight", COL),
            Rule(S + "linear_proj.weight", H + "o_proj.weight", ROW),
        ]
        if c.q_lora_rank:
            out += [
                Rule(S + "linear_q_down_proj.weight", H + "q_a_proj.weight"),
                Rule(S + "q_layernorm.weight", H + "q_a_layernorm.weight"),
                Rule(S + "linear_q_up_proj.weight", H + "q_b_proj.weight", COL),
            ]
        else:
            out.append(Rule(S + "linear_q_proj.weight", H + "q_proj.weight", COL))
        M = A + "mlp."
        out += [
            *_mlp_rules(L + "mlp.", M, layers="dense"),
            *_expert_rules(layers="moe"),
            Rule(L + "mlp.router.expert_bias", M + "gate.e_score_correction_bias", layers="moe", buffer=True),
        ]
        if c.n_shared_experts:
            out += _mlp_rules(L + "mlp.shared_experts.", M + "shared_experts.", layers="moe")
        return out

    return Adapter(family="deepseek-v3", transformer=transformer, gpt=gpt, rules=rules, shape=shape)


@register_adapter("gpt2")
def _gpt2() -> Adapter:
    """GPT-2: LayerNorm with bias, biases everywhere, GeLU (tanh), learned positions, tied head, Conv1D."""

    def shape(c: Any) -> ModelShape:
        return ModelShape(
            num_layers=c.n_layer,
            num_heads=c.n_head,
            num_query_groups=c.n_head,
            head_dim=c.n_embd // c.n_head,
            vocab_size=c.vocab_size,
            tied=bool(c.tie_word_embeddings),
            normalization="LayerNorm",
        )

    def transformer(c: Any, seq_len: int) -> dict[str, Any]:
        if c.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
            _refuse(
                "model.hf_config.activation_function",
                c.activation_function,
                "GPT-2 is mapped with the tanh GeLU",
                "use activation_function: gelu_new",
            )
        if getattr(c, "scale_attn_by_inverse_layer_idx", False) or getattr(
            c, "reorder_and_upcast_attn", False
        ):
            _refuse(
                "model.hf_config.scale_attn_by_inverse_layer_idx",
                True,
                "per-layer attention scaling",
                "set it to false",
            )
        return dict(
            num_layers=c.n_layer,
            hidden_size=c.n_embd,
            ffn_hidden_size=c.n_inner or 4 * c.n_embd,
            num_attention_heads=c.n_head,
            num_query_groups=c.n_head,
            normalization="LayerNorm",
            layernorm_epsilon=c.layer_norm_epsilon,
            gated_linear_unit=False,
            activation_func=gelu_tanh,
            add_bias_linear=True,
            add_qkv_bias=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            bias_activation_fusion=False,
        )

    def gpt(c: Any) -> dict[str, Any]:
        return {
            "share_embeddings_and_output_weights": bool(c.tie_word_embeddings),
            "position_embedding_type": "learned_absolute",
        }

    def rules(c: Any) -> list[Rule]:
        L, H = "decoder.layers.*.", "transformer.h.*."
        out = [
            Rule("embedding.word_embeddings.weight", "transformer.wte.weight", VOCAB, stage="first"),
            Rule("embedding.position_embeddings.weight", "transformer.wpe.weight", stage="first"),
            Rule("decoder.final_layernorm.weight", "transformer.ln_f.weight", stage="last"),
            Rule("decoder.final_layernorm.bias", "transformer.ln_f.bias", stage="last"),
            _head_rule(c, "transformer.wte.weight"),
        ]
        for ln_m, ln_h in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
            out += [Rule(L + f"{ln_m}.{p}", H + f"{ln_h}.{p}") for p in ("weight", "bias")]
        out += [
            Rule(
                L + "self_attention.linear_qkv.weight",
                H + "attn.c_attn.weight",
                COL,
                fuse="qkv",
                transpose=True,
            ),
            Rule(L + "self_attention.linear_qkv.bias", H + "attn.c_attn.bias", COL, fuse="qkv"),
            Rule(L + "self_attention.linear_proj.weight", H + "attn.c_proj.weight", ROW, transpose=True),
            Rule(L + "self_attention.linear_proj.bias", H + "attn.c_proj.bias"),
            Rule(L + "mlp.linear_fc1.weight", H + "mlp.c_fc.weight", COL, transpose=True),
            Rule(L + "mlp.linear_fc1.bias", H + "mlp.c_fc.bias", COL),
            Rule(L + "mlp.linear_fc2.weight", H + "mlp.c_proj.weight", ROW, transpose=True),
            Rule(L + "mlp.linear_fc2.bias", H + "mlp.c_proj.bias"),
        ]
        return out

    return Adapter(family="gpt2", transformer=transformer, gpt=gpt, rules=rules, shape=shape)


_missing = sorted(
    f"{fam.name} (adapter {fam.adapter!r})"
    for fam in FAMILIES.values()
    if fam.adapter is not None and fam.adapter not in ADAPTERS
)
if _missing:  # the family registry and the adapters must list the same families
    raise RuntimeError("families without a megatron-core adapter: " + ", ".join(_missing))
