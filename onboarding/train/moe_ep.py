"""Expert parallelism for packed ``moe.experts`` blocks: dispatch, grouped compute, combine.

Each ``moe.experts`` block of the op graph (packed 3-D weights, ``forward(hidden, top_k_index,
top_k_weights)`` as in transformers 5) is replaced by an `EPExperts` module. With EP degree
``ep`` the rank at EP coordinate ``c`` keeps experts ``[c*E/ep, (c+1)*E/ep)`` (frozen, sliced
from the full deterministic init). One forward:

  1. local (token, k) pairs sorted (stably) by expert; per-(rank, expert) counts exchanged;
  2. hidden rows and their routing weights sent with the autograd-aware ``all_to_all_single``
     (uneven and zero splits);
  3. received rows regrouped by local expert, computed grouped (SwiGLU, or a non-gated
     up -> act -> down; optional expert LoRA with per-expert A/B and no delta-W), each row
     scaled by its routing weight inside (before the down projection where no down bias
     forbids it: the backward then keeps no [P, D] rows for the weights' gradient), optional
     capacity drop at the owner;
  4. results sent back and summed per token on the origin rank; the weights' gradient returns
     through the same all-to-all to the router.

The tensor ops of steps 1, 3 and 4 (pair order, gathers, placement and combine, the weighted
SwiGLU, the grouped matmul) are in `_moe_ep_ops`; this module holds the experts module, its
application to a model and the routers' load balancing.

Legend: N tokens, K top-k, E experts (E_l local), D hidden, F expert width, r LoRA rank,
P pairs (N*K), R received rows. The first expert weight is gate_up [E, 2F, D] (gated: [gate |
up] halves) or up [E, F, D] (non-gated); down is [E, D, F] either way.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.nn import functional as F

from onboarding.errors import InputError
from onboarding.graph.opgraph import OpGraph
from onboarding.patching.core import _experts_bindings, _gated_experts_roles
from onboarding.train._moe_ep_ops import (_bincount, _combine_pairs, _counts, _gather_pairs, _gmms,
                                          _PairOrder, _place_rows, _SwiGLUWeighted)


@dataclass(kw_only=True)
class EPGroup:
    """The expert-parallel process group of this rank (``group=None``: one process, no comms)."""

    group: dist.ProcessGroup | None = None
    rank: int = 0
    size: int = 1


@dataclass(kw_only=True)
class ExpertLoRA:
    rank: int
    alpha: float


_ROLES = ("gate_up", "down", "gate_up_bias", "down_bias")


def _packed_weights(module: nn.Module, width: int, attrs: dict, path: str = ""
                    ) -> dict[str, tuple[str, torch.Tensor]]:
    """{role: (parameter name, weight in the kernel layout)} for roles gate_up (or a non-gated
    up), down and, where the block has them, gate_up_bias and down_bias, found by the patching
    binding's shape rule for hidden states of ``width`` (a non-gated block's up is the weight
    ending in it) and the classifier's ``attrs`` (weight layout, gate/up split, bias names).

    The kernel layout: gate_up [E, 2F, D] as [gate | up] halves (up [E, F, D]), down [E, D, F],
    gate_up_bias [E, 2F] as halves, down_bias [E, D]. A weight already in it is the parameter
    itself; another (gpt-oss's x @ W, interleaved gate/up) is a converted copy.
    """
    found: list[tuple[torch.Tensor, ...]] = []
    biased = bool(attrs.get("gate_up_bias") and attrs.get("down_bias"))
    block = SimpleNamespace(attrs=attrs)
    bindings = _experts_bindings(module, lambda x, i, w, *ws: found.append(ws), block, kernel_bias=biased)
    where = path or type(module).__name__
    if not bindings:
        raise InputError(f"{where}: expected packed expert weights [E, 2F, D] (or [E, F, D]) and "
                         "[E, D, F], or their x @ W transposes; expert parallelism cannot split this "
                         "block")
    if len(bindings) > 1:  # non-gated with F == D: the shapes cannot tell up from down
        raise InputError(f"{where}: non-gated experts with F == D ({width}): which packed weight is "
                         "up cannot be told by shape; expert parallelism cannot split this block")
    # The binding hands the weights it found to its kernel function: a probe call reveals them.
    with torch.no_grad():
        next(iter(bindings.values()))(torch.zeros(1, width), torch.zeros(1, 1, dtype=torch.long),
                                      torch.ones(1, 1))
    own = {id(p): n for n, p in module.named_parameters(recurse=False)}
    # Only gated weights are converted: their source names are the binding's own (its shape rule
    # for gate_up / down, the classifier's names for the biases).
    gated = _gated_experts_roles(module, *[p for p in module.parameters(recurse=False) if p.ndim == 3])
    sources = {**(gated[1] if gated else {}), **{r: attrs[r] for r in _ROLES[2:] if attrs.get(r)}}
    return {role: (own.get(id(t)) or sources[role], t) for role, t in zip(_ROLES, found[0])}


class EPExperts(nn.Module):
    """Expert-parallel replacement of a packed experts module.

    Parameters: the frozen base weights and biases (local experts only) in the kernel layout (see
    `_packed_weights`): under their original names where they already are in it, else (gpt-oss's
    x @ W, interleaved gate/up) converted copies under their roles (``gate_up``, ``down``,
    ``gate_up_bias``); and with expert LoRA ``lora_A_gate_up [E_l, r, D]``, ``lora_B_gate_up [E_l, 2F, r]`` (non-gated
    experts: ``[E_l, F, r]``, on up), ``lora_A_down [E_l, r, F]``, ``lora_B_down [E_l, D, r]`` in
    fp32 (B starts at zero). ``act`` is the gate's activation (gated) or the expert's (non-gated).
    """

    def __init__(self, source: nn.Module, *, path: str, layer: int, ep: EPGroup, width: int,
                 act: Callable[[torch.Tensor], torch.Tensor], attrs: dict | None = None,
                 lora: ExpertLoRA | None = None, capacity_factor: float | None = None,
                 dispatch_groups: int = 1, seed: int = 0):
        super().__init__()
        attrs = attrs or {}
        self.path, self.layer, self.ep, self.act = path, layer, ep, act
        self.capacity_factor, self.dispatch_groups = capacity_factor, dispatch_groups
        self.kernel: Callable | None = None  # see `use_kernel`
        self.swiglu_kernel: Callable | None = None  # see `use_swiglu_kernel`
        self.pair_sum_kernel: Callable | None = None  # see `use_pair_sum_kernel`
        # gpt-oss's SwiGLU: gate clamped above, up clamped both ways and offset before the product
        self.limit = attrs.get("clamp")
        self.up_offset = float(attrs.get("up_offset") or 0.0)
        roles = _packed_weights(source, width, attrs, path)
        gate_up, down = roles["gate_up"][1], roles["down"][1]
        self.n_experts = gate_up.shape[0]
        # gate_up [E, 2F, D] against down [E, D, F]; a non-gated block's up is [E, F, D]
        self.gated = gate_up.shape[1] == 2 * down.shape[2]
        if self.n_experts % ep.size:
            raise InputError(f"{path}: ep={ep.size} does not divide {self.n_experts} experts")
        used = {n for n, _ in roles.values()}
        extra = [n for n, _ in source.named_parameters(recurse=False) if n not in used]
        if extra:
            raise InputError(f"{path}: expert parameters {extra} are not supported by expert "
                             "parallelism")
        converted = sorted(n for n, t in roles.values() if t is not getattr(source, n))
        if converted and lora is not None:
            raise InputError(f"{path}: expert_lora=true, but the expert weights {converted} are not "
                             "in the [E, out, in] layout with [gate | up] halves (x @ W or "
                             "interleaved gate/up, as gpt-oss); expert LoRA needs that layout. Set "
                             "expert_lora=false")
        self.n_local = self.n_experts // ep.size
        lo = ep.rank * self.n_local
        sl = slice(lo, lo + self.n_local)
        # Frozen local slices in the kernel layout: a weight already in it keeps its name (and the
        # source's order); a converted one is registered under its role (gate_up, down, ...).
        self.names: dict[str, str] = {}
        role_of = {name: role for role, (name, _) in roles.items()}
        for name, p in source.named_parameters(recurse=False):
            role = role_of[name]
            t = roles[role][1]
            reg = name if t is p else role
            self.register_parameter(reg, nn.Parameter(t.detach()[sl].clone(), requires_grad=False))
            self.names[role] = reg
        self.gate_up_name, self.down_name = self.names["gate_up"], self.names["down"]
        # what a plain SwiGLU experts kernel (`use_kernel`) computes: silu(gate) * up; no biases,
        # clamp, offset or slope
        self.plain = (self.gated and "gate_up_bias" not in roles and self.limit is None
                      and self.up_offset == 0.0 and float(attrs.get("alpha") or 1.0) == 1.0
                      and _is_silu(act))
        self.lora = lora
        if lora is not None:
            self._init_lora(lora, gate_up.shape, down.shape, seed, sl)
        self._k = 1
        self.last_counts: torch.Tensor | None = None  # [E] pairs routed per expert, this rank
        self.last_dropped = 0
        self._full_lora: dict[str, torch.Tensor] | None = None

    # ---- parameters ------------------------------------------------------------------------
    def _init_lora(self, lora: ExpertLoRA, gu_shape, dn_shape, seed: int, sl: slice) -> None:
        e, two_f, d = gu_shape  # two_f: F for non-gated experts
        f = dn_shape[2]
        gen = torch.Generator().manual_seed(seed * 1_000_003 + 7919 * (self.layer + 1))
        dev = getattr(self, self.gate_up_name).device

        def a(in_f: int) -> nn.Parameter:  # nn.Linear's default init: U(-1/sqrt(in), 1/sqrt(in))
            full = (torch.rand(e, lora.rank, in_f, generator=gen) * 2 - 1) / math.sqrt(in_f)
            return nn.Parameter(full[sl].clone().to(dev))

        self.lora_A_gate_up = a(d)
        self.lora_B_gate_up = nn.Parameter(torch.zeros(self.n_local, two_f, lora.rank, device=dev))
        self.lora_A_down = a(f)
        self.lora_B_down = nn.Parameter(torch.zeros(self.n_local, d, lora.rank, device=dev))
        self.scaling = lora.alpha / lora.rank

    def use_kernel(self, experts_lora: Callable | None) -> bool:
        """Compute the experts and their expert LoRA with ``experts_lora(x_sorted, counts, gate_up,
        down, A_gu, B_gu, A_d, B_d, scaling) -> y_sorted`` (`moe_experts/swiglu_lora`'s
        pre-sorted entry) from now on (None: the torch path again). Only plain SwiGLU experts
        with expert LoRA take it (``plain``); returns whether this module did."""
        self.kernel = experts_lora if self.plain and self.lora is not None else None
        return self.kernel is not None

    def use_swiglu_kernel(self, swiglu_weighted: Callable | None) -> bool:
        """Compute the routing-weighted SwiGLU of the torch path (`_SwiGLUWeighted`) with
        ``swiglu_weighted(h [R, 2F], w [R]) -> [R, F]`` (`swiglu/weighted`'s entry: one Triton
        pass forward, one backward with dw reduced inside) from now on (None: `_SwiGLUWeighted`
        again). Attaching is the choice (`onboarding.train.kernels.attach_swiglu_kernels`,
        on CUDA only): an attached kernel is used, nothing else decides. Only plain SwiGLU
        experts take it (``plain``: no clamp, offset, slope or biases); returns whether this
        module did."""
        self.swiglu_kernel = swiglu_weighted if self.plain else None
        return self.swiglu_kernel is not None

    def use_pair_sum_kernel(self, pair_sum: Callable | None) -> None:
        """Sum each token's k rows with ``pair_sum(src [S, D], index [n * k], k) -> [n, D]`` (the
        pair-sum family's entry: one Triton pass, fp32 sums rounded once) from now on, in the
        combine (`_CombinePairs`) and in the backward of the token-row gather (`_GatherPairs`);
        None: the torch path of `_sum_pairs` again. Attaching is the choice
        (`onboarding.train.kernels.attach_pair_sum_kernels`, on CUDA only); every experts module
        takes it (the combine does not depend on the experts' activation)."""
        self.pair_sum_kernel = pair_sum

    def lora_parameters(self) -> list[nn.Parameter]:
        if self.lora is None:
            return []
        return [self.lora_A_gate_up, self.lora_B_gate_up, self.lora_A_down, self.lora_B_down]

    # ---- forward ---------------------------------------------------------------------------
    def _split_args(self, args, kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        idx = [t for t in tensors if not t.is_floating_point()]
        flt = [t for t in tensors if t.is_floating_point()]
        width = getattr(self, self.gate_up_name).shape[2]
        hidden = [t for t in flt if t.shape[-1] == width and t.ndim == 2]
        weights = [t for t in flt if t is not (hidden[0] if hidden else None)]
        if len(idx) != 1 or len(hidden) < 1 or len(weights) != 1:
            raise ValueError(f"{self.path}: expected (hidden [N, {width}], top_k_index [N, K], "
                             f"top_k_weights [N, K]), got {[tuple(t.shape) for t in tensors]}")
        return hidden[0], idx[0], weights[0]

    def forward(self, *args, **kwargs) -> torch.Tensor:
        x, idx, w = self._split_args(args, kwargs)
        n, k = idx.shape
        self._k = k
        flat_e = idx.reshape(-1)
        counts = _bincount(flat_e, self.n_experts)
        self.last_counts = counts.detach()
        self.last_dropped = 0  # summed over the dispatch groups of this forward
        order = torch.argsort(flat_e, stable=True)  # pairs grouped by expert, token order inside
        # the routing weights travel with their rows and are applied inside the expert compute
        # (`_compute`), so the combine below is a plain sum that keeps nothing for the backward
        if self.ep.group is None and self.dispatch_groups > 1:
            return self._grouped_single(x, idx, w).view(n, k, -1).sum(1).to(x.dtype)
        po = _PairOrder.of(order, k)  # rows and inverse once, shared by the gathers and combine
        y_sorted = self._dispatch(_gather_pairs(x, po, k, self.pair_sum_kernel), counts, n,
                                  _gather_pairs(w.reshape(-1), po))
        return _combine_pairs(y_sorted, po, k, self.pair_sum_kernel).to(x.dtype)

    def _grouped_single(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor
                        ) -> torch.Tensor:
        """One process standing in for ``dispatch_groups`` EP groups (capacity per group)."""
        n, k = idx.shape
        if n % self.dispatch_groups:
            raise ValueError(f"{self.path}: {n} tokens do not split into "
                             f"{self.dispatch_groups} dispatch groups")
        outs = []
        for xs, ids, ws in zip(x.chunk(self.dispatch_groups), idx.chunk(self.dispatch_groups),
                               w.chunk(self.dispatch_groups)):
            fe = ids.reshape(-1)
            o = torch.argsort(fe, stable=True)
            po = _PairOrder.of(o, k)
            ys = self._dispatch(_gather_pairs(xs, po, k, self.pair_sum_kernel),
                                _bincount(fe, self.n_experts),
                                xs.shape[0], _gather_pairs(ws.reshape(-1), po))
            outs.append(_place_rows(ys, o))
        return torch.cat(outs)

    def _dispatch(self, x_sorted: torch.Tensor, counts: torch.Tensor, n_tokens: int,
                  w_sorted: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert [P, D] and their routing weights [P] -> the weighted expert
        outputs in the same order [P, D]."""
        ep, el = self.ep, self.n_local
        if ep.group is None:  # one source, this rank: its counts and token count as they are
            return self._local(x_sorted, None, w_sorted, counts=counts, tokens=n_tokens)
        # Per destination rank: counts of its local experts, plus our token count (capacity).
        send = torch.cat([counts.view(ep.size, el),
                          counts.new_full((ep.size, 1), n_tokens)], dim=1).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=ep.group)
        in_splits = counts.view(ep.size, el).sum(1).tolist()
        out_splits = recv[:, :el].sum(1).tolist()
        x_recv = all_to_all_single_autograd(x_sorted, out_splits, in_splits, ep.group)
        w_recv = all_to_all_single_autograd(w_sorted.unsqueeze(1).contiguous(), out_splits,
                                            in_splits, ep.group).squeeze(1)
        y_recv = self._local(x_recv, recv, w_recv)
        return all_to_all_single_autograd(y_recv, in_splits, out_splits, ep.group)

    def _local(self, x_recv: torch.Tensor, recv: torch.Tensor | None, w_recv: torch.Tensor, *,
               counts: torch.Tensor | None = None, tokens: int | None = None) -> torch.Tensor:
        """Rows received from each source (source-major, expert-sorted inside) and their routing
        weights -> weighted outputs.

        ``recv [S, E_l + 1]``: rows per (source, local expert) and each source's token count;
        None for one source (this rank's own rows), whose ``counts`` [E_l] and ``tokens`` are
        given (no [1, E_l + 1] table to build and sum: two launches and a sum per MoE layer).
        """
        el = self.n_local
        if recv is None or recv.shape[0] == 1:  # one source: rows already grouped by expert
            if recv is not None:
                counts, tokens = recv[0, :el], recv[0, el]
            regroup, xg, wg = None, x_recv, w_recv
        else:
            per = recv[:, :el]
            counts, tokens = per.sum(0), recv[:, el].sum()
            local_e = torch.repeat_interleave(
                torch.arange(el, device=x_recv.device).repeat(per.shape[0]), per.reshape(-1),
                output_size=x_recv.shape[0])  # the size known: no host read of the counts
            regroup = _PairOrder.of(torch.argsort(local_e, stable=True), 1)  # expert-major,
            xg, wg = _gather_pairs(x_recv, regroup), _gather_pairs(w_recv, regroup)  # then source
        keep = None
        if self.capacity_factor is not None:
            # capacity per expert over the dispatch group: ceil(cf * tokens * K / E)
            cap = math.ceil(self.capacity_factor * int(tokens) * self._k / self.n_experts)
            start = torch.cumsum(counts, 0) - counts
            pos = torch.arange(xg.shape[0], device=xg.device) - start.repeat_interleave(
                counts, output_size=xg.shape[0])
            keep = pos < cap
            self.last_dropped += int((~keep).sum())
            kept_counts = torch.clamp(counts, max=cap)
            yk = self._compute(xg[keep], kept_counts, wg[keep])
            yg = _place_rows(yk, keep.nonzero().squeeze(1), xg.shape[0])
        else:
            yg = self._compute(xg, counts, wg)
        return yg if regroup is None else _place_rows(yg, regroup.order)

    def _compute(self, xg: torch.Tensor, counts: torch.Tensor | list[int],
                 wg: torch.Tensor | None = None) -> torch.Tensor:
        """The experts (SwiGLU, or non-gated act(up); per-expert biases, gpt-oss's clamp and up
        offset) over rows grouped by local expert, with expert LoRA inside, each row times its
        routing weight ``wg`` (None: unweighted); through the kernel of `use_kernel` when it
        attached one.

        Without a down bias the weight scales the activation before the down projection (both
        down terms are linear in it): plain SwiGLU rows then keep only the gate/up product and
        the weights for the backward (`_SwiGLUWeighted`, or the Triton kernel of
        `use_swiglu_kernel`), where the weighted output rows would otherwise be kept [rows, D]
        for the weights' gradient."""
        gu, dn = getattr(self, self.gate_up_name), getattr(self, self.down_name)
        if self.kernel is not None:
            y = self.kernel(xg, _counts(counts, xg.device), gu, dn,
                            *self.lora_parameters(), self.scaling).to(xg.dtype)
            return y if wg is None else y * wg.unsqueeze(-1).to(y.dtype)
        bgu, bd = (getattr(self, self.names[r]) if r in self.names else None
                   for r in ("gate_up_bias", "down_bias"))
        e = None  # each row's local expert, for the biases
        if bgu is not None:
            e = torch.repeat_interleave(torch.arange(len(counts), device=xg.device),
                                        _counts(counts, xg.device))
        gmm = _gmms(counts)  # the per-expert loops read the counts once
        h = gmm(xg, gu.transpose(1, 2))
        if bgu is not None:
            h = h + bgu[e].to(h.dtype)
        if self.lora is not None:
            xa = gmm(xg.float(), self.lora_A_gate_up.transpose(1, 2))
            h = h.float() + self.scaling * gmm(xa, self.lora_B_gate_up.transpose(1, 2))
        pre = wg is not None and bd is None  # the weight goes on the activation
        if self.plain and pre:
            a = (_SwiGLUWeighted.apply(h, wg) if self.swiglu_kernel is None
                 else self.swiglu_kernel(h, wg))
        else:
            if self.gated:
                g, u = h.chunk(2, dim=-1)
                if self.limit is not None:
                    g, u = g.clamp(max=self.limit), u.clamp(min=-self.limit, max=self.limit)
                a = self.act(g) * (u + self.up_offset if self.up_offset else u)
            else:
                a = self.act(h)
            if pre:
                a = a * wg.unsqueeze(-1).to(a.dtype)
        y = gmm(a.to(dn.dtype), dn.transpose(1, 2))
        if bd is not None:
            y = y + bd[e].to(y.dtype)
        if self.lora is not None:
            aa = gmm(a.float(), self.lora_A_down.transpose(1, 2))
            y = y.float() + self.scaling * gmm(aa, self.lora_B_down.transpose(1, 2))
        if wg is not None and not pre:
            y = y * wg.unsqueeze(-1).to(y.dtype)
        return y.to(xg.dtype)

    # ---- export ----------------------------------------------------------------------------
    def gather_lora(self) -> None:
        """Collective over the EP group: keep the full [E, ...] expert LoRA for `peft_tensors`."""
        if self.lora is None:
            return
        full = {}
        for name, p in zip(("A_gate_up", "B_gate_up", "A_down", "B_down"),
                           self.lora_parameters()):
            t = p.detach()
            if self.ep.group is not None and self.ep.size > 1:
                parts = [torch.empty_like(t) for _ in range(self.ep.size)]
                dist.all_gather(parts, t.contiguous(), group=self.ep.group)
                t = torch.cat(parts)
            full[name] = t.float().cpu()
        self._full_lora = full

    def peft_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """PEFT ``ParamWrapper`` tensors of the full expert LoRA (see `peft_export`).

        With ep > 1, call `gather_lora` on every rank first (it is a collective).
        """
        from onboarding.train.peft_export import expert_lora_tensors

        if self.lora is None:
            return {}
        if self._full_lora is None:
            if self.ep.size > 1:
                raise RuntimeError(f"{self.path}: call gather_lora() on every rank first")
            self.gather_lora()
        t = self._full_lora
        assert t is not None
        # registration order of the base weights: PEFT nests its wrappers in that order
        order = [n for n, _ in self.named_parameters(recurse=False)
                 if n in (self.gate_up_name, self.down_name)]
        pairs = {self.gate_up_name: (t["A_gate_up"], t["B_gate_up"]),
                 self.down_name: (t["A_down"], t["B_down"])}
        return expert_lora_tensors(prefix, [(n, *pairs[n]) for n in order])

    def peft_target(self) -> dict:
        """``target_parameters`` (names relative to this module) for adapter_config.json."""
        return {"target_parameters": [self.gate_up_name, self.down_name] if self.lora else []}


# The non-gated experts' activations by the classifier's names (`moe_experts/mlp`'s set).
_MLP_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu2": lambda x: torch.relu(x).square(), "relu": torch.relu, "silu": F.silu, "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def _is_silu(act: Callable) -> bool:
    """Whether ``act`` computes silu (g * sigmoid(g)): checked on values, not by its type."""
    t = torch.linspace(-8.0, 8.0, 161)
    try:
        return bool(torch.allclose(act(t), F.silu(t), rtol=1e-5, atol=1e-6))
    except Exception:  # noqa: BLE001 - an activation that cannot take a plain tensor is not silu
        return False


def _activation(block_attrs: dict, module: nn.Module, path: str) -> Callable:
    """The module's own ``act_fn`` when it has one, else the classifier's activation name; a
    gate's sigmoid slope (``alpha``: g * sigmoid(alpha * g), gpt-oss) when the classifier read one."""
    if block_attrs.get("clamp") is not None and block_attrs.get("clamp_style") != "pre_act":
        raise InputError(f"{path}: clamped SwiGLU experts with clamp style "
                         f"{block_attrs.get('clamp_style')!r} are not supported by expert parallelism")
    alpha = block_attrs.get("alpha")
    if block_attrs.get("gated") is not False and alpha is not None:
        return lambda g: g * torch.sigmoid(float(alpha) * g)
    act = getattr(module, "act_fn", None)
    if callable(act):
        return act
    name = block_attrs.get("activation", "silu")
    if block_attrs.get("gated") is False and name in _MLP_ACTS:
        return _MLP_ACTS[name]
    if name == "silu":
        return F.silu
    raise InputError(f"{path}: expert activation {name!r} unsupported by expert parallelism")


def _ep_module(block, src: nn.Module, ep: EPGroup, **kw) -> EPExperts:
    """The `EPExperts` replacing ``block`` (module ``src``), or `InputError` naming why not."""
    a = block.attrs
    if a.get("zero_experts"):  # identity slots past the real experts: no dispatch for them here
        raise InputError(f"{block.path}: expert parallelism supports routed experts with weights; "
                         f"this block has zero_experts={a['zero_experts']!r} (identity experts)")
    if a.get("gate_up_split") not in (None, "halves", "interleaved"):
        raise InputError(f"{block.path}: gate/up split {a.get('gate_up_split')!r} unread; expert "
                         "parallelism needs [gate | up] halves or interleaved gate/up")
    if a.get("layout") != "packed_3d":
        raise InputError(f"{block.path}: expert layout {a.get('layout')!r}; expert parallelism "
                         "needs packed 3-D expert weights")
    if not block.inputs:
        raise InputError(f"{block.path}: the op graph records no input for this experts block")
    return EPExperts(src, path=block.path, layer=block.layer or 0, ep=ep, width=block.inputs[0].shape[-1],
                     act=_activation(a, src, block.path), attrs=a, **kw)


def apply_expert_parallel(model: nn.Module, graph: OpGraph, ep: EPGroup, *,
                          lora: ExpertLoRA | None = None, capacity_factor: float | None = None,
                          dispatch_groups: int = 1, seed: int = 0) -> list[EPExperts]:
    """Replace every packed ``moe.experts`` block of ``graph`` in ``model``; returns the modules.

    Served: SwiGLU experts with gate_up [E, 2F, D] + down [E, D, F] or their x @ W transposes,
    [gate | up] halves or interleaved, per-expert biases, gpt-oss's clamp, slope and up offset;
    non-gated up [E, F, D] + down [E, D, F] (the classifier's ``gated: False``). Expert LoRA
    needs the [E, out, in] layout with halves.

    A block it cannot serve (identity "zero" experts, experts split over modules, ...) raises
    `InputError` before any block is replaced, unless nothing needs this module: with ep=1, no
    expert LoRA and dropless routing the block keeps the model's own experts module (a warning
    says so; its expert load is then not counted).
    """
    modules = dict(model.named_modules())
    own_ok = ep.size == 1 and lora is None and capacity_factor is None
    plan = []
    for block in graph.by_kind("moe.experts"):
        src = modules.get(block.path)
        if src is None:
            raise InputError(f"{block.path}: in the op graph but not in the model")
        try:
            new = _ep_module(block, src, ep, lora=lora, capacity_factor=capacity_factor,
                             dispatch_groups=dispatch_groups, seed=seed)
        except InputError as err:
            if not own_ok:
                raise
            warnings.warn(f"{err}; with ep=1, no expert LoRA and dropless routing it keeps the "
                          "model's own experts module", stacklevel=2)
            continue
        plan.append((block.path, new))
    for path, new in plan:
        parent_path, _, attr = path.rpartition(".")
        setattr(modules[parent_path] if parent_path else model, attr, new)
    return [new for _, new in plan]


class RouterTaps:
    """Forward hooks on the graph's ``moe.router`` blocks keeping each router's logits [N, E].

    A hook re-run by activation checkpointing overwrites its entry with identical values.
    """

    def __init__(self, model: nn.Module, graph: OpGraph):
        self.logits: dict[str, torch.Tensor] = {}
        self._handles = []
        modules = dict(model.named_modules())
        for b in graph.by_kind("moe.router"):
            e = b.attrs.get("n_experts")
            if b.path in modules and e:
                self._handles.append(modules[b.path].register_forward_hook(
                    self._hook(b.path, int(e))))

    def _hook(self, path: str, e: int):
        def hook(module, args, out):
            outs = out if isinstance(out, (tuple, list)) else (out,)
            hit = [t for t in outs if isinstance(t, torch.Tensor) and t.is_floating_point()
                   and t.shape[-1] == e]
            if hit:
                self.logits[path] = hit[0].reshape(-1, e)
        return hook


def aux_loss(taps: RouterTaps, ep_modules: list[EPExperts], group: dist.ProcessGroup | None
             ) -> torch.Tensor | None:
    """The load-balancing loss of transformers' MoE models (Switch style, over all layers):
    ``E * sum_e f_e * P_e`` with ``f_e`` the share of (token, k) pairs routed to expert e and
    ``P_e`` the mean router probability, both over every layer's tokens.

    ``f`` is all-reduced over ``group`` (it carries no gradient); ``P`` stays the local mean, so
    the mean of the ranks' losses equals the single-process loss over the global batch, and so
    do its gradients. None when nothing was tapped.
    """
    if not taps.logits or not ep_modules:
        return None
    logits = torch.cat(list(taps.logits.values()))
    e = logits.shape[-1]
    probs = torch.softmax(logits.float(), dim=-1)
    counts = torch.stack([m.last_counts for m in ep_modules]).sum(0).float()
    n = torch.tensor([float(logits.shape[0])], device=counts.device)
    if group is not None:
        stats = torch.cat([counts, n])
        dist.all_reduce(stats, group=group)
        counts, n = stats[:-1], stats[-1:]
    f = counts / n  # pairs per token-row, summed over k as transformers' sum over the k axis
    return e * (f * probs.mean(0)).sum()


def global_counts(ep_modules: list[EPExperts], group: dist.ProcessGroup | None) -> torch.Tensor:
    """[layers, E] (token, k) pairs routed to each expert in the last step, over all ranks."""
    counts = torch.stack([m.last_counts for m in ep_modules]).clone()
    if group is not None:
        dist.all_reduce(counts, group=group)
    return counts


def score_bias_tensors(model: nn.Module, graph: OpGraph, e: int) -> dict[str, torch.Tensor]:
    """{router path: its score-correction bias} for the routers that have one: the router block
    says ``score_bias`` (the classifier saw a parameter added to the scores before top-k) and the
    module holds exactly one 1-D tensor of size E (parameter or buffer)."""
    modules = dict(model.named_modules())
    out = {}
    for b in graph.by_kind("moe.router"):
        mod = modules.get(b.path)
        if not b.attrs.get("score_bias") or mod is None:
            continue
        cands = [t for t in (*mod.parameters(recurse=False), *mod.buffers(recurse=False))
                 if t.ndim == 1 and t.shape[0] == e]
        if len(cands) == 1:
            out[b.path] = cands[0]
    return out


def check_bias_balancing(model: nn.Module, graph: OpGraph, e: int) -> None:
    """`InputError` unless every router of ``graph`` selects its top-k on scores plus a per-expert
    bias that `update_score_bias` can move (DeepSeek-V3's aux-loss-free balancing needs one)."""
    routers = [b.path for b in graph.by_kind("moe.router")]
    have = score_bias_tensors(model, graph, e)
    missing = [p for p in routers if p not in have]
    if not routers or missing:
        raise InputError(
            f"balance='bias': router {missing[0] if missing else '(none found)'} has no score-"
            f"correction bias (one [{e}] tensor added to the routing scores for top-k selection "
            "only), so auxiliary-loss-free balancing cannot steer it; use balance='aux-loss'")


@torch.no_grad()
def update_score_bias(model: nn.Module, graph: OpGraph, counts: torch.Tensor,
                      rate: float = 1e-3) -> int:
    """Aux-loss-free balancing: ``bias_e += rate * sign(mean load - load_e)`` per router.

    Applies to routers whose block says ``score_bias`` and that hold one 1-D tensor of size E
    (the score-correction bias). ``counts`` [layers, E] in the order of the ``moe.experts``
    blocks; routers pair with experts by their parent module. Returns the routers updated.
    """
    by_parent = {b.path.rpartition(".")[0]: i for i, b in enumerate(graph.by_kind("moe.experts"))}
    done = 0
    for path, bias in score_bias_tensors(model, graph, counts.shape[1]).items():
        i = by_parent.get(path.rpartition(".")[0])
        if i is None:
            continue
        load = counts[i].to(bias.device, torch.float32)
        bias.add_(rate * torch.sign(load.mean() - load).to(bias.dtype))
        done += 1
    return done
