"""megatron-core on CPU: the compatibility patches, applied only when the device is CPU.

megatron-core 0.16.1 is written for CUDA: it asks for the current CUDA device, keeps its
tensor-parallel RNG in CUDA generators, hard-codes ``device="cuda"`` in the pipeline schedules and
grad clipping, creates streams and events, and checks ``param.type()`` strings in its optimizers.
CPU is our test bed, not our target, so each patch below is the smallest change that lets the same
code path run on gloo; on CUDA :func:`apply` is never called and nothing is patched.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False


class _CpuRNGStatesTracker:
    """megatron's RNG tracker (named generator states forked around TP-region dropout / init) on the CPU
    default generator instead of CUDA generators. Same interface: add, fork, get_states, set_states, reset."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


class _CudaDeviceToCpu(TorchFunctionMode):
    """Rewrites ``device="cuda"`` (and cuda devices) in tensor factories to cpu, and ``Tensor.cuda()``
    to a no-op: the pipeline schedules and grad clipping create small bookkeeping tensors on "cuda" by
    name, and the tied LM head of the last pipeline stage is moved with ``.cuda()``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:  # tied embeddings across pipeline stages call .cuda() on the copy
            return args[0]
        dev = kwargs.get("device")
        if dev is not None and torch.device(dev).type == "cuda":
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


class _NoStream:
    """Stands in for torch.cuda.Stream / Event: CPU work is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str):  # record_event() returns an event, and so on
        return lambda *a, **k: _NoStream()

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def apply() -> None:
    """Patch once per process; idempotent. Only for device == "cpu"."""
    global _APPLIED
    if _APPLIED:
        return
    from megatron.core.tensor_parallel import random as mp_random
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    # megatron allocates on torch.cuda.current_device(); "cpu" is a valid device argument
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    # streams, events and syncs: nothing to order on CPU
    torch.cuda.Stream = _NoStream  # type: ignore[assignment,misc]
    torch.cuda.Event = _NoStream  # type: ignore[assignment,misc]
    torch.cuda.current_stream = lambda *a, **k: _NoStream()  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    # the TP RNG tracker on the CPU generator; megatron's own seeding asks CUDA generators for state
    tracker = _CpuRNGStatesTracker()
    mp_random._CUDA_RNG_STATE_TRACKER = tracker
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True  # get_cuda_rng_tracker() now returns ours
    # activation recompute (tensor_parallel.checkpoint) saves and restores the CPU state, the CUDA state
    # and the tracker's: there is no CUDA generator, so its state is an empty placeholder
    mp_random._get_cuda_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)
    mp_random._set_cuda_rng_state = lambda *a, **k: None
    # the causal masks are made on "cuda" by name, also inside tensor_parallel.checkpoint's autograd
    # Function, where the device-rewriting mode below is not active: made on the CPU instead
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as mt_utils

    def causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, device="cpu"), diagonal=1).bool()

    def sliding_window_mask(sq: int, skv: int, window_size: Any) -> torch.Tensor:
        m = torch.ones(sq, skv, dtype=torch.bool, device="cpu")
        return ~torch.tril(
            torch.triu(m, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1]
        )

    for mod in (mt_utils, fused_softmax):
        mod.get_default_causal_mask = causal_mask
        mod.get_sliding_window_causal_mask = sliding_window_mask
    # the optimizers pick fp32 / half paths by type string ("torch.cuda.FloatTensor")
    _orig_type = torch.Tensor.type

    def _type(self: torch.Tensor, *args: Any, **kwargs: Any):
        if args or kwargs:
            return _orig_type(self, *args, **kwargs)
        name = _orig_type(self)
        return name.replace("torch.", "torch.cuda.", 1) if name.count(".") == 1 else name

    torch.Tensor.type = _type  # type: ignore[method-assign]
    # 0.16.1 imports te_general_gemm from TransformerEngine and calls it when the import fails
    moe_utils.te_general_gemm = None
    # the alltoall dispatcher wants split sizes as numpy, but only converts tensors that are on CUDA
    _to_cpu = moe_utils.maybe_move_tensor_to_cpu

    def _to_cpu_numpy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return _to_cpu(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = _to_cpu_numpy
    _CudaDeviceToCpu().__enter__()  # for the life of the process (a rank runs one engine)
    _APPLIED = True


def seed_model_parallel_rng(seed: int, *, tp_rank: int, ep_rank: int, etp_rank: int = 0) -> None:
    """The three named states megatron's ``model_parallel_cuda_manual_seed`` creates, on CPU."""
    from megatron.core.tensor_parallel import random as mp_random

    tracker = mp_random._CUDA_RNG_STATE_TRACKER
    tracker.reset()
    tracker.add(mp_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mp_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)
