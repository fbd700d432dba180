"""A fourth engine is one module plus one registry line (issue 31), through the `tessera` command.

A toy engine (``tests/plugins/toy_engine.py``: the ddp engine under the name ``toyddp``, writing the
sharding string ``toy-ddp``, read back by its own reader) is registered by one line
(``tests/plugins/toy_engine_plugin.py``, named in ``TESSERA_ENGINES``). It trains, checkpoints, exports to
HF (whose loss replays the run's next step) and reshards to DeepSpeed ZeRO-2 (verified bit-exact). Any
module outside ``engines/`` and the registry that compares an engine name or a sharding string breaks
one of these steps. Everything runs in fresh processes: the registry is read at import, and this test
process's has no toy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, free_port
from tessera.checkpoint.index import read_meta, step_dir_name
from tessera.rundir import RunDir

pytestmark = pytest.mark.slow

PLUGINS = REPO / "tests" / "plugins"


def _env(log: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["TESSERA_ENGINES"] = "toy_engine_plugin"
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(PLUGINS), str(REPO / "tests"), env.get("PYTHONPATH")) if p
    )
    env["TOY_ENGINE_READER_LOG"] = str(log)
    return env


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    p = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def test_a_toy_fourth_engine_needs_only_its_module_and_registry_line(tmp_path):
    log = tmp_path / "reader.log"
    env = _env(log)
    run = tmp_path / "toy"
    tessera = [sys.executable, "-m", "tessera.cli"]
    _run(
        [
            *tessera,
            "run",
            "recipes/tiny-llama-cpu.yaml",
            "parallel.engine=toyddp",
            "parallel.zero=0",
            f"run.out_dir={run}",
            f"run.master_port={free_port()}",
            "train.steps=3",
            "checkpoint.every=2",
            "tracking.wandb.mode=disabled",
            "data.eval.max_samples=32",
        ],
        env,
    )
    rd = RunDir(run)
    ckpt = rd.checkpoints / step_dir_name(2)
    meta = read_meta(ckpt)
    assert (meta["engine"], meta["sharding"]) == ("toyddp", "toy-ddp")
    assert rd.read_manifest()["layout"]["engine"] == "toyddp"

    # the HF export (read by the toy's reader) replays the run: its loss on step 3's batch is the logged one
    replay = (
        "import sys; from pathlib import Path; from helpers import assert_hf_export_replays_the_run as a; "
        "a(Path(sys.argv[1]), 2, Path(sys.argv[2]))"
    )
    _run([sys.executable, "-c", replay, str(run), str(tmp_path / "hf")], env)

    # resharded to DeepSpeed ZeRO-2 by the target layout's ranks: weights and Adam moments bit-exact
    z2 = tmp_path / "z2"
    _run([*tessera, "convert", str(ckpt), "--to", "deepspeed", "--layout", "zero=2", "--out", str(z2)], env)
    rec = json.loads((z2 / "tessera_conversion.json").read_text())
    assert rec["verify"]["ok"] and rec["verify"]["optimizer"]["ok"], rec["verify"]
    assert rec["by"] == "stage + ZeroWriter (no model in memory)"  # DeepSpeed's files, without its engine
    assert read_meta(RunDir(z2).checkpoints / step_dir_name(2))["sharding"] == "deepspeed-zero2"

    calls = log.read_text().split("\n")
    assert f"weights {ckpt.name}" in calls, calls  # the registry entry's reader, not the ddp engine's
    assert {f"moment:exp_avg {ckpt.name}", f"moment:exp_avg_sq {ckpt.name}"} <= set(calls), calls
