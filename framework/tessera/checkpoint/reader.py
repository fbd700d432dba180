"""Any Tessera checkpoint as full HF tensors, without the engine that wrote it.

``meta.json`` (format v2) says the engine, its sharding and the layout, so the reader picks the format's
own machinery: the ddp engine's safetensors; DeepSpeed's ``zero_to_fp32`` for ZeRO 1-3 (its fp32 master
partitions merged, exactly what ``get_fp32_state_dict_from_zero_checkpoint`` gives) and the module file
for ZeRO-0 (read with ``weights_only=True``); megatron-core's ``dist_checkpointing`` through torch's
distributed-checkpoint reader, which stores every tensor in its global (tp = 1, all stages) form, mapped
back to HF names by the declarative weight map. The checkpoint is verified before anything reads it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tessera.checkpoint.manager import FORMAT_VERSION, verify_or_raise
from tessera.errors import CheckpointError

_EXPERTS = "mlp.experts.experts."
MOMENTS = ("exp_avg", "exp_avg_sq")


def hf_config_of(meta: dict[str, Any]) -> Any:
    """The HF config recorded in a v2 checkpoint."""
    from transformers import AutoConfig

    cfg = dict(meta["model_config"])
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg)


def read_hf_state(ckpt: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(HF state dict in fp32, meta) of checkpoint directory ``ckpt``, verified first."""
    ckpt = Path(ckpt)
    meta = verify_or_raise(ckpt)
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            "a v1 checkpoint does not say which engine and layout wrote it",
            field="checkpoint",
            value=str(ckpt),
            fix="resume it once with this release (its next checkpoint is v2), then convert that",
        )
    sharding = meta["sharding"]
    if sharding == "torch-ddp":
        from tessera.engines.ddp import MODEL_FILE
        from tessera.tensorfile import load_tensors

        state = load_tensors(ckpt / MODEL_FILE)
    elif sharding.startswith("deepspeed-zero"):
        state = _deepspeed(ckpt, int(meta["layout"]["zero"]))
    elif sharding.startswith("megatron-"):
        state = _megatron(ckpt, hf_config_of(meta))
    else:
        raise CheckpointError(
            f"reading sharding {sharding!r} is not supported yet",
            field="checkpoint",
            value=str(ckpt),
            fix="convert from a checkpoint of the deepspeed, ddp or megatron (zero_impl megatron) engine",
        )
    return {k: v.float() for k, v in state.items()}, meta


def _deepspeed(ckpt: Path, zero: int) -> dict[str, torch.Tensor]:
    if zero == 0:  # no partitions: the module's own state dict (tensors only, so weights_only holds)
        files = sorted(ckpt.glob("mp_rank_*_model_states.pt"))
        return dict(torch.load(files[0], map_location="cpu", weights_only=True)["module"])
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    # DeepSpeed unpickles its own files here; their checksums were verified above
    return dict(get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent), tag=ckpt.name))


def _megatron(ckpt: Path, hf_cfg: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Global megatron tensors (layers stacked on dim 0 by dist_checkpointing) -> the tp = 1, pp = 1 chunk
    -> HF, through the same weight map the engine loads with. ``prefix``: "" for the parameters,
    ``optimizer.state.exp_avg.`` (or ``exp_avg_sq``) for megatron DDP's Adam moments, saved per parameter."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from tessera.models.megatron import Shard, adapter_for
    from tessera.models.weight_map import mcore_to_hf

    root = ckpt / "megatron"
    reader = FileSystemReader(str(root))
    md = reader.read_metadata()
    # tensors only: the byte entries (TransformerEngine "_extra_state") would be unpickled
    keys = {
        k
        for k, m in md.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
        and k.startswith(prefix)
        and (prefix or not k.startswith("optimizer."))
    }
    if not keys:
        return {}

    class _Only(_EmptyStateDictLoadPlanner):
        # torch's key filter also consults metadata.planner_data, which megatron-core does not write
        def _should_include_key(self, key: str, metadata: Any) -> bool:
            return key in keys

    glob: dict[str, torch.Tensor] = {}
    # torch's own single-process reader of a distributed checkpoint (what dcp_to_torch_save uses)
    _load_state_dict(glob, storage_reader=reader, planner=_Only(), no_dist=True)
    adapter = adapter_for(hf_cfg.model_type)
    shape = adapter.shape(hf_cfg)
    # megatron-core saves the local spec's separate norms under TransformerEngine's fused names; its layer
    # spec says how (sharded_state_dict_keys_map), and the reverse gives the module keys back
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=shape.num_experts or None, normalization=shape.normalization)
    renamed = {v: k for k, v in spec.submodules.sharded_state_dict_keys_map.items()}
    chunk: dict[str, torch.Tensor] = {}
    for key, t in glob.items():
        key = key[len(prefix) :]
        if not key.startswith("decoder.layers."):
            chunk[key] = t
            continue
        rest = key[len("decoder.layers.") :]
        for saved, module in renamed.items():
            if rest.startswith(saved):
                rest = module + rest[len(saved) :]
        for i in range(shape.num_layers):  # dim 0: the global layer index
            if rest.startswith(_EXPERTS):  # SequentialMLP: dim 1 of its saved tensors is the global expert
                for e in range(shape.num_experts):
                    chunk[f"decoder.layers.{i}.mlp.experts.local_experts.{e}.{rest[len(_EXPERTS) :]}"] = t[i][
                        e
                    ]
            else:
                chunk[f"decoder.layers.{i}.{rest}"] = t[i]
    try:
        return mcore_to_hf({Shard(): chunk}, adapter, hf_cfg)
    except KeyError as e:
        raise CheckpointError(
            f"the megatron checkpoint has no tensor for {e}",
            field="checkpoint",
            value=str(root),
            fix="resume the run on its own layout; this checkpoint's tensors do not match its model_config",
        ) from None


def read_hf_optimizer(ckpt: Path, meta: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]] | None:
    """Adam moments keyed by HF parameter name (``{name: {"exp_avg": t, "exp_avg_sq": t}}``) where the
    format keeps them per parameter (the ddp engine; megatron DDP); None where they are not read yet
    (DeepSpeed ZeRO's flat partitions, megatron's distributed optimizer buffers). ``ckpt`` is verified."""
    sharding = meta["sharding"]
    if sharding == "torch-ddp":
        from tessera.engines.ddp import OPTIMIZER_FILE
        from tessera.tensorfile import load_tensors

        out: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in load_tensors(ckpt / OPTIMIZER_FILE).items():
            name, kind = key.rsplit("/", 1)
            if kind in MOMENTS:
                out.setdefault(name, {})[kind] = t
        return out
    if sharding == "megatron-ddp":
        cfg = hf_config_of(meta)
        per = {m: _megatron(ckpt, cfg, prefix=f"optimizer.state.{m}.") for m in MOMENTS}
        if not per["exp_avg"]:
            return None
        return {name: {m: per[m][name] for m in MOMENTS} for name in per["exp_avg"]}
    return None
