"""Checkpoint I/O: Tessera's own save / load / conversion against plain file I/O on the same disk.

Three measurements, each next to a baseline run in the same process layout, on the same disk (one temp
directory under ``runs/``, or ``--dir``):

1. **Save**: ``CheckpointManager.save`` as the training loop calls it (finiteness check, the engine's
   shard, RNG files, manifest, BLAKE3 checksum of every file, meta.json, rename, ``latest``, pruning to
   ``keep=1``) of the default recipe's engine (DeepSpeed ZeRO-2 on 2 gloo ranks; ``--engine ddp`` for
   the DDP baseline engine) holding a ~84M-parameter Llama after one AdamW step: ~1.3 GB on disk.
   The save is durable: the ranks hash and fsync every data file (shared between them by bytes) before
   the rename, and fsync the directories. Baseline: each rank writes files of the same names and sizes
   as it wrote, and fsyncs them. As a check, the time to fsync the saved files again right after the
   save (untimed for it) is reported as "left dirty after save": ~0 s when nothing was left to flush.
   Both sides keep one copy: the save prunes the previous checkpoint, and each plain write deletes the
   previous repetition's files (rank 0, after the writes), both inside the timing.
2. **Load**: the resume path (``pick`` the latest, ``verify`` every file against meta.json, ``load``; as
   the worker resumes, the checksums are computed by a thread beside the engine's load, which waits for
   them).
   Baseline: each rank reads its files in 16 MiB chunks. Both start cold: every file is fsynced and
   evicted from the page cache (``posix_fadvise(DONTNEED)``) before each timed read.
3. **Conversion**: ``tessera convert HF_DIR --to megatron --layout tp=2`` (the CLI, its ranks, the
   checkpoint save and the verification) of the same model saved with ``save_pretrained``, against a
   cold read of the same safetensors files; the conversion's peak memory (the largest process's peak
   RSS, exact, from ``getrusage(RUSAGE_CHILDREN)`` of a wrapper; the whole process tree's PSS, polled).

Tessera and baseline alternate (order swapped every repetition); medians, ratios (Tessera GB/s / plain
GB/s) and every repetition go to ``bench-results/checkpoint_io.json``. About 5 minutes on the 2-core
test bed (2 of them the conversion); ~6 GB of temporary files, removed at the end.

    python tools/bench/checkpoint_io.py [--reps 3] [--out bench-results] [--dir runs] [--engine deepspeed]
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
GB = 1e9
CHUNK = 16 << 20
#: ~84M parameters: 65.5M in the untied embeddings, 2 layers of GQA attention + SwiGLU MLP
MODEL = {
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "num_hidden_layers": 2,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1.0e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
RECIPES = {"deepspeed": "tiny-llama-cpu.yaml", "ddp": "tiny-llama-cpu-ddp.yaml"}
CONVERT_RECIPE = "tiny-llama-cpu-mcore-tp2.yaml"


# ---- plain file I/O (the baselines) and the page cache ---------------------------------------------------


def files_under(root: Path) -> dict[str, int]:
    """Relative path -> size of every regular file under ``root``."""
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def evict(paths: list[Path]) -> float:
    """fsync every file, then drop it from the page cache; returns the seconds the fsyncs took (what the
    writer left dirty in the page cache for the kernel to flush; ~0 after a durable save)."""
    flush = 0.0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            t0 = time.perf_counter()
            os.fsync(fd)
            flush += time.perf_counter() - t0
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return flush


def plain_write(root: Path, sizes: dict[str, int], block: bytes, before: Path | None = None) -> None:
    """Write files of the given relative names and sizes from ``block`` (repeated), each fsynced; then
    delete the directory ``before`` where it exists (the previous copy: a save's pruning to ``keep=1``)."""
    view = memoryview(block)
    for rel, size in sizes.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            left = size
            while left:
                left -= f.write(view[: min(left, len(view))])
            f.flush()
            os.fsync(f.fileno())
    if before is not None and before.is_dir():
        shutil.rmtree(before)


def plain_read(paths: list[Path]) -> int:
    """Read every file through one reusable buffer; returns the bytes read."""
    buf = bytearray(CHUNK)
    n = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while k := f.readinto(buf):
                n += k
    return n


def owner(rel: str) -> int:
    """The rank that writes checkpoint file ``rel``: DeepSpeed's ZeRO partitions and Tessera's RNG files
    name theirs, everything else (model states, manifest, meta.json) is rank 0's."""
    m = re.search(r"(?:zero_pp_rank_|rng_rank)0*(\d+)", Path(rel).name)
    return int(m.group(1)) if m else 0


def proc_io() -> dict[str, int]:
    """This process's I/O counters: rchar / wchar (syscalls) and read_bytes / write_bytes (storage)."""
    out = {}
    for line in Path("/proc/self/io").read_text().splitlines():
        k, v = line.split(":")
        out[k] = int(v)
    return {k: out[k] for k in ("rchar", "wchar", "read_bytes", "write_bytes")}


class Phases:
    """Seconds spent inside wrapped callables (a measurement shim; the library code is unchanged)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, obj: Any, attr: str, label: str) -> None:
        fn = getattr(obj, attr)

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - t0

        setattr(obj, attr, timed)

    def take(self) -> dict[str, float]:
        out, self.seconds = self.seconds, {}
        return out


# ---- save / load on the engine's ranks -------------------------------------------------------------------


def _rank(rank: int, world: int, port: int, spec: dict[str, Any], q: Any) -> None:
    from tessera.launch.local import set_rank_env

    threads = max(1, (os.cpu_count() or 1) // world)
    set_rank_env(rank, world, port, threads=threads)
    import deepspeed
    import torch

    torch.set_num_threads(threads)
    import tessera.checkpoint.manager as manager_mod
    from tessera.checkpoint.manager import CheckpointManager
    from tessera.comm.groups import all_gather_object, barrier
    from tessera.config.loader import load_recipe
    from tessera.engines.base import ModelSource
    from tessera.plan.layout import layout_from_recipe
    from tessera.tables.engines import engine_class

    recipe = load_recipe(spec["recipe"], spec["overrides"]).recipe
    layout = layout_from_recipe(recipe)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    source = ModelSource.of(recipe, vocab_size=recipe.data.vocab_size)
    engine = engine_class(layout.engine)(source, recipe, layout, device="cpu")
    # one real AdamW step, so that the optimizer holds (non-zero) moments as in any run's checkpoint
    ids = torch.randint(
        0, MODEL["vocab_size"], (layout.micro_batch, 32), generator=torch.Generator().manual_seed(rank)
    )
    engine.train_step([{"input_ids": ids, "labels": ids.clone()}] * layout.grad_accum, 1)
    work = Path(spec["work"])
    ckpt = CheckpointManager(work / "checkpoints", keep=1, rank=rank, world_size=world)
    describe = {
        "engine": layout.engine,
        "sharding": engine.sharding,
        "layout": layout.to_dict(),
        "precision": recipe.train.precision,
        "model_config": json.loads(source.hf_config().to_json_string()),
        "tokenizer_hash": None,
    }
    manifest = {"benchmark": "checkpoint_io", "recipe": spec["recipe"]}

    phases = Phases()
    phases.wrap(ckpt, "check_finite", "check_finite")
    phases.wrap(engine, "save", "engine.save")
    phases.wrap(engine, "load", "engine.load")
    phases.wrap(ckpt, "_prune", "prune")
    phases.wrap(manager_mod, "checksum_file", "checksum")
    phases.wrap(manager_mod, "save_tensors", "rng_file")

    def timed(fn: Any) -> tuple[float, dict[str, float], dict[str, int]]:
        barrier()
        io0, t0 = proc_io(), time.perf_counter()
        fn()
        barrier()
        seconds, io1 = time.perf_counter() - t0, proc_io()
        return seconds, phases.take(), {k: io1[k] - io0[k] for k in io0}

    def save(step: int) -> None:
        ckpt.save(step, engine, describe=describe, sampler={"position": step}, manifest=manifest)

    def load() -> None:  # the worker's resume: pick, verify every file (checksums beside the load), load
        path = ckpt.pick(None)
        ckpt.load(path, ckpt.verify(path, defer_checksums=True), engine)

    def cold(paths: list[Path]) -> float:
        flush = evict(paths) if rank == 0 else 0.0
        barrier()
        return flush

    block = os.urandom(CHUNK)
    save(1)  # warm-up (first-call costs); from here every save also prunes the previous checkpoint
    sizes = files_under(ckpt.latest())  # type: ignore[arg-type]  # the plain files mirror these
    cold([ckpt.latest() / f for f in sizes])  # type: ignore[operator]
    load()
    phases.take()
    mine = {f: n for f, n in sizes.items() if owner(f) % world == rank}
    reps: list[dict[str, Any]] = []
    for rep in range(spec["reps"]):
        plain = work / f"plain-{rep}"
        rec: dict[str, Any] = {"rep": rep, "order": "tessera-first" if rep % 2 == 0 else "plain-first"}
        before = work / f"plain-{rep - 1}" if rank == 0 else None  # rank 0 prunes, as in the save
        saves = {
            "tessera_save": lambda step=rep + 2: save(step),
            "plain_write": lambda plain=plain, before=before: plain_write(plain, mine, block, before),
        }
        loads = {
            "tessera_load": load,
            "plain_read": lambda plain=plain: plain_read([plain / f for f in mine]),
        }
        for group in (saves, loads):
            for key in list(group) if rep % 2 == 0 else list(group)[::-1]:
                rec[key] = timed(group[key])
                where = ckpt.latest() if key.startswith("tessera") else plain
                flush = cold([where / f for f in files_under(where)])  # type: ignore[arg-type,operator]
                if key == "tessera_save":
                    rec["tessera_flush_s"] = flush
                    rec["files"] = files_under(where)  # type: ignore[arg-type]
                    rec["bytes"] = sum(rec["files"].values())
        reps.append(rec)
    if rank == 0:
        shutil.rmtree(work / f"plain-{spec['reps'] - 1}", ignore_errors=True)
    barrier()
    everyone = all_gather_object(reps)
    if rank == 0:  # the trained model as an HF directory: the conversion's source
        engine.modules()[0].save_pretrained(spec["hf_dir"], safe_serialization=True)
        q.put({"ranks": everyone, "layout": layout.to_dict(), "sharding": engine.sharding})
        q.close()
        q.join_thread()
    barrier()
    torch.distributed.destroy_process_group()
    from tessera.train.worker import exit_process

    exit_process(0)


def run_ranks(spec: dict[str, Any], world: int, timeout: float = 900) -> dict[str, Any]:
    """Spawn the ranks, wait for rank 0's result; a rank that dies stops the others."""
    from tessera.comm.shm import release_shared_memory

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, world, port, spec, q)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                result = q.get(timeout=2)
                break
            except Exception:  # queue.Empty
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"a rank failed (exit codes {[p.exitcode for p in procs]})") from None
        for p in procs:
            p.join(timeout=120)
        return result
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        release_shared_memory("127.0.0.1", port)  # DeepSpeed leaves its CPU all-reduce segments behind


# ---- conversion ------------------------------------------------------------------------------------------

#: runs the command, then prints the largest peak RSS of its (waited-for) process tree, in KiB
_WRAP = (
    "import resource, subprocess, sys\n"
    "rc = subprocess.call(sys.argv[1:])\n"
    "print('MAXRSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
    "sys.exit(rc)\n"
)


def convert_once(hf_dir: Path, recipe: Path, out: Path, log: Path) -> dict[str, Any]:
    """``tessera convert HF --to megatron --layout tp=2`` in a child process tree: seconds and peak memory
    (:func:`measure_tree`)."""
    cmd = [sys.executable, "-m", "tessera.cli", "convert", str(hf_dir), "--to", "megatron",
           "--layout", "tp=2", "--recipe", str(recipe), "--out", str(out)]  # fmt: skip
    return measure_tree(cmd, out, log)


def measure_tree(cmd: list[str], out: Path, log: Path) -> dict[str, Any]:
    """``cmd`` in a child process tree (writing ``out``): seconds and peak memory.

    Peak memory three ways: the largest single process's peak RSS (exact: the kernel's, through the
    wrapper's ``RUSAGE_CHILDREN``); each process's peak RSS and the tree's peak total PSS (polled every
    0.1 s; PSS splits shared pages, so the forked writers do not count their parent's pages twice)."""
    import psutil

    procs: dict[int, dict[str, Any]] = {}
    tree_pss = [0]
    with open(log, "w") as logf:
        t0 = time.perf_counter()
        wrapper = subprocess.Popen([sys.executable, "-c", _WRAP, *cmd], stdout=logf, stderr=logf, cwd=REPO)
        parent = psutil.Process(wrapper.pid)

        def poll() -> None:
            while wrapper.poll() is None:
                total = 0
                try:
                    kids = parent.children(recursive=True)
                except psutil.Error:
                    break
                for k in kids:
                    try:
                        mem = k.memory_full_info()
                        rec = procs.setdefault(
                            k.pid, {"pid": k.pid, "ppid": k.ppid(), "cmd": " ".join(k.cmdline()[1:5])[:90]}
                        )
                        rec["peak_rss"] = max(rec.get("peak_rss", 0), mem.rss)
                        total += mem.pss
                    except psutil.Error:
                        pass
                tree_pss[0] = max(tree_pss[0], total)
                time.sleep(0.1)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        try:
            rc = wrapper.wait(timeout=600)
        except subprocess.TimeoutExpired:
            wrapper.kill()
            raise
        seconds = time.perf_counter() - t0
        poller.join()
    text = log.read_text()
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd[2:6])} failed (exit {rc}):\n{text[-3000:]}")
    m = re.search(r"MAXRSS_KB (\d+)", text)
    return {
        "seconds": seconds,
        "peak_rss_largest_process": int(m.group(1)) * 1024 if m else None,
        "peak_pss_tree_polled": tree_pss[0],
        "processes_polled": sorted(procs.values(), key=lambda r: -r.get("peak_rss", 0)),
        "output_bytes": sum(files_under(out).values()),
        "log_tail": text.strip().splitlines()[-30:],
    }


# ---- main ------------------------------------------------------------------------------------------------


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def _write_recipes(work: Path, engine: str) -> tuple[Path, Path]:
    model = work / "model.yaml"
    model.write_text(yaml.safe_dump({"model": {"hf_config": MODEL}}, sort_keys=False))
    train = work / "recipe.yaml"
    train.write_text(f"include:\n  - {REPO / 'recipes' / RECIPES[engine]}\n  - {model}\n")
    conv = work / "convert-recipe.yaml"
    # the HF directory is save_pretrained weights without a tokenizer: the recipe's own BPE, said so
    conv.write_text(
        f"include:\n  - {REPO / 'recipes' / CONVERT_RECIPE}\n  - {model}\n"
        "data:\n  tokenizer: bpe\n  tokenizer_override: true\n"
    )
    return train, conv


def summarize(ranks: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Rank 0's timings (the barriers make them the slowest rank's), I/O counters summed over ranks."""
    out: dict[str, Any] = {}
    for key in ("tessera_save", "plain_write", "tessera_load", "plain_read"):
        secs = [r[key][0] for r in ranks[0]]
        out[key] = {
            "median_s": _med(secs),
            "all_s": secs,
            "rank0_phases_median_s": {
                k: _med([r[key][1].get(k, 0.0) for r in ranks[0]]) for k in ranks[0][0][key][1]
            },
            "io_bytes_all_ranks_median": {
                k: _med([sum(rk[i][key][2][k] for rk in ranks) for i in range(len(ranks[0]))])
                for k in ranks[0][0][key][2]
            },
        }
    # a check, not a cost: fsync of the saved files right after the save (~0 s: the save fsynced them)
    flush = [r["tessera_flush_s"] for r in ranks[0]]
    out["tessera_flush_after_save"] = {"median_s": _med(flush), "all_s": flush}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--convert-reps", type=int, default=1)
    ap.add_argument("--engine", choices=sorted(RECIPES), default="deepspeed")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "bench-results"))
    ap.add_argument(
        "--dir", default=str(REPO / "runs"), help="parent of the temp directory (the disk measured)"
    )
    args = ap.parse_args()
    parent = Path(args.dir).resolve()
    parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(parent).free
    if free < 10 * GB:
        print(f"checkpoint_io: {parent} has {free / GB:.1f} GB free, needs ~10 GB", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix=".bench-checkpoint-io-", dir=parent))
    try:
        train_recipe, conv_recipe = _write_recipes(work, args.engine)
        hf_dir = work / "hf"
        spec = {
            "recipe": str(train_recipe),
            "overrides": [
                f"run.world_size={args.world}",
                "run.device=cpu",
                "parallel.micro_batch=1",
                f"parallel.global_batch={args.world}",
                "train.precision=fp32",
            ],
            "work": str(work),
            "reps": args.reps,
            "hf_dir": str(hf_dir),
        }
        t0 = time.perf_counter()
        ranks = run_ranks(spec, args.world)
        save_load_s = time.perf_counter() - t0
        hf_files = sorted(hf_dir.glob("*.safetensors"))
        hf_bytes = sum(p.stat().st_size for p in hf_files)
        reads: list[float] = []
        convs: list[dict[str, Any]] = []
        for i in range(max(args.reps, args.convert_reps)):
            if i < args.reps:
                evict(hf_files)
                t = time.perf_counter()
                plain_read(hf_files)
                reads.append(time.perf_counter() - t)
            if i < args.convert_reps:
                evict(hf_files)
                out = work / f"converted-{i}"
                convs.append(convert_once(hf_dir, conv_recipe, out, work / f"convert-{i}.log"))
                shutil.rmtree(out, ignore_errors=True)
        result = report(args, ranks, parent, (hf_bytes, len(hf_files)), reads, convs, save_load_s)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "checkpoint_io.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


def _row(label: str, seconds: float, gbps: float | None, note: str = "") -> str:
    rate = f"{gbps:8.3f}" if gbps is not None else f"{'':8}"
    return f"{label:36}{seconds:9.2f}{rate}  {note}".rstrip()


def report(
    args: argparse.Namespace,
    ranks: dict[str, Any],
    disk: Path,
    hf: tuple[int, int],
    reads: list[float],
    convs: list[dict[str, Any]],
    save_load_s: float,
) -> dict[str, Any]:
    """Print the table; returns the JSON record (``table``: the printed lines). ``hf``: (bytes, files) of
    the HF weights."""
    import psutil

    s = summarize(ranks["ranks"])
    first = ranks["ranks"][0][0]
    nbytes, hf_bytes = first["bytes"], hf[0]
    timed = ("tessera_save", "plain_write", "tessera_load", "plain_read")
    gbps = {k: nbytes / GB / s[k]["median_s"] for k in timed}
    read_gbps = hf_bytes / GB / _med(reads)
    ratios = {
        "save_throughput_ratio": gbps["tessera_save"] / gbps["plain_write"],
        "load_throughput_ratio": gbps["tessera_load"] / gbps["plain_read"],
    }
    # the same ratio repetition by repetition (each pair ran back to back): the disk's drift between
    # repetitions leaves the pairs, which is what the medians above mix
    pairs = {
        kind: [p / t for p, t in zip(s[base]["all_s"], s[f"tessera_{kind}"]["all_s"], strict=True)]
        for kind, base in (("save", "plain_write"), ("load", "plain_read"))
    }
    for kind, xs in pairs.items():
        ratios[f"{kind}_paired_ratio_median"] = _med(xs)
    conv_s = conv_gbps = peak = tree = None  # --convert-reps 0: no conversion measured
    if convs:
        conv_s = _med([c["seconds"] for c in convs])
        conv_gbps = hf_bytes / GB / conv_s
        peak = max(c["peak_rss_largest_process"] or 0 for c in convs)
        tree = max(c["peak_pss_tree_polled"] for c in convs)
        ratios |= {
            "conversion_over_disk_read_ratio": conv_gbps / read_gbps,
            "conversion_peak_rss_over_hf_bytes": peak / hf_bytes,
            "conversion_tree_peak_pss_over_hf_bytes": tree / hf_bytes,
        }
    lines: list[str] = []
    lines += [
        f"Checkpoint I/O: {args.engine} engine ({ranks['sharding']}), {args.world} gloo rank(s), "
        f"{args.reps} reps, medians",
        f"checkpoint {nbytes / GB:.3f} GB in {len(first['files'])} files on {disk}; every read cold "
        "(fsync + fadvise DONTNEED first)",
        f"{'':36}{'s':>9}{'GB/s':>8}",
        _row("Tessera save (durable: data fsynced)", s["tessera_save"]["median_s"], gbps["tessera_save"]),
        _row(
            "  left dirty after save",
            s["tessera_flush_after_save"]["median_s"],
            None,
            "(fsync of its files right after; ~0 = nothing left)",
        ),
        _row("plain write, same files, fsync", s["plain_write"]["median_s"], gbps["plain_write"]),
        _row("Tessera load (pick, verify, load)", s["tessera_load"]["median_s"], gbps["tessera_load"]),
        _row("plain read, same files", s["plain_read"]["median_s"], gbps["plain_read"]),
    ]
    if conv_s is not None:
        lines.append(
            _row("convert HF -> megatron TP2", conv_s, conv_gbps, f"({hf_bytes / GB:.3f} GB of HF weights)")
        )
    lines.append(_row("plain read of the HF safetensors", _med(reads), read_gbps))
    shown = {"tessera_save": {"checksum": "checksum+fsync"}, "tessera_load": {}}
    for kind, names in shown.items():
        ph = s[kind]["rank0_phases_median_s"]
        other = s[kind]["median_s"] - sum(ph.values())
        parts = ", ".join(f"{names.get(k, k)} {v:.2f}" for k, v in ph.items() if v >= 0.005)
        lines.append(f"rank 0 {kind.split('_')[1]}: {parts}, rest (waits, meta, rename) {other:.2f} s")
    rd = s["tessera_load"]["io_bytes_all_ranks_median"]
    lines.append(
        f"Tessera load, all ranks: {rd['rchar'] / GB:.2f} GB through read(), "
        f"{rd['read_bytes'] / GB:.2f} GB from storage"
    )
    if peak is not None and tree is not None:
        lines.append(
            f"conversion peak memory: largest process RSS {peak / 2**30:.2f} GiB "
            f"({ratios['conversion_peak_rss_over_hf_bytes']:.1f}x the HF weights), process tree PSS "
            f"{tree / 2**30:.2f} GiB ({ratios['conversion_tree_peak_pss_over_hf_bytes']:.1f}x)"
        )
    lines += [f"  {k:40} {v:.3f}" for k, v in ratios.items()]
    lines += [
        f"  {kind} pairs (plain s / Tessera s, by repetition): " + " ".join(f"{x:.2f}" for x in xs)
        for kind, xs in pairs.items()
    ]
    print()
    print("\n".join(lines))
    import deepspeed
    import torch

    return {
        "benchmark": "checkpoint_io",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {
            "cpu_count": os.cpu_count(),
            "memory_bytes": psutil.virtual_memory().total,
            "disk_path": str(disk),
            "disk_free_bytes": shutil.disk_usage(disk).free,
            "kernel": platform.release(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "deepspeed": deepspeed.__version__,
        },
        "engine": args.engine,
        "sharding": ranks["sharding"],
        "layout": ranks["layout"],
        "world_size": args.world,
        "model_hf_config": MODEL,
        "reps": args.reps,
        "table": lines,
        "reads": "cold: every file fsynced and posix_fadvise(DONTNEED) before each timed read",
        "checkpoint_bytes": nbytes,
        "checkpoint_files": first["files"],
        "gb_per_s": gbps,
        "ratios": ratios,
        "save_load": s,
        "save_load_wall_s": save_load_s,
        "conversion": {
            "command": "tessera convert HF --to megatron --layout tp=2 --recipe <tp2 recipe + model>",
            "hf_bytes": hf_bytes,
            "hf_files": hf[1],
            "median_s": conv_s,
            "gb_per_s": conv_gbps,
            "runs": convs,
            "hf_read_s": reads,
            "hf_read_gb_per_s": read_gbps,
        },
        "repetitions": ranks["ranks"],
    }


if __name__ == "__main__":
    sys.exit(main())
