"""A dry run's read of the data (`sample_corpus`): the ranks' reader on the first records of each file,
refusing what the full read refuses with the same error, and never reading past its sample."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tessera.config.schema import DataSection
from tessera.data.corpus import SAMPLE_RECORDS, load_corpus, sample_corpus
from tessera.errors import DataError


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _refusal(fn) -> str:
    with pytest.raises(DataError) as err:
        fn()
    return err.value.render()


@pytest.mark.parametrize("case", ["wrong text_field", "not text", "bad json", "not utf-8", "parquet column"])
def test_the_sample_refuses_what_the_full_read_refuses_with_the_same_error(tmp_path: Path, case: str) -> None:
    if case == "wrong text_field":
        _jsonl(tmp_path / "d.jsonl", [{"content": f"doc {i}"} for i in range(40)])
    elif case == "not text":
        _jsonl(tmp_path / "d.jsonl", [{"text": i} for i in range(40)])
    elif case == "bad json":
        (tmp_path / "d.jsonl").write_text('{"text": "fine"}\n{not json\n')
    elif case == "not utf-8":
        (tmp_path / "d.txt").write_bytes(b"caf\xe9 latin-1\n" * 20)
    else:
        pq.write_table(pa.table({"body": [f"doc {i}" for i in range(40)]}), tmp_path / "d.parquet")
    files = [next(p.name for p in tmp_path.iterdir())]
    section = DataSection(source="files", files=files, cache_dir="cache")
    sampled = _refusal(lambda: sample_corpus(section, root=tmp_path))
    assert sampled == _refusal(lambda: load_corpus(section, root=tmp_path).documents)
    expected = {
        "wrong text_field": "data.text_field = 'text': column 'text' not found in d.jsonl (columns: content)",
        "not text": "data.text_field = 'text': column 'text' holds int values, not text",
        "bad json": f"data.files = ['{tmp_path / 'd.jsonl'}']: could not read as jsonl: ArrowInvalid: JSON "
        "parse error: Missing a name for object member. in row 1",
        "not utf-8": f"data.files = ['{tmp_path / 'd.txt'}']: could not read as text: UnicodeDecodeError: "
        "'utf-8' codec can't decode byte 0xe9 in position 3: invalid continuation byte",
        "parquet column": "data.text_field = 'text': column 'text' not found in d.parquet (columns: body)",
    }[case]
    assert sampled.splitlines()[0] == expected


def test_the_sample_reads_the_first_records_of_each_file_and_writes_nothing(tmp_path: Path) -> None:
    # a bad record past the reader's first 10 MB block, which the sample never reaches and the full read
    # refuses: the read is bounded (a 10 GB corpus costs a dry run one block per file)
    _jsonl(tmp_path / "a.jsonl", [{"body": f"doc {i} " + "x" * 1000} for i in range(11_000)])
    with (tmp_path / "a.jsonl").open("a") as f:
        f.write("{not json\n")
    _jsonl(tmp_path / "b.jsonl", [{"body": "x"}, {"body": ""}, {"body": None}])
    (tmp_path / "empty.jsonl").write_text("")  # no error: read with the others it adds nothing
    section = DataSection(source="files", files=["*.jsonl"], text_field="body", cache_dir="cache")
    sample = sample_corpus(section, root=tmp_path)
    assert [p.name for p in sample.files] == ["a.jsonl", "b.jsonl", "empty.jsonl"]
    assert (sample.records, sample.documents) == (SAMPLE_RECORDS + 3, SAMPLE_RECORDS + 1)
    assert not (tmp_path / "cache").exists()
    assert "could not read as jsonl" in _refusal(lambda: load_corpus(section, root=tmp_path).documents)
    # files with no document at all, read to their end: the run's own error
    _jsonl(tmp_path / "a.jsonl", [{"body": "  "}])
    _jsonl(tmp_path / "b.jsonl", [{"body": "\n"}, {"body": None}])
    assert _refusal(lambda: sample_corpus(section, root=tmp_path)).splitlines()[0] == (
        "data.files = ['*.jsonl']: the data files hold no non-empty documents"
    )
