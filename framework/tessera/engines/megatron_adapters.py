"""LoRA on megatron-core's parallel linears: HF's per-projection adapters, exactly, under TP / SP / PP.

Written here, not taken from peft: peft's ``LoraParallelLinear`` does not run with megatron-core 0.16.1
(a ``fan_in_fan_out`` KeyError when it dispatches, an unset ``lora_bias``, and megatron's linears return
``(output, bias)`` tuples its forward multiplies), and it puts one adapter (one A) on a module, so on
megatron's fused ``linear_qkv`` / ``linear_fc1`` it would train another model than HF's separate q / k / v
and gate / up adapters. As Megatron-Bridge's CanonicalLoRA does, each HF projection keeps its own adapter
here, and their outputs are laid out as the fused base's: interleaved per query group for QKV,
``[gate_r; up_r]`` for fc1.

Which megatron module an HF target lives in, and how it is split, comes from the family's weight
:class:`~tessera.models.megatron.Rule` s (no family has adapter code of its own): a target whose HF tensor
no rule maps onto a column- or row-parallel linear of the layers has no megatron counterpart and is
refused naming it. The adapters' own rules are derived from the base's, so loading, checkpoints, the
offline reader and resharding move them like any other tensor:

- on a column-parallel base (q, k, v, gate, up): A (r x in) replicated, B (out x r) split on its rows like
  the base (query groups, ffn rows); the A x product is made whole by ``copy_to_tensor_model_parallel_region``
  (its backward sums B's partial input gradients over TP, so A's gradient is complete on every rank); under
  sequence parallelism the input is gathered first (its gradient, already complete, is split back);
- on a row-parallel base (o, down): A (r x in) split on its columns like the base, B (out x r) replicated;
  the partial A x is summed over TP (reduce-scattered over the sequence under SP, where B's gradient is then
  partial: it is marked ``sequence_parallel`` so that megatron's ``finalize_model_grads`` sums it over TP).

A forward hook adds ``scaling * B(A x)`` to the base's output; the base itself is untouched (and frozen).
DoRA, adapter dropout, modules to save and adapters on routed experts are refused on this engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tessera.errors import RecipeError
from tessera.models.megatron import COL, REPL, ROW, Adapter, Rule, adapter_for

#: where the adapters of a base linear live: a sibling module "<leaf>_lora" holding one module per target
SUFFIX = "_lora"


@dataclass(frozen=True)
class Site:
    """One adapted megatron linear: its module path (``*`` = layer), how its output is laid out (``qkv``,
    ``gate_up`` or None), its split (col / row), and the HF targets it holds adapters for, in the fused
    order, each with its HF weight pattern."""

    mcore: str
    fuse: str | None
    split: str
    targets: tuple[tuple[str, str], ...]  # (target, HF weight pattern)
    #: a routed expert's linear (``#`` in ``mcore``): one adapter per expert on HF's fused expert tensor,
    #: packed as peft packs them (``Rule.hf_experts``)
    expert: bool = False

    @property
    def lora(self) -> str:
        return self.mcore + SUFFIX


def _target_of(hf_weight: str) -> str:
    return hf_weight.rsplit(".", 2)[-2]  # "model.layers.*.self_attn.q_proj.weight" -> "q_proj"


def sites(adapter: Adapter, hf_cfg: Any, peft: Mapping[str, Any]) -> list[Site]:
    """The megatron linears the recipe's targets adapt, from the family's weight rules; a target without a
    column / row-parallel counterpart in the layers (an embedding, a routed expert, the LM head, a norm) is
    a RecipeError naming it, and so are what this engine does not run (DoRA, dropout, modules to save)."""
    from tessera.models.adapters import refuse_any

    refuse_any(
        peft,
        [
            (
                "peft.method",
                peft["method"] != "lora",
                "DoRA's magnitude is not mapped onto megatron's fused linears",
            ),
            ("peft.dropout", float(peft["dropout"]) != 0.0, "adapter dropout would need the TP-region RNG"),
            ("peft.modules_to_save", bool(peft["modules_to_save"]), "modules trained in full are not mapped"),
        ],
        message="the megatron engine cannot train this yet: {why}",
        fix="use parallel.engine: deepspeed or ddp for it (adapters of every kind on the HF module)",
    )
    wanted = list(dict.fromkeys(peft["target_modules"]))
    found: dict[str, Site] = {}
    for rule in adapter.rules(hf_cfg):
        if "#" in rule.mcore:
            site = _expert_site(rule, wanted)
            if site is not None:
                found.update((t, site) for t in _expert_targets(site) if t in wanted)
            continue
        if rule.split not in (COL, ROW) or not rule.mcore.startswith("decoder.layers.*."):
            continue
        if not rule.mcore.endswith(".weight") or rule.layers != "all":
            continue
        names = rule.hf if isinstance(rule.hf, tuple) else (rule.hf,)
        if (
            rule.fuse not in (None, "qkv", "gate_up")
            or rule.transpose
            or len(names) != {None: 1, "qkv": 3, "gate_up": 2}[rule.fuse]
        ):
            continue  # GPT-2's one [q; k; v] tensor, HF's fused [gate; up]: no per-target HF tensor
        targets = tuple((_target_of(n), n) for n in names if _target_of(n) in wanted)
        if targets:
            site = Site(
                rule.mcore.removesuffix(".weight"),
                rule.fuse,
                rule.split,
                tuple((_target_of(n), n) for n in names),
            )
            found.update((t, site) for t, _ in targets)
    missing = [t for t in wanted if t not in found]
    if missing:
        mapped = sorted({t for s in _all_sites(adapter, hf_cfg) for t, _ in s.targets})
        raise RecipeError(
            f"the {hf_cfg.model_type} adapter of the megatron engine has no linear of the layers for {missing[0]!r}"
            + (" (a routed expert, an embedding, the LM head or a norm)" if mapped else ""),
            field="peft.target_modules",
            value=missing[0],
            fix=f"target the projections it maps ({', '.join(mapped) or 'none'}), or use parallel.engine: "
            "deepspeed or ddp (adapters on any linear of the HF module)",
        )
    out: dict[str, Site] = {}
    for t in wanted:
        s = found[t]
        out.setdefault(s.mcore, s)
    # only the targets asked for, in the fused order (an expert site's one target is the fused tensor's)
    return [
        s if s.expert else dataclasses.replace(s, targets=tuple(x for x in s.targets if x[0] in wanted))
        for s in out.values()
    ]


#: HF targets -> the fused expert tensor they adapt together (transformers 5 MoE layers)
_EXPERT_TENSORS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def _expert_targets(site: Site) -> tuple[str, ...]:
    return _EXPERT_TENSORS[site.targets[0][0]]


def _expert_site(rule: Rule, wanted: list[str]) -> Site | None:
    """The adapter site of a routed expert's linear when the recipe targets its HF tensor (peft's LoRA on
    the fused tensor: gate and up together, or down); None otherwise. Only gate *and* up can share it."""
    if rule.split not in (COL, ROW) or rule.layers != "all" or not isinstance(rule.hf, str):
        return None
    leaf = rule.hf.rsplit(".", 1)[-1]
    targets = _EXPERT_TENSORS.get(leaf)
    if targets is None or not any(t in wanted for t in targets):
        return None
    if not all(t in wanted for t in targets):
        missing = next(t for t in targets if t not in wanted)
        raise RecipeError(
            f"the experts keep {' and '.join(targets)} in one tensor ({rule.hf}): one adapter covers both",
            field="peft.target_modules",
            value=next(t for t in targets if t in wanted),
            fix=f"target {missing} too, or neither",
        )
    fuse = "gate_up_fused" if rule.fuse == "gate_up_fused" else None
    return Site(rule.mcore.removesuffix(".weight"), fuse, rule.split, ((leaf, rule.hf),), expert=True)


def _all_sites(adapter: Adapter, hf_cfg: Any) -> list[Site]:
    every = {"method": "lora", "dropout": 0.0, "modules_to_save": [], "target_modules": []}
    names = set()
    for rule in adapter.rules(hf_cfg):
        if "#" not in rule.mcore and rule.split in (COL, ROW) and rule.mcore.startswith("decoder.layers.*."):
            for n in rule.hf if isinstance(rule.hf, tuple) else (rule.hf,):
                names.add(_target_of(n))
    out: list[Site] = []
    for t in sorted(names):
        try:
            out += sites(adapter, hf_cfg, {**every, "target_modules": [t]})
        except RecipeError:
            continue
    return out


def lora_rules(site: Site) -> list[Rule]:
    """The weight rules of one site's adapters (A and B of each target), split as described above."""
    a_split, b_split = (REPL, COL) if site.split == COL else (ROW, REPL)
    out = []
    for target, hf in site.targets:
        base = hf.removesuffix(".weight")
        for part, split in (("lora_A", a_split), ("lora_B", b_split)):
            extra: dict[str, Any] = {}
            if site.expert:  # the expert's block of peft's packed tensor: A's rows, B's columns
                extra = {"hf_experts": "rows" if part == "lora_A" else "cols"}
                if part == "lora_B" and site.fuse == "gate_up_fused":
                    extra["fuse"] = "gate_up_fused"  # B's rows laid out as the base's [gate_r; up_r]
            out.append(Rule(f"{site.lora}.{target}.{part}.weight", f"{base}.{part}.weight", split, **extra))
    return out


def with_lora(adapter: Adapter, peft: Mapping[str, Any] | None) -> Adapter:
    """The family's adapter with the rules of the recipe's LoRA adapters added (itself without them)."""
    if peft is None:
        return adapter

    def rules(c: Any) -> list[Rule]:
        return [*adapter.rules(c), *(r for s in sites(adapter, c, peft) for r in lora_rules(s))]

    return dataclasses.replace(adapter, rules=rules)


def mcore_adapter(hf_cfg: Any, peft: Any = None) -> Adapter:
    """:func:`~tessera.models.megatron.adapter_for` of the config, with the adapters' rules when ``peft``
    (the recipe's section, or meta.json's dict) is given."""
    from tessera.models.adapters import section_dict

    return with_lora(adapter_for(hf_cfg.model_type), section_dict(peft))


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
