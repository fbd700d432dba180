"""How the megatron engine builds its model: megatron-core's parallel state from the layout, the
transformer config, the model chunks filled from the HF weights through the declarative weight map, and
the checks that the result is the layout's (TP attributes; DeepSpeed's view of the groups)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from tessera.models.megatron import COL, REPL, ROW, VOCAB, Shard, adapter_for, layer_range, padded_vocab
from tessera.models.weight_map import iter_hf_to_mcore, tp_splits
from tessera.plan.layout import ParallelLayout

#: parallel.recompute -> megatron-core's settings: selective recomputes the attention core (the s^2 scores,
#: softmax, dropout), full recomputes each layer from its input (uniform, one layer per checkpoint)
RECOMPUTE: dict[str, dict[str, Any]] = {
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}

CPU_CONFIG = dict(  # megatron-core's fused CUDA kernels off: the pure-torch paths run anywhere
    # each rank initialises only its local slices (overwritten by build_model_chunks): megatron's CPU
    # initialisation would make every weight whole first ("master weight") and then slice it
    use_cpu_initialization=False,
    gradient_accumulation_fusion=False,
    bias_dropout_fusion=False,
    bias_activation_fusion=False,
    masked_softmax_fusion=False,
    apply_rope_fusion=False,
    persist_layer_norm=False,
    batch_p2p_sync=False,
    batch_p2p_comm=False,
)


class MpuAdapter:
    """The model-parallel unit DeepSpeed asks for (``deepspeed.initialize(mpu=...)``), from megatron's
    groups. megatron-core 0.16.1's ``parallel_state`` lacks ``get_model_parallel_*``, so it cannot be
    passed itself. Deliberately no ``initialize_sequence_parallel``: DeepSpeed would then ignore these
    groups. Model parallel = tensor parallel here (DeepSpeed ZeRO is only composed with pp = 1)."""

    def __init__(self, ps: Any) -> None:
        self._ps = ps

    def get_data_parallel_group(self):
        return self._ps.get_data_parallel_group()

    def get_data_parallel_world_size(self) -> int:
        return self._ps.get_data_parallel_world_size()

    def get_data_parallel_rank(self) -> int:
        return self._ps.get_data_parallel_rank()

    def get_model_parallel_group(self):
        return self._ps.get_tensor_model_parallel_group()

    def get_model_parallel_world_size(self) -> int:
        return self._ps.get_tensor_model_parallel_world_size()

    def get_model_parallel_rank(self) -> int:
        return self._ps.get_tensor_model_parallel_rank()

    def get_tensor_model_parallel_rank(self) -> int:
        return self._ps.get_tensor_model_parallel_rank()


#: the checkpoint ``sharding`` of megatron's own DDP / distributed optimizer: this prefix and which
SHARDING_PREFIX = "megatron-"
#: the checkpoint ``sharding`` of DeepSpeed ZeRO over megatron's modules: this prefix and the stage
DEEPSPEED_SHARDING_PREFIX = "megatron+deepspeed-zero"


def sharding_of(layout: ParallelLayout) -> str:
    """The checkpoint ``sharding`` this engine writes at ``layout``: megatron's own DDP or distributed
    optimizer, or DeepSpeed ZeRO over megatron's modules."""
    if layout.zero_impl == "deepspeed":
        return f"{DEEPSPEED_SHARDING_PREFIX}{layout.zero}"
    return SHARDING_PREFIX + ("distributed-optimizer" if layout.zero == 1 else "ddp")


def chained(optimizer: Any) -> list[Any]:
    """The megatron optimizers inside ``optimizer`` (dense and expert ones are chained under EP)."""
    return getattr(optimizer, "chained_optimizers", [optimizer])


def init_parallel_state(layout: ParallelLayout, *, seed: int, device: str) -> Any:
    """megatron-core's process groups from the layout (rank order tp, then dp, then pp)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if device == "cpu":
        from tessera.engines import cpu_shim

        cpu_shim.apply()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp or None,  # None: megatron's default, = tp
    )
    rank = dist.get_rank()
    coords = layout.coords(rank)
    got = {
        "tp": ps.get_tensor_model_parallel_rank(),
        "pp": ps.get_pipeline_model_parallel_rank(),
        "dp": ps.get_data_parallel_rank(),
    }
    if got != {k: coords[k] for k in got}:  # internal: our rank arithmetic must be megatron's
        raise RuntimeError(f"rank {rank}: megatron-core placed it at {got}, the layout says {coords}")
    if device == "cpu":
        from tessera.engines import cpu_shim

        cpu_shim.seed_model_parallel_rng(
            seed,
            tp_rank=got["tp"],
            ep_rank=ps.get_expert_model_parallel_rank(),
            etp_rank=ps.get_expert_tensor_parallel_rank(),
        )
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return ps


class SequenceParallelNorm:
    """torch's RMSNorm / LayerNorm for megatron-core's local layer spec under sequence parallelism.

    Written here because megatron-core has none: its local spec's torch norm (``WrappedTorchNorm``)
    asserts against ``sequence_parallel``, and the norms that take it are TransformerEngine's and Apex's
    fused CUDA builds (Apex: LayerNorm only). Under SP each TP rank normalises its own slice of the
    sequence, so the norm's weight gradient is a partial sum; its parameters carry megatron's
    ``sequence_parallel`` attribute, which ``finalize_model_grads`` reads to all-reduce them over the TP
    group, exactly as it does for the fused norms. The per-head q/k norms (``qk_layernorm``) take it too:
    each TP rank normalises its own heads, and finalize_model_grads sums those gradients once either way.
    Same arguments as ``WrappedTorchNorm``; the same module and numerics as it without SP."""

    def __new__(
        cls,
        config: Any,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        if config.layernorm_zero_centered_gamma:  # internal: no adapter asks for it
            raise RuntimeError("zero-centred norm weights are not built by SequenceParallelNorm")
        make = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = make(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


def _mla_core_attention() -> Any:
    """megatron-core's local ``DotProductAttention`` for multi-latent attention, which passes it
    TransformerEngine's ``k_channels`` / ``v_channels``: accepted, and the output is v's width (its math
    already takes q / k heads wider than v's). Written here because the local spec has no MLA attention
    of its own; needed on any machine without TransformerEngine."""
    from megatron.core.transformer import multi_latent_attention as mla
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    # without TransformerEngine megatron's TE extension is a mock module, so TELinear is no type while MLA's
    # HAVE_TE is True, and MLA's isinstance(linear_proj, TELinear) fails; nothing else reads the flag
    if not isinstance(getattr(mla, "TELinear", None), type):
        mla.HAVE_TE = False

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, *args: Any, k_channels: Any = None, v_channels: Any = None, **kwargs: Any):
            super().__init__(*args, **kwargs)
            if v_channels is not None:
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return MLADotProductAttention


def layer_spec(config: Any, shape: Any, layers: range) -> Any:
    """megatron-core's local GPT layer spec for the global ``layers`` of a model chunk (experts, q/k norms,
    multi-latent attention, dense layers before the MoE ones); under sequence parallelism with torch's
    norms (no TransformerEngine / Apex), :class:`SequenceParallelNorm` in place of each norm and of the
    final one. One spec for every layer where they are alike, else the block of per-layer specs."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    def one(moe: bool) -> Any:
        spec = get_gpt_layer_local_spec(
            num_experts=shape.num_experts if moe else None,
            normalization=config.normalization,
            qk_layernorm=config.qk_layernorm,
            multi_latent_attention=shape.mla,
        )
        sub = spec.submodules
        if shape.mla:
            attn = sub.self_attention.submodules
            attn.core_attention = _mla_core_attention()
            # the down projections replicated on every TP rank (megatron's plain Linear, the local twin of
            # TransformerEngine's "duplicated" TELinear), not column-parallel: with a column-parallel
            # kv_down_proj, MLA gathers its output over TP and the RoPE key part of it, which every rank's
            # heads use, gets back only the gradient of the heads of the rank holding those columns
            # (measured: 3e-5 relative in the step-1 gradient norm at TP2); replicated, the key's gradient
            # is summed by the sequence-parallel gather, and the weights' by finalize_model_grads
            from megatron.core.post_training.modelopt.layers import Linear

            attn.linear_q_down_proj = attn.linear_kv_down_proj = Linear
        if config.sequence_parallel and sub.input_layernorm is WrappedTorchNorm:
            sub.input_layernorm = sub.pre_mlp_layernorm = SequenceParallelNorm
            attn = sub.self_attention.submodules
            for name in ("q_layernorm", "k_layernorm", "kv_layernorm"):
                if getattr(attn, name, None) is WrappedTorchNorm:
                    setattr(attn, name, SequenceParallelNorm)
        return spec

    moe, dense = one(bool(shape.num_experts)), one(False) if shape.dense_layers else None
    specs = [dense if g < shape.dense_layers else moe for g in layers]
    sp_norms = config.sequence_parallel and moe.submodules.input_layernorm is SequenceParallelNorm
    if not sp_norms and dense is None:
        return moe
    final = SequenceParallelNorm if sp_norms else WrappedTorchNorm
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=final)


def transformer_config(
    hf_cfg: Any,
    layout: ParallelLayout,
    *,
    seq_len: int,
    precision: str,
    device: str,
    moe_aux_loss_coeff: float = 0.0,
):
    """The ``TransformerConfig``: the family adapter's model shape plus the layout and the device, and
    the router's load-balancing loss (``model.moe_aux_loss_coeff``) for a mixture of experts."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    adapter = adapter_for(hf_cfg.model_type)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    kw = adapter.transformer(hf_cfg, seq_len)
    if moe_aux_loss_coeff and kw.get("num_moe_experts"):
        kw.update(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=moe_aux_loss_coeff)
    kw.update(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        expert_model_parallel_size=layout.ep,
        sequence_parallel=layout.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=precision == "bf16",
        attention_softmax_in_fp32=True,
        **RECOMPUTE[layout.recompute],
        # the schedules scale by 1/num_microbatches and DDP averages over dp; the loss function
        # passes scale = grad_accum * dp / global_tokens, so the product is 1 / global_tokens
        calculate_per_token_loss=False,
    )
    if device == "cpu":
        kw.update(CPU_CONFIG)
    return (MLATransformerConfig if kw.get("multi_latent_attention") else TransformerConfig)(**kw)


def build_model_chunks(
    hf_cfg: Any,
    hf_state: Mapping[str, torch.Tensor],
    config: Any,
    layout: ParallelLayout,
    ps: Any,
    peft: Mapping[str, Any] | None = None,
    *,
    fill: bool = True,
) -> list[torch.nn.Module]:
    """One ``GPTModel`` per virtual stage of this rank, each loaded with its shard of ``hf_state`` (read
    part by part: megatron makes only the local slices, uninitialised, and they are filled here; not with
    ``fill`` False: a conversion's writer writes each from ``hf_state`` as it saves it); with
    ``peft`` (the recipe's section as a dict), the LoRA adapters of :mod:`tessera.engines.megatron_adapters`
    on its linears, filled from ``hf_state`` by their canonical names like the rest."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    from tessera.engines.megatron_adapters import attach
    from tessera.models.megatron_lora import mcore_adapter

    family = adapter_for(hf_cfg.model_type)
    adapter = mcore_adapter(hf_cfg, peft)
    shape = adapter.shape(hf_cfg)
    chunks = []
    for vp in range(layout.vpp):
        shard = shard_of(ps, layout, vp)
        model = GPTModel(
            config,
            layer_spec(config, shape, layer_range(shape, shard)),
            vocab_size=padded_vocab(shape.vocab_size, layout.tp),
            max_sequence_length=hf_cfg.max_position_embeddings,
            pre_process=shard.first_stage,
            post_process=shard.last_stage,
            parallel_output=True,
            vp_stage=vp if layout.vpp > 1 else None,
            **adapter.gpt(hf_cfg),
        )
        if peft is not None:
            attach(model, family, hf_cfg, peft, config)
        placed = [layer.layer_number - 1 for layer in model.decoder.layers]
        if placed != list(layer_range(shape, shard)):  # internal: megatron's split must be the map's
            raise RuntimeError(
                f"{shard}: megatron placed layers {placed}, the weight map expects "
                f"{list(layer_range(shape, shard))}"
            )
        if not fill:
            check_tp_attributes(model, hf_cfg, shard, adapter)
            chunks.append(model)
            continue
        # one tensor at a time into the parameters: never a second copy of the chunk
        own = {k: v for k, v in model.state_dict(keep_vars=True).items() if not k.endswith("_extra_state")}
        unexpected, filled = [], set()
        with torch.no_grad():
            for key, t in iter_hf_to_mcore(hf_state, adapter, hf_cfg, shard):
                if key in own and tuple(own[key].shape) == tuple(t.shape):
                    own[key].copy_(t)
                    filled.add(key)
                else:
                    unexpected.append(key)
        missing = sorted(set(own) - filled)
        if missing or unexpected:  # internal: the weight map and megatron's modules disagree
            raise RuntimeError(f"weight map mismatch for {shard}: missing {missing}, unexpected {unexpected}")
        check_tp_attributes(model, hf_cfg, shard, adapter)
        chunks.append(model)
    return chunks


def _per_optimizer(optimizer: Any, loaded: Any) -> list[tuple[Any, Any]]:
    opts = chained(optimizer)
    return list(zip(opts, [loaded] if len(opts) == 1 else [loaded[i] for i in range(len(opts))], strict=True))


def with_adam_steps(optimizer: Any, loaded: Any) -> Any:
    """The optimizer state megatron-core loaded, every parameter's state holding a "step" (torch AdamW's
    ``load_state_dict`` requires one): megatron-core saves the per-parameter step as one common step, and
    a checkpoint at step 0 (a conversion from an HF directory) has none; it becomes 0 here, and
    :func:`restore_adam_steps` then sets the saved one."""
    for _, sd in _per_optimizer(optimizer, loaded):
        inner = sd if "state" in sd else sd.get("optimizer", {})  # megatron's DDP optimizer: torch's own
        for st in (inner.get("state") or {}).values():
            if isinstance(st, dict) and "exp_avg" in st and "step" not in st:
                st["step"] = torch.zeros((), dtype=torch.float32)
    return loaded


def restore_adam_steps(optimizer: Any, loaded: Any) -> None:
    """megatron-core 0.16.1 without Apex / TE mishandles torch AdamW's per-parameter "step" on load: it
    assigns one tensor shared by every parameter (AdamW then adds 1 to it once per parameter per step)
    and then overwrites it from the load template. Each parameter gets its own tensor holding the step
    saved in the optimizer's common state (measured: without this, the resumed run's second step
    differed)."""
    for opt, sd in _per_optimizer(optimizer, loaded):
        groups = sd.get("optimizer", {}).get("param_groups", [])
        steps = {float(g["step"]) for g in groups if g.get("step") is not None}
        if len(steps) > 1:  # internal: one optimizer, one step count
            raise RuntimeError(f"checkpoint has several optimizer steps: {sorted(steps)}")
        step = next(iter(steps)) if steps else None
        for st in opt.optimizer.state.values():
            if step is not None and "exp_avg" in st:
                st["step"] = torch.full((), step, dtype=torch.float32)
            elif torch.is_tensor(st.get("step")):
                st["step"] = st["step"].clone()


def shard_of(ps: Any, layout: ParallelLayout, vp_stage: int) -> Shard:
    return Shard(
        tp=layout.tp,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp=layout.pp,
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        vpp=layout.vpp,
        vp_stage=vp_stage,
        ep=layout.ep,
        ep_rank=ps.get_expert_model_parallel_rank(),
        etp=ps.get_expert_tensor_parallel_world_size(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
    )


def check_tp_attributes(model: torch.nn.Module, hf_cfg: Any, shard: Shard, adapter: Any = None) -> None:
    """Guard against a silent failure: a TP-sharded parameter without ``tensor_model_parallel=True`` is
    counted once per TP rank in the clipping norm (DeepSpeed and megatron both read the attribute), and
    a replicated one with it is counted once instead of tp times. Each parameter's flag must match
    the weight map's split."""
    split = tp_splits(adapter or adapter_for(hf_cfg.model_type), hf_cfg, shard)
    wrong = []
    for name, p in model.named_parameters():
        want = split.get(name, REPL) in (COL, ROW, VOCAB)
        if bool(getattr(p, "tensor_model_parallel", False)) != want:
            wrong.append(name)
    if wrong:
        raise RuntimeError(
            "tensor_model_parallel attribute disagrees with the weight map (clipping norm would be wrong): "
            + ", ".join(wrong[:6])
        )


def verify_deepspeed_groups(engine: Any, layout: ParallelLayout) -> None:
    """Guard against the silent failure of ``mpu=None`` (or an mpu DeepSpeed ignored): DeepSpeed then
    treats all ranks as data-parallel and broadcasts rank 0's TP shard to every rank, and training runs
    "fine" with wrong numbers. Its data-parallel group must be the layout's."""
    # ZeRO reduces over the sequence-data-parallel group (= the dp group without sequence parallelism)
    got_dp, got_seq_dp, got_mp = engine.dp_world_size, engine.seq_dp_world_size, engine.mp_world_size
    if not got_dp == got_seq_dp == layout.dp or got_mp != layout.tp:
        raise RuntimeError(
            f"DeepSpeed sees dp={got_dp} mp={got_mp}, the layout is dp={layout.dp} tp={layout.tp}: "
            "it was initialised without the model-parallel groups (mpu)"
        )
