"""Engine `deepspeed`: the HF module itself under DeepSpeed ZeRO 0-3 data parallelism.

DeepSpeed owns sharding (ZeRO stages, offload), gradient accumulation boundaries, clipping, mixed
precision and its checkpoint format. Tessera owns the config it is given (built from the recipe; a
user's own JSON is merged in, and a value that contradicts the recipe is an error, never a silent
precedence rule), the loss normalisation (by tokens, see :mod:`tessera.engines.base`) and the LR schedule.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tessera.comm.groups import multi_rank
from tessera.config.schema import Recipe
from tessera.engines.base import StepResult, label_tokens, summed_token_loss
from tessera.engines.held import deepspeed_grad_bytes, deepspeed_params_and_optimizer
from tessera.errors import CheckpointError, RecipeError
from tessera.plan.layout import ParallelLayout
from tessera.train.schedule import lr_factor

# recipe field -> (DeepSpeed JSON path, how the recipe value reads in DeepSpeed terms)
_CONFLICT_KEYS: list[tuple[str, tuple[str, ...]]] = [
    ("parallel.micro_batch", ("train_micro_batch_size_per_gpu",)),
    ("parallel.grad_accum", ("gradient_accumulation_steps",)),
    ("parallel.global_batch", ("train_batch_size",)),
    ("parallel.zero", ("zero_optimization", "stage")),
    ("optim.grad_clip", ("gradient_clipping",)),
    ("train.precision", ("bf16", "enabled")),
    ("train.precision", ("fp16", "enabled")),
    ("parallel.offload_optimizer", ("zero_optimization", "offload_optimizer", "device")),
    ("parallel.offload_params", ("zero_optimization", "offload_param", "device")),
]
# sections Tessera builds itself from the recipe; a user JSON may not bring its own
_OWNED_SECTIONS = {"optimizer": "optim.*", "scheduler": "optim.schedule / optim.warmup_steps"}


def _get_path(d: dict[str, Any], path: tuple[str, ...]) -> Any:
    cur: Any = d
    for p in path:
        if not isinstance(cur, dict) or p not in cur:
            return None
        cur = cur[p]
    return cur


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def build_ds_config(recipe: Recipe, layout: ParallelLayout, *, device: str) -> dict[str, Any]:
    """The DeepSpeed JSON for this run: recipe values, plus the user's JSON where it does not conflict."""
    zero: dict[str, Any] = {"stage": layout.zero}
    if layout.zero > 0:
        # contiguous, deterministic buckets; overlap only helps where there is a separate comm stream
        zero.update(contiguous_gradients=True, overlap_comm=device == "cuda", reduce_scatter=True)
    if layout.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": device == "cuda"}
    if layout.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": device == "cuda"}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": layout.micro_batch,
        "gradient_accumulation_steps": layout.grad_accum,
        "train_batch_size": layout.global_batch,
        "gradient_clipping": recipe.optim.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": recipe.train.precision == "bf16"},
        "fp16": {"enabled": recipe.train.precision == "fp16"},
        "steps_per_print": 10**9,  # Tessera logs; keep DeepSpeed's own step printing quiet
        "wall_clock_breakdown": False,
        # torch's AdamW with offload is allowed (bit-exact resume, no JIT op build)
        "zero_force_ds_cpu_optimizer": False,
    }
    user_path = recipe.parallel.deepspeed_config
    if user_path is None:
        return cfg
    try:
        user = json.loads(Path(user_path).read_text())
    except FileNotFoundError:
        raise RecipeError(
            "DeepSpeed config file not found",
            field="parallel.deepspeed_config",
            value=user_path,
            fix="give the path of an existing JSON file",
        ) from None
    except json.JSONDecodeError as e:
        raise RecipeError(
            f"not valid JSON: {e}",
            field="parallel.deepspeed_config",
            value=user_path,
            fix="fix the JSON syntax",
        ) from None
    for section, owner in _OWNED_SECTIONS.items():
        if section in user:
            raise RecipeError(
                f"'{section}' in {user_path} conflicts with the recipe, which builds it from {owner}",
                field="parallel.deepspeed_config",
                value=user_path,
                fix=f"remove '{section}' from the JSON and set {owner} in the recipe",
            )
    for field, path in _CONFLICT_KEYS:
        theirs = _get_path(user, path)
        ours = _get_path(cfg, path)
        if theirs is None or theirs == "auto":
            continue
        if path[-1] == "device":  # offload: recipe says on/off, the JSON says a device
            ours, theirs = ours is not None, theirs != "none"
        if theirs != ours:
            raise RecipeError(
                f"conflicts with {'.'.join(path)} = {theirs!r} in {user_path} (the recipe gives {ours!r})",
                field=field,
                value=ours,
                fix=f"remove {'.'.join(path)} from the JSON or set {field} to match it",
            )
    return _deep_merge(cfg, user)


def build_optimizer(recipe: Recipe, params, *, device: str, offload: bool) -> torch.optim.Optimizer:
    o = recipe.optim
    groups = _param_groups(params, o.weight_decay)
    if o.name == "deepspeed_adam":
        # JIT-built C++/CUDA ops (cached under ~/.cache/torch_extensions after the first build)
        if offload or device == "cpu":
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(groups, lr=o.lr, betas=o.betas, eps=o.eps, adamw_mode=True)
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam(groups, lr=o.lr, betas=o.betas, eps=o.eps, adam_w_mode=True)
    return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, foreach=False)


def _param_groups(named_params, weight_decay: float) -> list[dict[str, Any]]:
    """No weight decay on biases and norm weights (1-D tensors), the usual LLM practice."""
    decay, no_decay = [], []
    for _, p in named_params:
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


class DeepSpeedEngine:
    """HF causal LM + ``deepspeed.initialize``; one ``train_step`` = one optimizer step."""

    def __init__(self, model: torch.nn.Module, recipe: Recipe, layout: ParallelLayout, *, device: str):
        import deepspeed

        self.layout = layout
        self.device = torch.device(device if device == "cpu" else f"cuda:{torch.cuda.current_device()}")
        self.ds_config = build_ds_config(recipe, layout, device=device)
        optimizer = build_optimizer(
            recipe, model.named_parameters(), device=device, offload=layout.offload_optimizer
        )
        # the LR is a pure function of the step (set before each update), so a resumed run - even one
        # whose train.steps was raised - follows exactly the schedule of an uninterrupted run
        self._optim_cfg, self._total_steps = recipe.optim, recipe.train.steps
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=self.ds_config
        )
        self.dp_group = None  # the whole world: the deepspeed engine is data-parallel only

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    def _dp_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` in place over the data-parallel group."""
        if multi_rank():
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.dp_group)
        return t

    def set_lr(self, step: int) -> float:
        lr = self._optim_cfg.lr * lr_factor(step - 1, optim=self._optim_cfg, total_steps=self._total_steps)
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]], step: int) -> StepResult:
        """One optimizer step (``step`` is 1-based and sets the LR)."""
        assert len(micro_batches) == self.layout.grad_accum, "sampler and layout disagree"  # internal
        lr = self.set_lr(step)
        local_tokens = float(sum(label_tokens(mb["labels"]) for mb in micro_batches))
        local_inputs = float(sum(mb["input_ids"].numel() for mb in micro_batches))
        counts = torch.tensor([local_tokens, local_inputs], dtype=torch.float64, device=self.device)
        global_tokens, global_inputs = self._dp_sum(counts).tolist()
        # DeepSpeed divides by grad_accum (scale_wrt_gas) and averages over dp: undo both so that the
        # gradient is d(sum of token losses)/d(theta) / (tokens in the global batch).
        scale = self.layout.grad_accum * self.layout.dp / max(global_tokens, 1.0)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.engine.train()
        manual_norm = None
        for i, mb in enumerate(micro_batches):
            ids = mb["input_ids"].to(self.device, non_blocking=True)
            labels = mb["labels"].to(self.device, non_blocking=True)
            logits = self.engine(input_ids=ids, use_cache=False).logits
            token_loss = summed_token_loss(logits, labels)
            loss_sum += token_loss.detach()  # stays on the device: no sync per micro-batch
            self.engine.backward(token_loss * scale)
            if i == len(micro_batches) - 1:
                if self.layout.zero == 0:
                    # without ZeRO, DeepSpeed clips but does not keep the norm; gradients are all-reduced
                    # by now (backward at the boundary), so the pre-clip norm is the same on every rank
                    manual_norm = self._grad_norm()
                grads_held = deepspeed_grad_bytes(self.engine, self.layout.zero)
            self.engine.step()
        self.held_state_bytes = {
            "grads": grads_held,
            **deepspeed_params_and_optimizer(self.engine, self.layout.zero),
        }
        self._dp_sum(loss_sum)
        grad_norm = self.engine.get_global_grad_norm() if manual_norm is None else manual_norm
        grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
        return StepResult(
            loss=float(loss_sum) / max(global_tokens, 1.0),
            grad_norm=grad_norm,
            lr=lr,
            tokens=int(global_tokens),
            input_tokens=int(global_inputs),
        )

    def _grad_norm(self) -> float:
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self.engine.module.parameters():
            if p.grad is not None:
                sq += p.grad.detach().double().pow(2).sum()
        return float(sq.sqrt())

    def named_groups(self) -> dict[Any, str]:
        """Process groups by name for the comm accounting: data parallelism over the whole world."""
        return {}

    def close(self) -> None:
        """Nothing to release: the process group belongs to the worker."""

    def save(self, root: Path, tag: str, client_state: dict[str, Any]) -> None:
        self.engine.save_checkpoint(str(root), tag=tag, client_state=client_state, save_latest=False)

    def load(self, root: Path, tag: str) -> dict[str, Any]:
        return load_deepspeed_checkpoint(self.engine, root, tag)


def load_deepspeed_checkpoint(engine: Any, root: Path, tag: str) -> dict[str, Any]:
    """Model, optimizer (no scheduler: the LR is a function of the step) and the client state."""
    path, client_state = engine.load_checkpoint(
        str(root), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=False
    )
    if path is None:
        raise CheckpointError(
            "DeepSpeed found no checkpoint to load",
            field="checkpoint",
            value=str(Path(root) / tag),
            fix="check the run directory's checkpoints/",
        )
    return client_state or {}
