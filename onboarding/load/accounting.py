"""Parameter accounting of a (usually meta-device) model, found by structure.

Routed experts are found from the module tree, not class names: a module holding >= 3-D
parameters that share a leading expert dimension E (packed experts), or a ModuleList of >= 2
identical modules whose parent also holds an [E, D] router weight. Packed weights with no router
beside them count as experts only where something routes: a top-k (module or config attribute) or
the config's expert count equal to E; else they are per-head weights every token uses
(RecurrentGemma's block-diagonal gates, [H, bw, bw]). A token uses top-k of the E
experts, so routed parameters count ``top_k / E`` toward the active parameters; shared experts and
dense parts count fully.

Alternative MoE blocks (`take_alternatives`): sibling MoE blocks of one class under one parent of
which a forward on one kind of token runs one alone (the parse found the other ran no op: an
`unknown` block with ``attrs["not_run"]``; ERNIE 4.5 VL's modality-routed experts) are branches
a token takes one of. The active parameters count the largest; the totals count every one.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from torch import nn

from onboarding.modpath import inside

# The config fields that count a model's routed experts.
EXPERT_COUNT_NAMES = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
# Config / module attribute names that hold the number of experts a token is routed to.
TOPK_NAMES = ("num_experts_per_tok", "top_k", "topk", "moe_topk", "num_selected_experts",
              "experts_per_token", "moe_k")

LAYER_INDEX = re.compile(r"\.(\d+)(?=\.|$)")


def path_pattern(path: str) -> str:
    """``model.layers.3.mlp`` -> ``model.layers.*.mlp`` (numeric components become ``*``)."""
    return LAYER_INDEX.sub(".*", path)


@dataclass(kw_only=True, slots=True)
class MoEInfo:
    path: str  # the MoE block (parent of experts and router)
    experts_path: str
    n_experts: int
    top_k: int | None
    top_k_source: str
    router_path: str | None
    routed_params: int
    shared_paths: list[str] = field(default_factory=list)
    class_name: str = ""  # the MoE block's class (siblings of one class may be alternatives)
    active_params: int = 0  # parameters under ``path`` a token uses (routed: top-k of E)
    # the sibling MoE block a token takes instead of this one (`take_alternatives`); "": none
    alternative_to: str = ""


@dataclass(kw_only=True, slots=True)
class ParamCounts:
    total: int
    active: int
    active_without_embeddings: int
    embedding: int
    lm_head: int
    tied_embeddings: bool
    routed_experts: int
    by_category: dict[str, int]
    by_component: dict[str, int]
    moe: list[MoEInfo]
    # a multimodal model's parts (language, vision, projector, audio...; onboarding.load.multimodal)
    by_part: dict[str, int] = field(default_factory=dict)
    parts_note: str = ""
    alternatives_note: str = ""  # MoE blocks a token takes one of (`take_alternatives`)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _is_conv(m: nn.Module) -> bool:
    return isinstance(m, nn.modules.conv._ConvNd)


def _packed_experts(module: nn.Module) -> int | None:
    """E if ``module`` directly holds >= 3-D parameters that all share leading dim E >= 2."""
    if _is_conv(module):
        return None
    leads = {p.shape[0] for p in module.parameters(recurse=False) if p.ndim >= 3}
    if len(leads) == 1 and (e := leads.pop()) >= 2:
        return e
    return None


def _same_structure(mods: list[nn.Module]) -> bool:
    sig = [tuple((n, tuple(p.shape)) for n, p in m.named_parameters()) for m in mods]
    return len(mods) >= 2 and all(s == sig[0] and s for s in sig)


def _router_in(parent: nn.Module, parent_path: str, n_experts: int,
               skip: str) -> str | None:
    for name, mod in parent.named_modules():
        path = f"{parent_path}.{name}" if name and parent_path else name or parent_path
        if inside(path, skip):
            continue
        for pname, p in mod.named_parameters(recurse=False):
            if p.ndim == 2 and p.shape[0] == n_experts:
                return path
    return None


def _top_k(block: nn.Module, router: nn.Module | None, config: Any) -> tuple[int | None, str]:
    for where, obj in (("router", router), ("moe block", block)):
        for attr in TOPK_NAMES:
            v = getattr(obj, attr, None) if obj is not None else None
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v, f"{where} attribute {attr}"
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    for attr in TOPK_NAMES:
        v = getattr(cfg, attr, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v, f"config.{attr}"
    return None, "not found"


def _config_counts_experts(config: Any, n_experts: int) -> bool:
    """Whether the (text) config names ``n_experts`` as its number of routed experts."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    return any(getattr(cfg, name, None) == n_experts for name in EXPERT_COUNT_NAMES)


def find_moe(model: nn.Module, config: Any = None) -> list[MoEInfo]:
    modules = dict(model.named_modules())
    found: list[MoEInfo] = []
    for path, mod in modules.items():
        n_exp = _packed_experts(mod)
        if n_exp is None and isinstance(mod, nn.ModuleList) and _same_structure(list(mod)):
            n_exp = len(mod)
        if n_exp is None or not path:
            continue
        parent_path = path.rsplit(".", 1)[0] if "." in path else ""
        parent = modules[parent_path]
        router = _router_in(parent, parent_path, n_exp, skip=path)
        if router is None:
            if isinstance(mod, nn.ModuleList):
                continue  # identical layers without a router are just a layer stack
            block_path = path  # packed experts with a router held elsewhere: count anyway
        else:
            block_path = parent_path
        if any(inside(path, f.experts_path) for f in found):
            continue
        top_k, src = _top_k(modules[block_path], modules.get(router) if router else None,
                            config)
        if router is None and top_k is None and not _config_counts_experts(config, n_exp):
            # no sign of routing: per-head weights every token uses ([H, bw, bw] block-diagonal
            # gates, RecurrentGemma's RG-LRU), not routed experts
            continue
        shared = []
        if block_path != path:
            for name, child in modules[block_path].named_children():
                cpath = f"{block_path}.{name}" if block_path else name
                if cpath in (path, router) or (router or "").startswith(cpath + "."):
                    continue
                if sum(1 for m in child.modules() if isinstance(m, nn.Linear)) >= 2:
                    shared.append(cpath)
        found.append(MoEInfo(path=block_path, experts_path=path, n_experts=n_exp, top_k=top_k,
                             top_k_source=src, router_path=router,
                             routed_params=sum(p.numel() for p in mod.parameters()),
                             shared_paths=shared,
                             class_name=type(modules[block_path]).__name__))
    return found


def _owner(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0] if "." in param_name else ""


def count_parameters(model: nn.Module, config: Any = None) -> ParamCounts:
    """Exact totals (tied parameters counted once) and active-per-token parameters."""
    modules = dict(model.named_modules())
    moe = find_moe(model, config)
    embed_ids = {id(m.weight) for m in modules.values() if isinstance(m, nn.Embedding)}
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_ids = {id(out_emb.weight)} if isinstance(out_emb, nn.Module) and hasattr(
        out_emb, "weight") else set()
    tied = bool(head_ids & embed_ids)

    def category(owner: str, pid: int) -> str:
        if pid in embed_ids:
            return "embedding"
        if pid in head_ids:
            return "lm_head"
        for info in moe:
            if inside(owner, info.experts_path):
                return "moe.experts"
            if info.router_path and owner == info.router_path:
                return "moe.router"
            if any(inside(owner, s) for s in info.shared_paths):
                return "moe.shared_expert"
        mod = modules.get(owner)
        if mod is not None and not list(mod.children()) and all(
                p.ndim == 1 for p in mod.parameters(recurse=False)):
            return "norm"
        return "dense"

    total = active = 0
    by_category: dict[str, int] = {}
    by_component: dict[str, int] = {}
    embedding = lm_head = 0
    for name, p in model.named_parameters():  # named_parameters de-duplicates tied tensors
        n = p.numel()
        owner = _owner(name)
        cat = category(owner, id(p))
        total += n
        by_category[cat] = by_category.get(cat, 0) + n
        pat = path_pattern(owner)
        by_component[pat] = by_component.get(pat, 0) + n
        if cat == "embedding":
            embedding += n
        elif cat == "lm_head":
            lm_head += n
        share = float(n)
        if cat == "moe.experts":
            info = next(i for i in moe if inside(owner, i.experts_path))
            share = n * ((info.top_k / info.n_experts) if info.top_k else 1.0)
        active += share
        block = next((i for i in moe if inside(owner, i.path)), None)
        if block is not None:
            block.active_params += share
    active = int(round(active))
    for info in moe:
        info.active_params = int(round(info.active_params))
    return ParamCounts(total=total, active=active,
                       active_without_embeddings=active - embedding - lm_head,
                       embedding=embedding, lm_head=lm_head, tied_embeddings=tied,
                       routed_experts=by_category.get("moe.experts", 0),
                       by_category=by_category, by_component=by_component, moe=moe)


def alternative_moe(moe: list[MoEInfo], not_run: list[str]) -> dict[str, str]:
    """{MoE block path: the sibling path a token takes instead} for the MoE blocks that are
    alternatives: two or more MoE blocks of one class under one parent, of which some ran no op
    in a forward (``not_run``: paths, of the proxy or this model, compared by `path_pattern`)
    while another did. A token takes one: the one kept is the largest by active parameters
    (the first of equals); the others map to it."""
    unrun = {path_pattern(p) for p in not_run}
    groups: dict[tuple[str, str], list[MoEInfo]] = {}
    for info in moe:
        if "." in info.path:
            groups.setdefault((info.path.rsplit(".", 1)[0], info.class_name), []).append(info)
    out: dict[str, str] = {}
    for infos in groups.values():
        ran = [i for i in infos if path_pattern(i.path) not in unrun]
        if len(infos) < 2 or not ran or len(ran) == len(infos):
            continue
        kept = max(infos, key=lambda i: i.active_params)  # max keeps the first of equals
        out.update({i.path: kept.path for i in infos if i is not kept})
    return out


def take_alternatives(counts: ParamCounts, not_run: list[str]) -> None:
    """Count one of each group of alternative MoE blocks (`alternative_moe`) in ``counts``'s
    active parameters, the largest, and say which in ``alternatives_note``; the totals, the
    routed experts and the categories still count every block (their weights are all held).
    Blocks already taken out are not taken out twice."""
    alt = alternative_moe(counts.moe, not_run)
    dropped = [i for i in counts.moe if i.path in alt and not i.alternative_to]
    if not dropped:
        return
    for info in dropped:
        info.alternative_to = alt[info.path]
        counts.active -= info.active_params
        counts.active_without_embeddings -= info.active_params
    kept = sorted({path_pattern(i.alternative_to) for i in dropped})
    left = sorted({path_pattern(i.path) for i in dropped})
    n = sum(i.active_params for i in dropped)
    counts.alternatives_note = (
        f"MoE blocks a token takes one of (siblings of one class; the others ran no op on the "
        f"proxy's tokens): the active parameters count {', '.join(kept)} (the largest), not "
        f"{', '.join(left)} ({n:,} parameters a token of the other kind would use instead); "
        "the totals count both")


def token_embedding(model: nn.Module) -> nn.Embedding | None:
    """The token embedding table, whose width is the model's (D): the table that a linear
    projects back to (in_features its width, out_features its rows: the output head, tied or
    not), else the table with the most rows. Rows alone can mislead: a per-layer input table
    (Gemma 3n: L x P values per token) may have more rows than the vocabulary."""
    tables = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if not tables:
        return None
    heads = {(m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear)}
    matched = [t for t in tables if (t.embedding_dim, t.num_embeddings) in heads]
    return max(matched or tables, key=lambda m: m.num_embeddings)
