"""A proxy config's cuts of widths (model, heads, FFN, linear attention, MLA and indexer, state
space), routed experts (top-k kept: `onboarding.load.proxy`'s rules) and vocabulary, each by
the Hugging Face field conventions. `onboarding.load.proxy.shrink_config` runs them, then
chooses the layers (with the field helpers `_writable` and `_set` from here) and re-derives.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from onboarding.load.accounting import EXPERT_COUNT_NAMES, TOPK_NAMES

if TYPE_CHECKING:
    from onboarding.load.proxy import ProxySize


# The routed experts' FFN width (LongCat-Flash's: expert_ffn_hidden_size); a config with routed
# experts and none of these sizes its experts with intermediate_size (Mixtral, gpt-oss, JetMoE).
EXPERT_WIDTH_NAMES = ("moe_intermediate_size", "expert_intermediate_size",
                      "expert_ffn_hidden_size")
GROUP_COUNT_NAMES = ("n_group", "num_expert_group")


def _writable(c: Any, name: str) -> bool:
    """False for a field the config class derives from others (a property without a setter,
    xLSTM's v_head_dim): it follows its sources and is never set directly."""
    prop = getattr(type(c), name, None)
    return not (isinstance(prop, property) and prop.fset is None)


def _is_width(v: Any) -> bool:
    """A width as `_set` takes it: a positive int, or a per-layer list (or tuple) of them."""
    def one(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x > 0

    return one(v) or (isinstance(v, (list, tuple)) and bool(v) and all(one(x) for x in v))


def _set(c: Any, name: str, fn) -> None:
    """``name`` = fn(its value); a per-layer list of them (Gemma 3n's intermediate_size, one a
    layer) is scaled as its largest value is, each layer keeping its share of it."""
    v = getattr(c, name, None)
    if not _writable(c, name) or not _is_width(v):
        return
    if isinstance(v, int):
        setattr(c, name, int(fn(v)))
    else:
        top = max(v)
        new = int(fn(top))
        if new != top:
            setattr(c, name, type(v)(max(1, x * new // top) for x in v))


# Head-size fields that some configs tie to each other (DeepSeek's head_dim is its rotary
# width): fields equal in the full config stay equal in the proxy.
_TIED_DIMS = ("head_dim", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "index_head_dim",
              "linear_key_head_dim", "linear_value_head_dim", "linear_head_dim")


def _retie(c: Any, before: dict[str, Any]) -> None:
    names = [n for n in _TIED_DIMS if isinstance(before.get(n), int) and _writable(c, n)]
    for a in names:
        for b in names:
            if a < b and before[a] == before[b]:
                v = min(getattr(c, a), getattr(c, b))
                setattr(c, a, v)
                setattr(c, b, v)


def _rope_fraction(c: Any) -> float | None:
    """The rotary table's share of head_dim (partial_rotary_factor; one value for all layer
    types), None where the config names none."""
    rp = getattr(c, "rope_parameters", None)
    if isinstance(rp, dict):
        if "partial_rotary_factor" in rp:
            return rp["partial_rotary_factor"]
        per_type = {v.get("partial_rotary_factor", 1.0) for v in rp.values() if isinstance(v, dict)}
        if len(per_type) == 1:
            return per_type.pop()
    prf = getattr(c, "partial_rotary_factor", None)
    return float(prf) if isinstance(prf, (int, float)) and not isinstance(prf, bool) else None


def _retie_rope(c: Any, before: dict[str, Any], fraction: float | None) -> None:
    """Where the rotary table (head_dim x partial_rotary_factor) is as wide as the MLA rotary part
    qk_rope_head_dim in the full config (dots3: 256 x 0.25 = 64), keep them equal in the proxy."""
    hd, rope = before.get("head_dim"), before.get("qk_rope_head_dim")
    if not (fraction and isinstance(hd, int) and isinstance(rope, int) and hd * fraction == rope):
        return
    new = int(getattr(c, "head_dim") * fraction)
    if new >= 2 and new % 2 == 0 and _writable(c, "qk_rope_head_dim"):
        c.qk_rope_head_dim = new


# State-space (Mamba-2 style) mixers split an inner width into heads: heads x head dim equals
# d_ssm, or expand x hidden_size where no d_ssm field exists. (heads, head dim) field pairs:
_SSM_HEADS = (("mamba_n_heads", "mamba_d_head"), ("mamba_num_heads", "mamba_head_dim"),
              ("num_heads", "head_dim"))
_SSM_GROUPS = ("mamba_n_groups", "n_groups")


def _ssm_expand(c: Any) -> int | None:
    return next((getattr(c, n) for n in ("mamba_expand", "expand")
                 if isinstance(getattr(c, n, None), int)), None)


def _ssm_inner(c: Any) -> int | None:
    d_ssm = getattr(c, "mamba_d_ssm", None)
    if isinstance(d_ssm, int) and d_ssm > 0:
        return d_ssm
    expand = _ssm_expand(c)
    hidden = getattr(c, "hidden_size", None)
    return expand * hidden if isinstance(expand, int) and isinstance(hidden, int) else None


def _retie_ssm_heads(c: Any, before: dict[str, Any], s: ProxySize) -> None:
    """Keep heads x head dim == the SSM inner width where the full config has it so: the
    proxy's inner width follows the shrunk hidden size (d_ssm at most expand x hidden), the head
    dim is capped, the heads fill the rest, and the group count divides the heads."""
    inner_before = before.get("_ssm_inner")
    for heads_name, dim_name in _SSM_HEADS:
        heads, dim = before.get(heads_name), before.get(dim_name)
        if not (isinstance(heads, int) and isinstance(dim, int) and inner_before == heads * dim):
            continue
        if isinstance(getattr(c, "mamba_d_ssm", None), int):
            c.mamba_d_ssm = min(c.mamba_d_ssm, (_ssm_expand(c) or 1) * c.hidden_size)
        inner = _ssm_inner(c)
        new_dim = min(dim, s.head_dim_cap, inner)
        new_heads = max(1, inner // new_dim)
        setattr(c, heads_name, new_heads)
        setattr(c, dim_name, inner // new_heads)
        for g in _SSM_GROUPS:
            groups = getattr(c, g, None)
            if isinstance(groups, int) and groups > 0:
                setattr(c, g, math.gcd(groups, new_heads))
        return


# an FFN's hidden width, named (the fields `_shrink_widths` sets by name are left to it)
_FFN_WIDTH = re.compile(r"(^|_)(intermediate_size|ffn_hidden_size|intermediate_dim)(_|$)")
_FFN_NAMED = ("intermediate_size", "shared_expert_intermediate_size") + EXPERT_WIDTH_NAMES

# the routed experts' own model width, where the MoE block projects the hidden state into one
# and back (MuseSpark's moe_hidden_size, Nemotron-H's moe_latent_size): a model width, not an FFN's
_EXPERT_MODEL_WIDTH = re.compile(r"(^|_)(moe|experts?)_(hidden|latent)_(size|dim)$")

_WIDTH_ALIAS = re.compile(r"^(embed(ding)?_(dim|size)|d_model|model_dim|n_embd|hidden_dim)$")


def _shrink_widths(c: Any, s: ProxySize, notes: list[str]) -> None:
    before = {n: getattr(c, n, None) for n in _TIED_DIMS + tuple(n for p in _SSM_HEADS for n in p)
              + ("qk_rope_head_dim",)}
    before["_ssm_inner"] = _ssm_inner(c)
    heads = getattr(c, "num_attention_heads", None)
    kv = getattr(c, "num_key_value_heads", None)
    had_head_dim = isinstance(getattr(c, "head_dim", None), int)
    hidden = getattr(c, "hidden_size", None)
    rope_fraction = _rope_fraction(c)
    _set(c, "hidden_size", lambda v: min(v, s.hidden))
    # a second name for the model width (xLSTM's embedding_dim beside hidden_size) follows it
    for name, v in list(vars(c).items()):
        if name != "hidden_size" and v == hidden and _WIDTH_ALIAS.search(name):
            _set(c, name, lambda _: c.hidden_size)
    if isinstance(heads, int):
        new_heads = min(heads, s.heads)
        c.num_attention_heads = new_heads
        if isinstance(kv, int) and kv > 0:
            groups = max(1, heads // kv)  # keep the GQA ratio where it fits
            c.num_key_value_heads = max(1, new_heads // min(groups, new_heads))
        if had_head_dim and _writable(c, "head_dim"):  # Falcon's is a property (hidden / heads)
            c.head_dim = min(c.head_dim, s.head_dim_cap)
        # a per-layer list of head counts (Laguna's num_attention_heads_per_layer, 48 a layer)
        # whose largest is the global count follows it, each layer keeping its share and a
        # multiple of the key/value heads; before, 48 stayed beside num_attention_heads 4
        kv_new = getattr(c, "num_key_value_heads", None)
        step = kv_new if isinstance(kv_new, int) and kv_new > 0 else 1
        for name, v in list(vars(c).items()):
            if "heads" in name and isinstance(v, (list, tuple)) and _is_width(v) \
                    and max(v) == heads and heads != new_heads and _writable(c, name):
                setattr(c, name, type(v)(max(step, x * new_heads // heads // step * step)
                                         for x in v))
    # an expert width field, an int or a per-layer list, sizes the experts: intermediate_size
    # is then the dense layers' width
    experts_use_ffn = _expert_count(c) is not None and not any(
        _is_width(getattr(c, n, None)) for n in EXPERT_WIDTH_NAMES)
    _set(c, "intermediate_size", lambda v: min(v, s.experts_ffn if experts_use_ffn else s.ffn))
    for name in EXPERT_WIDTH_NAMES:
        _set(c, name, lambda v: min(v, s.expert_ffn))
    _set(c, "shared_expert_intermediate_size", lambda v: min(v, s.expert_ffn * 2))
    # other FFN widths by their name's shape (Ergo's first_dense_intermediate_size and
    # shared_intermediate_size, Llama 4's intermediate_size_mlp, Falcon's ffn_hidden_size):
    # a shared expert's as the one above, a routed expert's as the expert width, else dense
    for name in [n for n in vars(c) if _FFN_WIDTH.search(n) and n not in _FFN_NAMED]:
        low = name.lower()
        cap = s.expert_ffn * 2 if "shared" in low else \
            s.expert_ffn if ("expert" in low or "moe" in low) else s.ffn
        _set(c, name, lambda v: min(v, cap))
    # the experts' own model width is capped as the model width is (MuseSpark's tiny proxy kept
    # moe_hidden_size 4096: 55.3M parameters, its experts 4096 wide around a hidden of 128)
    for name in [n for n in vars(c) if _EXPERT_MODEL_WIDTH.search(n) and n not in _FFN_NAMED]:
        _set(c, name, lambda v: min(v, s.hidden))
    # linear attention (gated delta / Kimi delta / mamba-style) widths
    lk = getattr(c, "linear_num_key_heads", None)
    lv = getattr(c, "linear_num_value_heads", None)
    if isinstance(lk, int) and isinstance(lv, int):
        ratio = max(1, lv // lk)
        c.linear_num_key_heads = min(lk, max(1, s.heads // 2))
        c.linear_num_value_heads = c.linear_num_key_heads * ratio
    _set(c, "linear_num_heads", lambda v: min(v, s.heads))
    for name in ("linear_key_head_dim", "linear_value_head_dim", "linear_head_dim"):
        _set(c, name, lambda v: min(v, s.head_dim_cap))
    # low-rank / MLA and indexer widths
    for name in ("q_lora_rank", "kv_lora_rank"):
        _set(c, name, lambda v: min(v, s.latent_cap * (2 if name == "q_lora_rank" else 1)))
    for name in ("qk_nope_head_dim", "v_head_dim", "index_head_dim"):
        _set(c, name, lambda v: min(v, s.head_dim_cap))
    _set(c, "qk_rope_head_dim", lambda v: min(v, max(8, s.head_dim_cap // 2)))
    _set(c, "index_n_heads", lambda v: min(v, s.heads))
    index_topk = getattr(c, "index_topk", None)
    _set(c, "index_topk", lambda v: min(v, s.index_topk))
    # the sparse selection's other budgets (Kolibri's always-kept local and sink tokens, its
    # candidate pool): below the proxy's lengths too, else no query sees more keys than the
    # budget and the selection never runs
    for name in [n for n in vars(c) if n.startswith("index_") and n.endswith("_tokens")]:
        _set(c, name, lambda v: min(v, max(1, s.index_topk // 4)))
    _set(c, "index_pool_size", lambda v: min(v, 2 * s.index_topk))
    if isinstance(index_topk, int) and getattr(c, "index_topk") != index_topk:
        notes.append(f"index_topk {index_topk} -> {c.index_topk}: sparse attention keeps fewer "
                     f"keys per query, below the proxy's sequence lengths (with K >= T the top-k "
                     f"selection keeps every key)")
    _set(c, "sliding_window", lambda v: min(v, s.window))
    for name in ("ssm_state_size", "state_size", "mamba_d_state"):
        _set(c, name, lambda v: min(v, 16 if s.hidden <= 256 else v))
    for name in ("mamba_n_heads", "mamba_num_heads"):
        _set(c, name, lambda v: min(v, s.heads * 2))
    _retie(c, before)
    _retie_rope(c, before, rope_fraction)
    _retie_ssm_heads(c, before, s)
    if isinstance(getattr(c, "qk_head_dim", None), int) and isinstance(
            getattr(c, "qk_nope_head_dim", None), int):
        c.qk_head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim


def _count(c: Any, name: str) -> int | None:
    v = getattr(c, name, None)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _expert_count(c: Any) -> int | None:
    """The routed experts (the largest count field above 1); None for a config without them."""
    counts = [v for n in EXPERT_COUNT_NAMES if (v := _count(c, n)) is not None and v > 1]
    return max(counts) if counts else None


def _topk_names(c: Any) -> list[str]:
    return [n for n in TOPK_NAMES + ("num_experts_per_token",) if _count(c, n) is not None]


@dataclass(frozen=True, slots=True)
class _Routing:
    experts: int
    groups: int  # 1: no group-limited routing
    topk_group: int | None


def _routing_for(n_exp: int, k: int, groups: int, topk_group: int | None) -> _Routing | None:
    """Group-limited routing over ``n_exp`` experts close to the full model's (``groups`` groups,
    the best ``topk_group`` of them searched) that can still pick ``k`` experts: the most groups
    that divide ``n_exp`` into groups of at least 2 (a group's score is its best two experts'),
    top groups fewer than groups where the full model has them fewer; None if none can."""
    if groups <= 1:
        return _Routing(n_exp, groups, topk_group)
    strict = topk_group is None or topk_group < groups
    for g in range(min(groups, n_exp // 2), 1, -1):
        if n_exp % g:
            continue
        tg = None if topk_group is None else max(1, min(topk_group, g - 1 if strict else g))
        if k <= (tg if tg is not None else g) * (n_exp // g):
            return _Routing(n_exp, g, tg)
    return None


def _shrink_experts(c: Any, s: ProxySize, notes: list[str]) -> None:
    """Routed experts down to the size's ``experts``, top-k kept: at least 2 x top-k experts,
    more where group-limited routing needs them to reach top-k. Top-k is capped (a note) only
    where that would take more than ``max_experts`` experts."""
    full_exp = _expert_count(c)
    if full_exp is None:
        return
    topk_names = _topk_names(c)
    k_full = max((getattr(c, n) for n in topk_names), default=1)
    groups_name = next((n for n in GROUP_COUNT_NAMES if _count(c, n) is not None), None)
    groups = getattr(c, groups_name) if groups_name else 1
    topk_group = _count(c, "topk_group") if groups > 1 else None
    limit = min(full_exp, s.max_experts)
    need = min(full_exp, 2 * k_full)  # experts that keeping top-k takes
    k = max(1, s.max_experts // 2) if need > s.max_experts else k_full
    why = f"keeping it would need {need} routed experts, over the proxy's limit of {s.max_experts}"
    routing = next((r for n in range(min(full_exp, max(s.experts, 2 * k)), limit + 1)
                    if (r := _routing_for(n, k, groups, topk_group)) is not None), None)
    if routing is None:
        why = (f"group-limited routing ({groups} groups, top {topk_group}) over at most "
               f"{limit} experts cannot reach it")
    while routing is None and k > 1:
        k -= 1
        routing = _routing_for(limit, k, groups, topk_group)
    if routing is None:  # groups of fewer than 2 experts in the full model too: keep its routing
        k, routing = k_full, _Routing(full_exp, groups, topk_group)
    for name in EXPERT_COUNT_NAMES:
        v = _count(c, name)
        if v is not None and v > 1 and _writable(c, name):
            setattr(c, name, min(v, routing.experts))
    if groups_name:
        setattr(c, groups_name, routing.groups)
    if routing.topk_group is not None:
        c.topk_group = routing.topk_group
    for name in topk_names:
        if _writable(c, name):
            setattr(c, name, min(getattr(c, name), k))
    if k < k_full:
        notes.append(f"top-k {k_full} -> {k}: {why}")


def _shrink_vocab(c: Any, s: ProxySize) -> None:
    vocab = getattr(c, "vocab_size", None)
    if not isinstance(vocab, int):
        return
    c.vocab_size = min(vocab, s.vocab)
    # other tables over the vocabulary, the same (Gemma 4's per-layer input embeddings) or a part
    # of it (Gemma 3n's vocab_size_per_layer_input, 262,144 of 262,400), are cut to it: left
    # whole, Gemma 3n's tiny proxy held a 262,144 x 2,560 table and 674M parameters, and its
    # alignment was killed for memory
    for name, v in list(vars(c).items()):
        if name != "vocab_size" and "vocab" in name and isinstance(v, int) \
                and c.vocab_size < v <= vocab:
            _set(c, name, lambda _: c.vocab_size)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        v = getattr(c, name, None)
        if isinstance(v, int) and v >= c.vocab_size:
            setattr(c, name, c.vocab_size - 1)
        elif isinstance(v, list):
            setattr(c, name, [min(x, c.vocab_size - 1) for x in v])
