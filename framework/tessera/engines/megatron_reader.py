"""The megatron engine's checkpoints read offline, and when the engine reshards one while loading it.

megatron's own DDP and distributed optimizer save through megatron-core's ``dist_checkpointing``, read
here through torch's distributed-checkpoint reader, which stores every tensor in its global (tp = 1, all
stages) form, mapped back to HF names by the declarative weight map. DeepSpeed ZeRO over megatron's
modules (pp = 1) saves one ZeRO checkpoint per TP rank, each merged by DeepSpeed's ``zero_to_fp32``
(:func:`tessera.engines.zero_reader.zero_merge`) and then put together by the same weight map. The
checkpoint was verified before a reader is called; nothing in it is unpickled beyond the allow-list.
"""

from __future__ import annotations

import contextlib
import io
import re
import struct
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from tessera.engines.base import CheckpointReader, unreadable_sharding
from tessera.engines.megatron_build import DEEPSPEED_SHARDING_PREFIX, SHARDING_PREFIX, sharding_of
from tessera.engines.zero_reader import zero_merge
from tessera.errors import CheckpointError
from tessera.models.hf import hf_config_of
from tessera.plan.layout import ParallelLayout
from tessera.safeload import FIX as SAFE_FIX
from tessera.safeload import FileWindow, dcp_reader_class, safe_torch_load
from tessera.tensorfile import TensorView

_EXPERTS = "mlp.experts.experts."
#: megatron's optimizer state keys: "optimizer.state.<kind>.<model key>", prefixed "chained_<i>." when the
#: optimizer is chained (dense + expert parameters); "optimizer.*" also covers its other entries
OPTIM_KEY = re.compile(r"^(?:chained_\d+\.)?optimizer\.(?:state\.(\w+?)\.)?")
#: the directory of megatron-core's dist_checkpointing inside a step directory
DIST_DIR = "megatron"


class MegatronReader(CheckpointReader):
    """The megatron engine's checkpoints (``sharding`` ``megatron-ddp``, ``megatron-distributed-optimizer``
    or ``megatron+deepspeed-zero<stage>``)."""

    def weights(self, ckpt: Path, meta: dict[str, Any]) -> dict[str, torch.Tensor]:
        sharding = meta["sharding"]
        if sharding.startswith(SHARDING_PREFIX):
            return _megatron(ckpt, hf_config_of(meta), peft=meta.get("peft"))
        if sharding.startswith(DEEPSPEED_SHARDING_PREFIX):
            return _megatron_deepspeed(ckpt, meta)
        raise unreadable_sharding(ckpt, sharding)

    def moment(self, ckpt: Path, meta: dict[str, Any], kind: str) -> Mapping[str, torch.Tensor] | None:
        sharding = meta["sharding"]
        if sharding.startswith(SHARDING_PREFIX):  # megatron DDP and the distributed optimizer save them alike
            got = _megatron(ckpt, hf_config_of(meta), moment=kind, peft=meta.get("peft"))
            return TensorView(got, dtype=torch.float32) if len(got) else None  # read as asked for
        if sharding.startswith(DEEPSPEED_SHARDING_PREFIX):
            return _megatron_deepspeed(ckpt, meta, kind)
        return None


READER = MegatronReader()


def reshards_on_load(meta: dict[str, Any], layout: ParallelLayout) -> bool:
    """megatron -> megatron with the same optimizer kind: megatron-core's dist_checkpointing reshards the
    checkpoint itself (global tensors; the optimizer state in model space), so no stage is needed
    (:meth:`tessera.engines.megatron_engine.MegatronEngine.load_resharded`). Not between ep > 1 and
    ep = 1: megatron chains a separate expert optimizer only with expert parallelism, and its state keys
    ("chained_<i>.optimizer...") then differ, which dist_checkpointing cannot map."""
    saved_ep = int((meta.get("layout") or {}).get("ep", 1))
    return (
        layout.engine == "megatron"
        and layout.zero_impl == "megatron"
        and meta.get("sharding") == sharding_of(layout)
        and (saved_ep > 1) == (layout.ep > 1)
    )


def _megatron(
    ckpt: Path, hf_cfg: Any, moment: str | None = None, peft: dict[str, Any] | None = None
) -> MegatronTensors:
    """The checkpoint's HF tensors (``moment``: None for the parameters, ``exp_avg`` or ``exp_avg_sq`` for
    megatron's Adam moments, saved per parameter), read on access (:class:`MegatronTensors`)."""
    return MegatronTensors(ckpt, hf_cfg, moment=moment, peft=peft)


class MegatronTensors(Mapping[str, torch.Tensor]):
    """The HF tensors of a megatron ``dist_checkpointing`` checkpoint, read on access, one group at a time.

    dist_checkpointing stores every tensor in its global (tp = 1, all stages) form, the layers stacked on
    dim 0 and saved one stored chunk per layer and TP rank; the HF names come from the same weight map the
    engine loads with (:func:`tessera.models.weight_map.mcore_to_hf`). An access reads only the stored
    chunks of the megatron tensors that HF tensor is made from (a *group*: q, k and v share their fused
    tensor, gate and up theirs), through torch's own distributed-checkpoint reader and a planner that asks
    for just those regions, and keeps that one group: reading the tensors in order holds one group at a
    time, never the model (a conversion's memory does not grow with depth). The weight map runs on the
    group's tensors with every other megatron tensor on the meta device (shapes only, no memory)."""

    def __init__(
        self, ckpt: Path, hf_cfg: Any, *, moment: str | None = None, peft: dict[str, Any] | None = None
    ) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from tessera.models.megatron_lora import mcore_adapter
        from tessera.models.weight_map import hf_row_sources, hf_sources

        self._root = Path(ckpt) / DIST_DIR
        self._reader = dcp_reader_class()(str(self._root))  # its .metadata through the restricted unpickler
        md = self._reader.read_metadata()
        # tensors only: the byte entries (TransformerEngine "_extra_state") would be unpickled
        stored = {
            k: m
            for k, m in md.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata)
            and (
                OPTIM_KEY.match(k) is None
                if moment is None
                else (OPTIM_KEY.match(k) or [None, None])[1] == moment
            )
        }
        self._md = {k: stored[k] for k in stored}
        self._cfg, self._adapter, self._peft = hf_cfg, mcore_adapter(hf_cfg, peft), peft
        #: the global chunk's megatron key -> (stored key, index of the layer / expert on its leading dims)
        self._source = _chunk_sources(stored, self._adapter.shape(hf_cfg), moment)
        self._meta = {
            c: torch.empty(tuple(stored[f].size)[len(i) :], dtype=stored[f].properties.dtype, device="meta")
            for c, (f, i) in self._source.items()
        }
        hf = self._convert(self._meta) if self._source else {}
        # groups: the megatron keys that one HF tensor, or several sharing a tensor, are made from
        deps = hf_sources(self._adapter, hf_cfg)
        parent: dict[str, str] = {}

        def root(c: str) -> str:
            while parent.setdefault(c, c) != c:
                c = parent[c]
            return c

        for k in hf:
            first, *rest = sorted(c for c in deps[k] if c in self._source)
            for c in rest:
                parent[root(c)] = root(first)
        self._group = {k: root(min(c for c in deps[k] if c in self._source)) for k in hf}
        self._members: dict[str, list[str]] = {}
        for c in self._source:
            self._members.setdefault(root(c), []).append(c)
        self._keys = list(hf)
        self._shapes = {k: (t.shape, t.dtype) for k, t in hf.items()}  # the weight map on meta, once
        self._held: tuple[str | None, dict[str, torch.Tensor]] = (None, {})
        # HF tensors that are the first rows of one megatron tensor, alone in their group: a range of
        # their rows is read alone (:meth:`part`)
        self._rows: dict[str, str] = {}
        for k, c in hf_row_sources(self._adapter, hf_cfg).items():
            shp, m = self._shapes.get(k), self._meta.get(c)
            if shp is None or m is None or self._members.get(self._group[k]) != [c] or not m.dim():
                continue
            size, dtype = shp
            if len(size) and size[1:] == m.shape[1:] and size[0] <= m.shape[0] and dtype == m.dtype:
                self._rows[k] = c

    def _convert(self, chunk: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from tessera.models.megatron import Shard
        from tessera.models.weight_map import mcore_to_hf

        try:
            return mcore_to_hf(
                {Shard(): dict(chunk)}, self._adapter, self._cfg, adapters_only=self._peft is not None
            )
        except KeyError as e:
            raise CheckpointError(
                f"the megatron checkpoint has no tensor for {e}",
                field="checkpoint",
                value=str(self._root),
                fix="resume the run on its own layout; this checkpoint's tensors do not match its model_config",
            ) from None

    def __getitem__(self, key: str) -> torch.Tensor:
        group = self._group[key]
        held, tensors = self._held
        if held != group:
            self._held = (None, {})  # the previous group goes before the next is read
            del tensors
            real = self._read(self._members[group])
            out = self._convert({**self._meta, **real})
            del real
            self._held = (group, {k: t for k, t in out.items() if not t.is_meta})
        return self._held[1][key]

    def part(self, key: str, index: tuple[int | slice, ...]) -> torch.Tensor:
        """``self[key][index]``; a range of rows of an HF tensor that is one megatron tensor's rows (the
        embedding, the LM head: the largest tensors) is read alone, from the stored chunks holding them,
        without the rest of the tensor or the group."""
        rows = index[0] if index else None
        c = self._rows.get(key)
        if (
            c is None
            or self._held[0] == self._group[key]
            or not isinstance(rows, slice)
            or rows.step not in (None, 1)
            or any(i != slice(None) for i in index[1:])
        ):
            return self[key][index]
        start, stop, _ = rows.indices(self._shapes[key][0][0])
        got = _read_regions(
            self._root,
            self._reader.read_metadata(),
            {c: self._source[c]},
            rows={c: (start, max(start, stop))},
        )
        return got[c]

    def shape_of(self, key: str) -> tuple[int, ...]:
        """The HF tensor's shape, from the checkpoint's metadata."""
        return tuple(self._shapes[key][0])

    def release(self) -> None:
        """Let go of the group held (the last one read): a reader kept for later holds no tensor."""
        self._held = (None, {})

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._group

    def shapes(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """HF key -> (shape, dtype), read from the checkpoint's metadata only."""
        return dict(self._shapes)

    def _read(self, members: list[str]) -> dict[str, torch.Tensor]:
        """The global chunk's megatron tensors ``members``: their stored chunks only."""
        return _read_regions(self._root, self._reader.read_metadata(), {c: self._source[c] for c in members})


def _chunk_sources(
    stored: Mapping[str, Any], shape: Any, moment: str | None
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The global chunk's megatron key (the engine's module names) -> (stored key, the leading index that
    selects it: () whole, (layer,), (layer, expert) or (expert,))."""
    # megatron-core saves the local spec's separate norms under TransformerEngine's fused names; its layer
    # spec says how (sharded_state_dict_keys_map), and the reverse gives the module keys back
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(
        num_experts=shape.num_experts or None,
        normalization=shape.normalization,
        multi_latent_attention=shape.mla,
    )
    renamed = {v: k for k, v in spec.submodules.sharded_state_dict_keys_map.items()}
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for fqn in stored:
        key = fqn if moment is None else fqn[OPTIM_KEY.match(fqn).end() :]  # type: ignore[union-attr]
        if not key.startswith("decoder.layers."):
            out[key] = (fqn, ())
            continue
        rest = key[len("decoder.layers.") :]
        layer, dot, after = rest.partition(".")
        if layer.isdigit() and dot:  # not stacked: a model with dense and MoE layers saves each layer apart
            if after.startswith(_EXPERTS):  # its SequentialMLP's tensors: dim 0 is the global expert
                for e in range(shape.num_experts):
                    out[f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.{after[len(_EXPERTS) :]}"] = (
                        fqn,
                        (e,),
                    )
            else:
                out[key] = (fqn, ())
            continue
        for saved, module in renamed.items():
            if rest.startswith(saved):
                rest = module + rest[len(saved) :]
        for i in range(shape.num_layers):  # dim 0: the global layer index
            if rest.startswith(_EXPERTS):  # SequentialMLP: dim 1 of its saved tensors is the global expert
                for e in range(shape.num_experts):
                    out[f"decoder.layers.{i}.mlp.experts.local_experts.{e}.{rest[len(_EXPERTS) :]}"] = (
                        fqn,
                        (i, e),
                    )
            else:
                out[f"decoder.layers.{i}.{rest}"] = (fqn, (i,))
    return out


def _read_regions(
    root: Path,
    metadata: Any,
    requests: Mapping[str, tuple[str, tuple[int, ...]]],
    rows: Mapping[str, tuple[int, int]] | None = None,
) -> dict[str, torch.Tensor]:
    """Per request (name -> (stored key, leading index)): the entries of a stored global tensor that the
    leading index selects, whole along the other dims (``rows``: name -> [start, stop) of the first of
    them, where only those are wanted), the index dims dropped. torch's planner helper
    says which stored chunks hold them (``create_read_items_for_chunk_list``, its resharding rule); each
    chunk's bytes are then read straight into the destination where they are a contiguous piece of it
    (:func:`_read_item`). By hand because torch's reader (``FileSystemReader.read_data``) loads every
    stored chunk into a tensor of its own and copies it over: 1.5 x the largest tensor at the peak (the
    embedding's two TP halves and the whole) where reading in place needs 1 x."""
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    out: dict[str, torch.Tensor] = {}
    with contextlib.ExitStack() as files:
        opened: dict[str, Any] = {}
        for name, (fqn, index) in requests.items():
            m = metadata.state_dict_metadata[fqn]
            rest = tuple(m.size)[len(index) :]
            lo, hi = (rows or {}).get(name, (0, rest[0] if rest else 0))
            first = ((lo,), (hi - lo,)) if rest else ((), ())
            offsets = (*index, *first[0], *(0 for _ in rest[1:]))
            sizes = (*(1 for _ in index), *first[1], *rest[1:])
            dest = torch.empty(sizes, dtype=m.properties.dtype)
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            for item in create_read_items_for_chunk_list(fqn, m, [chunk]):
                info = metadata.storage_data[item.storage_index]
                if info.relative_path not in opened:
                    opened[info.relative_path] = files.enter_context(open(root / info.relative_path, "rb"))
                into = narrow_tensor_by_index(dest, item.dest_offsets, item.lengths)
                _read_item(
                    opened[info.relative_path], info, item, into, where=f"{root / info.relative_path}:{fqn}"
                )
            out[name] = dest.reshape(sizes[len(index) :])
    return out


def _read_item(f: Any, info: Any, item: Any, into: torch.Tensor, *, where: str) -> None:
    """One stored chunk's part ``item`` into ``into``. Where the chunk is a whole contiguous tensor read
    whole into a contiguous destination, its bytes go straight from its archive's storage record into
    the destination (the archive's pickle is loaded onto the meta device first: shape, strides, dtype,
    no data); otherwise the chunk is loaded (``weights_only``, the allow-list) and its part copied."""
    from torch.distributed._shard._utils import narrow_tensor_by_index

    window = FileWindow(f, info.offset, info.length)
    if not info.transform_descriptors:
        stored = safe_torch_load(window, map_location="meta", where=where)
        nbytes = stored.numel() * stored.element_size()
        span = (
            _byte_span(stored.shape, item.storage_offsets, item.lengths, stored.element_size())
            if torch.is_tensor(stored)
            and stored.is_contiguous()
            and stored.storage_offset() == 0
            and stored.untyped_storage().nbytes() == nbytes
            and stored.dtype == into.dtype
            and into.is_contiguous()
            else None
        )
        record = _storage_record(window, nbytes) if span is not None else None
        if record is not None:
            assert span is not None
            start, nbytes = span
            f.seek(info.offset + record + start)
            view = memoryview(into.reshape(-1).view(torch.uint8).numpy())
            got = 0
            while got < nbytes and (n := f.readinto(view[got:])):
                got += n
            if got != nbytes:
                raise CheckpointError(
                    f"a stored tensor ends early ({got} of {nbytes} bytes)",
                    field="checkpoint",
                    value=where,
                    fix=SAFE_FIX,
                )
            return
        window.seek(0)
    stored = safe_torch_load(io.BufferedReader(window), map_location="cpu", where=where)
    into.copy_(narrow_tensor_by_index(stored, item.storage_offsets, item.lengths))


def _byte_span(shape: torch.Size, offsets: Any, lengths: Any, itemsize: int) -> tuple[int, int] | None:
    """(first byte, bytes) of the region ``offsets`` / ``lengths`` of a C-contiguous tensor of ``shape``
    where it is one contiguous run of its bytes (every dim after some dim whole, every dim before it of
    length 1), else None."""
    dims = len(shape)
    k = next((d for d in range(dims - 1, -1, -1) if offsets[d] != 0 or lengths[d] != shape[d]), -1)
    if any(lengths[d] != 1 for d in range(k)):
        return None
    stride, start = 1, 0
    for d in range(dims - 1, -1, -1):
        start += offsets[d] * stride
        stride *= shape[d]
    count = 1
    for n in lengths:
        count *= n
    return start * itemsize, count * itemsize


def _storage_record(window: FileWindow, nbytes: int) -> int | None:
    """The offset in the archive of the raw bytes of its one storage record (``<archive>/data/<key>``,
    stored uncompressed, ``nbytes`` long); None for any other archive (read the general way)."""
    window.seek(0)
    try:
        with zipfile.ZipFile(window) as z:
            records = [i for i in z.infolist() if "/data/" in i.filename and not i.filename.endswith(".pkl")]
            if (
                len(records) != 1
                or records[0].compress_type != zipfile.ZIP_STORED
                or records[0].file_size != nbytes
            ):
                return None
            at = records[0].header_offset
        window.seek(at)
        header = window.read(30)
        if len(header) != 30 or header[:4] != b"PK\x03\x04":
            return None
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        return at + 30 + name_len + extra_len
    except zipfile.BadZipFile:
        return None


def _megatron_deepspeed(ckpt: Path, meta: dict[str, Any], kind: str | None = None) -> dict[str, torch.Tensor]:
    """megatron with DeepSpeed ZeRO (pp = 1): one ZeRO checkpoint per TP rank over megatron's modules,
    each merged by DeepSpeed's zero_to_fp32 (:func:`~tessera.engines.zero_reader.zero_merge`), then the TP
    shards back to HF by the same weight map the engine loads with."""
    from tessera.models.megatron import Shard, adapter_for
    from tessera.models.weight_map import mcore_to_hf

    cfg, layout = hf_config_of(meta), meta["layout"]
    tp, zero = int(layout["tp"]), int(layout["zero"])
    chunks = {}
    for r in range(tp):
        local = zero_merge(ckpt, zero, kind, mp=r)
        chunks[Shard(tp=tp, tp_rank=r, etp=tp, etp_rank=r)] = {
            k: v for k, v in local.items() if not k.endswith("_extra_state")
        }
    return mcore_to_hf(chunks, adapter_for(cfg.model_type), cfg)
