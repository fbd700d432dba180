"""DeepSpeed ZeRO, as both engines use it: ``deepspeed.initialize`` on the config built from the recipe and
the user's JSON (:mod:`tessera.engines.ds_config`), the gradient-accumulation step loop, the model-state
accounting, and its checkpoint save / load.

The deepspeed engine runs it on the HF module over the whole world; the megatron engine runs it on a
megatron-core model over megatron's data-parallel group (``mpu``), for ZeRO 1-3 with pp = 1.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from tessera.comm.accounting import Phase
from tessera.config.schema import Recipe
from tessera.engines.ds_config import build_ds_config
from tessera.engines.held import (
    ACTIVATIONS,
    deepspeed_grad_bytes,
    deepspeed_params_and_optimizer,
    flat_tensors,
)
from tessera.engines.optim import (
    LRSchedule,
    adam_state,
    build_optimizer,
    materialize_adam_state,
    set_adam_step,
)
from tessera.errors import CheckpointError
from tessera.plan.layout import ParallelLayout
from tessera.safeload import into_memory
from tessera.writes import current, torch_save

#: the checkpoint ``sharding`` of DeepSpeed ZeRO: this prefix and the stage ("deepspeed-zero2")
SHARDING_PREFIX = "deepspeed-zero"


class DeepSpeedRunner:
    """``deepspeed.initialize`` on ``model`` plus the step loop: one ``step`` = one optimizer update."""

    def __init__(
        self, model: torch.nn.Module, recipe: Recipe, layout: ParallelLayout, *, device: str, mpu: Any = None
    ) -> None:
        import deepspeed

        self.layout = layout
        self.config = build_ds_config(recipe, layout, device=device)
        optimizer = build_optimizer(
            recipe, model.named_parameters(), device=device, offload=layout.offload_optimizer
        )
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=self.config, mpu=mpu
        )
        _load_safely(self.engine)
        #: a frozen base under adapters: checkpoints hold only what trains
        self.frozen = any(not p.requires_grad for p in model.parameters())
        self.schedule = LRSchedule(recipe)
        self._grads_held: int | None = None
        self.sharding = f"{SHARDING_PREFIX}{layout.zero}"
        #: the last step's optimizer step (the boundary ``engine.step()``), timed
        self.optimizer_phase = Phase()

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    def step(
        self,
        micro_batches: list[dict[str, torch.Tensor]],
        scale: float,
        loss_of: Callable[[Any, dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor | None]],
        *,
        dp_group: Any = None,
        around: Callable[[], Any] = contextlib.nullcontext,
    ) -> tuple[torch.Tensor, float | None, torch.Tensor | None]:
        """Forward / backward every micro-batch (``loss_of(engine, mb)``: its summed token loss and the
        load-balancing loss or None, added unscaled: DeepSpeed averages it over micro-batches and dp), step
        at the boundary. Returns the loss summed over the micro-batches and the data-parallel ranks
        (``dp_group``, None: every rank, each sp rank's slice of the rows included; its all-reduce runs
        while the optimizer steps), the pre-clip global grad norm and this rank's load-balancing loss
        summed over its micro-batches (None without one). ``around``: a context each micro-batch's
        forward and backward run in (the long-sequence components' checkpoint offload)."""
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.engine.device)
        aux_sum: torch.Tensor | None = None
        manual_norm = None
        self.engine.train()
        self.optimizer_phase = Phase()
        for i, mb in enumerate(micro_batches):
            with around():
                with ACTIVATIONS.micro_batch():
                    token_loss, aux = loss_of(self.engine, mb)
                loss_sum += token_loss.detach()  # stays on the device: no sync per micro-batch
                objective = token_loss * scale
                if aux is not None:
                    objective = objective + aux
                    aux_sum = aux.detach() if aux_sum is None else aux_sum + aux.detach()
                self.engine.backward(objective)
            if i < len(micro_batches) - 1:
                self.engine.step()  # not a boundary: DeepSpeed only counts the micro-step
                continue
            if self._grads_held is None:  # gradients exist only here; measured once
                self._grads_held = deepspeed_grad_bytes(self.engine, self.layout.zero)
            if self.layout.data_ranks > 1:  # the reported loss, summed over dp (and sp) in the background
                pending = torch.distributed.all_reduce(loss_sum, group=dp_group, async_op=True)
            with self.optimizer_phase:  # the boundary: clip, (ZeRO) reduce, update, (ZeRO) gather
                if self.layout.zero == 0:
                    # without ZeRO, DeepSpeed clips but does not keep the norm; gradients are all-reduced
                    # by now (backward at the boundary), so the pre-clip norm is the same on every rank
                    manual_norm = _grad_norm(self.engine.module.parameters())
                self.engine.step()
            if self.layout.data_ranks > 1:
                pending.wait()
        norm = self.engine.get_global_grad_norm() if manual_norm is None else manual_norm
        return loss_sum, None if norm is None else float(norm), aux_sum

    def held_state(self) -> dict[str, int]:
        return {
            "grads": self._grads_held or 0,
            **deepspeed_params_and_optimizer(self.engine, self.layout.zero),
        }

    def optimizer_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        opt = self.engine.optimizer
        inner = getattr(opt, "optimizer", opt)
        for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
            for i, t in enumerate(flat_tensors(getattr(opt, attr, []))):
                yield f"{attr}[{i}]", t
        for i, st in enumerate(inner.state.values()):
            for k, v in st.items():
                if torch.is_tensor(v):
                    yield f"optimizer.state[{i}].{k}", v

    def import_optimizer(
        self, params: Iterable[tuple[torch.nn.Parameter, dict[str, torch.Tensor]]], step: int
    ) -> None:
        """Adam moments from full tensors per module parameter, through DeepSpeed's own tensor-fragment
        API (``safe_set_full_optimizer_state``: the partition of the flat fp32 state each rank owns, ZeRO
        1-3); without ZeRO the torch optimizer keys its state by the parameters themselves."""
        from deepspeed.utils import safe_set_full_optimizer_state

        opt = self.engine.optimizer
        inner = getattr(opt, "optimizer", opt)
        materialize_adam_state(inner)  # AdamW creates its state lazily; DeepSpeed links to it when it exists
        for flat in getattr(opt, "fp32_partitioned_groups_flat", []):  # ZeRO-3 fills param_groups per step
            adam_state(inner, flat)
        if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):  # ZeRO 1-2: map fragments onto the state
            opt._lazy_init_hp_params_optimizer_state()
        with torch.no_grad():
            for p, full in params:
                for kind, value in full.items():
                    if self.layout.zero == 0:
                        adam_state(inner, p)[kind].copy_(value)
                    else:
                        safe_set_full_optimizer_state(p, value.to(p.device, torch.float32), kind)
        set_adam_step(inner, step)

    @property
    def saves_in_background(self) -> bool:
        """True with Tessera's checkpoint engine (DeepSpeed's torch engine made safe); a user's JSON that
        chose another one (nebula, fast, decoupled) keeps it, and its saves stay synchronous."""
        return isinstance(self.engine.checkpoint_engine, safe_checkpoint_engine_class())

    def save(self, path: Path) -> None:
        # DeepSpeed's own format (pickled .pt files); Tessera's state goes in meta.json, not client_state
        remove_planted_scripts(path.parent)
        # a frozen base (adapters) is not saved: the model source rebuilds it, meta.json records which
        self.engine.save_checkpoint(
            str(path.parent),
            tag=path.name,
            client_state={},
            save_latest=False,
            exclude_frozen_parameters=self.frozen,
        )

    def load(self, path: Path) -> None:
        """Model and optimizer (no scheduler: the LR is a function of the step). DeepSpeed reads its
        files through its checkpoint engine, which :func:`_load_safely` made an allow-listed
        ``weights_only`` load; the checkpoint manager has verified their checksums and scanned their
        pickles before this runs."""
        opt = self.engine.optimizer
        inner = getattr(opt, "optimizer", opt)
        # the moments the engine holds now (DeepSpeed makes them at construction): the load replaces them
        # with the checkpoint's, and they become the memory those are copied into (into_memory's reuse)
        replaced = [v for st in inner.state.values() for v in st.values() if torch.is_tensor(v)]
        loaded, _ = self.engine.load_checkpoint(
            str(path.parent),
            tag=path.name,
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
            load_module_strict=not self.frozen,  # the frozen base is not in it (the model source has it)
        )
        if loaded is None:
            raise CheckpointError(
                "DeepSpeed found no checkpoint to load",
                field="checkpoint",
                value=str(path),
                fix="resume with the engine and layout that wrote it (see its meta.json)",
            )
        # the optimizer keeps the moments its load handed it; on CPU (a CPU run, ZeRO-Offload) those map
        # this checkpoint's file (:class:`SafeTorchCheckpointEngine` loads mapped): copied once, here
        into_memory(inner.state, reuse=replaced)


#: the recovery scripts DeepSpeed's save copies beside the step directories (from ``deepspeed/utils``)
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


def remove_planted_scripts(root: Path) -> None:
    """Rank 0 of DeepSpeed copies its recovery scripts beside the step dirs with shutil.copyfile, which
    writes through a link: a link planted there goes first (the copy is then a file of its own)."""
    for script in RECOVERY_SCRIPTS:
        if (root / script).is_symlink():
            (root / script).unlink(missing_ok=True)


def _load_safely(engine: Any) -> None:
    """DeepSpeed's checkpoint engine is pluggable (``engine.checkpoint_engine``, chosen from its config);
    its default, ``TorchCheckpointEngine``, loads with ``torch.load(weights_only=False)``, so a replaced
    shard would run code. Every load of model, optimizer and expert states goes through this object, so
    it becomes the same engine whose ``load`` is :func:`tessera.safeload.safe_torch_load` (``weights_only``
    with the allow-list; anything else is a CheckpointError naming the file and the class). The other
    engines a user's JSON may choose call ``torch.load`` without ``weights_only=False`` (torch's default is
    True) and stay as they are."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    current = getattr(engine, "checkpoint_engine", None)
    if type(current) is TorchCheckpointEngine:
        cls = safe_checkpoint_engine_class()
        safe = cls.__new__(cls)
        safe.__dict__.update(current.__dict__)  # its serialization settings, as DeepSpeed configured it
        engine.checkpoint_engine = safe


@functools.cache
def safe_checkpoint_engine_class() -> type:
    """The class is made on first use: it derives from DeepSpeed's, imported only with an engine."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from tessera.safeload import safe_torch_load

    class SafeTorchCheckpointEngine(TorchCheckpointEngine):
        """DeepSpeed's torch checkpoint engine, loading with ``weights_only=True`` and the allow-list."""

        def load(self, path: str, map_location: Any = None) -> Any:
            # mapped, not read: DeepSpeed's ZeRO 1-2 load opens every rank's partition file on every rank
            # and keeps its own, and reads the model states file twice (once only to check its model-
            # parallel size); a mapped file costs only the pages used (the checkpoint manager's
            # verification has just read them into the page cache). Any map_location: torch applies it to
            # each mapped storage (DeepSpeed passes an identity function, a device, or nothing; a GPU
            # location copies the mapped pages to the device). torch maps zip-format files only.
            import zipfile

            return safe_torch_load(path, map_location=map_location, mmap=zipfile.is_zipfile(path))

        def save(self, state_dict: Any, path: str) -> None:
            """Inside a Tessera checkpoint save, the file goes to that save (:mod:`tessera.writes`):
            hashed while ``torch.save`` writes it, and written from a snapshot by the save's thread when
            the save is asynchronous; otherwise DeepSpeed's own ``torch.save`` to the path."""
            writes = current()
            if writes is None:
                super().save(state_dict, path)
                return
            zipfile = self.zipfile_serialization
            writes.add(
                Path(path),
                state_dict,
                lambda obj, f: torch_save(obj, f, _use_new_zipfile_serialization=zipfile),
            )

        def preserves_storage_sharing(self) -> bool:
            # DeepSpeed clones a state dict before a save when the engine would keep views of flat
            # buffers; a background save's snapshot copies every tensor on its own already
            writes = current()
            return writes is None or not writes.background

    return SafeTorchCheckpointEngine


def _grad_norm(params: Iterator[torch.nn.Parameter]) -> float:
    sq = None
    for p in params:
        if p.grad is not None:
            part = p.grad.detach().double().pow(2).sum()
            sq = part if sq is None else sq + part
    return 0.0 if sq is None else float(sq.sqrt())
