"""LoRA on megatron-core's parallel linears: HF's per-projection adapters, exactly, under TP / SP / PP.

Written here, not taken from peft: peft's ``LoraParallelLinear`` does not run with megatron-core 0.16.1
(a ``fan_in_fan_out`` KeyError when it dispatches, an unset ``lora_bias``, and megatron's linears return
``(output, bias)`` tuples its forward multiplies), and it puts one adapter (one A) on a module, so on
megatron's fused ``linear_qkv`` / ``linear_fc1`` it would train another model than HF's separate q / k / v
and gate / up adapters. As Megatron-Bridge's CanonicalLoRA does, each HF projection keeps its own adapter
here, and their outputs are laid out as the fused base's: interleaved per query group for QKV,
``[gate_r; up_r]`` for fc1.

Which megatron linear an HF target lives in, and how its adapters are split and named, are weight rules
(:mod:`tessera.models.megatron_lora`); here are the modules and their collectives:

- on a column-parallel base (q, k, v, gate, up): A (r x in) replicated, B (out x r) split on its rows like
  the base (query groups, ffn rows); the A x product is made whole by ``copy_to_tensor_model_parallel_region``
  (its backward sums B's partial input gradients over TP, so A's gradient is complete on every rank); under
  sequence parallelism the input is gathered first (its gradient, already complete, is split back);
- on a row-parallel base (o, down): A (r x in) split on its columns like the base, B (out x r) replicated;
  the partial A x is summed over TP (reduce-scattered over the sequence under SP, where B's gradient is then
  partial: it is marked ``sequence_parallel`` so that megatron's ``finalize_model_grads`` sums it over TP).

A forward hook adds ``scaling * B(A x)`` to the base's output; the base itself is untouched (and frozen).
A routed expert's adapter is peft's LoRA of the fused expert tensor (one A and B per expert, its parameters
expert parameters: ``allreduce = False``). DoRA, adapter dropout and modules to save are refused here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from tessera.errors import RecipeError
from tessera.models.megatron import COL, Adapter
from tessera.models.megatron_lora import SUFFIX, Site, sites

__all__ = ["LoRASite", "attach", "freeze_base"]


# ---- the modules ---------------------------------------------------------------------------------------


class LoRAPair(torch.nn.Module):
    """One target's A and B (``lora_A.weight`` r x in, ``lora_B.weight`` out x r, local shapes)."""

    def __init__(self, r: int, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.lora_A = torch.nn.Linear(in_features, r, bias=False, dtype=dtype, device="cpu")
        self.lora_B = torch.nn.Linear(r, out_features, bias=False, dtype=dtype, device="cpu")


class LoRASite(torch.nn.Module):
    """The adapters of one base linear (column- or row-parallel), added to its output by a forward hook."""

    def __init__(
        self, site: Site, base: torch.nn.Module, shape: Any, r: int, scaling: float, config: Any
    ) -> None:
        from megatron.core import tensor_parallel

        super().__init__()
        self.site, self.scaling, self.config = site, scaling, config
        #: how the targets' outputs join into the base's: an expert's one adapter is laid out by its rule
        self.layout = None if site.expert else site.fuse
        # the base's own TP group and sequence parallelism (a routed expert's: the expert-TP group, no SP)
        self.group = getattr(base, "tp_group", None)
        self.sp = bool(getattr(base, "sequence_parallel", config.sequence_parallel))
        tp = config.tensor_model_parallel_size
        dtype = config.params_dtype
        out_local, in_local = base.weight.shape
        self.groups = shape.num_query_groups // tp
        self.per_q = shape.num_heads // shape.num_query_groups * shape.head_dim
        self.head_dim = shape.head_dim
        if self.layout == "qkv" and shape.num_query_groups % tp:
            raise RecipeError(
                f"adapters on q / k / v need the {shape.num_query_groups} query groups split evenly over tp",
                field="parallel.tp",
                value=tp,
                fix=f"use a tp dividing {shape.num_query_groups}",
            )
        for target, _ in site.targets:
            if site.split == COL:
                out = self._rows_of(target, out_local)
                pair = LoRAPair(r, in_local, out, dtype)
                tensor_parallel.set_tensor_model_parallel_attributes(pair.lora_B.weight, True, 0, 1)
                tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(pair.lora_A.weight)
            else:
                pair = LoRAPair(r, in_local, out_local, dtype)
                tensor_parallel.set_tensor_model_parallel_attributes(pair.lora_A.weight, True, 1, 1)
                tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(pair.lora_B.weight)
                # under SP each rank's B sees its own part of the sequence: finalize_model_grads sums it
                pair.lora_B.weight.sequence_parallel = self.sp
            if site.expert:  # megatron's DDP and optimizer take expert parameters apart (expert-dp group)
                for w in (pair.lora_A.weight, pair.lora_B.weight):
                    w.allreduce = False
            self.add_module(target, pair)  # keys <site>_lora.<target>.lora_A.weight, as the rules say
        self.fused = [t for t, _ in site.targets]
        base.register_forward_hook(self._add)

    def _rows_of(self, target: str, out_local: int) -> int:
        if self.layout == "qkv":
            return self.groups * (self.per_q if target.startswith("q") else self.head_dim)
        if self.layout == "gate_up":
            return out_local // 2
        return out_local

    def _add(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        out, bias = output
        return out + self.delta(args[0], out).to(out.dtype), bias

    def delta(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``scaling * B(A x)`` of every target, laid out as the base's local output ``out``."""
        from megatron.core.tensor_parallel import mappings

        sp, g = self.sp, self.group
        if self.site.split == COL:
            full = (
                mappings.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=g)
                if sp
                else x
            )
            ys = {}
            for t in self.fused:
                p = self._modules[t]
                h = mappings.copy_to_tensor_model_parallel_region(F.linear(full, p.lora_A.weight), group=g)
                ys[t] = F.linear(h, p.lora_B.weight) * self.scaling
            return self._lay_out(ys, out)
        (t,) = self.fused
        p = self._modules[t]
        h = F.linear(x, p.lora_A.weight)
        h = (
            mappings.reduce_scatter_to_sequence_parallel_region(h, group=g)
            if sp
            else mappings.reduce_from_tensor_model_parallel_region(h, group=g)
        )
        return F.linear(h, p.lora_B.weight) * self.scaling

    def _lay_out(self, ys: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """The targets' outputs in the fused base's local layout (a target not adapted adds zeros)."""
        fuse = self.layout
        if fuse is None:
            return next(iter(ys.values()))
        lead = out.shape[:-1]
        if fuse == "gate_up":
            half = out.shape[-1] // 2
            parts = [ys.get(t, out.new_zeros(*lead, half)) for t in ("gate_proj", "up_proj")]
            return torch.cat(parts, dim=-1)
        g, d = self.groups, self.head_dim
        q = ys.get("q_proj", out.new_zeros(*lead, g * self.per_q)).reshape(*lead, g, self.per_q)
        k = ys.get("k_proj", out.new_zeros(*lead, g * d)).reshape(*lead, g, d)
        v = ys.get("v_proj", out.new_zeros(*lead, g * d)).reshape(*lead, g, d)
        return torch.cat([q, k, v], dim=-1).reshape(*lead, -1)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> Any:
        """A and B with their TP split (replicated ones once per TP group), layers stacked as the base's."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        axis = {
            k: (0 if self.site.split == COL else 1)
            for k in state
            if k.endswith("lora_B.weight" if self.site.split == COL else "lora_A.weight")
        }
        dp_cp = (metadata or {}).get("dp_cp_group") or ps.get_data_parallel_group(with_context_parallel=True)
        return make_sharded_tensors_for_checkpoint(
            state,
            prefix,
            axis,
            sharded_offsets,
            tp_group=self.group or ps.get_tensor_model_parallel_group(),
            dp_cp_group=dp_cp,
        )


def attach(
    model: torch.nn.Module, adapter: Adapter, hf_cfg: Any, peft: Mapping[str, Any], config: Any
) -> None:
    """The adapters of the recipe into every layer of a GPTModel chunk (before its weights are filled)."""
    shape = adapter.shape(hf_cfg)
    scale = float(peft["alpha"]) / int(peft["r"])
    for site in sites(adapter, hf_cfg, peft):
        parent_path, leaf = site.mcore.removeprefix("decoder.layers.*.").rsplit(".", 1)
        for layer in model.decoder.layers:
            if "#" in parent_path:  # every local expert of the layer
                holder, _, rest = parent_path.partition(".#")
                parents = [
                    e.get_submodule(rest.lstrip(".")) if rest else e for e in layer.get_submodule(holder)
                ]
            else:
                parents = [layer.get_submodule(parent_path)]
            for parent in parents:
                base = getattr(parent, leaf)
                parent.add_module(leaf + SUFFIX, LoRASite(site, base, shape, int(peft["r"]), scale, config))


def freeze_base(chunks: list[torch.nn.Module]) -> None:
    """Only the adapters train: every other parameter of the chunks stops taking gradients."""
    for c in chunks:
        for name, p in c.named_parameters():
            p.requires_grad = SUFFIX + "." in name
