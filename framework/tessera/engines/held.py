"""What a rank really holds of its model states: the parameter, gradient and optimizer tensors, by size.

Read from the engines' own structures (not from the allocator, which also counts activations and
buffers), so it can be compared with the planner's model-state prediction term by term. Gradients are
read at the gradient-accumulation boundary (before the optimizer step frees or reuses them), parameters
and optimizer state after the step (torch's AdamW creates its state lazily at the first step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch


def tensor_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of distinct tensor storages (a view and its base count once; empty ZeRO-3 stubs count 0)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in tensors:
        if not torch.is_tensor(t) or t.numel() == 0:
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def flat_tensors(x: Any) -> list[torch.Tensor]:
    if torch.is_tensor(x):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in flat_tensors(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in flat_tensors(v)]
    return []


def optimizer_bytes(inner: torch.optim.Optimizer, model_params: Iterable[torch.Tensor]) -> int:
    """The optimizer's state tensors plus its own parameters when they are not the model's (fp32 master
    copies / partitions); the scalar ``step`` counters are left out."""
    # views into the model's own storage (megatron's fp32 shards of its parameter buffer) are not copies
    own = {p.untyped_storage().data_ptr() for p in model_params}
    masters = [
        p for g in inner.param_groups for p in g["params"] if p.untyped_storage().data_ptr() not in own
    ]
    state = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return tensor_bytes(masters) + tensor_bytes(state)


def deepspeed_grad_bytes(engine: Any, zero: int) -> int:
    """Gradients DeepSpeed holds at the boundary: ``p.grad`` without ZeRO, the reduced partitions
    (``averaged_gradients``) with it."""
    if zero == 0:
        return tensor_bytes(p.grad for p in engine.module.parameters() if p.grad is not None)
    return tensor_bytes(flat_tensors(getattr(engine.optimizer, "averaged_gradients", {})))


def deepspeed_params_and_optimizer(engine: Any, zero: int) -> dict[str, int]:
    params = list(engine.module.parameters())

    def held(ps: list[Any]) -> int:
        if zero >= 3:  # the partition, plus the full data of persistent parameters
            return tensor_bytes([p.ds_tensor for p in ps if hasattr(p, "ds_tensor")] + ps)
        return tensor_bytes(ps)

    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    masters = flat_tensors(getattr(opt, "fp32_partitioned_groups_flat", [])) if zero >= 3 else []
    return {
        "params": held(params),
        "optimizer": optimizer_bytes(inner, params) + tensor_bytes(masters),
        "frozen": held([p for p in params if not p.requires_grad]),  # a frozen base (adapters), of params
    }


def megatron_grad_bytes(chunks: Iterable[Any]) -> int:
    """megatron DDP's gradient buffers (fp32 with grad_reduce_in_fp32), dense and expert."""
    bufs = [b for c in chunks for b in (*c.buffers, *getattr(c, "expert_parallel_buffers", []))]
    return tensor_bytes(b.grad_data for b in bufs)


def megatron_params_and_optimizer(chunks: Iterable[Any], optimizer: Any) -> dict[str, int]:
    params = [p for c in chunks for p in c.parameters()]
    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    return {
        "params": tensor_bytes(params),
        "optimizer": sum(optimizer_bytes(o.optimizer, params) for o in opts),
        "frozen": tensor_bytes(p for p in params if not p.requires_grad),  # a frozen base (adapters)
    }


# ---- activations ---------------------------------------------------------------------------------------


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter, or a view of one (``weight.t()`` saved by a matmul; ZeRO-3's gathered weights)."""
    while t is not None:
        if isinstance(t, torch.nn.Parameter):
            return True
        t = t._base
    return False


class SavedActivations:
    """Bytes autograd saves for backward per micro-batch, measured with saved-tensor hooks.

    Armed for one step (the first of a process: later steps run without hooks), an engine wraps each
    micro-batch's forward and loss in :meth:`micro_batch`; every tensor autograd saves then passes the
    pack hook, which counts its storage once (a view and its base, or one tensor saved by two ops, are
    one storage) and leaves parameters and their views out. With checkpointed layers (recompute) the
    saves inside a checkpoint are the checkpoint's own business: what it keeps, the layer input, is what
    the hook sees. ``per_micro_batch`` is the largest micro-batch (of one model chunk, with virtual
    pipeline stages); None until a step was measured."""

    def __init__(self) -> None:
        self.armed = False
        self.per_micro_batch: int | None = None
        self._param_storages: set[int] = set()

    def arm(self, modules: Iterable[torch.nn.Module]) -> None:
        self._param_storages = {p.untyped_storage().data_ptr() for m in modules for p in m.parameters()}
        self.per_micro_batch = None  # a new measurement (the harness runs several runs per process)
        self.armed = True

    def disarm(self) -> None:
        self.armed = False
        self._param_storages = set()

    @contextlib.contextmanager
    def micro_batch(self) -> Iterator[None]:
        if not self.armed:
            yield
            return
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key and key not in seen and key not in self._param_storages and not _is_parameter(t):
                seen[key] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.per_micro_batch = max(self.per_micro_batch or 0, sum(seen.values()))


#: the process's meter: the training loop arms it, the engines' micro-batch loops report to it
ACTIVATIONS = SavedActivations()
