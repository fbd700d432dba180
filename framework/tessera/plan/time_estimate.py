"""The planner's time side: FLOPs per token, the pipeline bubble, link bandwidths, step time and MFU.

Built on the memory and communication estimates (:mod:`tessera.plan.estimate`,
:mod:`tessera.plan.comm_estimate`) and a :class:`~tessera.plan.hardware.HardwareProfile`; every formula is
written into the result.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from tessera.plan.comm_estimate import CommOp, comm_per_step
from tessera.plan.estimate import (
    BYTES,
    ModelFacts,
    expert_dp,
    hf_tensor_numels,
    largest_shard,
    layer_params,
)
from tessera.plan.hardware import HardwareProfile
from tessera.plan.layout import ParallelLayout

#: Adam step memory traffic per updated parameter: read fp32 param, m, v (12) + grad, write param, m, v
#: (12) and the compute-dtype copy; 28 bytes for bf16 (14 read + 14 written) and for fp32 (16 + 12)
ADAM_BYTES_PER_PARAM = 28
#: the fraction of peak FLOP/s the matmuls reach when the profile has no calibrated figure
DEFAULT_EFFICIENCY = 0.5


def matmul_params(f: ModelFacts, *, active: bool = True) -> int:
    """N of the FLOP formula: the non-embedding parameters (nanoGPT's convention): the input embedding
    and learned positions are lookups, the LM head is a matmul even when tied. ``active``: MoE counts
    topk / E of the expert weights (what one token runs through), not all of them."""
    layer = layer_params(f)
    experts = layer["expert"] * (f.topk / f.num_experts if (active and f.moe) else 1)
    per_layer = layer["tp"] + layer["repl"] + experts
    return int(
        f.num_layers * per_layer + f.hidden * (2 if f.norm == "LayerNorm" else 1) + f.vocab_size * f.hidden
    )


FLOPS_FORMULA = (
    "6*N_active + 12*L*H*Q*T (PaLM, Chowdhery et al. 2022, App. B; N without input embeddings); "
    "under adapters 4*N_active + 6*N_adapters + 12*L*H*Q*T (no weight gradients of the frozen base)"
)


def flops_per_token(f: ModelFacts, seq_len: int) -> float:
    """Model FLOPs per trained token, forward + backward: 6N + 12·L·H·Q·T (PaLM App. B). The attention
    term counts QK^T and AV over the full sequence T (the usual MFU convention; causal kernels do half)."""
    attn = 12 * f.num_layers * f.num_heads * f.head_dim * seq_len
    if f.adapters:  # a frozen base: forward 2N and input gradients 2N, no weight gradients; adapters 6N_a
        return 4 * matmul_params(f) + 6 * sum(f.adapters) + attn
    return 6 * matmul_params(f) + attn


def recompute_flops_per_token(f: ModelFacts, seq_len: int, recompute: str) -> float:
    """Extra hardware FLOPs of recomputation: full = one more forward of the layers (2·N_layers +
    4·L·H·Q·T); selective = the core attention forward again (4·L·H·Q·T)."""
    attn = 4 * f.num_layers * f.num_heads * f.head_dim * seq_len
    if recompute == "full":
        return 2 * (matmul_params(f) - f.vocab_size * f.hidden) + attn
    return attn if recompute == "selective" else 0.0


def bubble_fraction(pp: int, vpp: int, num_microbatches: int) -> float:
    """Share of a pipelined step spent idle: (p-1)/(v·m + p-1). Narayanan et al. 2021 give the bubble
    relative to the ideal time, (p-1)/m (1F1B) and (p-1)/(v·m) (interleaved); this is the same bubble
    as a fraction of the whole step, bubble / (ideal + bubble). 0 without pipelining."""
    if pp <= 1:
        return 0.0
    return (pp - 1) / (vpp * num_microbatches + pp - 1)


def link_bandwidth(hw: HardwareProfile, span: int) -> float:
    """A group inside one node runs on the intra-node link (NVLink); one spanning nodes on the NIC."""
    return hw.intra_node_bandwidth if span <= hw.devices_per_node else hw.inter_node_bandwidth


def op_seconds(o: CommOp, hw: HardwareProfile) -> float:
    """α + n·β per message: the profile's latency per message sent (``calls`` x ``messages``: DDP's and
    DeepSpeed's buckets; a TP / EP collective may have its own α), plus the wire bytes over the group's
    link bandwidth."""
    return o.wire_bytes / link_bandwidth(hw, o.span) + hw.latency_for(o.group) * o.calls * o.messages


def grad_hook_passes(layout: ParallelLayout) -> int:
    """Micro-batches of a step whose gradients DeepSpeed's backward hooks reduce besides the last one's:
    ZeRO 2-3 reduce (and partition) every micro-batch's gradients, ZeRO 0-1 and the other sharding
    implementations only the last one's (which every layout pays, in its efficiency)."""
    return layout.grad_accum - 1 if layout.uses_deepspeed and layout.zero >= 2 else 0


def grad_hook_seconds(
    f: ModelFacts, layout: ParallelLayout, *, precision: str, hardware: HardwareProfile
) -> float:
    """DeepSpeed ZeRO 2-3's gradient hooks on the micro-batches before the last (:func:`grad_hook_passes`):
    per parameter tensor the profile's ``grad_hook_s``, plus each gradient copied into a reduction
    bucket and its partition out of it (2 x the rank's gradient bytes at ``hbm_bandwidth``)."""
    passes = grad_hook_passes(layout)
    if not passes:
        return 0.0
    n_tensors = len(hf_tensor_numels(f))  # a megatron module under DeepSpeed: as many, each a TP shard
    grad_bytes = BYTES[precision] * (sum(f.adapters) or largest_shard(f, layout).total)
    per_pass = n_tensors * (hardware.grad_hook_s or 0.0) + 2 * grad_bytes / hardware.hbm_bandwidth
    return passes * per_pass


#: the fp32 gradient partition DeepSpeed copies to the host once per step, at the accumulation boundary
#: (ZeRO-3 ``_offload_grad_partition_at_boundary``, ZeRO 1-2 ``copy_grads_in_partition``): 4 bytes a parameter
OFFLOAD_GRAD_BYTES = 4


@dataclass(frozen=True)
class OffloadSeconds:
    """Host-link and host-CPU seconds of DeepSpeed's CPU offload for one rank's partition (0 without it).

    Optimizer offload (ZeRO-Offload, Ren et al. 2021): per step the fp32 gradient partition goes down
    (``grads_down``, issued from the last backward's hooks), the CPU Adam step updates the fp32 master and
    m, v in host memory (``cpu_adam``: 28 bytes a parameter at the rank's share of the node's host-memory
    bandwidth, a lower bound: DeepSpeed's AVX CPUAdam is memory-bound at best), and the updated parameters
    come back up in the compute dtype (``params_up``). Parameter offload (ZeRO-Infinity, Rajbhandari et al.
    2021): the partition lives on the host, and every forward and every backward copies it up before
    gathering it (``params_per_pass``, once per pass per micro-batch)."""

    grads_down: float = 0.0
    cpu_adam: float = 0.0
    params_up: float = 0.0
    params_per_pass: float = 0.0

    def total_link(self, micro_batches: int) -> float:
        return self.grads_down + self.params_up + 2 * micro_batches * self.params_per_pass


def offload_seconds(
    layout: ParallelLayout, shard: int, *, precision: str, hardware: HardwareProfile
) -> OffloadSeconds:
    """:class:`OffloadSeconds` of ``shard`` parameters (the rank's ZeRO partition) over the profile's
    ``host_link_bandwidth`` (per device, per direction) and ``host_memory_bandwidth`` (per node, shared by
    the node's ranks). Nothing where the profile cannot offload (a CPU device: host and device memory are
    the same, DeepSpeed's copies stay in place)."""
    L, hw, e = layout, hardware, BYTES[precision]
    if not hw.can_offload or not (L.offload_optimizer or L.offload_params):
        return OffloadSeconds()
    link = hw.host_link_bandwidth
    assert link is not None and hw.host_memory_bandwidth is not None  # can_offload
    out = OffloadSeconds()
    if L.offload_optimizer:
        ranks_per_node = min(L.world_size, hw.devices_per_node)
        out = OffloadSeconds(
            grads_down=OFFLOAD_GRAD_BYTES * shard / link,
            cpu_adam=shard * ADAM_BYTES_PER_PARAM / (hw.host_memory_bandwidth / ranks_per_node),
            params_up=e * shard / link,
        )
    if L.offload_params:
        out = OffloadSeconds(
            grads_down=out.grads_down,
            cpu_adam=out.cpu_adam,
            params_up=out.params_up,
            params_per_pass=e * shard / link,
        )
    return out


@dataclass(frozen=True)
class TimeEstimate:
    """Seconds of one optimizer step on the busiest rank and the model FLOPs utilisation."""

    step_s: float
    compute_s: float
    bubble_s: float
    tp_ep_s: float
    pp_s: float
    dp_exposed_s: float
    optimizer_s: float
    grad_hooks_s: float
    model_flops_per_step: float
    mfu: float
    #: of ``compute_s``, the recomputed forward work (full: the layers' forward again; selective: the
    #: attention core's)
    recompute_s: float = 0.0
    #: seconds on the host link per step with offload (hidden or not; what is exposed is in
    #: ``optimizer_s`` and ``dp_exposed_s``)
    host_link_s: float = 0.0

    def to_json(self) -> dict[str, float]:
        return asdict(self)


def step_time(
    f: ModelFacts,
    layout: ParallelLayout,
    *,
    seq_len: int,
    precision: str,
    recompute: str,
    hardware: HardwareProfile,
    efficiency: float = DEFAULT_EFFICIENCY,
    ops: list[CommOp] | None = None,
) -> TimeEstimate:
    """Step time = (compute + TP/EP collectives) / (1 - bubble) + PP sends + exposed DP collectives +
    optimizer step + DeepSpeed ZeRO 2-3's gradient hooks on the micro-batches before the last
    (:func:`grad_hook_seconds`). Compute = (model + recompute FLOPs) x tokens / world / (peak x efficiency). Each
    collective takes wire bytes / link bandwidth + latency per call. TP and EP collectives sit on the
    critical path; DP ones hide behind the compute they overlap with (DeepSpeed / megatron bucket the
    grad reduction into the backward and prefetch ZeRO-3 gathers; torch DDP's buckets are timed like
    ZeRO-0's all-reduce, over the last backward), only what exceeds it is exposed; on a profile without
    ``comm_overlap`` (CPU: gloo and the backward share the cores) all of it is. The profile's calibrated
    efficiency of the layout's engine replaces the default one.
    The optimizer reads and writes 28 bytes per parameter of its shard at device-memory bandwidth; with
    offload (:func:`offload_seconds`) the CPU Adam step and the parameters' copy back up are exposed, the
    gradients' copy down hides behind the last backward like a DP collective, and parameter offload's
    copies up share each micro-batch's forward and backward window with the ZeRO-3 gathers.
    Recompute adds its forward FLOPs (:func:`recompute_flops_per_token`) to the compute.
    MFU = model FLOPs per step / (step time x peak x world), PaLM's definition (no recompute FLOPs)."""
    L, hw, m = layout, hardware, layout.grad_accum
    ops = comm_per_step(f, L, seq_len=seq_len, precision=precision) if ops is None else ops
    tokens = L.global_batch * seq_len
    model_flops = flops_per_token(f, seq_len) * tokens
    hw_flops = (flops_per_token(f, seq_len) + recompute_flops_per_token(f, seq_len, recompute)) * tokens
    peak = hw.peak_for(precision)
    compute = hw_flops / L.world_size / (peak * (hw.efficiency_for(L.engine) or efficiency))

    def secs(o: CommOp) -> float:
        return op_seconds(o, hw)

    # TP, EP and Ulysses' all-to-alls sit on the critical path; the data-parallel ops overlap
    tp_ep = sum(secs(o) for o in ops if o.group in ("tp", "ep", "sp") and not o.data_parallel)
    pp_s = sum(secs(o) for o in ops if o.group in ("pp", "embd"))
    mb = compute / m  # one micro-batch: forward 1/3, backward 2/3 of its compute
    windows = {"fwd": mb / 3, "bwd": 2 * mb / 3}
    per_mb: dict[str, float] = {"fwd": 0.0, "bwd": 0.0}
    exposed = 0.0
    last_bwd = 0.0
    for o in ops:
        if not o.data_parallel:
            continue
        if not hw.comm_overlap:  # nothing runs beside the backward: every second counts
            exposed += secs(o)
        elif o.overlap in per_mb:
            per_mb[o.overlap] += secs(o) / o.calls  # the same op once per micro-batch
        elif o.overlap == "last_bwd":
            last_bwd += secs(o)
        else:
            exposed += secs(o)
    rp = largest_shard(f, L)
    dense, expert = (rp.total, 0) if L.caps.hf_module else (rp.dense, rp.expert)
    if f.adapters:  # the optimizer and its offload see only what trains
        dense, expert = sum(f.adapters), 0
    if L.zero == 0:
        shard = dense + expert
    else:
        shard = math.ceil(dense / L.data_ranks) + (math.ceil(expert / expert_dp(L)) if expert else 0)
    off = offload_seconds(L, shard, precision=precision, hardware=hw)
    per_mb["fwd"] += off.params_per_pass
    per_mb["bwd"] += off.params_per_pass
    if hw.comm_overlap:
        last_bwd += off.grads_down
    exposed += m * sum(max(0.0, per_mb[k] - windows[k]) for k in per_mb) + max(0.0, last_bwd - windows["bwd"])
    if L.offload_optimizer and hw.can_offload:
        optimizer = off.cpu_adam + off.params_up + (0.0 if hw.comm_overlap else off.grads_down)
    else:
        optimizer = shard * ADAM_BYTES_PER_PARAM / hw.hbm_bandwidth
    recompute_s = compute * recompute_flops_per_token(f, seq_len, recompute) / (hw_flops / tokens)
    bubble = bubble_fraction(L.pp, L.vpp, m)
    pipelined = (compute + tp_ep) / (1 - bubble)
    hooks = grad_hook_seconds(f, L, precision=precision, hardware=hw)
    step = pipelined + pp_s + exposed + optimizer + hooks
    return TimeEstimate(
        step_s=step,
        compute_s=compute,
        bubble_s=max(0.0, pipelined - compute - tp_ep),
        tp_ep_s=tp_ep,
        pp_s=pp_s,
        dp_exposed_s=exposed,
        optimizer_s=optimizer,
        grad_hooks_s=hooks,
        model_flops_per_step=model_flops,
        mfu=model_flops / (step * peak * L.world_size),
        recompute_s=recompute_s,
        host_link_s=off.total_link(m),
    )
