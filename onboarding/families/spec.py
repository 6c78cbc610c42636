"""The typed declaration of a kernel family: render parameters, variants, tuning space, shape
buckets, and the hooks each stage calls (block matching, sample inputs, ...).

A family folder's `family.py` builds one `FamilySpec` named `FAMILY`; `onboarding.families`
discovers and registers it (see `discover.py`). Nothing here knows any particular family.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onboarding.errors import InputError

_PARAM_TYPES = (bool, int, float, str)


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
class NightlySpec:
    """A family's share of the nightly regression suite (`onboard bench --suite nightly`): a few
    of its benchmark cases, each with the implementations timed (ours and its anchors), and the
    smallest relative change a nightly may call a regression for this family (a floor under the
    threshold the run's own noise sets: short kernels move more between processes)."""

    cases: Mapping[str, tuple[str, ...]]  # case name (exact) -> impls, e.g. ("ours", "eager")
    min_threshold: float = 0.05

    def __post_init__(self) -> None:
        if not self.cases or any(not impls for impls in self.cases.values()):
            raise ValueError("NightlySpec: every case needs at least one impl")
        if not 0 < self.min_threshold < 1:
            raise ValueError(f"NightlySpec: min_threshold {self.min_threshold} not in (0, 1)")


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
    # The family's folder (templates, family.py, its other modules): family.py passes
    # `folder=Path(__file__).parent`, so a copied folder renders from where it lies.
    folder: Path | None = field(default=None, compare=False)
    # Another family this one builds on: its folder's templates are searched after this one's
    # (a family that shares another's kernels with a flag set, as the per-channel delta rule).
    extends: str | None = None
    # Stage hooks. Each is optional: a stage that needs one a family lacks skips that family and
    # says so. Signatures are documented where the stage calls them.
    # binding(block, module, kernels, record, model) -> undo | None: patch one block the family
    # serves (`module`: the model's module at block.path; `kernels`: this family's loaded
    # modules for the block, the one keyed (path, family) first); returns the patch's undo, or
    # None with `record` rejected and saying why (see `onboarding.patching.core.patch_model`).
    binding: Callable[..., Callable[[], None] | None] | None = field(default=None, compare=False)
    # probe: the `onboarding.patching.callswap.Interface` the binding swaps by; the parse stage
    # records, for each block `match` accepts, what a swap by it would find and be handed
    # (`callswap.record_core_calls`), as ``block.attrs["core_calls"][interface.what]``, so that
    # `refusal` can run the binding's own acceptance test on the op graph. A probe with a
    # ``record_calls(model, [(block, module)], run)`` method records by its own means instead
    # (rope's: its swaps sit beside the block; `onboarding.patching.probe`).
    probe: Any = field(default=None, compare=False)
    # refusal(block) -> {"serves": the part (None: the block's core), "reason"} | None: why the
    # binding would leave a block of the kinds `match` serves unpatched, read off the op graph by
    # the binding's own acceptance test (`match` returns None for such a block; coverage says
    # the reason instead of "template").
    refusal: Callable[[Any], dict[str, Any] | None] | None = field(default=None, compare=False)
    # tune: problem_dims(entry, block) -> {dim: size} | None, the real problem dims of one
    # coverage entry (`.shapes` its block's input shapes, `.variant`, `.params`) and its
    # `opgraph.Block` (None when the graph lacks it), read off input shapes, weights and attrs.
    # They size the bucket (`shape_buckets[0].dim`; a family that declares this hook is the
    # only say on it: None or a dict without that dim leaves the block untuned) and, when they
    # hold every `timing_dims`, the timing inputs.
    problem_dims: Callable[..., dict[str, int] | None] | None = field(default=None, compare=False)
    # tune: the dims `timing_inputs` needs (`onboard tune --dims` checks them up front).
    timing_dims: tuple[str, ...] = ()
    # tune: timing_inputs(variant, params, dims, dtype, gen) -> entry arguments at the real
    # shapes `dims`, in `dtype`, drawn with `gen` (a torch.Generator on the device: make the
    # tensors there, `onboarding.tune.worker.randn`). None: timed at the sample shapes.
    timing_inputs: Callable[..., list[Any]] | None = field(default=None, compare=False)
    bench_cases: Callable[[], list[Any]] | None = field(default=None, compare=False)  # bench
    bench_nightly: NightlySpec | None = field(default=None, compare=False)  # the nightly suite
    # training_variants: what the training stage attaches itself, by what it serves -> the variant:
    # a block kind run with frozen weights and LoRA inside the kernel ("moe.experts"), a training
    # layer ("lora.linear": LoRALinear) or a piece of the training path's own modules
    # ("moe.experts.weighted_act": the experts' weighted activation). None of these is found in the
    # op graph, so `match` never picks them; training asks `families.training_kernel(kind)` for the
    # (family, variant) to render.
    training_variants: Mapping[str, str] = field(default_factory=dict)
    # plan: what the family's kernel keeps for its backward, in the memory planner's terms
    # (`onboarding.plan.memory`): "norm_input" (its 16-bit input alone), "delta_rule" (the chunked
    # delta rule's intermediates, `memory.delta_rule_kernel_saved` from the render params),
    # "topk_positions" (the picked int32 positions and the gathered keys and values),
    # "gate_and_up" (a fused gated MLP: gate and up, the activation recomputed), "scan" (a
    # state-space scan: what the family's `plan_saved(widths, seq)` declares per token, from its
    # `saved_shapes` of what its autograd Function saves; None where the widths are not its). None: the
    # planner counts the block's own torch path.
    plan_saves: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not self.shape_buckets:
            raise ValueError(f"family {self.name!r}: needs at least one shape bucket")
        self.check_config(self.default_config)
        for b in self.shape_buckets:
            self.check_config(b.config)
        for variant in self.training_variants.values():
            self._check_variant(variant)

    def untuned_config(self, size: int) -> dict[str, Any]:
        """The tile config a rendered module runs a problem whose bucketed dimension is ``size``
        with before any tuned.json pin: the default, then its shape bucket's values (the bucket
        whose [lo, hi] holds ``size``, the last one past the end: the module's `config_for`)."""
        bucket = next((b for b in self.shape_buckets if b.lo <= size <= b.hi), self.shape_buckets[-1])
        return {**self.default_config, **bucket.config}

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
