"""Engine `ddp`: the naive data-parallel baseline — what a user without Tessera would write.

A full replica of the HF model on every rank, ``torch.nn.parallel.DistributedDataParallel`` with its
defaults (25 MiB buckets, a 1 MiB first bucket, gradients copied out of the buckets), one all-reduce of
all gradients per optimizer step (the other micro-batches accumulate under ``no_sync``), torch AdamW, no
ZeRO, no tensor or pipeline parallelism; bf16 through ``torch.autocast`` with fp32 parameters. Same data,
same token-normalised loss and LR schedule as every other engine, so a comparison against it measures the
layout, nothing else.

Checkpoints are safetensors written by rank 0 (the replicas are identical): ``model.safetensors`` keyed
by HF parameter names, and ``optimizer.safetensors`` with each parameter's Adam moments and step. With
adapters (a ``peft`` section) both hold only what trains, by canonical name
(:mod:`tessera.models.adapters`); the frozen base is the model source's, recorded in meta.json.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tessera.comm.accounting import Phase
from tessera.config.schema import Recipe
from tessera.engines.base import (
    Engine,
    HFObjective,
    ModelSource,
    Moments,
    ShardedStateDict,
    StepResult,
    TensorSlice,
    global_counts,
    hf_eval_loss,
    hf_recompute,
    mean_aux_loss,
    step_result,
)
from tessera.engines.held import ACTIVATIONS, optimizer_bytes, tensor_bytes
from tessera.engines.optim import MOMENTS, LRSchedule, adam_state, build_optimizer, set_adam_step
from tessera.errors import CheckpointError
from tessera.hostmem import lean_construction
from tessera.models.adapters import named_parameters
from tessera.plan.layout import ParallelLayout
from tessera.tensorfile import load_tensors_and_meta, save_tensors

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"


def counted_allreduce_hook(process_group, bucket):  # no annotations: DDP checks them against its own types
    """PyTorch's own default all-reduce hook (divide by the group size, sum), registered explicitly.

    DDP's built-in reducer calls the C++ process group directly, so a count of ``torch.distributed``'s
    Python functions (:mod:`tessera.comm.accounting`) would never see the baseline communicate. This hook
    is the same arithmetic issued through ``torch.distributed.all_reduce``, which the count sees (bytes,
    per bucket). Its time is measured from launch to completion: DDP overlaps it with the backward pass,
    so it is time in flight, not time the rank was blocked."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from tessera.comm.accounting import add_async_seconds

    group = process_group if process_group is not None else dist.group.WORLD
    t0 = time.perf_counter()
    fut = default_hooks.allreduce_hook(group, bucket)

    def done(f: torch.futures.Future) -> torch.Tensor:
        add_async_seconds("all_reduce", group, bucket.buffer(), time.perf_counter() - t0)
        return f.value()

    return fut.then(done)


class DDPEngine(Engine):
    """torch DDP over full HF replicas; one ``train_step`` = one optimizer step."""

    sharding = "torch-ddp"

    def __init__(self, source: ModelSource, recipe: Recipe, layout: ParallelLayout, *, device: str) -> None:
        from torch.nn.parallel import DistributedDataParallel

        self.layout = layout
        self.device = torch.device(device if device == "cpu" else f"cuda:{torch.cuda.current_device()}")
        with lean_construction():
            self.model = source.build_hf(device=self.device)  # fp32 parameters; bf16 through autocast
        hf_recompute(self.model, layout.recompute)
        self.ddp = DistributedDataParallel(
            self.model, device_ids=None if self.device.type == "cpu" else [self.device.index]
        )
        self.ddp.register_comm_hook(None, counted_allreduce_hook)
        self.optimizer = build_optimizer(recipe, self.model.named_parameters(), device=device, offload=False)
        self.schedule = LRSchedule(recipe)
        self.grad_clip = recipe.optim.grad_clip
        self.bf16 = recipe.train.precision == "bf16"
        self.objective = HFObjective.of(source, autocast_bf16=self.bf16)
        self._grads_held: int | None = None
        #: what a checkpoint holds: every parameter, or with adapters only the trained ones
        self.adapters = source.peft is not None

    def _saved(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in named_parameters(self.model) if p.requires_grad or not self.adapters]

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]], step: int) -> StepResult:
        assert len(micro_batches) == self.layout.grad_accum, "sampler and layout disagree"  # internal
        lr = self.schedule.set(self.optimizer, step)
        tokens, inputs = global_counts(micro_batches, self.layout, device=self.device, group=None)
        # DDP averages gradients over dp and the micro-batches add up: the product is 1 / global tokens
        scale = self.layout.dp / max(tokens, 1.0)
        self.ddp.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        aux_sum: torch.Tensor | None = None
        m = len(micro_batches)
        for i, mb in enumerate(micro_batches):
            with contextlib.nullcontext() if i == m - 1 else self.ddp.no_sync():
                with ACTIVATIONS.micro_batch():
                    token_loss, aux = self.objective(self.ddp, mb, self.device)
                loss_sum += token_loss.detach()
                objective = token_loss * scale
                if aux is not None:  # DDP averages over dp; the micro-batches add up: divide by m here
                    objective = objective + aux / m
                    aux_sum = aux.detach() if aux_sum is None else aux_sum + aux.detach()
                objective.backward()
        if self._grads_held is None:  # gradients exist between backward and the next zero_grad
            self._grads_held = tensor_bytes(p.grad for p in self.model.parameters() if p.grad is not None)
        # the reported loss, summed over dp while the optimizer steps
        pending = dist.all_reduce(loss_sum, async_op=True) if self.layout.dp > 1 else None
        with Phase() as opt:
            # the pre-clip norm of the all-reduced gradients: the same on every rank
            norm = torch.nn.utils.clip_grad_norm_(
                self.model.parameters(), self.grad_clip if self.grad_clip > 0 else math.inf
            )
            self.optimizer.step()
        if pending is not None:
            pending.wait()
        return step_result(
            float(loss_sum),
            float(norm),
            lr=lr,
            tokens=tokens,
            inputs=inputs,
            optimizer=opt,
            moe_aux_loss=mean_aux_loss(aux_sum, self.layout),
        )

    def eval_loss(self, micro_batches: list[dict[str, torch.Tensor]]) -> tuple[float, float]:
        return hf_eval_loss(
            self.model, micro_batches, self.layout, device=self.device, autocast_bf16=self.bf16
        )

    def named_groups(self) -> dict[Any, str]:
        """Data parallelism over the whole world: the comm accounting names it from the layout."""
        return {}

    def held_state(self) -> dict[str, int]:
        params = list(self.model.parameters())
        return {
            "params": tensor_bytes(params),
            "grads": self._grads_held or 0,
            "optimizer": optimizer_bytes(self.optimizer, params),
            "frozen": tensor_bytes(p for p in params if not p.requires_grad),
        }

    def state_dict(self) -> ShardedStateDict:
        """Whole tensors: every rank holds a full replica."""
        return {n: [TensorSlice.whole(p.detach())] for n, p in named_parameters(self.model)}

    def optimizer_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        names = {p: n for n, p in named_parameters(self.model)}
        for p, st in self.optimizer.state.items():
            for k, v in st.items():
                if torch.is_tensor(v):
                    yield f"{names.get(p, '?')}.{k}", v

    def modules(self) -> list[torch.nn.Module]:
        return [self.model]

    def import_optimizer(self, moments: Moments, step: int) -> None:
        """Each parameter's AdamW state from the full HF-named moments (every rank: a full replica)."""
        with torch.no_grad():
            for name, p in named_parameters(self.model):
                if not p.requires_grad:
                    continue  # a frozen base has no optimizer state
                st = adam_state(self.optimizer, p)
                for kind in MOMENTS:
                    st[kind].copy_(moments[kind][name])
        set_adam_step(self.optimizer, step)

    # ---- checkpoints -------------------------------------------------------------------------------
    saves_in_background = True  # safetensors through save_tensors

    def save(self, path: Path) -> None:
        if dist.is_initialized() and dist.get_rank() != 0:
            return  # identical replicas: rank 0 writes for all
        named = self._saved()
        save_tensors(path / MODEL_FILE, {n: p for n, p in named})
        state: dict[str, torch.Tensor] = {}
        for n, p in named:
            for k, v in self.optimizer.state.get(p, {}).items():
                state[f"{n}/{k}"] = v if torch.is_tensor(v) else torch.tensor(v)
        ids = {id(p): n for n, p in named}
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [ids[id(p)] for p in g["params"]]}
            for g in self.optimizer.param_groups
        ]
        save_tensors(path / OPTIMIZER_FILE, state, {"param_groups": groups})

    def load(self, path: Path) -> None:
        weights, _ = load_tensors_and_meta(path / MODEL_FILE)
        state, meta = load_tensors_and_meta(path / OPTIMIZER_FILE)
        named = dict(self._saved())
        missing = sorted(set(named) - set(weights))
        if missing:
            raise CheckpointError(
                f"{len(missing)} parameter(s) of the model are not in the checkpoint, e.g. {missing[0]}",
                field="checkpoint",
                value=str(path / MODEL_FILE),
                fix="resume with the model the checkpoint was written for (see its meta.json)",
            )
        with torch.no_grad():
            for n, p in named.items():
                p.copy_(weights[n])
        # torch's own optimizer state_dict, rebuilt from the names: state indexed by position in the groups
        groups, position = [], {}
        for g in meta["param_groups"]:
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": []})
            for n in g["params"]:
                groups[-1]["params"].append(len(position))
                position[n] = len(position)
        per_param: dict[int, dict[str, torch.Tensor]] = {}
        for key, v in state.items():
            n, k = key.rsplit("/", 1)
            per_param.setdefault(position[n], {})[k] = v
        self.optimizer.load_state_dict({"state": per_param, "param_groups": groups})

    def close(self) -> None:
        """Nothing to release: the process group belongs to the worker."""
