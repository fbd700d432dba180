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
