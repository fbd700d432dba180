"""The megatron engine's checkpoints read offline, and when the engine reshards one while loading it.

megatron's own DDP and distributed optimizer save through megatron-core's ``dist_checkpointing``, read
here through torch's distributed-checkpoint reader, which stores every tensor in its global (tp = 1, all
stages) form, mapped back to HF names by the declarative weight map. DeepSpeed ZeRO over megatron's
modules (pp = 1) saves one ZeRO checkpoint per TP rank, each merged by DeepSpeed's ``zero_to_fp32``
(:func:`tessera.engines.zero_reader.zero_merge`) and then put together by the same weight map. The
checkpoint was verified before a reader is called; nothing in it is unpickled beyond the allow-list.
"""

from __future__ import annotations

import pickle
import re
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
from tessera.safeload import dcp_reader_class

_EXPERTS = "mlp.experts.experts."
#: megatron's optimizer state keys: "optimizer.state.<kind>.<model key>", prefixed "chained_<i>." when the
#: optimizer is chained (dense + expert parameters); "optimizer.*" also covers its other entries
_OPTIM = re.compile(r"^(?:chained_\d+\.)?optimizer\.(?:state\.(\w+?)\.)?")
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

    def moment(self, ckpt: Path, meta: dict[str, Any], kind: str) -> dict[str, torch.Tensor] | None:
        sharding = meta["sharding"]
        if sharding.startswith(SHARDING_PREFIX):  # megatron DDP and the distributed optimizer save them alike
            got = _megatron(ckpt, hf_config_of(meta), moment=kind, peft=meta.get("peft"))
            return {k: v.float() for k, v in got.items()} or None
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
) -> dict[str, torch.Tensor]:
    """Global megatron tensors (layers stacked on dim 0 by dist_checkpointing) -> the tp = 1, pp = 1 chunk
    -> HF, through the same weight map the engine loads with. ``moment``: None for the parameters,
    ``optimizer.state.exp_avg.`` (or ``exp_avg_sq``) for megatron DDP's Adam moments, saved per parameter."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from tessera.models.megatron import Shard
    from tessera.models.megatron_lora import mcore_adapter
    from tessera.models.weight_map import mcore_to_hf

    root = ckpt / DIST_DIR
    reader = dcp_reader_class()(str(root))  # its .metadata through the restricted unpickler
    md = reader.read_metadata()
    # tensors only: the byte entries (TransformerEngine "_extra_state") would be unpickled
    keys = {
        k
        for k, m in md.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
        and (_OPTIM.match(k) is None if moment is None else (_OPTIM.match(k) or [None, None])[1] == moment)
    }
    if not keys:
        return {}

    class _Only(_EmptyStateDictLoadPlanner):
        # torch's key filter also consults metadata.planner_data, which megatron-core does not write
        def _should_include_key(self, key: str, metadata: Any) -> bool:
            return key in keys

    glob: dict[str, torch.Tensor] = {}
    # torch's own single-process reader of a distributed checkpoint (what dcp_to_torch_save uses); it
    # loads each tensor entry with weights_only=True (the byte entries are never asked for)
    try:
        _load_state_dict(glob, storage_reader=reader, planner=_Only(), no_dist=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"a tensor entry is not a plain tensor ({str(e).strip().splitlines()[-1][:160]})",
            field="checkpoint",
            value=str(root),
            fix=SAFE_FIX,
        ) from None
    adapter = mcore_adapter(hf_cfg, peft)
    shape = adapter.shape(hf_cfg)
    # megatron-core saves the local spec's separate norms under TransformerEngine's fused names; its layer
    # spec says how (sharded_state_dict_keys_map), and the reverse gives the module keys back
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(
        num_experts=shape.num_experts or None,
        normalization=shape.normalization,
        multi_latent_attention=shape.mla,
    )
    renamed = {v: k for k, v in spec.submodules.sharded_state_dict_keys_map.items()}
    chunk: dict[str, torch.Tensor] = {}
    for key, t in glob.items():
        key = key if moment is None else key[_OPTIM.match(key).end() :]  # type: ignore[union-attr]
        if not key.startswith("decoder.layers."):
            chunk[key] = t
            continue
        rest = key[len("decoder.layers.") :]
        layer, dot, after = rest.partition(".")
        if layer.isdigit() and dot:  # not stacked: a model with dense and MoE layers saves each layer apart
            if after.startswith(_EXPERTS):  # its SequentialMLP's tensors: dim 0 is the global expert
                for e in range(shape.num_experts):
                    chunk[
                        f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.{after[len(_EXPERTS) :]}"
                    ] = t[e]
            else:
                chunk[key] = t
            continue
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
        return mcore_to_hf({Shard(): chunk}, adapter, hf_cfg, adapters_only=peft is not None)
    except KeyError as e:
        raise CheckpointError(
            f"the megatron checkpoint has no tensor for {e}",
            field="checkpoint",
            value=str(root),
            fix="resume the run on its own layout; this checkpoint's tensors do not match its model_config",
        ) from None


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
