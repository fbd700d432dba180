"""LoRA on megatron-core's linears, as weight rules: which megatron linear each HF target adapts, and how its
adapters are split and named (:mod:`tessera.engines.megatron_adapters` builds the modules).

Which megatron module an HF target lives in, and how it is split, comes from the family's weight
:class:`~tessera.models.megatron.Rule` s (no family has adapter code of its own): a target whose HF tensor
no rule maps onto a column- or row-parallel linear of the layers, or onto a routed expert's fused tensor,
has no megatron counterpart and is refused naming it. The adapters' own rules are derived from the base's
(A replicated and B split like the base on a column-parallel linear; A split like the base and B
replicated on a row-parallel one; a routed expert's from its block of peft's packed tensors), so loading,
checkpoints, the offline reader, resharding and the planner move and count them like any other tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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
    found = _found(adapter, hf_cfg, wanted)
    missing = [t for t in wanted if t not in found]
    if missing:
        mapped = sorted(_found(adapter, hf_cfg, _candidates(adapter, hf_cfg)))
        raise RecipeError(
            f"the {hf_cfg.model_type} adapter of the megatron engine has no linear of the layers for {missing[0]!r}"
            + (" (an embedding, the LM head or a norm)" if mapped else ""),
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


def _found(adapter: Adapter, hf_cfg: Any, wanted: list[str]) -> dict[str, Site]:
    """Target -> the site that adapts it, for the ``wanted`` targets the family's rules map."""
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
    return found


def _candidates(adapter: Adapter, hf_cfg: Any) -> list[str]:
    """Every HF target name the family's layer rules mention (what :func:`_found` may map)."""
    names: set[str] = set()
    for rule in adapter.rules(hf_cfg):
        for n in rule.hf if isinstance(rule.hf, tuple) else (rule.hf,):
            leaf = n.rsplit(".", 1)[-1]
            names.update(
                _EXPERT_TENSORS.get(leaf, (_target_of(n),)) if "#" in rule.mcore else (_target_of(n),)
            )
    return sorted(names)


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
