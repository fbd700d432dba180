"""``tessera verify A B [--prompts N] [--json]``: are two models the same model?

Each side is an HF directory or a Tessera checkpoint of any engine and layout (read as HF tensors by
:mod:`tessera.checkpoint.reader`). The report: key coverage (missing, unexpected), shapes and dtypes,
per-tensor max absolute difference and content-hash equality, the Adam moments where both sides keep
them per parameter, and the logits of both models on fixed prompts (max absolute difference and mean
KL divergence), and for an HF directory with a tokenizer whether its ``config.json`` and
``generation_config.json`` name the tokenizer's special tokens (an eos that is not the tokenizer's and
``generate`` never stops). The verdict: weights bit-exact (or equal after the dtype cast when the dtypes
differ), logits within ``1e-5`` in fp32, and the special-token ids agreeing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tessera.checkpoint.sources import is_hf_dir, resolve_source, tokenizer_dir_of
from tessera.engines.optim import MOMENTS
from tessera.tensorfile import TensorView

LOGITS_TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-2}
#: what peft's save_pretrained writes beside ``adapter_model.safetensors``: a PEFT adapter directory
ADAPTER_CONFIG = "adapter_config.json"
#: fixed prompts (Python, like the default corpus, and prose); tokenized by the run's tokenizer
PROMPTS = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "import os\nimport sys\n\n\ndef main(argv=None):\n    args = argv or sys.argv[1:]\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "The quick brown fox jumps over the lazy dog, and the dog does not mind at all.",
    "for i, line in enumerate(open(path)):\n    if line.strip():\n        print(i, line)\n",
    "try:\n    value = int(text)\nexcept ValueError:\n    value = None\n",
    "Distributed training is not adding devices: every run plans, computes, communicates and saves.",
    "with open(filename, 'rb') as f:\n    data = f.read()\n    digest = hashlib.sha256(data).hexdigest()\n",
)


@dataclass
class Side:
    """One model to compare: where it came from, its HF tensors (a dict, or a lazy mapping that reads one
    tensor per access) and, where the format keeps them, its Adam moments, read one kind at a time
    (``moments("exp_avg")`` -> HF name -> tensor), so a comparison never holds both kinds of both sides."""

    label: str
    kind: str  # "hf" or "checkpoint"
    config: Any
    state: Mapping[str, torch.Tensor]
    moments: Callable[[str], Mapping[str, torch.Tensor] | None] | None
    tokenizer_dir: Path | None
    model_dir: Path | None = None  # an HF directory loads through from_pretrained itself
    #: adapters (a checkpoint's meta.json ``peft``): the model is the HF model with them, by canonical name
    peft: dict[str, Any] | None = None
    #: a PEFT adapter directory: loaded with ``PeftModel.from_pretrained`` on ``model_dir`` (its base)
    adapter_dir: Path | None = None


#: megatron-core's advice on importing it without TransformerEngine or Apex (true of a CPU machine, and
#: nothing to do with reading a checkpoint; the training ranks send it to their log file)
_IMPORT_ADVICE = r"(Transformer Engine and Apex are|Apex is) not installed"
_PEFT_DEPRECATION = r"`is_gradient_checkpointing` is deprecated"


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """For the duration of a conversion or comparison: no transformers / huggingface_hub progress bars
    (loading and writing a few files, one bar each) and no megatron-core import advice on the console;
    both are restored afterwards (a caller that wants bars keeps them)."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_IMPORT_ADVICE, category=UserWarning)
            # transformers' deprecation of a name peft's LoRA layers still read (peft 0.21.2)
            warnings.filterwarnings("ignore", message=_PEFT_DEPRECATION, category=FutureWarning)
            yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def open_side(path: Path) -> Side:
    path = Path(path)
    if (path / ADAPTER_CONFIG).is_file():
        with quiet_libraries():  # a base in legacy form loads through from_pretrained: no bar
            return _adapter_side(path)
    if is_hf_dir(path):
        with quiet_libraries():
            return _hf_side(path)
    from tessera.checkpoint.reader import hf_config_of, hf_tensors, read_hf_moment

    ckpt = resolve_source(path)
    with quiet_libraries():  # the megatron reader imports megatron-core
        state, meta = hf_tensors(ckpt)  # read on access where the format allows
    return Side(
        label=str(ckpt),
        kind="checkpoint",
        config=hf_config_of(meta),
        state=state,
        moments=lambda kind: read_hf_moment(ckpt, meta, kind),
        tokenizer_dir=tokenizer_dir_of(ckpt),
        peft=meta.get("peft"),
    )


def _adapter_side(path: Path) -> Side:
    """A PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) on the base its
    config names: tensors are the base's plus the adapter's by canonical name; logits through
    ``PeftModel.from_pretrained`` on that base."""
    from peft import LoraConfig

    from tessera.models.adapters import names_of_config
    from tessera.models.hf import hf_dir_tensors, read_dir_config
    from tessera.tensorfile import LazyTensors

    cfg = json.loads((path / ADAPTER_CONFIG).read_text())
    base = Path(cfg.get("base_model_name_or_path") or "")
    if not is_hf_dir(base):
        from tessera.errors import CheckpointError

        raise CheckpointError(
            "the adapter's base model (adapter_config.json base_model_name_or_path) is not a local HF directory",
            field="adapter_config.json",
            value=str(base),
            fix="export the base first (tessera convert RUN --to hf --out BASE) and name it there",
        )
    lazy = LazyTensors([path / "adapter_model.safetensors"])
    names = names_of_config(read_dir_config(base), LoraConfig.from_pretrained(str(path)))
    adapters = {names.from_peft_key(k): lazy[k] for k in lazy}
    state = {**dict(hf_dir_tensors(base)), **adapters}
    has_tok = any((path / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json"))
    return Side(
        str(path), "peft", read_dir_config(base), state, None, path if has_tok else None,
        model_dir=base, adapter_dir=path,
    )  # fmt: skip


def _hf_side(path: Path) -> Side:
    """An HF directory, under the model's own tensor names (:func:`tessera.models.hf.hf_dir_tensors`)."""
    from tessera.models.hf import hf_dir_tensors, read_dir_config

    tensors = hf_dir_tensors(path)  # checks config.json and the weight files first
    has_tok = any((path / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json"))
    return Side(
        str(path), "hf", read_dir_config(path), tensors, None, path if has_tok else None, model_dir=path
    )


#: a tensor comparison reads and compares this many bytes of each side at a time (a row block)
BLOCK_BYTES = 16 << 20


def _blocks(
    state: Mapping[str, torch.Tensor], key: str
) -> tuple[torch.Size, torch.dtype, Iterator[torch.Tensor]]:
    """(shape, dtype, row blocks of at most :data:`BLOCK_BYTES`) of one tensor: read block by block from
    an HF directory's files (safetensors slices), cut from the tensor otherwise (a checkpoint's reader
    holds its group anyway)."""
    part = getattr(state, "part", None)
    if part is None:
        t = state[key]
        shape, dtype, rows = t.shape, t.dtype, lambda i, j: t[i:j]
    else:
        shape = torch.Size(state.shape_of(key))  # type: ignore[attr-defined]
        first = part(key, (slice(0, 1),)) if shape else state[key]
        dtype = first.dtype
        rows = lambda i, j: part(key, (slice(i, j),))  # noqa: E731
        del first
    if not shape or shape[0] == 0:
        return shape, dtype, iter([state[key] if part is not None else t])  # type: ignore[possibly-undefined]
    per = max(1, BLOCK_BYTES // max(1, shape[1:].numel() * dtype.itemsize))
    return shape, dtype, (rows(i, min(i + per, shape[0])) for i in range(0, shape[0], per))


def _compare_tensor(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], k: str) -> dict[str, Any]:
    """One tensor of both sides, row block by row block: never more than a block of each beside what the
    sides hold."""
    xs, xd, xb = _blocks(a, k)
    ys, yd, yb = _blocks(b, k)
    row: dict[str, Any] = {"name": k, "shape_a": list(xs), "shape_b": list(ys)}
    row.update(dtype_a=str(xd).removeprefix("torch."), dtype_b=str(yd).removeprefix("torch."))
    if xs != ys:
        row.update(max_abs_diff=None, equal=False, same_bytes=False)
        return row
    common = xd if xd == yd else torch.promote_types(xd, yd)
    cast = yd if xd != yd else xd  # a dtype change compares the cast, as the conversion that asked for it did
    worst, equal, ha, hb = 0.0, True, hashlib.sha256(), hashlib.sha256()
    for x, y in zip(xb, yb, strict=True):
        same = bool(torch.equal(x.to(cast), y.to(cast)))
        if x.numel() and not same:  # the difference's temporaries only where there is one
            worst = max(worst, float((x.to(common) - y.to(common)).abs().max()))
        equal = equal and same
        for h, t in ((ha, x), (hb, y)):
            h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())
    row.update(max_abs_diff=worst, equal=equal, same_bytes=xd == yd and ha.digest() == hb.digest())
    return row


def _model(side: Side, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if side.model_dir is not None and (side.adapter_dir is not None or side.peft is not None):
        model = AutoModelForCausalLM.from_pretrained(
            str(side.model_dir), local_files_only=True, dtype=dtype, attn_implementation="eager"
        )
        if side.adapter_dir is not None:  # the ecosystem's own load of an exported adapter, untouched
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(side.adapter_dir), torch_dtype=dtype)
        return model.eval()
    if side.peft is None:
        streamed = _streamed(side, dtype)
        if streamed is not None:
            return streamed
    model = AutoModelForCausalLM.from_config(side.config, attn_implementation="eager").to(dtype)
    if side.peft is not None:
        from tessera.models.adapters import inject

        inject(model, side.peft)
        model.to(dtype)
    from tessera.models.adapters import name_map

    canon = name_map(model)
    with torch.no_grad():  # one tensor at a time (the side's state may be read lazily)
        for name, t in model.state_dict().items():
            if canon[name] in side.state:
                t.copy_(side.state[canon[name]])
    model.tie_weights()
    return model.eval()


def _streamed(side: Side, dtype: torch.dtype) -> torch.nn.Module | None:
    """The side's model with no weights of its own: built with accelerate's ``init_empty_weights``, then
    accelerate's ``cpu_offload`` hooks read each module's weights from the side's tensors (cast to
    ``dtype``) as the module runs and drop them after, so a forward pass holds one module's weights, and
    a lazy reader one group of tensors, never the model: a verification's memory does not grow with
    depth. None where the side's tensors do not give every weight a value (the caller's copying path
    keeps the model's own for the rest)."""
    from accelerate import cpu_offload, init_empty_weights
    from transformers import AutoModelForCausalLM

    from tessera.models.adapters import name_map

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(side.config, attn_implementation="eager")
    canon = name_map(model)
    names = {n: canon[n] for n in model.state_dict()}
    out = model.get_output_embeddings()
    if out is not None and getattr(side.config, "tie_word_embeddings", False):  # the head is the embedding
        head = next(n for n, p in model.named_parameters(remove_duplicate=False) if p is out.weight)
        embed = model.get_input_embeddings().weight
        names[head] = canon[next(n for n, p in model.named_parameters() if p is embed)]
    if any(k not in side.state for k in names.values()):
        return None
    if any(b.is_meta for b in model.buffers()):
        return None
    _rows_read(model, names, side.state, dtype)
    return cpu_offload(model.eval(), torch.device("cpu"), state_dict=TensorView(side.state, names, dtype))  # type: ignore[arg-type]


def _rows_read(
    model: torch.nn.Module, names: dict[str, str], state: Mapping[str, torch.Tensor], dtype: torch.dtype
) -> None:
    """The streamed model's input embedding and LM head (plain ``nn.Embedding`` / ``nn.Linear`` without a
    bias; any other kind stays with accelerate's hooks) replaced by modules reading their weight a block
    of rows at a time as they run (:class:`_RowsEmbedding`, :class:`_RowsHead`): these are a model's
    largest tensors, and accelerate's hooks would load each whole. ``names`` loses their entries."""
    swaps = (
        (model.get_input_embeddings(), torch.nn.Embedding, _RowsEmbedding, model.set_input_embeddings),
        (model.get_output_embeddings(), torch.nn.Linear, _RowsHead, model.set_output_embeddings),
    )
    for module, kind, rows, put in swaps:
        if type(module) is not kind or getattr(module, "bias", None) is not None:
            continue
        if getattr(module, "max_norm", None) is not None:
            continue
        name = next(n for n, p in model.named_parameters(remove_duplicate=False) if p is module.weight)
        put(rows(state, names.pop(name), dtype))


class _RowsEmbedding(torch.nn.Module):
    """An embedding lookup reading the table a block of rows at a time (:func:`_blocks`) and taking the
    rows the ids ask for from each: one block in memory, never the table."""

    def __init__(self, state: Mapping[str, torch.Tensor], key: str, dtype: torch.dtype) -> None:
        super().__init__()
        self._state, self._key, self._dtype = state, key, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        shape, _, blocks = _blocks(self._state, self._key)
        out = torch.empty(*ids.shape, *shape[1:], dtype=self._dtype)
        at = 0
        for w in blocks:
            hit = (ids >= at) & (ids < at + w.shape[0])
            out[hit] = w[ids[hit] - at].to(self._dtype)
            at += w.shape[0]
        return out


class _RowsHead(torch.nn.Module):
    """An LM head without a bias computing its logits a block of output rows at a time (the weight's row
    blocks, :func:`_blocks`): one block of the weight in memory, never the whole."""

    def __init__(self, state: Mapping[str, torch.Tensor], key: str, dtype: torch.dtype) -> None:
        super().__init__()
        self._state, self._key, self._dtype = state, key, dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, _, blocks = _blocks(self._state, self._key)
        out = x.new_empty(*x.shape[:-1], shape[0])
        at = 0
        for w in blocks:
            out[..., at : at + w.shape[0]] = torch.nn.functional.linear(x, w.to(self._dtype))
            at += w.shape[0]
        return out


def release(state: Mapping[str, torch.Tensor]) -> None:
    """Let a lazy reader go of the tensors it holds between reads (megatron's reader keeps the last
    group it read); a plain dict holds its tensors anyway."""
    getattr(state, "release", lambda: None)()


def _prompts(a: Side, b: Side, n: int, vocab: int) -> list[torch.Tensor]:
    tok_dir = a.tokenizer_dir or b.tokenizer_dir
    if tok_dir is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tok_dir))
        return [torch.tensor([tok.encode(p)[:64]]) for p in (PROMPTS * (n // len(PROMPTS) + 1))[:n]]
    gen = torch.Generator().manual_seed(0)  # no tokenizer at hand: fixed token ids
    return [torch.randint(0, vocab, (1, 32), generator=gen) for _ in range(n)]


def special_tokens(side: Side) -> dict[str, Any] | None:
    """An HF directory's special-token ids against its tokenizer's: ``config.json`` and
    ``generation_config.json`` as written (not as transformers would complete them); None for a checkpoint
    or a directory without a tokenizer."""
    if side.kind != "hf" or side.model_dir is None or side.tokenizer_dir is None:
        return None
    from transformers import AutoTokenizer

    from tessera.data.tokenizer import token_ids
    from tessera.models.hf import token_id_conflicts

    ids = token_ids(AutoTokenizer.from_pretrained(str(side.tokenizer_dir), local_files_only=True))
    problems = []
    for name in ("config.json", "generation_config.json"):
        f = side.model_dir / name
        if f.is_file():
            problems += token_id_conflicts(name, json.loads(f.read_text()), ids)
    return {"side": side.label, "tokenizer": ids, "problems": problems, "ok": not problems}


def compare(a: Side, b: Side, *, prompts: int = 4, source_tokens: bool = True) -> dict[str, Any]:
    """The full report and its verdict (``ok``). ``source_tokens=False`` where ``a`` is only the source a
    conversion read: its own special-token ids are not the conversion's to judge (a pretrained directory
    whose config.json names another eos than its tokenizer is converted as it is; the export of a run
    from it writes the tokenizer's, :func:`tessera.models.hf.set_token_ids`)."""
    from tessera.hostmem import lean_construction

    # no autograd (ZeRO's tensors require grad); every tensor freed is given back (lazy sides read a
    # group of tensors at a time)
    with quiet_libraries(), torch.no_grad(), lean_construction():
        return _compare(a, b, prompts=prompts, source_tokens=source_tokens)


def _compare(a: Side, b: Side, *, prompts: int, source_tokens: bool) -> dict[str, Any]:
    # in the first side's own order (a lazy reader holds one group of tensors: q, k and v share theirs)
    shared = [k for k in a.state if k in b.state]
    tensors = sorted((_compare_tensor(a.state, b.state, k) for k in shared), key=lambda r: r["name"])
    release(a.state)
    release(b.state)
    report: dict[str, Any] = {
        "a": a.label,
        "b": b.label,
        "missing_in_b": sorted(set(a.state) - set(b.state)),
        "unexpected_in_b": sorted(set(b.state) - set(a.state)),
        "tensors": tensors,
        "weights_ok": bool(shared) and all(r["equal"] for r in tensors),
    }
    report["optimizer"] = _compare_moments(a, b)
    report["logits"] = compare_logits(a, b, prompts) if prompts else None
    sides = (a, b) if source_tokens else (b,)
    report["special_tokens"] = [t for t in map(special_tokens, sides) if t is not None]
    report["ok"] = (
        report["weights_ok"]
        and not report["missing_in_b"]
        and not report["unexpected_in_b"]
        and (report["optimizer"] is None or report["optimizer"]["ok"])
        and (report["logits"] is None or report["logits"]["ok"])
        and all(t["ok"] for t in report["special_tokens"])
    )
    return report


def _compare_moments(a: Side, b: Side) -> dict[str, Any] | None:
    """Each Adam moment of every parameter, bit-exact, one kind at a time; None unless both sides have
    them."""
    if a.moments is None or b.moments is None:
        return None
    differ: list[str] = []
    missing: set[str] = set()
    compared = 0
    for kind in MOMENTS:
        ma, mb = a.moments(kind), b.moments(kind)
        if ma is None or mb is None:
            return None
        missing |= set(ma) ^ set(mb)
        shared = sorted(set(ma) & set(mb))
        differ += [f"{k}.{kind}" for k in shared if not _same(ma, mb, k)]
        compared = max(compared, len(shared))
        del ma, mb
    return {"compared": compared, "differ": sorted(differ), "missing": sorted(missing),
            "ok": not differ and not missing}  # fmt: skip


def _same(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], k: str) -> bool:
    """Whether tensor ``k`` is bit for bit the same on both sides, compared row block by row block."""
    xs, xd, xb = _blocks(a, k)
    ys, yd, yb = _blocks(b, k)
    return (xs, xd) == (ys, yd) and all(torch.equal(x, y) for x, y in zip(xb, yb, strict=True))


def _first_dtype(state: Mapping[str, torch.Tensor]) -> torch.dtype:
    """The dtype of a side's first tensor: from a lazy reader's ``shapes`` (nothing read), else read."""
    first = next(iter(state))
    of = getattr(state, "shapes", None)
    return of()[first][1] if of is not None else state[first].dtype


def compare_logits(a: Side, b: Side, n: int) -> dict[str, Any]:
    dtype = min((_first_dtype(s.state) for s in (a, b)), key=lambda d: torch.finfo(d).bits)
    dtype = dtype if dtype in LOGITS_TOL else torch.float32
    from tessera.hostmem import give_back

    prompts = _prompts(a, b, n, min(a.config.vocab_size, b.config.vocab_size))

    def logits(side: Side) -> list[torch.Tensor]:  # one model in memory at a time
        # every prompt in one pass (a streamed model reads its weights once per pass), right-padded: under
        # the causal mask a prompt's positions never see the padding after them, so each prompt's logits
        # are its own; both sides run the same batch
        batch = torch.nn.utils.rnn.pad_sequence([p[0] for p in prompts], batch_first=True)
        model = _model(side, dtype)
        with torch.no_grad():
            out = model(input_ids=batch).logits.float()
        release(side.state)
        del model
        give_back()  # accelerate's hooks make the model a reference cycle: it goes before the next side's
        return [out[i, : p.shape[1]] for i, p in enumerate(prompts)]

    worst, kls = 0.0, []
    for la, lb in zip(logits(a), logits(b), strict=True):
        worst = max(worst, float((la - lb).abs().max()))
        pa, pb = la.log_softmax(-1), lb.log_softmax(-1)
        kls.append(float((pa.exp() * (pa - pb)).sum(-1).mean()))
    tol = LOGITS_TOL[dtype]
    return {"prompts": n, "dtype": str(dtype).removeprefix("torch."), "max_abs_diff": worst,
            "mean_kl": sum(kls) / len(kls), "tolerance": tol, "ok": worst <= tol}  # fmt: skip


def render(report: dict[str, Any]) -> None:
    """The verdict table on the console."""
    from rich.console import Console
    from rich.table import Table

    con = Console()
    con.width = max(con.width, 120)
    t = Table(title=f"verify\n  A: {report['a']}\n  B: {report['b']}")
    for col in ("check", "result", "verdict"):
        t.add_column(col)

    def row(check: str, result: str, ok: bool) -> None:
        t.add_row(check, result, "[green]ok[/]" if ok else "[bold red]FAIL[/]")

    cover = not report["missing_in_b"] and not report["unexpected_in_b"]
    row(
        "key coverage",
        f"{len(report['tensors'])} shared, {len(report['missing_in_b'])} missing in B, "
        f"{len(report['unexpected_in_b'])} unexpected in B",
        cover,
    )
    bad = [r["name"] for r in report["tensors"] if not r["equal"]]
    diffs = [r["max_abs_diff"] for r in report["tensors"] if r["max_abs_diff"] is not None]
    row(
        "weights",
        f"max |A-B| {max(diffs, default=0.0):.3g}; "
        + (f"differ: {', '.join(bad[:4])}" if bad else "all equal"),
        report["weights_ok"],
    )
    same = sum(r["same_bytes"] for r in report["tensors"])
    row("content hashes", f"{same}/{len(report['tensors'])} identical", True)
    opt = report["optimizer"]
    if opt is not None:
        what = f"differ: {', '.join(opt['differ'][:4])}" if opt["differ"] else "shared ones equal"
        row(
            "Adam moments",
            f"{opt['compared']} params, {len(opt['missing'])} on one side only; {what}",
            opt["ok"],
        )
    else:
        row("Adam moments", "not compared (a side keeps none per parameter)", True)
    lg = report["logits"]
    if lg is not None:
        row(
            f"logits, {lg['prompts']} prompts ({lg['dtype']})",
            f"max |A-B| {lg['max_abs_diff']:.3g} (tolerance {lg['tolerance']:g}), mean KL {lg['mean_kl']:.3g}",
            lg["ok"],
        )
    merged = report.get("logits_vs_adapters")
    if merged is not None:  # a merged export against the checkpoint's base + adapters
        row(
            f"logits vs A's adapters unmerged ({merged['dtype']})",
            f"max |A-B| {merged['max_abs_diff']:.3g} (tolerance {merged['tolerance']:g})",
            merged["ok"],
        )
    for tok in report.get("special_tokens") or []:
        ids = ", ".join(f"{k.removesuffix('_token_id')} {v}" for k, v in tok["tokenizer"].items())
        row(
            "special tokens, " + ("A" if tok["side"] == report["a"] else "B"),
            "; ".join(tok["problems"]) if tok["problems"] else f"config = tokenizer ({ids})",
            tok["ok"],
        )
    con.print(t)
    con.print("[bold green]PASS[/]" if report["ok"] else "[bold red]FAIL[/]")
