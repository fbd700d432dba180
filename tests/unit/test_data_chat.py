"""Chat and prompt-completion rows: rendered with the tokenizer's chat template, the loss mask on the
assistant turns (completion) exactly, stored beside the tokens; odd rows handled as the recipe says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import chat_rows, chat_tokenizer
from tessera.config.schema import DataSection
from tessera.data import prepare_data
from tessera.data.prepare import DATASET_JSON, prepare_dataset
from tessera.errors import DataError


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    from tessera.data.tokenizer import _train_bpe

    base = tmp_path_factory.mktemp("base")
    words = [" ".join(m["content"] for m in r["messages"]) for r in chat_rows(100)]
    _train_bpe([*words, "user assistant system"], 300).save_pretrained(base)
    return chat_tokenizer(base, tmp_path_factory.mktemp("chat"))


def _prepare_chat(tmp_path: Path, tok: Path, **kw) -> dict:
    """``c.jsonl`` in ``tmp_path`` prepared as chat rows into ``out``."""
    return prepare_dataset(
        [str(tmp_path / "c.jsonl")],
        tokenizer=str(tok),
        out=tmp_path / "out",
        fmt="chat",
        show_progress=False,
        **kw,
    )


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _expected(tokenizer, messages) -> tuple[list[int], list[int]]:
    """Ids and mask built piece by piece from the message boundaries, without the template: each turn is
    ``<|im_start|>`` role ``\\n`` content ``<|im_end|>`` ``\\n``; an assistant turn's content, ``<|im_end|>``
    and ``\\n`` are trained on."""
    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    ids, mask = [], []
    for m in messages:
        head = [start, *enc(m["role"]), *enc("\n")]
        body = [*enc(m["content"]), end, *enc("\n")]
        ids += head + body
        mask += [0] * len(head) + [int(m["role"] == "assistant")] * len(body)
    return ids, mask


def test_chat_mask_is_exactly_the_assistant_turns(tok, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from transformers import AutoTokenizer

    rows = chat_rows(24)
    _jsonl(tmp_path / "c.jsonl", rows)
    rec = _prepare_chat(tmp_path, tok, workers=2)
    assert rec["rows"] == "chat" and rec["loss_mask"] == "mask" and rec["documents"] == 24
    tokens, masks = (
        IndexedDataset(str(tmp_path / "out" / "tokens")),
        IndexedDataset(str(tmp_path / "out" / "mask")),
    )
    t = AutoTokenizer.from_pretrained(str(tok), local_files_only=True)
    for i, r in enumerate(rows):
        ids, mask = _expected(t, r["messages"])
        assert tokens[i].tolist() == ids and masks[i].tolist() == mask, i
    # the rows a run trains on: labels -100 outside the assistant turns and on the padding
    section = DataSection(sources=[{"path": "out"}], seq_len=96, packing=False, format="chat", cache_dir="c")
    data = prepare_data(section, root=tmp_path)
    b = data.rows.batch(range(len(data.rows)))
    for i, r in enumerate(rows):
        ids, mask = _expected(t, r["messages"])
        n = min(len(ids), 96)
        want = [x if m else -100 for x, m in zip(ids[:n], mask[:n])] + [-100] * (96 - n)
        assert b["labels"][i].tolist() == want and b["input_ids"][i, :n].tolist() == ids[:n]
    assert data.rows.label_tokens(range(len(rows))) == int((b["labels"][:, 1:] != -100).sum())
    packed = prepare_data(
        DataSection(sources=[{"path": "out"}], seq_len=32, format="chat", cache_dir="c"), root=tmp_path
    )
    pb = packed.rows.batch(range(len(packed.rows)))
    stream = [(x, m) for r in rows for x, m in zip(*_expected(t, r["messages"]))]
    flat = [x if m else -100 for x, m in stream][: len(packed.rows) * 32]
    assert pb["labels"].flatten().tolist() == flat


def test_prompt_completion_mask_and_too_long_choices(tok, tmp_path):
    from transformers import AutoTokenizer

    pairs = [
        {"prompt": "alpha beta " * (1 + i % 4), "completion": "gamma delta " * (1 + i % 9)} for i in range(30)
    ]
    _jsonl(tmp_path / "p.jsonl", pairs)
    t = AutoTokenizer.from_pretrained(str(tok), local_files_only=True)
    base = {
        "source": "files",
        "files": ["p.jsonl"],
        "format": "prompt_completion",
        "tokenizer": str(tok),
        "packing": False,
    }
    with pytest.raises(DataError) as e:  # longer than seq_len: refused unless the recipe chooses
        prepare_data(DataSection(**base, seq_len=16), root=tmp_path)
    assert e.value.field == "data.chat.too_long" and "skip" in str(e.value)
    full = [
        t(p["prompt"], add_special_tokens=False)["input_ids"]
        + t(p["completion"], add_special_tokens=False)["input_ids"]
        + [t.eos_token_id]
        for p in pairs
    ]
    skip = prepare_data(DataSection(**base, seq_len=16, chat={"too_long": "skip"}), root=tmp_path)
    assert len(skip.rows) == sum(len(f) <= 16 for f in full) and skip.fingerprint["sources"][0]["skipped"][
        "too_long"
    ] == sum(len(f) > 16 for f in full)
    cut = prepare_data(DataSection(**base, seq_len=16, chat={"too_long": "truncate"}), root=tmp_path)
    b = cut.rows.batch(range(len(cut.rows)))
    for i, p in enumerate(pairs):
        n_p = len(t(p["prompt"], add_special_tokens=False)["input_ids"])
        want = [-100 if k < n_p else x for k, x in enumerate(full[i][:16])]
        want += [-100] * (16 - len(want))
        assert b["labels"][i].tolist() == want


@pytest.mark.parametrize(
    "row, why",
    [
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]},
            "the role 'robot'",
        ),
        ({"messages": [{"role": "user", "content": "only a question"}]}, "without an assistant turn"),
        ({"messages": "hello"}, "not a non-empty list"),
        ({"text": "no messages"}, "no 'messages' field"),
    ],
)
def test_bad_chat_rows_name_file_and_line_and_write_nothing(tok, tmp_path, row, why):
    good = chat_rows(3)
    _jsonl(tmp_path / "c.jsonl", [*good, row])
    with pytest.raises(DataError) as e:
        _prepare_chat(tmp_path, tok, workers=1)
    assert "c.jsonl:4: " in str(e.value) and why in str(e.value) and e.value.fix
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".tmp-*"))


def test_no_assistant_rows_are_skipped_with_a_count_when_asked(tok, tmp_path):
    rows = [*chat_rows(5), {"messages": [{"role": "user", "content": "alpha"}]}, *chat_rows(2, salt=1)]
    _jsonl(tmp_path / "c.jsonl", rows)
    rec = _prepare_chat(tmp_path, tok, workers=1, no_assistant="skip")
    assert rec["documents"] == 7 and rec["skipped"] == {"no_assistant": 1}
    assert json.loads((tmp_path / "out" / DATASET_JSON).read_text())["skipped"] == {"no_assistant": 1}
    # a BPE cannot render chat: a tokenizer directory is required
    with pytest.raises(DataError) as e:
        prepare_data(DataSection(source="files", files=["c.jsonl"], format="chat"), root=tmp_path)
    assert e.value.field == "data.tokenizer"
