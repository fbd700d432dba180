"""A jsonl corpus of a given size from text every machine has: the Python standard library's sources.

Deterministic (seeded): each line is ``{"text": ...}`` holding a slice of one stdlib file, files and slice
lengths drawn by the seed, so the corpus has the length spread of real documents (100 B - 8 KB) and
nothing is downloaded. Used by ``tools/bench/data.py``; never committed (``bench-results/`` and the
corpus directory are ignored).

    python tools/gen_corpus.py --size 2G --out /tmp/corpus-2G.jsonl [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import sysconfig
from pathlib import Path

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``20M``, ``2G``, ``512K`` or a byte count."""
    text = text.strip().upper()
    return int(float(text[:-1]) * _UNITS[text[-1]]) if text[-1] in _UNITS else int(text)


def generate(size: int, out: Path, *, seed: int = 0) -> Path:
    """Write ``out`` (at least ``size`` bytes, whole lines) unless it already exists at that size."""
    if out.is_file() and out.stat().st_size >= size:
        return out
    rng = random.Random(seed)
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for p in sorted(root.rglob("*.py")):
        if "test" in p.parts or "site-packages" in p.parts:
            continue
        try:
            texts.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    tmp = out.with_suffix(out.suffix + ".tmp")
    written = 0
    with open(tmp, "w", encoding="utf-8") as f:
        while written < size:
            text = rng.choice(texts)
            start = rng.randrange(max(1, len(text) - 100))
            line = json.dumps({"text": text[start : start + rng.randint(100, 8000)]}) + "\n"
            f.write(line)
            written += len(line.encode("utf-8"))
    tmp.rename(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", required=True, help="e.g. 20M, 2G")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(generate(parse_size(args.size), Path(args.out), seed=args.seed))


if __name__ == "__main__":
    main()
