"""Render kernel templates into self-contained modules, write them, and import them by path.

A family (`onboarding.families`) declares its template, a typed parameter schema, its variants,
tuning space and shape buckets as a `FamilySpec`. `render(family, variant, params)` validates
the parameters first (a bad parameter raises `InputError` naming it; nothing is written), then
renders `kernel_templates/<family>.py.j2` deterministically: the same parameters give a
byte-identical module. `write_module` stores it as `kernels/<family>/<variant>.py` and
`load_module` imports such a file by path under a private name
(`onboard_kernels.<family>.<variant>_<sha>`), never as a top-level `kernels` package (that name
belongs to the Hugging Face kernel hub). Rendered source must live in a file: Triton's `@jit`
reads the function source back, so `exec()` of a string fails outside the interpreter.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from onboarding.errors import InputError

TEMPLATE_DIR = Path(__file__).resolve().parents[1] / "kernel_templates"
MODULE_PREFIX = "onboard_kernels"
_IDENT = re.compile(r"^[a-z][a-z0-9_]*$")
_PARAM_TYPES = (bool, int, float, str)


# Runtime helpers shared by every rendered module (included as "_common.py.j2"). Kept here so
# each rendered module stays self-contained without a second template file per family.
_COMMON_TEMPLATE = """\
# ---- shared runtime: tile configs, shape buckets, output poisoning, dots -----------------------
import os as _os

_CONFIG_OVERRIDE: dict | None = None
_TUNED: dict = {}
# The contract suite sets this so outputs start as NaN and unwritten elements show up.
_POISON_OUTPUTS = False


def shape_bucket(size: int) -> str:
    \"\"\"Name of the SHAPE_BUCKETS entry whose [lo, hi] holds `size` (the last one past the end).\"\"\"
    for bucket in SHAPE_BUCKETS:
        if bucket["lo"] <= size <= bucket["hi"]:
            return bucket["name"]
    return SHAPE_BUCKETS[-1]["name"]


def set_config(config: dict | None = None, bucket: str | None = None) -> None:
    \"\"\"Pin tile config values for one shape bucket, or for all shapes when `bucket` is None.

    Keys and values must come from TUNING_SPACE; the keys a pin leaves out keep the bucket's own
    values (see `config_for`). `config=None` clears the pin.
    \"\"\"
    global _CONFIG_OVERRIDE
    if config is not None:
        for key, value in config.items():
            if key not in TUNING_SPACE or value not in TUNING_SPACE[key]:
                raise ValueError(f"config {key}={value!r} is not in TUNING_SPACE {TUNING_SPACE}")
        config = dict(config)
    if bucket is None:
        _CONFIG_OVERRIDE = config
    elif bucket not in [b["name"] for b in SHAPE_BUCKETS]:
        raise ValueError(f"unknown shape bucket {bucket!r}")
    elif config is None:
        _TUNED.pop(bucket, None)
    else:
        _TUNED[bucket] = config


def config_for(size: int) -> dict:
    \"\"\"The tile config used for a problem whose bucketed dimension is `size`: DEFAULT_CONFIG,
    then its bucket's values, the bucket's pin (tuned.json), the all-shapes pin, each over the
    last.\"\"\"
    name = shape_bucket(size)
    bucket = next(b for b in SHAPE_BUCKETS if b["name"] == name)
    return {**DEFAULT_CONFIG, **bucket["config"], **_TUNED.get(name, {}), **(_CONFIG_OVERRIDE or {})}


def _empty(shape, dtype, device) -> torch.Tensor:
    if _POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _dot_mode(precision: str, dtype: torch.dtype, device: torch.device) -> str:
    \"\"\"The `_dot` mode for inputs of `dtype`: their own 16-bit tensor-core dot on a GPU.

    bf16/fp16 inputs on a GPU dot in that dtype (fp32 accumulation), twice tf32's rate and half
    its operand traffic. fp32 inputs use the config's `precision` ("tf32"/"ieee"), "ieee" unless
    torch allows tf32 for fp32 matmuls. The interpreter computes bf16 dots wrongly (DESIGN.md):
    it keeps fp32 operands.
    \"\"\"
    if (dtype in (torch.bfloat16, torch.float16) and device.type == "cuda"
            and _os.environ.get("TRITON_INTERPRET", "0") in ("", "0")):
        return "bf16" if dtype == torch.bfloat16 else "fp16"
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return precision


def _aot_dot_mode(dtype: str, precision: str) -> str:
    \"\"\"The `_dot_mode` a GPU run with `dtype` ("bf16"/"fp16"/"fp32") inputs picks, for AOT specs:
    16-bit specs compile the 16-bit tensor-core path, fp32 ones `precision`.\"\"\"
    return dtype if dtype in ("bf16", "fp16") else precision


@triton.jit
def _operand(b_x, MODE: tl.constexpr):
    \"\"\"A loaded tile used only as a dot operand: kept in its 16-bit storage dtype for a 16-bit
    `_dot` (no round trip through fp32, half the registers), else fp32 (the interpreter's bf16
    maths is wrong).\"\"\"
    if MODE == "bf16" or MODE == "fp16":
        return b_x
    else:
        return b_x.to(tl.float32)


@triton.jit
def _cast_operand(b_x, MODE: tl.constexpr):
    \"\"\"A computed fp32 tile that is from then on only a dot operand: cast once to a 16-bit
    `_dot`'s dtype (which the dot would cast it to anyway), so that a tile held across a loop
    takes half the registers; unchanged for 32-bit modes.\"\"\"
    if MODE == "bf16":
        return b_x.to(tl.bfloat16)
    elif MODE == "fp16":
        return b_x.to(tl.float16)
    else:
        return b_x


@triton.jit
def _dot(a, b, MODE: tl.constexpr):
    \"\"\"tl.dot with fp32 accumulation; MODE from `_dot_mode` ("bf16"/"fp16" cast the operands).\"\"\"
    if MODE == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif MODE == "fp16":
        return tl.dot(a.to(tl.float16), b.to(tl.float16))
    else:
        return tl.dot(a, b, input_precision=MODE)


@triton.jit
def _band(NT, NC, GROUP_M: tl.constexpr):
    \"\"\"(row tile, column tile) of this program of a 1-D grid over NT row tiles x NC column tiles,
    walked in bands of GROUP_M row tiles, row tile fastest: the programs in flight together cover
    a band's row tiles across its column tiles, so each row tile (gathered or not) and each
    expert's weight tile comes from HBM about once (then from L2), not once per column tile.\"\"\"
    pid = tl.program_id(0)
    width = GROUP_M * NC
    first = (pid // width) * GROUP_M
    rows = tl.minimum(NT - first, GROUP_M)
    return first + (pid % width) % rows, (pid % width) // rows


def _band_grid(n_tiles: int, cols: int, block_n: int) -> tuple[int]:
    \"\"\"1-D grid of a row-tiled grouped GEMM (`_band` maps each program to its row and column tile).\"\"\"
    return (n_tiles * triton.cdiv(cols, block_n),)


def _num_programs(n_blocks: int, device: torch.device, per_sm: int = 4) -> int:
    \"\"\"Programs for a grid-stride loop: `per_sm` per SM on a GPU, one per block otherwise.\"\"\"
    if device.type == "cuda":
        return max(1, min(n_blocks, per_sm * torch.cuda.get_device_properties(device).multi_processor_count))
    return max(1, n_blocks)
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class Param:
    """One render parameter: type, default, and the allowed values or range.

    `choices` lists the allowed values; `min`/`max` bound numbers (inclusive); `nullable` admits
    None; `variants` restricts the parameter to some variants (elsewhere it must stay default).
    """

    name: str
    type: type
    default: Any
    doc: str = ""
    choices: tuple[Any, ...] | None = None
    min: float | None = None
    max: float | None = None
    nullable: bool = False
    variants: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.type not in _PARAM_TYPES:
            raise TypeError(f"param {self.name!r}: type must be one of {_PARAM_TYPES}")

    def check(self, value: Any, where: str) -> Any:
        """Return `value` coerced to this parameter's type, or raise InputError naming it."""
        if value is None:
            if self.nullable:
                return None
            raise InputError(f"{where}: parameter {self.name!r} must not be None")
        if self.type is bool:
            ok = isinstance(value, bool)
        elif self.type is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif self.type is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            value = float(value) if ok else value
            if ok and not math.isfinite(value):
                raise InputError(f"{where}: parameter {self.name!r} must be finite, got {value!r}")
        else:
            ok = isinstance(value, str)
        if not ok:
            raise InputError(
                f"{where}: parameter {self.name!r} must be {self.type.__name__}"
                f"{' or None' if self.nullable else ''}, got {type(value).__name__} {value!r}"
            )
        if self.choices is not None and value not in self.choices:
            raise InputError(
                f"{where}: parameter {self.name!r} must be one of {list(self.choices)}, got {value!r}"
            )
        if self.min is not None and value < self.min:
            raise InputError(f"{where}: parameter {self.name!r} must be >= {self.min}, got {value!r}")
        if self.max is not None and value > self.max:
            raise InputError(f"{where}: parameter {self.name!r} must be <= {self.max}, got {value!r}")
        return value


@dataclass(frozen=True, slots=True, kw_only=True)
class ShapeBucket:
    """A named range of the dimension that decides tile sizes (`dim` in [lo, hi]).

    `config` holds this bucket's untuned default tile config (over the family default), so a
    wide row does not start from a config that spills; tuning replaces it per bucket.
    """

    name: str
    dim: str
    lo: int
    hi: int
    config: Mapping[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dim": self.dim, "lo": self.lo, "hi": self.hi, "config": dict(self.config)}


@dataclass(frozen=True, slots=True, kw_only=True)
class FamilySpec:
    """Declaration of a kernel family: template, schema, variants, tuning space, buckets.

    `check` (optional) validates combinations of parameters after the per-parameter checks and
    raises InputError; `match` maps an `opgraph.Block` to `{"variant": ..., "params": ...}`;
    `sample_inputs` builds fresh random entry arguments for a candidate's correctness check.
    """

    name: str
    template: str
    template_version: int
    variants: Mapping[str, str]
    params: tuple[Param, ...]
    tuning_space: Mapping[str, tuple[Any, ...]]
    default_config: Mapping[str, Any]
    shape_buckets: tuple[ShapeBucket, ...]
    check: Callable[[str, dict[str, Any]], None] | None = None
    match: Callable[[Any], dict[str, Any] | None] | None = field(default=None, compare=False)
    # sample_inputs(variant, params, shapes, generator) -> positional args of the entry function
    # at the block's real widths (``shapes``: its input shapes): the generate stage's check.
    sample_inputs: Callable[..., list[Any]] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not self.shape_buckets:
            raise ValueError(f"family {self.name!r}: needs at least one shape bucket")
        self.check_config(self.default_config)
        for b in self.shape_buckets:
            self.check_config(b.config)

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)

    def defaults(self, variant: str) -> dict[str, Any]:
        self._check_variant(variant)
        return {p.name: p.default for p in self.params}

    def resolve(self, variant: str, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Validated, complete parameters for `variant` (defaults filled in), sorted by name."""
        self._check_variant(variant)
        params = dict(params or {})
        where = f"{self.name}/{variant}"
        unknown = sorted(set(params) - {p.name for p in self.params})
        if unknown:
            known = sorted(p.name for p in self.params)
            raise InputError(f"{where}: unknown parameter(s) {unknown}; known: {known}")
        out: dict[str, Any] = {}
        for p in sorted(self.params, key=lambda p: p.name):
            value = p.check(params.get(p.name, p.default), where)
            if p.variants is not None and variant not in p.variants and value != p.default:
                raise InputError(
                    f"{where}: parameter {p.name!r} applies only to variants {list(p.variants)}"
                )
            out[p.name] = value
        if self.check is not None:
            self.check(variant, out)
        return out

    def served(self, variant: str, params: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
        """A family `match` result, ``{"variant", "params"}`` (resolved), or None when the block's
        parameters are outside what `variant` renders (the family cannot serve that block)."""
        try:
            return {"variant": variant, "params": self.resolve(variant, params)}
        except InputError:
            return None

    def check_config(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """Validate a tile config against the tuning space (keys and values)."""
        bad = sorted(set(config) - set(self.tuning_space))
        if bad:
            raise InputError(f"{self.name}: unknown config key(s) {bad}; known: {sorted(self.tuning_space)}")
        for k, v in config.items():
            if v not in self.tuning_space[k]:
                raise InputError(f"{self.name}: config {k}={v!r} not in {list(self.tuning_space[k])}")
        return dict(sorted(config.items()))

    def _check_variant(self, variant: str) -> None:
        if variant not in self.variants:
            raise InputError(
                f"{self.name}: unknown variant {variant!r}; known: {sorted(self.variants)}"
            )


def families() -> dict[str, FamilySpec]:
    """All declared families by name (imported lazily: the declarations import this module)."""
    from onboarding import families as fam

    return {f.name: f for f in fam.FAMILIES}


def get_family(family: str | FamilySpec) -> FamilySpec:
    if isinstance(family, FamilySpec):
        return family
    table = families()
    if family not in table:
        raise InputError(f"unknown kernel family {family!r}; known: {sorted(table)}")
    return table[family]


def match_block(block: Any) -> list[tuple[str, dict[str, Any]]]:
    """Every family whose `match` accepts `block`, as (family name, {"variant", "params"})."""
    out = []
    for name, spec in sorted(families().items()):
        if spec.match is not None and (m := spec.match(block)) is not None:
            # a block may need several variants of one family (sparse attention: the indexer
            # and the gathered attention); the extra ones come under "also"
            for one in (m, *m.get("also", ())):
                out.append((name, {"variant": one["variant"], "params": one["params"]}))
    return out


def py_literal(value: Any) -> str:
    """Deterministic Python literal (dict keys sorted, floats by repr)."""
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"non-finite float {value!r} cannot be rendered")
        return repr(value)
    if isinstance(value, Mapping):
        items = ", ".join(f"{py_literal(k)}: {py_literal(v)}" for k, v in sorted(value.items()))
        return "{" + items + "}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(py_literal(v) for v in value)
        if isinstance(value, tuple):
            return "(" + inner + ("," if len(value) == 1 else "") + ")"
        return "[" + inner + "]"
    raise TypeError(f"cannot render {type(value).__name__} as a literal")


def params_hash(family: str, variant: str, version: int, params: Mapping[str, Any],
                tag: str | None = None) -> str:
    parts = [family, variant, version, dict(params)] + ([tag] if tag is not None else [])
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:8]


def _environment(template_dir: Path):
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.ChoiceLoader(
            [
                jinja2.DictLoader({"_common.py.j2": _COMMON_TEMPLATE}),
                jinja2.FileSystemLoader(str(template_dir)),
            ]
        ),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["py"] = py_literal
    return env


def render(
    family: str | FamilySpec,
    variant: str,
    params: Mapping[str, Any] | None = None,
    *,
    template_dir: Path | None = None,
    tag: str | None = None,
) -> str:
    """Validate `params` for `family`/`variant` and return the rendered module source.

    `template_dir`: templates other than kernel_templates/ (another revision's); `tag` then
    keeps the module's custom op names apart from the tree's (they share one op registry).
    Raises InputError (naming the parameter) on a bad family, variant or parameter; raises
    RuntimeError if the template produced invalid Python (a template bug).
    """
    spec = get_family(family)
    resolved = spec.resolve(variant, params)
    digest = params_hash(spec.name, variant, spec.template_version, resolved, tag)
    context = {
        "family": spec.name,
        "variant": variant,
        "template": spec.template,
        "template_version": spec.template_version,
        "params": resolved,
        "params_json": json.dumps(resolved, sort_keys=True),
        "op_name": f"{spec.name}_{variant}_{digest}",
        "tuning_space": {k: list(v) for k, v in spec.tuning_space.items()},
        "default_config": dict(spec.default_config),
        "shape_buckets": [b.as_dict() for b in spec.shape_buckets],
        **resolved,
    }
    env = _environment(Path(template_dir) if template_dir else TEMPLATE_DIR)
    source = env.get_template(spec.template).render(**context)
    try:
        compile(source, f"<{spec.name}/{variant}>", "exec")
    except SyntaxError as e:
        raise RuntimeError(f"template {spec.template} rendered invalid Python: {e}") from e
    return source


def module_path(root: Path | str, family: str, variant: str) -> Path:
    """Where a rendered module lives: `<root>/<family>/<variant>.py`."""
    for what, name in (("family", family), ("variant", variant)):
        if not _IDENT.match(name):
            raise InputError(f"{what} {name!r} is not a lowercase identifier")
    return Path(root) / family / f"{variant}.py"


def write_module(source: str, path: Path | str, *, overwrite: bool = False) -> Path:
    """Write rendered `source` to `path` (atomically); identical existing content is a no-op.

    Refuses (InputError) to replace a file with different content unless `overwrite=True`.
    No `__init__.py` is created: rendered modules are loaded by path only.
    """
    path = Path(path)
    if path.suffix != ".py":
        raise InputError(f"rendered module path must end in .py: {path}")
    if path.exists():
        if path.read_text() == source:
            return path
        if not overwrite:
            raise InputError(f"{path} exists with different content (pass overwrite=True to replace)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


_LOADED: dict[str, ModuleType] = {}
_OP_OWNERS: dict[str, str] = {}  # custom op name -> sha of the source that registered it
_OP_NAME_LINE = re.compile(r'^OP_NAME = "([^"]+)"$', re.M)


def load_module(path: Path | str) -> ModuleType:
    """Import a rendered module by path under `onboard_kernels.<family>.<variant>_<sha12>`.

    Modules are cached by content: loading the same source twice returns the same module (its
    custom ops can be registered only once per process).
    """
    path = Path(path).resolve()
    if not path.is_file():
        raise InputError(f"no rendered module at {path}")
    data = path.read_bytes()
    sha = hashlib.sha256(data).hexdigest()[:12]
    if sha in _LOADED:
        return _LOADED[sha]
    family = re.sub(r"\W", "_", path.parent.name) or "unknown"
    variant = re.sub(r"\W", "_", path.stem)
    name = f"{MODULE_PREFIX}.{family}.{variant}_{sha}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise InputError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    text = data.decode()
    op = _OP_NAME_LINE.search(text)
    sys.modules[name] = module
    try:
        if op and _OP_OWNERS.setdefault(op.group(1), sha) != sha:
            # Another source (an edited or re-rendered module) registered this op name in this
            # process already. torch replaces a custom op defined again under its name, which
            # leaves the first module calling a destroyed op: this one gets its own name.
            text = text[:op.end(1)] + f"_{sha}" + text[op.end(1):]
            exec(compile(text, str(path), "exec"), module.__dict__)
        else:
            spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    _LOADED[sha] = module
    return module


def render_to(
    root: Path | str,
    family: str | FamilySpec,
    variant: str,
    params: Mapping[str, Any] | None = None,
    *,
    overwrite: bool = False,
    template_dir: Path | None = None,
    tag: str | None = None,
) -> Path:
    """Render (`render`'s arguments) and write `<root>/<family>/<variant>.py`; returns the path."""
    spec = get_family(family)
    source = render(spec, variant, params, template_dir=template_dir, tag=tag)
    return write_module(source, module_path(root, spec.name, variant), overwrite=overwrite)
