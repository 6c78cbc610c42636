"""The classifier's rules for mixture of experts: routers, packed and listed experts, shared experts (`MoeRules`, a part of
`classify.Classifier`: its methods read the classifier's capture, context and blocks)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from onboarding.graph._records import (ACTIVATIONS, EXPERT_KINDS, SOFTMAX, _activation,
                                       _expert_activation, _expert_gating, _gate_up_split,
                                       _gathered_params, _hist, _is_rms, _matmul_recs, _sigmoid_glu,
                                       is_matmul, layer_of)
from onboarding.graph.capture import OpRecord
from onboarding.graph.opgraph import Block
from onboarding.modpath import inside


class MoeRules:
    """Rules for mixture of experts; mixed into `classify.Classifier`."""

    def _packed_gated(self, path: str, recs: list[OpRecord], names3: list[str],
                      orient: tuple[str, int], ev: list[str], attrs: dict[str, Any]) -> None:
        """Into `attrs`, what the kernel binding needs of gated packed experts: the weights' orientation
        (`weight_layout`), how the gate/up product is split (`gate_up_split`, None when the ops
        do not say), the per-expert biases (`gate_up_bias` [E, 2F] / `down_bias` [E, D]: 2-D
        parameters of the block used by its ops, by name relative to the block), and the
        activation of a written-out sigmoid gate g * sigmoid(alpha g) (SiLU with slope alpha)."""
        layout, i = orient
        e = attrs["n_experts"]  # the real experts (a zero-expert block's gate_up may hold more)
        gu = self.ctx.param_shapes[names3[i]]
        two_f, d = (gu[1], gu[2]) if layout == "out_in" else (gu[2], gu[1])
        split = _gate_up_split(recs, two_f)
        attrs.update(weight_layout=layout, gate_up_split=split, gate_up_bias=None, down_bias=None)
        ev.append(f"gate_up [E, {'2F, D' if layout == 'out_in' else 'D, 2F'}] and down "
                  f"[E, {'D, F' if layout == 'out_in' else 'F, D'}] ({layout})")
        ev.append(f"gate/up split: {split}" if split else
                  "gate/up split not read off the ops (neither halves nor interleaved)")
        # the split (else the first activation) separates the gate_up bias from the down bias
        pivot = next((r.index for r in recs if r.op in ("slice", "chunk", "split", "split_with_sizes",
                                                        "narrow") and r.in_shapes and r.in_shapes[0]
                      and r.in_shapes[0][-1] == two_f), None)
        if pivot is None:
            pivot = next((r.index for r in recs if r.op in ACTIVATIONS), None)
        first_use: dict[str, int] = {}
        for r in recs:
            for n in r.params.values():
                shape = self.ctx.param_shapes.get(n, [])
                if n.rsplit(".", 1)[0] == path and len(shape) == 2 and shape[0] == e \
                        and n[len(path) + 1:] != attrs.get("post_norm_weight"):
                    first_use.setdefault(n, r.index)
        for key, width, before in (("gate_up_bias", two_f, True), ("down_bias", d, False)):
            fits = [n for n, at in first_use.items() if self.ctx.param_shapes[n] == [e, width]
                    and (pivot is None or (at < pivot) == before)]
            if len(fits) == 1:
                attrs[key] = fits[0][len(path) + 1:]
                ev.append(f"{key.replace('_', ' ')} {fits[0][len(path) + 1:]} [E, {width}]")
        if _activation(recs) is None and (alpha := _sigmoid_glu(recs)) is not None:
            attrs["activation"] = "silu"
            attrs.setdefault("alpha", alpha)  # the clamp style's reading, when it made one
            ev.append(f"gate written out as g * sigmoid({alpha:g} g)")

    def _post_expert_norm(self, path: str, recs: list[OpRecord], e: int) -> str | None:
        """The [E, D] weight (its name under ``path``) of an RMS norm that runs on the expert
        outputs after the last matmul and whose scale is gathered row by row from that table
        (each routed row normalised with its expert's own weight); None without one."""
        last = max((r.index for r in recs if is_matmul(r.op)), default=None)
        after = [r for r in recs if last is not None and r.index > last]
        if not after or not _is_rms(after):
            return None
        names = [n for n in _gathered_params(after, self.ctx)
                 if len(self.ctx.param_shapes[n]) == 2 and self.ctx.param_shapes[n][0] == e
                 and n.startswith(path + ".")]
        return names[0][len(path) + 1:] if len(names) == 1 else None

    def _3d_params(self, path: str) -> list[str]:
        return [n for n, s in self.ctx.param_shapes.items()
                if n.rsplit(".", 1)[0] == path and len(s) >= 3]

    def _expert_params(self, path: str) -> int | None:
        if self.ctx.module_types.get(path, "").startswith("Conv"):
            return None
        leads = {self.ctx.param_shapes[n][0] for n in self._3d_params(path)}
        return leads.pop() if len(leads) == 1 and min(leads | {2}) >= 2 else None

    def _zero_experts(self, path: str, recs: list[OpRecord]) -> tuple[int, tuple[int, int]] | None:
        """(E, (Z, n)) for packed experts with identity ("zero") experts (LongCat-Flash): 3-D
        weights over two expert counts E + Z > E (gate_up over every routing slot, down over the
        E real experts only), and in the op order `n` > 0 scatter-adds into the output
        (``index_add_``) of a token multiplied by its routing weight with no matmul since the
        previous one. None otherwise: without seeing such a slot the zero experts' op is not
        guessed."""
        if self.ctx.module_types.get(path, "").startswith("Conv"):
            return None
        leads = sorted({self.ctx.param_shapes[n][0] for n in self._3d_params(path)})
        if len(leads) != 2 or leads[0] < 2:
            return None
        n, seg = 0, []
        for r in recs:
            if r.op in ("index_add_", "index_add"):
                if not any(is_matmul(x.op) for x in seg) and any(x.op in ("mul", "mul_") for x in seg):
                    n += 1
                seg = []
            else:
                seg.append(r)
        return (leads[0], (leads[1] - leads[0], n)) if n else None

    def _router(self, recs, exp_topk, n_experts):
        ops = _hist(recs)
        k = exp_topk[-1][1]
        scoring = "sigmoid" if ops["sigmoid"] else ("softmax" if any(
            op in ops for op in SOFTMAX) else "other")
        if scoring == "other" and ops["softplus"] and ops["sqrt"]:
            scoring = "sqrtsoftplus"  # DeepSeek-V4
        ev = [f"linear to {n_experts} expert logits", f"{scoring} scoring",
              f"topk k={k} over {n_experts} experts"]
        grouped = any(t[2] != n_experts and t[2] > 1 for t in exp_topk)
        if grouped:
            groups = min(t[2] for t in exp_topk if t[2] > 1)
            ev.append(f"group-limited: topk over {groups} groups first")
        bias = any(r.op == "add" and r.params for r in recs)
        renorm = ops["sum"] > 0 and (ops["div"] + ops["div_"]) > 0
        last_topk = max(t[0].index for t in exp_topk)
        if scoring == "softmax" and any(r.op in SOFTMAX and r.index > last_topk for r in recs):
            # softmax over the k selected logits (Cohere2-MoE, gpt-oss) is the softmax over all
            # experts renormalised over the selection, which picks the same top-k
            renorm = True
            ev.append("softmax over the top-k logits: renormalised softmax")
        attrs = {"n_experts": n_experts, "top_k": k, "scoring": scoring,
                 "group_limited": grouped, "score_bias": bias, "renormalize": renorm}
        # a bias of the logits' linear itself (gpt-oss), by its parameter name
        gate_bias = next((n for r in _matmul_recs(recs) for n in r.params.values()
                          if self.ctx.param_shapes.get(n) == [n_experts]), None)
        if gate_bias is not None:
            attrs["gate_bias"] = gate_bias
            ev.append("the logits' linear has a bias")
        if grouped:
            # The group pass picks topk_group of n_group group scores: the last top-k before
            # the final one (an earlier one may rank experts within each group).
            group_sel = [t for t in exp_topk if t[2] not in (n_experts, 1)][-1]
            attrs.update(n_group=group_sel[2], topk_group=group_sel[1])
            ev.append(f"keeps {group_sel[1]} of {group_sel[2]} groups")
        # A scalar multiply after the final top-k scales the routed weights.
        final = exp_topk[-1][0].index
        scale = next((r.scalars[1] for r in recs if r.index > final and r.op in ("mul", "mul_")
                      and len(r.scalars) > 1 and isinstance(r.scalars[1], float)), None)
        if scale is not None:
            attrs["routed_scaling_factor"] = scale
            ev.append(f"routed weights scaled by {scale:g}")
        elif grouped or bias:
            attrs["routed_scaling_factor"] = 1.0
        return "moe.router", ev, attrs

    def _inline_routers(self) -> None:
        """A router whose module holds the experts (or a shared expert) routes inline:
        its gate is a child linear, its softmax / top-k run in the MoE block's own forward, so
        the router is no module of its own (``inline``: a module patch would replace the block)."""
        for b in self.blocks.values():
            inner = [p for p, c in self.blocks.items() if b.kind == "moe.router"
                     and p.startswith(b.path + ".") and c.kind in EXPERT_KINDS]
            if inner:
                b.attrs["inline"] = True
                b.evidence.append(f"routing runs in this module's own forward, around {', '.join(inner)}"
                                  " (the router is no module of its own)")

    def _merge_expert_lists(self) -> None:
        """A list of identical MLPs beside a router is one experts block."""
        for lst, n in self.ctx.identical_lists.items():
            members = [p for p in self.blocks if p.startswith(lst + ".")
                       and p[len(lst) + 1:].split(".")[0].isdigit()]
            parent = lst.rsplit(".", 1)[0] if "." in lst else ""
            routers = [b for p, b in self.blocks.items() if b.kind == "moe.router" and
                       inside(p, parent) and
                       b.attrs.get("n_experts") == n]
            if not members or not routers:
                continue
            first = self.blocks[members[0]]
            # the first expert's own records and 2-D weights: its activation and gating
            first_recs = [r for r in self.cap.records
                          if inside(r.module, members[0])]
            gated = _expert_gating([s for n2, s in self.ctx.param_shapes.items()
                                    if n2.startswith(members[0] + ".") and len(s) == 2])
            flops = sum(self.blocks[m].flops for m in members)
            nbytes = sum(self.blocks[m].bytes for m in members)
            hist: Counter = Counter()
            for m in members:
                hist.update(self.blocks.pop(m).op_histogram)
            params = {n2[len(lst) + 1:]: s for n2, s in self.ctx.param_shapes.items()
                      if n2.startswith(lst + ".")}
            self.blocks[lst] = Block(
                path=lst, kind="moe.experts", layer=layer_of(lst), class_name="ModuleList",
                evidence=[f"{n} identical MLPs in a list", f"router beside it selects among {n}",
                          f"{len(members)} of them ran on this input"],
                op_histogram=dict(sorted(hist.items())), inputs=first.inputs,
                outputs=first.outputs, params=params,
                attrs={"n_experts": n, "layout": "module_list", "gated": gated,
                       "activation": _expert_activation(first_recs) or first.attrs.get("activation"),
                       "clamp": first.attrs.get("clamp"), "grouped_mm": False,
                       **{k: first.attrs[k] for k in ("clamp_style", "alpha", "up_offset")
                          if k in first.attrs}},
                flops=flops, bytes=nbytes)

    def _shared_experts(self) -> None:
        moe_parents = {b.path.rsplit(".", 1)[0] for b in self.blocks.values()
                       if b.kind in ("moe.router", "moe.experts")}
        for b in self.blocks.values():
            parent = b.path.rsplit(".", 1)[0]
            if b.kind == "mlp.dense" and parent in moe_parents:
                b.kind = "moe.shared_expert"
                b.evidence.append("a dense MLP beside a router and experts: shared expert")
