"""The engines' share of ``tessera plan --probe``: each engine's own training step, timed a few times on
the probe's ranks.

The matmuls of a layer are the machine's; what an engine does around them is the engine's: DeepSpeed's
gradient hooks and bucket copies, torch DDP's reducer, megatron-core's schedules, and each one's optimizer
path (per-tensor kernels, flattening, the norm of the gradients). On a small model that is most of a step
(the tiny Llama's steps took 1.3-1.8 x the plain forward + backward, and 2.3-7 x the AdamW kernel's
optimizer step), and no micro-benchmark without the engines sees it. So the probe's ranks build each engine as
`tessera run` does (:func:`tessera.launch.probe.run_engines`: :func:`tessera.tables.engines.engine_class`, the comm accounting installed before the
process group), on random tokens, and records each step as the training loop does
(:func:`tessera.train.metrics.step_split`). :func:`tessera.plan.measured.calibrate` then fits the
profile's engine efficiencies, the TP collectives' own α and the optimizer's bandwidth from these
observations exactly as ``--calibrate`` does from finished runs (``--calibrate`` on real runs stays the
more accurate: it sees the run's own data, batch and length).

One layout per engine at the probe's world size W, each at the recipe's micro-batch and the fewest
micro-batches the layout runs with (one per data-parallel rank; W under pipelining), so that what the
planner predicts for a recipe's own accumulation is extrapolated, not looked up:

- ``ddp``: torch DDP over W replicas;
- ``deepspeed-zero2``: DeepSpeed ZeRO-2 over W ranks;
- ``megatron-pp``: megatron-core, W pipeline stages (its efficiency with no TP collective between its
  matmuls);
- ``megatron-tp``: megatron-core, tensor parallel W (what a TP collective costs beyond its bytes).

A layout the layout rules refuse for this model (heads or layers not divisible by W, an engine that is not
installed) is left out, its reason recorded.
"""

from __future__ import annotations

from typing import Any

#: timed steps per layout after the warm-up ones (the first builds lazy state: buckets, optimizer moments)
STEPS = 10
WARMUP = 2


def probe_layouts(recipe: Any, world: int) -> list[tuple[str, list[str]]]:
    """(label, recipe overrides) of the layouts the probe runs at world size ``world``."""
    mb = int(recipe.parallel.micro_batch)
    common = ["parallel.auto=false", "parallel.ep=1", "parallel.sp=1", "parallel.dp=auto",
              "parallel.recompute=none", f"run.world_size={world}"]  # fmt: skip
    flat = [
        *common,
        "parallel.tp=1",
        "parallel.pp=1",
        "parallel.vpp=1",
        f"parallel.global_batch={world * mb}",
    ]
    out = [
        ("ddp", ["parallel.engine=ddp", "parallel.zero=0", *flat]),
        ("deepspeed-zero2", ["parallel.engine=deepspeed", "parallel.zero=2", *flat]),
    ]
    if world > 1:
        out += [
            ("megatron-pp", ["parallel.engine=megatron", "parallel.zero=0", *common, "parallel.tp=1",
                             f"parallel.pp={world}", "parallel.vpp=1", f"parallel.global_batch={world * mb}"]),
            ("megatron-tp", ["parallel.engine=megatron", "parallel.zero=0", *common, f"parallel.tp={world}",
                             "parallel.pp=1", "parallel.vpp=1", f"parallel.global_batch={mb}"]),
        ]  # fmt: skip
    else:
        out.append(("megatron", ["parallel.engine=megatron", "parallel.zero=0", *flat]))
    return out


def runnable(recipe: Any, world: int, device: str = "cpu") -> tuple[list[tuple[str, Any]], dict[str, str]]:
    """The probe's layouts as recipes ``(label, recipe)`` the layout rules accept and the planner expects
    to fit the device's memory (its stock profile: a DDP replica of a large model does not), and the
    refused ones with their reasons (``{label: reason}``)."""
    from tessera.config.loader import recipe_with
    from tessera.errors import TesseraError
    from tessera.plan.hardware import load_hardware
    from tessera.plan.layout import layout_from_recipe
    from tessera.plan.search import DEFAULT_HARDWARE, estimate_layout, fit_problem

    hardware = load_hardware(DEFAULT_HARDWARE[device])
    ok: list[tuple[str, Any]] = []
    refused: dict[str, str] = {}
    for label, overrides in probe_layouts(recipe, world):
        try:
            r = recipe_with(recipe, overrides)
            layout = layout_from_recipe(r)
        except TesseraError as e:
            refused[label] = str(e).splitlines()[0]
            continue
        memory = estimate_layout(r, layout, hardware=hardware).memory
        problem = fit_problem(memory, hardware, world)
        if problem is not None:
            refused[label] = problem
            continue
        ok.append((label, r))
    return ok, refused


def observations(measured: dict[str, Any], recipe: Any, world: int, device: str) -> list[Any]:
    """The probe's engine steps (rank 0's, as a run's metrics are) as :class:`tessera.plan.measured.Observation` s."""
    from tessera.plan.measured import Observation, ops_of, terms_of

    layouts = dict(runnable(recipe, world, device)[0])
    out = []
    for r in measured["ranks"][0].get("engines", []):
        if r.get("error") or not r.get("steps") or r["label"] not in layouts:
            continue
        ops = ops_of([(s["step"], s["ops"]) for s in r["steps"]])
        out.append(Observation(f"probe:{r['label']}", layouts[r["label"]], terms_of(r["steps"]), ops))
    return out
