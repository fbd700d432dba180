"""Count every collective and point-to-point op of a rank, whoever issues it.

:func:`install` wraps the ``torch.distributed`` functions once per process, before DeepSpeed or
megatron-core is imported (megatron binds ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to
module-level names at import time, so a later wrap would miss them). Each call is attributed to an
op, a group name derived from the layout (``dp``, ``tp``, ``pp``, ``ep``, ``world`` or the ranks), a
dtype, its payload bytes and its duration: for a blocking op the time spent in the call, for an
``async_op=True`` op the time until its ``wait()`` returns (the time the caller was blocked on it).

Payload bytes are what the op moves per rank in the sense the planner predicts (tessera.plan): the
tensor being reduced for all-reduce / reduce / broadcast, the gathered output for all-gather, the
input for reduce-scatter, the input for all-to-all, the tensor for send / recv. Ops issued inside
another counted op (``all_gather_object`` calling ``all_gather``) count once, as the outer op.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# op name -> how to find its payload (positional index or keyword of the tensor(s) that define it)
_OPS: dict[str, tuple[str, int]] = {
    "all_reduce": ("tensor", 0),
    "reduce": ("tensor", 0),
    "broadcast": ("tensor", 0),
    "all_gather": ("tensor_list", 0),  # the outputs
    "all_gather_into_tensor": ("output_tensor", 0),
    "_all_gather_base": ("output_tensor", 0),
    "reduce_scatter": ("input_list", 1),
    "reduce_scatter_tensor": ("input", 1),
    "_reduce_scatter_base": ("input", 1),
    "all_to_all": ("input_tensor_list", 1),
    "all_to_all_single": ("input", 1),
    "send": ("tensor", 0),
    "recv": ("tensor", 0),
    "isend": ("tensor", 0),
    "irecv": ("tensor", 0),
    "gather": ("tensor", 0),
    "scatter": ("tensor", 0),
    "barrier": ("", -1),
    "all_gather_object": ("", -1),
    "broadcast_object_list": ("", -1),
}
# canonical names in the records (torch has several spellings of the same collective)
_CANONICAL = {
    "all_gather_into_tensor": "all_gather",
    "_all_gather_base": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "isend": "send",
    "irecv": "recv",
}


def _nbytes(x: Any) -> int:
    if torch.is_tensor(x):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


_DTYPE_NAMES: dict[Any, str] = {}


def _dtype(x: Any) -> str:
    if torch.is_tensor(x):
        name = _DTYPE_NAMES.get(x.dtype)
        if name is None:
            name = _DTYPE_NAMES[x.dtype] = str(x.dtype).replace("torch.", "")
        return name
    if isinstance(x, (list, tuple)) and x:
        return _dtype(x[0])
    return "-"


@dataclass
class _Agg:
    count: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass
class CommCounter:
    """Per-process tally of the current step, keyed by (op, group, dtype)."""

    namer: Callable[[Any], str] = field(default=lambda group: "world")
    enabled: bool = True
    _step: dict[tuple[str, str, str], _Agg] = field(default_factory=lambda: defaultdict(_Agg))
    _local: threading.local = field(default_factory=threading.local)
    #: seconds of every op counted since the process installed the counter (never reset)
    total_seconds: float = 0.0
    #: the op this rank is blocked in now (op, group, bytes, since), for the heartbeat; None outside ops
    current: tuple[str, str, int, float] | None = None
    #: ops finished since the counter was installed (the heartbeat's sign of progress)
    completed: int = 0

    def describe(self, group: Any, payload: Any) -> tuple[str, int, str]:
        """The group's name, the payload's bytes and dtype: worked out once per call."""
        try:
            name = self.namer(group)
        except Exception:  # naming must never break a collective
            name = "?"
        return name, _nbytes(payload), _dtype(payload)

    def begin(self, op: str, group_name: str, nbytes: int) -> bool:
        """Mark ``op`` as the one in progress, if it is the outermost (nested ops, e.g.
        all_gather_object's, keep the outer one); True when it is (then :meth:`end` clears it)."""
        if self.current is not None:
            return False
        self.current = (op, group_name, nbytes, time.time())
        return True

    def end(self, outermost: bool) -> None:
        if outermost:
            self.current = None
            self.completed += 1

    @contextlib.contextmanager
    def inside(self, op: str, group: Any, payload: Any) -> Iterator[None]:
        """:meth:`begin` ... :meth:`end` around a block (an async op's ``wait()``)."""
        name, nbytes, _ = self.describe(group, payload)
        outermost = self.begin(op, name, nbytes)
        try:
            yield
        finally:
            self.end(outermost)

    def add(self, op: str, group_name: str, dtype: str, nbytes: int, seconds: float) -> None:
        """One call of ``op``: its bytes and seconds into this step's tally."""
        agg = self._step[(op, group_name, dtype)]
        agg.count += 1
        agg.bytes += nbytes
        agg.seconds += seconds
        self.total_seconds += seconds

    def record(self, op: str, group: Any, payload: Any, seconds: float) -> None:
        name, nbytes, dtype = self.describe(group, payload)
        self.add(op, name, dtype, nbytes, seconds)

    def add_seconds(self, op: str, group: Any, payload: Any, seconds: float) -> None:
        name, _, dtype = self.describe(group, payload)
        self._step[(op, name, dtype)].seconds += seconds
        self.total_seconds += seconds

    def pop_step(self) -> list[dict[str, Any]]:
        """This step's ops (sorted), and a fresh tally for the next step."""
        out = [
            {"op": op, "group": grp, "dtype": dt, "count": a.count, "bytes": a.bytes, "seconds": a.seconds}
            for (op, grp, dt), a in sorted(self._step.items())
        ]
        self._step = defaultdict(_Agg)
        return out


_COUNTER: CommCounter | None = None


class _TimedWork:
    """Wraps an async op's Work so that ``wait()`` adds the time the caller was blocked."""

    def __init__(self, work: Any, done: Callable[[float], None], mark: Callable[[], Any]) -> None:
        self._work, self._done, self._mark = work, done, mark

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            with self._mark():  # the heartbeat shows the op a rank is blocked on
                return self._work.wait(*args, **kwargs)
        finally:
            self._done(time.perf_counter() - t0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _wrap(name: str, fn: Callable[..., Any], counter: CommCounter) -> Callable[..., Any]:
    import inspect

    op = _CANONICAL.get(name, name)
    key, pos = _OPS[name]
    params = list(inspect.signature(fn).parameters)
    group_pos = params.index("group") if "group" in params else -1

    def _arg(args: tuple, kwargs: dict, kw: str, i: int) -> Any:
        # callers pass group and tensors by position as often as by keyword (megatron's irecv does)
        if kw in kwargs:
            return kwargs[kw]
        return args[i] if 0 <= i < len(args) else None

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # ~50 collectives a step on a tiny TP layout: the group, bytes and dtype are worked out once
        local = counter._local
        group = _arg(args, kwargs, "group", group_pos)
        payload = _arg(args, kwargs, key, pos) if pos >= 0 else None
        gname, nbytes, dtype = counter.describe(group, payload)
        outermost = counter.begin(op, gname, nbytes)  # the heartbeat says where the rank waits
        if not counter.enabled or getattr(local, "depth", 0):
            try:
                return fn(*args, **kwargs)
            finally:
                counter.end(outermost)
        local.depth = 1
        t0 = time.perf_counter()
        try:
            out = fn(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            local.depth = 0
            counter.end(outermost)
        counter.add(op, gname, dtype, nbytes, dt)
        if (
            out is not None
            and hasattr(out, "wait")
            and (kwargs.get("async_op") or name in ("isend", "irecv"))
        ):
            return _TimedWork(
                out,
                lambda s: counter.add_seconds(op, group, payload, s),
                lambda: counter.inside(op, group, payload),
            )
        return out

    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    wrapper.__name__ = name
    return wrapper


def _wrap_batch(fn: Callable[..., Any], counter: CommCounter) -> Callable[..., Any]:
    """``batch_isend_irecv([P2POp, ...])``: one send / recv record per op in the batch."""

    def wrapper(p2p_op_list: list, *args: Any, **kwargs: Any) -> Any:
        if not counter.enabled or getattr(counter._local, "depth", 0):
            return fn(p2p_op_list, *args, **kwargs)
        counter._local.depth = 1
        t0 = time.perf_counter()
        try:
            works = fn(p2p_op_list, *args, **kwargs)
        finally:
            counter._local.depth = 0
        dt = time.perf_counter() - t0
        for p in p2p_op_list:
            kind = "send" if getattr(p.op, "__name__", "") in ("isend", "send") else "recv"
            counter.record(kind, p.group, p.tensor, dt / max(len(p2p_op_list), 1))
        return works

    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def install(namer: Callable[[Any], str] | None = None) -> CommCounter:
    """Wrap ``torch.distributed`` once per process; later calls only set the group namer."""
    global _COUNTER
    if _COUNTER is None:
        from torch.distributed import distributed_c10d as c10d

        _COUNTER = CommCounter()
        originals: dict[int, Callable[..., Any]] = {}
        for name in _OPS:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            wrapped = _wrap(name, fn, _COUNTER)
            originals[id(fn)] = wrapped
            # both spellings: most callers use torch.distributed.X, some torch.distributed.distributed_c10d.X
            for ns in (dist, c10d):
                if getattr(ns, name, None) is fn:
                    setattr(ns, name, wrapped)
        _rebind_imported(originals)
        if hasattr(dist, "batch_isend_irecv"):
            batched = _wrap_batch(dist.batch_isend_irecv, _COUNTER)
            for ns in (dist, c10d):
                if getattr(ns, "batch_isend_irecv", None) is batched.__wrapped__:
                    ns.batch_isend_irecv = batched
    if namer is not None:
        _COUNTER.namer = namer
    _COUNTER.pop_step()  # a new run starts from an empty tally
    return _COUNTER


def _rebind_imported(wrapped: dict[int, Callable[..., Any]]) -> None:
    """Module-level names that megatron-core or DeepSpeed bound to a ``torch.distributed`` function before
    :func:`install` ran (megatron's ``dist_all_gather_func`` / ``dist_reduce_scatter_func``, which its
    sequence-parallel regions call) now name the wrapper too: a process that imported them first (a
    forkserver that preloads them) still counts every op."""
    import sys

    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith(("megatron.", "deepspeed.")):
            continue
        for attr, value in list(vars(mod).items()):
            if callable(value) and id(value) in wrapped:
                setattr(mod, attr, wrapped[id(value)])


def add_async_seconds(op: str, group: Any, payload: Any, seconds: float) -> None:
    """Time of an async op whose completion is awaited through a future rather than ``wait()`` (DDP's
    comm hooks): added to the op the wrapper already counted. No-op when nothing is installed."""
    if _COUNTER is not None and _COUNTER.enabled:
        _COUNTER.add_seconds(op, group, payload, seconds)


class Phase:
    """A timed block: ``seconds`` of wall time and ``comm_seconds`` of counted collectives inside it (an
    engine's optimizer step, so that the report can split a step into compute, communication and
    optimizer without counting the optimizer's own collectives twice)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.comm_seconds = 0.0

    def __enter__(self) -> Phase:
        self._t0 = time.perf_counter()
        self._c0 = _COUNTER.total_seconds if _COUNTER is not None else 0.0
        return self

    def __exit__(self, *exc: Any) -> None:
        self.seconds += time.perf_counter() - self._t0
        if _COUNTER is not None:
            self.comm_seconds += _COUNTER.total_seconds - self._c0


def group_namer(layout: Any, known: dict[Any, str] | None = None) -> Callable[[Any], str]:
    """Name a process group: first by identity (``known``: the engine's own groups, e.g. megatron's
    expert group, which can hold the same ranks as the dp group), else by the layout axes its members
    differ on (``dp``, ``tp``, ``pp``, or combinations like ``tp+dp``); the default group is ``world``."""
    cache: dict[int, str] = {id(g): n for g, n in (known or {}).items() if g is not None}

    world = layout.axes_of(range(layout.world_size))  # "dp" under pure data parallelism, and so on

    def name(group: Any) -> str:
        if group is None or group is dist.GroupMember.WORLD:
            return world
        key = id(group)
        if key not in cache:
            try:
                ranks = dist.get_process_group_ranks(group)
            except (ValueError, RuntimeError):
                return "unknown"
            cache[key] = layout.axes_of(ranks)
        return cache[key]

    return name
