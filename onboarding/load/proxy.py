"""Proxy configs: the same architecture with shrunk widths, experts and layers.

A proxy keeps what makes the architecture itself: the layer-type pattern (at least one full
period of a hybrid schedule and every distinct layer kind), top-k and gating, normalisation, the
rotary layout, and head dimensions where affordable. Widths, expert counts, vocabulary and depth
shrink. The rules act on the Hugging Face config *field conventions* (``hidden_size``,
``num_experts``...), never on model class names; a field the rules do not know keeps its value.

``tiny`` targets a few million parameters (CPU tests); ``small`` 0.3-1B (one GPU).

Top-k is kept exactly: the routed experts shrink to the size's ``experts``, but never below
2 x top-k (nor below what group-limited routing needs to pick top-k experts from its top groups).
Only where keeping top-k would need more than the size's ``max_experts`` experts is top-k itself
capped. That cap, the sparse-attention ``index_topk`` cap and a config whose ``__post_init__``
cannot re-derive its fields are the proxy's *notes*: each is warned about (`ProxyWarning`, which
the CLI prints) and appended to the proxy note that ``model.json`` records.

The cuts of widths, routed experts and vocabulary are `onboarding.load._proxy_cuts`; here are
the sizes, the layer choice, the re-derivation of derived fields and the checks of the result.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import itertools
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from onboarding.load.accounting import LAYER_INDEX
from onboarding.load._proxy_cuts import (  # the two name lists: re-exported (overrides, tests)
    EXPERT_COUNT_NAMES, GROUP_COUNT_NAMES, _set, _shrink_experts, _shrink_vocab, _shrink_widths,
    _writable)
from onboarding.errors import InputError


@dataclass(frozen=True, kw_only=True, slots=True)
class ProxySize:
    hidden: int
    heads: int
    head_dim_cap: int
    latent_cap: int  # MLA / low-rank widths
    experts: int  # routed experts, unless top-k needs more (2 x top-k, group-limited routing)
    max_experts: int  # hard limit on routed experts; top-k is capped only past max_experts // 2
    ffn: int
    expert_ffn: int
    # intermediate_size where it is also the routed experts' width (no expert width field:
    # Mixtral, gpt-oss): expert_ffn in tiny (CPU interpreter time grows with it), ffn in small
    # (wider GPU shapes; a narrower one takes 4x the layers to reach the 0.3B floor)
    experts_ffn: int
    vocab: int
    # Sparse attention's keys per query, below the sequence lengths the size runs at (tiny: the
    # CPU's 16-64 tokens; small: up to 2048): with K >= T every key is kept and the top-k
    # selection does nothing. (transformers clamps K to T, so this is not needed to run.)
    index_topk: int
    window: int
    max_params: int  # a full-size model at most this big is used as is (weights load)
    min_params: int  # small proxies add layer periods until they reach this


PROXY_SIZES = {
    # tiny: 32 experts x 3 x 128 x 64 is 0.8M parameters a layer (top-k up to 16 kept)
    "tiny": ProxySize(hidden=128, heads=4, head_dim_cap=32, latent_cap=32, experts=8,
                      max_experts=32, ffn=256, expert_ffn=64, experts_ffn=64, vocab=2048,
                      index_topk=16, window=32, max_params=20_000_000, min_params=0),
    # small: 128 experts x 3 x 1024 x 512 is 0.2B a layer (top-k up to 64 kept)
    "small": ProxySize(hidden=1024, heads=16, head_dim_cap=256, latent_cap=512, experts=64,
                       max_experts=128, ffn=2816, expert_ffn=512, experts_ffn=2816,
                       vocab=32768, index_topk=512, window=1024, max_params=1_000_000_000,
                       min_params=300_000_000),
}


class ProxyWarning(UserWarning):
    """What a proxy caps (top-k, sparse attention's index_topk) or could not re-derive; the
    same text is appended to the proxy note that ``model.json`` records."""


LAYER_COUNT_NAMES = ("num_hidden_layers", "n_layer", "num_layers")


def text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def layer_count_name(c: Any, model: nn.Module | None = None) -> str | None:
    """The field of text config ``c`` that counts ``model``'s layer stack: of the layer-count
    names ``c`` has (`LAYER_COUNT_NAMES`, through its attribute_map too), the first whose value
    is the length of one of the full-size ``model``'s ``nn.ModuleList`` s; without a model or a
    match, the first it has. LongCat-Flash's config on transformers 5.17 holds
    num_hidden_layers = 56 (its cache's count, two attention sublayers a layer) beside
    num_layers = 28, which sizes the 28 decoder layers."""
    names = [n for n in LAYER_COUNT_NAMES if isinstance(getattr(c, n, None), int)]
    lengths = {len(m) for m in model.modules() if isinstance(m, nn.ModuleList)} \
        if model is not None else set()
    found = next((n for n in names if getattr(c, n) in lengths), None)
    if found is None and lengths:
        # none sizes a stack: another int field named for layers that does (HRM-text's
        # num_layers_per_stack = 16 sizes its two stacks; its num_hidden_layers = 128 sizes none)
        found = next((k for k, v in vars(c).items() if "layer" in k and isinstance(v, int)
                      and not isinstance(v, bool) and v > 1 and v in lengths), None)
    return found or (names[0] if names else None)


def _layer_stack(model: nn.Module, n_layers: int) -> str | None:
    """The path of ``model``'s layer stack: its first ``nn.ModuleList`` of ``n_layers`` > 1."""
    return next((p for p, m in model.named_modules()
                 if isinstance(m, nn.ModuleList) and len(m) == n_layers > 1), None)


def layer_signatures(model: nn.Module, n_layers: int) -> list[tuple] | None:
    """Per-layer structure (sub-module paths, types and parameter ranks) of the layer stack.

    This catches layer schedules that configs express as periods/offsets instead of lists.
    """
    path = _layer_stack(model, n_layers)
    if path is None:
        return None
    return [tuple(sorted((LAYER_INDEX.sub(".*", name), type(m).__name__,
                          tuple(p.ndim for p in m.parameters(recurse=False)))
                         for name, m in layer.named_modules()))
            for layer in model.get_submodule(path)]


def layer_descriptors(c: Any, signatures: list[tuple] | None = None,
                      name: str | None = None) -> list[tuple]:
    """Per-layer type tuples: every per-layer type list in the config, plus module structure.
    ``name``: the layer-count field (`layer_count_name`; None: the first known one ``c`` has)."""
    name = name or layer_count_name(c)
    if name is None:
        return []
    n = getattr(c, name)
    # Lists of all-distinct ints are layer indices (e.g. per-layer ids), not layer types.
    lists = sorted(k for k, v in vars(c).items()
                   if isinstance(v, (list, tuple)) and len(v) == n and n > 1
                   and all(isinstance(x, (str, int, bool)) for x in v)
                   and not (all(isinstance(x, int) for x in v) and len(set(v)) == n))
    sig = signatures if signatures is not None and len(signatures) == n else [()] * n
    return [tuple(getattr(c, k)[i] for k in lists) + (sig[i],) for i in range(n)]


def _period(desc: list[tuple]) -> tuple[int, int]:
    """Smallest (prefix, period) with desc[i] == desc[i + period] for all i >= prefix, the
    period repeating at least twice after the prefix; (0, n) without one. A "period" that fits
    once (Flint's 49 layers: 2 dense, then sliding x 3 + full, but the last three layers sliding,
    sliding, full: prefix 3 and period 43 matched) is none: the stack is runs (`_runs`)."""
    n = len(desc)
    best = (0, max(n, 1))
    for s in range(0, min(4, n)):
        for p in range(1, (n - s) // 2 + 1):
            if all(desc[i] == desc[i + p] for i in range(s, n - p)):
                if s + p < sum(best):
                    best = (s, p)
                break
    return best


def _choose_layers(c: Any, periods: int, signatures: list[tuple] | None, name: str,
                   depth_kinds: frozenset[tuple] = frozenset()) -> list[int]:
    """The full-model indices of the layers to keep: ``periods`` periods of the layer schedule
    (every distinct layer kind), one more layer where the last kept one is alone of its kind and
    in ``depth_kinds`` (`_depth_dependent_kinds`)."""
    desc = layer_descriptors(c, signatures, name)
    n = getattr(c, name)
    if not desc:
        return list(range(min(n, 2 * periods)))
    keep = _schedule_layers(desc, periods)
    if _alone_last(desc, keep) in depth_kinds:
        keep.append(keep[-1] + 1)
    return keep


def _alone_last(desc: list[tuple], keep: list[int]) -> tuple | None:
    """The descriptor of the last kept layer where no other kept layer has it and the full
    stack has a layer after it: a layer kind that would only be seen as the proxy's last."""
    if not keep or keep[-1] + 1 >= len(desc):
        return None
    d = desc[keep[-1]]
    return d if sum(desc[i] == d for i in keep) == 1 else None


def _schedule_layers(desc: list[tuple], periods: int) -> list[int]:
    """``periods`` periods of the layer schedule ``desc`` after its prefix, every distinct
    kind included; a stack of runs: the first ``periods`` periods of each run."""
    n = len(desc)
    prefix, period = _period(desc)
    first_seen: dict[tuple, int] = {}
    for i, d in enumerate(desc):
        first_seen.setdefault(d, i)
    cover = max(first_seen.values()) + 1
    want = max(cover, prefix + period * periods, 2)
    if want >= n and (runs := _runs(desc)) and len(runs) > 1:
        # no period after a short prefix: the stack is runs of periods (Gemma 3n: 10 layers of
        # activation sparsity, 10 dense, 15 that reuse others' KV, each a period of 5 layer
        # types): the first `periods` periods of each run
        keep = [i for a, b, p in runs for i in range(a, min(b, a + p * periods))]
        if len(keep) < n:
            return keep
    return list(range(min(n, want)))


def _runs(desc: list[tuple]) -> list[tuple[int, int, int]]:
    """(start, end, period) runs that tile ``desc`` in order: from each start, the period whose
    repetition reaches furthest (at least two periods; ties: the shorter period); a layer that
    starts no repetition is a run of its own."""
    n, i, out = len(desc), 0, []
    while i < n:
        best_end, best_p = i + 1, 1
        for p in range(1, (n - i) // 2 + 1):
            j = i
            while j + p < n and desc[j] == desc[j + p]:
                j += 1
            if j + p - i >= 2 * p and j + p > best_end:
                best_end, best_p = j + p, p
        out.append((i, best_end, best_p))
        i = best_end
    return out


def _tail_counts(c: Any, name: str, n: int, keep: list[int], signatures: list[tuple] | None
                 ) -> None:
    """An int field counting the stack's last layers (Gemma 3n's num_kv_shared_layers = 15: the
    last 15 layers, which have no k/v projections) counts the kept layers among them, when the
    layer structure changes exactly where they begin (fields named for layers only)."""
    if signatures is None or len(signatures) != n:
        return
    for k, v in list(vars(c).items()):
        if "layer" not in k or k == name or k in LAYER_COUNT_NAMES or isinstance(v, bool) \
                or not isinstance(v, int) or not 0 < v < n or not _writable(c, k):
            continue
        start = n - v
        if signatures[start - 1] != signatures[start]:
            setattr(c, k, sum(1 for i in keep if i >= start))


def _partition_counts(c: Any, name: str, n: int, m: int) -> None:
    """Int fields named for layers that split the stack into consecutive sections (Dory's
    n_input_layers + n_recurrent_layers + n_output_layers = num_hidden_layers: layers run once,
    then looped, then once) split the ``m`` kept layers the same way, each section keeping at
    least one and its share of the rest. Before, they stayed as they were over fewer layers and
    the derived one went negative (8 + -12 + 8 = 4: the looped section never ran). The largest
    set of two or more such fields whose values sum to the layer count ``n`` is the split."""
    fields = [k for k, v in vars(c).items() if "layers" in k and k != name
              and k not in LAYER_COUNT_NAMES and isinstance(v, int) and not isinstance(v, bool)
              and 0 < v < n and _writable(c, k)]
    parts = next((combo for size in range(min(len(fields), 6), 1, -1)
                  for combo in itertools.combinations(fields, size)
                  if sum(getattr(c, k) for k in combo) == n), None)
    if parts is None or m < len(parts) or m == n:
        return
    new = {k: max(1, getattr(c, k) * m // n) for k in parts}
    order = sorted(parts, key=lambda k: -getattr(c, k))  # the largest sections give or take
    while sum(new.values()) != m:
        step = 1 if sum(new.values()) < m else -1
        k = next(k for k in order if step > 0 or new[k] > 1)
        new[k] += step
    for k, v in new.items():
        setattr(c, k, v)


def _shrink_layers(c: Any, periods: int, signatures: list[tuple] | None,
                   name: str | None, depth_kinds: frozenset[tuple] = frozenset()
                   ) -> list[int] | None:
    """Keep the layers `_choose_layers` picks; returns their full-model indices (None: no layer
    count to shrink). ``name``: the layer-count field (None: the first known one ``c`` has)."""
    name = name or layer_count_name(c)
    if name is None:
        return None
    n = getattr(c, name)
    for field in ("first_k_dense_replace",):
        _set(c, field, lambda v: min(v, 1))
    keep = _choose_layers(c, periods, signatures, name, depth_kinds)
    for k, v in list(vars(c).items()):
        if isinstance(v, (list, tuple)) and len(v) == n and n > 1:
            setattr(c, k, type(v)(v[i] for i in keep))
    for k in ("mlp_only_layers",):
        v = getattr(c, k, None)
        if isinstance(v, list):
            setattr(c, k, [i for i in v if i < len(keep)] if keep == list(range(len(keep)))
                    else [keep.index(i) for i in v if i in keep])
    if keep != list(range(len(keep))):  # runs kept (`_runs`): layers left out between them
        _tail_counts(c, name, n, keep, signatures)
    _partition_counts(c, name, n, len(keep))
    # a count of shared layers that is every layer (Gemma 4's assistant: num_kv_shared_layers =
    # the layer count, every layer reads the target model's KV) stays every layer
    for k, v in list(vars(c).items()):
        if "layer" in k and "shared" in k and isinstance(v, int) and not isinstance(v, bool) \
                and v == n and n > 1 and _writable(c, k):
            setattr(c, k, len(keep))
    # a second name for the layer count (xLSTM's num_blocks beside num_hidden_layers) follows it,
    # and a count of sublayers, a multiple of it (LongCat-Flash's num_hidden_layers, two a layer),
    # keeps its multiple
    for other in LAYER_COUNT_NAMES + ("num_blocks",):
        v = getattr(c, other, None)
        if other != name and isinstance(v, int) and not isinstance(v, bool) and v > 0 \
                and v % n == 0 and _writable(c, other):
            setattr(c, other, v // n * len(keep))
    setattr(c, name, len(keep))
    return keep


def _derived_fields(full: Any, c: Any, before: dict[str, Any]) -> list[str]:
    """The scalar fields of the full config ``full`` that its ``__post_init__`` fills in when
    they are None, their default (Zamba's attention_hidden_size = 2 hidden): set to None, a re-run
    gives the value back. Only those the shrinking left as they were (``before``). (A default
    other than None, Mamba's dt_rank "auto", is left alone: the proxies the tests pin keep it.)"""
    fields = [f for f in dataclasses.fields(c) if f.default is None
              and isinstance(before.get(f.name), (int, float, str)) and not isinstance(before.get(f.name), bool)
              and getattr(c, f.name, None) == before.get(f.name) and _writable(c, f.name)]
    if not fields:
        return []
    probe = copy.deepcopy(full)
    try:
        for f in fields:
            object.__setattr__(probe, f.name, f.default)
        probe.__post_init__()
    except Exception:  # noqa: BLE001 - the model's own config code, whatever it raises
        return []
    return [f.name for f in fields if getattr(probe, f.name, None) == before[f.name]]


def _rederive(c: Any, notes: list[str], full: Any = None, before: dict[str, Any] | None = None
              ) -> None:
    """Recompute what a dataclass config derives in ``__post_init__`` instead of taking as an
    argument (Zamba2's attention_head_dim = 2 hidden / heads, mamba_headdim, hybrid_layer_ids)
    from the shrunk fields: ``__post_init__`` runs again on a copy, and the derived (non-field)
    values that changed are taken from it. A config whose ``__post_init__`` refuses to run again
    keeps its derived values, which may still be the full model's: a note names the class and
    the error (the config is not wrong, so it is not an input error; the proxy may be)."""
    if not dataclasses.is_dataclass(c) or not hasattr(c, "__post_init__"):
        return
    fields = {f.name for f in dataclasses.fields(c)}
    # fields the full config derived from a default are derived again from the shrunk ones
    again = _derived_fields(full, c, before) if full is not None and before is not None else []
    probe = copy.deepcopy(c)
    defaults = {f.name: f.default for f in dataclasses.fields(c)}
    try:
        for k in again:
            object.__setattr__(probe, k, defaults[k])
        probe.__post_init__()
    except Exception as e:  # noqa: BLE001 - the model's own config code, whatever it raises
        derived = sorted(k for k in vars(c) if k not in fields and not k.startswith("_"))
        notes.append(f"{type(c).__name__}.__post_init__ raised {type(e).__name__}: {e} when re-run "
                     f"on the shrunk fields; its derived fields keep their values "
                     f"({', '.join(derived) or 'none found'})")
        return
    mine = vars(c)
    for k, v in vars(probe).items():
        if (k not in fields or k in again) and not k.startswith("_") and k in mine and mine[k] != v \
                and _writable(c, k):
            setattr(c, k, v)


def _lift_per_layer_overrides(c: Any) -> dict[int, dict[str, Any]] | None:
    """Take a heterogeneous config's per-layer overrides (transformers' `per_layer_config`) off
    it, so that the shrinking rules read and write the global fields (which such a config hides
    from global reads); None for a homogeneous config."""
    spec = vars(c).get("_heterogeneity_spec")
    if spec is None:
        return None
    overrides = copy.deepcopy(spec.per_layer_overrides)
    c.per_layer_config = None
    return overrides


def _put_back_per_layer_overrides(c: Any, overrides: dict[int, dict[str, Any]], before: dict[str, Any],
                                  keep: list[int] | None) -> None:
    """Re-attach the overrides of the kept layers (renumbered), each integer field scaled as the
    shrinking scaled its global value (a 512 head dim where the global 256 became 32: 64)."""
    out = {}
    pairs = enumerate(keep) if keep is not None else ((i, i) for i in sorted(overrides))
    for new_i, old_i in pairs:
        if old_i not in overrides:
            continue
        layer = {}
        for k, v in overrides[old_i].items():
            b, a = before.get(k), getattr(c, k, None)
            if isinstance(v, int) and not isinstance(v, bool) and isinstance(b, int) and isinstance(a, int) \
                    and b > 0 and a != b:
                v = max(1, round(v * a / b))
            layer[k] = v
        out[new_i] = layer
    c.per_layer_config = out


def _head_dim(c: Any) -> int | None:
    try:
        hd = getattr(c, "head_dim", None)
    except Exception:  # noqa: BLE001 - a per-layer field the config will not read globally
        return None
    if isinstance(hd, int) and hd > 0:
        return hd
    h, n = getattr(c, "hidden_size", None), getattr(c, "num_attention_heads", None)
    return h // n if isinstance(h, int) and isinstance(n, int) and n > 0 else None


def _head_dim_of_heads(c: Any) -> int | None:
    h, n = getattr(c, "hidden_size", None), getattr(c, "num_attention_heads", None)
    return h // n if isinstance(h, int) and isinstance(n, int) and n > 0 and h % n == 0 else None


def _fit_heads(c: Any, head_dim: int) -> None:
    """Cut the attention head count so that hidden / heads is ``head_dim`` (the key/value head
    count to the largest divisor of it that is no larger than before); nothing when the width
    does not hold a whole head of that dim."""
    h, n = getattr(c, "hidden_size", None), getattr(c, "num_attention_heads", None)
    if not (isinstance(h, int) and isinstance(n, int)) or h < head_dim or h % head_dim:
        return
    heads = h // head_dim
    c.num_attention_heads = heads
    kv = getattr(c, "num_key_value_heads", None)
    if isinstance(kv, int) and not isinstance(kv, bool) and kv > 0:
        c.num_key_value_heads = max(d for d in range(1, min(kv, heads) + 1) if heads % d == 0)


def _fit_rope_sections(c: Any, before: dict[str, Any]) -> None:
    """Rotary sections over the head (multimodal RoPE's per-axis split of the rotary half,
    ``rope_parameters["mrope_section"]``-style lists of ints) scale with the head dim, their sum
    kept exact: a list that summed to the full rotary half sums to the proxy's."""
    rp = getattr(c, "rope_parameters", None)
    old_hd = before.get("head_dim") if isinstance(before.get("head_dim"), int) else None
    if old_hd is None and isinstance(before.get("hidden_size"), int) and \
            isinstance(before.get("num_attention_heads"), int):
        old_hd = before["hidden_size"] // before["num_attention_heads"]
    new_hd = _head_dim(c)
    if not isinstance(rp, dict) or not old_hd or not new_hd or old_hd == new_hd:
        return
    for k, v in list(rp.items()):
        if not (isinstance(v, list) and len(v) > 1 and all(isinstance(x, int) for x in v)):
            continue
        total = sum(v)
        if total <= 0 or (old_hd % total and total % old_hd and (2 * total) % old_hd):
            continue
        want = total * new_hd // old_hd
        if want < len(v):
            continue
        out = [max(1, x * new_hd // old_hd) for x in v]
        out[0] += want - sum(out)
        if out[0] >= 1:
            rp[k] = out


def shrink_config(config: Any, size: str, *, periods: int = 1,
                  signatures: list[tuple] | None = None, notes: list[str] | None = None,
                  head_dim: int | None = None, fit_heads: bool = False,
                  layer_count: str | None = None,
                  depth_kinds: frozenset[tuple] = frozenset()) -> Any:
    """A deep copy of ``config`` shrunk to the proxy ``size`` (its text config if multimodal).

    ``signatures`` (from `layer_signatures` of the full-size model) let the layer choice see
    layer kinds that the config does not list per layer; ``layer_count`` (`layer_count_name`)
    is the field that counts the layer stack (None: the first known name the config has);
    ``depth_kinds`` the layer descriptors whose constants depend on the layer count
    (`_depth_dependent_kinds`): such a kind is not kept as the proxy's last layer alone. What
    the proxy caps or could not re-derive is appended to ``notes``; without a list, each is
    warned about (`ProxyWarning`).
    """
    if size not in PROXY_SIZES:
        raise InputError(f"--proxy {size!r}: expected one of {', '.join(PROXY_SIZES)}")
    s = PROXY_SIZES[size]
    found: list[str] = []
    cfg = copy.deepcopy(config)
    c = text_config(cfg)
    overrides = _lift_per_layer_overrides(c)
    before = dict(vars(c))
    _shrink_widths(c, s, found)
    if head_dim:  # a rotary layout fixed in the model's code needs this head dim
        c.head_dim = head_dim
        if fit_heads:
            _fit_heads(c, head_dim)
    _shrink_experts(c, s, found)
    _shrink_vocab(c, s)
    keep = _shrink_layers(c, periods, signatures, layer_count, depth_kinds)
    _rederive(c, found, text_config(config), before)
    _fit_rope_sections(c, before)
    if overrides is not None:
        _put_back_per_layer_overrides(c, overrides, before, keep)
    if c is not cfg:  # multimodal: the towers shrink too (the text config alone does not)
        from onboarding.load.multimodal import shrink_towers

        shrink_towers(config, cfg, s)
    from onboarding.load.multimodal import shrink_nested

    if nested := shrink_nested(c, s):
        found.append(f"sub-configs {', '.join(nested)} of the text config shrunk by one width "
                     "factor (the largest width to the proxy's), heads, FFN and layers capped")
    if notes is None:
        _warn(size, found)
    else:
        notes.extend(found)
    return cfg


# the warnings shown, by the filter list in force when shown: id -> (that list, messages), the
# SHOWN_LISTS lists last warned under (most recent last): every `catch_warnings` block makes a
# list of its own, one a test under pytest
_SHOWN: collections.OrderedDict[int, tuple[list, set[str]]] = collections.OrderedDict()
SHOWN_LISTS = 16


def _warn(size: str, notes: list[str]) -> None:
    """Warn about each note, each distinct one once while the same warning filters are in
    force: the whole of a CLI run, whose stages each rebuild the proxy (Python's "default" and
    "once" actions forget what they showed whenever a filter changes, which loading does); a
    `catch_warnings` block (pytest's, a test's) starts afresh. The proxy note keeps them all.
    What was shown is kept for the `SHOWN_LISTS` filter lists last warned under: a list warned
    under again after more others than that shows its notes again."""
    filters = warnings.filters  # held in _SHOWN, so that its id is not reused while kept
    shown = _SHOWN.setdefault(id(filters), (filters, set()))[1]
    _SHOWN.move_to_end(id(filters))
    while len(_SHOWN) > SHOWN_LISTS:
        _SHOWN.popitem(last=False)
    for note in notes:
        message = f"{size} proxy: {note}"
        if message not in shown:
            shown.add(message)
            warnings.warn(message, ProxyWarning, stacklevel=3)


def proxy_config(loaded, size: str, full_model: nn.Module | None = None,
                 full_params: int | None = None) -> tuple[Any, str]:
    """The proxy config for ``loaded`` and a one-line note on how it was made (with what it
    caps, each also warned about: `ProxyWarning`).

    ``full_model`` is the full-size model (on ``meta``), used for layer structure.
    """
    s = PROXY_SIZES.get(size)
    if s is None:
        raise InputError(f"--proxy {size!r}: expected one of {', '.join(PROXY_SIZES)}")
    if loaded.config is None or not loaded.is_hf:
        return loaded.config, "no config to shrink: the proxy is the model as given"
    if full_params is not None and full_params <= s.max_params:
        return copy.deepcopy(loaded.config), (
            f"full size ({full_params:,} parameters) fits the {size} budget: used as is")
    from onboarding.load.accounting import count_parameters

    c = text_config(loaded.config)
    name = layer_count_name(c, full_model)
    sigs = layer_signatures(full_model, getattr(c, name)) if full_model is not None and name \
        else None
    depth = _depth_dependent_kinds(loaded, sigs, name, full_model)
    notes: list[str] = []
    tied = None
    periods, cfg = 1, shrink_config(loaded.config, size, signatures=sigs, notes=notes,
                                    layer_count=name, depth_kinds=depth)
    while s.min_params:
        n = count_parameters(loaded.build(cfg, device="meta", seed=None)).total
        if n >= s.min_params or periods >= 16:
            break
        periods += 1
        notes = []
        cfg = shrink_config(loaded.config, size, periods=periods, signatures=sigs, notes=notes,
                            layer_count=name, depth_kinds=depth)
    if not s.min_params and loaded.probe_proxy is not None and not loaded.probe_proxy(cfg) \
            and not (tied := _keep_ties(loaded, cfg)):
        full_hd = _head_dim(c)
        # an attention that derives its head dim as hidden / heads ignores a head_dim field:
        # the head count is then cut so that the quotient is the head dim (Qwen2-VL's M-RoPE
        # sections, [16, 24, 24] in its code, need a rotary half of 64)
        tries = [(hd, fit) for hd in dict.fromkeys(x for x in (full_hd, 128, 64) if x)
                 for fit in (False, True)]
        # a try may shrink to a config already probed (a head dim the first shrink kept, heads
        # that already fill the width): each probe builds and runs the model, so each config once
        probed = {repr(cfg)}
        for hd, fit in tries:
            kept = shrink_config(loaded.config, size, signatures=sigs, notes=[], head_dim=hd,
                                 fit_heads=fit, layer_count=name, depth_kinds=depth)
            if fit and _head_dim_of_heads(text_config(kept)) != hd:
                continue  # the width does not hold whole heads of this dim
            if repr(kept) in probed:
                continue
            probed.add(repr(kept))
            if loaded.probe_proxy(kept):
                cfg = kept
                fitted = (f", {text_config(kept).num_attention_heads} head(s) of the width "
                          f"{text_config(kept).hidden_size}") if fit else ""
                notes.append(f"head dim {hd}{fitted}: the proxy with shrunk heads does not run "
                             "(a rotary layout fixed in the model's code)")
                break
    if tied:  # a tie between config fields the shrink broke, kept (`_proxy_ties`)
        cfg, kept_notes = tied
        notes.extend(kept_notes)
    _check_layer_stack(loaded, cfg, size, name, full_model)
    _check_shrunk(loaded, cfg, size, full_params)
    _warn(size, notes)
    note = f"shrunk to the {size} proxy ({periods} layer period(s))"
    return cfg, "; ".join([note] + notes)


def _keep_ties(loaded, cfg: Any) -> tuple[Any, list[str]] | None:
    """The proxy config ``cfg`` (which does not run) with the ties between config fields that
    the shrink broke kept, and a note for each; None when that does not make it run
    (`onboarding.load._proxy_ties`)."""
    from onboarding.load._proxy_ties import keep_ties
    from onboarding.load.multimodal import run_probe

    return keep_ties(loaded.config, cfg, lambda c: loaded.build(c, device="cpu", seed=0).eval(),
                     run_probe)


def _depth_dependent_kinds(loaded, signatures: list[tuple] | None, name: str | None,
                           full_model: nn.Module | None) -> frozenset[tuple]:
    """The kind (layer descriptor) of the tiny proxy's last layer when no other kept layer is of
    that kind and its constants depend on the layer count; empty otherwise.

    A layer may compute constants from its depth, ``layer_idx / (num_layers - 1)``: MiniMax
    scales its linear-attention layers' decay slopes by ``1 - layer_idx / (L - 1 + 1e-5) +
    1e-5``, about 2e-5 at the last layer. A proxy whose only layer of that kind is its last
    sees no decay, and a kernel that gets the decay wrong passes there. Found by building the
    tiny proxy with and without one more layer after it (on the CPU, weights left
    uninitialised: the constructors' buffers are what is read, uninitialised memory filled
    with NaN, torch's deterministic fill) and comparing that layer's buffers and float
    attributes. Kept per model and config for the process: every proxy of the model asks
    again (tiny and small, each run's stages)."""
    if full_model is None or name is None:
        return frozenset()
    key = (loaded.ref, loaded.part, repr(loaded.config))
    if key not in _DEPTH_KINDS:
        _DEPTH_KINDS[key] = _probe_depth_kinds(loaded, signatures, name, full_model)
    return _DEPTH_KINDS[key]


_DEPTH_KINDS: dict[tuple[str, str, str], frozenset[tuple]] = {}


def _probe_depth_kinds(loaded, signatures: list[tuple] | None, name: str,
                       full_model: nn.Module) -> frozenset[tuple]:
    c = text_config(loaded.config)
    desc, stack = layer_descriptors(c, signatures, name), _layer_stack(full_model, getattr(c, name))
    keep = _choose_layers(c, 1, signatures, name) if desc else []
    last = _alone_last(desc, keep)
    if last is None or stack is None:
        return frozenset()
    from transformers.initialization import no_init_weights

    seen = []
    for depth in (frozenset(), frozenset({last})):
        cfg = shrink_config(loaded.config, "tiny", signatures=signatures, notes=[],
                            layer_count=name, depth_kinds=depth)
        try:
            # one seed for both builds (random buffers agree), the caller's RNG left as it was
            with no_init_weights(), _filled_empty(), torch.random.fork_rng(devices=[]):
                model = loaded.build(cfg, device="cpu", seed=0)
        except InputError:  # a proxy that does not build: the checks after the shrink say so
            return frozenset()
        seen.append(_constants(model.get_submodule(stack)[len(keep) - 1]))
    alone, followed = seen
    return frozenset({last}) if alone.keys() != followed.keys() or not all(
        _equal(v, followed[k]) for k, v in alone.items()) else frozenset()


@contextlib.contextmanager
def _filled_empty():
    """torch.empty filled (floats NaN, integers their maximum) while inside: an uninitialised
    buffer reads the same in every build."""
    import torch.utils.deterministic as det

    was = (torch.are_deterministic_algorithms_enabled(),
           torch.is_deterministic_algorithms_warn_only_enabled(), det.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
        det.fill_uninitialized_memory = was[2]


def _constants(layer: nn.Module) -> dict[str, Any]:
    """A layer's buffers and float attributes, by sub-module path and name."""
    out: dict[str, Any] = {}
    for path, m in layer.named_modules():
        for k, b in m.named_buffers(recurse=False):
            out[f"{path}.{k}"] = b
        out.update({f"{path}.{k}": v for k, v in vars(m).items() if isinstance(v, float)})
    return out


def _equal(a: Any, b: Any) -> bool:
    """Two constants are the same: tensors of one shape and dtype, equal or both NaN at each
    position (`_filled_empty`), or equal values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) \
            and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan()) \
            and torch.equal(a.nan_to_num(), b.nan_to_num())
    return a == b or a != a and b != b  # NaN floats: the same unset value


# A proxy that keeps more than half the full model's parameters and more than this many times
# the size's max_params shrank nothing that matters: its real build would take the full model's
# memory and its weight init minutes (hf:blt: 180 s and 5.6 GiB with no result, then the OOM
# killer), so it is refused before the build.
UNSHRUNK_FACTOR = 10


def _check_shrunk(loaded, cfg: Any, size: str, full_params: int | None) -> None:
    """Raise InputError (exit 2) when the ``size`` proxy of ``loaded`` is about as big as the
    full model (more than half its ``full_params``) and far above the size's budget
    (`UNSHRUNK_FACTOR` x max_params): the model keeps its sizes in fields the proxy rules do
    not shrink (BLT's sub-configs and hash-embedding vocabulary). The message names the
    largest parameters and the config's sub-configs. Counted on meta: nothing is allocated."""
    from onboarding.load.accounting import count_parameters

    s = PROXY_SIZES[size]
    if full_params is None or full_params <= s.max_params * UNSHRUNK_FACTOR:
        return
    model = loaded.build(cfg, device="meta", seed=None)
    n = count_parameters(model).total
    if n <= s.max_params * UNSHRUNK_FACTOR or 2 * n <= full_params:
        return
    big = sorted(((p.numel(), name, list(p.shape)) for name, p in model.named_parameters()),
                 reverse=True)[:3]
    c = text_config(cfg)
    subs = sorted(k for k, v in vars(c).items() if hasattr(v, "to_dict") and hasattr(v, "model_type"))
    raise InputError(
        f"{loaded.ref}: the {size} proxy keeps {n:,} of the full model's {full_params:,} "
        f"parameters (the {size} budget is {s.max_params:,}): the config keeps its sizes in "
        "fields the proxy rules do not shrink"
        + (f" (its sub-configs {', '.join(subs)} are not shrunk)" if subs else "")
        + f"; the largest parameters: {'; '.join(f'{nm} {sh}' for _, nm, sh in big)}. Building it "
        f"would take about {n * 4 / 2**30:.0f} GiB in fp32: not attempted. Set smaller sizes "
        "with --set (dotted keys reach sub-configs: --set <sub-config>.<field>=<value>), or give "
        "a smaller config")


def _check_layer_stack(loaded, cfg: Any, size: str, name: str | None,
                       full_model: nn.Module | None) -> None:
    """The proxy's layer stack (on meta) has the layers its config counts: a model that sized
    its stack from another field would otherwise build every layer of the full size."""
    if full_model is None or name is None:
        return
    n = getattr(text_config(loaded.config), name)
    path = _layer_stack(full_model, n)
    want = getattr(text_config(cfg), name)
    if path is None or want == n:
        return
    stack = dict(loaded.build(cfg, device="meta", seed=None).named_modules()).get(path)
    if isinstance(stack, nn.ModuleList) and len(stack) != want:
        raise InputError(f"{loaded.ref}: the {size} proxy sets {name}={want}, but the model "
                         f"built from it has {len(stack)} layers at {path} (the full size "
                         f"{n}): its layer count is read from a field the proxy does not set; "
                         "use --proxy none")
