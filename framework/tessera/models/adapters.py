"""Low-rank adapters (LoRA, DoRA) on a frozen base: peft's layers on the HF modules, named and initialised
the same way under every engine and layout.

peft does the adapters themselves (``inject_adapter_in_model``: its ``LoraLayer`` wrappers, DoRA's
magnitude, merging, its file format). Tessera adds what peft leaves to its caller:

- **one name per tensor, whatever wraps it.** peft's module names carry its wrappers and the adapter
  name (``q_proj.base_layer.weight``, ``q_proj.lora_A.default.weight``,
  ``lm_head.modules_to_save.default.weight``); checkpoints, moments, resharding and ``tessera verify`` key
  tensors by :func:`canonical` names instead: the base keeps its HF name (``q_proj.weight``), an adapter is
  named as peft saves it without the ``base_model.model.`` prefix (``q_proj.lora_A.weight``,
  ``q_proj.lora_magnitude_vector``), and a module trained in full beside the adapters is
  ``lm_head.modules_to_save.weight``. :func:`peft_key` / :func:`from_peft_key` translate to and from
  ``adapter_model.safetensors``.
- **initial values that do not depend on the layout.** peft draws A with kaiming-uniform from the global
  RNG in construction order; here A is uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)) (the same distribution)
  drawn from a generator seeded by (seed, tensor name), B is zero, DoRA's magnitude is the row norm of
  the base weight (``W + s·B·A`` with ``B = 0``), and a module to save starts as the base module:
  :class:`WithAdapters` gives them next to the base weights, so every rank fills what it holds.
- **a check that every target was adapted**: peft only refuses a target that matches nothing, and skips
  a module of a type it cannot wrap without a word (Mixtral's fused experts under ``gate_proj``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tessera.errors import RecipeError

#: adapter tensors' name parts (canonical names)
LORA_PARTS = ("lora_A", "lora_B")
MAGNITUDE = "lora_magnitude_vector"
SAVED = "modules_to_save"
#: peft's prefix of every key of ``adapter_model.safetensors`` (a PeftModel around the HF model)
PEFT_PREFIX = "base_model.model."
ADAPTER_NAME = "default"
INIT_RULE = "tessera-lora-init-v1"


def canonical(name: str) -> str:
    """Tessera's name of a parameter of a peft-wrapped HF model (see the module docstring); a plain HF
    name is returned as it is."""
    parts = name.split(".")
    out: list[str] = []
    for i, part in enumerate(parts):
        if part in ("base_layer", "original_module"):
            continue
        if part == ADAPTER_NAME and i > 0 and parts[i - 1] in (*LORA_PARTS, MAGNITUDE, SAVED):
            continue
        out.append(part)
    if len(out) >= 2 and out[-2] == MAGNITUDE:  # peft keeps DoRA's vector in a module, saves it bare
        out.pop()
    return ".".join(out)


def is_adapter(name: str) -> bool:
    """Whether canonical ``name`` is a trained tensor of the adapters (not of the frozen base)."""
    parts = name.split(".")
    return any(p in LORA_PARTS for p in parts) or parts[-1] == MAGNITUDE or SAVED in parts


def base_of(name: str) -> str:
    """The base tensor an adapter tensor belongs to: ``q_proj.lora_A.weight`` -> ``q_proj.weight``,
    ``lm_head.modules_to_save.weight`` -> ``lm_head.weight``."""
    parts = name.split(".")
    if SAVED in parts:
        return ".".join(p for p in parts if p != SAVED)
    for k, p in enumerate(parts):
        if p in (*LORA_PARTS, MAGNITUDE):
            return ".".join([*parts[:k], "weight"])
    return name


def peft_key(name: str) -> str:
    """The key of canonical adapter tensor ``name`` in peft's ``adapter_model.safetensors``."""
    return PEFT_PREFIX + ".".join(p for p in name.split(".") if p != SAVED)


def from_peft_key(key: str) -> str:
    """The canonical name of a key of ``adapter_model.safetensors`` (the inverse of :func:`peft_key`)."""
    name = key.removeprefix(PEFT_PREFIX)
    parts = name.split(".")
    if any(p in LORA_PARTS for p in parts) or parts[-1] == MAGNITUDE:
        return name
    return ".".join([*parts[:-1], SAVED, parts[-1]])  # a module saved in full


def lora_config(section: Any, model: torch.nn.Module | None = None) -> Any:
    """peft's ``LoraConfig`` of the recipe's ``peft`` section (or of its dict in a checkpoint's meta.json);
    with ``model`` (the HF model, any device), targets on fused expert tensors become peft's
    ``target_parameters`` (:func:`peft_targets`)."""
    from peft import LoraConfig

    s = section if isinstance(section, Mapping) else section.model_dump()
    modules, parameters = peft_targets(model, s) if model is not None else (list(s["target_modules"]), [])
    return LoraConfig(
        r=int(s["r"]),
        lora_alpha=float(s["alpha"]),
        lora_dropout=float(s["dropout"]),
        target_modules=modules or None,
        target_parameters=parameters or None,
        modules_to_save=list(s["modules_to_save"]) or None,
        use_dora=s["method"] == "dora",
        bias="none",
        init_lora_weights=True,
    )


#: HF projection names on the experts' fused tensors (transformers 5 keeps each layer's experts as 3-D
#: parameters): gate and up are one ``gate_up_proj`` ([gate; up] rows per expert)
FUSED_GATE_UP = ("gate_proj", "up_proj")


def _fused(model: torch.nn.Module) -> dict[str, str]:
    """Leaf name -> peft's target_parameters suffix (``experts.gate_up_proj``) of the model's 3-D expert
    tensors."""
    out: dict[str, str] = {}
    for n, p in model.named_parameters():
        if len(getattr(p, "ds_shape", p.shape)) == 3:  # ZeRO-3 keeps the full shape aside
            parts = canonical(n).split(".")
            out.setdefault(parts[-1], ".".join(parts[-2:]))
    return out


def peft_targets(model: torch.nn.Module, section: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """(target_modules, target_parameters) for peft: a target that names linear modules stays a module
    target; one that names a projection of the fused experts (``gate_proj`` and ``up_proj`` together:
    their ``gate_up_proj``; ``down_proj``) becomes a parameter target, one LoRA per expert on the fused
    tensor (peft's ``ParamWrapper``: r rows of A and r columns of B per expert, gate and up sharing A)."""
    fused = _fused(model)
    modules: list[str] = []
    parameters: list[str] = []
    targets = list(dict.fromkeys(section["target_modules"]))
    for t in targets:
        if _modules_named(model, t):
            modules.append(t)
        if t in fused:
            parameters.append(fused[t])
        elif t in FUSED_GATE_UP and "gate_up_proj" in fused:
            other = FUSED_GATE_UP[1 - FUSED_GATE_UP.index(t)]
            if other not in targets:
                raise RecipeError(
                    f"the experts keep gate and up in one tensor ({fused['gate_up_proj']}): {t} alone cannot "
                    "have an adapter there",
                    field="peft.target_modules",
                    value=t,
                    fix=f"target both {FUSED_GATE_UP[0]} and {FUSED_GATE_UP[1]} (one adapter on the fused "
                    "tensor per expert), or neither",
                )
            parameters.append(fused["gate_up_proj"])
    parameters = list(dict.fromkeys(parameters))
    if parameters:
        refuse_any(
            section,
            [
                ("peft.method", section["method"] != "lora", "DoRA"),
                ("peft.dropout", float(section["dropout"]) != 0.0, "dropout"),
            ],
            message=f"peft's LoRA on the fused expert tensors ({', '.join(parameters)}) has no {{why}}",
            fix="use method lora with dropout 0, or target the attention projections only",
        )
    return modules, parameters


def refuse_any(
    section: Mapping[str, Any], checks: list[tuple[str, bool, str]], *, message: str, fix: str
) -> None:
    """The first of ``checks`` ((``peft.<key>``, refused?, why)) that is refused, as a RecipeError naming
    the field and its value (``message`` formats ``{why}``)."""
    for key, bad, why in checks:
        if bad:
            raise RecipeError(
                message.format(why=why), field=key, value=section[key.split(".", 1)[1]], fix=fix
            )


def section_dict(section: Any) -> dict[str, Any] | None:
    """The ``peft`` section as JSON (what meta.json records), or None without adapters."""
    if section is None:
        return None
    return dict(section) if isinstance(section, Mapping) else section.model_dump(mode="json")


def inject(model: torch.nn.Module, section: Any) -> torch.nn.Module:
    """peft's adapters into ``model`` in place (its base frozen, only adapters and modules to save
    trainable), after checking every target: a name the model has no module of, or a module of it that
    peft did not wrap, is a RecipeError naming it."""
    from peft import inject_adapter_in_model

    check_targets(model, section)
    cfg = lora_config(section, model)
    try:
        inject_adapter_in_model(cfg, model, adapter_name=ADAPTER_NAME)
    except (ValueError, TypeError) as e:
        raise RecipeError(
            f"peft cannot put adapters on this model: {str(e).splitlines()[0][:200]}",
            field="peft.target_modules",
            value=list(cfg.target_modules),
            fix="name linear modules of the model (see `tessera plan` for its module names)",
        ) from None
    _check_wrapped(model, section)
    return model


def _modules_named(model: torch.nn.Module, short: str) -> list[str]:
    return [n for n, _ in model.named_modules() if n == short or n.endswith("." + short)]


def check_targets(model: torch.nn.Module, section: Any) -> None:
    """Every target and module to save names modules of ``model`` (the HF model, before injection)."""
    s = section_dict(section)
    assert s is not None
    leaf_names = sorted(
        {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    )
    fused = _fused(model)
    for field, names in (
        ("peft.target_modules", s["target_modules"]),
        ("peft.modules_to_save", s["modules_to_save"]),
    ):
        for t in names:
            on_experts = field == "peft.target_modules" and (
                t in fused or (t in FUSED_GATE_UP and "gate_up_proj" in fused)
            )
            if not _modules_named(model, t) and not on_experts:
                hint = _fused_hint(model, t)
                raise RecipeError(
                    f"{type(model).__name__} has no module named {t!r}{hint}",
                    field=field,
                    value=t,
                    fix="use the model's linear module names: " + ", ".join(leaf_names[:12]),
                )


def _fused_hint(model: torch.nn.Module, target: str) -> str:
    fused = [n for n, p in model.named_parameters() if p.dim() == 3]
    if fused and target in ("w1", "w2", "w3"):
        return f" (its experts are fused 3-D tensors such as {fused[0]}: name them gate_proj, up_proj, down_proj)"
    return ""


def _check_wrapped(model: torch.nn.Module, section: Any) -> None:
    from peft.tuners.tuners_utils import BaseTunerLayer

    s = section_dict(section)
    assert s is not None
    for t in s["target_modules"]:
        missed = [
            n
            for n in _modules_named(model, t)
            if not isinstance(model.get_submodule(n), BaseTunerLayer)
            and not any(n.startswith(w + ".") for w in _wrapped(model))
        ]
        if missed:
            raise RecipeError(
                f"peft put no adapter on {missed[0]} ({type(model.get_submodule(missed[0])).__name__})",
                field="peft.target_modules",
                value=t,
                fix="target linear layers only (peft's LoRA wraps nn.Linear, Conv1D and Embedding)",
            )


def _wrapped(model: torch.nn.Module) -> list[str]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [n for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)]


# ---- shapes and initial values ------------------------------------------------------------------------


def _config_key(hf_cfg: Any) -> str:
    return hf_cfg.to_json_string(use_diff=False)


def _meta_model(cfg_json: str, peft_json: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads(cfg_json)
    hf_cfg = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg)
    return inject(model, json.loads(peft_json))


@functools.lru_cache(maxsize=8)
def _meta_shapes(cfg_json: str, peft_json: str) -> tuple[tuple[str, tuple[int, ...], bool], ...]:
    model = _meta_model(cfg_json, peft_json)
    return tuple((n, tuple(p.shape), p.requires_grad) for n, p in named_parameters(model))


def meta_model(hf_cfg: Any, section: Any) -> torch.nn.Module:
    """The HF model of ``hf_cfg`` on the meta device with the adapters of ``section`` (no memory)."""
    return _meta_model(_config_key(hf_cfg), json.dumps(section_dict(section), sort_keys=True))


def names_of_config(hf_cfg: Any, lora_cfg: Any) -> PeftNames:
    """:class:`PeftNames` of an adapter written by peft (its ``LoraConfig``, from adapter_config.json)."""
    from peft import inject_adapter_in_model
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg)
    inject_adapter_in_model(lora_cfg, model, adapter_name=ADAPTER_NAME)
    names = name_map(model)
    keys = {names[n]: PEFT_PREFIX + saved_key(n) for n, p in model.named_parameters() if p.requires_grad}
    return PeftNames(module_to_canonical=names, canonical_to_key=keys)


def adapter_shapes(hf_cfg: Any, section: Any) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of every trained adapter tensor (the peft model built on the meta device)."""
    rows = _meta_shapes(_config_key(hf_cfg), json.dumps(section_dict(section), sort_keys=True))
    return {n: s for n, s, trained in rows if trained}


def _seed_of(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{INIT_RULE}|{seed}|{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class WithAdapters(Mapping[str, torch.Tensor]):
    """The base's tensors (any Mapping by HF name: lazy files, the seeded rule) plus the adapters' initial
    values by canonical name; an adapter tensor ``given`` holds (a staged checkpoint) is taken from it.
    ``part`` reads only the part of a base tensor asked for (adapters are small: made whole, then cut)."""

    def __init__(
        self,
        base: Mapping[str, torch.Tensor],
        shapes: Mapping[str, tuple[int, ...]],
        *,
        seed: int,
        given: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.base, self.shapes, self.seed = base, dict(shapes), seed
        self.given = given if given is not None else {}
        self._names = [n for n in base if n not in self.shapes] + list(self.shapes)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self.shapes or name in self.base

    def shape_of(self, name: str) -> tuple[int, ...]:
        if name in self.shapes:
            return self.shapes[name]
        from tessera.models.init import shape_of

        return shape_of(self.base, name)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.shapes:
            return self.base[name]
        if name in self.given:
            return self.given[name].float()
        return self.initial(name)

    def part(self, name: str, index: tuple[Any, ...]) -> torch.Tensor:
        if name not in self.shapes:
            from tessera.models.init import read_part

            return read_part(self.base, name, index)
        return self[name][index].contiguous()

    def initial(self, name: str) -> torch.Tensor:
        """The adapter's value before the first step (see the module docstring)."""
        shape = self.shapes[name]
        parts = name.split(".")
        if "lora_B" in parts:
            return torch.zeros(shape)
        if "lora_A" in parts:
            bound = 1.0 / math.sqrt(shape[1])  # kaiming_uniform(a=sqrt(5)), peft's and nn.Linear's default
            g = torch.Generator().manual_seed(_seed_of(self.seed, name))
            return torch.empty(shape).uniform_(-bound, bound, generator=g)
        base = self.base[base_of(name)].float()
        if parts[-1] == MAGNITUDE:  # ||W + s·B·A|| per output row with B = 0 (peft's dora.py, dim=1)
            return torch.linalg.norm(base, dim=1)
        return base.clone()  # a module to save starts as the base module


def adapter_source(hf_cfg: Any, section: Any, base: Mapping[str, torch.Tensor], *, seed: int) -> WithAdapters:
    """:class:`WithAdapters` for the recipe's adapters on ``base``; adapter tensors ``base`` already holds
    (a resharding stage: base and adapters in one directory) are taken from it."""
    s = section_dict(section)
    assert s is not None
    shapes = adapter_shapes(hf_cfg, s)
    given = {n: base[n] for n in shapes if n in base}
    plain = _Without(base, set(shapes)) if given else base
    return WithAdapters(plain, shapes, seed=seed, given=given)


class _Without(Mapping[str, torch.Tensor]):
    """``base`` without the names in ``drop``."""

    def __init__(self, base: Mapping[str, torch.Tensor], drop: set[str]) -> None:
        self.base, self.drop = base, drop

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.drop:
            raise KeyError(name)
        return self.base[name]

    def __iter__(self) -> Iterator[str]:
        return (n for n in self.base if n not in self.drop)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def shape_of(self, name: str) -> tuple[int, ...]:
        from tessera.models.init import shape_of

        return shape_of(self.base, name)

    def part(self, name: str, index: tuple[Any, ...]) -> torch.Tensor:
        from tessera.models.init import read_part

        return read_part(self.base, name, index)


def name_map(model: torch.nn.Module) -> dict[str, str]:
    """Module parameter name -> canonical name, for every parameter and buffer of ``model``. peft nests one
    ``ParamWrapper`` per fused expert tensor it adapts, so their names are positional
    (``experts.base_layer.lora_A.default.weight`` is the inner wrapper's): they are named by the tensor the
    wrapper adapts instead (``experts.gate_up_proj.lora_A.weight``); everything else by :func:`canonical`."""
    out = {n: canonical(n) for n in model.state_dict(keep_vars=True)}
    out.update((n, canonical(n)) for n, _ in model.named_parameters())
    for path, module in model.named_modules():
        param = getattr(module, "parameter_name", None)
        if param is None or type(module).__name__ != "ParamWrapper":
            continue
        for part in LORA_PARTS:
            out[f"{path}.{part}.{ADAPTER_NAME}.weight"] = f"{canonical(path)}.{param}.{part}.weight"
    return out


def named_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """``model.named_parameters()`` under canonical names (plain HF names without adapters)."""
    names = name_map(model)
    for n, p in model.named_parameters():
        yield names[n], p


def saved_key(module_name: str) -> str:
    """The key peft's ``get_peft_model_state_dict`` saves a module parameter under (its adapter name out;
    DoRA's vector without ``.weight``; a module to save under the module's own name), without the
    ``base_model.model.`` prefix."""
    parts = module_name.split(".")
    out: list[str] = []
    for i, part in enumerate(parts):
        if part == ADAPTER_NAME and i > 0 and parts[i - 1] in (*LORA_PARTS, MAGNITUDE, SAVED):
            continue
        if part == SAVED:
            continue
        out.append(part)
    if len(out) >= 2 and out[-2] == MAGNITUDE:
        out.pop()
    return ".".join(out)


@dataclass(frozen=True)
class PeftNames:
    """Canonical names <-> peft's file keys and the module names of the model with adapters (built on the
    meta device): the adapters of fused experts are named by position in peft's files and modules."""

    module_to_canonical: dict[str, str]
    canonical_to_key: dict[str, str]

    def canonical(self, module_name: str) -> str:
        return self.module_to_canonical.get(module_name, canonical(module_name))

    def peft_key(self, name: str) -> str:
        return self.canonical_to_key.get(name) or peft_key(name)

    def from_peft_key(self, key: str) -> str:
        inverse = {v: k for k, v in self.canonical_to_key.items()}
        return inverse.get(key) or from_peft_key(key)


@functools.lru_cache(maxsize=8)
def _peft_names(cfg_json: str, peft_json: str) -> PeftNames:
    model = _meta_model(cfg_json, peft_json)
    names = name_map(model)
    keys = {names[n]: PEFT_PREFIX + saved_key(n) for n, p in model.named_parameters() if p.requires_grad}
    return PeftNames(module_to_canonical=names, canonical_to_key=keys)


def peft_names(hf_cfg: Any, section: Any) -> PeftNames:
    """:class:`PeftNames` of the model of ``hf_cfg`` with the adapters of ``section``."""
    return _peft_names(_config_key(hf_cfg), json.dumps(section_dict(section), sort_keys=True))


def whole_base_tensors(state: Mapping[str, list[Any]]) -> list[str]:
    """The frozen base tensors a rank holds whole (a replica's, a pipeline stage's), by canonical name."""
    return sorted(
        n
        for n, slices in state.items()
        if not is_adapter(n)
        and any(
            sl.flat is None and all(a == 0 and b == k for (a, b), k in zip(sl.index, sl.full_shape))
            for sl in slices
        )
    )


def checkers(whole: list[list[str]]) -> dict[str, int]:
    """Who checks each tensor held whole: of the ranks holding it (``whole[rank]``), one picked by the
    name's position, so that replicas share the reading and every tensor is read once."""
    holders: dict[str, list[int]] = {}
    for rank, names in enumerate(whole):
        for n in names:
            holders.setdefault(n, []).append(rank)
    return {n: ranks[i % len(ranks)] for i, (n, ranks) in enumerate(sorted(holders.items()))}


def check_frozen_base(
    state: Mapping[str, list[Any]], base: Mapping[str, torch.Tensor], *, rank: int, checker: Mapping[str, int]
) -> dict[str, Any]:
    """Whether the frozen base a rank holds (``state``: the engine's :meth:`state_dict`) is still bit for bit
    its source ``base`` (the model source's tensors, cast to the dtype the engine keeps them in): a tensor
    held whole is checked by the rank ``checker`` names (:func:`checkers`), every partition or slice by its
    holder, so the ranks together read the whole base once. Returns {"tensors": checked, "differ": names}."""
    from tessera.models.init import read_flat, read_part

    checked, differ = 0, []
    for name in sorted(n for n in state if not is_adapter(n)):
        for sl in state[name]:
            whole = sl.flat is None and all(a == 0 and b == k for (a, b), k in zip(sl.index, sl.full_shape))
            if whole and checker.get(name, rank) != rank:
                continue  # another rank holding it whole checks it
            if sl.flat is not None:
                want = read_flat(base, name, sl.full_shape, *sl.flat)
            else:
                want = read_part(base, name, tuple(slice(a, b) for a, b in sl.index))
            have = sl.tensor.detach().cpu()
            checked += 1
            if not torch.equal(have, want.to(have.dtype).reshape(have.shape)):
                differ.append(name)
    return {"tensors": checked, "differ": differ}
