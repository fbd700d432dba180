"""The measuring side of ``tessera plan R.yaml --probe`` (what it measures and how the profile is made of it:
:mod:`tessera.plan.probe`; the engines' layouts and their fit: :mod:`tessera.plan.probe_engines`).

Here the probe's ranks are started (gloo on CPU, NCCL on GPU, every rank at once), each times the
micro-benchmarks and then each engine's own steps, built as `tessera run` builds them: this module sits
with the launchers because it starts ranks and the engines, as `tessera run` does.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Any

from tessera.plan.probe import BUDGET_S, ENGINES_S, OPS, SIZES
from tessera.plan.probe_engines import STEPS, WARMUP

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
    from tessera.train.guard import die_with_parent

    die_with_parent()  # a probe rank never outlives the `tessera plan --probe` that started it (one killed)
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
                # every rank makes the same number of calls (each deciding by its own clock, one rank
                # went on to the next collective while the other waited in this one: a deadlock): the
                # slowest rank's time of one call sets the count for all
                call()
                sync()
                t0 = time.perf_counter()
                call()
                sync()
                one = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
                dist.all_reduce(one, op=dist.ReduceOp.MAX)
                share = budget * 0.4 / (len(OPS) * len(SIZES))
                calls = int(min(50, max(5, share // max(float(one), 1e-9))))
                seconds = _timed(call, 0.0, sync, at_least=calls)  # exactly `calls` timed calls
                collectives.append({"op": op, "bytes": size, "seconds": seconds})
        dist.barrier()
    out["collectives"] = collectives
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


def run_engines(layouts: list[tuple[str, Any]], *, device: str, counter: Any) -> list[dict[str, Any]]:
    """On this rank (the probe's process group up, ``counter``: the installed comm accounting): each
    layout's engine built, ``WARMUP`` + ``STEPS`` steps of random tokens, closed. Per layout its label
    and each timed step's split (:func:`tessera.train.metrics.step_split`) and counted collectives; a
    layout whose engine fails to build or step has ``error`` instead."""
    import torch

    from tessera.comm.accounting import group_namer
    from tessera.engines.base import MicroBatches, ModelSource
    from tessera.plan.layout import layout_from_recipe
    from tessera.tables.engines import engine_class
    from tessera.train.metrics import step_split

    out: list[dict[str, Any]] = []
    for label, recipe in layouts:
        layout = layout_from_recipe(recipe)
        seq, mb, vocab = recipe.data.seq_len, layout.micro_batch, recipe.data.vocab_size
        counts = (float(layout.global_batch * (seq - 1)), float(layout.global_batch * seq))
        engine = None
        steps: list[dict[str, Any]] = []
        t_build = time.perf_counter()
        try:
            engine = engine_class(layout.engine)(ModelSource.of(recipe, vocab_size=vocab), recipe, layout,
                                                 device=device)  # fmt: skip
            counter.namer = group_namer(layout, engine.named_groups())
            built = time.perf_counter() - t_build
            for n in range(1, WARMUP + STEPS + 1):
                # the same tokens on every rank (a TP group must see the same rows); timing only
                g = torch.Generator().manual_seed(n)
                rows = [torch.randint(0, vocab, (mb, seq), generator=g) for _ in range(layout.grad_accum)]
                micro = MicroBatches(({"input_ids": r, "labels": r} for r in rows), counts=counts)
                counter.pop_step()
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                res = engine.train_step(micro, n)
                if device == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                ops = counter.pop_step()
                if n > WARMUP:
                    steps.append({"step": n, **step_split(dt, res.optimizer_s, res.optimizer_comm_s, ops),
                                  "ops": ops})  # fmt: skip
            out.append({"label": label, "steps": steps, "build_s": built,
                        "seconds": time.perf_counter() - t_build})  # fmt: skip
        except Exception as e:  # an engine this machine cannot run is named in the probe, not fatal
            out.append({"label": label, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        finally:
            if engine is not None:
                engine.close()
            del engine
            if device == "cuda":  # the next engine gets the memory back (after a failed one too)
                torch.cuda.empty_cache()
    return out


# ---- the command -----------------------------------------------------------------------------------------


def cmd_probe(args: argparse.Namespace) -> int:
    """``tessera plan R.yaml --probe``: measure this machine at the recipe's world size and write the
    profile (:mod:`tessera.plan.probe`)."""
    from rich.console import Console

    from tessera.plan.command import plan_target
    from tessera.plan.probe import probe_path, profile_from, write_profile

    recipe, world, device = plan_target(args)

    con = Console()
    with con.status(f"probing this machine with {world} rank(s) on {device} (~30 s)"):
        measured = measure(recipe, world=world, device=device)
    profile, how = profile_from(measured, recipe, world=world, device=device)
    out = Path(args.out) if args.out else probe_path(device, world)
    write_profile(profile, how, measured, out)
    for key, text in how.items():
        con.print(f"  {key}: {text}", highlight=False, soft_wrap=True)
    con.print(f"probed in {measured['seconds']:.1f} s -> {out}", highlight=False, soft_wrap=True)
    if args.out:
        con.print(f"use it with --hardware {out} (or run.hardware)", highlight=False, soft_wrap=True)
    return 0
