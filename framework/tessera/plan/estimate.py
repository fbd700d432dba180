"""Per-rank parameters and memory of one layout: pure functions. Communication is
:mod:`tessera.plan.comm_estimate`; FLOPs, the bubble and step time :mod:`tessera.plan.time_estimate`.

Each estimate is a published formula applied to exact parameter counts, so a number in ``plan.json`` can
be checked by hand and compared with what a run measures (``comm/`` counts the same ops and groups).

Sources:
- model states: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
  Parameter Models", Sec. 3.1 and 5 (mixed-precision Adam: 2Ψ bf16 params + 2Ψ grads + 12Ψ fp32
  master/m/v; stages 1/2/3 shard the optimizer / + grads / + params over N data-parallel ranks).
- activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", Sec. 4 (sbh(34 + 5as/h) bytes per layer; /t with tensor + sequence parallelism; the 5as²b
  attention term goes with selective recompute; 2sbh with full recompute; Sec. 4.2.3 for pipelines).
- FLOPs: Chowdhery et al. 2022, "PaLM", Appendix B: 6N + 12·L·H·Q·T model FLOPs per token (as in
  nanoGPT's ``estimate_mfu``), N = the parameters that enter a matmul (input embedding and learned
  positions excluded, the LM head included even when tied).
- pipeline bubble: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", Sec. 2.2: bubble / ideal time = (p-1)/m for 1F1B and (p-1)/(v·m)
  interleaved; reported here as a fraction of the whole step, (p-1)/(v·m + p-1).

Rank layout follows megatron-core's "tp-cp-ep-dp-pp" order (see ``ParallelLayout.coords``): tp ranks are
adjacent, dp ranks stride tp, pp ranks stride tp·dp; experts are split over ep x etp ranks (the layout's
etp, megatron-core's default = tp), so the expert-data-parallel group has dp·tp/(ep·etp) ranks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tessera.errors import RecipeError
from tessera.models.megatron import padded_vocab
from tessera.plan.activations import (
    BYTES,
    PAPER,
    Kernels,
    activation_bytes_per_layer,
    activation_formula,
    head_activation_bytes,
    in_flight_microbatches,
    tiles_of,
)
from tessera.plan.facts import ModelFacts, layer_numels, meta_shard_numels
from tessera.plan.layout import ParallelLayout

GiB = 2**30
RECOMPUTE = ("none", "selective", "full")
#: DeepSpeed's default ``zero_optimization.reduce_bucket_size`` (elements): its gradient bucket buffer
DS_REDUCE_BUCKET = 500_000_000
#: optimizer parameter groups of the HF engines (``engines.optim.param_groups``: decay, no decay)
DS_PARAM_GROUPS = 2
#: torch DDP's default bucket caps (bytes): ``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`` for the first
#: bucket, ``bucket_cap_mb=25`` MiB for the others
DDP_FIRST_BUCKET_BYTES = 1024 * 1024
DDP_BUCKET_BYTES = 25 * 1024 * 1024


# ---- parameters --------------------------------------------------------------------------------------


def layer_params(f: ModelFacts) -> dict[str, int]:
    """Parameters of one transformer layer by how tensor parallelism treats them:
    ``tp`` (split over tp ranks), ``repl`` (norms, row-parallel biases, router: on every tp rank) and
    ``expert`` (split over ep x expert-tp)."""
    h, qo, kvo = f.hidden, f.num_heads * f.head_dim, f.num_kv_heads * f.head_dim
    qkv = qo + 2 * kvo
    norm = 2 * h * (2 if f.norm == "LayerNorm" else 1)  # two norms per layer
    norm += 2 * f.head_dim if f.qk_norm else 0  # one RMSNorm for the query heads, one for the key heads
    tp = h * qkv + (qkv if f.qkv_bias else 0) + qo * h
    repl = norm + (h if f.proj_bias else 0)
    fc1 = (2 if f.gated_mlp else 1) * f.ffn  # fc1 outputs (column-parallel, its bias split too)
    mlp_split = h * fc1 + f.ffn * h + (fc1 if f.mlp_bias else 0)
    mlp_repl = h if f.mlp_bias else 0  # fc2 bias (row-parallel: added after the all-reduce)
    if f.moe:  # experts are split over ep x expert-tp as a whole; the router is replicated
        expert = f.num_experts * (mlp_split + mlp_repl)
        return {"tp": tp, "repl": repl + f.num_experts * h, "expert": expert}
    return {"tp": tp + mlp_split, "repl": repl + mlp_repl, "expert": 0}


def count_params(f: ModelFacts) -> int:
    """Unique parameters of the whole model, as ``sum(p.numel() for p in model.parameters())`` counts them
    in HF (a tied head is the embedding, counted once); a meta-counted model's own count."""
    if f.generic:
        return sum(n for _, n in f.tensors)
    layer = layer_params(f)
    emb = f.vocab_size * f.hidden
    final_norm = f.hidden * (2 if f.norm == "LayerNorm" else 1)
    head = 0 if f.tied else emb
    return emb + f.positions * f.hidden + f.num_layers * sum(layer.values()) + final_norm + head


@dataclass(frozen=True)
class RankParams:
    """Parameters held by one rank: ``dense`` (sharded by ZeRO over dp) and ``expert`` (over edp)."""

    dense: int
    expert: int
    per_layer: int  # one layer's parameters on this rank (the ZeRO-3 gather working set)
    embedding: int  # this rank's share of the embedding / LM head table (0 if it holds neither)

    @property
    def total(self) -> int:
        return self.dense + self.expert


def rank_params(
    f: ModelFacts,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    first: bool = True,
    last: bool = True,
) -> RankParams:
    """What one rank of a (first / last / middle) pipeline stage holds: dense weights split over tp,
    norms and row-parallel biases replicated, layers split over pp, the vocabulary padded to a multiple
    of tp (megatron-core's ``VocabParallelEmbedding``), the embedding on the first stage, the LM head on
    the last (a tied head is a second copy when pp > 1) and experts split over ep x etp (etp defaults to
    tp, megatron-core's default). A meta-counted family with a megatron adapter is counted through the
    weight map on its meta-device model; one without (no megatron layout) is whole on its rank."""
    if f.generic and f.config_json:
        stage = 0 if first else pp - 1 if last else min(1, pp - 1)
        dense, expert, per_layer, emb = meta_shard_numels(
            f.config_json, tp, pp, stage, ep, tp if etp is None else etp
        )
        return RankParams(dense=dense, expert=expert, per_layer=per_layer, embedding=emb)
    if f.generic:
        return RankParams(
            dense=count_params(f),
            expert=0,
            per_layer=max(layer_numels(f).values(), default=0),
            embedding=f.vocab_size * f.hidden,
        )
    layer = layer_params(f)
    dense_layer = layer["tp"] // tp + layer["repl"]
    expert_layer = layer["expert"] // (ep * (tp if etp is None else etp))
    n = f.num_layers // pp
    vocab_shard = padded_vocab(f.vocab_size, tp) // tp * f.hidden
    emb = (vocab_shard + f.positions * f.hidden) if first else 0
    head = vocab_shard if last and not (f.tied and first) else 0
    final_norm = f.hidden * (2 if f.norm == "LayerNorm" else 1) if last else 0
    return RankParams(
        dense=n * dense_layer + emb + head + final_norm,
        expert=n * expert_layer,
        per_layer=dense_layer + expert_layer,
        embedding=vocab_shard if (first or last) else 0,
    )


def largest_shard(f: ModelFacts, layout: ParallelLayout) -> RankParams:
    """The parameters of the pipeline stage holding the most (first or last; the only one if pp = 1)."""
    L = layout
    ends = [(True, True)] if L.pp == 1 else [(True, False), (False, True)]
    return max(
        (rank_params(f, tp=L.tp, pp=L.pp, ep=L.ep, etp=L.etp, first=a, last=b) for a, b in ends),
        key=lambda r: r.total,
    )


_ZERO_TEXT = {
    2: ("16Ψ", "4Ψ+12Ψ/N", "2Ψ+14Ψ/N", "16Ψ/N"),
    4: ("16Ψ", "8Ψ+8Ψ/N", "4Ψ+12Ψ/N", "16Ψ/N"),
}


def zero_formula(zero: int, precision: str, psi: int, n: int) -> str:
    """The model-state formula of a stage as text, with its Ψ and N (for the plan record)."""
    return f"ZeRO-{zero} {precision} Adam {_ZERO_TEXT[BYTES[precision]][zero]}, Ψ={psi:,}, N={n}"


def model_state_bytes(psi: int, n: int, zero: int, precision: str) -> dict[str, int]:
    """ZeRO model-state bytes for Ψ parameters sharded over n ranks (Rajbhandari et al. 2020, Sec. 5).

    bf16/fp16 mixed-precision Adam: params 2Ψ, grads 2Ψ, optimizer 12Ψ (fp32 master + m + v), so
    16Ψ (ZeRO-0), 4Ψ+12Ψ/N (ZeRO-1), 2Ψ+14Ψ/N (ZeRO-2), 16Ψ/N (ZeRO-3). fp32 Adam: params 4Ψ, grads
    4Ψ, optimizer 8Ψ (m + v): 16Ψ, 8Ψ+8Ψ/N, 4Ψ+12Ψ/N, 16Ψ/N. A shard is ceil(Ψ/N) elements (padded).
    """
    if precision not in BYTES:
        raise RecipeError(
            "unknown precision", field="train.precision", value=precision, fix="use bf16, fp16 or fp32"
        )
    p = BYTES[precision]
    opt = 12 if p == 2 else 8
    shard = math.ceil(psi / n)
    return {
        "params": p * (shard if zero >= 3 else psi),
        "grads": p * (shard if zero >= 2 else psi),
        "optimizer": opt * (shard if zero >= 1 else psi),
    }


def deepspeed_state_bytes(
    psi: int, n: int, zero: int, precision: str, *, persistent: int = 0
) -> dict[str, int]:
    """What DeepSpeed's ZeRO really holds per rank, where it differs from the paper's accounting
    (measured with torch AdamW on gloo, fp32, dp 2; tools/dev/MODEL_STATES.md): stages 1 and 2 share
    one code path, so stage 1 partitions the gradients too; every stage >= 1 keeps an fp32 master
    partition (4Ψ/N) even when the model is fp32; ZeRO-3 keeps the ``persistent`` parameters (tensors
    under ``stage3_param_persistence_threshold``) whole on every rank. ZeRO-0 is the paper's."""
    if zero == 0:
        return model_state_bytes(psi, n, 0, precision)
    p, shard = BYTES[precision], math.ceil(psi / n)
    params = p * psi if zero < 3 else p * shard + p * persistent
    return {"params": params, "grads": p * shard, "optimizer": (4 + 8) * shard}


def ddp_state_bytes(psi: int) -> dict[str, int]:
    """What the ddp engine holds per rank: a full replica whatever the precision, because torch DDP +
    torch AdamW keep the parameters in fp32 (bf16 runs under ``torch.autocast``): params 4Ψ, grads 4Ψ,
    AdamW m + v 8Ψ = 16Ψ, the ZeRO paper's mixed-precision total of a plain data-parallel replica."""
    return {"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi}


DDP_FORMULA = "DDP fp32 replica params 4Ψ + grads 4Ψ + AdamW m,v 8Ψ = 16Ψ (bf16 under autocast too)"


def ddp_bucket_count(
    grad_bytes: Sequence[int], *, first_cap: int = DDP_FIRST_BUCKET_BYTES, cap: int = DDP_BUCKET_BYTES
) -> int:
    """Messages torch DDP all-reduces the gradients in: ``grad_bytes`` per parameter in the order the
    gradients become ready (reverse parameter order), filled into buckets the way DDP's reducer does once
    it has rebuilt them after the first step (``_compute_bucket_assignment_by_size``): a tensor joins the
    open bucket, which closes once it holds ``>=`` its cap; 1 MiB for the first, 25 MiB after (the first
    step, before the rebuild, reduces everything in one bucket)."""
    buckets, size, limit = 0, 0, first_cap
    for b in grad_bytes:
        size += b
        if size >= limit:
            buckets, size, limit = buckets + 1, 0, cap
    return buckets + (1 if size else 0)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank on the device (and on the host, for offload) of the largest pipeline stage."""

    params: int
    grads: int
    optimizer: int
    activations: int
    #: what one micro-batch's forward saves for backward on this stage (one model chunk of it)
    activations_per_micro_batch: int
    buffers: int
    host: int
    stage: str  # "only" (pp = 1), "first" or "last"
    formulas: dict[str, str]
    #: of ``params``, the frozen base's bytes under adapters (0 when every weight trains)
    frozen: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    def to_json(self) -> dict[str, int]:
        out = {k: getattr(self, k) for k in ("params", "grads", "optimizer", "activations", "buffers")}
        return {
            **out,
            "frozen": self.frozen,
            "total": self.total,
            "host": self.host,
            "activations_per_micro_batch": self.activations_per_micro_batch,
        }


def expert_dp(layout: ParallelLayout) -> int:
    """Size of the group that shards expert states: dp*tp / (ep * etp) (dp for the engines without EP,
    whose ep = etp = tp = 1)."""
    L = layout
    return max(1, L.dp * L.tp // (L.ep * L.etp))


def _state_bytes(layout: ParallelLayout, psi: int, precision: str, *, persistent: int = 0) -> dict[str, int]:
    """Model-state bytes of ``psi`` dense parameters by who shards them (``layout.sharding``: full replicas,
    DeepSpeed's ZeRO, or the paper's accounting)."""
    if layout.sharding.replicas:
        return ddp_state_bytes(psi)
    if layout.sharding.deepspeed:
        return deepspeed_state_bytes(psi, layout.data_ranks, layout.zero, precision, persistent=persistent)
    return model_state_bytes(psi, layout.dp, layout.zero, precision)


def _frozen_bytes(layout: ParallelLayout, psi: int, precision: str, *, persistent: int) -> int:
    """What a frozen base of ``psi`` parameters costs a rank: its parameters only (no gradients, no
    optimizer state), fp32 in the ddp engine's replicas, the compute dtype under DeepSpeed, a 1/N
    partition (plus the tensors ZeRO-3 keeps whole) under ZeRO-3."""
    if layout.sharding.replicas:
        return 4 * psi
    p = BYTES[precision]
    if layout.zero >= 3:
        return p * math.ceil(psi / layout.data_ranks) + p * persistent
    return p * psi


def adapter_split_per_rank(f: ModelFacts, layout: ParallelLayout) -> tuple[int, int]:
    """(dense, expert) adapter elements one rank holds: all of them, as dense, on an HF-module engine; on
    megatron's linears a pipeline stage's layers, the TP-split ones (B of column-parallel sites, A of
    row-parallel ones) 1/tp, a routed expert's with its expert (1/ep, its TP split over etp). megatron's
    distributed optimizer shards the dense ones over dp and the expert ones over the expert-dp group."""
    if layout.caps.hf_module:
        return sum(f.adapters), 0
    dense = expert = 0
    experts = f.adapters_ep or (False,) * len(f.adapters)
    for n, split, is_expert in zip(f.adapters, f.adapters_tp, experts, strict=True):
        if is_expert:
            n //= layout.ep
            expert += n // layout.etp if split else n
        else:
            dense += n // layout.tp if split else n
    return dense // layout.pp, expert // layout.pp


def persistent_of(numels: Sequence[int]) -> int:
    return sum(x for x in numels if x < ZERO3_PERSISTENCE_THRESHOLD)


def memory_per_rank(
    f: ModelFacts,
    layout: ParallelLayout,
    *,
    seq_len: int,
    precision: str,
    recompute: str = "none",
    kernels: Kernels = PAPER,
) -> MemoryEstimate:
    """Device bytes per rank of the stage that needs the most: ZeRO model states (dense states over dp,
    expert states over the expert-dp group), activations of the in-flight micro-batches, and buffers
    (the fp32 logits of the loss on the last stage, the ZeRO-3 gathered layers, DeepSpeed's gradient
    bucket, DDP's bucket copy of the gradients). Offload moves the optimizer states (+ the fp32 gradient
    partition) or the parameters to host. An engine that trains the HF module (``hf_module``) has no
    separate expert states: DeepSpeed shards its experts like any other tensor."""
    e = p = BYTES[precision]  # activation and parameter bytes (the compute dtype)
    L, t = layout, layout.tp
    hf_module = L.caps.hf_module
    m = L.grad_accum
    stages = [("only", True, True)] if L.pp == 1 else [("first", True, False), ("last", False, True)]
    shape = dict(
        seq_len=seq_len,
        micro_batch=L.micro_batch,
        tp=t,
        sequence_parallel=L.sequence_parallel,
        precision=precision,
        kernels=kernels,
        sp=L.sp,
        tiled_mlp=L.tiled_mlp,
        tiled_loss=L.tiled_loss,
    )
    per_layer = activation_bytes_per_layer(f, recompute, **shape)
    local = seq_len // L.sp  # the positions a rank holds (Ulysses: its slice of each sequence)
    best: MemoryEstimate | None = None
    for name, first, last in stages:
        rp = rank_params(f, tp=t, pp=L.pp, ep=L.ep, etp=L.etp, first=first, last=last)
        dense, expert = (rp.total, 0) if hf_module else (rp.dense, rp.expert)
        # ZeRO-3 keeps the HF module's small tensors whole (megatron-core's fused tensors are not counted)
        small = persistent_numel(f) if hf_module else 0
        trained = rp.total
        frozen = 0
        if f.adapters:  # a frozen base (parameters only) plus the adapters' full states
            frozen = _frozen_bytes(L, dense + expert, precision, persistent=small)
            # the experts' adapters are the expert states now (the experts themselves: the frozen base)
            trained, expert = adapter_split_per_rank(f, L)
            st = _state_bytes(L, trained, precision, persistent=persistent_of(f.adapters) if hf_module else 0)
            st["params"] += frozen
            trained += expert
        else:
            st = _state_bytes(L, dense, precision, persistent=small)
        if expert:
            for k, v in model_state_bytes(expert, expert_dp(L), L.zero, precision).items():
                st[k] += v
        if f.adapters and not (hf_module or L.sharding.deepspeed or L.sharding.replicas):
            # megatron's DDP keeps the adapters' gradients in fp32 buffers (grad_reduce_in_fp32), whole under
            # its distributed optimizer too (measured: bf16 TP2 and dp2 equal this to the byte)
            st["grads"] = 4 * trained
        host = 0
        if L.offload_optimizer:
            host += st["optimizer"] + 4 * math.ceil(trained / L.data_ranks)  # + the fp32 gradient partition
            st["optimizer"] = 0
        if L.offload_params:
            host += st["params"]
            st["params"] = 0
        rank = 0 if first else L.pp - 1
        layers = f.num_layers // L.pp
        act = int(per_layer * layers * in_flight_microbatches(L.pp, L.vpp, m, rank))
        if recompute == "full":  # the layer being recomputed holds its full activations meanwhile
            act += activation_bytes_per_layer(f, **shape)
        if L.offload_activations and recompute == "full":
            # DeepSpeed's checkpoint offload keeps the last layer's input on the device, the others' on the host
            moved = int(per_layer * max(layers - 1, 0) * in_flight_microbatches(L.pp, L.vpp, m, rank))
            act -= moved
            host += moved
        if L.tiled_mlp:  # the MLP tile being recomputed in backward: its intermediates, one tile's worth
            act += 4 * e * L.micro_batch * math.ceil(local / tiles_of(local, f.hidden)) * f.ffn
        # what one micro-batch's forward saves on this stage, per model chunk (what SavedActivations measures)
        per_micro_batch = per_layer * layers // L.vpp
        if recompute == "full" and kernels.checkpoint_keeps_mask:
            mask = e * L.micro_batch * seq_len * seq_len
            act, per_micro_batch = act + mask, per_micro_batch + mask
        buffers = 0
        if last:
            head = head_activation_bytes(f, **shape)
            act += head
            # the tiled loss keeps the LM head's input on its autograd context, which saved-tensor hooks
            # do not see: held, but not in what SavedActivations measures
            per_micro_batch += head - (e * local * L.micro_batch * f.hidden // t if L.tiled_loss else 0)
            # besides the saved fp32 softmax, the loss holds the logits in e and (e < 4) their fp32 copy;
            # the tiled loss one tile's at a time
            tokens = math.ceil(local / tiles_of(local, f.hidden)) if L.tiled_loss else local
            logits = tokens * L.micro_batch * (padded_vocab(f.vocab_size, t) // t)
            buffers += logits * (e + (4 if e < 4 else 0))
        if L.sharding.replicas:
            states = f"{DDP_FORMULA}, Ψ={trained:,}, whole on each of the {L.dp} ranks"
        else:
            states = zero_formula(L.zero, precision, trained, L.data_ranks) + (
                f"; experts: {zero_formula(L.zero, precision, expert, expert_dp(L))}" if expert else ""
            )
        if f.adapters:
            held = "a 1/N partition" if L.zero >= 3 else "whole"
            states = (
                f"adapters (Ψ = the {len(f.adapters)} trained tensors): {states}; frozen base "
                f"Ψ_base={dense:,} parameters only, {held} on each rank: {frozen:,} B"
            )
        formulas = {"model_states": states, "activations": activation_formula(recompute, kernels)}
        if L.zero >= 3:
            # gathered full (dp-unsharded) params: the largest module in use + the prefetched layer
            buffers += p * (max(rp.per_layer, rp.embedding) + rp.per_layer)
        elif L.sharding.deepspeed and L.data_ranks > 1:
            buffers += p * min(trained, DS_REDUCE_BUCKET)
        elif L.sharding.replicas:
            # DDP's reducer allocates its buckets whatever the world size (for the trained parameters)
            buffers += 4 * trained
            formulas["buffers"] = (
                "DDP reducer's flat fp32 bucket copy of every gradient (gradient_as_bucket_view=False, "
                f"the default): 4Ψ, Ψ={trained:,}"
            )
        est = MemoryEstimate(
            params=st["params"],
            grads=st["grads"],
            optimizer=st["optimizer"],
            activations=act,
            activations_per_micro_batch=per_micro_batch,
            buffers=buffers,
            host=host,
            stage=name,
            formulas=formulas,
            frozen=frozen,
        )
        if best is None or est.total > best.total:
            best = est
    assert best is not None
    return best


#: DeepSpeed ZeRO-3 keeps parameters smaller than this (elements) whole on every rank
#: (``stage3_param_persistence_threshold``, default 1e5): gathered once per step, not per micro-batch
ZERO3_PERSISTENCE_THRESHOLD = 100_000


def hf_tensor_numels(f: ModelFacts) -> list[int]:
    """Element counts of the HF module's parameter tensors (what DeepSpeed partitions tensor by tensor),
    roughly in parameter order (embeddings, then per layer norms, attention, MLP; final norm, head):
    ``fused_qkv`` families (GPT-2's Conv1D) keep q/k/v in one tensor; transformers v5 MoE families keep
    all experts' gate/up and down in one tensor each. A meta-counted model: its own tensors."""
    if f.generic:
        return [n for _, n in f.tensors]
    h, qo, kvo, ffn = f.hidden, f.num_heads * f.head_dim, f.num_kv_heads * f.head_dim, f.ffn
    qkv = qo + 2 * kvo
    norm = [h, h] if f.norm == "LayerNorm" else [h]
    out = [f.vocab_size * h] + ([f.positions * h] if f.positions else [])
    layer: list[int] = norm + norm + ([f.head_dim, f.head_dim] if f.qk_norm else [])
    if f.fused_qkv:
        layer += [h * qkv] + ([qkv] if f.qkv_bias else [])
    else:
        layer += [h * qo, h * kvo, h * kvo] + ([qo, kvo, kvo] if f.qkv_bias else [])
    layer += [qo * h] + ([h] if f.proj_bias else [])
    fc1 = (2 if f.gated_mlp else 1) * ffn  # gate + up (SwiGLU) or the one up projection
    if f.moe:
        layer += [f.num_experts * h, f.num_experts * fc1 * h, f.num_experts * h * ffn]
    else:
        layer += [h * ffn] * (fc1 // ffn) + [ffn * h] + ([ffn] * (fc1 // ffn) + [h] if f.mlp_bias else [])
    out += layer * f.num_layers + norm
    return out + ([] if f.tied else [f.vocab_size * h])


def persistent_numel(f: ModelFacts) -> int:
    """Elements of the HF module's tensors DeepSpeed ZeRO-3 keeps whole on every rank (under
    ``stage3_param_persistence_threshold``)."""
    return sum(x for x in hf_tensor_numels(f) if x < ZERO3_PERSISTENCE_THRESHOLD)
