"""``tessera slurm R.yaml --nodes N``: the sbatch script of a multi-node run, written and submitted (or
printed with ``--dry-run``).

The script asks for one task per node and runs ``srun tessera run R.yaml`` in it: every node's
``tessera run`` reads its node rank, the node list and the job id from SLURM's variables
(:mod:`tessera.launch.modes`), node 0's supervises the others (:mod:`tessera.launch.agent`), and restarts
happen inside the allocation. ``--signal=TERM@S`` makes SLURM send SIGTERM ``S`` seconds before the time
limit: every ``tessera run`` then asks its ranks to checkpoint the current step (``run.preempt_grace_s``
plus a minute), so ``--resume`` in the next job continues where this one stopped.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from tessera.errors import RecipeError
from tessera.launch.modes import ranks_per_node
from tessera.rundir import RunDir


def sbatch_script(
    recipe_path: str,
    overrides: list[str],
    *,
    nodes: int,
    recipe: object,
    run_dir: Path,
    workdir: Path,
    tessera: list[str],
    partition: str | None = None,
    time: str | None = None,
    account: str | None = None,
    qos: str | None = None,
    gpus_per_node: int | None = None,
    cpus_per_task: int | None = None,
    job_name: str | None = None,
    resume: bool = False,
) -> str:
    """The script's text; ``tessera``: how to call tessera on the nodes (this installation's)."""
    r = recipe.run  # type: ignore[attr-defined]
    if nodes < 2:
        raise RecipeError(
            "a SLURM script is for two nodes or more",
            field="--nodes",
            value=nodes,
            fix="--nodes 2 or more (one node: srun tessera run R.yaml, or tessera run inside salloc)",
        )
    per_node = ranks_per_node(r.world_size, nodes, "--nodes")[0]
    if gpus_per_node is None and r.device != "cpu":
        gpus_per_node = per_node
    grace = int(r.preempt_grace_s) + 60
    opts = [
        ("job-name", job_name or r.name or Path(recipe_path).stem),
        ("nodes", nodes),
        ("ntasks-per-node", 1),
        ("gpus-per-node", gpus_per_node),
        ("cpus-per-task", cpus_per_task),
        ("partition", partition),
        ("time", time),
        ("account", account),
        ("qos", qos),
        ("output", RunDir(run_dir).logs / "slurm-%j.out"),
        ("signal", f"TERM@{grace}"),
    ]
    run = shlex.join([*tessera, "run", recipe_path, *overrides, *(["--resume"] if resume else [])])
    lines = [
        "#!/bin/bash",
        f"# {r.world_size} ranks on {nodes} nodes x {per_node}; written by tessera slurm, submit with sbatch",
        *(f"#SBATCH --{k}={v}" for k, v in opts if v is not None),
        "set -euo pipefail",
        f"cd {shlex.quote(str(workdir))}",
        "# one tessera run per node: node ranks, node list and rendezvous port come from SLURM's variables;",
        "# node 0's supervises every node, restarts (run.restarts) stay inside this allocation",
        f"srun --ntasks-per-node=1 --kill-on-bad-exit=0 {run}",
        "",
    ]
    return "\n".join(lines)


def slurm_command(args: argparse.Namespace) -> int:
    """``tessera slurm``: check the recipe, write ``<run dir>/tessera.sbatch``, submit it with sbatch."""
    from tessera.launch.runs import _tessera_command, check_recipe, run_dir_of

    resolved, _ = check_recipe(args.recipe, args.overrides, here=False)  # the login node has no GPU
    recipe = resolved.recipe
    run_dir = run_dir_of(recipe, args.recipe).resolve()
    script = sbatch_script(
        args.recipe,
        args.overrides,
        nodes=args.nodes,
        recipe=recipe,
        run_dir=run_dir,
        workdir=Path.cwd().resolve(),
        tessera=_tessera_command(),
        partition=args.partition,
        time=args.time,
        account=args.account,
        qos=args.qos,
        gpus_per_node=args.gpus_per_node,
        cpus_per_task=args.cpus_per_task,
        job_name=args.job_name,
        resume=args.resume,
    )
    if args.dry_run:
        sys.stdout.write(script)
        return 0
    from tessera.atomic import write_text_atomic

    path = run_dir / RunDir.SBATCH
    RunDir(run_dir).logs.mkdir(parents=True, exist_ok=True)  # SLURM does not create --output's directory
    write_text_atomic(path, script)
    print(f"wrote {path}")
    if shutil.which("sbatch") is None:
        raise RecipeError(
            "sbatch is not on PATH: this machine is not a SLURM login node",
            field="tessera slurm",
            value=str(path),
            fix=f"copy the run directory to the cluster and run `sbatch {path}` there, or use --dry-run",
        )
    done = subprocess.run(["sbatch", str(path)], capture_output=True, text=True)
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    return done.returncode
