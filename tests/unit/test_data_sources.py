"""The mapped data path: rows read from megatron-core indexed datasets equal the in-memory packing, a
dataset written by megatron-core's own builder trains as a source, blends follow their weights at every
step and resume to the same samples at any dp, and a damaged ``.idx`` / ``.bin`` is refused naming it."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tessera.config.schema import DataSection
from tessera.data import StepSampler, prepare_data
from tessera.data.corpus import load_corpus
from tessera.errors import CheckpointError, DataError


def _all(rows) -> tuple[torch.Tensor, torch.Tensor]:
    b = rows.batch(range(len(rows)))
    return b["input_ids"], b["labels"]


def _text(i: int) -> str:
    return " ".join(f"w{(i * 13 + k) % 37}" for k in range(3 + i % 17)) + f" #{i}"


@pytest.fixture
def tok(bpe_dir) -> Path:
    return bpe_dir


def _megatron_prefix(path: Path, docs: list[list[int]], dtype=np.uint16) -> str:
    """An indexed dataset written by megatron-core's own builder (not through Tessera)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(path) + ".bin", dtype=dtype)
    for d in docs:
        builder.add_document(np.asarray(d, dtype=dtype), [len(d)])
    builder.finalize(str(path) + ".idx")
    return str(path)


def _pack(docs: list[list[int]], seq_len: int) -> torch.Tensor:
    stream = [t for d in docs for t in d]
    n = len(stream) // seq_len
    return torch.tensor(stream[: n * seq_len], dtype=torch.int64).view(n, seq_len)


def test_mapped_rows_equal_the_in_memory_packing_of_the_stdlib_corpus(tmp_path):
    """The rows a run trains on (packed and padded, training and held-out) are, token for token, the
    tokenized documents joined with eos and cut as the in-memory path cut them."""
    from transformers import AutoTokenizer

    for packing in (True, False):
        section = DataSection(
            max_docs=30,
            seq_len=64,
            vocab_size=300,
            cache_dir=str(tmp_path),
            packing=packing,
            eval={"fraction": 0.1},
        )
        data = prepare_data(section, root=tmp_path)
        docs = load_corpus(section, root=tmp_path).documents
        t = AutoTokenizer.from_pretrained(data.tokenizer_dir, local_files_only=True)
        encoded = [[*t(d, add_special_tokens=False)["input_ids"], data.eos_id] for d in docs]
        train, held = encoded[:27], encoded[27:]  # 10 % of 30 held out: the last 3 documents
        if packing:
            assert torch.equal(_all(data.rows)[0], _pack(train, 64))
            assert torch.equal(_all(data.eval_rows)[0], _pack(held, 64))
        else:
            ids, labels = _all(data.rows)
            for i, d in enumerate(train):
                n = min(len(d), 64)
                assert ids[i, :n].tolist() == d[:n] and (labels[i, n:] == -100).all()
        assert data.fingerprint["num_docs"] == 30 and data.fingerprint["eval"]["num_docs"] == 3
        # the BPE was trained on the 27 training documents only
        from tessera.data.tokenizer import _train_bpe

        alone = _train_bpe(docs[:27], 300)
        assert alone.backend_tokenizer.to_str() == t.backend_tokenizer.to_str()


def test_a_megatron_builder_dataset_trains_as_a_source_in_place(tok, tmp_path):
    """A prefix written by megatron-core's builder is read where it is (nothing copied into the cache),
    with the tokenizer named in data.tokenizer."""
    docs = [[(i * 7 + k) % 250 for k in range(5 + i % 9)] for i in range(60)]
    (tmp_path / "corpus").mkdir()
    prefix = _megatron_prefix(tmp_path / "corpus" / "mine_text_document", docs)
    section = DataSection(
        sources=[{"path": prefix}], tokenizer=str(tok), seq_len=16, cache_dir=str(tmp_path / "c")
    )
    data = prepare_data(section, root=tmp_path)
    assert torch.equal(_all(data.rows)[0], _pack(docs, 16))
    assert data.spec["sources"][0]["prefix"] == prefix and not (tmp_path / "c" / "prepared").exists()
    src = data.fingerprint["sources"][0]
    assert src["kind"] == "megatron" and src["documents"] == 60 and data.fingerprint["source"] == "sources"
    # a prepared directory names its tokenizer: data.tokenizer auto (bpe for a data section alone) takes it
    from tessera.data.prepare import prepare_dataset

    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": _text(i)}) + "\n" for i in range(50)))
    prepare_dataset(
        [str(tmp_path / "a.jsonl")], tokenizer=str(tok), out=tmp_path / "prep", workers=1, show_progress=False
    )
    auto = prepare_data(
        DataSection(sources=[{"path": "prep"}], seq_len=16, cache_dir=str(tmp_path / "c")), root=tmp_path
    )
    assert auto.tokenizer_dir == str(tok) and len(auto) > 0
    # a tokenizer other than the one the directory was prepared with is refused, naming both
    other = tmp_path / "other"
    shutil.copytree(tok, other)
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**cfg, "model_max_length": 7}))
    with pytest.raises(DataError) as e:
        prepare_data(
            DataSection(sources=[{"path": "prep"}], tokenizer=str(other), cache_dir=str(tmp_path / "c")),
            root=tmp_path,
        )
    assert (
        e.value.field == "data.tokenizer"
        and str(tok) in str(e.value)
        and "tokenizer_override" in str(e.value)
    )


def _blend(tmp_path: Path, tok: Path, weights=(0.7, 0.3)):
    a = _megatron_prefix(tmp_path / "a", [[1 + (i + k) % 200 for k in range(40)] for i in range(50)])
    b = _megatron_prefix(tmp_path / "b", [[201 + (i + k) % 50 for k in range(24)] for i in range(70)])
    section = DataSection(
        sources=[
            {"path": a, "weight": weights[0], "name": "web"},
            {"path": b, "weight": weights[1], "name": "code"},
        ],
        tokenizer=str(tok),
        seq_len=8,
        cache_dir=str(tmp_path / "cache"),
    )
    return prepare_data(section, root=tmp_path)


def _sampler(data, dp: int, rank: int, seed: int = 7) -> StepSampler:
    s = StepSampler(
        len(data),
        global_batch=16,
        micro_batch=16 // dp,
        grad_accum=1,
        dp_rank=rank,
        dp_size=dp,
        seed=seed,
        shuffle=False,
    )
    data.rows.set_seed(seed)
    s.source_tokens = [0, 0]
    return s


def _steps(data, sampler: StepSampler, n: int) -> list[list[int]]:
    """The rows' first tokens of each step (which rows, not just which indices), counting tokens per source."""
    out = []
    for _ in range(n):
        micro = sampler.next_step()
        epoch = sampler.last_epoch
        out.append([int(x) for mb in micro for x in data.rows.batch(mb, epoch)["input_ids"][:, 0]])
        per = data.rows.tokens_by_source(sampler.last_global_batch, epoch)
        sampler.source_tokens = [int(x + y) for x, y in zip(sampler.source_tokens, per)]
    return out


def test_blend_follows_its_weights_and_resumes_to_the_same_samples_at_any_dp(tok, tmp_path):
    data = _blend(tmp_path, tok)
    rows = data.rows
    assert rows.own_order and rows.names == ["web", "code"]
    sizes = [len(p) for p in rows.parts]
    assert sizes == [50 * 40 // 8, 70 * 24 // 8] and len(rows) == sum(sizes)
    full = _sampler(data, 1, 0)
    ref = _steps(data, full, 200)  # 200 steps of 16 rows: past the end of a pass (505 rows)
    web, code = full.source_tokens
    assert abs(web / (web + code) - 0.7) <= 0.02 * 0.7 and abs(code / (web + code) - 0.3) <= 0.02 * 0.3
    # within one row per pass over the blend (505 rows): megatron's blending index, taken in sequence
    assert abs(web / 8 - 0.7 * 200 * 16) <= 200 * 16 // len(rows) + 1
    # every row of a source is seen once before any is seen again (shuffled inside the source)
    drawn: list[list[int]] = [[], []]
    for epoch in (0, 1):
        src, row = rows._locate(range(len(rows)), epoch)
        for s in (0, 1):
            drawn[s] += row[src == s].tolist()
    for s in (0, 1):
        assert sorted(drawn[s][: sizes[s]]) == list(range(sizes[s])) and drawn[s][: sizes[s]] != list(
            range(sizes[s])
        )
    # stopped at step 100 and resumed, on 1 rank and on 2: the same rows, the same counts
    head = _sampler(data, 1, 0)
    got = _steps(data, head, 100)
    state = json.loads(json.dumps(head.state_dict()))
    for dp in (1, 2):
        again = _blend(tmp_path, tok)  # a fresh process: the blend index read back from its cache
        resumed = [_sampler(again, dp, r) for r in range(dp)]
        for s in resumed:
            s.load_state_dict(state)
        per_rank = [_steps(again, s, 100) for s in resumed]
        merged = [[t for r in range(dp) for t in per_rank[r][i]] for i in range(100)]
        assert got + merged == ref
        assert all(s.source_tokens == full.source_tokens for s in resumed)  # every rank counts the same
    assert (tmp_path / "cache" / "blends").is_dir()
    # another seed: another order inside the sources, the same shares
    other = _sampler(data, 1, 0, seed=8)
    assert _steps(data, other, 5) != ref[:5]


def _damage(prefix: str, how: str) -> None:
    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    if how == "truncated bin":
        bin_.write_bytes(bin_.read_bytes()[:-6])
    elif how == "longer bin":
        bin_.write_bytes(bin_.read_bytes() + b"\0\0")
    elif how == "bad header":
        idx.write_bytes(b"NOTANIDX!" + idx.read_bytes()[9:])
    elif how == "short idx":
        idx.write_bytes(idx.read_bytes()[:-8])


@pytest.mark.parametrize("how", ["truncated bin", "longer bin", "bad header", "short idx"])
def test_a_damaged_idx_or_bin_is_refused_naming_the_file(tok, tmp_path, how):
    """Training and the dry run's look at data.sources refuse it with the file named, never read garbage."""
    from tessera.data.sources import describe_sources

    prefix = _megatron_prefix(tmp_path / "d", [[5, 6, 7, 8, 9, 10] for _ in range(30)])
    _damage(prefix, how)
    section = DataSection(
        sources=[{"path": prefix}], tokenizer=str(tok), seq_len=8, cache_dir=str(tmp_path / "c")
    )
    for check in (
        lambda: prepare_data(section, root=tmp_path),
        lambda: describe_sources(section, root=tmp_path),
    ):
        with pytest.raises(DataError) as e:
            check()
        text = str(e.value)
        assert e.value.field == "data.sources" and str(tmp_path / "d") in text and "fix:" in text
        assert ("truncated" in text) == (how == "truncated bin")


def test_resume_on_a_changed_dataset_is_refused_naming_both_hashes(tok, tmp_path):
    """The run pins each source's identity; a prepared dataset whose dataset.json changed (other tokens
    or another tokenizer) is refused before launch unless --accept-data-change."""
    from tessera.data.identity import data_identity
    from tessera.data.prepare import prepare_dataset
    from tessera.launch.runs import check_resume_inputs

    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": _text(i)}) + "\n" for i in range(40)))
    prepare_dataset(
        [str(tmp_path / "a.jsonl")], tokenizer=str(tok), out=tmp_path / "prep", workers=1, show_progress=False
    )
    section = DataSection(
        sources=[{"path": "prep"}], tokenizer=str(tok), seq_len=16, cache_dir=str(tmp_path / "c")
    )
    data = prepare_data(section, root=tmp_path)
    ident = data_identity(section, root=tmp_path)
    assert ident["content_hash"] == data.fingerprint["content_hash"]
    assert (
        ident["data_hash"] == data.fingerprint["data_hash"] and ident["tokenizer_hash"] == data.tokenizer_hash
    )

    class _Recipe:  # the three fields check_resume_inputs reads
        class train:
            seed = 1

        class parallel:
            global_batch = 8

        data = section

    meta = {"data_fingerprint": data.fingerprint, "tokenizer_hash": data.tokenizer_hash, "sampler": {}}
    import os

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        check_resume_inputs(tmp_path, meta, _Recipe, accept_data_change=False)  # unchanged: fine
        (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": _text(i)}) + "\n" for i in range(41)))
        shutil.rmtree(tmp_path / "prep")
        prepare_dataset(
            [str(tmp_path / "a.jsonl")],
            tokenizer=str(tok),
            out=tmp_path / "prep",
            workers=1,
            show_progress=False,
        )
        with pytest.raises(CheckpointError) as e:
            check_resume_inputs(tmp_path, meta, _Recipe, accept_data_change=False)
        now = data_identity(section, root=tmp_path)["content_hash"]
        assert data.fingerprint["content_hash"] in str(e.value) and now in str(e.value)
        assert "--accept-data-change" in str(e.value)
        check_resume_inputs(tmp_path, meta, _Recipe, accept_data_change=True)
    finally:
        os.chdir(cwd)


def test_document_boundaries_restart_positions_and_keep_attention_inside_each_document(tok, tmp_path):
    """Packed rows with data.document_boundaries: position ids count from each document's first token,
    which is no target; transformers' attention (sdpa, eager) then gives each document the logits it has
    alone; megatron is refused."""
    from transformers import AutoConfig, AutoModelForCausalLM

    docs = [[10 + (i * 5 + k) % 200 for k in range(3 + i % 7)] + [0] for i in range(40)]  # eos 0 ends each
    prefix = _megatron_prefix(tmp_path / "d", docs)
    base = {
        "sources": [{"path": prefix}],
        "tokenizer": str(tok),
        "seq_len": 16,
        "cache_dir": str(tmp_path / "c"),
    }
    plain = prepare_data(DataSection(**base), root=tmp_path)
    cut = prepare_data(DataSection(**base, document_boundaries=True), root=tmp_path)
    b, p = cut.rows.batch(range(len(cut.rows))), plain.rows.batch(range(len(plain.rows)))
    assert torch.equal(b["input_ids"], p["input_ids"]) and "position_ids" not in p
    stream = [t for d in docs for t in d]
    starts = set(np.cumsum([0] + [len(d) for d in docs])[1:-1].tolist())  # where documents begin
    for r in range(len(cut.rows)):
        for c in range(16):
            g = r * 16 + c
            if c > 0 and g in starts:
                assert b["position_ids"][r, c] == 0 and b["labels"][r, c] == -100
            else:
                assert b["labels"][r, c] == stream[g]
                assert b["position_ids"][r, c] == (0 if c == 0 else b["position_ids"][r, c - 1] + 1)
    assert cut.rows.label_tokens(range(len(cut.rows))) == int((b["labels"][:, 1:] != -100).sum())
    assert cut.fingerprint["data_hash"] != plain.fingerprint["data_hash"]
    cfg = AutoConfig.for_model(
        "llama",
        vocab_size=320,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    for attn in ("sdpa", "eager"):
        cfg._attn_implementation = attn
        model = AutoModelForCausalLM.from_config(cfg).eval()
        row, pos = b["input_ids"][1:2], b["position_ids"][1:2]
        with torch.no_grad():
            packed = model(input_ids=row, position_ids=pos, use_cache=False).logits[
                0
            ]  # as the engines call it
            cuts = [0, *[c for c in range(1, 16) if pos[0, c] == 0], 16]
            for a, z in itertools.pairwise(cuts):
                alone = model(input_ids=row[:, a:z]).logits[0]
                torch.testing.assert_close(packed[a:z], alone, rtol=1e-5, atol=1e-5)
    from tessera.config.loader import load_recipe
    from tessera.errors import RecipeError

    with pytest.raises(RecipeError) as e:
        load_recipe(
            Path(__file__).parents[2] / "recipes" / "tiny-llama-cpu-mcore-tp2.yaml",
            ["data.document_boundaries=true"],
        )
    assert e.value.field == "data.document_boundaries" and "deepspeed" in str(e.value)
