"""``tessera plan R.yaml --probe``: measure the machine a recipe will run on, in about 30 s, and write what
was measured as a hardware profile the planner uses from then on.

The stock profiles (``configs/hardware/``) hold datasheet figures; on a machine unlike the datasheet (a
2-core VM, a shared node) they predict steps several times too fast until someone calibrates by hand
(``--calibrate`` needs finished runs). The probe measures, on the recipe's world size of ranks started
here (gloo on CPU, NCCL on GPU, one rank per device or per core as a run places them, every rank at once
so that they compete for the machine as a run's ranks do):

- the **FLOP/s of a matmul at the model's shapes** (a micro-batch's tokens x hidden x the MLP's width,
  in the recipe's precision): the profile's peak (``peak_flops``, ``peak_flops_fp32`` for fp32 recipes);
- the **model's own forward + backward** (the recipe's HF model built from its config, no engine, one
  micro-batch): the planner's FLOPs for it over its time, divided by that peak, is the profile's
  ``efficiency`` (attention, norms, activations, autograd: what a layer costs beyond its matmuls; the
  engines' steps below replace it per engine);
- an **AdamW step** over the model's parameters (torch's foreach kernel): the planner counts 28 bytes of
  memory traffic per parameter, so 28·N over its time is the kernel's bandwidth (recorded; the engines'
  optimizer steps below set ``hbm_bandwidth``);
- **all-reduce, all-gather and all-to-all** over the real backend at sizes from 4 KiB to 16 MiB: α
  (seconds per call: ``latency_s``, ``tp_latency_s``) and β (seconds per wire byte: the
  ``intra_node_bandwidth``) by least squares, with the planner's own wire-byte counts.

- **each engine's own steps** (:mod:`tessera.plan.probe_engines`: DDP, DeepSpeed ZeRO-2, megatron-core
  PP and TP at this world size, built as `tessera run` builds them, ~0.2-1.8 s each on 2 CPU ranks): what
  an engine does around the matmuls (hooks, bucket copies, schedules, its optimizer's path) is most of a
  small model's step and no micro-benchmark sees it. ``--calibrate``'s fit on these steps gives each
  engine's ``efficiency``, the optimizer's effective ``hbm_bandwidth``, the TP collectives' own α
  (``tp_latency_s``), and α / β over the engines' data-parallel collectives together with the ones above.

The profile goes to ``~/.cache/tessera/hardware/probe-<host>-<device>-<world>r.yaml`` (or ``--out``;
the directory moves with ``TESSERA_HARDWARE_DIR``) with the raw measurements beside it (``.json``).
``tessera plan`` and ``tessera run`` on this host pick it up when no profile is named; the run's manifest
records it.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

#: message sizes of the collectives, bytes (fp32 elements x 4)
SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20)
OPS = ("all_reduce", "all_gather", "all_to_all")
#: seconds the whole probe aims at (start-up of the ranks included)
BUDGET_S = 30.0
#: of those, what the engines' steps take (:mod:`tessera.plan.probe_engines`), measured on 2 CPU ranks
ENGINES_S = 8.0


def probe_dir() -> Path:
    return Path(os.environ.get("TESSERA_HARDWARE_DIR") or Path.home() / ".cache" / "tessera" / "hardware")


def probe_path(device: str, world: int) -> Path:
    """Where this host's probe of ``world`` ranks on ``device`` is kept."""
    return probe_dir() / f"probe-{socket.gethostname()}-{device}-{world}r.yaml"


def find_probe(device: str, world: int) -> Path | None:
    path = probe_path(device, world)
    return path if path.is_file() else None


# ---- one rank --------------------------------------------------------------------------------------------


def _timed(fn: Any, budget: float, sync: Any, at_least: int = 3) -> float:
    """Median seconds of ``fn`` over as many calls as fit ``budget`` (at least ``at_least``), after one
    warm-up call."""
    fn()
    sync()
    times: list[float] = []
    t_end = time.perf_counter() + budget
    while len(times) < at_least or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
        if len(times) >= 50:
            break
    return statistics.median(times)


def _model_figures(
    spec: dict[str, Any], rank: int, device: Any, dtype: Any, budget: float, sync: Any
) -> dict[str, Any]:
    """The recipe's HF model (no engine): one micro-batch's forward + backward, and an AdamW step."""
    import torch
    from transformers import AutoModelForCausalLM

    from tessera.models.hf import load_hf_config

    cfg = load_hf_config(spec["model"], vocab_size=spec["vocab_size"])
    torch.manual_seed(rank)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(device)
    ids = torch.randint(0, cfg.vocab_size, (spec["micro_batch"], spec["seq_len"]), device=device)

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    out = {"fwd_bwd_s": _timed(step, budget * 0.3, sync)}
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-6, foreach=True)
    out["adam_s"] = _timed(opt.step, budget * 0.1, sync)
    out["params"] = sum(p.numel() for p in params)
    return out


def _rank_main(rank: int, world: int, port: int, spec: dict[str, Any], q: Any) -> None:
    cuda = spec["device"] == "cuda"
    threads = max(1, (os.cpu_count() or 1) // world) if not cuda else 1
    # the environment a launcher gives a rank (DeepSpeed's comm reads it), before torch starts its threads
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads))  # fmt: skip
    if not cuda:
        os.environ["DS_ACCELERATOR"] = "cpu"
    import torch
    import torch.distributed as dist

    from tessera.comm.accounting import install
    from tessera.comm.shm import use_venv_build_tools

    use_venv_build_tools()  # DeepSpeed's CPU comm op as `make setup` built it, not rebuilt here
    torch.set_num_threads(threads)
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    counter = install()  # as a run's worker: before anything binds torch.distributed
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    out: dict[str, Any] = {"rank": rank, "threads": threads}
    budget = spec["budget"]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[spec["precision"]]
    tokens, h, width = spec["tokens"], spec["hidden"], spec["width"]
    a = torch.randn(tokens, h, device=device, dtype=dtype)
    b = torch.randn(h, width, device=device, dtype=dtype)
    reps = max(1, int(2e8 // (2 * tokens * h * width)))  # ~0.2 GFLOP per timed call: above timer noise

    def matmuls() -> None:
        for _ in range(reps):
            a @ b

    out["matmul_s"] = _timed(matmuls, budget * 0.1, sync) / reps
    out["matmul_flops"] = 2.0 * tokens * h * width / out["matmul_s"]

    out.update(_model_figures(spec, rank, device, dtype, budget, sync))  # the model is gone after it

    collectives: list[dict[str, Any]] = []
    if world > 1:
        for op in OPS:
            for size in SIZES:
                n = size // 4
                x = torch.ones(n, device=device)
                gathered = torch.empty(n * world, device=device)

                def call(op: str = op, x: Any = x, gathered: Any = gathered) -> None:
                    if op == "all_reduce":
                        dist.all_reduce(x)
                    elif op == "all_gather":
                        dist.all_gather_into_tensor(gathered, x)
                    else:
                        dist.all_to_all_single(gathered[: x.numel()], x)

                dist.barrier()
                seconds = _timed(call, budget * 0.4 / (len(OPS) * len(SIZES)), sync, at_least=5)
                collectives.append({"op": op, "bytes": size, "seconds": seconds})
        dist.barrier()
    out["collectives"] = collectives
    from tessera.plan.probe_engines import run_engines

    t0 = time.perf_counter()
    out["engines"] = run_engines(spec["engines"], device=spec["device"], counter=counter)
    out["engines_s"] = time.perf_counter() - t0
    q.put(out)
    q.close()
    q.join_thread()
    from tessera.train.worker import exit_process

    exit_process(0)  # no interpreter teardown: the comm backends' threads can abort it (see there)


# ---- the probe -------------------------------------------------------------------------------------------


def measure(recipe: Any, *, world: int, device: str, budget: float = BUDGET_S) -> dict[str, Any]:
    """Start ``world`` ranks here, measure, return every rank's figures (rank order) and the setting."""
    import multiprocessing as mp

    from tessera.models.hf import load_hf_config
    from tessera.plan.probe_engines import runnable

    p = recipe.parallel
    engines, refused = runnable(recipe, world, device)
    cfg = load_hf_config(recipe.model, vocab_size=recipe.data.vocab_size)
    width = int(getattr(cfg, "intermediate_size", None) or 4 * cfg.hidden_size)
    spec = {
        "device": device,
        "precision": recipe.train.precision if device == "cuda" else "fp32",
        "tokens": p.micro_batch * recipe.data.seq_len,
        "hidden": int(cfg.hidden_size),
        "width": width,
        "model": recipe.model,
        "vocab_size": recipe.data.vocab_size,
        "micro_batch": p.micro_batch,
        "seq_len": recipe.data.seq_len,
        # the ranks' start-up (imports, rendezvous) and the engines' steps take the rest
        "budget": max(1.0, budget - ENGINES_S - 8.0),
        "engines": engines,
        "refused": refused,
    }
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, spec, q), daemon=True) for r in range(world)
    ]
    t0 = time.perf_counter()
    for proc in procs:
        proc.start()
    results: list[dict[str, Any]] = []
    try:
        while len(results) < world:
            try:
                results.append(q.get(timeout=2))
            except Exception:  # queue.Empty: is every rank still there?
                if any(proc.exitcode not in (None, 0) for proc in procs):
                    codes = [proc.exitcode for proc in procs]
                    raise RuntimeError(f"a probe rank failed (exit codes {codes})") from None
                if time.perf_counter() - t0 > 10 * budget:
                    raise RuntimeError("the probe's ranks did not finish") from None
        for proc in procs:
            proc.join(timeout=30)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        from tessera.comm.shm import release_shared_memory

        release_shared_memory("127.0.0.1", port)  # DeepSpeed's CPU segments of the rendezvous
    return {
        "ranks": sorted(results, key=lambda r: r["rank"]),
        "setting": {k: v for k, v in spec.items() if k not in ("model", "engines")}
        | {"engines": [label for label, _ in engines]},
        "seconds": time.perf_counter() - t0,
    }


def profile_from(
    measured: dict[str, Any], recipe: Any, *, world: int, device: str
) -> tuple[Any, dict[str, Any]]:
    """The hardware profile the measurements make (the device's stock profile with the measured figures
    in place of its datasheet ones), and the derivation of each figure."""
    from tessera.models.hf import load_hf_config
    from tessera.plan.comm_estimate import wire_factor
    from tessera.plan.facts import model_facts
    from tessera.plan.hardware import load_hardware
    from tessera.plan.measured import _fit_alpha_beta
    from tessera.plan.search import DEFAULT_HARDWARE
    from tessera.plan.time_estimate import ADAM_BYTES_PER_PARAM, flops_per_token

    ranks = measured["ranks"]
    s = measured["setting"]
    base = load_hardware(DEFAULT_HARDWARE[device])
    peak = statistics.median(r["matmul_flops"] for r in ranks)
    facts = model_facts(load_hf_config(recipe.model, vocab_size=recipe.data.vocab_size))
    model_flops = flops_per_token(facts, s["seq_len"]) * s["tokens"]
    achieved = statistics.median(model_flops / r["fwd_bwd_s"] for r in ranks)
    bandwidth = statistics.median(ADAM_BYTES_PER_PARAM * r["params"] / r["adam_s"] for r in ranks)
    how: dict[str, Any] = {
        "peak_flops": f"matmul {s['tokens']}x{s['hidden']} @ {s['hidden']}x{s['width']} ({s['precision']}): "
        f"{peak / 1e9:.2f} GFLOP/s (median over {world} ranks at once)",
        "efficiency": f"the model's forward + backward of one micro-batch: {achieved / 1e9:.2f} GFLOP/s of the "
        f"planner's FLOPs = {achieved / peak:.3f} of that peak",
        "hbm_bandwidth": f"AdamW (foreach) over {ranks[0]['params']:,} parameters: {bandwidth / 1e9:.2f} GB/s "
        f"at the planner's {ADAM_BYTES_PER_PARAM} bytes a parameter",
    }
    changes: dict[str, Any] = {
        "name": f"probe-{socket.gethostname()}",
        "efficiency": min(1.0, achieved / peak),
        "engine_efficiency": None,
        "grad_hook_s": None,
        "hbm_bandwidth": bandwidth,
    }
    if s["precision"] == "fp32":
        changes["peak_flops_fp32"] = peak
        if device == "cpu":
            changes["peak_flops"] = peak
    else:
        changes["peak_flops"] = peak
    samples = [
        (1.0, wire_factor(c["op"], world) * c["bytes"], c["seconds"])
        for c in ranks[0]["collectives"]  # every rank took part in each; rank 0's times
    ]
    if samples:
        alpha, beta = _fit_alpha_beta(samples)
        changes["latency_s"] = alpha
        changes["tp_latency_s"] = alpha
        if beta > 0:
            changes["intra_node_bandwidth"] = 1.0 / beta
        how["latency_s"] = (
            f"α of all-reduce / all-gather / all-to-all at {len(SIZES)} sizes: {alpha * 1e6:.1f} µs"
        )
        how["intra_node_bandwidth"] = (
            f"1/β of the same fit: {1.0 / beta / 1e9:.2f} GB/s" if beta > 0 else "kept"
        )
        changes["devices_per_node"] = max(base.devices_per_node, world)
    profile = replace(base, **changes)
    return _with_engines(profile, how, measured, recipe, world, device, samples)


def _with_engines(
    profile: Any,
    how: dict[str, Any],
    measured: dict[str, Any],
    recipe: Any,
    world: int,
    device: str,
    samples: list[Any],
) -> tuple[Any, dict[str, Any]]:
    """The profile with what the engines' own steps say (:mod:`tessera.plan.probe_engines`), fitted as
    ``--calibrate`` fits runs: each engine's efficiency, the optimizer's bandwidth, α / β over the engines'
    data-parallel collectives and the probe's own, the TP collectives' α."""
    from tessera.plan.measured import calibrate
    from tessera.plan.probe_engines import observations

    observed = observations(measured, recipe, world, device)
    failed = {e["label"]: e["error"] for e in measured["ranks"][0].get("engines", []) if e.get("error")}
    refused = {**measured["setting"].get("refused", {}), **failed}
    if refused:
        how["engines_left_out"] = "; ".join(f"{k}: {v}" for k, v in refused.items())
    if not observed:
        return profile, how
    fitted, report = calibrate(observed, profile, extra_samples=samples)
    name = profile.name
    profile = replace(fitted, name=name)
    steps = {o.label.removeprefix("probe:"): o.terms["step"] for o in observed}
    how["engine_efficiency"] = (
        "planner FLOPs / compute of each engine's own steps ("
        + ", ".join(f"{k} {v * 1e3:.1f} ms a step" for k, v in steps.items() if v is not None)
        + "): "
        + ", ".join(f"{k} {v:.3f}" for k, v in (profile.engine_efficiency or {}).items())
    )
    how["efficiency"] = (
        f"the median of the engines' efficiencies below, {profile.efficiency:.3f} (the planner's default for "
        f"an engine not probed; {how['efficiency']})"
    )
    how["hbm_bandwidth"] = (
        f"the engines' optimizer steps: {profile.hbm_bandwidth / 1e9:.2f} GB/s at the planner's bytes "
        f"(the AdamW kernel alone: {how['hbm_bandwidth']})"
    )
    how["latency_s"] = (
        f"α over the probe's collectives and the engines' data-parallel ones "
        f"({report['messages_fitted']} samples): {profile.latency_s * 1e6:.1f} µs"
    )
    how["intra_node_bandwidth"] = (
        f"1/β of the same fit: {profile.intra_node_bandwidth / 1e9:.2f} GB/s"
        if report["seconds_per_wire_byte"] > 0
        else f"kept, {profile.intra_node_bandwidth / 1e9:.2f} GB/s (the fit found no cost per byte)"
    )
    if profile.tp_latency_s is not None and any(o.label == "probe:megatron-tp" for o in observed):
        how["tp_latency_s"] = (
            f"the TP layout's step beyond the rest of the prediction, per TP message: "
            f"{profile.tp_latency_s * 1e6:.1f} µs"
        )
    return profile, how


def write_profile(profile: Any, how: dict[str, Any], measured: dict[str, Any], path: Path) -> None:
    """The profile as YAML (the derivations as comments) and the raw measurements beside it as JSON."""
    from tessera.atomic import write_json_atomic
    from tessera.plan.hardware import dump_profile

    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    head = [f"# measured by `tessera plan --probe` on {socket.gethostname()} at {stamp}"]
    head += [f"# {k}: {v}" for k, v in how.items()]
    head.append(
        "# the engines' figures come from a few steps of random tokens at the probe's layouts: "
        "`tessera plan --calibrate RUN...` fits them from finished runs of your own"
    )
    dump_profile(profile, path, head)
    write_json_atomic(path.with_suffix(".json"), {**measured, "derivation": how, "written": stamp})


def probe_record(device: str, world: int) -> dict[str, Any] | None:
    """What a run's manifest says of this host's probe: the profile's path and figures (None: no probe)."""
    path = find_probe(device, world)
    if path is None:
        return None
    from tessera.plan.hardware import load_hardware

    try:
        figures = {k: v for k, v in asdict(load_hardware(path)).items() if v is not None}
        extra = (
            json.loads(path.with_suffix(".json").read_text()) if path.with_suffix(".json").is_file() else {}
        )
    except Exception as e:  # a damaged probe file is named, never a crash of the run
        return {"path": str(path), "error": f"{type(e).__name__}: {str(e)[:200]}"}
    return {
        "path": str(path),
        "written": extra.get("written"),
        "profile": figures,
        "derivation": extra.get("derivation"),
    }
