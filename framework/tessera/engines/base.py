"""The engine protocol every engine implements completely, and the step logic all of them share.

An engine owns one rank's model, optimizer and the collectives of its layout; the training loop
(:mod:`tessera.train.loop`) only calls the methods of :class:`Engine`, and engines are built through the
registry (:mod:`tessera.tables.engines`) with one signature, ``Engine(source, recipe, layout,
device=...)``, so nothing above this layer branches on an engine's name.

Loss normalisation is by tokens, not by micro-batches: a step's loss is the sum of token cross-entropies
over the whole global batch (all micro-batches, all data-parallel ranks) divided by the number of label
tokens in it. That is what a single-rank, no-accumulation run computes, so layouts that split the same
global batch differently give the same numbers even when micro-batches carry different numbers of tokens.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tessera.comm.accounting import Phase
from tessera.config.schema import ModelSection, Recipe
from tessera.errors import CheckpointError
from tessera.plan.layout import ParallelLayout
from tessera.tables.families import family_of

IGNORE_INDEX = -100


@dataclass
class StepResult:
    """What one optimizer step reports (global values, identical on every rank)."""

    loss: float
    grad_norm: float | None  # the pre-clip global norm; None when the engine reports none
    lr: float
    tokens: int  # label tokens in the global batch
    input_tokens: int  # input positions in the global batch (throughput counts these)
    optimizer_s: float = 0.0  # wall seconds of the optimizer step (clip + update), its collectives included
    optimizer_comm_s: float = 0.0  # the counted collective seconds inside optimizer_s
    #: the MoE load-balancing loss added to the objective (coefficient included; mean over micro-batches
    #: and data-parallel ranks, summed over layers); None without model.moe_aux_loss_coeff
    moe_aux_loss: float | None = None


@dataclass(frozen=True)
class ModelSource:
    """Where an engine's initial weights come from: the recipe's model section (an inline HF config or a
    local directory, random init from ``seed`` or pretrained), with the tokenizer's vocabulary size.

    Every engine and layout starts from the same weights, and no rank builds more of the model than it
    holds: :meth:`tensors` reads / draws them one tensor, or one part of a tensor, per access (ZeRO-3
    partitions, TP slices, pipeline stages, experts), and :meth:`build_hf` makes the whole HF model only
    for the engines that hold it whole (ddp, ZeRO 0-2), directly in its training dtype on its device."""

    section: ModelSection
    vocab_size: int
    seed: int
    #: an HF directory (safetensors) whose tensors replace the initial weights: a resharded checkpoint's
    #: staged weights; ``model.pretrained`` reads ``model.path`` the same way
    weights: Path | None = None
    #: the tokenizer's bos / eos / pad ids, written into the config of a model trained from scratch
    token_ids: Mapping[str, int | None] | None = None
    #: the recipe's ``peft`` section: adapters on the frozen base (:mod:`tessera.models.adapters`)
    peft: Any = None

    @classmethod
    def of(
        cls,
        recipe: Recipe,
        *,
        vocab_size: int,
        weights: Path | None = None,
        token_ids: Mapping[str, int | None] | None = None,
    ) -> ModelSource:
        return cls(
            section=recipe.model,
            vocab_size=vocab_size,
            seed=recipe.train.seed,
            weights=weights,
            token_ids=token_ids,
            peft=recipe.peft,
        )

    def hf_config(self) -> Any:
        from tessera.models.hf import check_vocab, load_hf_config

        cfg = load_hf_config(self.section, vocab_size=self.vocab_size, token_ids=self.token_ids)
        check_vocab(cfg, self.vocab_size)
        return cfg

    def weights_dir(self) -> Path | None:
        if self.weights is not None:
            return Path(self.weights)
        return Path(self.section.path) if self.section.pretrained and self.section.path else None

    def tensors(self) -> Mapping[str, torch.Tensor]:
        """The initial weights by HF name, read or drawn lazily: the given directory's (lazy safetensors
        reads), else the seeded rule's (:class:`~tessera.models.init.SeededWeights`); with adapters, theirs
        too, by canonical name (:class:`~tessera.models.adapters.WithAdapters`)."""
        from tessera.models.hf import hf_dir_tensors
        from tessera.models.init import SeededWeights

        d = self.weights_dir()
        if self.peft is None:
            return hf_dir_tensors(d) if d is not None else SeededWeights(self.hf_config(), self.seed)
        from tessera.models.adapters import adapter_shapes, adapter_source

        cfg = self.hf_config()
        base = (
            hf_dir_tensors(d, extra=set(adapter_shapes(cfg, self.peft)))
            if d is not None
            else SeededWeights(cfg, self.seed)
        )
        return adapter_source(cfg, self.peft, base, seed=self.seed)

    def build_hf(self, *, dtype: torch.dtype = torch.float32, device: Any = "cpu") -> torch.nn.Module:
        """The whole HF model in ``dtype`` on ``device`` (with the recipe's adapters, its base frozen),
        filled from :meth:`tensors` one tensor at a time."""
        from tessera.models.hf import empty_model, fill_from

        model = empty_model(
            self.hf_config(), attn_implementation=self.section.attn_implementation, dtype=dtype, device=device
        )
        self.add_adapters(model, device=device)
        fill_from(model, self.tensors(), where=str(self.weights_dir() or "model.hf_config"))
        return model

    def add_adapters(self, model: torch.nn.Module, *, device: Any = "cpu") -> None:
        """The recipe's adapters into the HF ``model`` in place (none without a ``peft`` section); their
        values come from :meth:`tensors` (fill them after this)."""
        if self.peft is None:
            return
        from transformers.initialization import no_init_weights

        from tessera.models.adapters import inject

        with no_init_weights(), torch.device(device):  # values come from the seeded rule, not peft's draw
            inject(model, self.peft)

    def initial_weights(self) -> dict[str, Any]:
        """What the manifest records of the initial weights: the sha256 of the weight files of a
        pretrained / given directory, or of the tensors the seed gives (by HF name, in fp32, streamed one
        tensor at a time: every engine and layout of the same model and seed records the same hash; above
        ``DIGEST_MAX_PARAMS`` only the rule and the seed, which decide them)."""
        d = self.weights_dir()
        if d is not None:
            from tessera.evidence.manifest import files_digest

            files = sorted(d.glob("*.safetensors")) or sorted(d.glob("*.bin"))
            return {"from": "files", "path": str(d), "sha256": files_digest(files)}
        from tessera.evidence.manifest import weights_digest
        from tessera.models.init import INIT_RULE, SeededWeights

        tensors = SeededWeights(self.hf_config(), self.seed)  # the base's (adapters start from their rule)
        record: dict[str, Any] = {"from": "seed", "seed": self.seed, "rule": INIT_RULE}
        if sum(math.prod(tensors.shape_of(n)) for n in tensors) <= DIGEST_MAX_PARAMS:
            record["sha256"] = weights_digest(tensors)
        return record

    def base_identity(self) -> dict[str, Any]:
        """What the base under adapters is, for every checkpoint's meta.json (a checkpoint holds only the
        adapters): the recipe's pretrained directory (path + sha256 of its weight files) or the seeded
        rule, never a staged copy (resharding stages the base beside the adapters)."""
        import dataclasses

        return dataclasses.replace(self, weights=None, peft=None).initial_weights()


#: the largest model whose seeded initial weights the manifest hashes (drawing them again takes time)
DIGEST_MAX_PARAMS = 2_000_000_000


@dataclass(frozen=True)
class TensorSlice:
    """The part of a full HF tensor that one rank holds.

    ``index`` gives, per dimension of the full tensor (shape ``full_shape``), the ``(start, stop)`` range
    held, and ``tensor`` has exactly that shape. ``flat`` instead says the rank holds elements
    ``[start, stop)`` of the flattened full tensor (ZeRO-3 partitions), with ``tensor`` 1-D."""

    tensor: torch.Tensor
    full_shape: tuple[int, ...]
    index: tuple[tuple[int, int], ...] | None = None
    flat: tuple[int, int] | None = None

    @classmethod
    def whole(cls, t: torch.Tensor) -> TensorSlice:
        return cls(tensor=t, full_shape=tuple(t.shape), index=tuple((0, n) for n in t.shape))

    def place(self, full: torch.Tensor) -> None:
        """Write this slice into ``full`` (a tensor of ``full_shape``)."""
        if self.flat is not None:
            full.view(-1)[self.flat[0] : self.flat[1]] = self.tensor.reshape(-1)
        else:
            assert self.index is not None
            full[tuple(slice(a, b) for a, b in self.index)] = self.tensor


#: HF parameter name -> the slices of it this rank holds (a fused tensor can hold several of one name)
ShardedStateDict = dict[str, list[TensorSlice]]
#: Adam moments of a whole model: ``moments["exp_avg"][hf_name]`` is the full fp32 tensor (read lazily)
Moments = Mapping[str, Mapping[str, torch.Tensor]]


@runtime_checkable
class Engine(Protocol):
    """One rank's model + optimizer under a layout. Built as ``cls(source, recipe, layout, device=...)``."""

    device: torch.device
    #: how the data-parallel state is sharded and saved, recorded in checkpoints (e.g. "deepspeed-zero2")
    sharding: str
    #: whether :meth:`save` hands every file it writes to the checkpoint save's writer (:mod:`tessera.writes`),
    #: so that ``checkpoint.async`` can write them in the background from a snapshot
    saves_in_background: bool = False

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]], step: int) -> StepResult:
        """One optimizer step over this rank's micro-batches (``step`` is 1-based and sets the LR)."""
        ...

    def eval_loss(self, micro_batches: list[dict[str, torch.Tensor]]) -> tuple[float, float]:
        """(summed token loss, label tokens) of one held-out global batch (this rank's micro-batches of
        it, as in ``train_step``), summed over the whole batch; no gradients, nothing updated."""
        ...

    def named_groups(self) -> dict[Any, str]:
        """The engine's own process groups by name (dp, tp, pp, ep, ...) for the comm accounting."""
        ...

    def held_state(self) -> dict[str, int]:
        """Bytes of model states this rank holds now: ``params``, ``grads`` (as held at the gradient
        accumulation boundary), ``optimizer``. Computed on demand from the engine's own tensors."""
        ...

    def state_dict(self) -> ShardedStateDict:
        """This rank's parameters keyed by HF parameter names, each with the slice of the full tensor."""
        ...

    def optimizer_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(label, tensor) of every optimizer-state tensor this rank holds (master copies, moments)."""
        ...

    def modules(self) -> list[torch.nn.Module]:
        """The local model modules (chunks) this rank runs forward and backward through."""
        ...

    def import_optimizer(self, moments: Moments, step: int) -> None:
        """Set this rank's share of the Adam moments from full HF-named tensors, and every parameter's
        step count (a resharded checkpoint: the weights came in through the :class:`ModelSource`)."""
        ...

    def save(self, path: Path) -> None:
        """Write this rank's share of model and optimizer state into the checkpoint directory ``path``."""
        ...

    def load(self, path: Path) -> None:
        """Restore model and optimizer state from the (verified) checkpoint directory ``path``."""
        ...

    def close(self) -> None:
        """Release what the engine initialised (global parallel state); the process group stays."""
        ...

    def load_resharded(self, path: Path) -> str:
        """Restore model and optimizer state from the (verified) checkpoint ``path`` written at another
        layout, resharding it while loading, with no layout-free stage; returns what resharded it, in
        words, for the manifest's record. Only an engine whose registry entry names a ``reshard_on_load``
        that accepts the checkpoint is asked; every other one takes a resharded checkpoint through the
        stage (its weights as the :class:`ModelSource`, then :meth:`import_optimizer`)."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot load a checkpoint of another layout itself: its registry entry "
            "must name no reshard_on_load (the layout-free stage then reshards it), or it must implement "
            "load_resharded"
        )


class CheckpointReader(ABC):
    """An engine's offline checkpoint reader: its own files as full HF tensors, with no process group
    and no model built, for ``tessera convert`` / ``tessera verify`` and the resharding stage. The
    registry entry's ``reader`` names an instance; :mod:`tessera.checkpoint.reader` verifies the
    checkpoint first and calls it. ``meta`` is the checkpoint's ``meta.json`` (format v2)."""

    @abstractmethod
    def weights(self, ckpt: Path, meta: dict[str, Any]) -> Mapping[str, torch.Tensor]:
        """Every parameter (and buffer the format keeps) by HF name, whole; a reader may read each when it
        is asked for (megatron's, ZeRO's), so a caller reading them in turn never holds the model."""

    def moment(self, ckpt: Path, meta: dict[str, Any], kind: str) -> Mapping[str, torch.Tensor] | None:
        """One Adam moment (``exp_avg`` or ``exp_avg_sq``) of every trainable parameter by HF name; None
        where the format's moments are not readable offline."""
        return None

    def adam_step(self, ckpt: Path, meta: dict[str, Any]) -> int:
        """The optimizer's update count. Every Tessera step is one update (fp16 loss scaling, which skips
        updates, is refused): the step, unless the format keeps its own count to check it against."""
        return int(meta["step"])


def unreadable_sharding(ckpt: Path, sharding: str) -> CheckpointError:
    """The error of a reader given a checkpoint of its engine in a sharding it cannot read."""
    return CheckpointError(
        f"reading sharding {sharding!r} is not supported yet",
        field="checkpoint",
        value=str(ckpt),
        fix="convert from a checkpoint of the deepspeed, ddp or megatron (zero_impl megatron) engine",
    )


# ---- shared step logic -------------------------------------------------------------------------------


def hf_recompute(model: torch.nn.Module, recompute: str) -> None:
    """``parallel.recompute: full`` on an HF module: gradient checkpointing of every decoder layer (the
    layer's input is kept; its activations are recomputed in backward). Non-reentrant checkpointing: it
    works under ZeRO-3's parameter hooks and with inputs that need no grad; RNG state is restored, so
    dropout draws the same masks in the recompute. (``selective`` is refused by the layout rules.)"""
    if recompute == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def label_tokens(labels: torch.Tensor) -> int:
    """Tokens that carry a loss after the causal shift (position 0 of each row predicts nothing)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def summed_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies in fp32 (the caller divides by the global token count). The
    labels move, not the logits: position t is scored against label t+1 and the last position against
    nothing, so no shifted copy of the b·s·V logits is made."""
    return summed_target_loss(logits, next_token_targets(labels))


def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """What position t of each row is scored against: label t+1 (the last position: nothing)."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def summed_target_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Sum of the fp32 cross-entropies of ``logits`` against targets already shifted (ignored: -100)."""
    return F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)),
        target.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def dp_sum(t: torch.Tensor, layout: ParallelLayout, group: Any = None) -> torch.Tensor:
    """Sum ``t`` in place over the data-parallel group (``None``: the whole world; under Ulysses its sp
    ranks too, each with its slice of the same rows)."""
    if layout.data_ranks > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


class MicroBatches(list):
    """This rank's micro-batches of one step, with the global batch's (label tokens, input positions)
    when the caller knows them: the training loop does, from the seeded sampler that gives every rank
    every rank's indices, so :func:`global_counts` needs no collective."""

    def __init__(self, items: Iterable[dict[str, torch.Tensor]], counts: tuple[float, float] | None = None):
        super().__init__(items)
        self.counts = counts


def global_counts(
    micro_batches: list[dict[str, torch.Tensor]], layout: ParallelLayout, *, device: torch.device, group: Any
) -> tuple[float, float]:
    """(label tokens, input positions) of the global batch: known beforehand (:class:`MicroBatches`), or
    this rank's counts summed over dp (under Ulysses the sp ranks of a group hold the same whole rows:
    summed over them too, then divided by sp)."""
    if isinstance(micro_batches, MicroBatches) and micro_batches.counts is not None:
        return micro_batches.counts
    local = [
        float(sum(label_tokens(mb["labels"]) for mb in micro_batches)),
        float(sum(mb["input_ids"].numel() for mb in micro_batches)),
    ]
    summed = dp_sum(torch.tensor(local, dtype=torch.float64, device=device), layout, group) / layout.sp
    tokens, inputs = summed.tolist()
    return tokens, inputs


def step_result(
    loss_sum: float,
    grad_norm: Any,
    *,
    lr: float,
    tokens: float,
    inputs: float,
    optimizer: Phase | None = None,
    moe_aux_loss: float | None = None,
) -> StepResult:
    """The step's report; an engine that has no norm passes ``None`` (never NaN, which means diverged);
    ``optimizer``: the timed optimizer step."""
    norm = None if grad_norm is None else float(grad_norm)
    return StepResult(
        loss=float(loss_sum) / max(tokens, 1.0),
        grad_norm=norm,
        lr=lr,
        tokens=int(tokens),
        input_tokens=int(inputs),
        optimizer_s=optimizer.seconds if optimizer else 0.0,
        optimizer_comm_s=optimizer.comm_seconds if optimizer else 0.0,
        moe_aux_loss=moe_aux_loss,
    )


def router_balance_loss(router_logits: Sequence[torch.Tensor], *, topk: int, coeff: float) -> torch.Tensor:
    """megatron-core's load-balancing loss (``switch_load_balancing_loss_func`` on its router's routing
    map) from an HF MoE model's router logits: per layer, over the micro-batch's T tokens,
    E·coeff/(k·T²) · Σ_e (Σ_t p_te) · (tokens routed to e), p = the fp32 softmax of the logits and the
    routing its top k; summed over layers. (HF's ``load_balancing_loss_func`` pools every layer's tokens
    into one product of means: another number, so it is not used.)"""
    total = torch.zeros((), dtype=torch.float32, device=router_logits[0].device)
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        t, e = probs.shape
        routed = torch.zeros_like(probs).scatter_(1, torch.topk(probs, topk, dim=-1).indices, 1.0)
        total = total + (probs.sum(0) * routed.sum(0)).sum() * (e * coeff / (topk * t * t))
    return total


def mean_aux_loss(aux_sum: torch.Tensor | None, layout: ParallelLayout, group: Any = None) -> float | None:
    """The step's load-balancing loss: this rank's sum over its micro-batches, averaged over them and
    over the data-parallel ranks (what the gradient sees); None when there is none."""
    if aux_sum is None:
        return None
    total = dp_sum(aux_sum.detach().double().reshape(1).clone(), layout, group)
    return float(total) / (layout.grad_accum * layout.dp)


@dataclass(frozen=True)
class HFObjective:
    """What an HF-module engine minimises per micro-batch: the summed token loss and, for a mixture of
    experts with ``model.moe_aux_loss_coeff``, the router load-balancing loss (``topk`` experts/token)."""

    aux_coeff: float = 0.0
    topk: int = 0
    autocast_bf16: bool = False

    @classmethod
    def of(cls, source: ModelSource, *, autocast_bf16: bool = False) -> HFObjective:
        cfg = source.hf_config()
        topk = int(family_of(cfg.model_type).facts(cfg)["topk"])
        coeff = source.section.moe_aux_loss_coeff if topk else 0.0
        return cls(aux_coeff=coeff, topk=topk, autocast_bf16=autocast_bf16)

    def __call__(
        self, model: Any, mb: dict[str, torch.Tensor], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(summed token loss, load-balancing loss or None) of one micro-batch through ``model``."""
        return self.run(model, self.inputs(mb, device), device)

    @staticmethod
    def inputs(mb: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
        """A micro-batch as the model takes it: input ids, next-token targets, position ids where given."""
        return {
            "input_ids": mb["input_ids"].to(device, non_blocking=True),
            "target": next_token_targets(mb["labels"].to(device, non_blocking=True)),
            **position_ids(mb, device),
        }

    def run(
        self,
        model: Any,
        x: dict[str, torch.Tensor],
        device: torch.device,
        *,
        loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`__call__` on inputs already made (:meth:`inputs`, or a Ulysses slice). ``loss``: the
        summed token loss of the targets computed apart (the tiled loss); the forward then makes no logits."""
        extra: dict[str, Any] = {"output_router_logits": True} if self.aux_coeff else {}
        if "position_ids" in x:
            extra["position_ids"] = x["position_ids"]
        if loss is not None:
            extra["logits_to_keep"] = torch.zeros(0, dtype=torch.long, device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.autocast_bf16):
            out = model(input_ids=x["input_ids"], use_cache=False, **extra)
        token_loss = summed_target_loss(out.logits, x["target"]) if loss is None else loss(x["target"])
        if not self.aux_coeff:
            return token_loss, None
        return token_loss, router_balance_loss(out.router_logits, topk=self.topk, coeff=self.aux_coeff)


def position_ids(mb: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """``{"position_ids": ...}`` for rows cut at documents (``data.document_boundaries``), else nothing.
    transformers' mask builder reads restarting positions as packed sequences and keeps attention inside
    each one (sdpa, eager, flex; flash-attention goes varlen)."""
    pos = mb.get("position_ids")
    return {} if pos is None else {"position_ids": pos.to(device, non_blocking=True)}


def hf_eval_loss(
    model: Any,
    micro_batches: list[dict[str, torch.Tensor]],
    layout: ParallelLayout,
    *,
    device: torch.device,
    autocast_bf16: bool = False,
    group: Any = None,
    loss_of: Callable[[Any, dict[str, torch.Tensor]], torch.Tensor] | None = None,
) -> tuple[float, float]:
    """(summed token loss, label tokens) of a held-out global batch through an HF causal LM (or a
    DeepSpeed engine around one), summed over data parallelism; no gradients, eval mode. ``loss_of``:
    a micro-batch's summed token loss another way (the long-sequence objective: this rank's slice)."""
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    with torch.no_grad():
        for mb in micro_batches:
            if loss_of is not None:
                loss_sum += loss_of(model, mb)
                continue
            ids = mb["input_ids"].to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
                logits = model(input_ids=ids, use_cache=False, **position_ids(mb, device)).logits
            loss_sum += summed_token_loss(logits, mb["labels"].to(device, non_blocking=True))
    tokens, _ = global_counts(micro_batches, layout, device=device, group=group)
    return float(dp_sum(loss_sum, layout, group)), tokens


def first_nonfinite(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The label of the first tensor holding NaN or Inf, or None. A finite sum means every element is
    finite (NaN and Inf propagate through it) and costs one read at memory speed, ~30x faster than
    ``isfinite(t).all()``; only a sum that is not finite (bad values, or finite ones that overflow the
    dtype) takes the element-wise check."""
    for name, t in named:
        if not (torch.is_tensor(t) and t.is_floating_point() and t.numel()):
            continue
        if not bool(torch.isfinite(t.sum())) and not bool(torch.isfinite(t).all()):
            return name
    return None


def is_finite_number(x: float | None) -> bool:
    return x is None or math.isfinite(x)
