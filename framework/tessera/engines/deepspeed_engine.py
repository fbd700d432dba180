"""Engine `deepspeed`: the HF module itself under DeepSpeed ZeRO 0-3 data parallelism.

DeepSpeed owns sharding (ZeRO stages, offload), gradient accumulation boundaries, clipping, mixed
precision and its checkpoint format (:mod:`tessera.engines.zero`). Tessera owns the config it is given,
the loss normalisation (by tokens, see :mod:`tessera.engines.base`) and the LR schedule.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tessera.config.schema import Recipe
from tessera.engines.base import (
    Engine,
    HFObjective,
    ModelSource,
    Moments,
    ShardedStateDict,
    StepResult,
    TensorSlice,
    global_counts,
    hf_eval_loss,
    hf_recompute,
    mean_aux_loss,
    step_result,
)
from tessera.engines.optim import MOMENTS
from tessera.engines.ulysses import LongSequences
from tessera.engines.zero import DeepSpeedRunner, build_ds_config
from tessera.hostmem import lean_construction
from tessera.models.adapters import named_parameters
from tessera.plan.layout import ParallelLayout

#: the dtype DeepSpeed keeps the module's parameters in (its fp32 master copies live in the optimizer)
PARAM_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class DeepSpeedEngine(Engine):
    """HF causal LM + ``deepspeed.initialize``; one ``train_step`` = one optimizer step."""

    def __init__(self, source: ModelSource, recipe: Recipe, layout: ParallelLayout, *, device: str) -> None:
        self.layout = layout
        self.device = torch.device(device if device == "cpu" else f"cuda:{torch.cuda.current_device()}")
        self.objective = HFObjective.of(source)
        #: Ulysses sp / tiled MLP and loss / checkpoint offload (DeepSpeed's ALST), or None
        self.long: LongSequences | None = None
        if layout.long_sequences:  # the sp groups first: every rank makes them in the same order
            self.long = LongSequences(
                source, layout, seq_len=recipe.data.seq_len, device=self.device, base=self.objective
            )
        with lean_construction():
            if layout.zero == 3:  # partitioned as it is made: no rank holds the whole model
                model = partitioned_from(
                    source, source.tensors(), build_ds_config(recipe, layout, device=device)
                )
            else:  # ZeRO 0-2 hold the whole model on every rank: made whole, in the dtype DeepSpeed trains in
                model = source.build_hf(dtype=PARAM_DTYPE[recipe.train.precision], device=self.device)
        hf_recompute(model, layout.recompute)
        if self.long is not None:
            self.long.attach(model)
        self.ds = DeepSpeedRunner(
            model, recipe, layout, device=device, mpu=None if self.long is None else self.long.mpu
        )
        self.sharding = self.ds.sharding

    @property
    def module(self) -> torch.nn.Module:
        return self.ds.module

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]], step: int) -> StepResult:
        assert len(micro_batches) == self.layout.grad_accum, "sampler and layout disagree"  # internal
        lr = self.ds.schedule.set(self.ds.engine.optimizer, step)
        tokens, inputs = global_counts(micro_batches, self.layout, device=self.device, group=None)
        # DeepSpeed divides by grad_accum (scale_wrt_gas) and averages over dp: undo both so that the
        # gradient is d(sum of token losses)/d(theta) / (tokens in the global batch). Under sp each rank's
        # loss is its slice's; DeepSpeed sums the slices' gradients over the sp ranks and divides by dp,
        # except ZeRO-3's reduce-scatter, which divides by dp*sp (deepspeed 0.19.8): sp times more there
        scale = self.layout.grad_accum * self.layout.dp / max(tokens, 1.0)
        if self.layout.zero == 3 and self.layout.sp > 1:
            scale *= self.layout.sp
        around = self.long.around if self.long is not None else contextlib.nullcontext
        loss_sum, norm, aux_sum = self.ds.step(micro_batches, scale, self._loss_of, around=around)
        return step_result(
            float(loss_sum),
            norm,
            lr=lr,
            tokens=tokens,
            inputs=inputs,
            optimizer=self.ds.optimizer_phase,
            moe_aux_loss=mean_aux_loss(aux_sum, self.layout),
        )

    def eval_loss(self, micro_batches: list[dict[str, torch.Tensor]]) -> tuple[float, float]:
        """Through the DeepSpeed engine (ZeRO-3 gathers its parameters in the forward; bf16 casts); with
        the long-sequence components, through their objective (each sp rank its slice)."""
        long = self.long
        loss_of = None if long is None else (lambda model, mb: long(model, mb, self.device)[0])
        return hf_eval_loss(self.ds.engine, micro_batches, self.layout, device=self.device, loss_of=loss_of)

    def _loss_of(self, engine: Any, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.long is not None:
            return self.long(engine, mb, self.device)
        return self.objective(engine, mb, self.device)

    def named_groups(self) -> dict[Any, str]:
        """Data parallelism over the whole world: the comm accounting names it from the layout."""
        return {}

    def held_state(self) -> dict[str, int]:
        return self.ds.held_state()

    def state_dict(self) -> ShardedStateDict:
        """HF names; whole tensors under ZeRO 0-2 (replicas), the flat ZeRO-3 partition under ZeRO-3."""
        out: ShardedStateDict = {}
        rank = dist.get_rank() if dist.is_initialized() else 0
        for name, p in named_parameters(self.module):
            if hasattr(p, "ds_tensor"):  # ZeRO-3: this rank's partition of the flattened tensor
                start, stop = partition_range(p, rank)
                t = p.ds_tensor.detach().view(-1)[: stop - start]
                out[name] = [TensorSlice(tensor=t, full_shape=tuple(p.ds_shape), flat=(start, stop))]
            else:
                out[name] = [TensorSlice.whole(p.detach())]
        return out

    def optimizer_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.ds.optimizer_tensors()

    def modules(self) -> list[torch.nn.Module]:
        return [self.module]

    def import_optimizer(self, moments: Moments, step: int) -> None:
        self.ds.import_optimizer(
            (
                (p, {k: moments[k][name] for k in MOMENTS})
                for name, p in named_parameters(self.module)
                if p.requires_grad  # a frozen base has no optimizer state
            ),
            step,
        )

    @property
    def saves_in_background(self) -> bool:  # type: ignore[override]
        return self.ds.saves_in_background

    def save(self, path: Path) -> None:
        self.ds.save(path)

    def load(self, path: Path) -> None:
        self.ds.load(path)

    def close(self) -> None:
        """The long-sequence components' process-global state (the sp groups, the attention override);
        the process group itself belongs to the worker."""
        if self.long is not None:
            self.long.close()
            self.long = None


def partition_range(p: Any, rank: int) -> tuple[int, int]:
    """The elements ``[start, stop)`` of the flattened parameter that ZeRO-3 rank ``rank`` holds (equal
    partitions, the last one padded)."""
    part, numel = int(p.ds_tensor.numel()), int(p.ds_numel)
    start = min(rank * part, numel)
    return start, min(start + part, numel)


def partitioned_from(
    source: ModelSource, tensors: Mapping[str, torch.Tensor], ds_config: dict[str, Any]
) -> Any:
    """ZeRO-3: the HF model is created under ``deepspeed.zero.Init``, so every parameter is partitioned as
    it is made (in the dtype DeepSpeed trains in, on the device), and each rank copies in only its flat
    partition of every tensor, read from ``tensors`` (the seeded rule draws just the rows covering it; a
    lazy safetensors reader reads just those rows): no rank ever holds the whole model."""
    import deepspeed
    from transformers.initialization import no_init_weights

    from tessera.models.hf import fill_from
    from tessera.models.init import read_flat

    # the dtype comes from the config (fp32 unless bf16 / fp16 is on): deepspeed 0.19.8 ignores an
    # explicit dtype= on an accelerator without fp16 (operator precedence in Init._set_dtype) and
    # makes bf16 partitions
    if not deepspeed.comm.is_initialized():  # zero.Init sizes its partitions by DeepSpeed's world
        deepspeed.init_distributed(
            dist_backend=dist.get_backend() if dist.is_initialized() else None, verbose=False
        )
    with deepspeed.zero.Init(config_dict_or_path=ds_config), no_init_weights():
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(
            source.hf_config(), attn_implementation=source.section.attn_implementation
        )
        model.tie_weights()  # part of HF's init_weights, which no_init_weights skips
    if source.peft is not None:
        # adapters after zero.Init, never inside it: a layer made under zero.Init is partitioned at the
        # end of its __init__, so peft's init would write into empty tensors; made here they are plain
        # tensors, which deepspeed.initialize partitions. peft reads ZeRO-3 through transformers' global
        # HfDeepSpeedConfig (DoRA's magnitude gathers the base weight), held only while injecting: alive,
        # it would also put later from_config calls under zero.Init
        from transformers.integrations import HfDeepSpeedConfig

        zero3 = HfDeepSpeedConfig(ds_config)
        source.add_adapters(model)
        del zero3
    rank = dist.get_rank() if dist.is_initialized() else 0

    def copy_partition(t: torch.Tensor, name: str) -> None:
        if not hasattr(t, "ds_tensor"):  # a buffer: not partitioned
            t.copy_(tensors[name])
            return
        start, stop = partition_range(t, rank)
        part = read_flat(tensors, name, tuple(t.ds_shape), start, stop)
        t.ds_tensor.view(-1)[: stop - start].copy_(part)

    fill_from(
        model,
        tensors,
        where=str(source.weights_dir() or "model.hf_config"),
        shape_of=lambda t: tuple(getattr(t, "ds_shape", t.shape)),
        copy=copy_partition,
    )
    return model
