"""Kill trials of asynchronous checkpoints: a run SIGKILLed at random points of its saves resumes from a
complete checkpoint every time and ends bit-identical to the run that was never interrupted.

One `tessera run` with ``checkpoint.async=true``, a save every 2 steps and ``run.restarts`` = trials + 1
carries ``--trials`` faults, one per save: ``kill_in_save:rank=R:step=S:at=B``, R drawn from the ranks
and B from the bytes that rank writes for one checkpoint (measured on the reference run's last
checkpoint), so the kill lands anywhere from the writer's first block to its last; one trial in five is
``at=-1`` instead (rank 0 killed after the directory's rename, before ``latest`` names it). Each kill is
a restart of every rank by the supervisor, from what ``latest`` names. The reference is the same recipe,
run without faults. Checked: the run ends, one restart per trial, every checkpoint left passes
verification, and the final weights and both Adam moments are equal to the reference's
(``torch.equal``), as are the losses of every step. Results: ``<out>/async_kill_trials.json``.

    python tools/async_kill_trials.py [--trials 10] [--recipe recipes/tiny-llama-cpu.yaml] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "framework"))


def owner(name: str) -> int:
    """The rank that writes checkpoint file ``name``: the rank-numbered ones (DeepSpeed's ZeRO partitions,
    RNG files, megatron-core's ``__R_0.distcp`` buckets) name it; the rest are rank 0's."""
    m = re.search(r"(?:rank_?|^__)0*(\d+)", Path(name).name)
    return int(m.group(1)) if m else 0


def run(recipe: str, out: Path, steps: int, extra: list[str], env: dict[str, str]) -> tuple[int, float, str]:
    cmd = [sys.executable, "-m", "tessera.cli", "run", recipe, f"run.out_dir={out}", f"train.steps={steps}",
           "checkpoint.every=2", f"checkpoint.keep={steps}", "checkpoint.async=true",
           "tracking.wandb.mode=disabled", *extra]  # fmt: skip
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    return p.returncode, time.perf_counter() - t0, (p.stdout + p.stderr)[-4000:]


def final_state(run_dir: Path, world: int) -> tuple[str, dict[str, Any]]:
    from tessera.checkpoint.manager import CheckpointManager
    from tessera.checkpoint.reader import read_hf_moment, read_hf_state
    from tessera.rundir import RunDir

    ckpt = CheckpointManager(RunDir(run_dir).checkpoints, keep=99, rank=0, world_size=world).latest()
    assert ckpt is not None
    state, meta = read_hf_state(ckpt)
    out = {f"w/{k}": v for k, v in state.items()}
    for kind in ("exp_avg", "exp_avg_sq"):
        out.update({f"{kind}/{k}": v for k, v in (read_hf_moment(ckpt, meta, kind) or {}).items()})
    return ckpt.name, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--recipe", default="recipes/tiny-llama-cpu.yaml")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "bench-results"))
    ap.add_argument("--keep-runs", action="store_true", help="keep the two run directories")
    args = ap.parse_args()
    import torch

    from tessera.checkpoint.manager import CheckpointManager
    from tessera.config.loader import load_recipe
    from tessera.rundir import RunDir, read_jsonl

    world = load_recipe(args.recipe, []).recipe.run.world_size
    steps = 2 * args.trials + 2
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    work = Path(
        tempfile.mkdtemp(prefix="kill-trials-", dir=REPO / "runs" if (REPO / "runs").is_dir() else None)
    )
    try:
        rc, ref_s, log = run(args.recipe, work / "reference", steps, [], env)
        if rc != 0:
            print(log, file=sys.stderr)
            return 1
        last = RunDir(work / "reference").checkpoints / f"step_{steps:06d}"
        sizes = [0] * world
        for f in json.loads((last / "meta.json").read_text())["files"]:
            sizes[owner(f["path"])] += f["bytes"]
        rng = random.Random(args.seed)
        faults = []
        for i in range(args.trials):
            step = 2 * (i + 1)
            if i % 5 == 4:
                faults.append({"rank": 0, "step": step, "at": -1})
            else:
                r = rng.randrange(world)
                faults.append({"rank": r, "step": step, "at": rng.randrange(sizes[r])})
        spec = ",".join(f"kill_in_save:rank={f['rank']}:step={f['step']}:at={f['at']}" for f in faults)
        rc, faulted_s, log = run(
            args.recipe,
            work / "faulted",
            steps,
            [f"run.restarts={args.trials + 1}"],
            {**env, "TESSERA_FAULTS": spec},
        )
        fired = sorted(p.name for p in (work / "faulted" / RunDir.FAULTS_FIRED).iterdir()) if rc == 0 else []
        result: dict[str, Any] = {"recipe": args.recipe, "world": world, "steps": steps, "trials": args.trials,
                                  "bytes_per_rank": sizes, "faults": faults, "exit_code": rc,
                                  "reference_s": ref_s, "faulted_s": faulted_s, "fired": len(fired)}  # fmt: skip
        if rc == 0:
            # the supervisor's record of every restart (a kill in the first save starts over: no resume)
            restarts = RunDir(work / "faulted").read_summary().get("restarts", [])
            mgr = CheckpointManager(RunDir(work / "faulted").checkpoints, keep=99, rank=0, world_size=world)
            for ckpt in mgr.complete():
                mgr.verify(ckpt)  # raises on any problem
            name_a, a = final_state(work / "reference", world)
            name_b, b = final_state(work / "faulted", world)
            differ = [k for k in a if k not in b or not torch.equal(a[k], b[k])]
            la = [r["loss"] for r in read_jsonl(work / "reference" / "metrics.jsonl")]
            lb = [r["loss"] for r in read_jsonl(work / "faulted" / "metrics.jsonl")]
            result.update({"restarts_seen": len(restarts), "checkpoints_verified": len(mgr.complete()),
                           "final": [name_a, name_b], "tensors": len(a), "tensors_different": differ,
                           "losses_equal": la == lb,
                           "resumed_from": [r.get("checkpoint") for r in restarts]})  # fmt: skip
            ok = not differ and la == lb and len(fired) == len(restarts) == args.trials and name_a == name_b
        else:
            result["log_tail"] = log
            ok = False
        result["bit_identical"] = ok
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "async_kill_trials.json").write_text(json.dumps(result, indent=2, default=str))
        print(json.dumps({k: v for k, v in result.items() if k != "log_tail"}, indent=1, default=str))
        print(f"{args.trials} kills during saves, {len(fired)} fired: final state "
              f"{'bit-identical' if ok else 'DIFFERENT or run failed'} (wrote {out / 'async_kill_trials.json'})")  # fmt: skip
        return 0 if ok else 1
    finally:
        if not args.keep_runs:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
