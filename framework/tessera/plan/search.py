"""The planner's search: enumerate layouts, keep what the engines can run and the device can hold, rank by
estimated step time.

Validity is never decided here: every candidate is built as a :class:`ParallelLayout` (which checks the
engine's capabilities) and, for an engine whose rules need the model, passed to its registry entry's
``layout_checks`` with the model's shape (the one place with its rules); a LayoutError's message becomes the
rejection reason. What this module adds is the search space, read from each engine's row of the capability
table (``tables/engines.py``) and bounded: powers of two for tp and ep, divisors of the world for pp, a
few virtual-stage and micro-batch sizes; the memory fit ("does not fit: needs X GiB per rank ...") and the
ranking (ties go to the engine listed first in the table).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tessera.errors import LayoutError, RecipeError, TesseraError
from tessera.plan.activations import kernels_for
from tessera.plan.comm_estimate import CommOp, comm_bytes_by_op, comm_formulas, comm_per_step
from tessera.plan.estimate import (
    RECOMPUTE,
    GiB,
    Kernels,
    MemoryEstimate,
    count_params,
    memory_per_rank,
)
from tessera.plan.facts import ModelFacts, model_facts, with_adapters
from tessera.plan.hardware import HardwareProfile
from tessera.plan.layout import LAYOUT_AXES, ParallelLayout, check_ulysses, resolve_auto
from tessera.plan.time_estimate import (
    DEFAULT_EFFICIENCY,
    FLOPS_FORMULA,
    TimeEstimate,
    bubble_fraction,
    step_time,
)
from tessera.tables.engines import (
    ENGINE_NAMES,
    Capabilities,
    adapters_refusal,
    capabilities,
    engine_hook,
)

BUBBLE_FORMULA = (
    "(p-1)/(v*m + p-1): Narayanan et al. 2021 (p-1)/(v*m) of the ideal time, as a share of the step"
)


def layout_json(layout: ParallelLayout, recompute: str) -> dict[str, Any]:
    """The layout fields a plan records (what a recipe's ``parallel:`` section would say, plus recompute)."""
    keys = ("engine", *LAYOUT_AXES, "zero", "micro_batch", "grad_accum")
    out: dict[str, Any] = {k: getattr(layout, k) for k in keys}
    out.update(
        recompute=recompute,
        sequence_parallel=layout.sequence_parallel,
        tiled_mlp=layout.tiled_mlp,
        tiled_loss=layout.tiled_loss,
        zero_impl=layout.zero_impl,
        offload_optimizer=layout.offload_optimizer,
        offload_params=layout.offload_params,
    )
    return out


@dataclass(frozen=True)
class Candidate:
    """A layout that runs and fits, with its estimates."""

    layout: ParallelLayout
    recompute: str
    memory: MemoryEstimate
    comm_bytes: dict[str, int]
    bubble: float
    time: TimeEstimate
    comm_formulas: dict[str, str] = field(default_factory=dict)
    comm_ops: list[CommOp] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "layout": layout_json(self.layout, self.recompute),
            "memory_bytes_per_rank": self.memory.to_json(),
            "comm_bytes_per_step": dict(self.comm_bytes),
            "bubble_fraction": self.bubble,
            "step_time_s": self.time.step_s,
            "mfu": self.time.mfu,
            "model_flops_per_step": self.time.model_flops_per_step,
            "step_time_breakdown_s": {k: v for k, v in self.time.to_json().items() if k.endswith("_s")},
            "formulas": {
                **self.memory.formulas,
                **self.comm_formulas,
                "flops_per_token": FLOPS_FORMULA,
                "bubble": BUBBLE_FORMULA,
                "mfu": "model_flops_per_step / (step_time_s * peak_flops * world_size)",
            },
        }


@dataclass(frozen=True)
class Rejection:
    """A layout left out, and why (a layout rule's message, or the memory shortfall)."""

    layout: dict[str, Any]
    reason: str
    memory: MemoryEstimate | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"layout": self.layout, "reason": self.reason}
        if self.memory is not None:
            out["memory_bytes_per_rank"] = self.memory.to_json()
        return out


@dataclass
class PlanResult:
    """Every layout considered: the fastest that fits (``chosen``), the others that fit, the rejected."""

    chosen: Candidate | None
    candidates: list[Candidate] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    #: the recipe's own layout against the device (`tessera plan` sets it; None for ``parallel: auto``)
    recipe_layout: LayoutFit | None = None
    #: what the estimates know of the model: family, parameters, how they were counted, and the
    #: estimates taken from a generic formula (a family without an entry)
    model: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model} if self.model else {}
        if self.recipe_layout is not None:
            out["recipe_layout"] = self.recipe_layout.to_json(best=self.chosen)
        return out | {
            "chosen": self.chosen.to_json() if self.chosen else None,
            "candidates": [c.to_json() for c in self.candidates],
            "rejected": [r.to_json() for r in self.rejected],
        }


def _backend(hw: HardwareProfile) -> str:
    return "gloo" if hw.device == "cpu" else "nccl"


def fit_reason(need: int, have: int, *, where: str = "per rank", device: str = "the device") -> str:
    """The rejection reason of a layout that does not fit, in GiB."""
    return (
        f"does not fit: needs {need / GiB:.1f} GiB {where}, {device} has {have / GiB:.1f} GiB "
        f"(short by {(need - have) / GiB:.1f} GiB)"
    )


def fit_problem(mem: MemoryEstimate, hw: HardwareProfile, world_size: int) -> str | None:
    """Why a layout with these bytes per rank does not fit: the device memory, or (offload) the host memory
    of a node shared by its ranks; None when it fits."""
    if mem.total > hw.memory_bytes:
        return fit_reason(mem.total, hw.memory_bytes)
    per_node = mem.host * min(world_size, hw.devices_per_node)
    if mem.host and hw.host_memory_bytes is not None and per_node > hw.host_memory_bytes:
        return fit_reason(per_node, hw.host_memory_bytes, where="of host memory per node", device="the node")
    return None


def _one_line(e: TesseraError) -> str:
    return e.render().replace("\n  fix: ", "; fix: ")


def _powers_of_two(limit: int) -> list[int]:
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v *= 2
    return out


def _structures(
    f: ModelFacts, caps: Capabilities, world_size: int, hw: HardwareProfile, *, ulysses: bool = False
) -> Iterator[dict[str, Any]]:
    """The layouts to try, without the batch split, inside what the engine can run (``caps``). Bounded:
    tp a power of two up to the head count, pp a divisor of what tp leaves, vpp in {1, 2, 4}, ep a power
    of two up to the expert count, the engine's ZeRO stages, CPU offload of the optimizer (ZeRO >= 1) and
    of the parameters (ZeRO-3) where the engine and the hardware have it; Ulysses (``ulysses``: the
    attention kernel is one DeepSpeed wraps) sp a power of two above 1 up to the head count, with the MLP
    and the loss tiled or not, for the engines that have it (tp = pp = 1); the rules (not this
    enumeration) reject what the engine cannot run with this model."""
    tps = [t for t in _powers_of_two(min(world_size, f.num_heads)) if world_size % t == 0] if caps.tp else [1]
    offload = caps.offload and hw.can_offload
    for tp in tps:
        rest = world_size // tp
        pps = [p for p in range(1, rest + 1) if rest % p == 0 and p <= f.num_layers] if caps.pp else [1]
        for pp in pps:
            eps = [1] + ([e for e in _powers_of_two(f.num_experts) if e > 1] if caps.ep and f.moe else [])
            for vpp in (1,) if pp == 1 else (1, 2, 4):
                for ep in (e for e in eps if e <= world_size // pp):
                    for zero in caps.zero:
                        for extra in _ulysses_options(f, caps, world_size, ulysses and tp * pp == 1):
                            base = dict(tp=tp, pp=pp, vpp=vpp, ep=ep, zero=zero, **extra)
                            yield base
                            if offload and zero >= 1:
                                yield dict(base, offload_optimizer=True)
                            if offload and zero == 3:
                                yield dict(base, offload_optimizer=True, offload_params=True)


def _ulysses_options(f: ModelFacts, caps: Capabilities, world_size: int, on: bool) -> list[dict[str, Any]]:
    """No sequence parallelism, then each Ulysses degree (a power of two above 1 dividing the world, up to
    the head count) with the MLP and loss tiled and not."""
    out: list[dict[str, Any]] = [{}]
    if not (on and caps.sp):
        return out
    for sp in (s for s in _powers_of_two(min(world_size, f.num_heads)) if s > 1 and world_size % s == 0):
        out += [dict(sp=sp), dict(sp=sp, tiled_mlp=not f.moe, tiled_loss=True)]
    return out


def plan(
    hf_cfg: Any,
    *,
    world_size: int,
    seq_len: int,
    global_batch: int,
    precision: str,
    hardware: HardwareProfile,
    engines: Sequence[str] = ENGINE_NAMES,
    recompute: Sequence[str] = ("none", "selective", "full"),
    micro_batches: Sequence[int] = (1, 2, 4, 8),
    attn_implementation: str = "eager",
    efficiency: float = DEFAULT_EFFICIENCY,
    peft: Any = None,
) -> PlanResult:
    """Enumerate, validate, estimate and rank the layouts of ``hf_cfg`` on ``world_size`` devices.

    ``attn_implementation``: the HF kernel the deepspeed engine runs ("sdpa" never stores the s x s
    scores); megatron-core's local layer spec always materialises them. ``efficiency``: the fraction of
    peak FLOP/s the matmuls reach (0.4-0.6 for large dense models on H100-class GPUs). Candidates are
    sorted by estimated step time, then the less offload, then memory, then the engine's place in the
    capability table (so that an exact tie, e.g. torch DDP and DeepSpeed ZeRO-0 in fp32, goes to the engine
    listed first);
    ``chosen`` is the fastest, None when nothing fits (:func:`rank_key`).
    """
    for eng in engines:
        if eng not in ENGINE_NAMES:
            raise RecipeError(
                "unknown engine",
                field="parallel.engine",
                value=eng,
                fix="use one of " + ", ".join(ENGINE_NAMES),
            )
    if precision not in ("bf16", "fp16", "fp32"):
        raise RecipeError(
            "unknown precision", field="train.precision", value=precision, fix="use bf16, fp16 or fp32"
        )
    for rc in recompute:
        if rc not in RECOMPUTE:
            raise RecipeError(
                "unknown recompute option", field="recompute", value=rc, fix="use none, selective or full"
            )
    f = with_adapters(model_facts(hf_cfg), hf_cfg, peft)
    q = _Query(
        f=f,
        world_size=world_size,
        seq_len=seq_len,
        global_batch=global_batch,
        precision=precision,
        hw=hardware,
        micro_batches=tuple(micro_batches),
        efficiency=efficiency,
        sp_ok=f.shape is not None and f.shape.sequence_parallel_ok,
    )
    result = PlanResult(chosen=None, model=model_summary(f))
    for engine in engines:
        caps = capabilities(engine)
        # the HF module runs the kernel the recipe names; megatron-core's local spec always materialises
        kernels = kernels_for(
            f, hf_module=caps.hf_module, device=hardware.device, attn_implementation=attn_implementation
        )
        options = [r for r in recompute if r in caps.recompute]
        if not options:
            continue
        checks = engine_hook(engine, "layout_checks")  # the engine's rules that need the model, if any
        ulysses = attn_implementation == "sdpa"
        for st in _structures(f, caps, world_size, hardware, ulysses=ulysses):
            _try_structure(result, q, engine, st, options, kernels, checks)
    result.candidates.sort(key=rank_key)
    result.chosen = result.candidates[0] if result.candidates else None
    return result


def model_summary(f: ModelFacts) -> dict[str, Any]:
    """The model as the planner counts it (PlanResult.model): a family without an entry is counted on
    its meta-device model, and the estimates that fall back to a generic formula are named."""
    from tessera.tables.families import GENERIC_ESTIMATES

    out = {
        "family": f.family,
        "parameters": count_params(f),
        "counted_on": "the model built on the meta device" if f.generic else "the family's formula",
        "generic_estimates": list(GENERIC_ESTIMATES) if f.generic else [],
    }
    if f.adapters:  # what trains (the rest, the base, is frozen: parameters only)
        out["adapter_parameters"] = sum(f.adapters)
    return out


def rank_key(c: Candidate) -> tuple[float, int, int, int]:
    """How candidates are ranked: estimated step time, then the less host offload (at equal time - the
    transfers hidden behind compute - keeping the states on the device spares the host's memory and
    cores), then memory, then the engine's place in the capability table."""
    offload = int(c.layout.offload_optimizer) + int(c.layout.offload_params)
    return (c.time.step_s, offload, c.memory.total, ENGINE_NAMES.index(c.layout.engine))


@dataclass(frozen=True)
class _Query:
    """What one plan() call asks: the model, the cluster and the batch."""

    f: ModelFacts
    world_size: int
    seq_len: int
    global_batch: int
    precision: str
    hw: HardwareProfile
    micro_batches: tuple[int, ...]
    efficiency: float
    sp_ok: bool


def _try_structure(
    result: PlanResult,
    q: _Query,
    engine: str,
    st: dict[str, Any],
    options: list[str],
    kernels: Kernels,
    checks: Any,
) -> None:
    """All micro-batch sizes and recompute options of one structural layout; a rule that rejects every
    micro-batch size with the same reason is listed once (with the first size). ``checks``: the engine's
    ``layout_checks`` (None: the capability rules are all), given the model's shape the query has."""
    f, hw, world_size, global_batch, precision = q.f, q.hw, q.world_size, q.global_batch, q.precision
    dp = world_size // (st["tp"] * st["pp"] * st.get("sp", 1))
    zero_impl, sp = resolve_auto(engine, zero=st["zero"], tp=st["tp"], sp_ok=q.sp_ok)
    refused = adapters_refusal(engine, zero_impl) if f.adapters else None
    if refused is not None:
        result.rejected.append(
            Rejection(dict(engine=engine, dp=dp, **st, zero_impl=zero_impl), refused.message)
        )
        return
    seen: set[str] = set()
    sizes = [mb for mb in q.micro_batches if mb * dp <= max(global_batch, dp)] or [1]
    for mb in sizes:
        desc = dict(engine=engine, world_size=world_size, dp=dp, micro_batch=mb, global_batch=global_batch)
        try:
            layout = ParallelLayout(
                **desc,
                **st,
                etp=st["tp"],  # megatron-core's default expert_tensor_parallel_size
                grad_accum=max(1, global_batch // (mb * dp)),
                zero_impl=zero_impl,
                sequence_parallel=sp,
            )
            if checks is not None:
                checks(None, layout, shape=f.shape)
            if layout.sp > 1:
                check_ulysses(layout, num_heads=f.num_heads, num_kv_heads=f.num_kv_heads)
                if q.seq_len % layout.sp:
                    raise LayoutError(
                        f"data.seq_len={q.seq_len} cannot be cut into sp={layout.sp} equal slices",
                        field="parallel.sp",
                        value=layout.sp,
                        fix="a sequence length divisible by sp",
                    )
        except LayoutError as e:
            reason = _one_line(e)
            if reason not in seen:
                seen.add(reason)
                lay = {k: v for k, v in desc.items() if k not in ("world_size", "global_batch")}
                lay.update(st, grad_accum=None, zero_impl=zero_impl, sequence_parallel=sp)
                result.rejected.append(Rejection(layout=lay, reason=reason))
            continue
        ops = comm_per_step(f, layout, seq_len=q.seq_len, precision=precision, backend=_backend(hw))
        base = layout
        for rc in options:
            layout = base if rc == base.recompute else replace(base, recompute=rc)
            mem = memory_per_rank(
                f, layout, seq_len=q.seq_len, precision=precision, recompute=rc, kernels=kernels
            )
            lay = layout_json(layout, rc)
            reason = fit_problem(mem, hw, world_size)
            if reason is not None:
                result.rejected.append(Rejection(lay, reason, mem))
                continue
            t = step_time(
                f,
                layout,
                seq_len=q.seq_len,
                precision=precision,
                recompute=rc,
                hardware=hw,
                efficiency=q.efficiency,
                ops=ops,
            )
            result.candidates.append(
                Candidate(
                    layout=layout,
                    recompute=rc,
                    memory=mem,
                    comm_bytes=comm_bytes_by_op(ops),
                    bubble=bubble_fraction(layout.pp, layout.vpp, layout.grad_accum),
                    time=t,
                    comm_formulas=comm_formulas(ops),
                    comm_ops=ops,
                )
            )


# ---- recipes ---------------------------------------------------------------------------------------

DEFAULT_HARDWARE = {"cuda": "h100-sxm-80g", "cpu": "cpu-2core"}


def hardware_for(recipe: Any, *, device: str, override: str | None = None) -> HardwareProfile:
    """The profile named on the command line, else ``run.hardware``, else the device's default."""
    from tessera.plan.hardware import load_hardware

    return load_hardware(override or recipe.run.hardware or DEFAULT_HARDWARE[device])


def plan_recipe(
    recipe: Any, *, world_size: int, hardware: HardwareProfile, engines: Sequence[str] | None = None
) -> PlanResult:
    """Plan the recipe's model and batch on ``world_size`` devices, recompute (none / selective / full,
    as far as each engine runs it) searched like any other axis."""
    from tessera.models.hf import load_hf_config

    p = recipe.parallel
    hf_cfg = load_hf_config(recipe.model, vocab_size=recipe.data.vocab_size)
    gb = p.global_batch or p.micro_batch * (p.grad_accum or 1) * world_size
    return plan(
        hf_cfg,
        world_size=world_size,
        seq_len=recipe.data.seq_len,
        global_batch=gb,
        precision=recipe.train.precision,
        hardware=hardware,
        engines=engines or ENGINE_NAMES,
        recompute=RECOMPUTE,
        micro_batches=tuple(sorted({1, 2, 4, 8, p.micro_batch})),
        attn_implementation=recipe.model.attn_implementation,
        peft=recipe.peft,
    )


def apply_plan(recipe: Any, result: PlanResult) -> Any:
    """The recipe with the chosen layout written into ``parallel`` (``auto`` cleared, so the ranks run
    exactly this layout); a plan with nothing that fits is an error with the closest shortfall."""
    if result.chosen is None:
        fits = [r.reason for r in result.rejected if r.reason.startswith("does not fit")]
        raise LayoutError(
            "no layout the engines support fits this model on this hardware"
            + (f" (e.g. {fits[0]})" if fits else ""),
            field="parallel.auto",
            value=True,
            fix="add ranks, pick a larger device with run.hardware, shorten data.seq_len or lower the batch",
        )
    lay = result.chosen.layout
    keys = ("engine", *LAYOUT_AXES, "zero", "zero_impl", "micro_batch", "grad_accum")
    chosen = {k: getattr(lay, k) for k in keys}
    chosen.update(
        global_batch=lay.global_batch,
        sequence_parallel=lay.sequence_parallel,
        tiled_mlp=lay.tiled_mlp,
        tiled_loss=lay.tiled_loss,
        offload_optimizer=lay.offload_optimizer,
        offload_params=lay.offload_params,
        recompute=result.chosen.recompute,
        auto=False,
    )
    parallel = recipe.parallel.model_copy(update=chosen)
    return recipe.model_copy(update={"parallel": parallel})


def estimate_layout(
    recipe: Any, layout: ParallelLayout, *, hardware: HardwareProfile, recompute: str = "none"
) -> Candidate:
    """The estimates of the recipe's own layout (what a run should cost), for plan.json and the comm
    accounting's comparison."""
    from tessera.models.hf import load_hf_config

    hf_cfg = load_hf_config(recipe.model, vocab_size=recipe.data.vocab_size)
    f = with_adapters(model_facts(hf_cfg), hf_cfg, recipe.peft)
    kw = dict(seq_len=recipe.data.seq_len, precision=recipe.train.precision)
    ops = comm_per_step(f, layout, backend=_backend(hardware), **kw)
    kernels = kernels_for(
        f,
        hf_module=layout.caps.hf_module,
        device=hardware.device,
        attn_implementation=recipe.model.attn_implementation,
    )
    return Candidate(
        layout=layout,
        recompute=recompute,
        memory=memory_per_rank(f, layout, recompute=recompute, kernels=kernels, **kw),
        comm_bytes=comm_bytes_by_op(ops),
        bubble=bubble_fraction(layout.pp, layout.vpp, layout.grad_accum),
        time=step_time(f, layout, recompute=recompute, hardware=hardware, ops=ops, **kw),
        comm_formulas=comm_formulas(ops),
        comm_ops=ops,
    )


# ---- the recipe's own layout -----------------------------------------------------------------------


@dataclass(frozen=True)
class Fix:
    """One change of the recipe's layout (``overrides``, as `tessera run` takes them) and its estimates."""

    overrides: dict[str, Any]
    estimate: Candidate

    @property
    def text(self) -> str:
        return " ".join(
            f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self.overrides.items()
        )


@dataclass(frozen=True)
class LayoutFit:
    """The recipe's own layout measured against the hardware, and, when it does not fit, the changes of
    one of its fields that make it fit (fastest first)."""

    estimate: Candidate | None
    hardware: HardwareProfile
    world_size: int
    #: why it does not fit (the planner's rejection reason: memory, or a layout rule); None = it fits
    problem: str | None
    fixes: list[Fix] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.problem is None

    def message(self, best: Candidate | None = None) -> str:
        """One sentence: fits with its figures, or what it needs and which change makes it fit (else the
        planner's best layout, ``best``)."""
        have = self.hardware.memory_bytes / GiB
        if self.estimate is None:
            return f"the recipe's layout does not run on {self.world_size} ranks: {self.problem}"
        c = self.estimate
        figures = f"{c.memory.total / GiB:.1f} GiB of {have:.1f} GiB per rank"
        if self.fits:
            return (
                f"the recipe's layout fits: {figures}, {c.time.step_s:.3g} s/step, MFU {c.time.mfu:.3f}, "
                f"bubble {c.bubble:.3f}"
            )
        what = f"needs {figures}" if c.memory.total > self.hardware.memory_bytes else self.problem
        head = f"the recipe's layout does not fit: it {what}"
        if self.fixes:
            alts = " or ".join(
                f"{f.text} ({f.estimate.memory.total / GiB:.1f} GiB, {f.estimate.time.step_s:.3g} s/step)"
                for f in self.fixes[:3]
            )
            return f"{head}; set {alts}"
        if best is not None:
            return f"{head}; no one-field change fits; the planner's best layout: {best.layout.describe()}"
        return f"{head}; no one-field change fits and no layout the engines support fits either"

    def to_json(self, best: Candidate | None = None) -> dict[str, Any]:
        return {
            "fits": self.fits,
            "problem": self.problem,
            "message": self.message(best),
            "device_memory_bytes": self.hardware.memory_bytes,
            "estimate": self.estimate.to_json() if self.estimate is not None else None,
            "fixes": [
                {
                    "overrides": f.overrides,
                    "memory_total_bytes": f.estimate.memory.total,
                    "step_time_s": f.estimate.time.step_s,
                    "mfu": f.estimate.time.mfu,
                    "layout": layout_json(f.estimate.layout, f.estimate.recompute),
                }
                for f in self.fixes
            ],
        }


def _variations(recipe: Any, layout: ParallelLayout, hw: HardwareProfile) -> Iterator[dict[str, Any]]:
    """One-field changes of the recipe's layout that lower its memory: recompute, offload (where the
    engine and the hardware have it), a higher ZeRO stage, twice the tp (inside a node) or pp, fewer
    virtual stages, half the micro-batch."""
    caps = layout.caps
    for rc in caps.recompute:
        if RECOMPUTE.index(rc) > RECOMPUTE.index(layout.recompute):
            yield {"parallel.recompute": rc}
    if caps.offload and hw.can_offload:
        if layout.zero >= 1 and not layout.offload_optimizer:
            yield {"parallel.offload_optimizer": True}
        if layout.zero == 3 and not layout.offload_params:  # as the search offers it: with the optimizer's
            yield {"parallel.offload_optimizer": True, "parallel.offload_params": True}
    for z in caps.zero:
        if z > layout.zero:
            yield {"parallel.zero": z}
    if caps.tp and layout.tp * 2 <= hw.devices_per_node:
        yield {"parallel.tp": layout.tp * 2}
    if caps.pp:
        yield {"parallel.pp": layout.pp * 2}
    if layout.vpp > 1:
        yield {"parallel.vpp": 1}
    if layout.micro_batch > 1:
        yield {"parallel.micro_batch": layout.micro_batch // 2}


def _with(recipe: Any, overrides: dict[str, Any]) -> Any:
    """The recipe with ``parallel.*`` overrides (dp re-derived where tp or pp change)."""
    update = {k.split(".", 1)[1]: v for k, v in overrides.items()}
    if "tp" in update or "pp" in update:
        update["dp"] = "auto"
    return recipe.model_copy(update={"parallel": recipe.parallel.model_copy(update=update)})


def check_recipe_layout(
    recipe: Any, *, hardware: HardwareProfile, world_size: int | None = None
) -> LayoutFit:
    """Estimate the recipe's own layout on ``world_size`` ranks (default ``run.world_size``) of
    ``hardware``; when it does not fit, try :func:`_variations` and keep those that fit, fastest first."""
    from tessera.plan.layout import layout_from_recipe

    ws = world_size or recipe.run.world_size
    recipe = recipe.model_copy(update={"run": recipe.run.model_copy(update={"world_size": ws})})
    try:
        layout = layout_from_recipe(recipe)
    except LayoutError as e:
        return LayoutFit(estimate=None, hardware=hardware, world_size=ws, problem=_one_line(e))
    own = estimate_layout(recipe, layout, hardware=hardware, recompute=layout.recompute)
    problem = fit_problem(own.memory, hardware, ws)
    if problem is None:
        return LayoutFit(estimate=own, hardware=hardware, world_size=ws, problem=None)
    fixes = []
    for overrides in _variations(recipe, layout, hardware):
        changed = _with(recipe, overrides)
        try:
            lay = layout_from_recipe(changed)
        except (LayoutError, RecipeError):
            continue
        est = estimate_layout(changed, lay, hardware=hardware, recompute=lay.recompute)
        if fit_problem(est.memory, hardware, ws) is None:
            fixes.append(Fix(overrides=overrides, estimate=est))
    fixes.sort(key=lambda f: rank_key(f.estimate))
    return LayoutFit(estimate=own, hardware=hardware, world_size=ws, problem=problem, fixes=fixes)
