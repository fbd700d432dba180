"""``tessera convert --to deepspeed`` at ZeRO 1-2: DeepSpeed's checkpoint written without DeepSpeed's engine.

A conversion trains nothing: its checkpoint is the source's weights, their fp32 master partitions and the
Adam moments (zeros at step 0 from an HF directory; the staged ones from a checkpoint). DeepSpeed writes
its checkpoint only from a live engine, which holds the whole module, its flat copy, this rank's fp32
partition and both moments: ~3 x the model per rank at dp 2 (3.8 GB of host memory for a 1.2 GB model),
and it has no offline writer (its ``ds_to_universal`` reads, it does not write these files). So the files
are made here, by hand where DeepSpeed offers nothing to call:

- the objects are the dicts DeepSpeed's save pickles (``DeepSpeedEngine._common_checkpoint_state`` and
  ``_save_zero_checkpoint``, ``DeepSpeedZeroOptimizer.state_dict``), built from the rules that make them
  in the pinned version: a parameter group's trainable parameters end to end, padded to a multiple of
  2 x dp elements, cut into dp equal partitions; the padding this rank's partition holds; each
  parameter's fragment in the partition (``tensor_fragment.get_hp_fragment_mapping``). DeepSpeed's own
  classes and helpers wherever it has them (its loss scaler, ``fragment_address``, ``ZeroStageEnum``,
  ``_checkpoint_parallel_metadata``, the optimizer's own ``state_dict`` of the param groups);
- every tensor in them is a placeholder that takes no memory (:func:`tessera.hostmem.zeros`), and
  ``torch.save`` runs with ``skip_data``: torch writes the pickle and each record's header, and asks its
  stream to skip each record's bytes; the stream (:class:`_Filling`) writes them instead, made from the
  source one parameter at a time as torch reaches them, through the checkpoint's hashing writer.

A test compares every file with the one DeepSpeed's engine wrote (every key and value, each tensor bit for
bit) and the conversions resume. Declined (the engine converts): ZeRO 0 and 3, adapters, offload, the
long-sequence components, DeepSpeed's own Adam, bf16 at ZeRO-1 (DeepSpeed's BF16_Optimizer has another
format), and a JSON that turns on ``round_robin_gradients``, ``parameter_alignment`` or ``elastic_checkpoint``.
"""

from __future__ import annotations

import shutil
import stat
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tessera.engines.optim import MOMENTS, initial_moments
from tessera.engines.zero import RECOVERY_SCRIPTS, SHARDING_PREFIX, remove_planted_scripts
from tessera.engines.zero_lazy import tensors_in
from tessera.hostmem import lean_construction, zeros
from tessera.writes import current, without_zip_crc

#: a storage's bytes, made when torch's writer reaches its record: tensors whose bytes, end to end, are it
Fill = Callable[[], Iterator[torch.Tensor]]
#: the zero optimization settings that change the files' layout from the one written here
_LAYOUT_KEYS = ("round_robin_gradients", "parameter_alignment", "elastic_checkpoint", "offload_optimizer",
                "offload_param", "cpu_offload")  # fmt: skip


def writer_for(recipe: Any, layout: Any, *, from_hf: bool = True) -> type | None:
    """:class:`ZeroWriter` where it writes the layout's checkpoint as DeepSpeed's engine would (see the
    module), else None (the engine itself converts)."""
    from tessera.device import resolve_device
    from tessera.engines.ds_config import build_ds_config

    precision = recipe.train.precision
    if layout.zero not in (1, 2) or recipe.peft is not None or layout.long_sequences:
        return None
    if layout.offload_optimizer or layout.offload_params or recipe.optim.name == "deepspeed_adam":
        return None
    if precision == "fp16" or (precision == "bf16" and layout.zero == 1):
        return None
    zero = build_ds_config(recipe, layout, device=resolve_device(recipe.run.device)).get(
        "zero_optimization", {}
    )
    if any(zero.get(k) not in (None, False, {}) for k in _LAYOUT_KEYS):
        return None
    return ZeroWriter


@dataclass(frozen=True)
class FlatGroup:
    """One parameter group as DeepSpeed's ZeRO 1-2 optimizer lays it out (``round_robin_gradients`` and
    ``parameter_alignment`` off): its parameters end to end from element 0, the whole padded to a multiple
    of ``2 x dp`` (``align_dense_tensors`` with ``nccl_start_alignment_factor`` 2), ``dp`` equal partitions."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    dp: int

    @property
    def numel(self) -> int:
        return sum(s.numel() for s in self.shapes)

    @property
    def partition(self) -> int:
        align = 2 * self.dp
        return -(-self.numel // align) * align // self.dp

    def padding(self, rank: int) -> int:
        """Padding elements at the end of ``rank``'s partition (``DeepSpeedZeroOptimizer.groups_padding``)."""
        left, size = rank * self.partition, self.partition
        return size if self.numel <= left else max(0, left + size - self.numel)

    def pieces(self, rank: int) -> Iterator[tuple[str, int, int, int]]:
        """(name, first, end, where) of every parameter with elements in ``rank``'s partition, in order: its
        elements ``[first, end)`` lie there from element ``where`` of the partition."""
        lo, hi = rank * self.partition, (rank + 1) * self.partition
        at = 0
        for name, shape in zip(self.names, self.shapes):
            start, stop = max(at, lo), min(at + shape.numel(), hi)
            if start < stop:
                yield name, start - at, stop - at, start - lo
            at += shape.numel()

    def fragments(self, rank: int) -> OrderedDict[str, Any]:
        """Name -> ``fragment_address`` (numel, start in the partition) of each parameter with elements in
        ``rank``'s partition: the optimizer's ``param_slice_mappings`` of this group."""
        from deepspeed.utils.tensor_fragment import fragment_address

        return OrderedDict(
            (name, fragment_address(numel=end - first, start=where))
            for name, first, end, where in self.pieces(rank)
        )


class ZeroWriter:
    """The deepspeed engine of a conversion at ZeRO 1-2 (see the module): saves, never trains."""

    #: its tensors are made as they are written: nothing for the save's finiteness check to read; the
    #: conversion's verification then compares the written checkpoint with its source
    holds_state = False
    saves_in_background = False

    def __init__(self, source: Any, recipe: Any, layout: Any, *, device: str) -> None:
        import torch.distributed as dist

        from tessera.engines.deepspeed_engine import PARAM_DTYPE
        from tessera.engines.ds_config import build_ds_config
        from tessera.engines.optim import build_optimizer
        from tessera.models.hf import empty_model, fill_from

        self.layout = layout
        self.device = torch.device("cpu")
        self.sharding = f"{SHARDING_PREFIX}{layout.zero}"
        self.dtype = PARAM_DTYPE[recipe.train.precision]
        self.weights = source.tensors()  # read one parameter at a time as the files are written
        self.model = empty_model(
            source.hf_config(), attn_implementation=source.section.attn_implementation, dtype=self.dtype,
            device="meta",
        )  # fmt: skip
        # the engine's build checks the names and shapes of the source against the model: here too
        fill_from(self.model, self.weights, where=str(source.weights_dir() or "model.hf_config"),
                  copy=lambda t, name: None)  # fmt: skip
        self.config = build_ds_config(recipe, layout, device=device)
        # the optimizer the engine is given, over the meta parameters: its param groups, as DeepSpeed saves them
        self.optimizer = build_optimizer(recipe, self.model.named_parameters(), device=device, offload=False)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.moments: Mapping[str, Mapping[str, torch.Tensor]] | None = None
        self.step = 0

    def import_optimizer(self, moments: Any, step: int) -> None:
        """The moments to write (full tensors by HF name, read as written) and the step; an HF directory's
        (:class:`~tessera.engines.optim.ZeroMoments`, step 0) are written as zeros without reading."""
        self.moments = None if initial_moments(moments, step) else moments
        self.step = step

    def save(self, path: Path) -> None:
        writes = current()
        if writes is None:  # internal: the checkpoint manager saves through a Writes
            raise RuntimeError("the conversion writer saves only inside a checkpoint save")
        files = zero_files(
            self.model, self.optimizer, self.config, zero=self.layout.zero, dp=self.layout.dp, rank=self.rank,
            dtype=self.dtype, weights=self.weights, moments=self.moments, step=self.step,
        )  # fmt: skip
        with lean_construction():  # tensor after tensor read and freed: each one returned when freed
            for name, obj, fills in files:
                writes.add(path / name, obj, lambda o, f, fills=fills: save_filled(o, fills, f))
        if self.rank == 0:
            copy_recovery_scripts(path.parent)

    # ---- the rest of the engine protocol: a writer holds nothing and never trains ---------------------
    def named_groups(self) -> dict[Any, str]:
        return {}

    def held_state(self) -> dict[str, int]:
        return {"params": 0, "grads": 0, "optimizer": 0}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def optimizer_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(())

    def modules(self) -> list[torch.nn.Module]:
        return []

    def close(self) -> None:
        self.weights, self.moments = {}, None

    def train_step(self, micro_batches: Any, step: int) -> Any:  # internal: a writer never trains
        raise RuntimeError("the conversion writer does not train")

    def eval_loss(self, micro_batches: Any) -> Any:
        raise RuntimeError("the conversion writer does not train")

    def load(self, path: Path) -> None:
        raise RuntimeError("the conversion writer does not load")


class _Placeholders:
    """Tensors that take no memory (:func:`tessera.hostmem.zeros`), each with the fill of its bytes."""

    def __init__(self) -> None:
        self.fills: dict[int, Fill] = {}

    def __call__(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, fill: Fill) -> torch.Tensor:
        t = zeros(tuple(shape), dtype)
        if t.numel():
            self.fills[t.untyped_storage()._cdata] = fill
        return t


def zero_files(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    config: dict[str, Any],
    *,
    zero: int,
    dp: int,
    rank: int,
    dtype: torch.dtype,
    weights: Mapping[str, torch.Tensor],
    masters: Mapping[str, torch.Tensor] | None = None,
    moments: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
    step: int = 0,
) -> list[tuple[str, Any, dict[int, Fill]]]:
    """Data-parallel rank ``rank``'s files of a DeepSpeed ZeRO-``zero`` (1-2) checkpoint of ``model`` (on
    the meta device, in ``dtype``) trained by ``optimizer`` (the torch optimizer DeepSpeed is given, whose
    param groups it flattens): (file name, the object DeepSpeed pickles into it, with placeholder tensors;
    the fill of each placeholder's storage by ``_cdata``). The module holds ``weights`` in ``dtype``; the
    fp32 partitions ``masters`` (default: ``weights`` in ``dtype``, as DeepSpeed copies them from the
    module); the Adam moments ``moments`` (default: zeros) at step count ``step``."""
    names = {id(p): n for n, p in model.named_parameters()}  # a tied parameter: its first name
    groups = []
    for g in optimizer.param_groups:
        trained = [p for p in g["params"] if p.requires_grad and p.numel() > 0]  # is_optimized_parameter
        groups.append(FlatGroup(tuple(names[id(p)] for p in trained), tuple(p.shape for p in trained), dp))
    made = _Placeholders()

    def master(name: str) -> torch.Tensor:
        return (masters[name] if masters is not None else weights[name].to(dtype)).to(torch.float32)

    files: list[tuple[str, Any, dict[int, Fill]]] = []
    if rank == 0:
        files.append(
            (
                "mp_rank_00_model_states.pt",
                _model_states(model, groups, weights, zero, config, made),
                made.fills,
            )
        )
    state: dict[int, dict[str, Any]] = {}
    for i, g in enumerate(groups):
        state[i] = {"step": torch.tensor(float(step))}
        for kind in MOMENTS:
            src = moments[kind] if moments is not None else None
            fill = _partition(
                g, rank, g.partition, None if src is None else (lambda n, src=src: src[n].float())
            )
            state[i][kind] = made((g.partition,), torch.float32, fill)
    masters_flat = [  # views of the optimizer's trained flat tensors: saved as requiring grad
        made((n,), torch.float32, _partition(g, rank, n, master)).requires_grad_()
        for g in groups
        for n in [g.partition - g.padding(rank)]  # saved without the padding
    ]
    optim = {
        "optimizer_state_dict": _optimizer_state(
            optimizer, groups, state, masters_flat, zero, dp, rank, dtype, config
        )
    }
    optim.update(ds_config=config, ds_version=_version())
    prefix = "bf16_" if dtype == torch.bfloat16 else ""
    files.append((f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", optim, made.fills))
    return files


def _version() -> str:
    from deepspeed import __version__

    return __version__


def _partition(g: FlatGroup, rank: int, n: int, read: Callable[[str], torch.Tensor] | None) -> Fill:
    """The first ``n`` elements of ``rank``'s partition of group ``g``: each parameter's piece of it read
    with ``read(name)`` (a full fp32 tensor; None: zeros), then the group's padding (zeros)."""

    def fill() -> Iterator[torch.Tensor]:
        if read is None:  # the kernel's zero page: no memory
            yield zeros((n,), torch.float32)
            return
        at = 0
        for name, lo, hi, _ in g.pieces(rank):
            if at >= n:
                return
            k = min(hi - lo, n - at)
            yield read(name).reshape(-1)[lo : lo + k]
            at += k
        if at < n:
            yield zeros((n - at,), torch.float32)

    return fill


def _optimizer_state(
    optimizer: torch.optim.Optimizer,
    groups: list[FlatGroup],
    state: dict[int, dict[str, Any]],
    masters_flat: list[torch.Tensor],
    zero: int,
    dp: int,
    rank: int,
    dtype: torch.dtype,
    config: dict[str, Any],
) -> dict[str, Any]:
    """``DeepSpeedZeroOptimizer.state_dict()`` of a ZeRO 1-2 optimizer (``elastic_checkpoint`` off): the torch
    optimizer's own state dict over one flat partition per group, the fp32 partitions without padding, the
    layout's paddings and fragments, DeepSpeed's loss scaler (static 1.0 outside fp16)."""
    from deepspeed.checkpoint import constants as c
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    param_groups = optimizer.state_dict()["param_groups"]
    for i, group in enumerate(param_groups):
        group["params"] = [i]  # DeepSpeed's groups hold one flat partition each
    scaler = CreateLossScaler(
        dtype=dtype, static_loss_scale=1.0, dynamic_scaling=False, dynamic_loss_args=None
    )
    return {
        c.LOSS_SCALER: scaler,
        "dynamic_loss_scale": scaler.dynamic,
        "overflow": False,
        c.CLIP_GRAD: float(config.get("gradient_clipping", 0.0)),
        c.BASE_OPTIMIZER_STATE: {"state": state, "param_groups": param_groups},
        c.SINGLE_PARTITION_OF_FP32_GROUPS: masters_flat,
        c.ZERO_STAGE: ZeroStageEnum.gradients if zero == 2 else ZeroStageEnum.optimizer_states,
        c.GROUP_PADDINGS: [g.padding(rank) for g in groups],
        c.PARAM_ALIGNMENT_PADDINGS: [[0] * len(g.names) for g in groups],
        c.PARTITION_COUNT: [dp] * len(groups),
        c.DS_VERSION: _version(),
        c.PARAM_SLICE_MAPPINGS: [g.fragments(rank) for g in groups],
    }


def _model_states(
    model: torch.nn.Module,
    groups: list[FlatGroup],
    weights: Mapping[str, torch.Tensor],
    zero: int,
    config: dict[str, Any],
    made: _Placeholders,
) -> dict[str, Any]:
    """The model-states file's object (``DeepSpeedEngine._common_checkpoint_state``): the module's state
    dict (a tied parameter once, under each of its names), the shapes of the flat groups, the tied names,
    the counters of an engine that has not stepped."""
    from deepspeed.runtime.engine import _checkpoint_parallel_metadata

    state = model.state_dict(keep_vars=True)
    owner = {id(t): n for n, t in [*model.named_parameters(), *model.named_buffers()]}
    module: OrderedDict[str, torch.Tensor] = OrderedDict()
    by_id: dict[int, torch.Tensor] = {}
    for key, t in state.items():
        if id(t) not in by_id:
            name = owner.get(id(t), key)
            by_id[id(t)] = made(t.shape, t.dtype, lambda name=name, dt=t.dtype: iter([weights[name].to(dt)]))
        module[key] = by_id[id(t)]
    buffers = {id(b) for _, b in model.named_buffers()}
    first: dict[int, str] = {}
    shared: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):  # DeepSpeed's walk, by identity
        if id(p) in first:
            shared[name] = first[id(p)]
        else:
            first[id(p)] = name
    frozen = OrderedDict() if zero == 2 else None  # ZeRO-2 records the frozen parameters: none here
    return dict(
        module=module,
        buffer_names=[k for k, t in state.items() if id(t) in buffers],
        optimizer=None,
        param_shapes=[OrderedDict(zip(g.names, g.shapes)) for g in groups],
        frozen_param_shapes=frozen,
        shared_params=shared,
        frozen_param_fragments=None if frozen is None else OrderedDict(),
        lr_scheduler=None,
        data_sampler=None,
        random_ltd=None,
        skipped_steps=0,
        global_steps=0,
        global_samples=0,
        dp_world_size=groups[0].dp if groups else 1,
        mp_world_size=1,
        **_checkpoint_parallel_metadata(None),
        ds_config=config,
        ds_version=_version(),
    )


class _Filling:
    """The stream ``torch.save`` writes into under ``skip_data``: it writes the pickle and the records'
    headers itself and asks the stream to ``seek`` past each record's bytes (a storage of no bytes has
    no record); here each seek writes that record's bytes instead, made by its fill."""

    def __init__(self, out: Any, records: list[tuple[int, Fill]]) -> None:
        self._out = out
        self._records = records
        self._next = 0

    def write(self, data: Any) -> int:
        return self._out.write(data)

    def flush(self) -> None:
        self._out.flush()

    def seek(self, n: int, whence: int = 0) -> int:
        if whence != 1 or self._next >= len(self._records) or self._records[self._next][0] != n:
            raise RuntimeError(
                f"torch.save skipped {n} bytes the conversion writer did not expect"
            )  # internal
        _, fill = self._records[self._next]
        self._next += 1
        left = n
        for t in fill():
            b = t.contiguous().reshape(-1).view(torch.uint8)
            if b.numel() > left:
                raise RuntimeError(f"a record's fill is longer than its {n} bytes")  # internal
            self._out.write(memoryview(b.numpy()))
            left -= b.numel()
            del t, b  # before the fill reads its next tensor: one in memory at a time
        if left:
            raise RuntimeError(f"a record's fill is {left} bytes short of {n}")  # internal
        return 0

    def done(self) -> None:
        if self._next != len(self._records):  # internal
            raise RuntimeError(f"torch.save wrote {self._next} of {len(self._records)} records")


def save_filled(obj: Any, fills: Mapping[int, Fill], stream: Any) -> None:
    """``torch.save(obj)`` into ``stream`` with every storage's bytes from its fill in ``fills`` (a
    storage without one: its own bytes), each made when torch reaches its record."""
    storages: dict[int, torch.UntypedStorage] = {}  # torch.save writes them in the order pickle reaches them
    for t in tensors_in(obj):
        storages.setdefault(t.untyped_storage()._cdata, t.untyped_storage())
    records = [
        (s.nbytes(), fills.get(key) or (lambda s=s: iter([torch.tensor([], dtype=torch.uint8).set_(s)])))
        for key, s in storages.items()
        if s.nbytes()
    ]
    filling = _Filling(stream, records)
    with without_zip_crc(), torch.serialization.skip_data():
        torch.save(obj, filling)
    filling.done()


def copy_recovery_scripts(root: Path) -> None:
    """DeepSpeed's ``zero_to_fp32.py`` / ``zero_to_torch.py`` beside the step directories, as its engine's
    save copies them (``_copy_recovery_script``: a copy made executable); a link planted there first goes."""
    import deepspeed

    remove_planted_scripts(root)
    for script in RECOVERY_SCRIPTS:
        dst = root / script
        shutil.copyfile(Path(deepspeed.__file__).parent / "utils" / script, dst)
        dst.chmod(dst.stat().st_mode | stat.S_IEXEC)
