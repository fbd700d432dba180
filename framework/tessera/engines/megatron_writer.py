"""``tessera convert HF_DIR --to megatron``: the checkpoint written without the model in memory.

A conversion from an HF directory trains nothing: its checkpoint is the HF weights through the weight
map and AdamW's initial state (zero moments, step 0). :class:`MegatronWriter` is the megatron engine built
with everything megatron-core allocates on the meta device: the parameters (unfilled), DDP's buffers,
AdamW's moments (its step counts are real: megatron reads them). megatron-core still makes the sharded
state dict and plans the save (keys, sharding, common state: the checkpoint the engine itself writes, a
test compares the two); only the tensors change: each bucket item is made as megatron-core's writer
reaches it, from the HF files through the weight map (a parameter, or a view of one) or as zeros (a
moment), and dropped after. Rank 0 then verifies every written tensor against the HF directory, one group
at a time. fp32 runs with megatron's own DDP and optimizer (zero 0) and no adapters; other layouts
convert through the engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tessera.engines.megatron_build import chained, shard_of
from tessera.engines.megatron_engine import MegatronEngine
from tessera.engines.megatron_reader import OPTIM_KEY
from tessera.hostmem import zeros
from tessera.models.weight_map import compact, hf_to_mcore_thunks


def writer_for(recipe: Any, layout: Any, *, from_hf: bool = True) -> type | None:
    """The writer's class where it can write the layout's checkpoint (from an HF directory, megatron's own
    DDP and optimizer, no adapters), else None (the engine itself converts)."""
    if not from_hf or layout.zero_impl != "megatron" or layout.zero != 0 or recipe.peft is not None:
        return None
    if recipe.train.precision != "fp32":  # bf16: megatron's fp32 masters are copies (not written yet)
        return None
    from tessera.device import resolve_device

    # on a GPU host the ranks' process group is NCCL, which the writer's CPU paths do not drive
    return MegatronWriter if resolve_device(recipe.run.device) == "cpu" else None


@contextlib.contextmanager
def _on_meta() -> Iterator[None]:
    """megatron-core allocates parameters and DDP's buffers on ``torch.cuda.current_device()``: on the
    meta device while the writer is built."""
    before = torch.cuda.current_device
    torch.cuda.current_device = lambda: "meta"  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.current_device = before  # type: ignore[assignment]


class MegatronWriter(MegatronEngine):
    """The megatron engine of a conversion from an HF directory (see the module): saves, never trains."""

    fills = False
    #: its tensors are made as they are written (nothing for the save's finiteness check to read); rank 0's
    #: verification compares each written tensor with the HF directory's, bit for bit
    holds_state = False

    def __init__(self, source: Any, recipe: Any, layout: Any, *, device: str) -> None:
        self._hf = source.tensors()  # read part by part as each tensor is written
        self._made: dict[int, tuple[torch.Tensor, Callable[[], torch.Tensor]]] | None = None
        self._last: tuple[int | None, torch.Tensor | None] = (None, None)
        # everything megatron-core allocates on the meta device: the parameters (it initialises them
        # where it makes them), DDP's buffers, the optimizer's state. A CPU parameter would also be copied
        # by its save planning when it is a view of a larger one (SwiGLU's gate and up halves of every
        # layer: all held until written); a meta one it leaves as it is
        from tessera.engines import cpu_shim

        cpu_shim.apply()  # nothing runs: no device is needed (megatron's CPU paths, set before the patch)
        with _on_meta():
            super().__init__(source, recipe, layout, device="cpu")

    def _materialize_optimizer_state(self) -> None:
        """AdamW's state as it is before its first step, without memory: moments on the meta device (the
        checkpoint's are written as zeros) and real step counts (megatron reads them)."""
        for opt in chained(self.optimizer):
            inner = opt.optimizer
            for group in inner.param_groups:
                for p in group["params"]:
                    if not inner.state[p]:
                        inner.state[p].update(
                            step=torch.zeros((), dtype=torch.float32),
                            exp_avg=torch.empty_like(p),
                            exp_avg_sq=torch.empty_like(p),
                        )

    def import_optimizer(self, moments: Any, step: int) -> None:
        """A conversion from an HF directory starts at AdamW's initial state: its moments are written as
        zeros, its step is 0."""
        if step != 0:  # internal: only an HF directory converts through the writer
            raise RuntimeError(f"the conversion writer starts at step 0, not {step}")
        self._materialize_optimizer_state()

    def written(self, item: Any, held: torch.Tensor) -> torch.Tensor:
        """The tensor of bucket item ``item``, whose tensor in the state is ``held`` (no data of its own):
        a moment's zeros; else the part of the parameter ``held`` is a view of (megatron saves SwiGLU's
        gate and up as two views of one parameter, a layer's parameter with a leading layer axis), made
        from the HF files by the weight map. The last parameter made is kept for its next view."""
        m = OPTIM_KEY.match(item.index.fqn)
        if m is not None and m.group(1) in ("exp_avg", "exp_avg_sq"):
            return zeros(held.shape, held.dtype)  # no memory: megatron holds each item till the next
        if self._made is None:
            self._made = self._makers()
        base = held
        while base._base is not None:  # a view: of the parameter it was cut from
            base = base._base
        ptr = id(base) if id(base) in self._made else held.untyped_storage()._cdata  # or a detached alias
        if ptr not in self._made or m is not None:  # internal: megatron saved a tensor the map does not make
            raise RuntimeError(f"the conversion writer has no tensor for {item.index.fqn}")
        param, make = self._made[ptr]
        if self._last[0] != ptr:
            self._last = (None, None)  # the previous parameter goes first
            self._last = (ptr, compact(make().to(param.dtype)))
        full = self._last[1]
        assert full is not None and tuple(full.shape) == tuple(param.shape)
        return full.as_strided(held.shape, held.stride(), held.storage_offset() - param.storage_offset())

    def close(self) -> None:
        """The tensors kept between the save's items go with the writer."""
        self._last, self._made = (None, None), None
        super().close()

    def _makers(self) -> dict[int, tuple[torch.Tensor, Callable[[], torch.Tensor]]]:
        """Each parameter, by identity and by its storage's, -> (the parameter, the function making it from
        the HF files by the weight map): the save's tensors are the parameters, views of them (by
        ``_base``) or detached aliases (by storage)."""
        out: dict[int, tuple[torch.Tensor, Callable[[], torch.Tensor]]] = {}
        for vp, c in enumerate(self.chunks):
            shard = shard_of(self.ps, self.layout, vp)
            thunks = hf_to_mcore_thunks(self._hf, self.adapter, self.hf_config, shard)
            for key, t in c.module.state_dict(keep_vars=True).items():
                if key in thunks:
                    out[id(t)] = out[t.untyped_storage()._cdata] = (t, thunks[key])
        return out

    def train_step(self, micro_batches: Any, step: int) -> Any:  # internal: a writer never trains
        raise RuntimeError("the conversion writer does not train")
