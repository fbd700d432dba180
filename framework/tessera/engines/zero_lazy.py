"""DeepSpeed ZeRO 1-3 checkpoints read one parameter at a time, in memory that does not grow with the model.

DeepSpeed's ``zero_to_fp32`` merges the fp32 master partitions of every rank into full tensors: for ZeRO
1-2 it first ``torch.cat``s each parameter group's partitions into one vector (the whole model in
memory, "memory usage doubles here" in its own words); for ZeRO-3 it makes a lazy ``GatheredTensor`` per
parameter, which still reads through a mapping of the files. Both keep every page they touch resident
while the files stay mapped. :class:`ZeroTensors` plans where each parameter's elements lie in the
partition files (the same layout ``zero_to_fp32`` walks: the partitions of a group laid end to end, each
parameter after the previous one and its alignment padding; for ZeRO-3 each rank's equal share of every
parameter, padded) and reads them on access straight from the files with ``readinto``, one parameter at
a time. Written by hand because DeepSpeed has no per-parameter merge for ZeRO 1-2 and no reader that does
not map the files. The partition files are loaded with ``mmap=True`` (the allow-list, nothing read but
the pickles): only to learn, from where each tensor's storage lies in the mapping, where its bytes are in
the file; the mapping's pages are never read. Buffers, frozen parameters and tied names come from
DeepSpeed's own merge of the model-states files (small, or the frozen base of an adapter run, as before).
"""

from __future__ import annotations

import contextlib
import io
import math
import struct
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from tessera.errors import CheckpointError
from tessera.safeload import FIX as SAFE_FIX
from tessera.safeload import forced_weights_only, safe_torch_load

#: (file, byte offset of the first element, elements): one contiguous run of a parameter's elements
Piece = tuple[Path, int, int]


def model_states(ckpt: Path, mp: int | None = None) -> list[Any]:
    """DeepSpeed's parse of the model-states files (buffers, parameter shapes, frozen parameters, tied
    names), of model-parallel rank ``mp`` only where given. zero_to_fp32 calls torch.load(weights_only=
    False) itself and takes no loader: torch's own switch makes that load weights_only (with the
    allow-list) for this call; one file at a time, so a refusal names the file."""
    from deepspeed.utils import zero_to_fp32 as z

    states: list[Any] = []
    for f in _of_rank(z.get_model_state_files(str(ckpt)), mp):
        with forced_weights_only(f):
            states += z.parse_model_states([f])
    return states


def flat_partitions(
    ckpt: Path, zero: int, kind: str | None, mp: int | None = None
) -> Iterator[tuple[Path, Any, list[torch.Tensor], Any]]:
    """Per data-parallel rank, in rank order: (its optim-states file, the file's loaded object, its flat
    fp32 partitions of the master weights (``kind`` None) or of that Adam moment, one per parameter group,
    the alignment paddings). ZeRO 1-3 keep each moment as flat partitions laid out exactly like the
    masters (the optimizer steps on those flat tensors). DeepSpeed's own pickles, verified and scanned
    first, loaded with weights_only, the allow-list and ``mmap=True`` (nothing read but the pickle)."""
    from deepspeed.checkpoint.constants import (
        FP32_FLAT_GROUPS,
        OPTIMIZER_STATE_DICT,
        PARAM_ALIGNMENT_PADDINGS,
        SINGLE_PARTITION_OF_FP32_GROUPS,
    )
    from deepspeed.utils import zero_to_fp32 as z

    for f in _of_rank(z.get_optim_files(str(ckpt)), mp):
        whole = safe_torch_load(f, map_location="cpu", mmap=True)
        sd = whole[OPTIMIZER_STATE_DICT]
        if kind is None:
            flats = sd[SINGLE_PARTITION_OF_FP32_GROUPS if zero <= 2 else FP32_FLAT_GROUPS]
        else:
            state = (sd.get("base_optimizer_state") or sd["optimizer_state_dict"])["state"]  # ZeRO 1-2 / 3
            flats = [state[g][kind] for g in sorted(state)]
        yield Path(f), whole, list(flats), sd.get(PARAM_ALIGNMENT_PADDINGS)


def _of_rank(files: list[str], mp: int | None) -> list[str]:
    return [f for f in files if mp is None or f"mp_rank_{mp:02d}_" in Path(f).name]


class ZeroTensors(Mapping[str, torch.Tensor]):
    """The full fp32 tensors of a ZeRO 1-3 checkpoint (``kind`` None: the master weights, with buffers,
    frozen parameters and tied names as ``zero_to_fp32`` gives them; else that Adam moment of every
    trainable parameter), each read from the partition files when asked for and not kept. ``mp``: the
    files of that model-parallel rank only. ``plan`` is None when the files' layout is not the one this
    reader knows: the caller merges through DeepSpeed instead."""

    def __init__(self, ckpt: Path, zero: int, kind: str | None, mp: int | None = None) -> None:
        from deepspeed.utils import zero_to_fp32 as z

        states = model_states(ckpt, mp)
        groups: list[list[tuple[Path, int, int]] | None] = []  # per rank, per group: (file, offset, numel)
        paddings = None
        for f, whole, flats, pads in flat_partitions(ckpt, zero, kind, mp):
            groups.append(_locate(f, flats, list(tensors_in(whole))))
            paddings = pads  # the same in every rank's file
            del whole, flats
        shapes = states[0].param_shapes
        located = [g for g in groups if g is not None]
        plan = None
        if located and len(located) == len(groups):
            plan = _zero2_plan(located, shapes, paddings) if zero <= 2 else _zero3_plan(located, shapes)
        self.plan = plan
        self._small: dict[str, torch.Tensor] = {}
        self._tied: dict[str, str] = {}
        if kind is None:  # buffers and frozen parameters: DeepSpeed's own merge of the model states
            with contextlib.redirect_stdout(io.StringIO()):
                self._small.update(states[0].buffers)
                if zero <= 2:
                    z._zero2_merge_frozen_params(self._small, states)
                else:
                    z._zero3_merge_frozen_params(self._small, len(groups), states)
            self._tied = {a: b for a, b in states[0].shared_params}
        self._keys = list(self._small) + list(plan or {})
        self._keys += [a for a, b in self._tied.items() if b in self._keys and a not in self._keys]

    def __getitem__(self, name: str) -> torch.Tensor:
        name = self._own(name)
        if name in self._small:
            return self._small[name].to(torch.float32, copy=True)
        assert self.plan is not None
        pieces, shape = self.plan[name]
        return _read_pieces(pieces, torch.empty(math.prod(shape), dtype=torch.float32)).view(shape)

    def part(self, name: str, index: tuple[int | slice, ...]) -> torch.Tensor:
        """``self[name][index]`` where ``index`` is a range of leading rows (a slice of step 1) read alone:
        those rows are one run of the parameter's flat elements; any other index reads the tensor."""
        own = self._own(name)
        rows = index[0] if len(index) == 1 and isinstance(index[0], slice) else None
        if own in self._small or rows is None or rows.step not in (None, 1) or self.plan is None:
            return self[name][index]
        pieces, shape = self.plan[own]
        lo, hi, _ = rows.indices(shape[0] if shape else 1)
        per, n = math.prod(shape[1:]), max(0, hi - lo)
        out = torch.empty(n * per, dtype=torch.float32)
        return _read_pieces(_split(pieces, lo * per, n * per), out).view(n, *shape[1:])

    def shape_of(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, from the plan and the model states (nothing read)."""
        own = self._own(name)
        return tuple(self._small[own].shape) if own in self._small else tuple(self.plan[own][1])  # type: ignore[index]

    def _own(self, name: str) -> str:
        """The name a tied name's tensor is kept under."""
        known = name in self._small or name in (self.plan or {})
        return name if known else self._tied.get(name, name)

    def shapes(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """Name -> (shape, dtype as read: fp32), from the plan and the model states (nothing read)."""
        known = {k: (t.shape, torch.float32) for k, t in self._small.items()}
        known.update({k: (shape, torch.float32) for k, (_, shape) in (self.plan or {}).items()})
        return {k: known[k] if k in known else known[self._tied[k]] for k in self._keys}

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a checkpoint object (dicts, lists, tuples), in the order pickle reaches them: dicts
    in insertion order, lists and tuples in order."""
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v)


def _locate(
    f: Path, flats: list[torch.Tensor], every: list[torch.Tensor]
) -> list[tuple[Path, int, int]] | None:
    """Where each flat fp32 tensor's bytes start in ``f`` (a torch zip archive loaded with ``mmap=True``:
    one mapping of the whole file, so a storage's address less the mapping's start is its record's data
    offset). ``every``: all tensors the archive's pickle holds; their storages must be exactly its data
    records, the lowest at the first, or None (read through DeepSpeed) where anything does not line up."""
    if any(t.dtype != torch.float32 or not t.is_contiguous() for t in flats):
        return None
    records: dict[int, int] = {}
    with open(f, "rb") as fh, zipfile.ZipFile(fh) as z:
        for i in z.infolist():
            if (
                "/data/" not in i.filename
                or i.filename.endswith(".pkl")
                or i.compress_type != zipfile.ZIP_STORED
            ):
                continue
            fh.seek(i.header_offset)
            head = fh.read(30)
            if head[:4] != b"PK\x03\x04":
                return None
            name_len, extra_len = struct.unpack("<HH", head[26:30])
            records[i.header_offset + 30 + name_len + extra_len] = i.file_size
    if not records:
        return None
    starts = {t.untyped_storage().data_ptr() for t in every if t.untyped_storage().nbytes()}
    base = min(starts) - min(records) if starts else 0
    if {s - base for s in starts} != set(records):
        return None
    out = []
    for t in flats:
        off = t.data_ptr() - base
        rec = max(o for o in records if o <= off)
        if off + t.numel() * 4 > rec + records[rec]:
            return None
        out.append((f, off, t.numel()))
    return out


def _split(parts: list[tuple[Path, int, int]], start: int, n: int) -> list[Piece]:
    """Elements ``[start, start + n)`` of the flat tensors ``parts`` laid end to end, as runs per tensor."""
    pieces: list[Piece] = []
    at = 0
    for f, offset, numel in parts:
        lo, hi = max(start, at), min(start + n, at + numel)
        if lo < hi:
            pieces.append((f, offset + (lo - at) * 4, hi - lo))
        at += numel
    if sum(p[2] for p in pieces) != n:
        raise CheckpointError(
            "a ZeRO parameter runs past the end of its partitions",
            field="checkpoint",
            value=str(parts[0][0]) if parts else "",
            fix=SAFE_FIX,
        )
    return pieces


def _zero2_plan(
    groups: list[list[tuple[Path, int, int]]], shapes: list[dict[str, Any]], paddings: Any
) -> dict[str, tuple[list[Piece], torch.Size]]:
    """ZeRO 1-2: a group's partitions (rank 0's, rank 1's, ...) laid end to end hold its parameters in
    order, each followed by its alignment padding (``zero_to_fp32._zero2_merge_trainable_params``)."""
    plan: dict[str, tuple[list[Piece], torch.Size]] = {}
    for g, group in enumerate(shapes):
        parts = [rank[g] for rank in groups]
        offset = 0
        pads = paddings[g] if paddings is not None else None
        for k, (name, shape) in enumerate(group.items()):
            size = torch.Size(shape)
            plan[name] = (_split(parts, offset, size.numel()), size)
            offset += size.numel() + (pads[k] if pads is not None else 0)
    return plan


def _zero3_plan(
    groups: list[list[tuple[Path, int, int]]], shapes: list[dict[str, Any]]
) -> dict[str, tuple[list[Piece], torch.Size]]:
    """ZeRO-3: every rank holds ``ceil(numel / world)`` elements of each parameter (the last padded), one
    parameter after another across its flat groups; the full tensor is the ranks' shares end to end, cut
    to its size (``zero_to_fp32._zero3_merge_trainable_params``)."""
    world = len(groups)
    plan: dict[str, tuple[list[Piece], torch.Size]] = {}
    offset = 0
    for name, shape in ((n, s) for d in shapes for n, s in d.items()):
        size = torch.Size(shape)
        share = math.ceil(size.numel() / world)
        pieces: list[Piece] = []
        for rank in groups:
            pieces += _split(rank, offset, share)
        left, cut = size.numel(), []
        for f, off, n in pieces:  # the padding at the end of the last share is not the tensor's
            if left <= 0:
                break
            cut.append((f, off, min(n, left)))
            left -= n
        plan[name] = (cut, size)
        offset += share
    return plan


def _read_pieces(pieces: list[Piece], out: torch.Tensor) -> torch.Tensor:
    """The runs ``pieces``, end to end, into the flat fp32 tensor ``out``; returns ``out``."""
    at = 0
    for f, offset, n in pieces:
        _read_into(f, offset, out[at : at + n])
        at += n
    return out


def _read_into(f: Path, offset: int, out: torch.Tensor) -> None:
    """``out.numel()`` fp32 elements of ``f`` from byte ``offset`` into ``out`` (contiguous)."""
    view = memoryview(out.view(torch.uint8).numpy())
    got = 0
    with open(f, "rb", buffering=0) as fh:
        fh.seek(offset)
        while got < len(view) and (n := fh.readinto(view[got:])):
            got += n
    if got != len(view):
        raise CheckpointError(
            f"a ZeRO partition ends early ({got} of {len(view)} bytes)",
            field="checkpoint",
            value=str(f),
            fix=SAFE_FIX,
        )
