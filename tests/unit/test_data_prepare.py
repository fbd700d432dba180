"""``tessera data prepare``: sources -> megatron-core indexed dataset, read back by megatron-core itself.

The tokens of every document are checked against the tokenizer called directly in the test (plus eos), in
source order; jsonl byte-range shards are checked to own every line exactly once wherever they are cut;
bad input is one DataError naming the file and line (or row) and leaves nothing in ``--out``.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from tessera.atomic import sha256_file
from tessera.data.prepare import DATASET_JSON, PREFIX, prepare_dataset
from tessera.data.readers import RowKind, Shard, jsonl_rows
from tessera.errors import DataError


def _text(i: int) -> str:
    return " ".join(f"tok{(i * 7 + k) % 31}" for k in range(5 + i % 11)) + f" doc {i} é"


@pytest.fixture
def tokenizer_dir(bpe_dir) -> Path:
    return bpe_dir


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """One source of each kind: jsonl (with a null text and a blank line), text, parquet with two row
    groups, and a datasets save_to_disk directory."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path_factory.mktemp("src")
    rows = [{"text": _text(i), "id": i} for i in range(40)] + [{"text": None, "id": 40}]
    (d / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:20]) + "\n" + "".join(
        json.dumps(r) + "\n" for r in rows[20:]))  # fmt: skip
    (d / "b.txt").write_text(_text(100) + "\n" + _text(101))
    pq.write_table(
        pa.table({"text": [_text(200 + i) for i in range(30)]}), d / "c.parquet", row_group_size=16
    )
    datasets.Dataset.from_dict({"text": [_text(300 + i) for i in range(12)]}).save_to_disk(str(d / "e"))
    return {"jsonl": d / "a.jsonl", "text": d / "b.txt", "parquet": d / "c.parquet", "saved": d / "e"}


def _expected(sources: dict[str, Path]) -> list[str]:
    return (
        [_text(i) for i in range(40)]
        + [_text(100) + "\n" + _text(101)]
        + [_text(200 + i) for i in range(30)]
        + [_text(300 + i) for i in range(12)]
    )


def test_prepared_tokens_are_what_megatron_core_reads(tokenizer_dir, sources, tmp_path):
    """Two workers; megatron-core's IndexedDataset maps the result; each document's tokens are the
    tokenizer's ids + eos, in source order; dataset.json records the sources' hashes and the totals; a
    second prepare of the same inputs changes nothing."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from transformers import AutoTokenizer

    out = tmp_path / "ds"
    srcs = [str(sources[k]) for k in ("jsonl", "text", "parquet", "saved")]
    rec = prepare_dataset(srcs, tokenizer=str(tokenizer_dir), out=out, workers=2, show_progress=False)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    docs = _expected(sources)
    want = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in docs]
    ds = IndexedDataset(str(out / PREFIX))
    assert len(ds) == len(want) == rec["documents"]
    assert [ds[i].tolist() for i in range(len(ds))] == want
    assert rec["tokens"] == sum(map(len, want)) == int(ds.sequence_lengths.sum())
    meta = json.loads((out / DATASET_JSON).read_text())
    assert meta == rec and meta["tokenizer"]["eos_token_id"] == tok.eos_token_id
    assert [s["sha256"] for s in meta["sources"][:3]] == [
        sha256_file(sources[k]) for k in ("jsonl", "text", "parquet")
    ]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    stamp = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = prepare_dataset(srcs, tokenizer=str(tokenizer_dir), out=out, workers=2, show_progress=False)
    assert again["up_to_date"] and {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamp


def test_jsonl_shards_own_every_line_once_wherever_they_are_cut(tmp_path):
    """A line belongs to the byte range its first byte is in: cut anywhere, the shards' lines are the
    file's lines, each once, in order."""
    lines = [json.dumps({"text": _text(i) * (1 + i % 3)}) for i in range(25)]
    path = tmp_path / "x.jsonl"
    path.write_text("\n".join(lines) + "\n")
    n = path.stat().st_size
    for cuts in ([0, n], [0, 1, n], [0, len(lines[0]), len(lines[0]) + 1, n], [*range(0, n, 37), n]):
        got = [
            values[0]
            for a, b in itertools.pairwise(cuts)
            for values, _, _ in jsonl_rows(Shard(0, str(path), "jsonl", a, b), RowKind())
        ]
        assert got == [json.loads(x)["text"] for x in lines], cuts


@pytest.mark.parametrize(
    "name, content, where, field",
    [
        ("bad.jsonl", b'{"text": "a"}\n{"text": "b"}\n{"text": \n', "bad.jsonl:3: not a JSON object", "SRC"),
        (
            "nofield.jsonl",
            b'{"text": "a"}\n{"body": "b"}\n',
            "nofield.jsonl:2: no 'text' field",
            "data.text_field",
        ),
        ("latin.jsonl", b'{"text": "a"}\n{"text": "caf\xe9"}\n', "latin.jsonl:2: not UTF-8", "SRC"),
        ("latin.txt", b"line one\ncaf\xe9\n", "latin.txt:2: not UTF-8", "SRC"),
        ("empty.jsonl", b"", "an empty source", "SRC"),
    ],
)
def test_bad_input_names_file_and_line_and_writes_nothing(
    tokenizer_dir, tmp_path, name, content, where, field
):
    src = tmp_path / name
    src.write_bytes(content)
    out = tmp_path / "out"
    with pytest.raises(DataError) as e:
        prepare_dataset([str(src)], tokenizer=str(tokenizer_dir), out=out, workers=1, show_progress=False)
    assert where in e.value.message and e.value.field == field and e.value.fix
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_the_command_prepares_and_refuses_with_exit_2(tokenizer_dir, sources, tmp_path, capsys):
    """``tessera data prepare`` (its ``main``, which the console script exits with): the summary line, and a
    bad row as exit 2 with one line naming file and line, no traceback, nothing in --out."""
    from tessera.cli import main

    cmd = ["data", "prepare", "--tokenizer", str(tokenizer_dir), "--workers", "1"]
    assert main([*cmd, str(sources["jsonl"]), "--out", str(tmp_path / "ok")]) == 0
    assert "prepared" in capsys.readouterr().out and (tmp_path / "ok" / DATASET_JSON).is_file()
    assert main([*cmd, str(sources["jsonl"]), "--out", str(tmp_path / "ok")]) == 0
    assert "up to date (40 documents" in capsys.readouterr().out
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"txt": "b"}\n')
    assert main([*cmd, str(bad), "--out", str(tmp_path / "no")]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:2: no 'text' field" in err and "Traceback" not in err and not (tmp_path / "no").exists()
