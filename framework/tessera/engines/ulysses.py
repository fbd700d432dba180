"""Long sequences on the HF module: DeepSpeed's Arctic Long Sequence Training components (ALST,
``deepspeed.runtime.sequence_parallel.ulysses_sp``) as the deepspeed engine runs them.

- **Ulysses sequence parallelism** (``parallel.sp``): the ranks of an sp group (consecutive ranks, as
  DeepSpeed's ``parallel_state_sp`` builds them) read the same samples and each keeps a slice of every
  sequence; DeepSpeed's ``UlyssesSPAttentionHF`` turns the slices into whole sequences over a share of the
  heads by all-to-all around the attention kernel (sdpa). Everything else a layer does is per token, so the
  rest of the model runs on the slice. DeepSpeed reduces the gradients over every rank (its sequence-data-
  parallel group) and divides by dp, so the loss normalisation by the global token count is unchanged.
- **Tiled MLP** (``parallel.tiled_mlp``): DeepSpeed's ``TiledMLP`` around each decoder layer's MLP.
- **Tiled loss** (``parallel.tiled_loss``): the LM head and the cross-entropy through DeepSpeed's
  ``sequence_tiled_compute`` on the decoder's last hidden states.
- **Checkpoint offload** (``parallel.offload_activations``): DeepSpeed's offload of the checkpointed layer
  inputs around each micro-batch's forward and backward.

Written here (DeepSpeed does not do it): the sample slicing with global position ids and with the targets
shifted on the whole row before slicing (DeepSpeed's ``UlyssesSPDataLoaderAdapter`` gathers every rank's
batch and changes the micro-batch count; Tessera's sampler already gives the sp ranks the same rows), a
summed token loss (no all-gather of per-rank means), static tile counts (DeepSpeed's examples agree on
one with an all-reduce per layer), and undoing the process-global state DeepSpeed leaves behind (the
attention override, the sp groups, DeepSpeed's global mpu), since a process may build several engines.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tessera.engines.base import IGNORE_INDEX, ModelSource
from tessera.errors import RecipeError
from tessera.plan.activations import tiles_of
from tessera.plan.layout import ParallelLayout

#: the attention kernel DeepSpeed's wrapper runs on the gathered sequences (the schema requires it at sp > 1)
CORE_ATTENTION = "sdpa"


class Ulysses:
    """The sp group of this rank and the attention wrapper over it; ``close()`` undoes both."""

    def __init__(self, source: ModelSource, layout: ParallelLayout, *, seq_len: int) -> None:
        import deepspeed
        from deepspeed.runtime.sequence_parallel import parallel_state_sp
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        from tessera.plan.facts import model_facts

        if not deepspeed.comm.is_initialized():
            deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)
        f = model_facts(source.hf_config())
        self.sp, self.seq_len = layout.sp, seq_len
        self.local = seq_len // layout.sp
        parallel_state_sp.initialize_sequence_parallel(layout.sp)
        #: DeepSpeed's mpu for ``deepspeed.initialize``: with it, ZeRO shards and reduces over every rank
        self.mpu = parallel_state_sp
        self.group = parallel_state_sp.get_sequence_parallel_group()
        self.rank = parallel_state_sp.get_sequence_parallel_rank()
        self._core = ALL_ATTENTION_FUNCTIONS[CORE_ATTENTION]
        uattn = UlyssesSPAttentionHF(
            attn=self._core,
            batch_size=layout.micro_batch,
            attn_head_count=f.num_heads,
            attn_head_size=f.head_dim,
            kv_head_count=f.num_kv_heads,  # built here: GPT-2's config has no num_key_value_heads
            num_hidden_layers=f.num_layers,
            process_group=self.group,
            seq_length_is_variable=False,
            local_seq_length=self.local,
            global_seq_length=seq_len,
        )
        uattn.core_attn_implementation = CORE_ATTENTION

        def attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, *a: Any, **kw: Any):
            # the mask transformers built is the slice's; causality over the gathered sequence is the
            # kernel's own (is_causal), as in DeepSpeed's register_with_transformers
            return uattn(module, query, key, value, None, *a, **kw)

        ALL_ATTENTION_FUNCTIONS[CORE_ATTENTION] = attention

    def shard(self, mb: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
        """This rank's slice of a micro-batch: the input ids and their global positions (RoPE and
        DeepSpeed's wrapper read them), and the next-token targets shifted on the whole row first, so the
        last position of a slice is scored against the first token of the next one."""
        ids = mb["input_ids"]
        b, s = ids.shape
        if s != self.seq_len:  # internal: the sampler's rows are data.seq_len long
            raise RuntimeError(f"a row of {s} tokens under Ulysses sp planned for {self.seq_len}")
        cut = slice(self.rank * self.local, (self.rank + 1) * self.local)
        pos = mb.get("position_ids")
        pos = torch.arange(s).expand(b, s) if pos is None else pos
        target = F.pad(mb["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)
        return {
            "input_ids": ids[:, cut].to(device, non_blocking=True),
            "position_ids": pos[:, cut].to(device, non_blocking=True),
            "target": target[:, cut].to(device, non_blocking=True),
        }

    def close(self) -> None:
        """The attention kernel back, the sp groups released (DeepSpeed's module globals, its mpu)."""
        import deepspeed.sequence.layer as ds_layer
        from deepspeed.runtime.sequence_parallel import parallel_state_sp
        from deepspeed.utils import groups
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        del ALL_ATTENTION_FUNCTIONS[CORE_ATTENTION]
        if ALL_ATTENTION_FUNCTIONS[CORE_ATTENTION] is not self._core:  # an override of someone else's
            ALL_ATTENTION_FUNCTIONS[CORE_ATTENTION] = self._core
        ds_layer._all_to_all_groups.pop(self.group.group_name, None)
        if groups.mpu is parallel_state_sp:  # deepspeed.initialize set it and nothing resets it
            groups.mpu = None
        data_group = parallel_state_sp._SEQUENCE_DATA_PARALLEL_GROUP
        parallel_state_sp._release_sequence_parallel_groups()
        for g in (self.group, data_group):
            if g is not None:
                with contextlib.suppress(ValueError, RuntimeError):  # already gone with the world
                    dist.destroy_process_group(g)


def tile_mlps(model: torch.nn.Module, *, tokens: int, hidden: int) -> None:
    """Every decoder layer's MLP through DeepSpeed's ``TiledMLP``: forward tile by tile without keeping
    the intermediates, backward recomputing one tile at a time (ZeRO told when the last tile's gradients
    are ready). Any token-wise MLP module: its own forward is what runs on each tile."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
    from transformers.modeling_layers import GradientCheckpointingLayer

    n = tiles_of(tokens, hidden)
    for layer in model.modules():
        if not isinstance(layer, GradientCheckpointingLayer) or not hasattr(layer, "mlp"):
            continue
        mlp = layer.mlp
        params = [p for p in mlp.parameters() if p.requires_grad]

        def tiled(x: torch.Tensor, _mlp: Any = mlp, _own: Callable = mlp.forward, _p: list = params) -> Any:
            return TiledMLP.apply(lambda module, tile: _own(tile), _mlp, x, n, _p)

        mlp.forward = tiled


def refuse_tiling(source: ModelSource, layout: ParallelLayout) -> None:
    """What the tiled MLP and loss cannot run: a mixture of experts' MLP (routed per token, with router
    outputs beside the hidden states), a head whose logits the model transforms after the projection."""
    cfg = source.hf_config()
    from tessera.plan.facts import model_facts

    if layout.tiled_mlp and model_facts(cfg).moe:
        raise RecipeError(
            f"the tiled MLP wraps a dense MLP; {cfg.model_type}'s layers route tokens to experts",
            field="parallel.tiled_mlp",
            value=True,
            fix="set parallel.tiled_mlp: false (the experts see each token once; their intermediates are "
            "per routed token already)",
        )
    scaled = [
        k for k in ("final_logit_softcapping", "logit_scale", "logits_scaling") if getattr(cfg, k, None)
    ]
    if layout.tiled_loss and scaled:
        raise RecipeError(
            f"the tiled loss computes logits with the LM head alone; {cfg.model_type} also applies "
            f"{scaled[0]} to them",
            field="parallel.tiled_loss",
            value=True,
            fix="set parallel.tiled_loss: false",
        )


class LastHidden:
    """The decoder's last hidden states of a forward called with no logits (``logits_to_keep`` empty):
    what the tiled loss projects tile by tile."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.value: torch.Tensor | None = None
        model.base_model.register_forward_hook(self._keep)

    def _keep(self, module: Any, args: Any, out: Any) -> None:
        self.value = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]

    def take(self) -> torch.Tensor:
        value, self.value = self.value, None
        if value is None:  # internal: the hook is on the module the forward ran
            raise RuntimeError("the decoder's forward hook saw no hidden states")
        return value


def tiled_token_loss(head: torch.nn.Module, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy (fp32) of ``hidden`` through the LM head, over sequence tiles with
    DeepSpeed's ``sequence_tiled_compute``: no tile's logits outlive it; backward re-runs each tile with the
    true incoming gradient (DeepSpeed's ``TiledFusedLogitsLoss`` computes the head's gradients with an
    incoming gradient of 1 during the forward, so a loss scale applied after it would miss them)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import sequence_tiled_compute

    def loss(hidden_states: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = head(hidden_states)
        return F.cross_entropy(
            logits.float().reshape(-1, logits.size(-1)),
            target.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )

    s = hidden.shape[1]
    return sequence_tiled_compute(
        loss,
        s,
        tiles_of(s, hidden.shape[-1]),
        {"hidden_states": hidden, "target": target},
        {},
        "hidden_states",
        [p for p in head.parameters() if p.requires_grad],
        output_unshard_dimension=0,
        output_reduction="sum",
    )


def offload_context(layout: ParallelLayout, device: torch.device) -> Callable[[], Any]:
    """A context for each micro-batch's forward and backward: DeepSpeed's offload of the checkpointed
    layer inputs to host memory (``parallel.offload_activations``, CUDA); a no-op otherwise (on CPU the
    inputs are in host memory already, and DeepSpeed's manager skips them)."""
    if not layout.offload_activations or device.type != "cuda":
        return contextlib.nullcontext
    from deepspeed.runtime.activation_checkpointing.offload_activations import (
        get_checkpoint_hidden_states_offloading_ctx_manager,
    )

    manager = get_checkpoint_hidden_states_offloading_ctx_manager()
    return lambda: manager


class LongSequences:
    """The deepspeed engine's objective when a long-sequence component is on (``parallel.sp`` > 1, a
    tiled MLP or loss, checkpoint offload): like :class:`tessera.engines.base.HFObjective`, the summed
    token loss of a micro-batch (this rank's slice of it under sp) and the load-balancing loss or None."""

    def __init__(
        self, source: ModelSource, layout: ParallelLayout, *, seq_len: int, device: torch.device, base: Any
    ) -> None:
        refuse_tiling(source, layout)
        self.layout, self.base = layout, base
        self.seq_len = seq_len
        self.ulysses = Ulysses(source, layout, seq_len=seq_len) if layout.sp > 1 else None
        #: each micro-batch's forward and backward run inside it (checkpoint offload, or nothing)
        self.around = offload_context(layout, device)
        self._hidden: LastHidden | None = None
        self._head: torch.nn.Module | None = None
        self.hidden_size = int(source.hf_config().get_text_config().hidden_size)

    @property
    def mpu(self) -> Any:
        """DeepSpeed's mpu for ``deepspeed.initialize`` (None without sp)."""
        return None if self.ulysses is None else self.ulysses.mpu

    def attach(self, model: torch.nn.Module) -> None:
        """On the built model, before ``deepspeed.initialize``: the tiled MLPs, the hidden-state hook."""
        if self.layout.tiled_mlp:
            tile_mlps(model, tokens=self.seq_len // self.layout.sp, hidden=self.hidden_size)
        if self.layout.tiled_loss:
            self._hidden = LastHidden(model)
            self._head = model.get_output_embeddings()

    def __call__(
        self, model: Any, mb: dict[str, torch.Tensor], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self.base.inputs(mb, device) if self.ulysses is None else self.ulysses.shard(mb, device)
        if self._hidden is None:
            return self.base.run(model, x, device)
        hidden, head = self._hidden, self._head
        assert head is not None
        return self.base.run(
            model, x, device, loss=lambda target: tiled_token_loss(head, hidden.take(), target)
        )

    def close(self) -> None:
        if self.ulysses is not None:
            self.ulysses.close()
            self.ulysses = None
