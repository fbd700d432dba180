"""The HF <-> megatron-core weight conversion: one generic function pair driven by each family's
declarative :class:`~tessera.models.megatron.Rule` s (no family has conversion code of its own), plus what
one megatron chunk holds in HF terms and which HF keys the rules cover.

Tensor layouts (QKV interleaved per query group, ``[gate_r; up_r]`` per TP rank, vocabulary padding,
layers over stages, experts over EP ranks) are described in :mod:`tessera.models.megatron`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from tessera.models.init import read_part, shape_of
from tessera.models.megatron import (
    COL,
    ROW,
    VOCAB,
    Adapter,
    ModelShape,
    Rule,
    Shard,
    expert_range,
    layer_range,
    padded_vocab,
)


def _qkv_interleave(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: ModelShape) -> torch.Tensor:
    """HF separate q/k/v (rows = heads*d) -> megatron's per-group [q..., k, v] rows."""
    g, d = s.num_query_groups, s.head_dim
    rest = q.shape[1:]
    q = q.reshape(g, (s.num_heads // g) * d, *rest)
    return torch.cat([q, k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1).reshape(-1, *rest)


def _qkv_split(fused: torch.Tensor, s: ModelShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d = s.num_query_groups, s.head_dim
    per_q = (s.num_heads // g) * d
    rest = fused.shape[1:]
    x = fused.reshape(g, per_q + 2 * d, *rest)
    q, k, v = x.split([per_q, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _tp_of(rule: Rule, shard: Shard) -> tuple[int, int]:
    expert = "#" in rule.mcore
    return (shard.etp, shard.etp_rank) if expert else (shard.tp, shard.tp_rank)


def _stage_has(rule: Rule, shard: Shard, shape: ModelShape) -> bool:
    if rule.stage == "first":
        return shard.first_stage
    if rule.stage == "last":
        return shard.last_stage
    if rule.stage == "output":
        return shard.last_stage and not (shape.tied and shard.first_stage)
    return True


def _instances(
    rule: Rule, shape: ModelShape, shard: Shard
) -> Iterator[tuple[str, Callable[[str], str], int | None]]:
    """(megatron key, HF pattern -> HF key) for every copy of ``rule`` in the chunk."""
    layers = layer_range(shape, shard) if "*" in rule.mcore else [None]
    experts = expert_range(shape, shard) if "#" in rule.mcore else [None]
    for local_l, gl in enumerate(layers):
        if gl is not None and rule.layers != "all" and (gl < shape.dense_layers) != (rule.layers == "dense"):
            continue
        for local_e, ge in enumerate(experts):
            key = rule.mcore
            if gl is not None:
                key = key.replace("*", str(local_l), 1)
            if ge is not None:
                key = key.replace("#", str(local_e), 1)

            def hf_key(p: str, gl=gl, ge=ge) -> str:
                p = p.replace("*", str(gl)) if gl is not None else p
                return p.replace("#", str(ge)) if ge is not None else p

            yield key, hf_key, ge


def _local_mcore(
    rule: Rule, hf: Mapping[str, torch.Tensor], hf_key: Callable[[str], str], expert: int | None,
    shape: ModelShape, tp: int, r: int,
) -> torch.Tensor:  # fmt: skip
    """This TP rank's megatron tensor of one rule instance, reading only the HF parts it holds."""
    names = [hf_key(n) for n in (rule.hf if isinstance(rule.hf, tuple) else (rule.hf,))]
    if rule.hf_experts is not None:  # one expert's block of a packed tensor (small: read whole, then cut)
        assert expert is not None
        block = expert_block(hf[names[0]], rule.hf_experts, shape.num_experts, expert)
        plain = dataclasses.replace(rule, hf="x", hf_experts=None, hf_expert_dim=False)
        return _local_mcore(plain, {"x": block}, lambda p: p, None, shape, tp, r)
    prefix: tuple[int, ...] = (expert,) if rule.hf_expert_dim else ()

    def read(
        name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """megatron-oriented rows / columns of HF tensor ``name`` (its expert; transposed for Conv1D)."""
        rs = slice(*rows) if rows else slice(None)
        cs = slice(*cols) if cols else slice(None)
        dims = len(shape_of(hf, name)) - len(prefix)
        index = (rs,) if dims == 1 else ((cs, rs) if rule.transpose else (rs, cs))
        t = read_part(hf, name, prefix + index)
        return t.t() if rule.transpose and dims == 2 else t

    def m_rows(name: str) -> int:  # megatron rows (output features) of the whole HF tensor
        dims = shape_of(hf, name)[len(prefix) :]
        return dims[1] if rule.transpose and len(dims) == 2 else dims[0]

    def m_cols(name: str) -> int:
        dims = shape_of(hf, name)[len(prefix) :]
        return dims[0] if rule.transpose else dims[1]

    def chunk(n: int) -> tuple[int, int]:
        return r * n // tp, (r + 1) * n // tp

    if rule.fuse == "qkv" and shape.num_query_groups % tp:  # groups split inside: rows of the whole
        whole = _local_mcore(rule, hf, hf_key, expert, shape, 1, 0)
        return whole[slice(*chunk(whole.shape[0]))]
    if rule.fuse == "qkv":  # query groups [g0, g1): a contiguous range of q, of k and of v rows
        g0, g1 = chunk(shape.num_query_groups)
        per_q = shape.num_heads // shape.num_query_groups * shape.head_dim
        d = shape.head_dim
        q_rows, kv_rows = shape.num_heads * d, shape.num_query_groups * d
        if len(names) == 3:
            q, k, v = (read(names[0], (g0 * per_q, g1 * per_q)), read(names[1], (g0 * d, g1 * d)),
                       read(names[2], (g0 * d, g1 * d)))  # fmt: skip
        else:  # GPT-2's [q; k; v] in one tensor
            q = read(names[0], (g0 * per_q, g1 * per_q))
            k = read(names[0], (q_rows + g0 * d, q_rows + g1 * d))
            v = read(names[0], (q_rows + kv_rows + g0 * d, q_rows + kv_rows + g1 * d))
        local = dataclasses.replace(
            shape, num_heads=shape.num_heads * (g1 - g0) // shape.num_query_groups, num_query_groups=g1 - g0
        )
        return _qkv_interleave(q, k, v, local)
    if rule.fuse == "gate_up":  # [gate_r; up_r]
        return torch.cat([read(n, chunk(m_rows(n))) for n in names])
    if rule.fuse == "gate_up_fused":  # HF holds [gate; up]
        ffn = m_rows(names[0]) // 2
        a, b = chunk(ffn)
        return torch.cat([read(names[0], (a, b)), read(names[0], (ffn + a, ffn + b))])
    if rule.split == VOCAB:  # rows of the vocabulary padded to a multiple of tp; the padding is zeros
        a, b = chunk(padded_vocab(shape.vocab_size, tp))
        real = read(names[0], (a, min(b, shape.vocab_size))) if a < shape.vocab_size else None
        pad = max(0, b - max(a, shape.vocab_size))
        if real is None:
            real = torch.zeros(0, m_cols(names[0]))
        return torch.cat([real, real.new_zeros(pad, *real.shape[1:])]) if pad else real
    if rule.split == COL:
        return read(names[0], chunk(m_rows(names[0])))
    if rule.split == ROW:
        return read(names[0], None, chunk(m_cols(names[0])))
    return read(names[0])


def expert_block(t: torch.Tensor, packing: str, experts: int, e: int) -> torch.Tensor:
    """Expert ``e``'s block of a tensor packing every expert's (see ``Rule.hf_experts``)."""
    if packing == "rows":
        return t.reshape(experts, t.shape[0] // experts, *t.shape[1:])[e]
    return t.reshape(t.shape[0], t.shape[1] // experts, experts)[:, :, e]


def pack_experts(blocks: list[torch.Tensor], packing: str) -> torch.Tensor:
    """The inverse of :func:`expert_block` over every expert's block, in expert order."""
    if packing == "rows":
        return torch.cat(blocks, dim=0)
    stacked = torch.stack(blocks, dim=-1)  # (out, r, E)
    return stacked.reshape(stacked.shape[0], -1)


def iter_hf_to_mcore(
    hf: Mapping[str, torch.Tensor], adapter: Adapter, hf_cfg: Any, shard: Shard
) -> Iterator[tuple[str, torch.Tensor]]:
    """(megatron key, tensor) of one model chunk (its TP / EP shard), one tensor at a time, from the HF
    tensors by name. Only the parts the chunk holds are read (:func:`~tessera.models.init.read_part`: a
    lazy safetensors reader or the seeded initial weights read / draw just those rows and columns)."""
    for key, make in hf_to_mcore_thunks(hf, adapter, hf_cfg, shard).items():
        yield key, make()


def hf_to_mcore_thunks(
    hf: Mapping[str, torch.Tensor], adapter: Adapter, hf_cfg: Any, shard: Shard
) -> dict[str, Callable[[], torch.Tensor]]:
    """megatron key -> a function making that tensor of the chunk from the HF tensors when called (what
    :func:`iter_hf_to_mcore` yields, in its order): a writer asks for each as it writes it."""
    shape = adapter.shape(hf_cfg)
    fresh = hasattr(hf, "part")  # a reader's parts are new tensors; a dict's are views of the caller's
    out: dict[str, Callable[[], torch.Tensor]] = {}
    for rule in adapter.rules(hf_cfg):
        if not _stage_has(rule, shard, shape):
            continue
        tp, r = _tp_of(rule, shard)
        for key, hf_key, expert in _instances(rule, shape, shard):
            if rule.buffer and hf_key(str(rule.hf)) not in hf:  # Adam moments: none for a buffer
                continue

            def make(rule=rule, hf_key=hf_key, expert=expert, tp=tp, r=r) -> torch.Tensor:
                t = _local_mcore(rule, hf, hf_key, expert, shape, tp, r)
                return t.contiguous() if fresh else t.clone(memory_format=torch.contiguous_format)

            out[key] = make
    return out


def hf_to_mcore(
    hf: Mapping[str, torch.Tensor], adapter: Adapter, hf_cfg: Any, shard: Shard
) -> dict[str, torch.Tensor]:
    """The megatron state dict of one model chunk (see :func:`iter_hf_to_mcore`)."""
    return dict(iter_hf_to_mcore(hf, adapter, hf_cfg, shard))


def mcore_to_hf(
    chunks: dict[Shard, dict[str, torch.Tensor]],
    adapter: Adapter,
    hf_cfg: Any,
    *,
    adapters_only: bool = False,
) -> dict[str, torch.Tensor]:
    """The full HF state dict from every chunk's megatron state dict (all TP / PP / VPP / EP shards).
    ``adapters_only``: a checkpoint of LoRA adapters, which holds no frozen base tensor (their rules are
    skipped; an adapter's missing is still an error)."""
    from tessera.models.adapters import is_adapter

    shape = adapter.shape(hf_cfg)
    gathered: dict[tuple[str, str, int | None], dict[int, torch.Tensor]] = {}
    by_key: dict[tuple[str, str, int | None], tuple[Rule, Callable[[str], str]]] = {}
    for shard, sd in chunks.items():
        for rule in adapter.rules(hf_cfg):
            if not _stage_has(rule, shard, shape):
                continue
            _, r = _tp_of(rule, shard)
            frozen = adapters_only and not is_adapter(rule.hf if isinstance(rule.hf, str) else rule.hf[0])
            for key, hf_key, expert in _instances(rule, shape, shard):
                if (rule.buffer or frozen) and key not in sd:  # Adam moments: none for a buffer
                    continue
                ident = (rule.mcore, hf_key(rule.mcore), expert)
                gathered.setdefault(ident, {})[r] = sd[key]
                by_key[ident] = (rule, hf_key)
    out: dict[str, torch.Tensor] = {}
    stacked: dict[str, dict[int, torch.Tensor]] = {}
    packing: dict[str, str] = {}
    for ident, shards in gathered.items():
        rule, hf_key = by_key[ident]
        expert = ident[2]
        ranks = [shards[i] for i in sorted(shards)]
        if rule.split == ROW:
            full = [_cat(ranks, dim=1)]
        elif rule.fuse in ("gate_up", "gate_up_fused"):
            halves = [t.chunk(2, dim=0) for t in ranks]
            full = [_cat([h[0] for h in halves]), _cat([h[1] for h in halves])]
        elif rule.split in (COL, VOCAB):
            full = [_cat(ranks, dim=0)]
        else:
            full = [ranks[0]]
        if rule.split == VOCAB:
            full = [full[0][: shape.vocab_size]]
        if rule.fuse == "qkv":
            full = list(_qkv_split(full[0], shape))
            if not isinstance(rule.hf, tuple):
                full = [torch.cat(full, dim=0)]
        if rule.fuse == "gate_up_fused":
            full = [torch.cat(full, dim=0)]
        if rule.transpose:
            full = [t.t() for t in full]
        names = rule.hf if isinstance(rule.hf, tuple) else (rule.hf,)
        for name, t in zip(names, full, strict=True):
            k = hf_key(name)
            if rule.hf_expert_dim or rule.hf_experts:
                stacked.setdefault(k, {})[expert] = t
                if rule.hf_experts:
                    packing[k] = rule.hf_experts
            elif rule.stage == "output" and k in out:
                continue  # tied head: the embedding already gave this tensor
            else:
                out[k] = compact(t)
    for k, per_expert in stacked.items():
        blocks = [per_expert[e] for e in sorted(per_expert)]
        out[k] = (pack_experts(blocks, packing[k]) if k in packing else torch.stack(blocks)).contiguous()
    return out


def _cat(ts: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """``torch.cat``, without the copy of a single piece (a tp = 1 tensor: the embedding of a global
    checkpoint is the largest tensor an offline reader holds)."""
    return ts[0] if len(ts) == 1 else torch.cat(ts, dim=dim)


def compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` holding no more memory than its own elements: a view of a larger tensor (one of q / k / v,
    vocabulary padding cut off) is copied, so that the input it was cut from can be freed; a tensor that
    is its whole storage is kept as it is (no second copy of it)."""
    whole = t.is_contiguous() and t.storage_offset() == 0
    if whole and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def tp_splits(adapter: Adapter, hf_cfg: Any, shard: Shard) -> dict[str, str]:
    """megatron key -> split kind (repl / col / row / vocab) of every tensor the chunk holds."""
    shape = adapter.shape(hf_cfg)
    return {
        key: rule.split
        for rule in adapter.rules(hf_cfg)
        if _stage_has(rule, shard, shape)
        for key, _, _ in _instances(rule, shape, shard)
    }


def hf_sources(adapter: Adapter, hf_cfg: Any) -> dict[str, set[str]]:
    """HF key -> the megatron keys of the global (tp = 1, pp = 1) chunk that :func:`mcore_to_hf` makes it
    from (q, k and v from one fused tensor; a packed expert tensor from every expert's): an offline reader
    reads just those for one HF tensor."""
    shape = adapter.shape(hf_cfg)
    out: dict[str, set[str]] = {}
    for rule in adapter.rules(hf_cfg):
        if not _stage_has(rule, Shard(), shape):
            continue
        names = rule.hf if isinstance(rule.hf, tuple) else (rule.hf,)
        for key, hf_key, _ in _instances(rule, shape, Shard()):
            for n in names:
                out.setdefault(hf_key(n), set()).add(key)
    return out


def hf_row_sources(adapter: Adapter, hf_cfg: Any) -> dict[str, str]:
    """HF key -> the megatron key of the global chunk whose first rows it is, row for row (no fusing,
    transposing or expert packing: the embedding and the LM head, the vocabulary's padding after its
    rows; a norm; a dense layer's projections): a range of its rows is that range of the megatron
    tensor's, which an offline reader reads alone."""
    shape = adapter.shape(hf_cfg)
    out: dict[str, str] = {}
    seen: set[str] = set()
    for rule in adapter.rules(hf_cfg):
        if not _stage_has(rule, Shard(), shape):
            continue
        plain = isinstance(rule.hf, str) and rule.fuse is None and not rule.transpose
        plain = plain and not rule.hf_expert_dim and rule.hf_experts is None
        for key, hf_key, _ in _instances(rule, shape, Shard()):
            names = rule.hf if isinstance(rule.hf, tuple) else (rule.hf,)
            for n in names:
                k = hf_key(n)
                if k in seen:  # made from more than one rule (a tied head): read whole
                    out.pop(k, None)
                elif plain:
                    out[k] = key
                seen.add(k)
    return out


def hf_keys_covered(adapter: Adapter, hf_cfg: Any) -> set[str]:
    """Every HF key the rules read (the coverage check of a conversion)."""
    shape = adapter.shape(hf_cfg)
    keys: set[str] = set()
    for rule in adapter.rules(hf_cfg):
        names = rule.hf if isinstance(rule.hf, tuple) else (rule.hf,)
        for _, hf_key, _ in _instances(rule, shape, Shard()):
            keys.update(hf_key(n) for n in names)
    return keys


def mcore_to_hf_slices(
    sd: dict[str, torch.Tensor], adapter: Adapter, hf_cfg: Any, shard: Shard
) -> dict[str, list[tuple[torch.Tensor, tuple[tuple[int, int], ...], tuple[int, ...]]]]:
    """What one chunk holds, in HF terms: HF key -> [(tensor, index, full HF shape)], where ``index`` is the
    ``(start, stop)`` range per dimension of the full HF tensor that ``tensor`` fills. The fused tensors
    give several entries: a TP shard of megatron's QKV is a contiguous range of q, of k and of v rows (its
    query groups), of gate_up a range of gate and of up rows. Vocabulary padding is left out. Replicated
    tensors appear on every rank that holds them (the reader picks one)."""
    shape = adapter.shape(hf_cfg)
    out: dict[str, list[tuple[torch.Tensor, tuple[tuple[int, int], ...], tuple[int, ...]]]] = {}
    for rule in adapter.rules(hf_cfg):
        if not _stage_has(rule, shard, shape):
            continue
        tp, r = _tp_of(rule, shard)
        names = rule.hf if isinstance(rule.hf, tuple) else (rule.hf,)
        if rule.hf_experts == "cols":
            continue  # a packed expert's columns are no slice of the HF tensor (only adapters are packed so)
        for key, hf_key, expert in _instances(rule, shape, shard):
            for name_i, t, row0, rows, col0, cols in _local_pieces(rule, sd[key], shape, tp, r):
                if rule.hf_experts == "rows":  # expert e's rows of the packed tensor
                    assert expert is not None
                    row0, rows = row0 + expert * rows, rows * shape.num_experts
                index = [(row0, row0 + t.shape[0])]
                full = [rows]
                if t.dim() == 2:
                    index.append((col0, col0 + t.shape[1]))
                    full.append(cols)
                if rule.transpose and t.dim() == 2:
                    t, index, full = t.t(), index[::-1], full[::-1]
                if rule.hf_expert_dim:
                    t = t.unsqueeze(0)
                    index = [(expert, expert + 1), *index]
                    full = [shape.num_experts, *full]
                out.setdefault(hf_key(names[name_i]), []).append((t, tuple(index), tuple(full)))
    return out


def _local_pieces(
    rule: Rule, t: torch.Tensor, shape: ModelShape, tp: int, r: int
) -> list[tuple[int, torch.Tensor, int, int, int, int]]:
    """The HF pieces of one local megatron tensor, in megatron orientation (rows = output features):
    (index into the rule's HF names, tensor, first row, full rows, first column, full columns)."""
    cols = t.shape[1] if t.dim() == 2 else 0
    if rule.fuse == "qkv":
        g, hq, d = shape.num_query_groups // tp, shape.num_heads // tp, shape.head_dim
        local = ModelShape(
            num_layers=1, num_heads=hq, num_query_groups=g, head_dim=d, vocab_size=shape.vocab_size
        )
        q, k, v = _qkv_split(t, local)
        qf, kf = shape.num_heads * d, shape.num_query_groups * d
        if isinstance(rule.hf, tuple):  # separate q / k / v tensors
            return [
                (0, q, r * hq * d, qf, 0, cols),
                (1, k, r * g * d, kf, 0, cols),
                (2, v, r * g * d, kf, 0, cols),
            ]
        full = qf + 2 * kf  # one [q; k; v] tensor (GPT-2's c_attn)
        return [(0, q, r * hq * d, full, 0, cols), (0, k, qf + r * g * d, full, 0, cols),
                (0, v, qf + kf + r * g * d, full, 0, cols)]  # fmt: skip
    if rule.fuse in ("gate_up", "gate_up_fused"):
        half = t.shape[0] // 2
        gate, up = t[:half], t[half:]
        if rule.fuse == "gate_up":
            return [(0, gate, r * half, half * tp, 0, cols), (1, up, r * half, half * tp, 0, cols)]
        ffn = half * tp
        return [(0, gate, r * half, 2 * ffn, 0, cols), (0, up, ffn + r * half, 2 * ffn, 0, cols)]
    if rule.split == VOCAB:
        start = r * t.shape[0]
        keep = max(0, min(t.shape[0], shape.vocab_size - start))
        return [(0, t[:keep], start, shape.vocab_size, 0, cols)] if keep else []
    if rule.split == COL:
        return [(0, t, r * t.shape[0], t.shape[0] * tp, 0, cols)]
    if rule.split == ROW:
        return [(0, t, 0, t.shape[0], r * cols, cols * tp)]
    return [(0, t, 0, t.shape[0], 0, cols)]
