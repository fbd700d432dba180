"""Engine `megatron`: megatron-core ``GPTModel`` with TP / SP / PP (1F1B, interleaved) / EP, and
data-parallel sharding by megatron-core's DistributedOptimizer or by DeepSpeed ZeRO (pp = 1).

The model is the HF model converted: every rank builds the HF model from the recipe's seed (exactly
what the deepspeed engine trains) and loads its own shard of it through the declarative weight map in
:mod:`tessera.models.megatron`, so runs of the two engines start from identical weights and are
comparable step by step. megatron-core's global ``parallel_state`` is initialised here, once, from the
:class:`~tessera.plan.layout.ParallelLayout`, and checked against the layout's own rank arithmetic.

Loss normalisation is the foundation's (see :mod:`tessera.engines.base`): the gradient is that of the
sum of token losses of the global batch divided by its token count, whatever the split.
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tessera.comm.accounting import Phase
from tessera.config.schema import Recipe
from tessera.engines.base import (
    IGNORE_INDEX,
    Engine,
    ModelSource,
    Moments,
    ShardedStateDict,
    StepResult,
    TensorSlice,
    dp_sum,
    global_counts,
    step_result,
)
from tessera.engines.held import ACTIVATIONS, megatron_grad_bytes, megatron_params_and_optimizer
from tessera.engines.megatron_adapters import freeze_base
from tessera.engines.megatron_build import (
    CPU_CONFIG,
    MpuAdapter,
    build_model_chunks,
    chained,
    check_tp_attributes,
    init_parallel_state,
    restore_adam_steps,
    shard_of,
    sharding_of,
    transformer_config,
    verify_deepspeed_groups,
    with_adam_steps,
)
from tessera.engines.megatron_saving import save_through
from tessera.engines.optim import MOMENTS, LRSchedule, materialize_adam_state, set_adam_step
from tessera.engines.zero import DeepSpeedRunner
from tessera.errors import CheckpointError
from tessera.hostmem import lean_construction
from tessera.models.adapters import section_dict
from tessera.models.megatron_lora import SUFFIX, mcore_adapter
from tessera.models.weight_map import iter_hf_to_mcore, mcore_to_hf_slices
from tessera.plan.layout import ParallelLayout
from tessera.safeload import safe_torch_load
from tessera.tables.engines import adapters_refusal
from tessera.tensorfile import save_tensors
from tessera.writes import current

# the construction side lives in megatron_build; importers of these names from here keep working
__all__ = [
    "CPU_CONFIG",
    "MegatronEngine",
    "MpuAdapter",
    "build_model_chunks",
    "chained",
    "check_tp_attributes",
    "init_parallel_state",
    "shard_of",
    "sharding_of",
    "transformer_config",
    "verify_deepspeed_groups",
]


def _shifted(mb: dict[str, torch.Tensor], device: torch.device) -> tuple[torch.Tensor, ...]:
    """megatron's loss at position t is against the label at t (no shift inside): shift here, mask the
    last position and the ignored labels."""
    ids = mb["input_ids"].to(device, non_blocking=True)
    labels = mb["labels"].to(device, non_blocking=True)
    target = torch.full_like(labels, IGNORE_INDEX)
    target[:, :-1] = labels[:, 1:]
    mask = target != IGNORE_INDEX
    target = torch.where(mask, target, torch.zeros_like(target))
    pos = torch.arange(ids.shape[1], device=device).unsqueeze(0).expand_as(ids)
    return ids, pos, target, mask


class MegatronEngine(Engine):
    """megatron-core GPTModel chunks + (DistributedOptimizer | DeepSpeed ZeRO); one train_step = one update."""

    fills, written = True, None  # :class:`tessera.engines.megatron_writer.MegatronWriter` changes both

    def __init__(self, source: ModelSource, recipe: Recipe, layout: ParallelLayout, *, device: str) -> None:
        self.layout = layout
        self.device = torch.device(device if device == "cpu" else f"cuda:{torch.cuda.current_device()}")
        self.schedule = LRSchedule(recipe)
        self.seq_len = recipe.data.seq_len
        self.ps = ps = init_parallel_state(layout, seed=recipe.train.seed, device=device)
        # each rank reads (given weights) or draws (the seeded rule) only the tensor parts its chunks hold
        hf_state = source.tensors()
        hf_cfg = source.hf_config()
        self.hf_config = hf_cfg
        self.aux_coeff = recipe.model.moe_aux_loss_coeff
        self.config = transformer_config(
            hf_cfg,
            layout,
            seq_len=self.seq_len,
            precision=recipe.train.precision,
            device=device,
            moe_aux_loss_coeff=self.aux_coeff,
        )
        #: the recipe's adapters (dict) or None: only they train, and checkpoints hold only them
        self.peft = section_dict(source.peft)
        refused = adapters_refusal(layout.engine, layout.zero_impl) if self.peft is not None else None
        if refused is not None:
            raise refused
        self.adapter = mcore_adapter(hf_cfg, self.peft)
        with lean_construction():
            chunks = build_model_chunks(hf_cfg, hf_state, self.config, layout, ps, self.peft, fill=self.fills)
        del hf_state
        if self.peft is not None:
            freeze_base(chunks)
        if device == "cuda":
            chunks = [c.cuda() for c in chunks]
        self.dp_group = ps.get_data_parallel_group()
        self.uses_deepspeed = layout.uses_deepspeed
        self.ds: DeepSpeedRunner | None = None
        if self.uses_deepspeed:
            self._init_deepspeed(chunks[0], recipe, device)
        else:
            self._init_megatron(chunks, recipe)
        self.sharding = sharding_of(layout)

    # ---- setup -------------------------------------------------------------------------------------
    def _init_megatron(self, chunks: list[torch.nn.Module], recipe: Recipe) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.transformer.module import Float16Module

        distopt = self.layout.zero == 1
        if self.config.bf16:  # as Megatron-LM: every parameter (norms included) in bf16, fp32 masters
            chunks = [Float16Module(self.config, c) for c in chunks]
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=distopt,
            check_for_nan_in_grad=False,
        )
        # bucketing only for the first chunk, as Megatron-LM does: later chunks' grads are ready later
        self.chunks = [
            DistributedDataParallel(self.config, ddp_cfg, c, disable_bucketing=i > 0)
            for i, c in enumerate(chunks)
        ]
        o = recipe.optim
        opt_cfg = OptimizerConfig(
            optimizer="adam",
            lr=o.lr,
            min_lr=o.min_lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.betas[0],
            adam_beta2=o.betas[1],
            adam_eps=o.eps,
            clip_grad=o.grad_clip or 0.0,
            use_distributed_optimizer=distopt,
            bf16=recipe.train.precision == "bf16",
            params_dtype=self.config.params_dtype,
            decoupled_weight_decay=True,
        )
        self.optimizer = get_megatron_optimizer(opt_cfg, self.chunks)
        self.config.finalize_model_grads_func = finalize_model_grads
        no_sync = [c.no_sync for c in self.chunks]
        self.config.no_sync_func = no_sync if len(no_sync) > 1 else no_sync[0]
        self.forward_backward = get_forward_backward_func()

    def _init_deepspeed(self, model: torch.nn.Module, recipe: Recipe, device: str) -> None:
        self.ds = DeepSpeedRunner(model, recipe, self.layout, device=device, mpu=MpuAdapter(self.ps))
        verify_deepspeed_groups(self.ds.engine, self.layout)
        self.chunks = [self.ds.module]
        self.optimizer = self.ds.engine.optimizer

    @property
    def module(self) -> torch.nn.Module:
        return self.chunks[0]

    # ---- the step ----------------------------------------------------------------------------------
    def _loss_sum(self, model: Any, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        """Summed token loss of one micro-batch (vocab-parallel cross-entropy on this TP shard)."""
        ids, pos, target, mask = _shifted(mb, self.device)
        per_token = model(ids, pos, None, labels=target)  # [b, s], fp32 cross-entropy
        return (per_token.float() * mask).sum()

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]], step: int) -> StepResult:
        assert len(micro_batches) == self.layout.grad_accum, "sampler and layout disagree"  # internal
        lr = self.schedule.set(self.optimizer, step)
        tokens, inputs = global_counts(micro_batches, self.layout, device=self.device, group=self.dp_group)
        # the schedules (or DeepSpeed) divide by the micro-batch count and DDP averages over dp
        scale = self.layout.grad_accum * self.layout.dp / max(tokens, 1.0)
        for c in self.chunks:
            c.train()
        if self.ds is not None:
            if self.aux_coeff:  # the schedules set it; DeepSpeed averages over micro-batches only the loss
                from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

                MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / len(micro_batches)))
            loss_t, grad_norm, _ = self.ds.step(
                micro_batches, scale, lambda e, mb: (self._loss_sum(e, mb), None), dp_group=self.dp_group
            )
            loss_sum, opt = float(loss_t), self.ds.optimizer_phase
        else:
            for c in self.chunks:
                c.zero_grad_buffer()
            self.optimizer.zero_grad()
            loss_sum = self._schedule(micro_batches, scale, forward_only=False)
            with Phase() as opt:
                ok, grad_norm, _ = self.optimizer.step()
            if not ok:  # only fp16 loss scaling skips a step, and fp16 is refused before launch
                raise RuntimeError("megatron optimizer skipped the step")
            grad_norm = None if grad_norm is None else float(grad_norm)
        return step_result(
            loss_sum,
            grad_norm,
            lr=lr,
            tokens=tokens,
            inputs=inputs,
            optimizer=opt,
            moe_aux_loss=self._moe_aux_loss() if self.aux_coeff else None,
        )

    def _moe_aux_loss(self) -> float:
        """The step's load-balancing loss from megatron-core's tracker (each router adds its layer's loss
        without the coefficient, once per micro-batch): summed over layers and pipeline stages, averaged
        over micro-batches and dp ranks, times the coefficient; the tracker is cleared for the next step."""
        from megatron.core.transformer.moe.moe_utils import (
            clear_aux_losses_tracker,
            get_moe_layer_wise_logging_tracker,
        )

        entry = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        if entry is not None:
            total += entry["values"].double().sum()
        if self.layout.pp > 1:
            dist.all_reduce(total, group=self.ps.get_pipeline_model_parallel_group())
        dp_sum(total, self.layout, self.dp_group)
        clear_aux_losses_tracker()
        return float(total) * self.aux_coeff / (self.layout.grad_accum * self.layout.dp)

    def eval_loss(self, micro_batches: list[dict[str, torch.Tensor]]) -> tuple[float, float]:
        tokens, _ = global_counts(micro_batches, self.layout, device=self.device, group=self.dp_group)
        for c in self.chunks:
            c.eval()
        with torch.no_grad():
            if self.ds is not None:
                loss_t = sum((self._loss_sum(self.ds.engine, mb).double() for mb in micro_batches), start=0.0)
                loss = torch.as_tensor(loss_t, dtype=torch.float64, device=self.device)
                # tp ranks hold copies of the same loss: one dp replica's sum per dp rank
                return float(dp_sum(loss, self.layout, self.dp_group)), tokens
            return self._schedule(micro_batches, 1.0, forward_only=True), tokens

    def _schedule(
        self, micro_batches: list[dict[str, torch.Tensor]], scale: float, *, forward_only: bool
    ) -> float:
        """Run megatron-core's schedule (1F1B / interleaved / no pipelining) over the micro-batches;
        returns the summed token loss of the global batch (every rank gets it)."""

        def loss_func(loss_sum: torch.Tensor):
            return loss_sum * scale, {"loss_sum": loss_sum.detach()}

        def forward_step(data_iterator, model):
            ids, pos, target, mask = _shifted(next(data_iterator), self.device)
            with ACTIVATIONS.micro_batch():
                out = model(ids, pos, None, labels=target)
                if out.dim() == 3:  # not the last stage: the hidden states go to the next stage
                    return out, None
                return (out.float() * mask).sum(), loss_func

        iters = [iter(micro_batches) for _ in self.chunks]
        reported = self.forward_backward(
            forward_step_func=forward_step,
            data_iterator=iters if len(iters) > 1 else iters[0],
            model=self.chunks if len(self.chunks) > 1 else self.chunks[0],
            num_microbatches=len(micro_batches),
            seq_length=self.seq_len,
            micro_batch_size=self.layout.micro_batch,
            forward_only=forward_only,
        )
        mine = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.layout.pp == 1:  # every rank holds its replica's loss (tp ranks the same copy): a sum
            for d in reported:  # over dp, and no collective at all at dp = 1 (a TP layout)
                mine += d["loss_sum"].double()
            return float(dp_sum(mine, self.layout, self.dp_group))
        # the loss lives on the last stage; tp ranks hold copies: count one rank per dp replica
        if (
            self.ps.is_pipeline_last_stage(ignore_virtual=True)
            and self.ps.get_tensor_model_parallel_rank() == 0
        ):
            for d in reported:
                mine += d["loss_sum"].double()
        if dist.get_world_size() > 1:
            dist.all_reduce(mine)
        return float(mine)

    # ---- what this rank holds ----------------------------------------------------------------------
    def held_state(self) -> dict[str, int]:
        if self.ds is not None:
            return self.ds.held_state()
        return {
            "grads": megatron_grad_bytes(self.chunks),  # megatron DDP's grad buffers live between steps
            **megatron_params_and_optimizer(self.chunks, self.optimizer),
        }

    def _local_modules(self) -> list[torch.nn.Module]:
        """The GPTModel chunks inside megatron's DDP / Float16Module wrappers (or DeepSpeed's)."""
        out = []
        for c in self.chunks:
            while hasattr(c, "module") and not hasattr(c, "decoder"):
                c = c.module
            out.append(c)
        return out

    def state_dict(self) -> ShardedStateDict:
        """HF names with the slice of the full HF tensor each local megatron tensor holds (fused QKV and
        gate_up give several slices; see :func:`tessera.models.megatron.mcore_to_hf_slices`)."""
        adapter = self.adapter
        out: ShardedStateDict = {}
        for vp, model in enumerate(self._local_modules()):
            local = {k: v.detach() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
            shard = shard_of(self.ps, self.layout, vp)
            for name, pieces in mcore_to_hf_slices(local, adapter, self.hf_config, shard).items():
                out.setdefault(name, []).extend(
                    TensorSlice(tensor=t, full_shape=full, index=index) for t, index, full in pieces
                )
        return out

    def optimizer_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.ds is not None:
            yield from self.ds.optimizer_tensors()
            return
        for j, opt in enumerate(chained(self.optimizer)):
            inner = opt.optimizer
            for g, group in enumerate(inner.param_groups):
                for i, p in enumerate(group["params"]):
                    yield f"optimizer[{j}].group[{g}].param[{i}]", p
                    for k, v in inner.state.get(p, {}).items():
                        if torch.is_tensor(v):
                            yield f"optimizer[{j}].group[{g}].param[{i}].{k}", v

    def modules(self) -> list[torch.nn.Module]:
        return self._local_modules()

    def import_optimizer(self, moments: Moments, step: int) -> None:
        """The HF moments go through the weight map exactly as the weights do (each rank's TP / PP / EP
        slice, fused QKV, padded vocabulary), then into the optimizer that owns each parameter: DeepSpeed
        (zero_impl deepspeed), the distributed optimizer (this dp rank's range of the flat parameter) or
        megatron's per-parameter optimizer."""
        if self.ds is None:
            self._materialize_optimizer_state()
            targets = self._main_params()
        for kind in MOMENTS:  # one kind at a time, each slice into the optimizer as the map makes it
            if self.ds is not None:
                self.ds.import_optimizer(((p, {kind: t}) for p, t in self._slices(moments, kind)), step)
                continue
            with torch.no_grad():
                for p, t in self._slices(moments, kind):
                    opt, main = targets[p]
                    if main is None:  # distributed optimizer: this dp rank's range of the flat parameter
                        r = opt._get_model_param_range_map(p)["param"]
                        state = opt._get_main_param_and_optimizer_states(p)
                        state[kind].copy_(t.reshape(-1)[r.start : r.end])
                    else:
                        opt.optimizer.state[main][kind].copy_(t)
        if self.ds is None:
            for opt in chained(self.optimizer):
                set_adam_step(opt.optimizer, step)

    def _slices(self, moments: Moments, kind: str) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        """(trained parameter, this rank's slice of its ``kind`` moment), one at a time (no more held)."""
        for vp, model in enumerate(self._local_modules()):
            trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
            shard = shard_of(self.ps, self.layout, vp)
            for n, t in iter_hf_to_mcore(moments[kind], self.adapter, self.hf_config, shard):
                if n in trained:
                    yield trained.pop(n), t
            if trained:  # internal: the weight map gives every trained parameter a moment
                raise RuntimeError(f"{kind}: no moment for {sorted(trained)[:3]}")

    def _main_params(self) -> dict[torch.nn.Parameter, tuple[Any, torch.Tensor | None]]:
        """model parameter -> (its megatron optimizer, the parameter its Adam state is keyed by; None for
        the distributed optimizer, which keys a shard)."""
        out: dict[torch.nn.Parameter, tuple[Any, torch.Tensor | None]] = {}
        for opt in chained(self.optimizer):
            if hasattr(opt, "model_param_gbuf_map"):
                out.update((p, (opt, None)) for p in opt.model_param_gbuf_map)
            elif hasattr(opt, "float16_groups"):  # bf16: fp32 main copies
                for lows, mains in zip(opt.float16_groups, opt.fp32_from_float16_groups, strict=True):
                    out.update((p, (opt, m)) for p, m in zip(lows, mains, strict=True))
            else:
                out.update((p, (opt, p)) for g in opt.optimizer.param_groups for p in g["params"])
        return out

    # ---- checkpoints -------------------------------------------------------------------------------
    def _rng_file(self, path: Path) -> Path:
        return Path(path) / f"megatron_rng_rank{dist.get_rank():05d}.safetensors"

    @property
    def saves_in_background(self) -> bool:  # type: ignore[override]
        return self.ds.saves_in_background if self.ds is not None else True

    def save(self, path: Path) -> None:
        """Model + optimizer (dist_checkpointing, or DeepSpeed's format with zero_impl deepspeed) and
        this rank's megatron RNG tracker states (TP-region dropout) as safetensors."""
        from megatron.core import tensor_parallel

        if self.ds is not None:
            self.ds.save(path)
        else:
            self._save_dist(path)
        states = tensor_parallel.get_cuda_rng_tracker().get_states()
        save_tensors(self._rng_file(path), states)

    def load(self, path: Path) -> None:
        from megatron.core import tensor_parallel

        from tessera.tensorfile import load_tensors

        if self.ds is not None:
            self.ds.load(path)
        else:
            self._load_dist(path)
        rng = self._rng_file(path)
        if not rng.is_file() and rng.with_suffix(".pt").is_file():  # a v1 checkpoint: tensors only
            states = safe_torch_load(rng.with_suffix(".pt"))
        else:
            states = load_tensors(rng)
        tensor_parallel.get_cuda_rng_tracker().set_states(states)

    def load_resharded(self, path: Path) -> str:
        """Model and optimizer from a megatron checkpoint of another tp / pp / dp / ep layout (same
        optimizer kind; :func:`tessera.engines.megatron_reader.reshards_on_load`): dist_checkpointing
        reads each rank's part of the global tensors and of the model-space optimizer state. The
        TP-region RNG tracker keeps this layout's own seeded streams: the saved ones belong to the old
        ranks."""
        self._load_dist(path)
        return "megatron-core dist_checkpointing"

    def _save_dist(self, ckpt: Path) -> None:
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        # Saves here are synchronous, so the writer's results never leave this process; without this,
        # megatron starts a spawn-context multiprocessing Manager just to carry them (a fresh Python
        # process: seconds per run on CPU, and a server left orphaned when a rank exits fast)
        if filesystem_async._results_queue is None:
            filesystem_async._results_queue = queue.Queue()
        path = Path(ckpt) / "megatron"
        if dist.get_rank() == 0:
            path.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        writes = current()
        if writes is not None:  # a Tessera checkpoint save: its writer writes the buckets
            sd, rank0 = self._sharded_state_dict(is_loading=False), dist.get_rank() == 0
            save_through(writes, sd, path, coordinator=rank0, resolve=self.written)
            return
        dist_checkpointing.save(self._sharded_state_dict(is_loading=False), str(path))
        dist.barrier()

    def _load_dist(self, ckpt: Path) -> None:
        from megatron.core import dist_checkpointing

        path = Path(ckpt) / "megatron"
        if not path.is_dir():
            raise CheckpointError(
                "no megatron dist_checkpointing directory in this checkpoint",
                field="checkpoint",
                value=str(path),
                fix="resume with the engine and layout that wrote it",
            )
        self._materialize_optimizer_state()
        sharded, common = safe_load_strategies()
        state = dist_checkpointing.load(
            self._sharded_state_dict(is_loading=True),
            str(path),
            sharded_strategy=sharded,
            common_strategy=common,
        )
        for i, c in enumerate(self.chunks):  # the model inside megatron's DDP wrapper
            missing, unexpected = c.module.load_state_dict(state[f"model{i}"], strict=self.peft is None)
            lost = [k for k in missing if SUFFIX + "." in k]  # with adapters only they are in the checkpoint
            if lost or unexpected:
                raise CheckpointError(
                    f"the checkpoint's model does not fit this one: missing {lost[:3]}, unexpected {unexpected[:3]}",
                    field="checkpoint",
                    value=str(path),
                    fix="resume with the recipe's peft section as the checkpoint's meta.json records it",
                )
        with torch.no_grad(), _model_space_step_fix(self.optimizer):
            # the distributed optimizer copies into views of the fp32 parameters
            self.optimizer.load_state_dict(with_adam_steps(self.optimizer, state["optimizer"]))
        restore_adam_steps(self.optimizer, state["optimizer"])

    def _materialize_optimizer_state(self) -> None:
        """A fresh torch AdamW creates its state at the first step, but the load template needs it (and
        megatron reads its "step" without Apex / TE): zero placeholders, all overwritten by the load."""
        for opt in chained(self.optimizer):
            materialize_adam_state(opt.optimizer)

    def _sharded_state_dict(self, *, is_loading: bool) -> dict[str, Any]:
        # the distributed optimizer's state in model space: per parameter, full shape, under the keys
        # megatron DDP's optimizer uses ("optimizer.state.exp_avg.<key>"), so dist_checkpointing reshards
        # it across tp / pp / dp and the offline reader finds the moments. megatron-core 0.16.1 refuses
        # the parallel per-rank variant ("fully_sharded_model_space": flattened ranges unsupported), so
        # the dp ranks' ranges are gathered at save, on dp rank 0 only and over gloo (the
        # memory-efficient mode: no rank holds more than its dp group's share of the state in full)
        metadata = {
            "distrib_optim_sharding_type": "fully_reshardable",
            "distrib_optim_fully_reshardable_mem_efficient": True,
        }
        model_sd = {
            f"model{i}": c.module.sharded_state_dict(metadata=metadata) for i, c in enumerate(self.chunks)
        }
        if self.peft is not None:  # the frozen base is the model source's (meta.json names it): not saved
            model_sd = {m: {k: v for k, v in sd.items() if SUFFIX + "." in k} for m, sd in model_sd.items()}
        # the optimizer finds each parameter's sharded key in the nested model dicts (as Megatron-LM does)
        optim = self.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
        return {**model_sd, "optimizer": optim}

    def named_groups(self) -> dict[Any, str]:
        """megatron-core's groups by name for the comm accounting: the expert groups can hold the same
        ranks as the dp or tp group, so they are told apart by identity, not by members."""
        ps = self.ps
        getters = {
            "dp": ("get_data_parallel_group", "get_data_parallel_group_gloo", "_dp_with_cp"),
            "tp": ("get_tensor_model_parallel_group",),
            "pp": ("get_pipeline_model_parallel_group",),
            "mp": ("get_model_parallel_group",),
            "ep": ("get_expert_model_parallel_group",),
            "edp": ("get_expert_data_parallel_group",),
            "etp": ("get_expert_tensor_parallel_group",),
            "embd": ("get_embedding_group",),
            "pos_embd": ("get_position_embedding_group",),
        }
        calls = {"_dp_with_cp": lambda: ps.get_data_parallel_group(with_context_parallel=True)}
        out: dict[Any, str] = {}
        for name, fns in reversed(getters.items()):  # the first name wins where groups coincide
            for fn in fns:
                try:
                    group = calls[fn]() if fn in calls else getattr(ps, fn)(check_initialized=False)
                except TypeError:
                    group = getattr(ps, fn)()
                except (AssertionError, RuntimeError):
                    continue
                if group is not None:
                    out[group] = name
        return out

    def close(self) -> None:
        if self.ps.model_parallel_is_initialized():
            self.ps.destroy_model_parallel()


@contextlib.contextmanager
def _model_space_step_fix(optimizer: Any) -> Iterator[None]:
    """megatron-core 0.16.1's distributed optimizer, loading its model-space format with torch's AdamW
    (no Apex / TE), first puts the group's "step" into every parameter's state and then copies every state
    key from the checkpoint's tensors, which carry no "step" (it is saved per group): a KeyError. During
    the load each distributed optimizer copies only the keys the checkpoint has; "step" stays as put
    (and is made per-parameter afterwards by ``_restore_adam_steps``). The copy is megatron's own
    (``_set_main_param_and_optimizer_states``, non-precision-aware branch), minus the missing key."""
    patched = []
    for opt in chained(optimizer):
        if not hasattr(opt, "model_param_gbuf_map"):
            continue

        def set_states(model_param: Any, tensors: dict[str, torch.Tensor], opt: Any = opt) -> None:
            group_index, group_order = opt.model_param_group_index_map[model_param]
            main = opt.optimizer.param_groups[group_index]["params"][group_order]
            dst = {"param": main, **opt.optimizer.state[main]}
            for key, value in tensors.items():
                dst[key].copy_(value)

        opt._set_main_param_and_optimizer_states = set_states
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states  # the class's method again


# ---- megatron-core's loads, made safe ------------------------------------------------------------------


@contextlib.contextmanager
def _swapped(module: Any, **names: Any) -> Iterator[None]:
    """``module.<name> = value`` for the block, then restored."""
    before = {k: getattr(module, k) for k in names}
    for k, v in names.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in before.items():
            setattr(module, k, v)


def safe_load_strategies() -> tuple[Any, Any]:
    """megatron-core's own ``torch_dist`` load strategies (sharded, common), with each of their three
    unpickling loads made safe (:mod:`tessera.safeload`):

    - ``common.pt``: ``torch.load`` with torch's default ``weights_only`` (megatron relies on it) ->
      :func:`safe_torch_load`, which holds whatever the environment says;
    - the distributed checkpoint's ``.metadata``: torch's reader calls ``pickle.load`` -> a reader whose
      ``read_metadata`` uses the restricted unpickler;
    - its byte entries (``_extra_state``): torch's planner loads them with ``weights_only=False`` -> a
      planner loading them with :func:`safe_torch_load`.

    megatron's ``TorchDistLoadShardedStrategy.load`` builds its reader and planner by module-level name
    (``_get_filesystem_reader``, ``MCoreLoadPlanner``) and takes neither as a parameter; the two names are
    swapped for the duration of its own call only (the narrowest hook there is)."""
    from megatron.core.dist_checkpointing.strategies import torch as mtorch
    from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME, TorchCommonLoadStrategy
    from torch.distributed.checkpoint._traverse import set_element

    from tessera.safeload import dcp_reader_class

    class SafeCommonLoad(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir: Any) -> Any:
            return safe_torch_load(Path(checkpoint_dir) / COMMON_STATE_FNAME, map_location="cpu")

    class SafeTorchDistLoad(mtorch.TorchDistLoadShardedStrategy):
        def _safely(self, checkpoint_dir: Any) -> Any:
            reader_cls = dcp_reader_class()

            class SafePlanner(mtorch.MCoreLoadPlanner):
                def load_bytes(self, read_item: Any, value: Any) -> None:
                    # DefaultLoadPlanner.load_bytes, with a safe load in place of weights_only=False
                    info = self.metadata.storage_data[read_item.storage_index]
                    obj = safe_torch_load(
                        value,
                        where=f"{Path(checkpoint_dir) / info.relative_path} (entry {read_item.dest_index.fqn})",
                    )
                    fqn = read_item.dest_index.fqn
                    if self.flatten_state_dict:
                        set_element(self.original_state_dict, self.mappings[fqn], obj)
                    else:
                        self.state_dict[fqn] = obj

            return _swapped(
                mtorch,
                _get_filesystem_reader=lambda d, cache_metadata=False: reader_cls(d),
                MCoreLoadPlanner=SafePlanner,
            )

        def load(self, sharded_state_dict: Any, checkpoint_dir: Any) -> Any:
            with self._safely(checkpoint_dir):
                return super().load(sharded_state_dict, checkpoint_dir)

        def load_tensors_metadata(self, checkpoint_dir: Any, metadata: Any = None) -> Any:
            with self._safely(checkpoint_dir):
                return super().load_tensors_metadata(checkpoint_dir, metadata)

        def load_sharded_metadata(self, checkpoint_dir: Any) -> Any:
            with self._safely(checkpoint_dir):
                return super().load_sharded_metadata(checkpoint_dir)

    return SafeTorchDistLoad(), SafeCommonLoad()
