"""Checkpoint writes: hashed while written, in the background from a snapshot, committed by rank 0 only
when every rank's marker is in (two "ranks" in one process share the directory, as ranks share a file
system); a writer's failure leaves the previous ``latest``."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import blake3
import pytest
import torch
from safetensors.torch import load_file, save_file

from tessera.checkpoint.index import LATEST, step_dir_name
from tessera.checkpoint.manager import CheckpointManager
from tessera.errors import CheckpointError
from tessera.rundir import RunDir
from tessera.tensorfile import save_tensors, write_safetensors
from tessera.writes import HashingFile, Writes, collecting, snapshot, write_hashed

DESCRIBE = {"engine": "test", "sharding": "none", "layout": {"dp": 2}, "precision": "fp32",
            "model_config": {}, "tokenizer_hash": "t"}  # fmt: skip


def sha(path: Path) -> str:
    """The checkpoint checksum (BLAKE3) of a file's bytes, by the reference package in one call."""
    return blake3.blake3(path.read_bytes()).hexdigest()


class RankEngine:
    """One parameter per rank in ``shard_rankR.safetensors``; ``gate`` holds the background writer of
    that rank until it is set (a slow disk), ``fail`` makes its write fail."""

    saves_in_background = True

    def __init__(self, rank: int, value: float, *, gate: threading.Event | None = None, fail: bool = False):
        self.rank, self.gate, self.fail = rank, gate, fail
        self.w = torch.nn.Parameter(torch.full((64, 64), float(value)))

    def modules(self):
        m = torch.nn.Module()
        m.w = self.w
        return [m]

    def optimizer_tensors(self):
        return iter(())

    def save(self, path: Path) -> None:
        save_tensors(path / f"shard_rank{self.rank}.safetensors", {"w": self.w})
        from tessera.writes import current

        writes = current()
        if self.gate is not None or self.fail:

            def slow(progress):
                if self.gate is not None:
                    assert self.gate.wait(30)
                if self.fail:
                    raise OSError(28, "No space left on device")
                return {}

            writes.add_task(slow)


def managers(tmp_path: Path, background: bool) -> list[CheckpointManager]:
    root = tmp_path / RunDir.CHECKPOINTS
    return [CheckpointManager(root, keep=2, rank=r, world_size=2, background=background) for r in (0, 1)]


def save(m: CheckpointManager, step: int, engine: RankEngine) -> Path:
    return m.save(step, engine, describe=DESCRIBE, sampler={"step": step}, manifest={"step": step})


def test_streamed_safetensors_and_torch_save_are_hashed_in_one_pass(tmp_path):
    tensors = {"a": torch.randn(3, 5), "bf": torch.randn(7, dtype=torch.bfloat16), "scalar": torch.tensor(3),
               "empty": torch.empty(0, 4), "mask": torch.tensor([True, False])}  # fmt: skip
    digest, size = write_hashed(
        tmp_path / "s.safetensors", lambda f: write_safetensors(f, tensors, {"k": "v"})
    )
    assert (digest, size) == (sha(tmp_path / "s.safetensors"), (tmp_path / "s.safetensors").stat().st_size)
    back = load_file(tmp_path / "s.safetensors")  # the safetensors package reads what was streamed
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)
    save_file(tensors, tmp_path / "ref.safetensors", metadata={"k": "v"})
    assert all(torch.equal(load_file(tmp_path / "ref.safetensors")[k], back[k]) for k in tensors)
    state = {"m": {"x": torch.arange(10)}, "l": [torch.ones(2), 3], "s": "text"}
    digest, size = write_hashed(tmp_path / "o.pt", lambda f: torch.save(state, f))
    assert digest == sha(tmp_path / "o.pt")
    assert torch.equal(torch.load(tmp_path / "o.pt")["m"]["x"], torch.arange(10))
    with pytest.raises(FileExistsError):  # a new file only: never over (or through) what is there
        HashingFile(tmp_path / "o.pt")


def test_snapshot_copies_tensors_and_keeps_containers():
    t = torch.zeros(4)
    state = {"a": t, "b": [t, (t, 1)], "c": "x"}
    copy = snapshot(state)
    t.add_(1)
    assert torch.equal(copy["a"], torch.zeros(4)) and torch.equal(copy["b"][1][0], torch.zeros(4))
    assert copy["b"][1][1] == 1 and copy["c"] == "x" and type(copy["b"][1]) is tuple
    shapes = {"shape": torch.Size([2, 3]), "groups": [[torch.Size([4])]]}  # ZeRO-3's param_shapes
    kept = snapshot(shapes)
    assert kept is shapes and type(kept["groups"][0][0]) is torch.Size  # nothing to copy: as it was


def test_background_save_writes_the_snapshot_and_moves_latest_last(tmp_path):
    sync = managers(tmp_path / "sync", background=False)
    # synchronous: rank 0's commit waits for rank 1's marker, so rank 0 saves from a thread here
    t = threading.Thread(target=save, args=(sync[0], 2, RankEngine(0, 2.0)))
    t.start()
    tmp = tmp_path / "sync" / RunDir.CHECKPOINTS / f".tmp-{step_dir_name(2)}"
    while not tmp.is_dir():  # rank 0 makes the directory; the barrier between them is a no-op here
        t.join(0.01)
    save(sync[1], 2, RankEngine(1, 2.0))
    t.join(30)
    want = sync[0].verify(sync[0].latest())

    bg = managers(tmp_path / "bg", background=True)
    gate = threading.Event()
    engines = [RankEngine(0, 2.0), RankEngine(1, 2.0, gate=gate)]
    save(bg[0], 1, RankEngine(0, 1.0))
    save(bg[1], 1, RankEngine(1, 1.0))
    bg[0].finish()
    bg[1].finish()
    assert bg[0].latest().name == step_dir_name(1)
    path = save(bg[0], 2, engines[0])
    save(bg[1], 2, engines[1])
    for e in engines:  # the steps go on: the checkpoint keeps the state of step 2
        with torch.no_grad():
            e.w.add_(100.0)
    assert bg[0].pending is not None and not bg[0].pending.writes.done()  # rank 1 is still writing
    assert (tmp_path / "bg" / RunDir.CHECKPOINTS / LATEST).read_text().strip() == step_dir_name(1)
    assert not path.exists()
    gate.set()
    bg[1].finish()
    bg[0].finish()
    got = bg[0].verify(bg[0].latest())
    assert bg[0].latest() == path
    assert {f["path"]: f["blake3"] for f in got["files"] if "shard" in f["path"]} == {
        f["path"]: f["blake3"] for f in want["files"] if "shard" in f["path"]
    }
    assert not list(path.glob(".done-*"))  # the markers are not part of the checkpoint


def test_a_failed_background_write_leaves_the_previous_latest(tmp_path):
    m = managers(tmp_path, background=True)
    for r in (0, 1):
        save(m[r], 1, RankEngine(r, 1.0))
    for r in (0, 1):
        m[r].finish()
    save(m[0], 2, RankEngine(0, 2.0))
    save(m[1], 2, RankEngine(1, 2.0, fail=True))
    with pytest.raises(OSError, match="No space"):
        m[1].finish()  # the failing rank raises its own error
    with pytest.raises(CheckpointError, match="rank 1 could not write its part of the checkpoint of step 2"):
        m[0].finish()  # rank 0 learns it from rank 1's marker and does not commit
    assert m[0].latest().name == step_dir_name(1)
    m[0].verify(m[0].latest())


def test_writes_in_line_raise_at_once(tmp_path):
    writes = Writes(tmp_path, background=False)
    with collecting(writes):
        save_tensors(tmp_path / "x.safetensors", {"w": torch.ones(3)})
    assert writes.results["x.safetensors"][0] == sha(tmp_path / "x.safetensors")
    save_tensors(tmp_path / "y.safetensors", {"w": torch.ones(3)})  # outside a save: safetensors' own
    assert torch.equal(load_file(tmp_path / "y.safetensors")["w"], torch.ones(3))


def test_verification_shares_the_files_out_by_bytes():
    from tessera.checkpoint.index import share_by_bytes

    sizes = [("a", 900), ("b", 500), ("c", 400), ("d", 100), ("e", 10)]
    shares = share_by_bytes(sizes, 2)
    assert shares == [{"a", "d"}, {"b", "c", "e"}]  # 1000 and 910 bytes (round robin: 1310 and 600)
    assert share_by_bytes(sizes, 1) == [{n for n, _ in sizes}]


def _mapped(path: Path) -> bool:
    return str(path) in Path("/proc/self/maps").read_text()


def test_moments_loaded_mapped_are_copied_into_memory_and_release_the_file(tmp_path):
    """DeepSpeed's loads go through Tessera's checkpoint engine, which maps the file; an optimizer that
    keeps the moments it loaded (torch's ``load_state_dict`` keeps same-device tensors) would map the
    checkpoint for the rest of the run. ``into_memory`` copies them in place: same objects, same values,
    and the file (pruned here) is no longer mapped."""
    from tessera.engines.zero import safe_checkpoint_engine_class
    from tessera.safeload import into_memory

    w = torch.nn.Parameter(torch.randn(256, 256))
    opt = torch.optim.AdamW([w], foreach=False)
    w.grad = torch.randn_like(w)
    opt.step()
    f = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer": opt.state_dict()}, f)
    want = {k: v.clone() for k, v in opt.state[w].items()}

    fresh = torch.optim.AdamW([w], foreach=False)
    engine = safe_checkpoint_engine_class().__new__(safe_checkpoint_engine_class())
    fresh.load_state_dict(engine.load(str(f), map_location="cpu")["optimizer"])
    assert _mapped(f)  # the loaded moments are the file's pages
    held = fresh.state[w]["exp_avg"]
    f.unlink()  # pruned: its blocks stay allocated while mapped
    copied = into_memory(fresh.state)
    assert copied == 2 * w.numel() * 4 + 4  # exp_avg, exp_avg_sq and the step count
    assert fresh.state[w]["exp_avg"] is held
    assert not _mapped(f)  # nor as "<path> (deleted)": the unlinked file's blocks are free
    for k, v in want.items():
        assert torch.equal(fresh.state[w][k], v), k
    assert into_memory(fresh.state) == 0  # nothing is mapped any more


def test_moments_land_in_the_memory_of_the_state_the_load_replaced(tmp_path):
    """A resume's engine already holds moments (DeepSpeed makes them at construction): ``into_memory``
    copies the mapped moments into those tensors (pages in memory already) instead of new memory, each
    spare used once and only for its own shape and dtype. DeepSpeed's identity ``map_location`` (its model
    states load) maps too, as a device or nothing does."""
    from tessera.engines.zero import safe_checkpoint_engine_class
    from tessera.safeload import into_memory

    w, b = torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(32))
    opt = torch.optim.AdamW([w, b], foreach=False)
    w.grad, b.grad = torch.randn_like(w), torch.randn_like(b)
    opt.step()
    f = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer": opt.state_dict()}, f)
    want = {(i, k): v.clone() for i, p in enumerate((w, b)) for k, v in opt.state[p].items()}

    fresh = torch.optim.AdamW([w, b], foreach=False)
    w.grad, b.grad = torch.zeros_like(w), torch.zeros_like(b)
    fresh.step()  # the engine's own moments, as at construction
    spares = [v for st in fresh.state.values() for v in st.values() if v.dim()]
    where = {id(t): t.data_ptr() for t in spares}
    engine = safe_checkpoint_engine_class().__new__(safe_checkpoint_engine_class())
    fresh.load_state_dict(engine.load(str(f), map_location=lambda storage, loc: storage)["optimizer"])
    assert _mapped(f)
    into_memory(fresh.state, reuse=spares)
    assert not _mapped(f)
    ptrs = {fresh.state[p][k].data_ptr() for p in (w, b) for k in ("exp_avg", "exp_avg_sq")}
    assert ptrs == set(where.values())  # every moment in a spare's memory, each spare once
    for i, p in enumerate((w, b)):
        for k in ("exp_avg", "exp_avg_sq"):
            assert fresh.state[p][k].shape == p.shape
            assert torch.equal(fresh.state[p][k], want[i, k]), (i, k)


def test_hashes_taken_beside_the_io_equal_the_reference_digests_at_every_size(tmp_path):
    """Reads and writes of 1 MiB and more are hashed on a helper thread while the I/O goes on (chunk
    borders, a last partial chunk, the empty file): the same digest as the reference over the whole
    bytes, BLAKE3 (written, and read on every core) and sha256 (read)."""
    from tessera.atomic import _CHUNK, checksum_file, sha256_file

    rng = torch.Generator().manual_seed(0)
    for size in (0, 1, _CHUNK - 1, _CHUNK, _CHUNK + 1, 3 * _CHUNK + 5):
        data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=rng).numpy().tobytes()
        f = tmp_path / f"f{size}"
        pieces = [data[i : i + (3 << 19)] for i in range(0, size, 3 << 19)]  # 1.5 MiB writes, then the rest
        digest, n = write_hashed(f, lambda out, pieces=pieces: [out.write(p) for p in pieces])
        assert n == size and f.read_bytes() == data, size
        assert digest == checksum_file(f) == blake3.blake3(data).hexdigest(), size
        assert sha256_file(f) == hashlib.sha256(data).hexdigest(), size
