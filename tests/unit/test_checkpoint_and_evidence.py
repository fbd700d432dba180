"""Checkpoint protocol (atomic rename, latest last, keep-N, crash mid-save), manifest, schedule, launcher."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers import PicklePayload, forge_checksum
from tessera.checkpoint.index import LATEST, MANIFEST, read_meta, step_dir_name, verify_or_raise
from tessera.checkpoint.manager import CheckpointManager, rng_file_name
from tessera.errors import CheckpointError, RecipeError, TrainingDiverged
from tessera.rundir import RunDir
from tessera.tensorfile import load_tensors, save_tensors


class TensorFileEngine:
    """The smallest engine that honours the save / load part of the protocol: one safetensors file per
    rank holding one parameter, plus an optimizer moment."""

    def __init__(self, value: float, fail_on_save: bool = False):
        self.model = torch.nn.Linear(2, 2, bias=False)
        with torch.no_grad():
            self.model.weight.fill_(value)
        self.moment = torch.full((2, 2), float(value))
        self.fail_on_save = fail_on_save

    def modules(self):
        return [self.model]

    def optimizer_tensors(self):
        yield "moment", self.moment

    def save(self, path: Path) -> None:
        save_tensors(path / "shard_rank0.safetensors", {"w": self.model.weight, "m": self.moment})
        if self.fail_on_save:
            raise RuntimeError("disk full (simulated crash mid-save)")

    def load(self, path: Path) -> None:
        t = load_tensors(path / "shard_rank0.safetensors")
        with torch.no_grad():
            self.model.weight.copy_(t["w"])
        self.moment = t["m"]


DESCRIBE = {
    "engine": "test",
    "sharding": "none",
    "layout": {"dp": 1},
    "precision": "fp32",
    "model_config": {},
    "tokenizer_hash": "t",
}


def _mgr(tmp_path, keep=2, world_size=1):
    return CheckpointManager(tmp_path / RunDir.CHECKPOINTS, keep=keep, rank=0, world_size=world_size)


def _save(m, step, engine):
    return m.save(step, engine, describe=DESCRIBE, sampler={"consumed_samples": step}, manifest={"m": step})


def test_save_rename_latest_and_keep(tmp_path):
    m = _mgr(tmp_path)
    for step in (1, 2, 3):
        _save(m, step, TensorFileEngine(step))
    names = sorted(p.name for p in (tmp_path / RunDir.CHECKPOINTS).iterdir())
    assert names == [LATEST, step_dir_name(2), step_dir_name(3)]
    assert m.latest().name == "step_000003"
    meta = m.verify(m.latest())
    assert meta["format_version"] == 2 and meta["step"] == 3 and meta["engine"] == "test"
    assert meta["sampler"] == {"consumed_samples": 3} and meta["layout"] == {"dp": 1}
    listed = {f["path"]: f for f in meta["files"]}
    assert set(listed) == {"shard_rank0.safetensors", MANIFEST, rng_file_name(0)}
    for path, f in listed.items():
        assert f["bytes"] == (m.latest() / path).stat().st_size and len(f["blake3"]) == 64
    e = TensorFileEngine(0)
    torch.manual_seed(0)
    assert m.load(m.latest(), meta, e) == {"consumed_samples": 3}
    assert torch.equal(e.model.weight, torch.full((2, 2), 3.0))


def test_a_checkpoint_recording_sha256_is_verified_by_it(tmp_path):
    """Checkpoints written before BLAKE3 record sha256: they verify, and an altered file is named."""
    import hashlib

    m = _mgr(tmp_path)
    p = _save(m, 1, TensorFileEngine(1))
    meta = json.loads((p / "meta.json").read_text())
    for f in meta["files"]:
        del f["blake3"]
        f["sha256"] = hashlib.sha256((p / f["path"]).read_bytes()).hexdigest()
    (p / "meta.json").write_text(json.dumps(meta))
    assert m.verify(p)["step"] == 1
    shard = p / "shard_rank0.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"sha256 does not match meta\.json") as e:
        m.verify(p)
    assert e.value.value == str(shard)


def test_checksums_deferred_to_the_load_still_refuse_a_damaged_file(tmp_path):
    """A resume's verification leaves the checksums to a thread (the model is built and the engine loads
    meanwhile): the load waits for them, and a flipped byte in a data file is refused naming the file
    after the engine's load, before anything trains; a load that fails on the damaged file reports the
    checksum, not its own error; an undamaged checkpoint loads as before."""
    m = _mgr(tmp_path)
    p = _save(m, 1, TensorFileEngine(1))
    meta = m.verify(p, defer_checksums=True)
    assert m.load(p, meta, TensorFileEngine(0)) == {"consumed_samples": 1}
    shard = p / "shard_rank0.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # the last tensor's data: the file still parses
    shard.write_bytes(bytes(data))
    meta = m.verify(p, defer_checksums=True)  # no problem seen yet: the checksum is running
    with pytest.raises(CheckpointError, match=r"blake3 does not match meta\.json") as e:
        m.load(p, meta, TensorFileEngine(0))
    assert e.value.value == str(shard)

    class Failing(TensorFileEngine):
        def load(self, path):
            raise RuntimeError("unreadable (the damaged bytes)")

    meta = m.verify(p, defer_checksums=True)
    with pytest.raises(CheckpointError, match="blake3 does not match") as e:
        m.load(p, meta, Failing(0))
    assert e.value.value == str(shard)
    with pytest.raises(CheckpointError, match="blake3 does not match"):
        m.verify(p)  # not deferred: refused at once, as before


def test_rng_state_round_trips_without_pickle(tmp_path):
    import random

    import numpy as np

    m = _mgr(tmp_path)
    torch.manual_seed(5)
    np.random.seed(6)
    random.seed(7)
    np.random.standard_normal()  # numpy holds a cached gaussian now
    p = _save(m, 1, TensorFileEngine(1))
    want = (torch.rand(4), np.random.rand(4), random.random(), np.random.standard_normal())
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    m.load(p, m.verify(p), TensorFileEngine(0))
    got = (torch.rand(4), np.random.rand(4), random.random(), np.random.standard_normal())
    assert torch.equal(want[0], got[0]) and (want[1] == got[1]).all() and want[2:] == got[2:]


def test_crash_mid_save_keeps_the_last_good_checkpoint(tmp_path):
    m = _mgr(tmp_path)
    _save(m, 5, TensorFileEngine(5))
    with pytest.raises(RuntimeError, match="simulated"):
        _save(m, 10, TensorFileEngine(10, fail_on_save=True))
    assert m.latest().name == "step_000005"
    assert not (tmp_path / RunDir.CHECKPOINTS / "step_000010").exists()
    _save(m, 10, TensorFileEngine(10))  # the next save clears the stray tmp
    assert not list((tmp_path / RunDir.CHECKPOINTS).glob(".tmp-*"))
    assert m.latest().name == "step_000010"


def test_non_finite_state_is_never_saved(tmp_path):
    m = _mgr(tmp_path)
    _save(m, 1, TensorFileEngine(1))
    for poison in ("param", "moment"):
        e = TensorFileEngine(2)
        with torch.no_grad():
            (e.model.weight if poison == "param" else e.moment)[0, 1] = float(
                "nan" if poison == "param" else "inf"
            )
        with pytest.raises(TrainingDiverged, match="non-finite"):
            _save(m, 2, e)
        assert (
            m.latest().name == "step_000001" and not (tmp_path / RunDir.CHECKPOINTS / "step_000002").exists()
        )


def _each_file_damaged(tmp_path, how):
    """A fresh checkpoint per file, that file damaged ``how``; yields (checkpoint, damaged file)."""
    src = _save(_mgr(tmp_path / "src"), 1, TensorFileEngine(1))
    for rel in [f["path"] for f in read_meta(src)["files"]]:
        case = tmp_path / f"{how}-{rel}"
        shutil.copytree(src, case)
        f = case / rel
        data = bytearray(f.read_bytes())
        if how == "flip":
            data[len(data) // 2] ^= 0x01  # same size, one bit
            f.write_bytes(bytes(data))
        elif how == "truncate":
            f.write_bytes(bytes(data[:-1]))
        else:
            f.unlink()
        yield case, f


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_every_damaged_file_is_named_before_anything_loads(tmp_path, how):
    n = 0
    for case, damaged in _each_file_damaged(tmp_path, how):
        with pytest.raises(CheckpointError) as e:
            verify_or_raise(case)
        assert e.value.value == str(damaged), e.value.render()
        assert "fix:" in e.value.render()
        n += 1
    assert n == 3


def test_unlisted_and_escaping_files_are_refused(tmp_path):
    p = _save(_mgr(tmp_path), 1, TensorFileEngine(1))
    (p / "extra.pt").write_bytes(b"not listed")
    with pytest.raises(CheckpointError, match="not listed"):
        verify_or_raise(p)
    (p / "extra.pt").unlink()
    meta = json.loads((p / "meta.json").read_text())
    meta["files"][0]["path"] = "../../etc/passwd"
    (p / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="valid relative path"):
        verify_or_raise(p)


GARBAGE = {"random": bytes(range(256)) * 3, "empty-object": b"{}", "empty": b""}


@pytest.mark.parametrize("kind", sorted(GARBAGE))
def test_garbage_meta_latest_and_state_files_name_the_file(tmp_path, kind):
    m = _mgr(tmp_path)
    p = _save(m, 1, TensorFileEngine(1))
    good = {f: (p / f).read_bytes() for f in ("meta.json", "rng_rank00000.safetensors")}
    (p / "meta.json").write_bytes(GARBAGE[kind])
    with pytest.raises(CheckpointError) as e:
        m.verify(p)
    assert e.value.value == str(p / "meta.json")
    (p / "meta.json").write_bytes(good["meta.json"])
    ptr = tmp_path / RunDir.CHECKPOINTS / "latest"
    ptr.write_bytes(GARBAGE[kind])
    with pytest.raises(CheckpointError) as e:
        m.latest()
    assert e.value.value == str(ptr)
    ptr.write_text("step_000001\n")
    # a state file with garbage of the same size passes no checksum; with a forged checksum the loader refuses it
    state = p / "rng_rank00000.safetensors"
    state.write_bytes(GARBAGE[kind])
    with pytest.raises(CheckpointError) as e:
        m.verify(p)
    assert e.value.value == str(state)
    meta = _forge(p, "rng_rank00000.safetensors")
    with pytest.raises(CheckpointError) as e:
        m.load(p, meta, TensorFileEngine(0))
    assert e.value.value == str(state)


def _forge(p: Path, rel: str) -> dict:
    """meta.json rewritten so that ``rel`` matches it again, then verified."""
    forge_checksum(p, rel)
    return verify_or_raise(p)


def test_a_pickle_in_place_of_the_rng_file_never_runs(tmp_path):
    import pickle

    m = _mgr(tmp_path)
    p = _save(m, 1, TensorFileEngine(1))
    marker = tmp_path / "pwned"
    (p / "rng_rank00000.safetensors").write_bytes(pickle.dumps(PicklePayload(marker)))
    with pytest.raises(CheckpointError, match=r"blake3|bytes"):
        m.verify(p)  # refused by its checksum
    meta = _forge(p, "rng_rank00000.safetensors")  # and with the checksum forged to match
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        m.load(p, meta, TensorFileEngine(0))
    assert not marker.exists()


def test_v1_checkpoint_still_resumes_with_a_warning(tmp_path, capsys):
    """The predecessor's layout: meta.json without checksums, client_state, pickled RNG state (read with
    weights_only=True)."""
    import random

    import numpy as np

    p = tmp_path / RunDir.CHECKPOINTS / "step_000004"
    p.mkdir(parents=True)
    TensorFileEngine(4).save(p)
    torch.manual_seed(3)
    rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    torch.save(rng, p / "rng_rank00000.pt")
    want = torch.rand(3)
    files = sorted(x.name for x in p.iterdir())
    meta = {
        "step": 4,
        "world_size": 1,
        "client_state": {"step": 4, "sampler": {"consumed_samples": 64}},
        "files": [{"path": f, "bytes": (p / f).stat().st_size} for f in files],
    }
    (p / "meta.json").write_text(json.dumps(meta))
    m = _mgr(tmp_path)
    assert m.latest() == p
    got = m.verify(p)
    assert "carries no checksums" in capsys.readouterr().err
    e = TensorFileEngine(0)
    assert m.load(p, got, e) == {"consumed_samples": 64}
    assert torch.equal(torch.rand(3), want) and torch.equal(e.model.weight, torch.full((2, 2), 4.0))
    (p / "rng_rank00000.pt").write_bytes((p / "rng_rank00000.pt").read_bytes()[:-1])
    with pytest.raises(CheckpointError, match="truncated"):
        m.verify(p)


def test_world_size_mismatch_is_refused(tmp_path):
    p = _save(_mgr(tmp_path), 1, TensorFileEngine(1))
    with pytest.raises(CheckpointError, match="written by 1 ranks"):
        _mgr(tmp_path, world_size=4).verify(p)


def test_manifest_capture_and_diff():
    from tessera.evidence.manifest import capture_manifest, diff_manifests, grouped_diff

    m, _ = capture_manifest(
        recipe={"a": 1},
        recipe_hash="h",
        layout={"dp": 2},
        data_fingerprint={"content_hash": "c"},
        tokenizer_hash="t",
        launcher_command="deepspeed ...",
        world_size=2,
        seed=1,
        device="cpu",
    )
    assert m["versions"]["torch"].startswith("2.13") and m["versions"]["python"].startswith("3.11")
    assert m["hardware"]["cpu_cores"] >= 1 and m["hardware"]["memory_bytes"] > 0
    assert set(m["git"]) == {"commit", "dirty", "diff_sha256"}
    assert m["packages"]["torch"] == m["versions"]["torch"] and len(m["packages"]) > 50  # the full list
    assert m["topology"]["ranks"] == 2 and m["topology"]["nodes"] == 1
    m2 = json.loads(json.dumps(m))
    m2["layout"]["dp"] = 4
    m2["launcher_command"] = "other"
    m2["hardware"]["hostname"] = "elsewhere"
    assert diff_manifests(m, m2) == [("layout.dp", 2, 4)]
    m2["packages"]["torch"] = "2.99"
    assert grouped_diff(m, m2) == {
        "config": [("layout.dp", 2, 4)],
        "environment": [("packages.torch", m["packages"]["torch"], "2.99")],
    }


def test_manifest_environment_redacts_secrets(monkeypatch):
    """Numerics / communication variables are recorded; anything named like a secret keeps its name and
    loses its value."""
    from tessera.evidence.manifest import REDACTED, capture_manifest

    secrets = {
        "WANDB_API_KEY": "wk-123456",
        "HF_TOKEN": "hf_abcdef",
        "DB_PASSWORD": "hunter2",
        "NCCL_SECRET": "x9",
    }
    for k, v in {**secrets, "NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "3", "HOME_DIR": "/h"}.items():
        monkeypatch.setenv(k, v)
    m, _ = capture_manifest(recipe={}, recipe_hash="h", layout={}, data_fingerprint={}, tokenizer_hash="t",
                            launcher_command=None, world_size=1, seed=1, device="cpu")  # fmt: skip
    env = m["environment"]
    assert env["NCCL_DEBUG"] == "INFO" and env["OMP_NUM_THREADS"] == "3" and "HOME_DIR" not in env
    assert all(env[k] == REDACTED for k in secrets)
    text = json.dumps(m)
    assert not any(v in text for v in secrets.values())


def test_lr_schedule_warmup_cosine():
    from tessera.config.schema import OptimSection
    from tessera.engines.optim import lr_factor

    o = OptimSection(lr=1.0, min_lr=0.1, warmup_steps=4, schedule="cosine")
    f = [lr_factor(s, optim=o, total_steps=14) for s in range(14)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert (
        f[4] == 1.0
        and f[9] == pytest.approx(0.55)
        and f[13] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(torch.pi * 0.9)).item()))
    )
    assert all(a >= b for a, b in itertools.pairwise(f[4:]))


def test_hostfile_parsing(tmp_path):
    from tessera.launch.modes import parse_hostfile

    hf = tmp_path / "h"
    hf.write_text("# nodes\nnode1 slots=8\nnode2 slots=8  # second\n\n")
    assert parse_hostfile(str(hf)) == [("node1", 8), ("node2", 8)]
    hf.write_text("node1 8\n")
    with pytest.raises(RecipeError, match="line 1"):
        parse_hostfile(str(hf))


@pytest.mark.parametrize("kind", sorted(GARBAGE))
def test_cli_resume_names_the_garbage_file_without_a_traceback(tmp_path, kind, capsys):
    """`tessera run --resume` on a run directory whose meta.json, latest or a state file holds garbage:
    exit 2 naming the file, and no traceback (the check runs before anything launches)."""
    from helpers import DEFAULT_RECIPE
    from tessera.cli import main

    for place in ("meta.json", "latest", "state"):
        run = tmp_path / place
        m = CheckpointManager(RunDir(run).checkpoints, keep=2, rank=0, world_size=1)
        p = _save(m, 1, TensorFileEngine(1))
        target = {"meta.json": p / "meta.json", "latest": RunDir(run).checkpoints / LATEST}.get(
            place, p / "shard_rank0.safetensors"
        )
        target.write_bytes(GARBAGE[kind])
        rc = main(["run", str(DEFAULT_RECIPE), f"run.out_dir={run}", "run.world_size=1", "--resume"])
        err = capsys.readouterr().err
        assert rc == 2, (place, err)
        assert str(target) in err and "fix:" in err and "Traceback" not in err, (place, err)
        assert not RunDir(run).logs.exists()  # nothing launched


def test_convert_refuses_a_damaged_source_and_a_used_output(tmp_path):
    """`tessera convert` verifies the source first (a flipped byte is named, nothing is written) and
    never writes into a non-empty --out."""
    from tessera.checkpoint.convert import convert_to_hf

    p = _save(_mgr(tmp_path), 1, TensorFileEngine(1))
    data = bytearray((p / "shard_rank0.safetensors").read_bytes())
    data[-3] ^= 0x01
    (p / "shard_rank0.safetensors").write_bytes(bytes(data))
    out = tmp_path / "hf"
    with pytest.raises(CheckpointError) as e:
        convert_to_hf(tmp_path, out)  # a run directory means its latest checkpoint
    assert e.value.value == str(p / "shard_rank0.safetensors") and not out.exists()
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(RecipeError, match="not an empty directory"):
        convert_to_hf(p, out)
    assert (out / "keep.txt").read_text() == "mine"


def test_first_nonfinite_finds_nan_and_inf_but_not_large_finite_values():
    """The fast path (a finite sum) never hides a bad value, and a sum that overflows is not one."""
    from tessera.engines.base import first_nonfinite

    big = torch.full((10,), 3e38)  # finite, but its fp32 sum overflows to inf
    assert first_nonfinite([("big", big), ("ok", torch.ones(4, dtype=torch.bfloat16))]) is None
    for bad in (float("nan"), float("inf"), float("-inf")):
        t = torch.randn(1000)
        t[777] = bad
        assert first_nonfinite([("fine", torch.zeros(3)), ("t", t)]) == "t"
    pair = torch.tensor([float("inf"), float("-inf")])  # sums to NaN: still found
    assert first_nonfinite([("pair", pair), ("ints", torch.arange(3))]) == "pair"


@pytest.mark.parametrize("block", [None, 4096])
@pytest.mark.parametrize("recipe", ["recipes/tiny-llama-cpu.yaml", "recipes/tiny-mixtral-cpu.yaml"])
def test_the_logits_check_streams_the_sides_tensors_module_by_module(recipe, block, monkeypatch):
    """verify's model of a side holds no weights: each module's are read from the side's tensors as it
    runs (accelerate's offload hooks; the embedding and the LM head a block of rows at a time, here also
    in blocks of 4 KiB: many per tensor) and dropped after, each tensor read once per pass, and the logits
    are the source model's, bit for bit (a dense and an MoE family); a state that leaves a parameter
    without a value falls back to the copying path (None here)."""
    from transformers import AutoModelForCausalLM

    import tessera.checkpoint.verify as verify
    from tessera.checkpoint.verify import Side, _streamed

    if block is not None:
        monkeypatch.setattr(verify, "BLOCK_BYTES", block)
    from tessera.config.loader import load_recipe
    from tessera.models.hf import load_hf_config

    r = load_recipe(recipe).recipe
    cfg = load_hf_config(r.model, vocab_size=r.data.vocab_size)
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(cfg).float().eval()
    state = {k: v.clone() for k, v in source.state_dict().items()}
    reads: dict[str, int] = {}

    class Counting(dict):
        def __getitem__(self, k):
            reads[k] = reads.get(k, 0) + 1
            return super().__getitem__(k)

    model = _streamed(Side("a", "checkpoint", cfg, Counting(state), None, None), torch.float32)
    assert model is not None
    assert all(p.is_meta for p in model.parameters())  # no weights of its own
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, source(input_ids=ids).logits)
    assert all(p.is_meta for p in model.parameters())  # dropped after use
    assert type(model.get_output_embeddings()).__name__ == "_RowsHead"
    assert type(model.get_input_embeddings()).__name__ == "_RowsEmbedding"
    read_for_weights = {k for k in state if "rotary" not in k}
    assert set(reads) == read_for_weights and set(reads.values()) == {1}
    partial = {k: v for k, v in state.items() if k != "model.layers.0.self_attn.o_proj.weight"}
    assert _streamed(Side("a", "checkpoint", cfg, partial, None, None), torch.float32) is None
