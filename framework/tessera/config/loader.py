"""Recipe loading: YAML layering with ``include:``, dotted CLI overrides, and where each value came from.

Layering order (later wins): schema defaults < included files (in list order, recursively) < the recipe
file itself < command-line overrides (``parallel.zero=3``). Every leaf value keeps the name of the layer
that set it, so ``tessera config show`` can answer "why is this 3?" without guessing.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel, ValidationError

from tessera.atomic import file_kind
from tessera.config.schema import Recipe
from tessera.errors import RecipeError, preview
from tessera.tables.engines import CAPABILITY_RULES, ENGINES

if TYPE_CHECKING:
    from tessera.rundir import RunDir

DEFAULT = "default"
_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


@dataclass
class ResolvedRecipe:
    """A validated recipe plus the layer that set each dotted key."""

    recipe: Recipe
    sources: dict[str, str] = field(default_factory=dict)
    path: Path | None = None
    plan: dict[str, Any] | None = None  # the planner's answer when the recipe said `parallel: auto`
    notes: list[str] = field(default_factory=list)  # inherited values adapted to the chosen engine

    def source_of(self, dotted: str) -> str:
        return self.sources.get(dotted, DEFAULT)

    def hash(self) -> str:
        return recipe_hash(self.recipe)


def recipe_hash(recipe: Recipe) -> str:
    """sha256 of the canonical JSON of the resolved recipe (what the manifest records)."""
    blob = json.dumps(recipe.to_dict(), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def project_root(start: Path) -> Path | None:
    """The nearest ancestor holding a ``configs/`` directory (where includes are looked up)."""
    for p in [start, *start.parents]:
        if (p / "configs").is_dir():
            return p
    return None


#: the largest recipe, include, acceptance or DeepSpeed JSON file read (a recipe is a few KiB; a path
#: such as /dev/zero or a log file given by mistake must not be read into memory)
MAX_CONFIG_BYTES = 1 << 20


def read_config_file(path: str | Path, *, field: str, what: str, limit: int = MAX_CONFIG_BYTES) -> str:
    """The text of a small input file (a recipe, an include, an acceptance YAML, a DeepSpeed JSON):
    refused unless it is a regular file of at most ``limit`` bytes of UTF-8. Opened non-blocking and
    checked on the open descriptor, so a FIFO never blocks and a file swapped after a check is still
    caught. A missing file raises :class:`FileNotFoundError` (each caller says where to look)."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise  # the caller's message (where such files live)
    except OSError as e:
        raise RecipeError(
            f"cannot open the {what} file ({e.strerror})",
            field=field,
            value=str(p),
            fix="check the path and its permissions",
        ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RecipeError(
                f"the {what} file is {file_kind(st.st_mode)}, not a regular file",
                field=field,
                value=str(p),
                fix=f"give the path of a regular {what} file",
            )
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)  # bounded even if the file grows after fstat
    finally:
        os.close(fd)
    if len(data) > limit:
        raise RecipeError(
            f"the {what} file is over the size limit of {limit:,} bytes "
            f"({max(st.st_size, len(data)):,} bytes; tessera.config.loader.MAX_CONFIG_BYTES)",
            field=field,
            value=str(p),
            fix=f"give the right file: a {what} is a few KiB of text",
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RecipeError(
            f"the {what} file is not UTF-8 text (byte {e.start})",
            field=field,
            value=str(p),
            fix=f"give the path of a {what} file (text)",
        ) from None


def _resolve_include(name: str, including: Path) -> Path:
    cand = [Path(name)] if Path(name).is_absolute() else []
    if not cand:
        cand.append(including.parent / name)
        root = project_root(including.parent.resolve()) or project_root(Path.cwd())
        if root is not None:
            cand += [root / name, root / "configs" / name]
    for c in cand:
        # a FIFO or a device is returned too: reading it then names it (rather than "not found")
        if c.is_file() or (c.exists() and not c.is_dir()):
            return c
    raise RecipeError(
        "included file not found",
        field="include",
        value=name,
        fix=f"looked in {', '.join(str(c) for c in cand)}; give a path relative to the recipe or to configs/",
    )


#: nodes a recipe may expand to, aliases counted at their full size (a recipe is a few hundred)
MAX_NODES = 20_000


class _RecipeLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses a key given twice in one mapping (YAML would keep the last), and
    reads YAML 1.2 floats without a dot (``3e-4``) as floats: YAML 1.1 makes them strings, which the
    strict schema would refuse where a user plainly wrote a number."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise RecipeError(
                    f"the key {key!r} appears twice in one mapping (lines {seen[key]} and {line}); "
                    "YAML would silently keep only the last",
                    field=str(key),
                    value=f"line {line}",
                    fix=f"merge the two {key!r} blocks into one",
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


_RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _expanded_size(node: yaml.Node, memo: dict[int, int]) -> int:
    """Nodes after alias expansion (an alias counts as everything it points at), memoised, so that
    nested anchors ("billion laughs") are measured without being expanded."""
    if id(node) in memo:
        return memo[id(node)]
    memo[id(node)] = 1  # a recursive alias counts once
    if isinstance(node, yaml.MappingNode):
        size = 1 + sum(_expanded_size(k, memo) + _expanded_size(v, memo) for k, v in node.value)
    elif isinstance(node, yaml.SequenceNode):
        size = 1 + sum(_expanded_size(v, memo) for v in node.value)
    else:
        size = 1
    memo[id(node)] = size
    return size


def safe_yaml(text: str, *, where: str) -> Any:
    """A recipe's YAML: duplicate keys refused, alias expansion bounded by :data:`MAX_NODES`."""
    loader = _RecipeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        size = _expanded_size(node, {})
        if size > MAX_NODES:
            raise RecipeError(
                f"the YAML expands to {size:,} nodes through its anchors and aliases (at most {MAX_NODES:,})",
                field="recipe",
                value=where,
                fix="write the values out instead of nesting aliases of aliases",
            )
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _read_yaml(path: Path, *, field: str = "recipe") -> dict[str, Any]:
    try:
        text = read_config_file(path, field=field, what="recipe" if field == "recipe" else "included")
        if not text.strip():
            raise RecipeError(
                "the recipe file is empty",
                field="recipe",
                value=str(path),
                fix="write at least a model section (see recipes/tiny-llama-cpu.yaml)",
            )
        data = safe_yaml(text, where=str(path)) or {}
    except FileNotFoundError:
        raise RecipeError(
            "recipe file not found",
            field=field,
            value=str(path),
            fix="check the path (recipes live in recipes/)",
        ) from None
    except yaml.YAMLError as e:
        raise RecipeError(
            f"not valid YAML: {e}",
            field="recipe",
            value=str(path),
            fix="fix the YAML syntax at the position shown",
        ) from None
    if not isinstance(data, dict):
        raise RecipeError(
            "a recipe must be a mapping of sections",
            field="recipe",
            value=str(path),
            fix="start the file with sections such as 'model:' and 'parallel:'",
        )
    return data


def _is_section(key: str, value: Any) -> bool:
    """A nested mapping of recipe fields; ``model.hf_config`` is one value (an HF config dict), not a section."""
    return isinstance(value, dict) and not key.endswith("hf_config")


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``, the dotted keys that provenance is recorded under."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if _is_section(key, v) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _merge(
    dst: dict[str, Any], src: dict[str, Any], label: str, sources: dict[str, str], pre: str = ""
) -> None:
    """Deep-merge ``src`` into ``dst`` (hf_config is replaced whole), recording ``label`` per leaf."""
    for k, v in src.items():
        key = f"{pre}{k}"
        if key == "parallel" and v == "auto":  # `parallel: auto` is short for `parallel: {auto: true}`
            v = {"auto": True}
        if _is_section(key, v) and isinstance(dst.get(k), dict):
            _merge(dst[k], v, label, sources, key + ".")
        else:
            dst[k] = v
            _record(sources, key, v, label)


def _record(sources: dict[str, str], key: str, value: Any, label: str) -> None:
    leaves = flatten(value, key + ".") if _is_section(key, value) else {key: value}
    for leaf in leaves:
        sources[leaf] = label


def _load_layers(
    path: Path, sources: dict[str, str], seen: tuple[Path, ...] = (), *, field: str = "recipe"
) -> dict[str, Any]:
    rp = path.resolve()
    if rp in seen:
        raise RecipeError(
            "include cycle",
            field="include",
            value=str(path),
            fix="remove the include that points back at " + " -> ".join(map(str, seen)),
        )
    raw = _read_yaml(path, field=field)
    given = raw.pop("include", None)
    includes = [] if given is None else [given] if isinstance(given, str) else given
    if not isinstance(includes, list) or not all(isinstance(i, str) and i.strip() for i in includes):
        raise RecipeError(
            f"include must be a file name or a list of file names (in {path})",
            field="include",
            value=given,
            fix="e.g. include: [configs/models/tiny-llama.yaml, configs/deepspeed/zero2.yaml]",
        )
    merged: dict[str, Any] = {}
    for inc in includes:
        layer = _load_layers(_resolve_include(inc, path), sources, (*seen, rp), field="include")
        _merge(merged, layer, "", {})  # values only; sources recorded by the recursive call
    label = _label(path)
    _merge(merged, raw, label, sources)
    return merged


def _label(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def parse_override(text: str) -> tuple[str, Any]:
    """``parallel.zero=3`` -> ("parallel.zero", 3); the value is parsed as YAML (numbers, lists, null)."""
    if "=" not in text:
        raise RecipeError(
            "an override must look like section.field=value",
            field="override",
            value=text,
            fix="e.g. parallel.zero=3 or optim.lr=3e-4",
        )
    key, _, val = text.partition("=")
    key = key.strip()
    if not key or key.startswith(".") or key.endswith("."):
        raise RecipeError("bad override key", field="override", value=text, fix="e.g. parallel.zero=3")
    try:
        parsed = yaml.safe_load(val) if val.strip() else ""
    except yaml.YAMLError:
        parsed = val
    # YAML 1.1 reads 3e-4 (no dot) as a string; users mean a float (a quoted '3e-4' stays a string).
    if isinstance(parsed, str) and _FLOAT.match(val.strip()):
        parsed = float(parsed)
    return key, parsed


def _set_dotted(d: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    cur = d
    for p in parts[:-1]:
        nxt = cur.get(p)
        if not isinstance(nxt, dict):
            nxt = {}
            cur[p] = nxt
        cur = nxt
    cur[parts[-1]] = value


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> ResolvedRecipe:
    """Load, layer, override and validate a recipe; user mistakes raise :class:`RecipeError`."""
    path = Path(path)
    sources: dict[str, str] = {}
    data = _load_layers(path, sources)
    for ov in overrides or []:
        key, val = parse_override(ov)
        _set_dotted(data, key, val)
        _record(sources, key, val, f"override {ov}")
    notes = _fit_inherited_to_engine(data, sources)
    recipe = validate_recipe(data)
    return ResolvedRecipe(recipe=recipe, sources=sources, path=path, notes=notes)


def recipe_with(recipe: Recipe, overrides: list[str]) -> Recipe:
    """``recipe`` with dotted overrides applied as :func:`load_recipe` applies the command line's: where
    they switch ``parallel.engine``, the recipe's settings the new engine cannot run fall back to its
    defaults (the recipe's every value counts as set by its layers, none as an override)."""
    data = recipe.to_dict()
    sources = {key: "recipe" for key in flatten(data)}
    for ov in overrides:
        key, val = parse_override(ov)
        _set_dotted(data, key, val)
        _record(sources, key, val, f"override {ov}")
    _fit_inherited_to_engine(data, sources)
    return validate_recipe(data)


def _fit_inherited_to_engine(data: dict[str, Any], sources: dict[str, str]) -> list[str]:
    """When an override switches ``parallel.engine`` (``parallel.engine=ddp`` on a ZeRO-2 recipe), the
    parallel settings the recipe's layers made for the old engine and the new one cannot run fall back to
    the new engine's defaults, each with a note naming the layer that set it: by the capability rule set
    the layout rules refuse with (:data:`tessera.tables.engines.CAPABILITY_RULES`, in its order). A value
    given as an override itself is never changed: a conflict there is an error, raised by the layout
    rules."""
    par = data.get("parallel")
    if not isinstance(par, dict) or not sources.get("parallel.engine", "").startswith("override"):
        return []
    spec = ENGINES.get(par.get("engine"))  # type: ignore[arg-type]
    if spec is None:
        return []  # the schema names the unknown engine
    caps = spec.caps
    notes = []
    for rule in CAPABILITY_RULES:
        key, dotted = rule.key, f"parallel.{rule.key}"
        src = sources.get(dotted, DEFAULT)
        if key in par and not src.startswith("override") and not rule.allows(caps, par[key]):
            default = rule.default(caps)
            notes.append(
                f"{dotted}={par[key]!r} (set by {src}) does not apply to engine '{spec.name}': using {default!r}"
            )
            par[key] = default
            sources[dotted] = f"engine {spec.name} default"
    return notes


def validate_recipe(data: dict[str, Any]) -> Recipe:
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise _friendly(e, data) from None


def write_recipe(recipe: Recipe, run_dir: RunDir) -> None:
    """recipe.resolved.yaml, the recipe every rank reads (atomically: a rank never sees half of it)."""
    from tessera.atomic import write_text_atomic

    run_dir.path.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run_dir.recipe, yaml.safe_dump(recipe.to_dict(), sort_keys=False))


def load_run_recipe(run_dir: RunDir) -> Recipe:
    """The run's recipe.resolved.yaml, validated."""
    return validate_recipe(yaml.safe_load(run_dir.recipe.read_text()))


def _known_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, f in model.model_fields.items():
        ann = f.annotation
        key = f"{prefix}{f.alias or name}"
        out.append(key)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _known_fields(ann, key + ".")
    return out


def _get(data: dict[str, Any], loc: tuple[Any, ...]) -> Any:
    cur: Any = data
    for p in loc:
        if (isinstance(cur, dict) and p in cur) or (
            isinstance(cur, list | tuple) and isinstance(p, int) and p < len(cur)
        ):
            cur = cur[p]
        else:
            return None
    return cur


def field_description(dotted: str) -> str | None:
    model: type[BaseModel] = Recipe
    parts = dotted.split(".")
    for i, p in enumerate(parts):
        f = next((f for n, f in model.model_fields.items() if (f.alias or n) == p), None)
        if f is None:
            return None
        if i == len(parts) - 1:
            return f.description
        ann = f.annotation
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return None


#: the member names pydantic puts in an error's location for a union (``int | Literal["auto"]``)
_UNION_TAGS = frozenset({"int", "bool", "float", "str"})


def _reason(err: Any) -> str:
    reason = str(err["msg"]).removeprefix("Value error, ")
    value = err.get("input")
    if err["type"] in ("int_type", "float_type") and isinstance(value, bool):
        reason += " (true / false is a boolean, not a number)"
    elif err["type"] == "bool_type" and isinstance(value, int | float):
        reason += " (write true or false)"
    return reason


def _friendly(e: ValidationError, data: dict[str, Any]) -> RecipeError:
    """Turn pydantic's report into one message per problem: field, value, fix. The alternatives of a
    union (``parallel.dp``: an integer or 'auto') are one problem, their reasons joined."""
    known = _known_fields(Recipe)
    lines: list[str] = []
    wrong: dict[str, tuple[int, Any, list[str]]] = {}  # dotted -> (line, value, reasons)
    first_field, first_value = None, None
    for err in e.errors():
        loc = tuple(
            p
            for p in err["loc"]
            if not (isinstance(p, str) and (p.startswith(("function-", "literal[")) or p in _UNION_TAGS))
        )
        dotted = ".".join(str(p) for p in loc if not isinstance(p, int)) or "recipe"
        value = err.get("input") if err["type"] != "missing" else None
        if err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(dotted, known, n=1, cutoff=0.6)
            fix = (
                f"did you mean '{close[0]}'?"
                if close
                else "remove it; see `tessera config show` for the fields"
            )
            msg = f"{dotted} = {preview(value)}: unknown field\n  fix: {fix}"
        elif err["type"] == "missing":
            desc = field_description(dotted)
            msg = f"{dotted}: required field is missing\n  fix: add {dotted} to the recipe" + (
                f" ({desc})" if desc else ""
            )
        else:
            value = _get(data, loc) if value is None else value
            if dotted in wrong:  # another alternative of the same union (or another item of a list)
                other = _reason(err).removeprefix("Input should be ")
                if not any(r.endswith(other) for r in wrong[dotted][2]):
                    wrong[dotted][2].append(other)
                continue
            wrong[dotted] = (len(lines), value, [_reason(err)])
            msg = ""  # written below, once every alternative is known
        if first_field is None:
            first_field, first_value = dotted, value
        lines.append(msg)
    for dotted, (i, value, reasons) in wrong.items():
        desc = field_description(dotted)
        fix = "see the recipe schema"
        if desc:  # "is the ..." unless the description brings its own article
            article = "" if desc.split(" ", 1)[0].lower() in ("the", "a", "an") else "the "
            fix = f"{dotted} is {article}{desc}"
        lines[i] = f"{dotted} = {preview(value)}: {' or '.join(reasons)}\n  fix: {fix}"
    err = RecipeError("\n".join(lines))
    err.field, err.value, err.framed = first_field, first_value, True
    return err
