"""The deepspeed engine's checkpoints read offline: DeepSpeed's own files as full HF tensors.

ZeRO-0 keeps the module's state dict whole in one model-states file (and torch AdamW's own state dict
beside it); ZeRO 1-3 keep fp32 master partitions, merged by DeepSpeed's ``zero_to_fp32`` exactly as
``get_fp32_state_dict_from_zero_checkpoint`` merges them (:func:`zero_merge`, which the megatron engine's
reader uses too, for DeepSpeed ZeRO over megatron's modules). Every pickle is loaded with
``weights_only=True`` and the allow-list of :mod:`tessera.safeload`; the checkpoint was verified (its
checksums, the static scan of its pickles) before a reader is called.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from tessera.engines.base import CheckpointReader, unreadable_sharding
from tessera.engines.zero import SHARDING_PREFIX
from tessera.engines.zero_lazy import ZeroTensors, flat_partitions, model_states
from tessera.errors import CheckpointError
from tessera.models.hf import hf_config_of
from tessera.safeload import safe_torch_load

#: DeepSpeed's file of the module (and, without ZeRO, the optimizer) state of a model-parallel rank
MODEL_STATES = "mp_rank_*_model_states.pt"


class ZeroReader(CheckpointReader):
    """The deepspeed engine's checkpoints (``sharding`` ``deepspeed-zero<stage>``)."""

    def weights(self, ckpt: Path, meta: dict[str, Any]) -> Mapping[str, torch.Tensor]:
        if not meta["sharding"].startswith(SHARDING_PREFIX):
            raise unreadable_sharding(ckpt, meta["sharding"])
        zero = int(meta["layout"]["zero"])
        if zero == 0:  # no partitions: the module's own state dict
            files = sorted(ckpt.glob(MODEL_STATES))
            return dict(safe_torch_load(files[0], map_location="cpu")["module"])
        return zero_tensors(ckpt, zero, None)

    def moment(self, ckpt: Path, meta: dict[str, Any], kind: str) -> Mapping[str, torch.Tensor] | None:
        sharding = meta["sharding"]
        if sharding == f"{SHARDING_PREFIX}0":
            return _zero0_moment(ckpt, meta, kind)
        if sharding.startswith(SHARDING_PREFIX):
            return zero_tensors(ckpt, int(meta["layout"]["zero"]), kind)
        return None


def zero_tensors(ckpt: Path, zero: int, kind: str | None) -> Mapping[str, torch.Tensor]:
    """The full tensors of a ZeRO 1-3 checkpoint, read one parameter at a time where the partition files
    are laid out as :class:`~tessera.engines.zero_lazy.ZeroTensors` knows (every checkpoint DeepSpeed's
    pinned version writes), else merged whole by DeepSpeed (:func:`zero_merge`)."""
    lazy = ZeroTensors(ckpt, zero, kind)
    return lazy if lazy.plan is not None else zero_merge(ckpt, zero, kind)


READER = ZeroReader()


def _zero0_moment(ckpt: Path, meta: dict[str, Any], kind: str) -> dict[str, torch.Tensor] | None:
    """Without ZeRO, DeepSpeed saves torch AdamW's own state dict, whose parameters are positions in its
    groups. Tessera built those groups (:func:`tessera.engines.optim.param_groups`: the HF model's
    parameters in order, matrices first), so the positions map back to names; every shape is checked.
    None for an optimizer of another form (DeepSpeed's bf16 / fp16 wrappers)."""
    from transformers import AutoModelForCausalLM

    from tessera.engines.optim import param_groups
    from tessera.models.adapters import inject, name_map

    files = sorted(ckpt.glob(MODEL_STATES))
    # DeepSpeed's own pickle, verified and scanned first, loaded with weights_only and the allow-list
    opt = safe_torch_load(files[0], map_location="cpu", mmap=True).get("optimizer")
    if not isinstance(opt, dict) or "state" not in opt or "param_groups" not in opt:
        return None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config_of(meta))
        if meta.get("peft") is not None:  # adapters: only they are in the optimizer's groups
            inject(model, meta["peft"])
    canon = name_map(model)
    named = {id(p): canon[n] for n, p in model.named_parameters()}
    order = [named[id(p)] for g in param_groups(model.named_parameters(), 0.0) for p in g["params"]]
    shapes = dict((canon[n], tuple(p.shape)) for n, p in model.named_parameters())
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


def zero_merge(ckpt: Path, zero: int, kind: str | None, mp: int | None = None) -> dict[str, torch.Tensor]:
    """DeepSpeed's own zero_to_fp32 merge, which undoes the partitioning, alignment padding and ZeRO-3
    per-parameter split of the fp32 master partitions (``kind`` None: the weights, with the buffers and
    shared parameters zero_to_fp32 adds), or of one Adam moment, fed the moment's partitions in the
    masters' place (:func:`flat_partitions`). ``mp``: only the files of that model-parallel (TP) rank
    (megatron with DeepSpeed ZeRO: one ZeRO checkpoint per TP rank). The merge functions are private to
    DeepSpeed (pinned version); the files are memory-mapped, so only what is merged is read."""
    from deepspeed.utils import zero_to_fp32 as z

    states = model_states(ckpt, mp)
    flat_groups, paddings = [], None
    for _, _, flats, pads in flat_partitions(ckpt, zero, kind, mp):
        flat_groups.append(flats)
        paddings = pads  # the same in every rank's file
    world = len(flat_groups)
    # its progress prints (stdout) and its tqdm bar "Gathering sharded weights" (stderr; ZeRO-3)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        if zero <= 2:
            merged = z._get_fp32_state_dict_from_zero2_checkpoint(world, flat_groups, states, False, paddings)
        else:
            merged = z._get_fp32_state_dict_from_zero3_checkpoint(world, flat_groups, states, False)
    trainable = {n for group in states[0].param_shapes for n in group}
    keep = (lambda n: True) if kind is None else (lambda n: n in trainable)
    return {n: t.float() for n, t in z.to_torch_tensor(merged).items() if keep(n)}  # fresh copies
