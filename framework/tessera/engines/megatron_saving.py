"""megatron-core's ``dist_checkpointing`` save, written through a Tessera checkpoint save's writer.

megatron-core splits an asynchronous save in three (``dist_checkpointing.save(...,
async_sharded_save=True)``): planning and the common state on the calling thread (collectives), the
bucket writes (``FileSystemWriterAsync.write_preloaded_data``, meant for forked processes), and a
finalization on every rank (a gather of the write results to the coordinator, which writes the
``.metadata`` file, then ``metadata.json``). Tessera uses the first two as megatron-core wrote them and
changes where they run:

- the buckets are written by the save's writer (:mod:`tessera.writes`), in the background from a snapshot
  when the save is asynchronous: no process is forked beside the gloo / NCCL threads of a rank;
- the finalization's gather goes through the ranks' completion markers on the shared file system, so rank
  0 finishes the metadata in its writer thread with no collective beside the training steps'.

The snapshot: megatron-core copies accelerator tensors to the host itself (its ``preload_fn``); CPU
tensors it keeps by reference (its forked writer has a copy-on-write view), so a background save clones
them here. The hashes of megatron-core's bucket files are read back after writing (its writer opens
the files itself), in the writer thread, off the step loop.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tessera.atomic import checksum_file
from tessera.writes import Hashed, Writes, without_zip_crc

RESULTS = "megatron_write_results"


def _strategy_class() -> type:
    """megatron-core's torch_dist save strategy, keeping what its planning returned (the storage writer
    and, on the coordinator, the global metadata) for the commit."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    class KeepPlan(TorchDistSaveShardedStrategy):
        planned: Any = None

        def _get_save_and_finalize_callbacks(self, writer: Any, save_state_dict_ret: Any) -> Any:
            self.planned = save_state_dict_ret  # (storage_writer, global_metadata, dist_wrapper)
            return super()._get_save_and_finalize_callbacks(writer, save_state_dict_ret)

    return KeepPlan


def save_through(
    writes: Writes,
    sharded_state_dict: Any,
    path: Path,
    *,
    coordinator: bool,
    resolve: Callable[[Any, Any], Any] | None = None,
) -> None:
    """Plan the save of ``sharded_state_dict`` into ``path`` (every rank, collectives), then hand the
    bucket writes to ``writes`` and, on the ``coordinator``, the metadata to its commit. ``resolve``: the
    state's tensors hold no data of their own (a conversion's writer): each bucket item's tensor is
    ``resolve(write_item, tensor)``, made as it is written and dropped after, in line."""
    from megatron.core import dist_checkpointing

    strategy = _strategy_class()("torch_dist", 1, thread_count=1)
    request = dist_checkpointing.save(
        sharded_state_dict, str(path), sharded_strategy=strategy, async_sharded_save=True
    )
    storage_writer, global_metadata, _ = strategy.planned
    buckets: list[Any] = list(request.async_fn_args[1]) if request.async_fn is not None else []
    if buckets:
        transforms = request.async_fn.args[0]  # partial(write_preloaded_data_multiproc, transforms, msc)
        if resolve is not None:
            buckets = [(f, key, (raw, _made(tensors, resolve))) for f, key, (raw, tensors) in buckets]
        elif any(t.device.type != "cpu" for _, _, (_, tensors) in buckets for _, t in tensors):
            buckets = request.preload_fn()  # megatron-core's own device-to-host copy
        elif writes.background:
            buckets = [
                (f, key, (raw, [(item, t.clone()) for item, t in tensors]))
                for f, key, (raw, tensors) in buckets
            ]
    else:
        transforms = None

    def write(progress: Any) -> dict[str, Hashed]:
        from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

        results: list[Any] = []
        hashed: dict[str, Hashed] = {}
        for i, bucket in enumerate(buckets):
            out: queue.Queue = queue.Queue()
            count: queue.Queue = queue.Queue()
            count.put(i)
            with without_zip_crc():  # the bucket's torch.save'd items: see there
                FileSystemWriterAsync.write_preloaded_data(transforms, i, bucket, out, count, True)
            _, written = out.get()
            if isinstance(written, Exception):
                raise written
            results += written
            hashed[bucket[0]] = (checksum_file(Path(bucket[0])), Path(bucket[0]).stat().st_size)
            progress(hashed[bucket[0]][1])
        writes.extra[RESULTS] = [_encode(r) for r in results]
        return hashed

    writes.add_task(write)
    if coordinator:

        def commit(markers: list[dict[str, Any]]) -> None:
            from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

            storage_writer.finish(
                global_metadata, [[_decode(r) for r in m.get(RESULTS, [])] for m in markers]
            )
            save_config(CheckpointingConfig(strategy.backend, strategy.version), str(path))

        writes.commits.append(commit)


def _made(tensors: list[tuple[Any, Any]], resolve: Callable[[Any, Any], Any]) -> Iterator[tuple[Any, Any]]:
    """A bucket's (item, tensor) pairs with each tensor made by ``resolve(item, tensor)`` as the writer
    reaches it (megatron-core's writer iterates them once, writing each before it asks for the next)."""
    for item, held in tensors:
        yield item, resolve(item, held)


def _encode(result: Any) -> dict[str, Any]:
    """A torch.distributed.checkpoint ``WriteResult`` (where one item went in which bucket file) as JSON."""
    i, s = result.index, result.storage_data
    return {
        "fqn": i.fqn,
        "offset": None if i.offset is None else list(i.offset),
        "index": i.index,
        "size": result.size_in_bytes,
        "path": s.relative_path,
        "at": s.offset,
        "length": s.length,
        "transforms": None if s.transform_descriptors is None else list(s.transform_descriptors),
    }


def _decode(d: dict[str, Any]) -> Any:
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    offset = None if d["offset"] is None else torch.Size(d["offset"])
    info = _StorageInfo(d["path"], d["at"], d["length"], d["transforms"])
    return WriteResult(MetadataIndex(d["fqn"], offset, d["index"]), d["size"], info)
