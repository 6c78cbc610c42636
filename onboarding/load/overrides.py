"""`--set key=value` overrides: parsed as JSON where possible, type-checked against the config;
and the other list-valued option types of the command line."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from onboarding.errors import InputError


def parse_assignments(items: list[str] | None) -> dict[str, Any]:
    """Parse ``["a=1", "b.c=[1,2]"]`` into ``{"a": 1, "b.c": [1, 2]}``; values are JSON or strings."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise InputError(f"--set {item!r}: expected key=value")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out[key] = value
    return out


def type_matches(old: Any, new: Any) -> bool:
    """Whether ``new`` may replace ``old``: same type, ints for floats, any value for None."""
    if old is None or new is None:
        return True
    if isinstance(old, bool) or isinstance(new, bool):
        return isinstance(old, bool) and isinstance(new, bool)
    if isinstance(old, float):
        return isinstance(new, (int, float))
    if isinstance(old, int):
        return isinstance(new, int)
    if isinstance(old, (list, tuple)):
        return isinstance(new, (list, tuple))
    return isinstance(new, type(old))


def apply_overrides(config: Any, overrides: dict[str, Any]) -> None:
    """Set ``overrides`` on a transformers config (dotted keys reach sub-configs).

    Unknown keys and values of the wrong type raise `InputError` naming the key; nothing is
    changed unless every override is valid.
    """
    planned: list[tuple[Any, str, Any]] = []
    for key, value in overrides.items():
        target, parts = config, key.split(".")
        for part in parts[:-1]:
            if not hasattr(target, part) or getattr(target, part) is None:
                raise InputError(f"--set {key}: {type(target).__name__} has no field {part!r}")
            target = getattr(target, part)
            if isinstance(target, dict):
                raise InputError(f"--set {key}: {part!r} is a plain dict; set it whole as JSON")
        leaf = parts[-1]
        known = set(target.to_dict()) if hasattr(target, "to_dict") else set(vars(target))
        if leaf not in known and not hasattr(target, leaf):
            raise InputError(
                f"--set {key}: unknown config key {leaf!r} for {type(target).__name__}"
            )
        old = getattr(target, leaf, None)
        if not type_matches(old, value):
            raise InputError(
                f"--set {key}={json.dumps(value)}: expected {type(old).__name__} "
                f"(current value {old!r}), got {type(value).__name__}"
            )
        if isinstance(old, float) and isinstance(value, int):
            value = float(value)
        planned.append((target, leaf, value))
    for target, leaf, value in planned:
        old = getattr(target, leaf, None)
        try:
            setattr(target, leaf, value)
        except Exception as exc:  # noqa: BLE001 - the config class' own field validation
            raise InputError(f"--set {leaf}={json.dumps(value)}: {type(target).__name__} "
                             f"rejects it: {_first_line(exc)}") from None
        _fit_per_layer_lists(target, leaf, old, value, {k.rsplit(".", 1)[-1] for k in overrides})
    check_values(config, overrides)


def _fit_per_layer_lists(c: Any, leaf: str, old: Any, new: Any, given: set[str]) -> None:
    """A new layer count carries the config's per-layer lists (``layer_types``, ...) along, as the
    config class derives them from the count when it is built with it: the first ``new`` entries;
    when the count grows, the list's shortest repeating pattern goes on. Lists the user set too
    are left as given."""
    from onboarding.load.proxy import LAYER_COUNT_NAMES

    if leaf not in LAYER_COUNT_NAMES or not isinstance(old, int) or not isinstance(new, int) \
            or old < 2 or new < 1 or old == new:
        return
    for k, v in list(vars(c).items()):
        if k not in given and not k.startswith("_") and isinstance(v, (list, tuple)) \
                and len(v) == old:
            period = next(p for p in range(1, old + 1) if all(v[i] == v[i % p] for i in range(old)))
            setattr(c, k, type(v)(v[i % period] for i in range(new)))


# fields that count or size something: an overridden one must be >= 1 (never negative for any
# count); top-k must not exceed the experts it picks from
_SIZE_FIELD = re.compile(r"(_size|_dim|_layers|_heads|^num_experts_per_tok|^top_?k|_topk)$")
_COUNT_FIELD = re.compile(r"^(num|n)_|_(size|dim|layers|heads|experts)$")


def check_values(config: Any, overrides: dict[str, Any]) -> None:
    """After ``--set``: what the values must satisfy for the config to describe a model, said
    before anything is built. Counts and sizes set to zero or less, top-k above the expert count,
    and whatever the config class' own `validate()` (transformers' strict configs) rejects."""
    for key, value in overrides.items():
        leaf = key.rsplit(".", 1)[-1]
        if isinstance(value, bool) or not isinstance(value, int):
            continue
        if value < 1 and _SIZE_FIELD.search(leaf):
            raise InputError(f"--set {key}={value}: a size, layer, head or top-k count must "
                             "be >= 1")
        if value < 0 and _COUNT_FIELD.search(leaf):
            raise InputError(f"--set {key}={value}: a count must be >= 0")
    from onboarding.load.accounting import TOPK_NAMES
    from onboarding.load.proxy import EXPERT_COUNT_NAMES, text_config

    tc = text_config(config)
    ints = {n: v for n in (*TOPK_NAMES, *EXPERT_COUNT_NAMES)
            if isinstance(v := getattr(tc, n, None), int) and not isinstance(v, bool)}
    topk = {n: v for n, v in ints.items() if n in TOPK_NAMES and v > 0}
    experts = {n: v for n, v in ints.items() if n in EXPERT_COUNT_NAMES and v > 0}
    if topk and experts:
        (kn, k), (en, e) = max(topk.items(), key=lambda t: t[1]), max(experts.items(),
                                                                      key=lambda t: t[1])
        if k > e and any(key.rsplit(".", 1)[-1] in ints for key in overrides):
            raise InputError(f"--set: {kn}={k} > {en}={e}: each token would pick more experts "
                             "than there are")
    validate = getattr(config, "validate", None)
    if callable(validate):
        try:
            validate()
        except Exception as exc:  # noqa: BLE001 - transformers' own checks, as they say it
            raise InputError(f"--set: transformers rejects the config: {type(exc).__name__}: "
                             f"{_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    lines = [x for x in str(exc).strip().splitlines() if x.strip()]
    return " ".join(x.strip() for x in lines[:2]) if lines else ""


def int_list(v: str) -> list[int]:
    """An argparse type: ``"2,4,8"`` -> ``[2, 4, 8]``."""
    try:
        return [int(x) for x in v.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 2,4,8, got "
                                         f"{v!r}") from None


def _bounded_int(low: int, what: str):
    def parse(v: str) -> int:
        try:
            n = int(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {v!r}") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"expected {what}, got {n}")
        return n
    parse.__name__ = "int"  # argparse names the type in its messages
    return parse


# argparse types: nonsense counts fail when the command line is read, before any work
positive_int = _bounded_int(1, "an integer >= 1")
nonneg_int = _bounded_int(0, "an integer >= 0")


def positive_int_list(v: str) -> list[int]:
    """An argparse type: ``"64,128"`` -> ``[64, 128]``, every size >= 1."""
    out = int_list(v)
    bad = [n for n in out if n < 1]
    if bad:
        raise argparse.ArgumentTypeError(f"expected sizes >= 1, got {v!r}")
    return out
