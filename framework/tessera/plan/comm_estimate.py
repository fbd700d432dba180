"""Per-rank communication of one layout: every collective a step issues, counted (bytes, calls, group, what
it can overlap with), and the least bytes its math needs; pure functions, like the memory estimates of
:mod:`tessera.plan.estimate` they share the parameter counts with. ``comm/`` counts the same ops and groups
in a run, and the tests compare the two op by op.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from tessera.models.megatron import padded_vocab
from tessera.plan.activations import BYTES
from tessera.plan.estimate import (
    DS_PARAM_GROUPS,
    DS_REDUCE_BUCKET,
    adapter_split_per_rank,
    ddp_bucket_count,
    expert_dp,
    hf_tensor_numels,
    largest_shard,
    persistent_numel,
    persistent_of,
)
from tessera.plan.facts import ModelFacts
from tessera.plan.layout import ParallelLayout

# ---- communication -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CommOp:
    """One kind of collective a rank issues in a step: ``calls`` calls of ``bytes_per_call`` bytes each
    (the full tensor: the all-reduced buffer, the gathered output, the scattered input, the all-to-all
    send buffer, the sent activation). ``span``: consecutive ranks the group covers (decides the link).
    ``overlap``: what it can hide behind - "none", "fwd" / "bwd" (each micro-batch's forward / backward)
    or "last_bwd" (the backward of the step's last micro-batch). ``messages``: how many messages one
    call is issued as (DDP's gradient buckets), recorded with its ``formula`` but not yet timed."""

    op: str
    group: str
    bytes_per_call: int
    calls: int
    group_size: int
    span: int
    overlap: str = "none"
    messages: int = 1
    formula: str = ""
    #: a data-parallel reduction or gather (ZeRO's, DDP's): overlaps the compute as ``overlap`` says; the
    #: others (TP, SP, EP) sit on the critical path
    data_parallel: bool = False

    @property
    def key(self) -> str:
        return f"{self.op}:{self.group}"

    @property
    def payload_bytes(self) -> int:
        return self.bytes_per_call * self.calls

    @property
    def wire_bytes(self) -> float:
        """Bytes each rank sends (bandwidth-optimal ring / pairwise algorithms): all-reduce 2(n-1)/n of
        the buffer, all-gather / reduce-scatter / all-to-all (n-1)/n, point-to-point the whole tensor."""
        return wire_factor(self.op, self.group_size) * self.payload_bytes


def wire_factor(op: str, n: int) -> float:
    """Bytes each of ``n`` ranks sends per byte of the op's buffer (:attr:`CommOp.wire_bytes`); p2p is
    full duplex: the link time is the send's, the matching recv adds none."""
    return {"all_reduce": 2 * (n - 1) / n, "send": 1.0, "recv": 0.0}.get(op, (n - 1) / n)


def pp_sends_per_rank(pp: int, vpp: int, num_microbatches: int) -> int:
    """Point-to-point sends of the busiest pipeline rank per step: each micro-batch crosses every chunk
    boundary once forward (activation) and once backward (gradient). A middle rank sends 2·v·m; with
    pp = 2 each rank has one boundary edge fewer per micro-batch: (2v - 1)·m."""
    if pp == 1:
        return 0
    return (2 * vpp if pp > 2 else 2 * vpp - 1) * num_microbatches


def comm_per_step(
    f: ModelFacts, layout: ParallelLayout, *, seq_len: int, precision: str, backend: str = "nccl"
) -> list[CommOp]:
    """Every collective of one optimizer step on one rank (first pipeline stage / largest shard).

    DP (ZeRO 0: all-reduce of the grads once per step; ZeRO 1: reduce-scatter of the grads + all-gather
    of the updated params once per step, the same 2(N-1)/N·Ψ volume; ZeRO 2: the reduce-scatter every
    micro-batch, DeepSpeed reduces as the backward goes; ZeRO 3: all-gather of the params in every
    forward and backward + reduce-scatter of the grads every micro-batch, 3Ψ at m = 1; torch DDP: one
    all-reduce of the fp32 grads, 4Ψ bytes whatever the precision, once per step in its buckets, the
    other micro-batches run under ``no_sync``). Expert states
    go over the expert-dp group ("edp"). TP: 2 all-reduces forward and 2 backward of b·s·h per layer
    and micro-batch (with SP: all-gather + reduce-scatter pairs, same volume; the embedding / head
    collectives, 1/(4L) more, are left out). PP: activation and gradient sends of b·s·h (/t with SP).
    EP: dispatch + combine all-to-all of b·s·topk·h tokens per MoE layer, forward and backward. Tied
    embeddings across stages: one all-reduce of the embedding grads between first and last stage.
    """
    L, e = layout, BYTES[precision]
    t, dp, pp, m, b = L.tp, L.dp, L.pp, L.grad_accum, L.micro_batch
    ops: list[CommOp] = []
    hf_module = L.caps.hf_module
    rp = largest_shard(f, L)
    # under Ulysses DeepSpeed shards and reduces over every rank (its sequence-data-parallel group), named
    # as the comm accounting names it: by the axes its ranks differ in
    dp_name = "dp" if L.sp == 1 else L.axes_of(range(L.world_size))
    groups = [(dp_name, rp.total if hf_module else rp.dense, L.data_ranks, t * L.data_ranks)]
    if not hf_module and rp.expert:
        groups.append(("edp", rp.expert, expert_dp(L), t * dp))
    dp_ops_from = len(ops)
    for name, psi, n, span in groups:
        if n == 1 or psi == 0:
            continue
        # under adapters only the trained tensors have gradients and updates; ZeRO-3 still gathers the base
        total_psi = psi
        if f.adapters:
            psi = adapter_split_per_rank(f, L)[0 if name == "dp" else 1]
            if psi == 0:
                continue
        # with sp > 1 DeepSpeed reduces the gradients in fp32 (seq_parallel_communication_data_type, and
        # stage 1-2's all-reduce forces it), whatever the compute dtype
        grad_b, param_b = (4 if L.sp > 1 else e) * psi, e * psi
        deepspeed_dp = L.sharding.deepspeed
        if L.sharding.replicas:
            # fp32 gradients (fp32 params under autocast), reduced once per step: no_sync on the others
            grads = [4 * x for x in reversed(f.adapters or hf_tensor_numels(f))]
            buckets = ddp_bucket_count(grads)
            why = (
                f"DDP all_reduce of the fp32 gradients once per step: 4Ψ = {4 * psi:,} bytes, Ψ={psi:,}, in "
                f"{buckets} bucket message(s) (reverse parameter order, first <= 1 MiB, then <= 25 MiB)"
            )
            ops.append(CommOp("all_reduce", name, 4 * psi, 1, n, span, "last_bwd", buckets, why))
        elif L.zero == 0:
            ops.append(CommOp("all_reduce", name, grad_b, 1, n, span, "last_bwd"))
        elif L.zero in (1, 2):
            per_mb = L.zero == 2
            # measured on gloo: DeepSpeed's stage-1/2 gradient reduction is an all-reduce of the buckets
            # (gloo has no reduce-scatter); megatron's distributed optimizer reduce-scatters everywhere
            reduce = "all_reduce" if deepspeed_dp and backend == "gloo" else "reduce_scatter"
            calls = m if per_mb else 1
            # DeepSpeed flattens, reduces and gathers each optimizer parameter group on its own (the HF
            # engines have two: decay / no decay), in buckets of reduce_bucket_size elements
            msgs = DS_PARAM_GROUPS - 1 + math.ceil(psi / DS_REDUCE_BUCKET) if deepspeed_dp else 1
            why = f"{msgs} message(s) per call: {DS_PARAM_GROUPS} parameter groups" if deepspeed_dp else ""
            ops.append(
                CommOp(reduce, name, grad_b, calls, n, span, "bwd" if per_mb else "last_bwd", msgs, why)
            )
            ops.append(CommOp("all_gather", name, param_b, 1, n, span, "none", msgs, why))
        else:
            # persistent (small) tensors are whole on every rank: one all-gather after the update;
            # the others are gathered for every forward and backward
            small = persistent_numel(f) + persistent_of(f.adapters) if hf_module else 0
            big_b = e * max(total_psi + (psi if f.adapters else 0) - small, 0)
            if small:
                ops.append(CommOp("all_gather", name, e * small, 1, n, span, "none"))
            if big_b:
                ops.append(CommOp("all_gather", name, big_b, m, n, span, "fwd"))
                ops.append(CommOp("all_gather", name, big_b, m, n, span, "bwd"))
            ops.append(CommOp("reduce_scatter", name, grad_b, m, n, span, "bwd"))
    ops[dp_ops_from:] = [replace(o, data_parallel=True) for o in ops[dp_ops_from:]]
    if L.sp > 1:
        ops += ulysses_ops(f, L, seq_len=seq_len, e=e)
    layers = f.num_layers // pp
    act = seq_len * b * f.hidden * e
    if t > 1 and f.adapter_sites and not L.caps.hf_module:
        ops += _lora_tp_ops(f, L, seq_len=seq_len, e=e, layers=layers)
    elif t > 1:
        if L.sequence_parallel:
            # per layer: the all-gathers into attention and MLP and the reduce-scatters out of them (2 + 2
            # forward, their transposes backward), and the backward's second all-gather of each
            # column-parallel linear's input (qkv, fc1: megatron keeps only the sequence shard for the
            # weight gradient); the embedding's reduce-scatter (first stage) and the LM head's gather
            # (last stage) with their transposes and the head's re-gather: measured exactly so on TP2
            # (a MoE layer has the attention half only: its experts' collectives run over the expert-TP
            # group, with payloads the routing decides, and are not predicted here); full recompute runs
            # each layer's forward collectives once more
            ag_edge, rs_edge = (3, 2) if pp == 1 else (2, 1)  # both edges, or the last stage's
            halves = 1 if f.moe else 2
            again = 1 if L.recompute == "full" else 0
            ops.append(CommOp("all_gather", "tp", act, ((3 + again) * halves * layers + ag_edge) * m, t, t))
            ops.append(
                CommOp("reduce_scatter", "tp", act, ((2 + again) * halves * layers + rs_edge) * m, t, t)
            )
            if pp == 1:
                ops.append(CommOp("all_reduce", "tp", seq_len * b * 4, 3 * m, t, t))  # the cross-entropy's
        else:
            # 2 per layer forward and 2 backward; the vocab-parallel embedding's forward (first stage),
            # and on the last stage the LM head's input-gradient plus the cross-entropy's 3 fp32 (b, s)
            # reductions (max, target logit, sum of exps): measured exactly so on TP2
            edge = 1 + (1 if pp == 1 else 0)
            ops.append(CommOp("all_reduce", "tp", act, (4 * layers + edge) * m, t, t))
            if pp == 1:
                ops.append(CommOp("all_reduce", "tp", seq_len * b * 4, 3 * m, t, t))
        # once a step, finalize_model_grads sums over TP the gradients of the weights every TP rank holds
        # whole but computes from its own part: the norms under SP (2 per layer, the final one on the
        # last stage; LayerNorm's biases too) and MoE routers, the per-head q/k norms (qk_norm) with or
        # without SP
        per_norm = f.hidden * (2 if f.norm == "LayerNorm" else 1)
        norms = (2 * layers + 1) * per_norm if L.sequence_parallel else 0
        norms += layers * f.num_experts * f.hidden if L.sequence_parallel and f.moe else 0  # the routers
        norms += 2 * layers * f.head_dim if f.qk_norm else 0
        if norms:  # megatron's gradient buffers are fp32 (grad_reduce_in_fp32)
            ops.append(CommOp("all_reduce", "tp", norms * 4, 1, t, t))
    if L.ep > 1 and f.moe:
        tokens = seq_len * b // (t if L.sequence_parallel else 1)
        ops.append(CommOp("all_to_all", "ep", tokens * f.topk * f.hidden * e, 4 * layers * m, L.ep, t * L.ep))
    if pp > 1:
        sends = pp_sends_per_rank(pp, L.vpp, m)
        boundary = act // (t if L.sequence_parallel else 1)  # one activation (or its gradient) per crossing
        ops.append(CommOp("send", "pp", boundary, sends, 2, L.world_size))
        ops.append(CommOp("recv", "pp", boundary, sends, 2, L.world_size))
        if f.tied:
            emb = padded_vocab(f.vocab_size, t) // t * f.hidden * e
            ops.append(CommOp("all_reduce", "embd", emb, 1, 2, L.world_size))
    return ops


def ulysses_ops(f: ModelFacts, L: ParallelLayout, *, seq_len: int, e: int) -> list[CommOp]:
    """DeepSpeed's Ulysses attention per layer and micro-batch (``UlyssesSPAttentionHF``, measured exactly
    so on sp2): forward 4 all-to-alls, each rank's send buffer its slice of q, k, v (into attention) and of
    the output (out of it): q and out e·b·(s/sp)·a·d, k and v e·b·(s/sp)·max(g, sp)·d (KV heads replicated
    up to sp when there are fewer); backward the same 4 again; full recompute runs the forward ones once
    more. Each forward also all-gathers the int64 position ids of the sequence (b·s·8 bytes gathered)."""
    b, m, sp = L.micro_batch, L.grad_accum, L.sp
    local = seq_len // sp
    q = e * b * local * f.num_heads * f.head_dim
    kv = e * b * local * max(f.num_kv_heads, sp) * f.head_dim
    passes = 3 if L.recompute == "full" else 2  # forward, backward (+ the recompute's forward)
    forwards = 2 if L.recompute == "full" else 1
    calls = f.num_layers * m
    why = "Ulysses: q and the attention output, e·b·(s/sp)·a·d each, forward and backward (+ recompute)"
    return [
        CommOp("all_to_all", "sp", q, 2 * passes * calls, sp, sp, formula=why),
        CommOp("all_to_all", "sp", kv, 2 * passes * calls, sp, sp,
               formula="Ulysses: k and v, e·b·(s/sp)·max(g,sp)·d each, forward and backward (+ recompute)"),
        CommOp("all_gather", "sp", b * seq_len * 8, forwards * calls, sp, sp,
               formula="Ulysses: the int64 position ids of the whole sequence, per layer and forward"),
    ]  # fmt: skip


def _lora_tp_ops(f: ModelFacts, L: ParallelLayout, *, seq_len: int, e: int, layers: int) -> list[CommOp]:
    """Every TP collective of a step on megatron with adapters (:mod:`tessera.engines.megatron_adapters`)
    and a frozen base, per micro-batch (measured exactly so on TP2, with and without SP):

    - the base's, forward as without adapters (SP: into and out of attention and MLP, 2 + 2 per layer; no
      SP: 2 all-reduces out of them), backward only where a gradient flows: not into the first layer's
      attention input (the frozen embedding's output needs none), nor into its MLP input without
      adapters in attention; no re-gather for weight gradients (the base has none); the embedding's
      forward, the LM head's forward gather (SP) and its input gradient; the cross-entropy's 3 fp32 (b, s);
    - the adapters': a column-parallel site (qkv, fc1) sums each target's (s, b, r) input gradient of B in
      backward and, under SP, gathers its input once more forward; a row-parallel one (o, down) sums A x
      forward (reduce-scatter + the backward's all-gather under SP);
    - once a step: under SP the row-parallel sites' B gradients, summed over TP by finalize_model_grads
      (the frozen norms have none).

    Full recompute runs every layer's forward collectives once more. A MoE layer counts its attention
    half only (its experts' collectives run over the expert-TP group with routed payloads)."""
    t, m, b, pp = L.tp, L.grad_accum, L.micro_batch, L.pp
    act = seq_len * b * f.hidden * e
    low = seq_len * b * f.adapter_rank * e
    dense = [(name, split, n) for name, split, n in f.adapter_sites if not name.startswith("experts.")]
    col_sites = sum(1 for _, split, _ in dense if split == "col")
    col_targets = sum(n for _, split, n in dense if split == "col")
    rows = sum(n for _, split, n in dense if split == "row")
    attn = any(name in ("linear_qkv", "linear_proj") for name, _, _ in dense)
    halves = 1 if f.moe else 2
    again = 1 if L.recompute == "full" else 0
    first = pp == 1  # the planned stage holds the first layer (pp > 1: the last stage's)
    # backward collectives the first layer skips: its attention input; its MLP input without attention
    pruned = (1 + (0 if attn or f.moe else 1)) if first else 0
    ops: list[CommOp] = []
    if L.sequence_parallel:
        fwd_ag = (halves + col_sites) * layers
        fwd_rs = halves * layers
        bwd_ag = halves * layers - ((0 if attn else 1) if first else 0)  # out of attention, out of the MLP
        bwd_rs = halves * layers - pruned  # into attention and the MLP
        ag = (1 + again) * fwd_ag + bwd_ag + 1  # + the LM head's gather
        rs = (1 + again) * fwd_rs + bwd_rs + (2 if first else 1)  # + the embedding's, the head's input grad
        ops.append(CommOp("all_gather", "tp", act, ag * m, t, t))
        ops.append(CommOp("reduce_scatter", "tp", act, rs * m, t, t))
        if rows:
            ops.append(CommOp("reduce_scatter", "tp", low, (1 + again) * rows * layers * m, t, t,
                              formula="LoRA: A x of each row-parallel target, summed over TP"))  # fmt: skip
            ops.append(CommOp("all_gather", "tp", low, rows * layers * m, t, t))
            ops.append(CommOp("all_reduce", "tp", rows * layers * f.hidden * f.adapter_rank * 4, 1, t, t,
                              formula="LoRA: the row-parallel B gradients under SP, summed over TP"))  # fmt: skip
    else:
        fwd = halves * layers
        bwd = halves * layers - pruned
        edge = 2 if first else 1  # the embedding's forward, the head's input gradient
        ops.append(CommOp("all_reduce", "tp", act, ((1 + again) * fwd + bwd + edge) * m, t, t))
        if rows:
            ops.append(CommOp("all_reduce", "tp", low, (1 + again) * rows * layers * m, t, t,
                              formula="LoRA: A x of each row-parallel target, summed over TP"))  # fmt: skip
    if col_targets:
        ops.append(CommOp("all_reduce", "tp", low, col_targets * layers * m, t, t, "bwd",
                          formula="LoRA: B's input gradient summed over TP, per column-parallel target"))  # fmt: skip
    ops.append(CommOp("all_reduce", "tp", seq_len * b * 4, 3 * m, t, t))  # the cross-entropy's (last stage)
    return ops


def minimum_wire_bytes(
    f: ModelFacts, layout: ParallelLayout, *, seq_len: int, precision: str
) -> tuple[float, str]:
    """The least bytes one rank must send per step for the layout's math, with bandwidth-optimal
    collectives (ring all-reduce 2(n-1)/n, reduce-scatter / all-gather / all-to-all (n-1)/n of the
    buffer): the yardstick the communication benchmark divides the measured bytes by, not a prediction.
    DP: replicated gradients (ZeRO 0, ddp) or a partitioned optimizer (ZeRO 1) need one reduce-scatter +
    all-gather of Ψ per step; partitioned gradients (ZeRO 2) a reduce-scatter per micro-batch; partitioned
    parameters (ZeRO 3) two gathers and a reduce-scatter per micro-batch (DeepSpeed's persistent small
    tensors as under ZeRO 2). TP without SP: 4 all-reduces of b·s·h per layer and micro-batch + the
    vocab-parallel embedding's forward and the LM head's input gradient. EP: dispatch + combine forward
    and backward of the (ep-1)/ep routed tokens. PP: one activation or gradient per micro-batch and
    boundary. Returns (bytes, formula)."""
    L, e = layout, BYTES[precision]
    m, t = L.grad_accum, L.tp
    rp = largest_shard(f, L)
    total, parts = 0.0, []
    dp_groups = [(rp.total if L.caps.hf_module else rp.dense, L.data_ranks, "Ψ")]
    if not L.caps.hf_module and rp.expert:
        dp_groups.append((rp.expert, expert_dp(L), "Ψ_experts"))
    for psi, n, name in dp_groups:
        if n == 1 or psi == 0:
            continue
        zero = 0 if L.sharding.replicas else L.zero
        if zero < 2:
            total += 2 * (n - 1) / n * psi * e
            parts.append(f"2·(n-1)/n·{name}·e")
            continue
        # ZeRO-3 keeps DeepSpeed's persistent (small) tensors whole: those move as under ZeRO-2
        small = 0
        if zero == 3 and L.caps.hf_module:
            small = min(psi, persistent_numel(f))
        total += ((m + 1) * small + (3 * m if zero == 3 else m + 1) * (psi - small)) * (n - 1) / n * e
        parts.append(
            f"(m+1)·(n-1)/n·{name}·e" if zero == 2 else f"[3m·{name}_big + (m+1)·{name}_persistent]·(n-1)/n·e"
        )
    layers = f.num_layers // L.pp
    act = seq_len * L.micro_batch * f.hidden * e
    if t > 1:
        # per layer 2 forward + 2 backward; the vocab-parallel embedding's forward (first stage) and the LM
        # head's input gradient (last stage)
        edge = 1 + (1 if L.pp == 1 else 0)
        total += (4 * layers + edge) * m * 2 * (t - 1) / t * act
        parts.append(f"(4·L/p+{edge})·m·2(t-1)/t·s·b·h·e")
    if L.ep > 1 and f.moe:
        total += 4 * layers * m * f.topk * act * (L.ep - 1) / L.ep
        parts.append("4·L/p·m·k·(ep-1)/ep·s·b·h·e")
    if L.sp > 1:  # Ulysses: q, k, v in and the output out, forward and backward, (sp-1)/sp of each
        a2a = sum(o.payload_bytes for o in ulysses_ops(f, replace(L, recompute="none"), seq_len=seq_len, e=e)
                  if o.op == "all_to_all")  # fmt: skip
        total += a2a * (L.sp - 1) / L.sp
        parts.append("2·L·m·(2·a + 2·max(g,sp))·d·b·(s/sp)·e·(sp-1)/sp")
    if L.pp > 1:
        total += pp_sends_per_rank(L.pp, L.vpp, m) * act / (t if L.sequence_parallel else 1)
        parts.append("sends·s·b·h·e (each chunk boundary once forward, once backward)")
    return total, " + ".join(parts) or "0 (one rank, nothing to send)"


def comm_formulas(ops: list[CommOp]) -> dict[str, str]:
    """The formulas the ops carry (DDP's bucketed all-reduce), keyed ``"comm:op:group"`` for the plan."""
    return {f"comm:{o.key}": o.formula for o in ops if o.formula}


def comm_bytes_by_op(ops: list[CommOp]) -> dict[str, int]:
    """Payload bytes per step keyed ``"op:group"`` (what ``plan.json`` records and ``comm/`` measures)."""
    out: dict[str, int] = {}
    for o in ops:
        out[o.key] = out.get(o.key, 0) + o.payload_bytes
    return out
