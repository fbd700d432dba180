"""An export to HF in bounded memory: megatron's stored chunks read in place, the HF files written tensor by
tensor exactly as save_pretrained writes them."""

from __future__ import annotations

import io
import json

import pytest
import torch


def _dcp(tmp_path, tensors):
    """A hand-made dist-checkpoint directory: ``tensors`` is {key: (global tensor, [(offsets, stored)])},
    each stored chunk a torch.save archive appended to one .distcp file, as torch's writer lays them."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    data, sd_md, storage = bytearray(), {}, {}
    for key, (full, chunks) in tensors.items():
        metas = []
        for offsets, stored in chunks:
            buf = io.BytesIO()
            torch.save(stored, buf)
            storage[MetadataIndex(key, torch.Size(offsets))] = _StorageInfo(
                "__0_0.distcp", len(data), len(buf.getvalue())
            )
            data += buf.getvalue()
            metas.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(stored.shape)))
        sd_md[key] = TensorStorageMetadata(TensorProperties(dtype=full.dtype), full.shape, metas)
    (tmp_path / "__0_0.distcp").write_bytes(bytes(data))
    return Metadata(state_dict_metadata=sd_md, storage_data=storage)


def test_stored_chunks_are_read_in_place_where_contiguous_and_copied_otherwise(tmp_path, monkeypatch):
    """A layer of a stacked tensor saved per layer and per TP rank: row halves (column-parallel) go
    straight from the file into the destination, no tensor of their own; column halves (row-parallel),
    and a chunk saved as a view of a larger tensor, are loaded and copied. Every result is the global
    tensor's entries, bit for bit."""
    import tessera.engines.megatron_reader as mr

    full = torch.randn(2, 6, 4, generator=torch.Generator().manual_seed(0))
    col = [((i, 3 * r, 0), full[i : i + 1, 3 * r : 3 * r + 3].clone()) for i in range(2) for r in range(2)]
    row = [
        ((i, 0, 2 * c), full[i : i + 1, :, 2 * c : 2 * c + 2].contiguous())
        for i in range(2)
        for c in range(2)
    ]
    big = full.clone()
    view = [((i, 0, 0), big[i : i + 1]) for i in range(2)]  # torch.save keeps the whole storage of a view
    md = _dcp(tmp_path, {"col": (full, col), "row": (full, row), "view": (full, view)})
    loads: list[str] = []
    real = mr.safe_torch_load

    def counting(f, **kw):
        loads.append(str(kw.get("map_location")))
        return real(f, **kw)

    monkeypatch.setattr(mr, "safe_torch_load", counting)
    got = mr._read_regions(tmp_path, md, {"c0": ("col", (0,)), "c1": ("col", (1,)), "all": ("col", ())})
    assert (
        torch.equal(got["c0"], full[0]) and torch.equal(got["c1"], full[1]) and torch.equal(got["all"], full)
    )
    assert loads and set(loads) == {"meta"}  # only the archives' pickles: the data went in place
    loads.clear()
    got = mr._read_regions(tmp_path, md, {"r1": ("row", (1,)), "v0": ("view", (0,))})
    assert torch.equal(got["r1"], full[1]) and torch.equal(got["v0"], full[0])
    assert loads.count("cpu") == 3  # two column halves, one view: each loaded, then copied
    # a range of rows alone (an embedding's block): from one TP half, and across both, still in place
    loads.clear()
    for lo, hi in ((1, 3), (2, 5), (0, 6), (4, 4)):
        got = mr._read_regions(tmp_path, md, {"p": ("col", (1,))}, rows={"p": (lo, hi)})
        assert torch.equal(got["p"], full[1, lo:hi])
    assert set(loads) == {"meta"}
    got = mr._read_regions(tmp_path, md, {"p": ("row", (0,))}, rows={"p": (1, 4)})
    assert torch.equal(got["p"], full[0, 1:4])  # rows of column halves: loaded and copied, still exact


def test_byte_span_is_the_one_run_of_bytes_a_region_covers():
    """Where a region of a C-contiguous tensor is one run of its bytes, its first byte and length; None
    where it is not."""
    from tessera.engines.megatron_reader import _byte_span

    shape = torch.Size((2, 6, 4))
    t = torch.arange(48).reshape(shape)
    for offsets, lengths in (((0, 0, 0), (2, 6, 4)), ((1, 2, 0), (1, 3, 4)), ((1, 0, 0), (1, 6, 4)),
                             ((0, 5, 1), (1, 1, 2)), ((1, 3, 0), (1, 0, 4))):  # fmt: skip
        start, n = _byte_span(shape, offsets, lengths, 8)  # type: ignore[misc]
        region = t[tuple(slice(o, o + n_) for o, n_ in zip(offsets, lengths, strict=True))]
        assert torch.equal(t.reshape(-1)[start // 8 : (start + n) // 8], region.reshape(-1))
    for offsets, lengths in (((0, 0, 0), (2, 3, 4)), ((0, 1, 0), (1, 2, 2))):
        assert _byte_span(shape, offsets, lengths, 8) is None


@pytest.mark.parametrize(
    ("shard", "dtype"), [("5GB", torch.float32), ("300KB", torch.float32), ("5GB", torch.bfloat16)]
)
def test_write_pretrained_writes_what_save_pretrained_writes(tmp_path, shard, dtype):
    """The export's writer, from a model with no weights and a mapping read tensor by tensor, writes the
    files save_pretrained writes: the same names, config.json / generation_config.json byte for byte, the
    same index (sharded), every tensor equal (fp32, and bf16: the dtype config.json records); each tensor
    asked for once, in the model's order."""
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from tessera.checkpoint.convert import write_pretrained

    cfg = AutoConfig.for_model(
        "llama", hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    model.save_pretrained(tmp_path / "ref", safe_serialization=True, max_shard_size=shard)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    asked: list[str] = []

    class Lazy(dict):
        def __getitem__(self, k):
            asked.append(k)
            return super().__getitem__(k)

    with init_empty_weights():
        empty = AutoModelForCausalLM.from_config(cfg).to(dtype)
    write_pretrained(empty, tmp_path / "ours", Lazy(state), max_shard_size=shard)
    ref, ours = tmp_path / "ref", tmp_path / "ours"
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in ref.iterdir())
    for name in ("config.json", "generation_config.json"):
        assert (ours / name).read_bytes() == (ref / name).read_bytes(), name
    if shard != "5GB":
        assert json.loads((ours / "model.safetensors.index.json").read_text()) == json.loads(
            (ref / "model.safetensors.index.json").read_text()
        )
    for f in sorted(ref.glob("*.safetensors")):
        with safe_open(str(f), "pt") as a, safe_open(str(ours / f.name), "pt") as b:
            assert sorted(a.keys()) == sorted(b.keys()) and b.metadata() == a.metadata() == {"format": "pt"}
            for k in a.keys():  # noqa: SIM118
                assert torch.equal(a.get_tensor(k), b.get_tensor(k)), k
    assert asked == [k for k in model.state_dict() if k in state]


def test_lazy_safetensors_reads_tensors_and_row_ranges_with_memory_of_their_own(tmp_path):
    """An HF directory's tensors read by hand: every tensor, and every range of rows, equals what
    safetensors reads (float, bf16, integer, 0-dim, empty); a tensor owns its memory (no view of a
    mapping of the file); shapes and dtypes come from the header and ``in`` reads nothing; a column part
    still goes through safetensors; a file cut short after its header is an error naming it."""
    from safetensors.torch import load_file, save_file

    from tessera.errors import CheckpointError
    from tessera.tensorfile import LazyTensors

    g = torch.Generator().manual_seed(0)
    tensors = {
        "w": torch.randn(7, 5, generator=g),
        "h": torch.randn(6, 3, generator=g).bfloat16(),
        "i": torch.arange(12, dtype=torch.int64).reshape(4, 3),
        "s": torch.tensor(2.5),
        "e": torch.zeros(0, 4),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    want = load_file(str(tmp_path / "model.safetensors"))
    lazy = LazyTensors.of_dir(tmp_path)
    reads = []
    real = lazy._rows
    lazy._rows = lambda *a: reads.append(a) or real(*a)  # type: ignore[method-assign]
    assert "w" in lazy and "nope" not in lazy and not reads
    assert {k: (tuple(s), d) for k, (s, d) in lazy.shapes().items()} == {
        k: (tuple(t.shape), t.dtype) for k, t in want.items()
    }
    for k, t in want.items():
        got = lazy[k]
        assert torch.equal(got, t) and got.dtype == t.dtype
        assert got.untyped_storage().nbytes() == t.numel() * t.element_size()
        for lo, hi in ((0, 1), (1, 3), (2, 100)) if t.dim() else ():
            assert torch.equal(lazy.part(k, (slice(lo, hi),)), t[lo:hi])
    assert torch.equal(lazy.part("w", (slice(None), slice(1, 3))), want["w"][:, 1:3])
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-8])
    with pytest.raises(CheckpointError, match="not a readable safetensors") as e:
        for k in want:  # the last tensor in the file lost its end
            lazy[k]
    assert e.value.value == str(tmp_path / "model.safetensors")


def test_the_writers_zeros_take_no_memory_until_written(tmp_path):
    """AdamW's initial moments as the HF -> megatron writer makes them: zeros of the shape and dtype,
    saved and loaded as zeros, and read without growing the process's anonymous memory (64 MiB read:
    under 4 MiB more); writing into them works like any tensor's."""
    from tessera.hostmem import zeros

    def anon_kb() -> int:
        return int(next(line for line in open("/proc/self/status") if line.startswith("RssAnon")).split()[1])

    before = anon_kb()
    z = zeros((4096, 4096), torch.float32)
    assert z.shape == (4096, 4096) and z.dtype == torch.float32 and z.is_contiguous()
    assert int(torch.count_nonzero(z)) == 0
    assert anon_kb() - before < 4096
    torch.save(z, tmp_path / "z.pt")
    assert torch.equal(torch.load(tmp_path / "z.pt"), torch.zeros(4096, 4096))
    assert torch.equal(zeros((0, 3), torch.bfloat16), torch.zeros(0, 3, dtype=torch.bfloat16))
    z[1, 2] = 5.0
    assert float(z.sum()) == 5.0


@pytest.mark.parametrize(
    ("numels", "dp", "partition", "paddings", "fragments"),
    [
        # two parameters, one partition boundary inside the second, no padding
        ([3, 5], 2, 4, [0, 0], [{"a": (3, 0), "b": (1, 3)}, {"b": (4, 0)}]),
        # 7 elements padded to 8 (a multiple of 2 x dp): the last partition ends in one element of padding
        ([3, 4], 2, 4, [0, 1], [{"a": (3, 0), "b": (1, 3)}, {"b": (3, 0)}]),
        # more ranks than elements: padding fills the last partitions whole
        ([1], 4, 2, [1, 2, 2, 2], [{"a": (1, 0)}, {}, {}, {}]),
    ],
)
def test_the_zero_writers_flat_groups_are_laid_out_as_deepspeeds(numels, dp, partition, paddings, fragments):
    """The ZeRO 1-2 layout the conversion writer writes (DeepSpeedZeroOptimizer's: a group's parameters end
    to end, padded to a multiple of 2 x dp, dp equal partitions): each rank's partition size, its padding
    (``groups_padding``) and each parameter's fragment in it (``param_slice_mappings``: numel, start), and
    the fill of a partition is those elements of the parameters followed by the padding's zeros."""
    from tessera.engines.zero_writer import FlatGroup, _partition

    names = tuple("ab"[: len(numels)])
    g = FlatGroup(names, tuple(torch.Size([n]) for n in numels), dp)
    assert g.partition == partition
    assert [g.padding(r) for r in range(dp)] == paddings
    assert [{k: (f.numel, f.start) for k, f in g.fragments(r).items()} for r in range(dp)] == fragments
    values = {k: torch.arange(n, dtype=torch.float32) + 10 * (i + 1) for i, (k, n) in enumerate(zip(names, numels))}
    flat = torch.cat([*values.values(), torch.zeros(dp * partition - sum(numels))])
    for r in range(dp):
        got = torch.cat(list(_partition(g, r, partition, values.__getitem__)()))
        assert torch.equal(got, flat[r * partition : (r + 1) * partition])
        short = partition - g.padding(r)  # the fp32 partition as saved: without its padding
        assert torch.equal(torch.cat([torch.zeros(0), *_partition(g, r, short, values.__getitem__)()]), flat[r * partition : r * partition + short])
