"""The README's quick start, run as written.

Each ```bash block of README.md's "## Quick start" section comes right after an HTML comment
``<!-- quickstart: NAME -->``. Blocks whose comment says "(not run" are not executed: ``make setup`` /
``make test`` / ``make demo`` (this test runs inside the venv ``make setup`` made, and ``make test`` is the
suite itself), the GPU install, and the line a user edits to point at their own paths. Every other block
runs in order, verbatim, with ``bash`` (``set -euo pipefail``), as if typed into one shell in the
repository root:

- the working directory is a scratch directory holding copies of the checkout's ``recipes/`` and
  ``configs/`` (what the blocks' relative paths and a recipe's ``include:`` resolve against), so the files
  the blocks write (``finetune.yaml``, ``runs/``, ``hf-finetune/``, ``.cache/``) land there, not in the
  checkout;
- the venv's ``bin/`` comes first on PATH (what ``source .venv/bin/activate`` does) and
  ``DS_ACCELERATOR=cpu``;
- the variables a block exports (``MODEL_DIR``, ``DATA``) reach the blocks after it, as in one shell.

Nothing in a block is substituted. The quick start's tiny model, 20 steps and 2 CPU ranks are what make
it cheap: one fine-tune, one export and verification, one comparison (3 runs of 20 steps: the baseline's
two seeds and the candidate), one plan. The blocks launch ranks; run this file under
``flock /tmp/tessera-heavy.lock`` beside other rank-launching tests on a small machine.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import REPO
from tessera.checkpoint.index import LATEST, step_dir_name
from tessera.rundir import RunDir

README = REPO / "README.md"
MARKER = re.compile(
    r"<!-- quickstart: (?P<name>[\w-]+)(?P<note>[^>]*)-->\s*\n```bash\n(?P<body>.*?)\n```", re.S
)
#: the quick start's blocks in order, and those the test does not run
BLOCKS = ["setup", "gpu", "own-paths", "tiny-model", "finetune", "export", "compare", "plan"]
NOT_RUN = {"setup", "gpu", "own-paths"}
BLOCK_TIMEOUT_S = 900


@dataclass
class Block:
    name: str
    body: str
    run: bool


@dataclass
class Outcome:
    returncode: int
    stdout: str
    stderr: str
    env: dict[str, str]
    seconds: float

    def why(self) -> str:
        return f"exit {self.returncode}\n--- stdout\n{self.stdout[-4000:]}\n--- stderr\n{self.stderr[-4000:]}"


def quickstart_blocks(text: str) -> list[Block]:
    """The fenced bash blocks of the "## Quick start" section with their markers; a bash block there
    without a marker is an error (it would go untested)."""
    section = text.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    blocks = [Block(m["name"], m["body"], "(not run" not in m["note"]) for m in MARKER.finditer(section)]
    fences = section.count("```bash\n")
    assert fences == len(blocks), f"{fences} bash blocks in the quick start, {len(blocks)} with a marker"
    return blocks


def test_every_quick_start_block_is_marked_and_known():
    blocks = quickstart_blocks(README.read_text())
    assert [b.name for b in blocks] == BLOCKS
    assert {b.name for b in blocks if not b.run} == NOT_RUN
    setup = next(b for b in blocks if b.name == "setup").body
    # .ci/run runs `make test`: the README's test command
    assert [ln.split("#")[0].strip() for ln in setup.splitlines()][:3] == [
        "make setup",
        "make test",
        "make demo",
    ]


def _run_block(block: Block, cwd: Path, env: dict[str, str]) -> Outcome:
    env_file = cwd / f".env-after-{block.name}"
    script = f"set -euo pipefail\n{block.body}\nenv -0 > {env_file}\n"
    t0 = time.monotonic()
    p = subprocess.run(
        ["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S
    )
    after = dict(env)
    if p.returncode == 0:
        after = dict(kv.split("=", 1) for kv in env_file.read_text().split("\0") if "=" in kv)
    return Outcome(p.returncode, p.stdout, p.stderr, after, time.monotonic() - t0)


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory) -> tuple[Path, dict[str, Outcome]]:
    """Run the quick start's blocks in order; stop at the first that fails (the later ones need it)."""
    work = tmp_path_factory.mktemp("quickstart")
    for d in ("recipes", "configs"):
        shutil.copytree(REPO / d, work / d)
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL_DIR", "DATA")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["DS_ACCELERATOR"] = "cpu"
    env.setdefault("WANDB_SILENT", "true")
    out: dict[str, Outcome] = {}
    for block in quickstart_blocks(README.read_text()):
        if not block.run:
            continue
        out[block.name] = _run_block(block, work, env)
        env = out[block.name].env
        if out[block.name].returncode != 0:
            break
    print("quick start blocks, seconds:", {name: round(o.seconds, 1) for name, o in out.items()})
    return work, out


def _outcome(quickstart, name: str) -> tuple[Path, Outcome]:
    work, out = quickstart
    if name not in out:
        pytest.fail(f"block {name!r} did not run: an earlier block failed")
    assert out[name].returncode == 0, out[name].why()
    return work, out[name]


@pytest.mark.slow
def test_tiny_model_block_makes_a_pretrained_dir_and_jsonl(quickstart):
    from transformers import AutoConfig, AutoTokenizer

    work, o = _outcome(quickstart, "tiny-model")
    model_dir, data = Path(o.env["MODEL_DIR"]), Path(o.env["DATA"])
    assert model_dir == work / "tiny-llama" and data == work / "tiny-data.jsonl"
    config, tok = AutoConfig.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    assert (config.model_type, config.vocab_size, config.num_hidden_layers) == ("llama", 512, 2)
    assert len(tok) == 512 and tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|pad|>"
    assert (config.eos_token_id, config.pad_token_id) == (tok.eos_token_id, tok.pad_token_id) == (0, 1)
    assert (model_dir / "model.safetensors").is_file()
    rows = [json.loads(ln) for ln in data.read_text().splitlines()]
    assert len(rows) == 60 and all(set(r) == {"text"} and r["text"].strip() for r in rows)


@pytest.mark.slow
def test_finetune_block_trains_the_pretrained_model_on_the_jsonl(quickstart):
    work, o = _outcome(quickstart, "finetune")
    model_dir = Path(quickstart[1]["tiny-model"].env["MODEL_DIR"])
    # the dry run came first and printed the layout of the recipe's layers (ZeRO-2 on 2 CPU ranks)
    dry = o.stdout.split("\nlaunch ", 1)[0]
    assert "zero=2" in dry and "dp=2" in dry and "global_batch=16" in dry
    assert "1 file(s) (jsonl)" in dry  # it read a sample of the data
    rd = RunDir(work / "runs" / "finetune")
    metrics = rd.read_metrics()
    assert [r["step"] for r in metrics] == list(range(1, 21))
    assert all(math.isfinite(r["loss"]) for r in metrics)
    assert [r["step"] for r in metrics if "eval_loss" in r] == [10, 20]
    assert (rd.checkpoints / LATEST).read_text().strip() == step_dir_name(20)
    m = rd.read_manifest()
    assert m["initial_weights"]["from"] == "files" and Path(m["initial_weights"]["path"]) == model_dir
    assert m["data"]["source"] == "files" and [Path(f["path"]) for f in m["data"]["files"]] == [
        work / "tiny-data.jsonl"
    ]
    assert m["data"]["num_docs"] == 60 and m["data"]["eval"]["num_docs"] == 3  # 5 % of 60 held out


@pytest.mark.slow
def test_finetune_block_uses_the_models_own_tokenizer(quickstart):
    """With model.pretrained the tokenizer is the model directory's: the manifest's tokenizer hash is
    the hash of that directory's tokenizer files (not a BPE trained on the corpus)."""
    from tessera.config.schema import DataSection
    from tessera.data.tokenizer import tokenizer_hash_on_disk

    work, _ = _outcome(quickstart, "finetune")
    model_dir = quickstart[1]["tiny-model"].env["MODEL_DIR"]
    own = tokenizer_hash_on_disk(
        DataSection(tokenizer=model_dir), "", root=work, cache_dir=work / ".cache" / "tessera"
    )
    assert own is not None
    assert RunDir(work / "runs" / "finetune").read_manifest()["tokenizer_hash"] == own


@pytest.mark.slow
def test_export_block_writes_a_verified_hf_dir_that_transformers_loads(quickstart):
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    work, o = _outcome(quickstart, "export")
    hf = work / "hf-finetune"
    # convert verified before keeping it, and the verify command passed on its own
    assert o.stdout.count("PASS") == 2, o.stdout[-3000:]
    config, tok = AutoConfig.from_pretrained(hf), AutoTokenizer.from_pretrained(hf)
    assert (config.model_type, config.vocab_size) == ("llama", 512)
    gen = GenerationConfig.from_pretrained(hf)
    # the special tokens of the tokenizer the run used, in config and generation config
    assert config.eos_token_id == gen.eos_token_id == tok.eos_token_id
    assert config.pad_token_id == gen.pad_token_id == tok.pad_token_id
    # after verify's PASS, the snippet prints the prompt and its greedy continuation
    assert o.stdout.rsplit("PASS\n", 1)[1].startswith("def main(")


@pytest.mark.slow
def test_compare_block_judges_the_recipe_against_ddp(quickstart):
    work, o = _outcome(quickstart, "compare")
    out = work / "runs" / "finetune-vs-ddp"
    v = json.loads((out / "verdict.json").read_text())
    assert v["verdict"] == "PASS" and "VERDICT: PASS" in o.stdout
    assert [c["threshold_name"] for c in v["checks"]] == ["loss_tolerance"]
    layouts = {n: RunDir(out / n).read_manifest()["layout"] for n in
               ("baseline-seed1234", "baseline-seed1235", "candidate-seed1234")}  # fmt: skip
    assert {n: (la["engine"], la["zero"], la["dp"]) for n, la in layouts.items()} == {
        "baseline-seed1234": ("ddp", 0, 2),
        "baseline-seed1235": ("ddp", 0, 2),
        "candidate-seed1234": ("deepspeed", 2, 2),
    }
    assert (out / "report.md").is_file()


@pytest.mark.slow
def test_plan_block_prints_a_chosen_layout_for_16_h100s(quickstart):
    _, o = _outcome(quickstart, "plan")
    assert "finetune.yaml on 16 x h100-sxm-80g" in o.stdout
    chosen = next(ln for ln in o.stdout.splitlines() if ln.startswith("chosen "))
    assert "world=16" in chosen and "global_batch=256" in chosen


def test_the_supported_table_is_what_the_registries_say():
    """README's family x engine table is the one tessera.tables.support generates from the family table,
    the engine registry and the tiny configs: a family, an adapter or a capability added without it (or a
    hand edit of the table) fails here."""
    from tessera.tables.families import FAMILIES
    from tessera.tables.support import BEGIN, END, block

    text = (REPO / "README.md").read_text()
    written = text[text.index(BEGIN) : text.index(END) + len(END)]
    assert written == block(REPO), "regenerate it: python -m tessera.tables.support README.md"
    rows = {line.split(" | ")[0].lstrip("| ").split(" (")[0] for line in written.splitlines()[3:-1]}
    assert rows == {*FAMILIES, "any other causal LM"}
