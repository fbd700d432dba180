import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("WANDB_SILENT", "true")
# a `tessera plan --probe` of this machine (kept in ~/.cache) would change what the planner predicts: the
# tests see none, unless they write one (under this directory, or their own)
os.environ["TESSERA_HARDWARE_DIR"] = str(
    Path(os.environ.get("TMPDIR", "/tmp")) / f"tessera-test-hw-{os.getpid()}"
)


@pytest.fixture(scope="session")
def bpe_dir(tmp_path_factory):
    """A tiny byte-level BPE (300 tokens, eos and pad) saved as a tokenizer directory: what the data
    tests name as --tokenizer / data.tokenizer."""
    from tessera.data.tokenizer import _train_bpe

    out = tmp_path_factory.mktemp("bpe")
    texts = [
        " ".join(f"w{(i * 13 + k) % 37} tok{(i * 7 + k) % 31}" for k in range(3 + i % 17)) for i in range(300)
    ]
    _train_bpe([f"{t} doc {i} é" for i, t in enumerate(texts)], 300).save_pretrained(out)
    return out
