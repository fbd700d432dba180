"""tessera.data: corpus, tokenizer cache, packed / padded tensors and the layout-invariant sampler."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch

from tessera.config.schema import DataSection
from tessera.data import StepSampler, load_corpus, load_documents, prepare_data
from tessera.data._cache import publish_dir, temp_dir_beside
from tessera.errors import CheckpointError, DataError, LayoutError

SMALL = {"max_docs": 20, "vocab_size": 300, "seq_len": 64}


@pytest.fixture(scope="module")
def stdlib_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache shared by the stdlib tests, so the BPE is trained once per module."""
    return tmp_path_factory.mktemp("stdlib_cache")


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _all(rows) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row of a split: (input_ids, labels)."""
    b = rows.batch(range(len(rows)))
    return b["input_ids"], b["labels"]


def _words(n: int, salt: int = 0) -> str:
    return " ".join(f"word{(i * 7 + salt) % 23}" for i in range(n))


# --- corpus -------------------------------------------------------------------------------------------


def test_stdlib_corpus_is_deterministic_and_clean(tmp_path: Path) -> None:
    section = DataSection(max_docs=20, cache_dir=str(tmp_path))
    a, b = load_corpus(section, root=tmp_path), load_corpus(section, root=tmp_path)
    assert a.fingerprint == b.fingerprint
    assert len(a.files) == 20 and len(a.documents) == 20
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    rel = [p.relative_to(stdlib).as_posix() for p in a.files]
    assert rel == sorted(rel)  # strided pick of a list sorted by relative path keeps the order
    for r in rel:
        assert r.endswith(".py")
        assert not {"site-packages", "test", "tests", "idlelib", "lib2to3"} & set(r.split("/"))
    entry = a.fingerprint["files"][0]
    assert set(entry) == {"path", "size", "sha256"} and len(entry["sha256"]) == 64
    other = load_corpus(DataSection(max_docs=21, cache_dir=str(tmp_path)), root=tmp_path)
    assert other.content_hash != a.content_hash


def test_file_formats_load(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("first line\nsecond line\n")
    (tmp_path / "b.md").write_text("# title\n\nbody")
    _write_jsonl(tmp_path / "c.jsonl", [{"body": "json one", "id": 1}, {"body": "json two", "id": 2}])
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["pq one", "pq two", "pq three"]}), tmp_path / "d.parquet")
    section = DataSection(
        source="files", files=["*.txt", "b.md"], max_docs=None, cache_dir=str(tmp_path / "cache")
    )
    assert load_documents(section, root=tmp_path) == ["first line\nsecond line\n", "# title\n\nbody"]
    section = DataSection(source="files", files=["c.jsonl", "d.parquet"], text_field="body", max_docs=None)
    assert load_documents(section, root=tmp_path) == ["json one", "json two", "pq one", "pq two", "pq three"]
    # An explicit format overrides the extension; nothing goes to ~/.cache but to cache_dir/datasets.
    (tmp_path / "e.data").write_text('{"body": "odd extension"}\n')
    section = DataSection(source="files", files=["e.data"], format="jsonl", text_field="body", cache_dir="cc")
    assert load_documents(section, root=tmp_path) == ["odd extension"]
    assert (tmp_path / "cc" / "datasets").is_dir()


def test_rewritten_file_changes_hash_and_documents(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [{"text": "old text"}])
    section = DataSection(source="files", files=["d.jsonl"])
    before = load_corpus(section, root=tmp_path)
    assert before.documents == ["old text"]
    _write_jsonl(path, [{"text": "new text"}])
    after = load_corpus(section, root=tmp_path)
    assert after.content_hash != before.content_hash and after.documents == ["new text"]


@pytest.mark.parametrize(
    ("files", "field"),
    [(["missing.jsonl"], "data.files"), (["nothing/*.jsonl"], "data.files"), (["x.csv"], "data.format")],
)
def test_bad_paths_are_data_errors(tmp_path: Path, files: list[str], field: str) -> None:
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError) as err:
        load_corpus(DataSection(source="files", files=files), root=tmp_path)
    assert err.value.field == field and field in str(err.value) and err.value.fix


def test_missing_text_field_is_named(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "d.jsonl", [{"content": "hello"}])
    section = DataSection(source="files", files=["d.jsonl"], text_field="body")
    with pytest.raises(DataError) as err:
        load_documents(section, root=tmp_path)
    assert err.value.field == "data.text_field" and "data.text_field" in str(err.value)
    assert "'body'" in str(err.value) and "content" in str(err.value)


# --- tokenizer and tensors -------------------------------------------------------------------------------


def test_bpe_cache_hit_same_hash_and_tensors(stdlib_cache: Path, tmp_path: Path) -> None:
    section = DataSection(**SMALL, cache_dir=str(stdlib_cache))
    a = prepare_data(section)
    b = prepare_data(section)
    assert a.tokenizer_hash == b.tokenizer_hash and a.tokenizer_dir == b.tokenizer_dir
    assert Path(a.tokenizer_dir).parent == stdlib_cache / "tokenizers"
    assert all(torch.equal(x, y) for x, y in zip(_all(a.rows), _all(b.rows)))
    assert a.fingerprint == b.fingerprint and a.spec == b.spec
    prepared = Path(a.spec["sources"][0]["prefix"]).parent
    assert prepared.parent == stdlib_cache / "prepared" and (prepared / "dataset.json").is_file()
    assert not [p for p in stdlib_cache.rglob(".tmp-*")]
    # Training is deterministic: a fresh cache trains byte-identical tokenizer files.
    fresh = prepare_data(DataSection(**SMALL, cache_dir=str(tmp_path)))
    assert fresh.tokenizer_hash == a.tokenizer_hash and torch.equal(_all(fresh.rows)[0], _all(a.rows)[0])


def test_packed_rows_are_full(stdlib_cache: Path) -> None:
    data = prepare_data(DataSection(**SMALL, cache_dir=str(stdlib_cache)))
    input_ids, labels = _all(data.rows)
    assert input_ids.dtype == torch.int64 and input_ids.shape == (len(data), 64)
    assert torch.equal(labels, input_ids)
    assert int(input_ids.max()) < data.vocab_size
    assert (input_ids == data.eos_id).any() and data.pad_id != data.eos_id
    fp = data.fingerprint
    assert fp["num_samples"] == len(data) and fp["num_tokens"] == len(data) * 64 and fp["num_docs"] == 20
    assert fp["packing"] is True and fp["seq_len"] == 64 and len(fp["files"]) == 20


def test_unpacked_rows_mask_exactly_the_padding(tmp_path: Path) -> None:
    docs = [_words(n, salt=n) for n in (2, 5, 9, 40, 3)]
    _write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in docs])
    section = DataSection(source="files", files=["d.jsonl"], vocab_size=300, seq_len=16, packing=False)
    data = prepare_data(section, root=tmp_path)
    assert len(data) == len(docs)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(data.tokenizer_dir, local_files_only=True)
    input_ids, labels = _all(data.rows)
    counts = []
    for i, doc in enumerate(docs):
        ids = tok(doc, add_special_tokens=False)["input_ids"]
        n = min(len(ids) + 1, 16)  # eos appended when it fits
        assert input_ids[i, : min(len(ids), 16)].tolist() == ids[:16]
        assert torch.equal(labels[i, :n], input_ids[i, :n])
        assert (labels[i, n:] == -100).all() and (input_ids[i, n:] == data.pad_id).all()
        if len(ids) < 16:
            assert int(input_ids[i, n - 1]) == data.eos_id
        counts.append(int((labels[i] != -100).sum()))
    assert len(set(counts)) > 1  # rows carry different token counts
    assert data.fingerprint["num_tokens"] == sum(counts)


def test_local_tokenizer_dir_without_pad_pads_with_eos(stdlib_cache: Path, tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    trained = prepare_data(DataSection(**SMALL, cache_dir=str(stdlib_cache)))
    base = PreTrainedTokenizerFast.from_pretrained(trained.tokenizer_dir, local_files_only=True)
    nopad = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, eos_token="<|endoftext|>")
    nopad.save_pretrained(str(tmp_path / "tok"))
    _write_jsonl(tmp_path / "d.jsonl", [{"text": _words(n)} for n in (1, 30)])
    section = DataSection(source="files", files=["d.jsonl"], tokenizer="tok", seq_len=16, packing=False)
    data = prepare_data(section, root=tmp_path)
    assert data.pad_id == data.eos_id
    # Row 0 is short: its eos is a target, the identical pad ids after it are not.
    input_ids, labels = _all(data.rows)
    n = int((labels[0] != -100).sum())
    assert int(labels[0, n - 1]) == data.eos_id and (input_ids[0, n:] == data.eos_id).all()
    # The directory's tokenizer files are hashed the same way as a trained BPE's.
    same = prepare_data(DataSection(**SMALL, tokenizer=trained.tokenizer_dir, cache_dir=str(stdlib_cache)))
    assert same.tokenizer_hash == trained.tokenizer_hash
    assert torch.equal(_all(same.rows)[0], _all(trained.rows)[0])


def test_missing_tokenizer_dir_and_too_few_samples(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "d.jsonl", [{"text": "tiny"}])
    with pytest.raises(DataError) as err:
        prepare_data(DataSection(source="files", files=["d.jsonl"], tokenizer="no/such/dir"), root=tmp_path)
    assert err.value.field == "data.tokenizer"
    with pytest.raises(DataError) as err:
        prepare_data(
            DataSection(source="files", files=["d.jsonl"], seq_len=512, vocab_size=300), root=tmp_path
        )
    assert err.value.field == "data.seq_len" and "lower data.seq_len" in str(err.value)


def test_publish_dir_keeps_the_winner(tmp_path: Path) -> None:
    target = tmp_path / "entry"
    target.mkdir()
    (target / "f").write_text("first")
    tmp = temp_dir_beside(target)
    (tmp / "f").write_text("second")
    assert publish_dir(tmp, target) == target
    assert (target / "f").read_text() == "first" and not tmp.exists()


# --- sampler -------------------------------------------------------------------------------------------


def _step_sets(num: int, g: int, dp: int, ga: int, steps: int, seed: int = 3) -> list[list[set[int]]]:
    """Per step, the set each rank consumes (its micro-batches united)."""
    samplers = [
        StepSampler(
            num, global_batch=g, micro_batch=g // (dp * ga), grad_accum=ga, dp_rank=r, dp_size=dp, seed=seed
        )
        for r in range(dp)
    ]
    out = []
    for _ in range(steps):
        per_rank = []
        for s in samplers:
            micro = s.next_step()
            assert len(micro) == ga and all(len(m) == g // (dp * ga) for m in micro)
            per_rank.append({i for m in micro for i in m})
        out.append(per_rank)
    return out


def test_sampler_same_set_per_step_for_every_layout() -> None:
    num, g, steps = 37, 8, 9  # 4 steps per epoch: crosses two epoch boundaries
    layouts = {(dp, ga): _step_sets(num, g, dp, ga, steps) for dp, ga in [(1, 2), (2, 1), (2, 2), (4, 2)]}
    ref = StepSampler(num, global_batch=g, micro_batch=g, grad_accum=1, dp_rank=0, dp_size=1, seed=3)
    for step in range(steps):
        expected = set(ref.peek_global(step))
        assert len(expected) == g
        for sets in layouts.values():
            per_rank = sets[step]
            assert set().union(*per_rank) == expected
            assert sum(len(s) for s in per_rank) == g  # disjoint across ranks
    epoch0 = [i for s in range(4) for i in ref.peek_global(s)]
    assert len(set(epoch0)) == 32 and ref.peek_global(4) != ref.peek_global(0)  # new permutation per epoch


def test_mapped_permutation_is_torchs_and_read_from_the_file(tmp_path: Path) -> None:
    """The shuffle order saved in the data cache and mapped (so a rank's memory does not grow with the
    rows) is torch's seeded randperm; a sampler reading it draws the batches one holding it does."""
    import numpy as np

    from tessera.data._cache import randperm

    want = torch.randperm(1000, generator=torch.Generator().manual_seed(7)).tolist()
    first = randperm(1000, 7, tmp_path / "orders")
    assert isinstance(first, np.memmap) and first.tolist() == want and first.dtype == np.int32
    assert (tmp_path / "orders" / "randperm-1000-7.npy").is_file()
    assert randperm(1000, 7, tmp_path / "orders").tolist() == want == randperm(1000, 7).tolist()

    def make(cache: Path | None) -> StepSampler:
        s = StepSampler(40, global_batch=8, micro_batch=2, grad_accum=2, dp_rank=1, dp_size=2, seed=5)
        s.perm_cache = cache
        return s

    mapped, held = make(tmp_path / "orders"), make(None)
    assert [mapped.next_step() for _ in range(12)] == [held.next_step() for _ in range(12)]
    assert sorted(p.name for p in (tmp_path / "orders").iterdir()) == [
        "randperm-1000-7.npy", "randperm-40-5.npy", "randperm-40-6.npy", "randperm-40-7.npy"
    ]  # fmt: skip


@pytest.mark.parametrize("split", [2, 4, 6])  # mid-epoch, exactly at an epoch boundary, in epoch 1
def test_sampler_resume_is_exact(split: int) -> None:
    def make() -> StepSampler:
        return StepSampler(20, global_batch=4, micro_batch=1, grad_accum=2, dp_rank=1, dp_size=2, seed=11)

    full = make()
    expected = [full.next_step() for _ in range(10)]
    first = make()
    got = [first.next_step() for _ in range(split)]
    state = json.loads(json.dumps(first.state_dict()))
    assert state["consumed_samples"] == split * 4 and state["epoch"] == split // 5
    resumed = make()
    resumed.load_state_dict(state)
    got += [resumed.next_step() for _ in range(10 - split)]
    assert got == expected and resumed.state_dict() == full.state_dict()


def test_sampler_errors() -> None:
    s = StepSampler(20, global_batch=4, micro_batch=2, grad_accum=1, dp_rank=0, dp_size=2, seed=1)
    for key, value in [("global_batch", 8), ("seed", 2)]:
        with pytest.raises(CheckpointError) as err:
            s.load_state_dict({**s.state_dict(), key: value})
        assert err.value.fix and key in str(err.value)
    with pytest.raises(DataError) as derr:
        StepSampler(3, global_batch=4, micro_batch=2, grad_accum=1, dp_rank=0, dp_size=2, seed=1)
    assert derr.value.fix
    with pytest.raises(LayoutError):
        StepSampler(20, global_batch=6, micro_batch=2, grad_accum=1, dp_rank=0, dp_size=2, seed=1)


# --- the held-out eval split ----------------------------------------------------------------------------


def test_eval_split_holds_out_whole_documents(tmp_path: Path) -> None:
    """data.eval: the last documents, laid out like the training rows, in no training row; its hash pins
    it; without a split the training rows are what they always were."""
    docs = [_words(30 + i, salt=i) for i in range(10)]
    _write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in docs])
    base = {"source": "files", "files": ["d.jsonl"], "vocab_size": 300, "seq_len": 8, "packing": False}
    split = prepare_data(DataSection(**base, eval={"fraction": 0.2}), root=tmp_path)
    # one tokenizer for both (a BPE trains on the training documents only, so each split has its own)
    plain = prepare_data(DataSection(**base, tokenizer=split.tokenizer_dir), root=tmp_path)
    assert plain.eval_rows is None and "eval" not in plain.fingerprint
    assert split.eval_rows is not None
    # unpacked: one row per document, so the rows are exactly the first 8 and the last 2 documents
    ids = _all(plain.rows)[0]
    assert torch.equal(_all(split.rows)[0], ids[:8]) and torch.equal(_all(split.eval_rows)[0], ids[8:])
    assert split.fingerprint["eval"]["num_docs"] == 2 and split.fingerprint["eval"]["num_samples"] == 2
    assert split.fingerprint["data_hash"] != plain.fingerprint["data_hash"]  # another cache entry
    from tessera.data.dataset import eval_split_hash

    assert split.fingerprint["eval"]["sha256"] == eval_split_hash(split.eval_rows)
    # the BPE never saw the held-out documents: it is another tokenizer than one trained on all ten
    everything = prepare_data(DataSection(**base), root=tmp_path)
    assert everything.tokenizer_hash != split.tokenizer_hash
    with pytest.raises(DataError) as e:
        prepare_data(DataSection(**base, eval={"fraction": 0.99}), root=tmp_path)
    assert e.value.field == "data.eval.fraction"


def test_eval_batches_are_layout_free() -> None:
    """Every layout of the same global batch evaluates the same rows; too few rows is a clear error."""
    seen = []
    for dp, ga in ((1, 4), (2, 2), (4, 1)):
        rows = set()
        for r in range(dp):
            s = StepSampler(
                100, global_batch=8, micro_batch=8 // (dp * ga), grad_accum=ga, dp_rank=r, dp_size=dp
            )
            for batch in s.eval_batches(30, max_samples=20):
                rows |= {i for mb in batch for i in mb}
        seen.append(rows)
    assert seen[0] == seen[1] == seen[2] == set(range(16))  # min(30, 20) rows -> 2 whole batches of 8
    with pytest.raises(DataError) as e:
        StepSampler(100, global_batch=8, micro_batch=8, grad_accum=1, dp_rank=0, dp_size=1).eval_batches(
            5, max_samples=256
        )
    assert e.value.field == "data.eval.fraction"


def test_every_rank_knows_the_global_token_count_without_a_collective(tmp_path: Path):
    """The loop's counts (from the step's global indices, which each rank's sampler knows) equal the
    sum of every dp rank's own micro-batch counts, which an all-reduce would give, padding included."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from tessera.data.mapped import DocumentRows, TokenFile, strided
    from tessera.engines.base import label_tokens

    builder = IndexedDatasetBuilder(str(tmp_path / "d.bin"), dtype=np.uint16)
    gen = np.random.default_rng(0)
    for n in gen.integers(2, 30, size=40):  # unpacked rows: some end in padding, some are cut
        builder.add_document(gen.integers(0, 50, size=n).astype(np.uint16), [int(n)])
    builder.finalize(str(tmp_path / "d.idx"))
    tf = TokenFile(str(tmp_path / "d"))
    rows = DocumentRows(tf, strided(tf.num_docs, None), 16, pad_id=0)
    samplers = [
        StepSampler(40, global_batch=8, micro_batch=2, grad_accum=2, dp_rank=r, dp_size=2, seed=5)
        for r in range(2)
    ]
    for _ in range(12):  # past an epoch boundary (5 steps per epoch)
        mine = [s.next_step() for s in samplers]
        assert samplers[0].last_global_batch == samplers[1].last_global_batch
        batches = [rows.batch(mb) for micro in mine for mb in micro]
        summed = sum(label_tokens(b["labels"]) for b in batches)
        assert rows.label_tokens(samplers[1].last_global_batch) == summed
        assert len(samplers[1].last_global_batch) * 16 == sum(b["input_ids"].numel() for b in batches)
