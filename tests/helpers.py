"""Spawn real ranks (gloo) running the same worker entry point the launchers run."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from tessera.rundir import RunDir

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools" / "bench"))
from construction_memory import preloaded_forkserver  # noqa: E402  (the benchmark's, one of it)

DEFAULT_RECIPE = REPO / "recipes" / "tiny-llama-cpu.yaml"
TEST_OVERRIDES = ["tracking.wandb.mode=disabled", "checkpoint.every=0", "run.device=cpu"]


@dataclass(frozen=True)
class RunSpec:
    """One run for the rank processes: its directory, --resume, the exit code it must end with, and an
    optional fault to inject (``TESSERA_FAULTS``)."""

    run_dir: str
    resume: bool = False
    expect: int = 0
    fault: str | None = None


# What every rank imports: loaded once in the forkserver, whose forks become the ranks (a spawned rank
# pays ~8 s of imports; several runs per set of ranks already spare the repeats within one fixture).
PRELOAD = ["torch", "torch.distributed", "deepspeed", "transformers", "megatron.core", "tessera.train.worker"]
RANK_ENV = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}  # what set_rank_env sets before the imports


def rank_context():
    """The multiprocessing context for rank processes: forkserver with PRELOAD imported, under RANK_ENV
    (the benchmark's :func:`construction_memory.preloaded_forkserver`); each rank still takes the test
    process's environment of the moment (:func:`_with_env`)."""
    return preloaded_forkserver(PRELOAD, RANK_ENV)


def _with_env(env: dict[str, str]) -> None:
    """A forked rank's environment := the test process's when it started the rank (as with spawn)."""
    os.environ.clear()
    os.environ.update(env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, runs: list[RunSpec], env: dict[str, str]) -> None:
    """One rank running one or more runs in turn (several runs per process spare the imports). A run
    may be expected to fail with a given code (a stop rule, bad input); the next one then still runs."""
    from tessera.launch.local import set_rank_env

    _with_env(env)

    set_rank_env(rank, world, port)
    import torch

    torch.set_num_threads(1)
    from tessera.train.faults import ENV
    from tessera.train.worker import Start, exit_process, run_rank

    code = 0
    for i, spec in enumerate(runs):
        os.environ.pop(ENV, None)
        if spec.fault:
            os.environ[ENV] = spec.fault
        code = run_rank(spec.run_dir, Start(resume=spec.resume), keep_process_group=i < len(runs) - 1)
        if code != spec.expect:
            code = code or 98  # a run that should have stopped but completed is a failure too
            break
        code = 0
    exit_process(code)


def prepare_run(run_dir: Path, overrides: list[str], recipe: Path = DEFAULT_RECIPE):
    """Resolve the recipe with overrides, write it into run_dir and warm the data cache (as the CLI does)."""
    from tessera.config.loader import load_recipe
    from tessera.train.prepare import prepare_run_dir

    r = load_recipe(recipe, [*TEST_OVERRIDES, *overrides]).recipe
    prepare_run_dir(r, run_dir, root=REPO)
    return r


def spawn_ranks(
    run_dir: Path | list[RunSpec], world: int, *, resume: bool = False, timeout: float = 420
) -> list[int]:
    """Start ``world`` processes, wait, return their exit codes (killing all on timeout). ``run_dir`` may
    be a list of runs done one after the other by the same processes (0 when each ended as expected)."""
    runs = [RunSpec(str(run_dir), resume)] if isinstance(run_dir, Path) else run_dir
    ctx = rank_context()
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, runs, env)) for r in range(world)]
    with _running(procs, timeout, port):
        pass
    return [p.exitcode for p in procs]


@contextlib.contextmanager
def _running(procs: list, timeout: float, port: int):
    """Start the rank processes from the repo root (data.cache_dir is relative to it), let the caller
    talk to them, then wait; whatever is still alive after ``timeout`` is killed, and DeepSpeed's
    shared-memory segments of the rendezvous are released (a killed rank cannot)."""
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        for p in procs:
            p.start()
        yield
        for p in procs:
            p.join(timeout)
    finally:
        os.chdir(cwd)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        from tessera.comm.shm import release_shared_memory

        release_shared_memory("127.0.0.1", port)


def train_run(
    run_dir: Path, overrides: list[str], *, world: int, resume: bool = False, recipe: Path = DEFAULT_RECIPE
) -> list[dict]:
    """prepare + spawn + read metrics.jsonl; fails with the ranks' log tails if a rank failed."""
    return train_runs({run_dir: (recipe, overrides, resume)}, world=world)[run_dir]


def train_runs(specs: dict[Path, tuple], *, world: int) -> dict[Path, list[dict]]:
    """Several runs of the same world size in one set of rank processes, in order:
    ``{run_dir: (recipe, overrides, resume[, expected exit code[, fault]])}`` -> ``{run_dir: metrics
    records}`` (an expected failure's records are what it wrote before it stopped)."""
    runs = []
    for run_dir, (recipe, overrides, resume, *rest) in specs.items():
        if not resume:
            prepare_run(run_dir, [f"run.world_size={world}", *overrides], recipe)
        expect, fault = (rest[0] if rest else 0), (rest[1] if len(rest) > 1 else None)
        runs.append(RunSpec(str(run_dir), resume, expect, fault))
    codes = spawn_ranks(runs, world, timeout=420 * len(specs))
    if any(codes):
        logs = "\n".join(
            f"--- {p}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-30:])
            for d in specs
            for p in sorted(RunDir(d).logs.glob("*.log"))
        )
        raise AssertionError(f"ranks exited with {codes}\n{logs}")
    return {d: read_metrics(d) if RunDir(d).metrics.is_file() else [] for d in specs}


def _fn_main(rank: int, world: int, port: int, fn, args: tuple, queue, env: dict[str, str]) -> None:
    from tessera.launch.local import set_rank_env

    _with_env(env)

    set_rank_env(rank, world, port)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from tessera.train.worker import exit_process

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        queue.put((rank, fn(*args), None))
    except BaseException:  # the test reports it with the rank's traceback
        import traceback

        queue.put((rank, None, traceback.format_exc()))
    exit_process(0)


def run_on_ranks(fn, world: int, *args, timeout: float = 600) -> list:
    """Run importable ``fn(*args)`` on ``world`` gloo ranks; returns each rank's result, raising with the
    rank's traceback if one failed."""
    ctx = rank_context()
    queue = ctx.SimpleQueue()
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_fn_main, args=(r, world, port, fn, args, queue, env)) for r in range(world)]
    results: dict[int, object] = {}
    with _running(procs, timeout, port):
        for _ in range(world):
            rank, value, err = queue.get()
            if err:
                raise AssertionError(f"rank {rank} failed:\n{err}")
            results[rank] = value
    return [results[r] for r in range(world)]


def read_metrics(run_dir: Path) -> list[dict]:
    return RunDir(run_dir).read_metrics()


def losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records]


def assert_close_rel(a: list[float], b: list[float], rel: float) -> None:
    assert len(a) == len(b), (len(a), len(b))
    for i, (x, y) in enumerate(zip(a, b), 1):
        assert abs(x - y) <= rel * abs(y), f"step {i}: {x!r} vs {y!r} (rel {abs(x - y) / abs(y):.2e} > {rel})"


def assert_comm_matches_plan(run_dir: Path, group: str, tol: float, *, step: int = 2) -> dict[str, int]:
    """The bytes a run really moved on ``group`` at ``step`` (comm.jsonl, every rank) against what the
    planner predicts for the run's layout, op by op within ``tol``; nothing sizeable unpredicted.
    Returns the prediction (op:group -> bytes)."""
    from collections import defaultdict

    import yaml

    from tessera.config.loader import validate_recipe
    from tessera.plan.hardware import load_hardware
    from tessera.plan.layout import layout_from_recipe
    from tessera.plan.search import estimate_layout

    rd = RunDir(run_dir)
    recipe = validate_recipe(yaml.safe_load(rd.recipe.read_text()))
    est = estimate_layout(recipe, layout_from_recipe(recipe), hardware=load_hardware("cpu-2core")).comm_bytes
    predicted = {k: v for k, v in est.items() if k.endswith(f":{group}") and v}
    assert predicted, est
    per_rank: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for rec in rd.read_comm():
        if rec["phase"] == "step" and rec["step"] == step:
            for o in rec["ops"]:
                per_rank[rec["rank"]][f"{o['op']}:{o['group']}"] += o["bytes"]
    assert sorted(per_rank) == list(range(recipe.run.world_size))
    for rank, got in per_rank.items():
        for key, want in predicted.items():
            assert abs(got.get(key, 0) - want) <= tol * want, (rank, key, got.get(key, 0), want)
        # our own scalar token / loss sums are a few bytes; anything bigger must be in the prediction
        other = sum(v for k, v in got.items() if k.endswith(f":{group}") and k not in predicted)
        assert other <= 0.01 * sum(predicted.values()), (rank, dict(got))
    return predicted


def assert_model_states_match_plan(run_dir: Path, tol: float = 0.05) -> dict[str, int]:
    """The parameter, gradient and optimizer bytes each rank really held (summary.json, read from the
    engine's tensors) against the planner's model-state prediction, term by term within ``tol``."""
    import yaml

    from tessera.config.loader import validate_recipe
    from tessera.plan.hardware import load_hardware
    from tessera.plan.layout import layout_from_recipe
    from tessera.plan.search import estimate_layout

    rd = RunDir(run_dir)
    recipe = validate_recipe(yaml.safe_load(rd.recipe.read_text()))
    mem = estimate_layout(recipe, layout_from_recipe(recipe), hardware=load_hardware("cpu-2core")).memory
    want = {k: getattr(mem, k) for k in ("params", "grads", "optimizer")}
    if (
        mem.frozen
    ):  # with adapters: the frozen base's share of params (0, and held 0, when every weight trains)
        want["frozen"] = mem.frozen
    held = rd.read_summary()["model_state_bytes_per_rank"]
    assert len(held) == recipe.run.world_size
    for rank, got in enumerate(held):
        assert mem.frozen or not got.get("frozen"), (rank, got)
        for k, v in want.items():
            assert abs(got.get(k, 0) - v) <= tol * v, (rank, k, got.get(k, 0), v)
    return want


def assert_activations_match_plan(run_dir: Path, tol: float = 0.10) -> tuple[list[int], int]:
    """The bytes each rank's autograd saved in one micro-batch's forward (summary.json) against the
    planner's per-micro-batch estimate for the recipe's layout and recompute, within ``tol``."""
    import yaml

    from tessera.config.loader import validate_recipe
    from tessera.plan.hardware import load_hardware
    from tessera.plan.layout import layout_from_recipe
    from tessera.plan.search import estimate_layout

    rd = RunDir(run_dir)
    recipe = validate_recipe(yaml.safe_load(rd.recipe.read_text()))
    layout = layout_from_recipe(recipe)
    mem = estimate_layout(
        recipe, layout, hardware=load_hardware("cpu-2core"), recompute=layout.recompute
    ).memory
    want = mem.activations_per_micro_batch
    got = rd.read_summary()["activation_bytes_per_rank"]
    assert len(got) == recipe.run.world_size and all(isinstance(g, int) for g in got), got
    for rank, g in enumerate(got):
        assert abs(g - want) <= tol * want, (rank, g, want, round(g / want, 3))
    return got, want


# ---- checkpoint integrity checks shared by the engine tests --------------------------------------------

PICKLE_MARKER = "PICKLE_PAYLOAD_RAN"


def set_steps(run_dir: Path, steps: int) -> None:
    """Raise train.steps of a run directory's recipe (what --resume reads) to continue it."""
    rewrite_recipe(run_dir, [f"train.steps={steps}"])


def rewrite_recipe(run_dir: Path, overrides: list[str]) -> None:
    """Apply ``overrides`` to a run directory's resolved recipe (what ``--resume`` reads)."""
    import yaml

    from tessera.config.loader import load_recipe

    rd = RunDir(run_dir)
    rd.recipe.write_text(yaml.safe_dump(load_recipe(rd.recipe, overrides).recipe.to_dict(), sort_keys=False))


class PicklePayload:
    """Unpickling this creates a marker file: what a malicious checkpoint file would do."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def forge_checksum(ckpt: Path, rel: str) -> None:
    """Rewrite meta.json so that file ``rel`` matches it again (an attacker, or a careless copy)."""
    import json

    from tessera.checkpoint.index import CHECKSUMS, META

    meta = json.loads((ckpt / META).read_text())
    for f in meta["files"]:
        if f["path"] == rel:
            kind = next(k for k in CHECKSUMS if f.get(k))
            f["bytes"], f[kind] = (ckpt / rel).stat().st_size, CHECKSUMS[kind](ckpt / rel)
    (ckpt / META).write_text(json.dumps(meta))


def plant_pickle(run_dir: Path) -> None:
    """Replace rank 0's RNG file of the latest checkpoint by a pickle with a payload, checksum forged."""
    import pickle

    from tessera.checkpoint.manager import CheckpointManager, rng_file_name

    ckpt = CheckpointManager(RunDir(run_dir).checkpoints, keep=2, rank=0, world_size=1).latest()
    (ckpt / rng_file_name(0)).write_bytes(pickle.dumps(PicklePayload(Path(run_dir) / PICKLE_MARKER)))
    forge_checksum(ckpt, rng_file_name(0))


def _all_tensors(obj, out: list) -> list:
    import torch

    if torch.is_tensor(obj):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _all_tensors(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _all_tensors(v, out)
    return out


def assert_all_finite(ckpt: Path) -> None:
    """Every floating-point tensor in every file of a checkpoint is finite (Tessera's safetensors, the
    engines' own .pt files, megatron's dist_checkpointing shards through torch's DCP converter)."""
    import tempfile

    import torch

    from tessera.tensorfile import load_tensors

    tensors: list = []
    for f in sorted(ckpt.rglob("*")):
        if f.suffix == ".safetensors":
            _all_tensors(load_tensors(f), tensors)
        elif f.suffix == ".pt":  # the engine's own pickle, written by this very test run
            _all_tensors(torch.load(f, map_location="cpu", weights_only=False), tensors)
    if (ckpt / "megatron").is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(ckpt / "megatron", Path(tmp) / "all.pt")
            _all_tensors(torch.load(Path(tmp) / "all.pt", weights_only=False), tensors)
    floats = [t for t in tensors if t.is_floating_point() and t.numel()]
    assert len(floats) > 3, f"no state found in {ckpt}"
    bad = sum(int((~torch.isfinite(t)).sum()) for t in floats)
    assert bad == 0, f"{bad} non-finite values in {ckpt}"


def assert_nan_stop(run_dir: Path, records: list[dict], ref: list[dict]) -> None:
    """A run with a NaN gradient injected at step 3 (checkpoints every 2 steps): every rank exits with
    DIVERGED naming the gradient norm (NaN, or Inf where DeepSpeed calls it an overflow), steps 1-2 are recorded (and equal the reference), step 3 is not,
    and ``latest`` is step 2, whose tensors are all finite."""
    from tessera.checkpoint.index import step_dir_name
    from tessera.checkpoint.manager import CheckpointManager
    from tessera.rundir import ExitCode

    rd = RunDir(run_dir)
    world = len(list(rd.logs.glob("rank_*.exit")))
    assert [rd.rank_exit(r) for r in range(world)] == [ExitCode.DIVERGED] * world
    assert [r["step"] for r in records] == [1, 2]
    assert_close_rel(losses(records), losses(ref)[:2], 1e-5)
    # DeepSpeed's ZeRO optimizer reports a NaN gradient as an overflow: an infinite norm
    log = rd.rank_file(0, "log").read_text()
    assert (
        "training diverged: step 3: grad_norm nan" in log or "training diverged: step 3: grad_norm inf" in log
    )
    latest = CheckpointManager(rd.checkpoints, keep=2, rank=0, world_size=1).latest()
    assert latest is not None and latest.name == step_dir_name(2)
    assert not (rd.checkpoints / step_dir_name(3)).exists()
    assert_all_finite(latest)


def assert_damage_is_refused(run_dir: Path, tmp_path: Path) -> None:
    """Each file of the run's latest checkpoint, one at a time, with one byte flipped (same size), cut
    short, or deleted: verification names exactly that file. Then, through the CLI, ``tessera run
    --resume`` on a copy with one flipped byte exits 2 naming the file, without a traceback and before
    any rank starts."""
    import shutil
    import subprocess
    import sys

    import pytest

    from tessera.checkpoint.index import read_meta, verify_or_raise
    from tessera.checkpoint.manager import CheckpointManager
    from tessera.errors import CheckpointError

    src = CheckpointManager(RunDir(run_dir).checkpoints, keep=2, rank=0, world_size=1).latest()
    files = [f["path"] for f in read_meta(src)["files"]]
    assert len(files) >= 4, files
    for how in ("flip", "truncate", "delete"):
        for i, rel in enumerate(files):
            case = tmp_path / f"{how}{i}"
            shutil.copytree(src, case)
            f = case / rel
            data = bytearray(f.read_bytes())
            if how == "flip":
                data[len(data) // 2] ^= 0x01
                f.write_bytes(bytes(data))
            elif how == "truncate":
                f.write_bytes(bytes(data[: len(data) // 2]))
            else:
                f.unlink()
            with pytest.raises(CheckpointError) as e:
                verify_or_raise(case)
            assert e.value.value == str(f), (how, rel, e.value.render())
            shutil.rmtree(case)
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    rd = RunDir(copy)
    rd.clear_rank_status()
    ckpt = rd.checkpoints / src.name
    victim = max(files, key=lambda r: (ckpt / r).stat().st_size)  # the engine's biggest state file
    data = bytearray((ckpt / victim).read_bytes())
    data[len(data) // 3] ^= 0x80
    (ckpt / victim).write_bytes(bytes(data))
    p = subprocess.run(
        [sys.executable, "-m", "tessera.cli", "run", str(rd.recipe), f"run.out_dir={copy}", "--resume"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert (
        str(ckpt / victim) in p.stderr
        and "blake3 does not match meta.json" in p.stderr
        and "Traceback" not in p.stderr
    ), p.stderr[-3000:]
    assert rd.rank_pid(0) is None  # refused before launch


def hf_loss_on_step(model, run_dir: Path, step: int) -> float:
    """An HF model's token-normalised loss on the global batch of 1-based ``step`` of a run."""
    import torch
    import yaml

    from tessera.config.loader import validate_recipe
    from tessera.data import StepSampler, load_prepared
    from tessera.engines.base import label_tokens, summed_token_loss
    from tessera.plan.layout import layout_from_recipe

    rd = RunDir(run_dir)
    recipe = validate_recipe(yaml.safe_load(rd.recipe.read_text()))
    data = load_prepared(rd.read_json(RunDir.DATA))
    sampler = StepSampler.for_data(data, layout_from_recipe(recipe), rank=0, seed=recipe.train.seed)
    rows = sampler.peek_global(step - 1)  # 0-based
    with torch.no_grad():
        b = data.rows.batch(rows, sampler.epoch_of(step - 1))
        ids, labels = b["input_ids"], b["labels"]
        return float(summed_token_loss(model(input_ids=ids).logits, labels)) / label_tokens(labels)


def initial_hf_model(run_dir: Path):
    """The single-process HF model the run started from: ``AutoModelForCausalLM.from_config`` of the run's
    config, every parameter and persistent buffer loaded (strictly) from the seeded rule."""
    import torch
    import yaml
    from transformers import AutoModelForCausalLM

    from tessera.config.loader import validate_recipe
    from tessera.data import load_prepared
    from tessera.models.hf import load_hf_config
    from tessera.models.init import SeededWeights

    rd = RunDir(run_dir)
    recipe = validate_recipe(yaml.safe_load(rd.recipe.read_text()))
    data = load_prepared(rd.read_json(RunDir.DATA))
    cfg = load_hf_config(recipe.model, vocab_size=data.vocab_size)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    weights = SeededWeights(cfg, recipe.train.seed)
    model.load_state_dict({name: weights[name] for name in weights.shapes}, strict=True)
    return model


def assert_hf_export_replays_the_run(
    run_dir: Path, ckpt_step: int, out: Path, *, rel: float = 1e-6, tamper: bool = False, cli: bool = True
) -> dict:
    """``tessera convert`` of the run's step ``ckpt_step`` checkpoint to an HF directory: it loads with
    ``from_pretrained`` (and its tokenizer with ``AutoTokenizer``), and that model's token-normalised
    loss on the global batch of step ``ckpt_step + 1`` equals the loss the run logged for that step. Its
    config.json and generation_config.json carry the special-token ids of the run's tokenizer (a run from
    scratch: exactly its bos, eos and pad); the console has no warning and no progress bar.
    ``tamper``: `tessera verify` then fails a copy whose config.json names another eos."""
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tessera.checkpoint.index import step_dir_name

    rd = RunDir(run_dir)
    src = rd.checkpoints / step_dir_name(ckpt_step)
    args = ["convert", str(src), "--to", "hf", "--out", str(out)]
    if cli:
        p = subprocess.run(
            [sys.executable, "-m", "tessera.cli", *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        code, stdout, stderr = p.returncode, p.stdout, p.stderr
    else:  # the same command in this process: no interpreter start and imports (~3 s)
        import contextlib
        import io

        from tessera.cli import main

        with contextlib.redirect_stdout(io.StringIO()) as o, contextlib.redirect_stderr(io.StringIO()) as e:
            code = main(args)
        stdout, stderr = o.getvalue(), e.getvalue()
    assert code == 0, stdout[-2000:] + stderr[-2000:]
    report = json.loads((out / "tessera_conversion.json").read_text())
    verify = report["verify"]  # tessera verify of the checkpoint against the written directory
    assert verify["ok"] and verify["weights_ok"] and report["step"] == ckpt_step
    assert verify["logits"]["max_abs_diff"] <= 1e-5 and not verify["missing_in_b"]
    assert AutoTokenizer.from_pretrained(str(out)).vocab_size > 0
    assert "Warning" not in stderr and "it/s]" not in stderr and "%|" not in stderr, stderr[-2000:]
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")  # a run from scratch: exactly the tokenizer's
    assert report["token_ids"] == {k: getattr(tok, k) for k in keys}
    for name in ("config.json", "generation_config.json"):
        written = json.loads((out / name).read_text())
        assert {k: written.get(k) for k in keys} == report["token_ids"], (name, written)
    if tamper:
        _assert_verify_fails_a_tampered_eos(src, out, int(tok.eos_token_id))
    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    loss = hf_loss_on_step(model, run_dir, ckpt_step + 1)
    logged = next(r["loss"] for r in rd.read_metrics() if r["step"] == ckpt_step + 1)
    assert abs(loss - logged) <= rel * abs(logged), (loss, logged)
    return report


def _assert_verify_fails_a_tampered_eos(ckpt: Path, export: Path, eos: int) -> None:
    """`tessera verify CKPT COPY` of an export whose config.json says eos 2 more than its tokenizer: exit 1,
    the special-token check failing with both values named, everything else equal."""
    import contextlib
    import io
    import shutil

    from tessera.cli import main

    copy = export.parent / f"{export.name}-tampered"
    shutil.copytree(export, copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["eos_token_id"] = eos + 2
    (copy / "config.json").write_text(json.dumps(cfg))
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert main(["verify", str(ckpt), str(copy), "--prompts", "1", "--json"]) == 1
    report = json.loads(printed.getvalue())
    assert report["weights_ok"] and report["logits"]["ok"] and not report["ok"]
    assert [t["problems"] for t in report["special_tokens"]] == [
        [f"config.json eos_token_id={eos + 2}, the tokenizer's eos_token is {eos}"]
    ]


def save_pretrained_tiny(path: Path, recipe: Path = DEFAULT_RECIPE) -> Path:
    """The recipe's tiny model written by save_pretrained (seed 7: not the weights any run initialises)
    with the recipe's stdlib BPE as its tokenizer (cached: the runs reuse it): the directory a pretrained
    run (``model.pretrained: true``) then loads."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tessera.config.loader import load_recipe
    from tessera.data import prepare_data
    from tessera.models.hf import load_hf_config

    r = load_recipe(recipe).recipe
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(load_hf_config(r.model, vocab_size=512)).save_pretrained(path)
    bpe = prepare_data(r.data, root=REPO).tokenizer_dir
    AutoTokenizer.from_pretrained(bpe, local_files_only=True).save_pretrained(path)
    return path


def relayout(src: Path, dst: Path, overrides: list[str], *, at_step: int | None = None) -> Path:
    """A copy of run directory ``src`` whose recipe (what ``--resume`` reads) has ``overrides`` applied:
    resuming it reshards the copied checkpoint to the new layout. ``at_step``: the copy resumes from that
    step's checkpoint (later ones are dropped), so one uninterrupted run is also the source."""
    import shutil

    from tessera.checkpoint.index import LATEST, step_dir_name

    shutil.copytree(src, dst)
    rd = RunDir(dst)
    if at_step is not None:
        keep = step_dir_name(at_step)
        for d in rd.checkpoints.glob("step_*"):
            if d.name != keep:
                shutil.rmtree(d)
        (rd.checkpoints / LATEST).write_text(keep + "\n")
    rewrite_recipe(dst, overrides)
    return dst


def read_wandb_records(run_dir: Path) -> list:
    """Every record of an offline W&B run (``run-*.wandb``: a LevelDB-style log of 32 KiB blocks, each
    record split in FULL / FIRST / MIDDLE / LAST chunks behind a 7-byte header, after the 7-byte file
    header ``:W&B``, magic, version), parsed as ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    [path] = list(Path(run_dir).glob("run-*.wandb"))
    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    block, pos, out, parts = 32768, 7, [], []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        kind = data[pos + 6]
        if kind == 0 and length == 0:
            break
        parts.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(b"".join(parts))
            out.append(rec)
            parts = []
    return out


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_tokenizer(base_dir, out):
    """The tokenizer in ``base_dir`` with ChatML's turn markers as special tokens and a ChatML chat
    template, saved to ``out`` (what a chat fine-tune's tokenizer directory holds)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base_dir), local_files_only=True)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    tok.save_pretrained(str(out))
    return out


def chat_rows(n: int, salt: int = 0) -> list[dict]:
    """``n`` conversations of 2-4 turns (some with a system turn, some with two assistant turns)."""
    words = ["alpha", "beta", "gamma", "delta", "def", "return", "import", "class", "value", "list"]
    rows = []
    for i in range(n):

        def say(k: int, length: int, i: int = i) -> str:
            return " ".join(words[(i * 3 + k * 7 + j + salt) % len(words)] for j in range(length))

        msgs = [{"role": "system", "content": say(0, 3)}] if i % 3 == 0 else []
        msgs += [
            {"role": "user", "content": say(1, 4 + i % 5)},
            {"role": "assistant", "content": say(2, 3 + i % 7)},
        ]
        if i % 2:
            msgs += [{"role": "user", "content": say(3, 2)}, {"role": "assistant", "content": say(4, 5)}]
        rows.append({"messages": msgs})
    return rows
