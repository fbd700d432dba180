"""Untrusted checkpoints (issue 38, items 1, 2 and 7): no pickle runs code even with forged checksums, even
when the static scan is bypassed; FIFOs and links in a checkpoint are refused before anything is opened;
meta.json is validated by its schema. One process, tiny files; the real DeepSpeed and megatron
checkpoints are in tests/dist (``assert_no_code_runs``)."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import time
from pathlib import Path

import pytest
import torch

from helpers import DEFAULT_RECIPE, PicklePayload, forge_checksum
from tessera.checkpoint.index import verify_or_raise
from tessera.checkpoint.manager import CheckpointManager
from tessera.cli import main
from tessera.errors import CheckpointError
from tessera.rundir import RunDir
from tessera.safeload import (
    ALLOWED,
    RestrictedUnpickler,
    file_problem,
    forced_weights_only,
    pickle_globals,
    safe_torch_load,
    scan_pickles,
)
from tessera.tensorfile import load_tensors, save_tensors
from untrusted import deadline, plant


class _Engine:
    """The smallest engine of the checkpoint protocol: one safetensors file, plus one torch ``.pt`` file
    holding tensors (as DeepSpeed's do), so that a pickle-bearing file is part of the checkpoint."""

    def __init__(self, value: float) -> None:
        self.model = torch.nn.Linear(2, 2, bias=False)
        with torch.no_grad():
            self.model.weight.fill_(value)

    def modules(self):
        return [self.model]

    def optimizer_tensors(self):
        return iter(())

    def save(self, path: Path) -> None:
        save_tensors(path / "shard_rank0.safetensors", {"w": self.model.weight})
        torch.save({"module": {"w": self.model.weight.detach()}}, path / "mp_rank_00_model_states.pt")

    def load(self, path: Path) -> None:
        with torch.no_grad():
            self.model.weight.copy_(load_tensors(path / "shard_rank0.safetensors")["w"])


DESCRIBE = {"engine": "test", "sharding": "none", "layout": {"dp": 1}, "precision": "fp32",
            "model_config": {"model_type": "llama"}, "tokenizer_hash": "t"}  # fmt: skip


def _ckpt(run: Path, step: int = 1) -> Path:
    m = CheckpointManager(RunDir(run).checkpoints, keep=2, rank=0, world_size=1)
    return m.save(step, _Engine(step), describe=DESCRIBE, sampler={"consumed_samples": step}, manifest={})


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    with deadline(60):
        rc = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return rc, err


# ---- item 1: no pickle runs -------------------------------------------------------------------------------


def test_the_static_scan_names_every_global_without_unpickling(tmp_path):
    marker = tmp_path / "ran"
    assert pickle_globals(io.BytesIO(pickle.dumps(PicklePayload(marker)))) == [
        "pathlib.Path.touch",
        "pathlib.PosixPath",
    ]
    # a STACK_GLOBAL whose module and name come from the memo, as pickle writes repeated strings
    data = pickle.dumps([PicklePayload(marker), PicklePayload(marker)], protocol=4)
    assert set(pickle_globals(io.BytesIO(data))) == {"pathlib.Path.touch", "pathlib.PosixPath"}
    # a name built at load time (not a string read from the file) is reported as such
    built = b"\x80\x04)\x940\x8c\x02osh\x00\x93."  # STACK_GLOBAL("os", a memoized tuple)
    assert "<a global computed at load time>" in pickle_globals(io.BytesIO(built))
    f = tmp_path / "x.pt"
    plant(f, "torch-zip", marker)
    assert "pathlib.Path" in file_problem(tmp_path, "x.pt") and not marker.exists()
    torch.save({"w": torch.ones(2), "n": torch.Size([2])}, f)
    assert file_problem(tmp_path, "x.pt") is None
    with pytest.raises(CheckpointError) as e:
        plant(f, "pickle", marker)
        scan_pickles(tmp_path, ["x.pt"])
    assert e.value.value == str(f) and "pathlib.Path.touch" in e.value.message and not marker.exists()


@pytest.mark.parametrize("how", ["pickle", "torch-zip"])
def test_safe_torch_load_refuses_a_payload_naming_the_file_and_class(tmp_path, how):
    marker, f = tmp_path / "ran", tmp_path / "optim_states.pt"
    plant(f, how, marker)
    with pytest.raises(CheckpointError) as e:
        safe_torch_load(f, map_location="cpu")
    assert e.value.value == str(f) and "pathlib.Path" in e.value.message and "allow-list" in e.value.message
    assert not marker.exists()
    torch.save({"w": torch.arange(3.0)}, f)  # a plain tensor file loads
    assert torch.equal(safe_torch_load(f)["w"], torch.arange(3.0))


def test_deepspeeds_checkpoint_engine_is_replaced_by_a_safe_one(tmp_path):
    """The payload does not run through DeepSpeed's own loading even when the static scan is bypassed:
    the engine's checkpoint engine (what load_checkpoint reads every .pt through) loads weights-only;
    zero_to_fp32's own torch.load(weights_only=False) is forced weights-only."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.utils import zero_to_fp32

    from tessera.engines.zero import _load_safely

    class Engine:
        checkpoint_engine = TorchCheckpointEngine()

    engine = Engine()
    _load_safely(engine)
    assert isinstance(engine.checkpoint_engine, TorchCheckpointEngine)
    assert type(engine.checkpoint_engine) is not TorchCheckpointEngine
    marker = tmp_path / "ran"
    for how in ("pickle", "torch-zip"):
        f = tmp_path / f"{how}_optim_states.pt"
        plant(f, how, marker)
        with pytest.raises(CheckpointError, match=r"pathlib\.Path") as e:
            engine.checkpoint_engine.load(str(f), map_location="cpu")
        assert e.value.value == str(f)
        with pytest.raises(CheckpointError, match=r"pathlib\.Path"), forced_weights_only(f):
            zero_to_fp32.parse_model_states([str(f)])
    assert not marker.exists()
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ  # the switch is scoped


def test_distributed_checkpoint_metadata_resolves_only_its_own_classes(tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(CheckpointError, match=r"pathlib\.Path\.touch"):
        RestrictedUnpickler(io.BytesIO(pickle.dumps(PicklePayload(marker)))).load()
    assert not marker.exists()
    assert "torch.distributed.checkpoint.metadata.Metadata" in RestrictedUnpickler(io.BytesIO()).names
    assert not any(n.startswith(("os.", "builtins.eval", "pathlib.")) for n in ALLOWED)


def test_a_payload_with_a_forged_checksum_is_refused_by_every_command(tmp_path, capsys):
    """`verify`, `convert` and `run --resume` on a checkpoint whose .pt file is a payload pickle with
    its checksum forged: exit 2 naming the file and the class before anything loads; the payload never
    runs. (The same on real ZeRO-2 / ZeRO-3 / megatron checkpoints: tests/dist.)"""
    run = tmp_path / "run"
    ckpt = _ckpt(run)
    marker = tmp_path / "ran"
    rel = "mp_rank_00_model_states.pt"
    for how in ("pickle", "torch-zip"):
        plant(ckpt / rel, how, marker)
        forge_checksum(ckpt, rel)
        for argv in (
            ["verify", str(ckpt), str(ckpt)],
            ["convert", str(ckpt), "--to", "hf", "--out", str(tmp_path / "hf")],
            ["run", str(DEFAULT_RECIPE), f"run.out_dir={run}", "run.world_size=1", "--resume"],
        ):
            rc, err = _cli(argv, capsys)
            assert rc == 2 and str(ckpt / rel) in err and "pathlib.Path" in err, err
    assert not marker.exists() and not RunDir(run).logs.exists()


# ---- item 2: non-regular files ----------------------------------------------------------------------------


def test_a_fifo_in_a_checkpoint_is_refused_before_anything_opens_it(tmp_path, capsys):
    """An unlisted FIFO named like a DeepSpeed shard, and a FIFO in place of a listed file or of meta.json:
    verify and convert return 2 at once naming it (opening it would block forever)."""
    ckpt = _ckpt(tmp_path / "run")
    for name in ("zero_pp_rank_2_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt", "meta.json"):
        case = tmp_path / f"case-{name}"
        shutil.copytree(ckpt, case)
        (case / name).unlink(missing_ok=True)
        os.mkfifo(case / name)
        t = time.monotonic()
        for argv in (
            ["verify", str(case), str(case)],
            ["convert", str(case), "--to", "hf", "--out", str(tmp_path / "o")],
        ):
            rc, err = _cli(argv, capsys)
            assert rc == 2 and str(case / name) in err and "FIFO" in err, err
        assert time.monotonic() - t < 30


def test_links_in_a_checkpoint_are_refused(tmp_path):
    """A listed file replaced by a link to a copy outside the checkpoint (same bytes, so its checksum
    matches), a linked directory, and a link inside pointing inside: all refused, naming the link."""
    ckpt = _ckpt(tmp_path / "run")
    outside = tmp_path / "outside"
    outside.mkdir()
    rel = "mp_rank_00_model_states.pt"
    shutil.copy(ckpt / rel, outside / rel)
    cases = {
        rel: lambda c: ((c / rel).unlink(), (c / rel).symlink_to(outside / rel)),
        "sub": lambda c: (c / "sub").symlink_to(outside, target_is_directory=True),
        "alias.pt": lambda c: (c / "alias.pt").symlink_to(c / rel),
    }
    for name, make in cases.items():
        case = tmp_path / f"case-{name}"
        shutil.copytree(ckpt, case)
        make(case)
        with pytest.raises(CheckpointError) as e:
            verify_or_raise(case)
        assert e.value.value == str(case / name) and "symbolic link" in e.value.message, e.value.render()


# ---- item 7: meta.json's schema ---------------------------------------------------------------------------

META_CASES = {
    "step=-5": ({"step": -5}, 'field "step" = -5: input should be greater than or equal to 0'),
    "step=six": ({"step": "six"}, "field \"step\" = 'six': input should be a valid integer"),
    "step=true": ({"step": True}, 'field "step" = True: input should be a valid integer'),
    "format_version=99": ({"format_version": 99}, "written by a newer Tessera (checkpoint format 99"),
    "format_version='2'": ({"format_version": "2"}, "not a checkpoint format Tessera knows"),
    "world_size=0": ({"world_size": 0}, 'field "world_size" = 0: input should be greater than or equal to 1'),
    "no step": ({"step": None}, "meta.json lacks step"),
    "layout.tp=0": ({"layout": {"tp": 0}}, 'field "layout.tp" = 0'),
    "sampler.epoch=-1": ({"sampler": {"epoch": -1}}, 'field "sampler.epoch" = -1'),
    "files=str": ({"files": "x"}, 'field "files" ='),
    "bytes=-1": ({"files.0.bytes": -1}, 'field "files.0.bytes" = -1'),
    "blake3=short": ({"files.0.blake3": "abc"}, 'field "files.0.blake3"'),
    "two checksums": ({"files.0.sha256": "0" * 64}, "must carry exactly one checksum, blake3 or sha256"),
    "path=..": ({"files.0.path": "../x"}, "not a valid relative path"),
}


@pytest.mark.parametrize("case", sorted(META_CASES))
def test_meta_json_is_validated_by_its_schema(tmp_path, capsys, case):
    """Each bad meta.json: `tessera run --resume` exits 2 before launch naming meta.json and the field
    (step -5 used to resume and train at a negative learning rate; "six" gave a traceback)."""
    run = tmp_path / "run"
    ckpt = _ckpt(run)
    meta = json.loads((ckpt / "meta.json").read_text())
    change, words = META_CASES[case]
    for key, value in change.items():
        if key.startswith("files.0."):
            meta["files"][0][key.split(".")[-1]] = value
        elif value is None:
            del meta[key]
        else:
            meta[key] = value
    (ckpt / "meta.json").write_text(json.dumps(meta))
    rc, err = _cli(["run", str(DEFAULT_RECIPE), f"run.out_dir={run}", "run.world_size=1", "--resume"], capsys)
    assert rc == 2 and str(ckpt / "meta.json") in err and words in err, err
    assert not RunDir(run).logs.exists()


def test_megatrons_loads_are_safe_without_the_scan(tmp_path):
    """megatron-core's common.pt load and the distributed checkpoint's .metadata read, through the
    strategies the megatron engine hands dist_checkpointing.load: a payload is refused naming the file."""
    from tessera.engines.megatron_engine import safe_load_strategies
    from tessera.safeload import dcp_reader_class

    sharded, common = safe_load_strategies()
    marker = tmp_path / "ran"
    for how in ("pickle", "torch-zip"):
        plant(tmp_path / "common.pt", how, marker)
        with pytest.raises(CheckpointError, match=r"pathlib\.Path") as e:
            common.load_common(tmp_path)
        assert e.value.value == str(tmp_path / "common.pt")
    (tmp_path / ".metadata").write_bytes(pickle.dumps(PicklePayload(marker)))
    with pytest.raises(CheckpointError, match=r"pathlib\.Path\.touch"):
        dcp_reader_class()(str(tmp_path)).read_metadata()
    with pytest.raises(CheckpointError, match=r"pathlib\.Path\.touch"):
        sharded.load_tensors_metadata(tmp_path)
    assert not marker.exists()
