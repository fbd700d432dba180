"""The planner's activation side: what one micro-batch keeps for its backward, per layer and on the last
stage, as each engine's kernels keep it, and how many micro-batches a pipeline rank holds at its peak.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Sec. 4 for
fused kernels (:data:`PAPER`); :func:`kernels_for` says where each engine keeps more, every term found
by measuring with saved-tensor hooks (``tessera.engines.held.SavedActivations``). Used by
:func:`tessera.plan.estimate.memory_per_rank`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tessera.models.megatron import padded_vocab
from tessera.plan.facts import ModelFacts

#: bytes per element of each precision
BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class Kernels:
    """What an engine's kernels keep for backward where they differ from the paper's fused ones.

    The defaults are Korthikanti et al.'s accounting. :func:`kernels_for` gives what each engine really
    runs, as measured with saved-tensor hooks (``tessera.engines.held.SavedActivations``) on the tiny
    models of every family."""

    #: a python RMSNorm (HF's; torch's outside CUDA): keeps its input upcast to fp32 and the normalized
    #: value besides its output, instead of the input alone
    composite_rmsnorm: bool = False
    #: flash / SDPA: the fp32 softmax statistics instead of the s x s scores
    fused_attention: bool = False
    #: unfused attention expands K and V to every query head (GQA) before the matmuls, and keeps them so
    repeated_kv: bool = False
    #: s·b·f tensors the dense MLP keeps, its down-projection input included (None: 4 SwiGLU, 2 GeLU)
    mlp: int | None = None
    #: the same per routed copy of a token in an expert (None: as the dense MLP)
    expert_mlp: int | None = None
    #: the expert outputs are kept for the routing-weight product (HF's Mixtral block)
    expert_outputs: bool = False
    #: full recompute keeps the s x s additive attention mask, which the layer gets as a positional
    #: argument, once per micro-batch (HF's GPT-2 blocks: e·b·s²)
    checkpoint_keeps_mask: bool = False


def kernels_for(
    f: ModelFacts, *, hf_module: bool, device: str, attn_implementation: str = "eager"
) -> Kernels:
    """The kernels an engine runs. The HF module (deepspeed, ddp): python RMSNorm; SiLU and SwiGLU's
    product keep gate, up, silu(gate) and the down-projection input; GPT-2's "gelu_new" is python too
    (x, tanh, 0.5x and 1 + tanh besides the down-projection input); Mixtral keeps each expert's input and
    output; HF's GPT-2 blocks take the attention mask positionally, so their recompute checkpoints keep
    it. megatron-core's local spec: torch.nn.RMSNorm (one fused kernel on CUDA), unfused attention;
    its unfused SwiGLU computes silu(gate) * (up + glu_linear_offset), one more s·b·f copy; an expert also
    scales by the routing probability inside the MLP (one more)."""
    unfused = not (hf_module and attn_implementation == "sdpa")
    if hf_module:
        gelu = 5 if f.activation == "gelu_new" else 2
        mlp = 4 if f.gated_mlp else gelu
        return Kernels(
            composite_rmsnorm=True,
            fused_attention=not unfused,
            repeated_kv=unfused,
            mlp=mlp,
            expert_mlp=mlp,
            expert_outputs=True,
            checkpoint_keeps_mask=unfused and f.family == "gpt2",
        )
    mlp = 5 if f.gated_mlp else 2
    return Kernels(composite_rmsnorm=device != "cuda", repeated_kv=True, mlp=mlp, expert_mlp=mlp + 1)


#: Korthikanti et al.'s fused kernels
PAPER = Kernels()


def _norm_input_bytes(f: ModelFacts, k: Kernels, e: int, sbh: int) -> int:
    """What one norm keeps of its input (and, composite, of the normalized value)."""
    return (4 + e) * sbh if k.composite_rmsnorm and f.norm == "RMSNorm" else e * sbh


@dataclass(frozen=True)
class ActivationShape:
    """What the activation bytes of one micro-batch depend on besides the model: its sequence length and
    size, the tensor-parallel split, the activation dtype and the engine's kernels."""

    seq_len: int
    micro_batch: int
    tp: int = 1
    sequence_parallel: bool = False
    precision: str = "bf16"
    kernels: Kernels = PAPER
    #: Ulysses: each rank holds seq_len / sp positions outside attention, a/sp heads of all inside
    sp: int = 1
    #: DeepSpeed's TiledMLP (the MLP keeps its input only) / the loss over tiles (no logits kept)
    tiled_mlp: bool = False
    tiled_loss: bool = False


def activation_bytes_per_layer(f: ModelFacts, recompute: str = "none", **shape: Any) -> int:
    """Bytes one transformer layer keeps for its backward, per rank (Korthikanti et al. 2022, Sec. 4);
    ``shape``: the fields of :class:`ActivationShape`.

    e = bytes per activation (2 bf16/fp16, 4 fp32), masks 1 byte. Outside the TP regions (split by t
    only with sequence parallelism): the two norm inputs 2·e·sbh plus their fp32 statistics (LayerNorm
    mean + rstd 8 bytes, RMSNorm rstd 4 bytes per token), the QKV input e·sbh, the MLP input e·sbh,
    two dropout masks 2sbh when hidden dropout is on; for MoE also the router's fp32 logits 4·sbE and
    the topk dispatched token copies topk·e·sbh. Inside (split by t): Q e·sb(ad), K and V 2e·sb(gd)
    (GQA: g kv heads), the output-projection input e·sb(ad), the MLP intermediates (GeLU: input and
    output 2e·sbf; SwiGLU unfused: gate, up, silu(gate), product 4e·sbf; MoE: times topk), and the
    attention scores: softmax e·as²b (+ dropout mask as²b and output e·as²b with attention dropout), or
    only the fp32 softmax statistics 4·asb with a fused (flash / SDPA) kernel. With GPT-2's shape (f=4h,
    g=a, dropout on, bf16) this is exactly sbh(34 + 5as/h) plus the 16sb of LayerNorm statistics.
    Per-head q / k norms (Qwen3) keep their inputs e·sb(ad + gd) and an fp32 rstd per head and token.
    Selective recompute drops the attention-score term; full recompute keeps the layer input e·sbh only.
    ``kernels``: where the engine's kernels keep more than the paper's (see :class:`Kernels`).
    """
    a = ActivationShape(**shape)
    k = a.kernels
    s, b, h, e, tp = a.seq_len // a.sp, a.micro_batch, f.hidden, BYTES[a.precision], a.tp
    sbh, sb = s * b * h, s * b
    sp_div = tp if a.sequence_parallel else 1
    if recompute == "full":
        return e * sbh // sp_div
    stats = 8 if f.norm == "LayerNorm" else 4
    norms = 2 * _norm_input_bytes(f, k, e, sbh) + 2 * stats * sb
    outside = norms + e * sbh + e * sbh + (2 * sbh if f.hidden_dropout else 0)
    qo, kvo = f.num_heads * f.head_dim, f.num_kv_heads * f.head_dim
    inside = e * sb * qo + 2 * e * sb * (qo if k.repeated_kv else kvo) + e * sb * qo
    if f.qk_norm:  # the per-head q / k norms keep their inputs (as a norm does) and an fp32 rstd per head
        norm_e = (4 + e) if k.composite_rmsnorm else e
        inside += norm_e * sb * (qo + kvo) + 4 * sb * (f.num_heads + f.num_kv_heads)
    dense = k.mlp if k.mlp is not None else (4 if f.gated_mlp else 2)
    mlp = 0 if a.tiled_mlp else dense * e * sb * f.ffn  # tiled: the input (counted outside) only
    if f.moe:
        outside += 4 * sb * f.num_experts + f.topk * e * sbh * (2 if k.expert_outputs else 1)
        mlp = (k.expert_mlp if k.expert_mlp is not None else dense) * e * sb * f.ffn * f.topk
    inside += mlp
    if recompute != "selective":
        heads = f.num_heads
        if k.fused_attention:
            inside += 4 * heads * s * b
        else:
            scores = heads * s * s * b
            inside += e * scores + ((scores + e * scores) if f.attn_dropout else 0)
    if a.sp > 1:
        # Ulysses (measured with saved-tensor hooks): the all-to-all's output into the output projection is
        # a storage of its own (at sp = 1 it is a view of the kernel's output); KV heads fewer than sp are
        # replicated to one per rank over the whole sequence
        inside += e * sb * qo
        if f.num_kv_heads < a.sp:
            inside += 2 * e * b * f.head_dim * (s * a.sp - s * f.num_kv_heads)
    return outside // sp_div + inside // tp


def head_activation_bytes(f: ModelFacts, **shape: Any) -> int:
    """Bytes the last stage keeps for backward after its layers: the final norm (as a layer's norm), the
    LM-head input e·sbh, and the loss's fp32 log-probabilities (softmax) 4·s·b·V/t (none with the tiled
    loss: each tile's are recomputed in backward); ``shape``: the fields of :class:`ActivationShape`
    (under Ulysses s is the rank's slice)."""
    a = ActivationShape(**shape)
    s, b, e, tp = a.seq_len // a.sp, a.micro_batch, BYTES[a.precision], a.tp
    sbh, sb = s * b * f.hidden, s * b
    stats = 8 if f.norm == "LayerNorm" else 4
    outside = _norm_input_bytes(f, a.kernels, e, sbh) + stats * sb + e * sbh
    logprobs = 0 if a.tiled_loss else 4 * sb * (padded_vocab(f.vocab_size, tp) // tp)
    return outside // (tp if a.sequence_parallel else 1) + logprobs


def tiles_of(tokens: int, hidden: int) -> int:
    """Tiles of a sequence of ``tokens`` for the tiled MLP and loss: tiles of ``hidden`` tokens, the rule of
    DeepSpeed's TiledMLP documentation (a tile's MLP intermediate is then ~ffn/hidden x hidden^2 elements).
    Static, from the layout alone: every rank of a ZeRO-3 group must run the same number of tiles."""
    return max(1, math.ceil(tokens / hidden))


def activation_formula(recompute: str, kernels: Kernels = PAPER) -> str:
    """The activation formula as text, for the plan record."""
    k = kernels
    head = " + last stage: final norm + e*s*b*h LM-head input + 4*s*b*V/t fp32 log-probs"
    if recompute == "full":
        return (
            "L_stage * in_flight * e*s*b*h/(t if sp) + one layer's full activations (recomputed one)" + head
        )
    attn = (
        ""
        if recompute == "selective"
        else (" + 4*a*s*b [fused]" if k.fused_attention else " + e*a*s^2*b [+ dropout]")
    )
    norm = "2*(4+e)*s*b*h [python RMSNorm]" if k.composite_rmsnorm else "2*e*s*b*h"
    kv = "2*e*s*b*a*d [K, V repeated]" if k.repeated_kv else "2*e*s*b*g*d"
    c_mlp = "c_mlp" if k.mlp is None else str(k.mlp)
    return (
        f"L_stage * in_flight * [({norm} + 2*e*s*b*h + 2*stats*s*b [+ 2sbh masks])/(t if sp) + "
        f"(2*e*s*b*a*d + {kv} + {c_mlp}*e*s*b*f" + attn + ")/t]" + head + "; "
        "Korthikanti et al. 2022 sbh(34+5as/h) for GPT shapes; in_flight: megatron 1F1B warmup count"
    )


def in_flight_microbatches(pp: int, vpp: int, num_microbatches: int, pp_rank: int = 0) -> float:
    """Micro-batches whose activations a pipeline rank holds at its peak, in units of its full stage.

    1F1B: ``min(pp - rank, m)`` (the warmup forwards plus one). Interleaved: megatron-core's warmup count
    ``(pp - rank - 1)*2 + (v - 1)*pp`` chunks plus one, each 1/v of the stage, capped at m*v; for rank 0
    that is Korthikanti et al.'s factor p*(1 + (p-1)/(p*v)).
    """
    if pp == 1:
        return 1.0
    if vpp == 1:
        return float(min(pp - pp_rank, num_microbatches))
    chunks = min((pp - pp_rank - 1) * 2 + (vpp - 1) * pp + 1, num_microbatches * vpp)
    return chunks / vpp
