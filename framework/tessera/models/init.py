"""Initial weights as a function of (seed, HF tensor name): any rank makes exactly the part it holds.

Every engine and layout starts from the same weights, so that runs are comparable step by step. Building
the whole HF model on every rank to get them costs the whole model in host memory per rank (32 GB in fp32
for an 8B model, eight ranks per node). Here a tensor's values depend only on the seed, its name and the
family's init rule, and are drawn in blocks of rows, each block from its own generator: a rank asks for a
part (ZeRO-3's flat partition, a TP slice, one expert) and only the blocks covering it are drawn.

The rule (``INIT_RULE``, recorded in the manifest) follows the HF families' own initialisation:
- a bias: zeros; any other 1-D parameter (RMSNorm / LayerNorm weights): ones;
- everything else (linear, embedding, fused expert tensors, GPT-2's Conv1D): normal(0, std) with std =
  the config's ``initializer_range``, and GPT-2's residual projections (``c_proj``) at std / sqrt(2 n_layer);
- tied weights (the LM head tied to the embedding) are one tensor under both names.

:class:`SeededWeights` and :class:`~tessera.tensorfile.LazyTensors` are the two sources of initial
weights; both are Mappings by HF name with ``part(name, index)``, read through :func:`read_part` /
:func:`read_flat` (a plain dict works too: it is sliced in memory).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch

INIT_RULE = "tessera-init-v1"
#: the largest block of rows drawn from one generator (elements); a row longer than this is one block
BLOCK_ELEMS = 1 << 20

Index = tuple[int | slice, ...]


def _seed_of(seed: int, name: str, block: int) -> int:
    digest = hashlib.sha256(f"{INIT_RULE}|{seed}|{name}|{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class SeededWeights(Mapping[str, torch.Tensor]):
    """The initial weights of ``hf_cfg``'s model from ``seed``, by HF name, drawn on access (fp32, CPU).

    ``part(name, index)`` draws only the rows that ``index`` touches. The tensor names and shapes come
    from the model built on the meta device (no memory)."""

    def __init__(self, hf_cfg: Any, seed: int) -> None:
        from transformers import AutoModelForCausalLM

        from tessera.tables.families import family_of

        self.seed = seed
        self.family = family_of(hf_cfg.model_type)
        self.std = float(getattr(hf_cfg, "initializer_range", 0.02))
        self.layers = int(getattr(hf_cfg, "num_hidden_layers", getattr(hf_cfg, "n_layer", 1)))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_cfg)
        owner: dict[int, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.alias: dict[str, str] = {}  # tied names -> the name whose values they share
        for name, p in model.named_parameters(remove_duplicate=False):
            self.shapes[name] = tuple(p.shape)
            self.alias[name] = owner.setdefault(id(p), name)
        #: 1-D tensors and persistent buffers of a family without an entry: the constant its own init sets
        self.consts: dict[str, float] = {}
        persistent = [n for n in model.state_dict() if n not in self.shapes]
        if self.family.generic:
            self.consts = own_init_constants(model, persistent)
            for name in persistent:
                self.shapes[name] = tuple(model.get_buffer(name).shape)
                self.alias[name] = name
        elif persistent:  # no family with an entry has one; one that adds one must give it a rule here
            from tessera.errors import RecipeError

            raise RecipeError(
                f"the model has persistent buffers the init rule ({INIT_RULE}) cannot make: {persistent[:3]}",
                field="model.hf_config.model_type",
                value=hf_cfg.model_type,
                fix="start from weights instead (model.path with model.pretrained: true)",
            )

    # ---- the rule -------------------------------------------------------------------------------
    def rule(self, name: str) -> tuple[str, float]:
        """("zeros" | "ones" | "normal", std) for the tensor ``name``."""
        shape = self.shapes[self.alias[name]]
        if self.alias[name] in self.consts:
            return "const", self.consts[self.alias[name]]
        if name.endswith(".bias"):
            return "zeros", 0.0
        if len(shape) == 1:
            return "ones", 0.0
        if any(name.endswith(s) for s in self.family.scaled_init):
            return "normal", self.std / math.sqrt(2 * self.layers)
        return "normal", self.std

    # ---- Mapping --------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> torch.Tensor:
        return self.part(name, ())

    def shape_of(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def part(self, name: str, index: Index) -> torch.Tensor:
        """``tensor[index]`` without drawing the rows outside it (``index``: see :func:`_plan`)."""
        shape = self.shapes[name]
        kind, std = self.rule(name)
        if kind != "normal":
            value = {"ones": 1.0, "zeros": 0.0}.get(kind, std)
            return torch.full(shape, value)[index].contiguous()
        try:
            rows, cols, out_shape = _plan(shape, index)
        except ValueError:  # another form: drawn whole (one tensor), then indexed
            return self.part(name, ())[index].contiguous()
        width = shape[-1]
        per_block = max(1, BLOCK_ELEMS // width)
        total = math.prod(shape[:-1])
        out = torch.empty(len(rows), cols.stop - cols.start)  # filled block by block: no second copy
        for b in range(rows.start // per_block, -(-rows.stop // per_block)):
            g = torch.Generator().manual_seed(_seed_of(self.seed, self.alias[name], b))
            lo, hi = b * per_block, min((b + 1) * per_block, total)
            block = torch.empty(hi - lo, width).normal_(0.0, std, generator=g)
            a, z = max(rows.start, lo), min(rows.stop, hi)
            out[a - rows.start : z - rows.start] = block[a - lo : z - lo, cols]
        return out.reshape(out_shape)


def own_init_constants(model: torch.nn.Module, buffers: list[str]) -> dict[str, float]:
    """The value the model's own ``_init_weights`` gives each 1-D parameter and each persistent buffer in
    ``buffers``: for a family without an entry, whose norms may start at zero (Gemma's ``1 + weight``) and
    whose routers may carry a correction bias (DeepSeek-V3). The owning modules of a model built on the meta
    device are made on the CPU one at a time (their own tensors only) and initialised; a 1-D tensor the
    init does not set to one constant has no rule here (an error naming it). Tensors of 2+ dims keep the
    rule of every HF family's init, normal(0, initializer_range)."""
    from tessera.errors import RecipeError

    wanted = {n for n, p in model.named_parameters() if p.dim() == 1} | set(buffers)
    out: dict[str, float] = {}
    for prefix, module in model.named_modules():
        local = [
            n for n, _ in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        ]
        mine = {n: f"{prefix}.{n}" if prefix else n for n in local}
        if not any(full in wanted for full in mine.values()):
            continue
        module.to_empty(device="cpu", recurse=False)
        with torch.no_grad():
            model._init_weights(module)
        for n, name in mine.items():
            if name not in wanted:
                continue
            t = getattr(module, n)
            lo, hi = float(t.detach().min()), float(t.detach().max())
            if lo != hi:
                raise RecipeError(
                    f"the model's own init draws {name} at random; the seeded rule ({INIT_RULE}) has no rule for it",
                    field="model.hf_config.model_type",
                    value=type(model).__name__,
                    fix="start from weights instead (model.path with model.pretrained: true)",
                )
            out[name] = lo
    return out


def _plan(shape: tuple[int, ...], index: Index) -> tuple[range, slice, tuple[int, ...]]:
    """For ``tensor[index]``: the rows of the tensor's 2-D view (leading dims flattened, last dim the
    columns) that cover it, the column slice, and the result's shape. ``index``: leading ints (e.g. an
    expert), then at most one step-1 slice of the next dim with every later leading dim whole, and any
    step-1 slice of the last dim - the forms TP, EP and ZeRO-3 partitions take."""
    n = len(shape)
    idx = [*index, *[slice(None)] * (n - len(index))]
    k = 0
    while k < n - 1 and isinstance(idx[k], int):
        k += 1
    base = 0
    for i in range(k):
        base = base * shape[i] + int(idx[i]) % shape[i]
    cols = idx[-1] if isinstance(idx[-1], slice) else slice(int(idx[-1]), int(idx[-1]) + 1)
    c0, c1, step = cols.indices(shape[-1])
    if step != 1 or any(idx[i] != slice(None) for i in range(k + 1, n - 1)):
        raise ValueError(f"unsupported index {index} of a tensor of shape {shape}")
    width = [c1 - c0] if isinstance(idx[-1], slice) else []
    if k == n - 1:  # every leading dim indexed: one row
        return range(base, base + 1), slice(c0, c1), tuple(width)
    a, b, step = idx[k].indices(shape[k]) if isinstance(idx[k], slice) else (0, 0, 0)
    if step != 1:
        raise ValueError(f"unsupported index {index} of a tensor of shape {shape}")
    inner = math.prod(shape[k + 1 : -1])
    first = (base * shape[k] + a) * inner
    return range(first, first + (b - a) * inner), slice(c0, c1), (b - a, *shape[k + 1 : -1], *width)


def shape_of(tensors: Mapping[str, torch.Tensor], name: str) -> tuple[int, ...]:
    """The shape of ``tensors[name]`` without reading it where the source knows it (a header, the rule)."""
    shape = getattr(tensors, "shape_of", None)
    return tuple(shape(name)) if shape is not None else tuple(tensors[name].shape)


def read_part(tensors: Mapping[str, torch.Tensor], name: str, index: Index) -> torch.Tensor:
    """``tensors[name][index]``, reading / drawing only that part where the source can."""
    part = getattr(tensors, "part", None)
    if part is not None:
        return part(name, index)
    return tensors[name][index]


def read_flat(
    tensors: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...], start: int, stop: int
) -> torch.Tensor:
    """Elements ``[start, stop)`` of the flattened tensor ``name`` (a ZeRO-3 partition), reading only
    the dim-0 rows that cover them."""
    if not shape:
        return tensors[name].reshape(-1)[start:stop]
    row = math.prod(shape[1:])
    r0, r1 = start // row, -(-stop // row)
    rows = read_part(tensors, name, (slice(r0, r1),))
    return rows.reshape(-1)[start - r0 * row : stop - r0 * row]
