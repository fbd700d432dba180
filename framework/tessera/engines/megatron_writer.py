"""``tessera convert HF_DIR --to megatron``: the checkpoint written without the model in memory.

A conversion trains nothing: its checkpoint is the source's weights through the weight map and its Adam
state (from an HF directory AdamW's initial state: zero moments, step 0; from a checkpoint, the moments
and step count of its layout-free stage, through the same map). :class:`MegatronWriter` is the megatron engine built
with everything megatron-core allocates on the meta device: the parameters (unfilled), DDP's buffers,
AdamW's moments (its step counts are real: megatron reads them). megatron-core still makes the sharded
state dict and plans the save (keys, sharding, common state: the checkpoint the engine itself writes, a
test compares the two); only the tensors change: each bucket item is made as megatron-core's writer
reaches it, from the source's files through the weight map (a parameter or a moment, or a view of one;
a fresh moment as zeros), and dropped after. Rank 0 then verifies every written tensor against the source,
one group at a time. fp32 runs with megatron's own DDP and optimizer (zero 0) and no adapters; other
layouts convert through the engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tessera.engines.megatron_build import chained, shard_of
from tessera.engines.megatron_engine import MegatronEngine
from tessera.engines.megatron_reader import OPTIM_KEY
from tessera.engines.optim import MOMENTS, initial_moments, set_adam_step
from tessera.hostmem import zeros
from tessera.models.weight_map import compact, hf_to_mcore_thunks


def writer_for(recipe: Any, layout: Any, *, from_hf: bool = True) -> type | None:
    """The writer's class where it can write the layout's checkpoint (megatron's own DDP and optimizer, no
    adapters), from an HF directory or a stage alike, else None (the engine itself converts)."""
    if layout.zero_impl != "megatron" or layout.zero != 0 or recipe.peft is not None:
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
        #: the moments to write (HF-named full tensors, read as written), None: zeros
        self._moments: Any = None
        self._made: dict[tuple[str, int], tuple[torch.Tensor, Callable[[], torch.Tensor]]] | None = None
        self._last: tuple[tuple[str, int] | None, torch.Tensor | None] = (None, None)
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
        """The moments to write and every parameter's step count: an HF directory's (AdamW's initial
        state: :class:`~tessera.engines.optim.ZeroMoments`, step 0) are written as zeros without
        reading; a stage's are read one tensor at a time as megatron-core writes them."""
        self._materialize_optimizer_state()
        self._moments = None if initial_moments(moments, step) else moments
        for opt in chained(self.optimizer):
            set_adam_step(opt.optimizer, step)

    def written(self, item: Any, held: torch.Tensor) -> torch.Tensor:
        """The tensor of bucket item ``item``, whose tensor in the state is ``held`` (no data of its own):
        the part of the parameter or moment ``held`` is a view of (megatron saves SwiGLU's gate and up as
        two views of one parameter, a layer's parameter with a leading layer axis), made from the source
        by the weight map; a fresh moment's zeros. The last tensor made is kept for its next view."""
        m = OPTIM_KEY.match(item.index.fqn)
        kind = m.group(1) if m is not None and m.group(1) in MOMENTS else None
        if kind is not None and self._moments is None:
            return zeros(held.shape, held.dtype)  # no memory: megatron holds each item till the next
        if self._made is None:
            self._made = self._makers()
        base = held
        while base._base is not None:  # a view: of the parameter (or moment) it was cut from
            base = base._base
        key = (kind or "", id(base))
        if key not in self._made:  # or a detached alias
            key = (kind or "", held.untyped_storage()._cdata)
        if key not in self._made or (m is not None and kind is None):  # internal: the map does not make it
            raise RuntimeError(f"the conversion writer has no tensor for {item.index.fqn}")
        whole, make = self._made[key]
        if self._last[0] != key:
            self._last = (None, None)  # the previous tensor goes first
            self._last = (key, compact(make().to(whole.dtype)))
        full = self._last[1]
        assert full is not None and tuple(full.shape) == tuple(whole.shape)
        return full.as_strided(held.shape, held.stride(), held.storage_offset() - whole.storage_offset())

    def close(self) -> None:
        """The tensors kept between the save's items go with the writer."""
        self._last, self._made = (None, None), None
        super().close()

    def _makers(self) -> dict[tuple[str, int], tuple[torch.Tensor, Callable[[], torch.Tensor]]]:
        """("", a parameter's identity or its storage's) -> (the parameter, the function making it from the
        source by the weight map); (moment kind, its state tensor's identity or storage's) -> (that tensor,
        the function making it from the source's moment) when moments are written: the save's tensors are
        these, views of them (by ``_base``) or detached aliases (by storage)."""
        mains = self._main_params().items()  # fp32, megatron's own optimizer: each parameter keys its state
        state = {id(p): opt.optimizer.state[main] for p, (opt, main) in mains if main is not None}
        sources = {
            "": self._hf,
            **({k: self._moments[k] for k in MOMENTS} if self._moments is not None else {}),
        }
        out: dict[tuple[str, int], tuple[torch.Tensor, Callable[[], torch.Tensor]]] = {}
        for vp, c in enumerate(self.chunks):
            shard = shard_of(self.ps, self.layout, vp)
            for kind, src in sources.items():
                thunks = hf_to_mcore_thunks(src, self.adapter, self.hf_config, shard)
                for key, p in c.module.state_dict(keep_vars=True).items():
                    t = p if not kind else state.get(id(p), {}).get(kind)
                    if key in thunks and t is not None:
                        out[(kind, id(t))] = out[(kind, t.untyped_storage()._cdata)] = (t, thunks[key])
        return out

    def train_step(self, micro_batches: Any, step: int) -> Any:  # internal: a writer never trains
        raise RuntimeError("the conversion writer does not train")
