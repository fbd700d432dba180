"""Any Tessera checkpoint as full HF tensors, without the engine that wrote it.

``meta.json`` (format v2) says the engine, its sharding and the layout, so the reader picks the format's
own machinery: the ddp engine's safetensors; DeepSpeed's ``zero_to_fp32`` for ZeRO 1-3 (its fp32 master
partitions merged, exactly what ``get_fp32_state_dict_from_zero_checkpoint`` gives) and the module file
for ZeRO-0; megatron-core's ``dist_checkpointing`` through torch's distributed-checkpoint reader, which
stores every tensor in its global (tp = 1, all stages) form, mapped back to HF names by the declarative
weight map. The checkpoint is verified (checksums, the static scan of its pickles) before anything reads
it, and every pickle is then loaded with ``weights_only=True`` and the allow-list of
:mod:`tessera.safeload`: nothing in a checkpoint runs code.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from tessera.checkpoint.index import FORMAT_VERSION, verify_or_raise
from tessera.errors import CheckpointError
from tessera.safeload import FIX as SAFE_FIX
from tessera.safeload import dcp_reader_class, forced_weights_only, safe_torch_load

_EXPERTS = "mlp.experts.experts."
#: megatron's optimizer state keys: "optimizer.state.<kind>.<model key>", prefixed "chained_<i>." when the
#: optimizer is chained (dense + expert parameters); "optimizer.*" also covers its other entries
_OPTIM = re.compile(r"^(?:chained_\d+\.)?optimizer\.(?:state\.(\w+?)\.)?")


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
    elif sharding.startswith("megatron+deepspeed-zero"):
        state = _megatron_deepspeed(ckpt, meta)
    else:
        raise CheckpointError(
            f"reading sharding {sharding!r} is not supported yet",
            field="checkpoint",
            value=str(ckpt),
            fix="convert from a checkpoint of the deepspeed, ddp or megatron (zero_impl megatron) engine",
        )
    return {k: v.float() for k, v in state.items()}, meta


def _deepspeed(ckpt: Path, zero: int) -> dict[str, torch.Tensor]:
    if zero == 0:  # no partitions: the module's own state dict
        files = sorted(ckpt.glob("mp_rank_*_model_states.pt"))
        return dict(safe_torch_load(files[0], map_location="cpu")["module"])
    return _zero_merge(ckpt, zero, None)


def _megatron(ckpt: Path, hf_cfg: Any, moment: str | None = None) -> dict[str, torch.Tensor]:
    """Global megatron tensors (layers stacked on dim 0 by dist_checkpointing) -> the tp = 1, pp = 1 chunk
    -> HF, through the same weight map the engine loads with. ``moment``: None for the parameters,
    ``optimizer.state.exp_avg.`` (or ``exp_avg_sq``) for megatron DDP's Adam moments, saved per parameter."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from tessera.models.megatron import Shard, adapter_for
    from tessera.models.weight_map import mcore_to_hf

    root = ckpt / "megatron"
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
    adapter = adapter_for(hf_cfg.model_type)
    shape = adapter.shape(hf_cfg)
    # megatron-core saves the local spec's separate norms under TransformerEngine's fused names; its layer
    # spec says how (sharded_state_dict_keys_map), and the reverse gives the module keys back
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=shape.num_experts or None, normalization=shape.normalization)
    renamed = {v: k for k, v in spec.submodules.sharded_state_dict_keys_map.items()}
    chunk: dict[str, torch.Tensor] = {}
    for key, t in glob.items():
        key = key if moment is None else key[_OPTIM.match(key).end() :]  # type: ignore[union-attr]
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


def read_hf_moment(ckpt: Path, meta: dict[str, Any], kind: str) -> dict[str, torch.Tensor] | None:
    """One Adam moment (``exp_avg`` or ``exp_avg_sq``) of every trainable parameter, keyed by HF name, in
    fp32; None where the format's moments are not readable offline (DeepSpeed's bf16 / fp16 optimizer
    wrappers without ZeRO). One kind at a time, so a caller never holds the weights and both moments
    together. ``ckpt`` is verified."""
    sharding = meta["sharding"]
    if sharding == "torch-ddp":
        from tessera.engines.ddp import OPTIMIZER_FILE
        from tessera.tensorfile import LazyTensors

        lazy = LazyTensors([ckpt / OPTIMIZER_FILE])
        return {k.rsplit("/", 1)[0]: lazy[k].float() for k in lazy if k.endswith("/" + kind)}
    if sharding.startswith("megatron-"):  # megatron DDP and the distributed optimizer save them alike
        got = _megatron(ckpt, hf_config_of(meta), moment=kind)
        return {k: v.float() for k, v in got.items()} or None
    if sharding == "deepspeed-zero0":
        return _deepspeed_zero0_moment(ckpt, meta, kind)
    if sharding.startswith("megatron+deepspeed-zero"):
        return _megatron_deepspeed(ckpt, meta, kind)
    if sharding.startswith("deepspeed-zero"):
        return _zero_merge(ckpt, int(meta["layout"]["zero"]), kind)
    return None


def _deepspeed_zero0_moment(ckpt: Path, meta: dict[str, Any], kind: str) -> dict[str, torch.Tensor] | None:
    """Without ZeRO, DeepSpeed saves torch AdamW's own state dict, whose parameters are positions in its
    groups. Tessera built those groups (:func:`tessera.engines.optim.param_groups`: the HF model's
    parameters in order, matrices first), so the positions map back to names; every shape is checked.
    None for an optimizer of another form (DeepSpeed's bf16 / fp16 wrappers)."""
    from transformers import AutoModelForCausalLM

    from tessera.engines.optim import param_groups

    files = sorted(ckpt.glob("mp_rank_*_model_states.pt"))
    # DeepSpeed's own pickle, verified and scanned first, loaded with weights_only and the allow-list
    opt = safe_torch_load(files[0], map_location="cpu", mmap=True).get("optimizer")
    if not isinstance(opt, dict) or "state" not in opt or "param_groups" not in opt:
        return None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config_of(meta))
    named = {id(p): n for n, p in model.named_parameters()}
    order = [named[id(p)] for g in param_groups(model.named_parameters(), 0.0) for p in g["params"]]
    shapes = dict((n, tuple(p.shape)) for n, p in model.named_parameters())
    got = [i for g in opt["param_groups"] for i in g["params"]]
    if len(got) != len(order) or any(
        tuple(opt["state"][i][kind].shape) != shapes[order[k]] for k, i in enumerate(got) if i in opt["state"]
    ):
        raise CheckpointError(
            "DeepSpeed's optimizer state does not line up with the model's parameter groups",
            field="checkpoint",
            value=str(files[0]),
            fix="resume it on its own layout (--same-layout), or export only the weights (--to hf)",
        )
    return {order[k]: opt["state"][i][kind].float() for k, i in enumerate(got) if i in opt["state"]}


def _zero_merge(ckpt: Path, zero: int, kind: str | None, mp: int | None = None) -> dict[str, torch.Tensor]:
    """DeepSpeed's own zero_to_fp32 merge, which undoes the partitioning, alignment padding and ZeRO-3
    per-parameter split of the fp32 master partitions (``kind`` None: the weights, with the buffers and
    shared parameters zero_to_fp32 adds), or of one Adam moment: ZeRO 1-3 keep each moment as flat
    partitions laid out exactly like the masters (the optimizer steps on those flat tensors), so the merge
    is fed the moment's partitions in their place. ``mp``: only the files of that model-parallel (TP) rank
    (megatron with DeepSpeed ZeRO: one ZeRO checkpoint per TP rank). The merge functions are private to
    DeepSpeed (pinned version); the files are memory-mapped, so only what is merged is read."""
    from deepspeed.checkpoint.constants import (
        FP32_FLAT_GROUPS,
        OPTIMIZER_STATE_DICT,
        PARAM_ALIGNMENT_PADDINGS,
        SINGLE_PARTITION_OF_FP32_GROUPS,
    )
    from deepspeed.utils import zero_to_fp32 as z

    def mine(files: list[str]) -> list[str]:
        return [f for f in files if mp is None or f"mp_rank_{mp:02d}_" in Path(f).name]

    model_states = []
    for f in mine(z.get_model_state_files(str(ckpt))):
        # zero_to_fp32 calls torch.load(weights_only=False) itself and takes no loader: torch's own switch
        # makes that load weights_only (with the allow-list) for this call; one file at a time, so a
        # refusal names the file
        with forced_weights_only(f):
            model_states += z.parse_model_states([f])
    flat_groups = []
    paddings = None
    for f in mine(z.get_optim_files(str(ckpt))):
        # DeepSpeed's own pickles, verified and scanned first, loaded with weights_only and the allow-list
        sd = safe_torch_load(f, map_location="cpu", mmap=True)[OPTIMIZER_STATE_DICT]
        paddings = sd.get(PARAM_ALIGNMENT_PADDINGS)
        if kind is None:
            flat_groups.append(sd[SINGLE_PARTITION_OF_FP32_GROUPS if zero <= 2 else FP32_FLAT_GROUPS])
        else:
            state = (sd.get("base_optimizer_state") or sd["optimizer_state_dict"])["state"]  # ZeRO 1-2 / 3
            flat_groups.append([state[g][kind] for g in sorted(state)])
        del sd
    world = len(flat_groups)
    # its progress prints (stdout) and its tqdm bar "Gathering sharded weights" (stderr; ZeRO-3)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        if zero <= 2:
            merged = z._get_fp32_state_dict_from_zero2_checkpoint(
                world, flat_groups, model_states, False, paddings
            )
        else:
            merged = z._get_fp32_state_dict_from_zero3_checkpoint(world, flat_groups, model_states, False)
    trainable = {n for group in model_states[0].param_shapes for n in group}
    keep = (lambda n: True) if kind is None else (lambda n: n in trainable)
    return {n: t.float() for n, t in z.to_torch_tensor(merged).items() if keep(n)}  # fresh copies


def _megatron_deepspeed(ckpt: Path, meta: dict[str, Any], kind: str | None = None) -> dict[str, torch.Tensor]:
    """megatron with DeepSpeed ZeRO (pp = 1): one ZeRO checkpoint per TP rank over megatron's modules,
    each merged by DeepSpeed's zero_to_fp32 (:func:`_zero_merge`), then the TP shards back to HF by the
    same weight map the engine loads with."""
    from tessera.models.megatron import Shard, adapter_for
    from tessera.models.weight_map import mcore_to_hf

    cfg, layout = hf_config_of(meta), meta["layout"]
    tp, zero = int(layout["tp"]), int(layout["zero"])
    chunks = {}
    for r in range(tp):
        local = _zero_merge(ckpt, zero, kind, mp=r)
        chunks[Shard(tp=tp, tp_rank=r, etp=tp, etp_rank=r)] = {
            k: v for k, v in local.items() if not k.endswith("_extra_state")
        }
    return mcore_to_hf(chunks, adapter_for(cfg.model_type), cfg)


def read_adam_step(ckpt: Path, meta: dict[str, Any]) -> int:
    """The optimizer's update count. Every Tessera step is one update (fp16 loss scaling, which skips
    updates, is refused), so where the format keeps it per parameter it is checked against the step."""
    step = int(meta["step"])
    if meta["sharding"] == "torch-ddp":
        from tessera.engines.ddp import OPTIMIZER_FILE
        from tessera.tensorfile import LazyTensors

        lazy = LazyTensors([ckpt / OPTIMIZER_FILE])
        seen = {int(lazy[k]) for k in lazy if k.endswith("/step")}
        if seen and seen != {step}:
            raise CheckpointError(
                f"the optimizer counted {sorted(seen)} updates at step {step}",
                field="checkpoint",
                value=str(ckpt / OPTIMIZER_FILE),
                fix="resume the run on its own layout once and convert the next checkpoint",
            )
    return step
