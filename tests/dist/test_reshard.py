"""Resume at another layout (issue 9's acceptance), on real gloo ranks, fp32.

One uninterrupted 10-step run per original layout, checkpointed at step 5, is both the reference and the
source: a copy of its run directory, cut back to step 5 and given a new layout in its recipe, is resumed
(``tessera run --resume`` on a changed recipe). The ranks reshard step 5 into a new step directory,
verify it, and train steps 6-10, which must match the original layout's steps 6-10: step 6 within 1e-5
relative, 7-10 within 1e-4. The resharded Adam moments are compared with the source's through
``tessera verify``'s own comparison: bit-exact.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import (
    REPO,
    assert_close_rel,
    assert_hf_export_replays_the_run,
    hf_loss_on_step,
    losses,
    relayout,
    save_pretrained_tiny,
    train_runs,
)

from tessera.checkpoint.index import read_meta, step_dir_name, verify_checkpoint
from tessera.checkpoint.reshard import layout_tag
from tessera.checkpoint.verify import compare, open_side
from tessera.config.loader import load_recipe
from tessera.rundir import RunDir

pytestmark = pytest.mark.slow

R = REPO / "recipes"
LLAMA = R / "tiny-llama-cpu.yaml"
ORIGINALS = {  # name -> (recipe, overrides): 2 ranks unless "1" in the name
    "ds_z2": (LLAMA, []),
    "ds_z0": (LLAMA, ["parallel.zero=0"]),
    "ddp": (LLAMA, ["parallel.engine=ddp", "parallel.zero=0"]),
    "mc_tp2": (R / "tiny-llama-cpu-mcore-tp2.yaml", []),
    "mc_pp2": (R / "tiny-llama-cpu-mcore-pp2.yaml", []),
    "mc_ep2": (R / "tiny-mixtral-cpu-mcore-ep2.yaml", []),
    "mc_tp1": (LLAMA, ["parallel.engine=megatron", "parallel.zero=0"]),
}
ONE = ["run.world_size=1"]
# name -> (original, the new layout's overrides, world size)
CHANGES = {
    "ds_z2_to_dp1": ("ds_z2", ONE, 1),
    "ds_z2_to_z3": ("ds_z2", ["parallel.zero=3"], 2),
    "mc_tp2_to_tp1": ("mc_tp2", [*ONE, "parallel.tp=1"], 1),
    "mc_pp2_to_pp1": ("mc_pp2", [*ONE, "parallel.pp=1"], 1),
    "mc_tp1_to_tp2": ("mc_tp1", ["run.world_size=2", "parallel.tp=2"], 2),
    "mc_ep2_to_ep1": ("mc_ep2", [*ONE, "parallel.ep=1"], 1),
    "ds_z2_to_mc_tp2": ("ds_z2", ["parallel.engine=megatron", "parallel.tp=2", "parallel.zero=1"], 2),
    "mc_tp2_to_ds_z2": ("mc_tp2", ["parallel.engine=deepspeed", "parallel.tp=1", "parallel.zero=2"], 2),
    "ddp_to_ds_z3": ("ddp", ["parallel.engine=deepspeed", "parallel.zero=3"], 2),
    "ds_z0_to_z2": ("ds_z0", ["parallel.zero=2"], 2),
    "ds_z2_to_mc_tp2_ds": ("ds_z2", ["parallel.engine=megatron", "parallel.tp=2", "parallel.zero=2"], 2),
}
# two held-out global batches (of 256 rows by default): nothing here compares eval losses
EVAL = "data.eval.max_samples=32"
CKPT = ["train.steps=10", "checkpoint.every=5", "checkpoint.keep=3", EVAL]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("reshard")
    out: dict = {"_base": base}

    def batch(specs: dict, world: int) -> None:
        got = train_runs({base / k: v for k, v in specs.items()}, world=world)
        out.update({d.name: rec for d, rec in got.items()})

    hf = save_pretrained_tiny(base / "hf_pretrained")
    two = {k: (rec, [*CKPT, *ov], False) for k, (rec, ov) in ORIGINALS.items() if "1" not in k}
    two["pretrained_z3"] = (LLAMA, [*pretrained(hf), "parallel.zero=3", EVAL], False)
    batch(two, 2)

    def changes(world: int) -> dict:
        for name, (orig, ov, w) in CHANGES.items():
            if w == world:
                relayout(base / orig, base / name, ov, at_step=5)
        return {name: (ORIGINALS[orig][0], [], True) for name, (orig, _, w) in CHANGES.items() if w == world}

    one = {"mc_tp1": (ORIGINALS["mc_tp1"][0], [*CKPT, *ORIGINALS["mc_tp1"][1]], False)}
    batch({**one, **changes(1)}, 1)  # mc_tp1 first: a source of the 2-rank changes
    batch(changes(2), 2)
    batch(
        {"pretrained_tp2_pp2": (R / "tiny-llama-cpu4-mcore-tp2-pp2.yaml", [*pretrained(hf), EVAL], False)}, 4
    )
    out["_hf"] = hf
    return out


def pretrained(hf) -> list[str]:
    return ["train.steps=1", "model.hf_config=null", f"model.path={hf}", "model.pretrained=true"]


@pytest.mark.parametrize("name", sorted(CHANGES))
def test_resume_at_another_layout_continues_the_run(runs, name):
    orig = CHANGES[name][0]
    resumed, full = runs[name], runs[orig]
    assert [r["step"] for r in resumed] == list(range(1, 11))
    assert_close_rel(losses(resumed)[5:6], losses(full)[5:6], 1e-5)
    assert_close_rel(losses(resumed)[6:], losses(full)[6:], 1e-4)
    assert [r["tokens"] for r in resumed] == [r["tokens"] for r in full]  # the sampler continued
    assert [r["lr"] for r in resumed] == [r["lr"] for r in full]  # and the LR schedule


@pytest.mark.parametrize("name", sorted(CHANGES))
def test_resharded_checkpoint_is_verified_and_recorded(runs, name):
    """The manifest records the change and the ranks' verification; ``tessera verify``'s comparison of
    the source step 5 and the resharded one, read back offline: weights, Adam moments (every parameter's,
    bit-exact) and logits; the source checkpoint stays untouched."""
    base = runs["_base"]
    rd = RunDir(base / name)
    manifest = rd.read_manifest()
    rec = manifest["resharded"]
    src = rd.checkpoints / step_dir_name(5)
    new = rd.checkpoints / step_dir_name(5, layout_tag(manifest["layout"]))
    assert rec["to"] == str(new) and rec["from"] == str(src) and manifest["resumed_from"] == str(new)
    assert rec["from_layout"] == layout_tag(read_meta(src)["layout"]) != rec["to_layout"]
    assert rec["verify"]["ok"] and rec["verify"]["moments_equal"]
    native = name.startswith("mc_") and "_to_ds_" not in name and name != "mc_ep2_to_ep1"  # chained optimizer
    assert rec["by"] == ("megatron-core dist_checkpointing" if native else "stage + engine import")
    assert read_meta(new)["layout"] == manifest["layout"] and read_meta(new)["step"] == 5
    report = compare(open_side(src), open_side(new), prompts=2)
    assert report["ok"] and report["weights_ok"] and not report["missing_in_b"]
    assert report["optimizer"] is not None and report["optimizer"]["ok"]
    assert report["optimizer"]["compared"] >= 20  # every trainable parameter of the tiny models
    assert report["logits"]["max_abs_diff"] <= 1e-5
    # the source is the original's step 5, file for file
    assert verify_checkpoint(src)[1] == []
    orig = RunDir(base / CHANGES[name][0]).checkpoints / step_dir_name(5)
    assert json.loads((src / "meta.json").read_text())["files"] == json.loads((orig / "meta.json").read_text())["files"]


def test_same_layout_refuses_a_change(runs, tmp_path):
    """``--resume --same-layout`` keeps the old refusal: exit 2 before launch, naming the field."""
    rd = RunDir(relayout(runs["_base"] / "ds_z2", tmp_path / "z3", ["parallel.zero=3"], at_step=5))
    p = subprocess.run(
        [sys.executable, "-m", "tessera.cli", "run", str(rd.recipe), f"run.out_dir={rd.path}", "--resume",
         "--same-layout"],  # fmt: skip
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2, p.stderr[-2000:]
    assert "parallel.zero" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("name", ["pretrained_z3", "pretrained_tp2_pp2"])
def test_pretrained_first_step_is_the_hf_models_loss(runs, name):
    """``model.pretrained`` from a save_pretrained directory under deepspeed ZeRO-3 and megatron TP2 x PP2:
    the first step's loss is the HF model's own loss on that batch (each megatron rank read only the
    tensors of its stage, lazily). The run took the model directory's tokenizer (data.tokenizer: auto) and
    its manifest says so."""
    from transformers import AutoModelForCausalLM

    from tessera.data.tokenizer import tokenizer_hash_on_disk

    model = AutoModelForCausalLM.from_pretrained(str(runs["_hf"]), local_files_only=True).eval()
    want = hf_loss_on_step(model, runs["_base"] / name, 1)
    assert_close_rel(losses(runs[name]), [want], 1e-5)
    manifest = RunDir(runs["_base"] / name).read_manifest()
    assert manifest["recipe"]["data"]["tokenizer"] == str(runs["_hf"])
    recipe = load_recipe(LLAMA, pretrained(runs["_hf"])).recipe
    own = tokenizer_hash_on_disk(recipe.data, "", root=REPO, cache_dir=REPO / recipe.data.cache_dir)
    assert manifest["tokenizer"] == {"source": "model", "path": str(runs["_hf"]), "sha256": own}


def test_ep2_export_to_hf_reproduces_the_run(runs, tmp_path):
    """`tessera convert --to hf` of megatron EP2's step 5 (the experts of both ranks, the chained
    optimizer's model-space checkpoint): from_pretrained loads it, and its loss on step 6's batch is the
    loss the run logged."""
    report = assert_hf_export_replays_the_run(runs["_base"] / "mc_ep2", 5, tmp_path / "hf", cli=False)
    assert report["sharding"] == "megatron-distributed-optimizer"


def _cli(capsys, *args: str) -> tuple[int, str]:
    """``tessera ARGS`` in this process (a refusal before launch: no fresh interpreter to import the
    libraries again): its exit code and stderr."""
    from tessera.cli import main

    capsys.readouterr()
    code = main(list(args))
    return code, capsys.readouterr().err


def _convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tessera.cli", "convert", *args], cwd=REPO, capture_output=True, text=True, timeout=600
    )


def test_convert_to_an_engine_layout_and_resume_it(runs, tmp_path):
    """`tessera convert STEP5 --to megatron --layout tp=2,zero=0` (the conversion writer: megatron-core's files
    made without the model, weights and Adam moments from the stage) and `--to ddp --layout dp=1` (the
    engine imports the stage): the target layout's ranks write a run directory whose checkpoint verifies
    against the source (moments bit-exact); `tessera run --resume` continues the megatron one: step 6 as
    the original run logged it. From an HF directory (with --recipe) to DeepSpeed ZeRO-2 (the conversion
    writer: DeepSpeed's files made without its engine): step 0, the HF weights bit-exact, no optimizer
    state to compare, the HF model's own loss at the first step of its resume."""
    src = RunDir(runs["_base"] / "ds_z2").checkpoints / step_dir_name(5)
    for to, layout, sharding, by in (
        ("megatron", "tp=2,zero=0", "megatron-ddp", "stage + MegatronWriter (no model in memory)"),
        ("ddp", "dp=1", "torch-ddp", "stage + engine import"),
    ):
        out = tmp_path / to
        p = _convert(str(src), "--to", to, "--layout", layout, "--out", str(out))
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        rec = json.loads((out / "tessera_conversion.json").read_text())
        assert rec["verify"]["ok"] and rec["verify"]["optimizer"]["ok"] and rec["by"] == by
        assert read_meta(out / "checkpoints" / step_dir_name(5))["sharding"] == sharding
    assert not list(tmp_path.glob(".tmp-*"))
    out = tmp_path / "megatron"
    r = subprocess.run(
        [sys.executable, "-m", "tessera.cli", "run", str(out / RunDir.RECIPE), "train.steps=6",
         "tracking.wandb.mode=disabled", "--resume"],  # fmt: skip
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert_close_rel(losses(RunDir(out).read_metrics())[5:6], losses(runs["ds_z2"])[5:6], 1e-5)

    hf_out = tmp_path / "from_hf"
    p = _convert(str(runs["_hf"]), "--to", "deepspeed", "--layout", "zero=2", "--recipe", str(LLAMA), "--out", str(hf_out))  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rec = json.loads((hf_out / "tessera_conversion.json").read_text())
    assert rec["step"] == 0 and rec["verify"]["weights_ok"] and rec["verify"]["optimizer"] is None
    assert read_meta(RunDir(hf_out).checkpoints / step_dir_name(0))["sharding"] == "deepspeed-zero2"
    assert rec["by"] == "stage + ZeroWriter (no model in memory)"
    _assert_resume_starts_at_the_hf_loss(runs["_hf"], hf_out)


def test_hf_to_megatron_is_written_without_the_model_as_the_engine_writes_it(runs, tmp_path):
    """`tessera convert HF --to megatron --layout tp=2` (fp32, megatron's DDP: the conversion writer, which
    holds no weights and makes each tensor as megatron-core's writer reaches it): the checkpoint verifies
    against the HF directory bit for bit, its moments are zeros at step 0, its keys, stored chunks, dtypes
    and common state are those of a checkpoint the engine itself wrote for the same recipe and layout, and
    `tessera run --resume` of it starts from the HF model's own loss."""
    from tessera.engines.megatron_reader import OPTIM_KEY, _read_regions
    from tessera.safeload import dcp_reader_class, safe_torch_load

    out = tmp_path / "mc"
    p = _convert(str(runs["_hf"]), "--to", "megatron", "--layout", "tp=2", "--recipe", str(R / "tiny-llama-cpu-mcore-tp2.yaml"), "--out", str(out))  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rec = json.loads((out / "tessera_conversion.json").read_text())
    assert rec["step"] == 0 and rec["verify"]["ok"] and rec["verify"]["weights_ok"]
    mine = RunDir(out).checkpoints / step_dir_name(0) / "megatron"
    engine = RunDir(runs["_base"] / "mc_tp2").checkpoints / step_dir_name(5) / "megatron"
    ma, mb = (dcp_reader_class()(str(d)).read_metadata() for d in (mine, engine))
    assert set(ma.state_dict_metadata) == set(mb.state_dict_metadata)

    def layout_of(m):
        return (tuple(m.size), m.properties.dtype, sorted((tuple(c.offsets), tuple(c.sizes)) for c in m.chunks))

    moments = 0
    for k, m in ma.state_dict_metadata.items():
        if hasattr(m, "chunks"):
            assert layout_of(m) == layout_of(mb.state_dict_metadata[k]), k
            if (OPTIM_KEY.match(k) or [None, None])[1] in ("exp_avg", "exp_avg_sq"):
                assert not _read_regions(mine, ma, {k: (k, ())})[k].any(), k
                moments += 1
    assert moments >= 8

    def keys(d, pre=""):
        if isinstance(d, dict):
            return {x for k, v in d.items() for x in keys(v, f"{pre}{k}.")}
        return {pre}

    # a trained checkpoint's common state also records the step every parameter shares (none at step 0)
    common = keys(safe_torch_load(engine / "common.pt")) - {"optimizer.state.common_step."}
    assert keys(safe_torch_load(mine / "common.pt")) == common
    _assert_resume_starts_at_the_hf_loss(runs["_hf"], out)


def _assert_resume_starts_at_the_hf_loss(hf, out) -> None:
    """`tessera run --resume` of conversion ``out`` from HF directory ``hf``: its first step's loss is the
    HF model's own on that batch."""
    from transformers import AutoModelForCausalLM

    r = subprocess.run(
        [sys.executable, "-m", "tessera.cli", "run", str(out / RunDir.RECIPE), "train.steps=1",
         "tracking.wandb.mode=disabled", EVAL, "--resume"],  # fmt: skip
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(str(hf), local_files_only=True).eval()
    assert_close_rel(losses(RunDir(out).read_metrics()), [hf_loss_on_step(model, out, 1)], 1e-5)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_convert_refuses_a_damaged_source(runs, tmp_path, capsys, damage):
    """A damaged checkpoint or HF directory: exit 2 naming the file, before any rank starts, and nothing
    at --out."""
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(RunDir(runs["_base"] / "ds_z2").checkpoints / step_dir_name(5), ckpt)
    hf = tmp_path / "hf"
    shutil.copytree(runs["_hf"], hf)
    for victim in (ckpt / "mp_rank_00_model_states.pt", hf / "model.safetensors"):
        if damage == "delete":
            victim.unlink()
        else:
            data = bytearray(victim.read_bytes())
            if damage == "flip":  # safetensors carries no checksum of its data: flip a byte of its header
                data[len(data) // 2 if victim.suffix == ".pt" else 12] ^= 0x01
            victim.write_bytes(bytes(data if damage == "flip" else data[: len(data) // 2]))
    for src, victim in ((ckpt, ckpt / "mp_rank_00_model_states.pt"), (hf, hf / "model.safetensors")):
        out = tmp_path / f"out-{src.name}"
        extra = ["--recipe", str(LLAMA)] if src == hf else []
        args = [str(src), "--to", "deepspeed", "--layout", "zero=3", *extra, "--out", str(out)]
        code, err = _cli(capsys, "convert", *args)
        assert code == 2, (damage, src, err[-2000:])
        assert str(victim) in err and "Traceback" not in err, err[-2000:]
        assert not out.exists() and not list(tmp_path.glob(".tmp-out-*"))
