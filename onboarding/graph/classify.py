"""Classify captured modules into blocks by structure: the ops they run and their shapes.

Modules are visited children first. Each module sees its *unclaimed* records: its own ops plus
those of descendants that did not become blocks (plain Linear projections, helper modules). Rules
match on those records; a matched module claims them. Class names are never used to decide;
each decision carries its evidence. Leftover substantive compute that no rule explains becomes
an ``unknown`` block at the module that ran it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from onboarding.graph.split import split_linear
from onboarding.graph._records import (ACTIVATIONS, CONV, Context, SOFTMAX, TRIANGULAR, VIEW_OPS,
                                       _activation, _attention_softmax, _clamp, _clamp_style,
                                       _compressed_kv, _conv_padding, _decay_cumsum,
                                       _expert_activation, _expert_gating, _extra_logits,
                                       _gathered_params, _hist, _inline_mlp, _is_rms, _linear_chain,
                                       _linear_dims, _matmul_recs, _mean_centred,
                                       _mlp_activation_by_shape,
                                       _norm_attrs, _relu_squared, _time_steps, _topks,
                                       estimate_cost, is_matmul, is_sdpa, layer_of,
                                       packed_orientation, stack_of)  # stack_of: re-exported
from onboarding.graph._mixers import MixerRules
from onboarding.graph._moe import MoeRules
from onboarding.graph._streams import StreamRules
from onboarding.graph.capture import Capture, OpRecord
from onboarding.graph.opgraph import CONV_KINDS, Block, TensorMeta
from onboarding.modpath import inside

# the block kinds of sequence mixers that mix tokens by scores or a recurrence
MIXER_PREFIXES = ("attention.", "sparse_attention.", "linear_attention.")


class Classifier(MixerRules, MoeRules, StreamRules):
    """Blocks of a capture, children first (module docstring). The rules of each block family
    beyond the dense ones live in the mixins: `_mixers.MixerRules`, `_moe.MoeRules`,
    `_streams.StreamRules`."""

    def __init__(self, cap: Capture, ctx: Context):
        self.cap, self.ctx = cap, ctx
        self.by_module: dict[str, list[OpRecord]] = {}
        for r in cap.records:
            self.by_module.setdefault(r.module, []).append(r)
        self.blocks: dict[str, Block] = {}
        self.unclaimed: dict[str, list[OpRecord]] = {}
        # a stream carrier's leftovers, or a mixer's projections around it (`run`)
        self.stranded: dict[str, list[OpRecord]] = {}
        self.origin: dict[int, str] = {r.index: r.module for r in cap.records}
        self._conv_at: dict[str, int] = {}  # a conv.causal1d block -> its conv record's index
        self._carriers: dict[str, tuple[set[int], int, int, list[int]]] | None = None
        self._no_grad: list[str] | None = None  # `_no_gradient_modules`' candidates

    # -- rules ----------------------------------------------------------------------------
    def _rule(self, path: str, recs: list[OpRecord], child_kinds: dict[str, str]
              ) -> tuple[str, list[str], dict[str, Any]] | None:
        ctx, ops = self.ctx, _hist(recs)
        mm = _matmul_recs(recs)
        leaf = not ctx.children.get(path)
        if ops["embedding"] and not mm:
            return "embedding", ["aten.embedding lookup"], {}
        if not mm and (patch := self._patch_conv(recs)) is not None:
            return patch
        if len(mm) == 1 and (patch := self._patch_unfold(recs, mm[0])) is not None:
            return patch
        if leaf and len(mm) == 1 and ctx.vocab and (d := _linear_dims(mm[0], ctx)) \
                and (d[1] == ctx.vocab or d[1] in ctx.vocabs) and sum(n for op, n in ops.items()
                                              if op not in VIEW_OPS and not is_matmul(op)) <= 2 \
                and (why := self._output_head(path, mm[0])):
            return "lm_head", [f"linear {d[0]} -> {d[1]} (vocabulary size)", why], {}
        if not mm and (ops["native_layer_norm"] or ops["layer_norm"]):
            return "norm.layer", ["layer_norm op"], {}
        if not mm and _is_rms(recs) and _gathered_params(recs, ctx):
            # a scale taken row by row from a table (an expert's own norm weight, gathered by
            # expert id): part of the module that routes the rows, no norm of the hidden state
            return None
        if not mm and _is_rms(recs) and self._row_statistic(path):
            # the inverse RMS alone, [..., 1] (HY V4's unweighted norm that scales another
            # projection): no normalised tensor for a norm kernel to return; its parent's ops
            return None
        if not mm and _is_rms(recs) and _mean_centred(recs):
            attrs = _norm_attrs(recs, ctx)
            # a second parameter beside the weight is the bias (which is which: patch calibration)
            attrs["has_bias"] = len({n for r in recs for n in r.params.values()}) >= 2
            ev = ["mean subtracted, then mean of squares, rsqrt, scale"]
            if attrs["has_bias"]:
                ev.append("bias added")
            return "norm.layer", ev, attrs
        if not mm and _is_rms(recs):
            attrs = _norm_attrs(recs, ctx)
            act = next((r for r in recs if r.op in ACTIVATIONS), None)
            ev = ["mean of squares, rsqrt, scale"]
            if attrs["unit_offset"]:
                ev.append("weight used as (1 + w)")
            if act is not None:
                gate = ACTIVATIONS[act.op]
                attrs["gate_activation"] = attrs["activation"] = gate
                # the gate applied before the mean of squares (Mamba-2's mixer norm) normalises
                # x * act(z), not x: another function than the gated-after form
                first_mean = min((r.index for r in recs if r.op == "mean"), default=act.index)
                if act.index < first_mean:
                    attrs["norm_before_gate"] = False
                    return "norm.rms_gated", ev + [f"input gated by {gate}(z) before the norm"], attrs
                return "norm.rms_gated", ev + [f"output gated by {gate}(z)"], attrs
            return "norm.rms", ev, attrs
        if not mm and (gated := self._mlp_gated_norm(path, recs, child_kinds)) is not None:
            return gated
        projections = [r for r in mm if any(len(ctx.param_shapes.get(n, ())) == 2
                                            for n in r.params.values())]
        # position x inv_freq may be a matmul (transformers 5.17) but never a weight projection
        if not projections and ops["cos"] and ops["sin"]:
            # one table per layer type when their widths differ (Gemma 4: sliding and full);
            # the model may make them in set order (hash-seeded): the widths sorted, none pinned
            dims = sorted({r.out_shapes[0][-1] for r in recs if r.op == "cos" and r.out_shapes})
            if len(dims) > 1:
                return "rope", ["cos and sin of position x inv_freq",
                                f"tables of {len(dims)} widths {dims} (one per layer type)"], {
                    "rotary_dim": None, "rotary_dims": dims}
            return "rope", ["cos and sin of position x inv_freq"], {
                "rotary_dim": dims[0] if dims else None}
        # Attention scores multiply two activations (q.k^T) or go through fused SDPA; a router's
        # softmax may look the same when n_experts == seq, but its logits come from a weight.
        act_mm = any(not r.params for r in mm) or any(is_sdpa(r.op) for r in recs)
        pooled = _compressed_kv(recs, ctx.seq) if act_mm else None
        attn = _attention_softmax(recs, ctx.seq, pooled["compressed_keys"] if pooled else 0) \
            if act_mm else []
        seq_topk = [t for t in _topks(recs) if t[2] == ctx.seq] if act_mm else []
        if act_mm and (depth := self._depth_attention(path, recs, mm)) is not None:
            return depth
        if attn and mm:
            inline = _inline_mlp(recs, ctx)
            kind, ev, attrs = self._attention(path, inline[0] if inline else recs, attn,
                                              seq_topk, child_kinds, pooled)
            if inline:
                attrs["inline_mlp"] = inline[1]
                ev.append(inline[2])
            return kind, ev, attrs
        if (scan := self._selective_scan(path, recs, child_kinds)) is not None:
            return scan
        decay = _decay_cumsum(recs)
        tri = [op for op in TRIANGULAR if ops[op]]
        if decay is not None and mm and not attn:
            return self._linear_attention(recs, decay, tri)
        exp_topk = [t for t in _topks(recs) if t[2] != ctx.seq or not act_mm]
        n_experts = max((t[2] for t in exp_topk), default=0)
        # a router keeps fewer experts than it scores: a top-k of every position (DeepSeek-V4's
        # compressed-attention indexer on a short proxy sequence) selects, it does not route
        sparse = any(t[2] == n_experts and (t[1] is None or t[1] < n_experts) for t in exp_topk)
        # scores that a product of two per-sequence activations made as wide as the set (an
        # indexer's queries against pooled keys [B, .., d, C]) pick positions, not experts
        if sparse and any(not r.params and len(r.in_shapes) > 1 and r.in_shapes[1]
                          and len(r.in_shapes[1]) >= 3 and r.out_shapes and r.out_shapes[0]
                          and r.out_shapes[0][-1] == n_experts for r in mm):
            sparse = False
        if sparse and any((d := _linear_dims(r, ctx)) and d[1] == n_experts for r in mm):
            return self._router(recs, exp_topk, n_experts)
        if sparse and (extra := _extra_logits(recs, mm, n_experts, ctx)):
            # one linear scores the routed experts and S more (shared experts' weights): the
            # top-k reads a slice of its E + S logits
            kind, ev, attrs = self._router(recs, exp_topk, n_experts)
            ev.insert(0, f"linear to {n_experts + extra} logits: the top-k reads the {n_experts} "
                      f"routed experts' slice; the other {extra} weight experts every token "
                      "goes through (shared)")
            return kind, ev, {**attrs, "shared_logits": extra}
        if sparse and (scorer := [p for p in self._free_blocks(path, ("mlp.dense",))
                                  if (out := self.blocks[p].outputs) and out[0].shape
                                  and out[0].shape[-1] == n_experts]):
            # the logits come out of an MLP below the module (ZAYA's router): the MLP is the
            # router's scorer, no feed-forward of the layer; it is taken into the router
            kind, ev, attrs = self._router(recs, exp_topk, n_experts)
            ev.insert(0, f"logits for {n_experts} experts from an MLP ({scorer[0]}), taken in")
            return kind, ev, {**attrs, "scorer": "mlp", "_absorb": scorer[:1]}
        expert_params, zero = self._expert_params(path), None
        if expert_params and mm and _time_steps(recs, ctx.seq) == ctx.seq \
                and self._weights_used_whole(path, recs):
            # per-head weights around a loop over the positions (Griffin's RG-LRU, Zamba's
            # multi-head Mamba on the CPU): every token meets every slice, nothing routes
            expert_params = None
        if expert_params is None and (split := self._zero_experts(path, recs)) is not None:
            expert_params, zero = split
        if expert_params and (mm or any("grouped_mm" in op for op in ops)):
            if zero is None and (split := split_linear(path, recs, ctx.param_shapes)) is not None:
                return "moe.experts", *split  # one weight, x.split(sizes) -> a linear per piece
            e = expert_params
            names3 = [n for n in self._3d_params(path) if len(self.ctx.param_shapes[n]) == 3]
            mats = [self.ctx.param_shapes[n][1:] for n in names3]
            gated = _expert_gating(mats)
            orient = packed_orientation(mats)
            if gated is None and orient is not None:
                gated = True  # gate_up [E, D, 2F] + down [E, F, D]: gpt-oss's x @ W layout
            ev = [f"{len(self._3d_params(path))} parameters stacked over {e} experts",
                  "matmuls over expert-sorted tokens"]
            if gated is False:
                ev.append("up [E, F, D] and down [E, D, F] only, each the other's transpose: "
                          "no gate half (non-gated experts)")
            attrs = {"n_experts": e, "layout": "packed_3d", "gated": gated,
                     "activation": _expert_activation(recs), "clamp": _clamp(recs),
                     **_clamp_style(recs), "grouped_mm": any("grouped_mm" in op for op in ops)}
            if zero is not None:
                attrs["zero_experts"] = zero[0]
                ev.append(f"3-D weights over {e + zero[0]} and {e} experts; {zero[1]} scatter-adds of "
                          f"a token times its routing weight with no matmul: slots >= {e} are "
                          "identity (zero) experts")
            if (post := self._post_expert_norm(path, recs, e)) is not None:
                attrs["post_norm"], attrs["post_norm_weight"] = "rms", post
                ev.append(f"each routed row RMS-normalised after the down projection and scaled "
                          f"by its expert's own weight {post} [E, D] (gathered by expert id), "
                          "before the routing weights sum them")
            if gated and orient is not None:
                self._packed_gated(path, recs, names3, orient, ev, attrs)
            return "moe.experts", ev, attrs
        if mm and (steps := _time_steps(recs, ctx.seq)) == ctx.seq:
            # projections around a loop over the positions: a recurrent mixer whatever else its
            # ops look like (a sigmoid-gated output reads as a gated MLP's product otherwise)
            return "linear_attention.other", [
                f"a loop over time: each of the {steps} positions taken one at a time "
                "(select along the sequence dim)", f"{len(mm)} projections around it"], {
                "recurrence": "time_loop", "steps": steps}
        if (wrap := self._recurrent_wrapper(path, recs, mm)) is not None:
            return wrap
        if (conv := self._gated_conv(path, recs, mm)) is not None:
            return conv
        if (hyper := self._hyper_connection(path, recs, mm)) is not None:
            return hyper
        if (low := self._low_rank_residual(path, recs, mm)) is not None:
            return low
        if (streams := self._stream_coefficients(path, recs, mm)) is not None:
            return streams
        if (streams := self._stream_projections(path, recs, mm)) is not None:
            return streams
        if (state := self._state_linear_attention(path, recs, mm)) is not None:
            return state
        weight_only = all(r.params for r in mm)  # an MLP multiplies by weights only
        # a conv over the sequence inside the block (causal or not) mixes tokens: no MLP,
        # whatever its projections look like (a mixer no rule explains is left to `unknown`);
        # projections chained with no nonlinearity between them are a low-rank linear map (a
        # gate's or a decay's projection inside a mixer): no MLP, their ops are the parent's;
        # projections around a sequence mixer block below the module are that mixer's
        if len(mm) >= 2 and weight_only and not attn and not seq_topk \
                and not self._free_convs(path, causal_only=False) and not _linear_chain(recs, mm) \
                and not self._mixer_between(path, mm) \
                and (act := _activation(recs) or (None if self._gates_an_input(path, mm) else
                                                  _mlp_activation_by_shape(recs, mm, ctx))):
            # act(gate) * up: a product, and a gate beside up (three projections, or the first
            # one twice as wide as the last one's input: gate and up fused). A written-out
            # activation multiplies too (xIELU, x * sigmoid(x)) without gating anything.
            # The product feeds the last projection (down): a product after it gates the output
            # (RWKV's channel mix: sigmoid(r(x)) * v(relu(k(x))^2)), not the MLP's hidden state.
            first, last = _linear_dims(mm[0], ctx), _linear_dims(mm[-1], ctx)
            fused = first is not None and last is not None and first[1] == 2 * last[0]
            act_at = next((r.index for r in recs if r.op in ACTIVATIONS), -1)
            product = any(r.op in ("mul", "mul_") and act_at < r.index < mm[-1].index for r in recs)
            gated = product and (len(mm) >= 3 or fused)
            if act == "relu" and _relu_squared(recs):
                act = "relu2"  # relu(x)^2 (squared ReLU), named as the experts rule names it
            return "mlp.dense", [f"{len(mm)} projections with {act}" +
                                 (" gating (act(gate) * up)" if gated else "")], {
                "activation": act, "gated": gated, "clamp": _clamp(recs), **_clamp_style(recs),
                "hidden": first[0] if first else None, "intermediate": first[1] if first else None}
        return None

    def _mlp_gated_norm(self, path: str, recs: list[OpRecord], child_kinds: dict[str, str]
                        ) -> tuple[str, list[str], dict[str, Any]] | None:
        """A norm gated by a low-rank MLP of its own output (AXK2's GatedRMSNorm: y = RMSNorm(x),
        then y * sigmoid(mlp(y)), mlp D -> r -> D with r < D): a module whose children are one
        `norm.rms` and one non-gated `mlp.dense` that reads the norm's output, and whose own ops
        are a sigmoid of the MLP's output and a product. The MLP is the norm's gate, no
        feed-forward of the layer: it is taken into this block (`norm.rms_gated`, gate "mlp");
        the norm stays its own block (a plain RMSNorm module)."""
        kids = [c for c in child_kinds if c in self.blocks]
        norms = [c for c in kids if child_kinds[c] == "norm.rms"]
        mlps = [c for c in kids if child_kinds[c] == "mlp.dense"]
        if len(kids) != 2 or len(norms) != 1 or len(mlps) != 1:
            return None
        norm, mlp = self.blocks[norms[0]], self.blocks[mlps[0]]
        a = mlp.attrs
        if a.get("gated") or not a.get("hidden") or not a.get("intermediate") \
                or a["intermediate"] >= a["hidden"] or not norm.outputs or not mlp.inputs \
                or not mlp.outputs or mlp.inputs[0].shape != norm.outputs[0].shape \
                or mlp.outputs[0].shape != norm.outputs[0].shape:
            return None
        width = norm.outputs[0].shape
        sig = [r for r in recs if r.op == "sigmoid" and r.in_shapes and r.in_shapes[0] == width]
        prod = [r for r in recs if r.op in ("mul", "mul_") and sig and r.index > sig[0].index
                and r.out_shapes and r.out_shapes[0] == width]
        io = self.cap.module_io.get(path)
        if not sig or not prod or not io or not io[1] or io[1][0].shape != width:
            return None
        ev = [f"{norms[0]} normalises, then its output is scaled by sigmoid of a low-rank MLP of "
              f"itself ({mlps[0]}: {a['hidden']} -> {a['intermediate']} -> {a['hidden']}, "
              f"{a.get('activation')}): a gated norm, the MLP its gate, no feed-forward"]
        attrs = {**{k: norm.attrs.get(k) for k in ("dim", "eps", "unit_offset", "has_weight")},
                 "gate_activation": "sigmoid", "activation": "sigmoid", "gate": "mlp",
                 "gate_rank": a["intermediate"], "gate_mlp_activation": a.get("activation"),
                 "norm": norms[0], "_absorb": [mlps[0]]}
        return "norm.rms_gated", ev, attrs

    def _row_statistic(self, path: str) -> bool:
        """The module returns one value per row of its input (last dim 1 where its input's is
        wider): a statistic of the row, not the row normalised."""
        io = self.cap.module_io.get(path)
        if not io or not io[0] or not io[1]:
            return False
        ins = [t.shape for t in io[0] if t.shape]
        outs = [t.shape for t in io[1] if t.shape]
        return bool(ins and outs and ins[0][-1] > 1 and all(o[-1] == 1 for o in outs))

    def _gates_an_input(self, path: str, mm: list[OpRecord]) -> bool:
        """The module is handed a tensor as wide as its first projection's output beside the one
        that projection reads (D -> F, and an input of width F != D): a sigmoid product there
        gates that input (Inkling 2's gated attention output projection: sigmoid(gate(h)) * o,
        then the out projection), it is no MLP's written-out g * sigmoid(g)."""
        io = self.cap.module_io.get(path)
        first = _linear_dims(mm[0], self.ctx) if mm else None
        if not io or not first or first[0] == first[1]:
            return False
        return any(t.shape and t.shape[-1] == first[1] for t in io[0])

    def _free_blocks(self, path: str, kinds: tuple[str, ...]) -> list[str]:
        """The blocks of a kind starting with one of ``kinds`` below ``path`` with no other block
        between them and it: blocks whose surrounding compute ``path`` now sees (a child's, or
        an unclaimed descendant's)."""
        def free(p: str) -> bool:
            mid = p.rsplit(".", 1)[0]
            while mid != path and mid.startswith(path + "." if path else ""):
                if mid in self.blocks:
                    return False
                mid = mid.rsplit(".", 1)[0] if "." in mid else ""
            return True

        return [p for p, b in self.blocks.items() if b.kind.startswith(kinds)
                and (p.startswith(path + ".") if path else True) and free(p)]

    def _free_convs(self, path: str, causal_only: bool = True) -> list[str]:
        """The conv blocks split out below ``path`` that it sees (`_free_blocks`): causal ones,
        or any depthwise conv over the sequence (``causal_only`` False)."""
        return self._free_blocks(path, ("conv.causal1d",) if causal_only else CONV_KINDS)

    def _mixer_between(self, path: str, mm: list[OpRecord]) -> list[str]:
        """The sequence mixer blocks below ``path`` that it sees (`_free_blocks`: attention,
        sparse or linear attention) whose ops run between its first projection and its last:
        projections that feed a mixer and read its output are that mixer's (xLSTM's mLSTM layer:
        q, k, v and gate projections, the recurrence in a child module, the output gate and
        projection), as attention's q, k, v and o are, never an MLP's, whatever activation the
        gates use. A mixer before the first projection or after the last one is a sublayer
        beside it (a decoder layer whose MLP runs in the layer's own forward)."""
        lo, hi = mm[0].index, mm[-1].index
        return [p for p in self._free_blocks(path, MIXER_PREFIXES) if any(
            lo < r.index < hi for m, rs in self.by_module.items()
            if inside(m, p) for r in rs)]

    def _mixer_projections(self, path: str, recs: list[OpRecord]) -> bool:
        """Two or more weight projections among ``recs`` with a sequence mixer block's ops
        between the first and the last (`_mixer_between`): the mixer's projections, that no
        rule of a module above may read as its own."""
        mm = [r for r in _matmul_recs(recs) if r.params]
        return len(mm) >= 2 and bool(self._mixer_between(path, mm))

    def _weights_used_whole(self, path: str, recs: list[OpRecord]) -> bool:
        """No op takes a part of one of the module's >= 3-D parameters along a dim (a select,
        an index, a narrowed slice): an expert loop takes its experts' weights one by one, a
        recurrence's per-head weights (RG-LRU's gates, Zamba's multi-head Mamba) are used whole."""
        mine = set(self._3d_params(path))
        for r in recs:
            if not mine & set(r.params.values()):
                continue
            if r.op in ("select", "index", "index_select", "unbind", "gather", "embedding",
                        "narrow", "take"):
                return False
            if r.op == "slice" and r.in_shapes and r.in_shapes[0]:
                sc, shape = r.scalars, r.in_shapes[0]
                dim = sc[1] if len(sc) > 1 and isinstance(sc[1], int) else 0
                start = sc[2] if len(sc) > 2 and isinstance(sc[2], int) else 0
                end = sc[3] if len(sc) > 3 and isinstance(sc[3], int) else shape[dim]
                if start > 0 or end < shape[dim]:
                    return False
        return True

    def _recurrent_wrapper(self, path: str, recs: list[OpRecord], mm: list[OpRecord]
                           ) -> tuple[str, list[str], dict[str, Any]] | None:
        """Weight projections around a recurrence in a module of its own below the module: one
        mixer, as a Mamba mixer with its scan inside is and as gated delta's q, k, v and gate
        projections are its block's. Either a causal conv the projections feed runs before the
        recurrence (Griffin's recurrent block: x and gate projections, a conv, the RG-LRU loop in
        a module of its own, gate, out projection), or the recurrence is weightless and its ops
        run between the first projection and the last (`_mixer_between`; xLSTM's mLSTM layer: q,
        k, v and gate projections make the inputs of the mLSTM cell, a module with no parameters,
        the output gate and projection read its output). The recurrence's block is taken into
        this one (`_absorb`): the projections are the block's, its default LoRA targets among
        them (`onboarding.train.lora.default_targets`: the linears inside attention-kind
        blocks). A weightless recurrence's module is recorded relative to the block
        (``core_module``, the same in every layer, so the layers stay one structure): a kernel
        replaces that module, the projections stay on the torch path."""
        inner = self._free_blocks(path, ("linear_attention.",))
        if len(inner) != 1 or len(mm) < 2 or not all(r.params for r in mm):
            return None
        child, convs = self.blocks[inner[0]], self._free_convs(path)
        if convs:
            if len(convs) != 1 or convs[0] not in self._conv_at \
                    or not mm[0].index < self._conv_at[convs[0]] < mm[-1].index:
                return None
            how, extra = f"a causal conv ({convs[0]}) before it", {"conv": convs[0]}
        elif child.params or inner[0] not in self._mixer_between(path, mm):
            return None
        else:  # the weightless module is the kernel's target (`onboarding.generate.tasks`)
            how, extra = ("the recurrence has no weights, its ops run between the first and the "
                          "last (they make its inputs and read its output)"), \
                {"core_module": inner[0][len(path) + 1:]}
        ev = [*child.evidence, f"projections around it in {path} ({len(mm)}), {how}: one mixer "
              f"with the recurrence ({inner[0]}) inside"]
        return child.kind, ev, {**child.attrs, **extra, "_absorb": [inner[0]]}

    def _gated_conv(self, path: str, recs: list[OpRecord], mm: list[OpRecord]
                    ) -> tuple[str, list[str], dict[str, Any]] | None:
        """A gated short convolution token mixer (LFM2's ShortConv, Hyena-style): weight
        projections before and after one child depthwise conv over the sequence (causal, or not:
        a bidirectional mixer's centred conv, then `causal` False), the conv's
        input or output multiplied elementwise by another tensor of its shape (a projected gate:
        B * x before, C * y after), and nothing that recurs, scores or routes (no exp, cumsum,
        softplus, softmax, fused attention or top-k). The conv itself stays its own
        `conv.causal1d` block; this block is the projections and the gates around it."""
        convs = self._free_convs(path, causal_only=False)
        if len(convs) != 1 or convs[0] not in self._conv_at or len(mm) < 2 \
                or self._free_blocks(path, MIXER_PREFIXES) \
                or not all(r.params for r in mm):
            return None
        ops = _hist(recs)
        if any(ops[op] for op in ("exp", "cumsum", "softplus", "topk", "log", "sort")) \
                or any(op in SOFTMAX or is_sdpa(op) for op in ops):
            return None
        at, conv = self._conv_at[convs[0]], self.blocks[convs[0]].attrs
        if not mm[0].index < at < mm[-1].index:
            return None
        ch = conv.get("channels")
        products = [r for r in recs if r.op in ("mul", "mul_") and len(r.in_shapes) > 1
                    and r.in_shapes[0] and r.in_shapes[0] == r.in_shapes[1] and ch in r.in_shapes[0]]
        pre = any(r.index < at for r in products)
        post = any(at < r.index < mm[-1].index for r in products)
        if not (pre or post):
            return None
        first, last = _linear_dims(mm[0], self.ctx), _linear_dims(mm[-1], self.ctx)
        causal = bool(conv.get("causal"))
        ev = [f"{'causal' if causal else 'non-causal'} depthwise conv over the sequence "
              f"({convs[0]}: {ch} channels, kernel {conv.get('kernel_size')})",
              f"{sum(r.index < at for r in mm)} projection(s) before it ({first[0]} -> {first[1]}), "
              f"{sum(r.index > at for r in mm)} after it (-> {last[1]})" if first and last else
              f"{len(mm)} projections around it"]
        if pre:
            ev.append("its input is an elementwise product of two tensors of its shape (gated)")
        if post:
            ev.append("its output is multiplied elementwise by another such tensor (gated)")
        ev.append("no decay, scan, softmax or top-k: a gated short-convolution token mixer" +
                  ("" if causal else " (bidirectional: outputs see later positions)"))
        return "conv.gated", ev, {
            "conv": convs[0], "channels": ch, "kernel_size": conv.get("kernel_size"),
            "input_gate": pre, "output_gate": post,
            "hidden": first[0] if first else None, "projected": first[1] if first else None,
            **({} if causal else {"causal": False})}

    def _low_rank_residual(self, path: str, recs: list[OpRecord], mm: list[OpRecord]
                           ) -> tuple[str, list[str], dict[str, Any]] | None:
        """A learned low-rank residual branch (Gemma 3n's LAuReL): two weight projections
        D -> r -> D with r < D and nothing but views between them (no activation anywhere: a
        rank-r linear map, no MLP), then an add of two tensors of the block's [.., D] shape (the
        branch added to the residual)."""
        if len(mm) != 2 or not all(self._weight_2d(r) for r in mm) or _activation(recs) \
                or any(r.op in ACTIVATIONS for r in recs):
            return None
        first, last = _linear_dims(mm[0], self.ctx), _linear_dims(mm[1], self.ctx)
        if not (first and last and first[1] == last[0] and first[0] == last[1]
                and first[1] < first[0]):
            return None
        d, rank = first
        if any(mm[0].index < r.index < mm[1].index and r.op not in VIEW_OPS for r in recs):
            return None
        io = self.cap.module_io.get(path)
        if not io or not io[0] or not io[1] or io[0][0].shape[-1:] != [d] \
                or io[1][0].shape != io[0][0].shape:
            return None
        if not any(r.op in ("add", "add_") and r.index > mm[1].index and len(r.in_shapes) > 1
                   and r.in_shapes[0] and r.in_shapes[0] == r.in_shapes[1]
                   and r.in_shapes[0][-1] == d for r in recs):
            return None
        return "residual.low_rank", [
            f"two projections {d} -> {rank} -> {d}, nothing between them but views and no "
            f"activation: a rank-{rank} linear map, no MLP",
            "added to a tensor of the block's own shape after the second one (a learned "
            "residual branch)"], {"hidden": d, "rank": rank}

    def _patch_conv(self, recs: list[OpRecord]) -> tuple[str, list[str], dict[str, Any]] | None:
        """A patch embedding: one 2-D or 3-D convolution whose stride is its kernel
        (non-overlapping patches), ungrouped, and the first such convolution of the forward (the
        one on the pixels; a later one, such as a patch-merging downsample, takes features)."""
        convs = [r for r in recs if r.op in CONV]
        if len(convs) != 1:
            return None
        r = convs[0]
        w = r.in_shapes[1] if len(r.in_shapes) > 1 else None
        stride = r.scalars[3] if len(r.scalars) > 3 else None
        groups = r.scalars[-1] if r.scalars and isinstance(r.scalars[-1], int) else 1
        if not w or len(w) not in (4, 5) or groups != 1 or not isinstance(stride, list) \
                or stride != w[2:] or max(stride) < 2:
            return None
        first = min(x.index for x in self.cap.records if x.op in CONV
                    and len(x.in_shapes) > 1 and x.in_shapes[1] and len(x.in_shapes[1]) in (4, 5))
        if r.index != first:
            return None
        return "embedding.patch", [
            f"convolution {w[1]} -> {w[0]} channels, kernel {'x'.join(map(str, w[2:]))} = stride "
            "(non-overlapping patches)", "the first such convolution of the forward (on the input)"
        ], {"in_channels": w[1], "dim": w[0], "patch": w[2:]}

    def _patch_unfold(self, recs: list[OpRecord], mm: OpRecord
                      ) -> tuple[str, list[str], dict[str, Any]] | None:
        """A patch embedding in two steps: one unfold (im2col) of images whose kernel is its
        stride (non-overlapping patches), then one linear reading what it cut (channels x the
        kernel's area), nothing else but views: a strided convolution written as an unfold and a
        GEMM (Llama 4's vision tower); the first unfold of the forward (the one on the pixels)."""
        cols = [r for r in recs if r.op == "im2col"]
        if len(cols) != 1 or any(r.op not in VIEW_OPS for r in recs if r not in (cols[0], mm)):
            return None
        r = cols[0]
        x = r.in_shapes[0] if r.in_shapes else None
        kernel, stride = (r.scalars[1], r.scalars[4]) if len(r.scalars) > 4 else (None, None)
        if not x or len(x) != 4 or not isinstance(kernel, list) or kernel != stride \
                or max(kernel) < 2 or mm.index < r.index:
            return None
        d = _linear_dims(mm, self.ctx)
        if not d or d[0] != x[1] * kernel[0] * kernel[1]:
            return None
        if r.index != min(x.index for x in self.cap.records if x.op == "im2col"):
            return None
        return "embedding.patch", [
            f"unfold (im2col) of {x[1]}-channel images, kernel {'x'.join(map(str, kernel))} = "
            "stride (non-overlapping patches)",
            f"then one linear {d[0]} -> {d[1]} over the patches: a convolution in two steps",
            "the first unfold of the forward (on the input)"
        ], {"in_channels": x[1], "dim": d[1], "patch": list(kernel)}

    def _output_head(self, path: str, rec: OpRecord) -> str | None:
        """Why the vocabulary-wide linear at ``path`` is the model's output head, or None: its
        weight is the embedding's (tied), or no other module's weight projection runs after its
        last call (the logits are what the forward ends with). Width alone is no evidence: an
        MLP as wide as the vocabulary has linears of the same shape that feed more compute."""
        weights = set(rec.params.values())
        if any(r.op == "embedding" and weights & set(r.params.values()) for r in self.cap.records):
            return "its weight is the embedding's (tied)"
        last = max(r.index for r in self.by_module.get(path, [rec]))
        if not any(r.index > last and r.module != path and r.params and is_matmul(r.op)
                   for r in self.cap.records):
            return "no weight projection runs after it: the model's output head"
        return None


    # -- traversal ------------------------------------------------------------------------
    def _post_order(self) -> list[str]:
        order: list[str] = []

        def visit(p: str) -> None:
            for c in self.ctx.children.get(p, []):
                visit(c)
            order.append(p)

        visit("")
        return order

    def _conv_blocks(self, path: str, recs: list[OpRecord]) -> list[OpRecord]:
        """Split depthwise convs over the sequence out as blocks named after their weight's
        module: `conv.causal1d` when no output sees a later input, else `conv.noncausal1d`."""
        kept = []
        for r in recs:
            w = r.in_shapes[1] if len(r.in_shapes) > 1 else None
            groups = r.scalars[-1] if r.scalars and isinstance(r.scalars[-1], int) else 1
            pad = r.scalars[4] if len(r.scalars) > 4 else None
            if r.op in CONV and w and len(w) == 3 and groups == w[0] and w[1] == 1:
                wname = r.params.get(1, f"{path}.conv")
                owner = wname.rsplit(".", 1)[0]
                k = w[-1]
                causal = pad in ([k - 1], k - 1)
                sides = self._seq_pad(r) if pad in ([0], 0) else None
                left = sides[0] if sides is not None and sides[1] == 0 else None
                after = [x for x in recs if x.index > r.index][:4]
                act = next((ACTIVATIONS[x.op] for x in after if x.op in ACTIVATIONS), None)
                ev = [f"depthwise conv1d: groups = channels = {w[0]}, kernel {k}"]
                extra: dict[str, Any] = {}
                if left is not None and left >= k - 1:
                    # the caller pads the sequence on the left only: no output sees a later
                    # input. More than K-1 (ZAYA's CCA: the pad of two chained convs) leaves
                    # the surplus to a conv after it: the output is longer than T.
                    causal = True
                    extra["left_pad"] = left
                    ev.append(f"unpadded, after a left pad of {left} by the caller"
                              f"{' (K-1)' if left == k - 1 else f' (K-1 = {k - 1}: longer output)'}"
                              ": causal")
                elif causal:
                    ev.append(f"padding {k - 1} then trimmed: causal")
                else:
                    # padding on both sides (centred, "same"), or too little on the left: an
                    # output sees later inputs. It still mixes tokens over the sequence.
                    extra["padding"] = list(sides) if sides is not None else _conv_padding(r, k)
                    ev.append(f"padding {extra['padding'] or pad}" +
                              (" by the caller" if sides is not None else "") +
                              f": each output sees {self._lookahead(extra['padding'], k)} later "
                              "position(s) (not causal)")
                if act:
                    ev.append(f"followed by {act}")
                # The activation after the conv is the caller's: the block itself is the plain
                # conv (so a kernel for it is a drop-in); `followed_by` records the fusion chance.
                self._conv_at[owner] = r.index
                self._add(owner, "conv.causal1d" if causal else "conv.noncausal1d", ev,
                          {"channels": w[0], "kernel_size": k, "activation": None,
                           "followed_by": act, "causal": causal, **extra}, [r], r)
            else:
                kept.append(r)
        return kept

    @staticmethod
    def _lookahead(padding: list[int] | None, k: int) -> str:
        """How many later positions an output sees: K-1 minus the left padding ('?': unknown)."""
        return "?" if not padding else str(max(k - 1 - padding[0], 0))

    def _seq_pad(self, conv: OpRecord) -> tuple[int, int] | None:
        """(left, right) when the op just before ``conv`` (past views) pads its input's last dim
        (the sequence of a [B, C, T] conv input) and nothing else: ``pad`` / ``constant_pad_nd``
        with [left, right]; None otherwise."""
        prev = next((x for x in reversed(self.cap.records[:conv.index])
                     if x.op not in VIEW_OPS), None)
        spec = prev.scalars[1] if prev is not None and prev.op in ("pad", "constant_pad_nd") \
            and len(prev.scalars) > 1 else None
        if not (isinstance(spec, list) and len(spec) >= 2 and all(isinstance(v, int) for v in spec)
                and not any(spec[2:]) and (spec[0] > 0 or spec[1] > 0) and min(spec[:2]) >= 0
                and prev.out_shapes and conv.in_shapes and prev.out_shapes[0] == conv.in_shapes[0]):
            return None
        return spec[0], spec[1]

    def _add(self, path, kind, evidence, attrs, recs, first=None) -> None:
        io = self.cap.module_io.get(path)
        if io:
            ins, outs = io
        elif first is not None:
            ins = [TensorMeta(shape=s, dtype=d or "") for s, d in
                   zip(first.in_shapes, first.in_dtypes) if s is not None]
            outs = [TensorMeta(shape=s, dtype=d) for s, d in
                    zip(first.out_shapes, first.out_dtypes)]
        else:
            ins, outs = [], []
        params = {n[len(path) + 1:]: s for n, s in self.ctx.param_shapes.items()
                  if n.startswith(path + ".")}
        flops, nbytes = estimate_cost(recs)
        if n := self._weight_matmuls(recs):
            attrs = {**attrs, "weight_matmuls": n}
        if inner := self._no_gradient_modules(path):
            attrs = {**attrs, "no_gradient_modules": inner}
        self.blocks[path] = Block(
            path=path, kind=kind, layer=layer_of(path),
            class_name=self.ctx.module_types.get(path, ""), evidence=evidence,
            op_histogram=dict(sorted(_hist(recs).items())), inputs=ins, outputs=outs,
            params=params, attrs=attrs, flops=flops, bytes=nbytes)

    def _no_gradient_modules(self, path: str) -> list[str]:
        """Modules below ``path`` (names relative to it, the outermost of nested ones) that hold
        parameters and pass no gradient out to them: every output the capture saw is an integer
        or boolean tensor (a top-k indexer handing back the positions it picked), or an op read
        some of its parameters and no output reaches them in autograd's graph
        (`capture.no_gradient_probe`: an indexer that turns its picks into a float mask itself).
        Parameters no op read at this sequence length (a compressor idle until a longer T) are
        no evidence either way: such a module is listed by its outputs' dtypes alone. Its
        parameters cannot train on the model's loss (training's default LoRA targets leave its
        linears out: `onboarding.train.lora.default_targets`)."""
        if self._no_grad is None:
            owners = {n.rsplit(".", i)[0] for n in self.ctx.param_shapes
                      for i in range(1, n.count(".") + 1)}
            ran = {n.rsplit(".", i)[0] for r in self.cap.records for n in r.params.values()
                   if n in self.ctx.param_shapes for i in range(1, n.count(".") + 1)}
            probed = self.cap.no_gradient or set()
            self._no_grad = [
                p for p, (_, outs) in self.cap.module_io.items() if p in owners and outs
                and (not any(o.dtype.startswith(("float", "bfloat", "complex")) for o in outs)
                     or (p in probed and p in ran))]
        pre = f"{path}." if path else ""
        inner = [p for p in self._no_grad if p.startswith(pre)]
        return sorted(p[len(pre):] for p in inner if not any(p.startswith(f"{q}.") for q in inner))

    def _weight_matmuls(self, recs: list[OpRecord]) -> int:
        """How many ``matmul`` ops take a 2-D parameter as an operand: a projection written
        ``x @ W.T`` (Falcon's) or ``x @ W``, a GEMM like ``linear`` though ATen names it
        ``matmul`` (coverage counts them with the linears)."""
        return sum(1 for r in recs if r.op == "matmul" and any(
            len(self.ctx.param_shapes.get(n, ())) == 2 and i < len(r.in_shapes)
            and r.in_shapes[i] is not None and len(r.in_shapes[i]) == 2
            for i, n in r.params.items()))

    def run(self) -> list[Block]:
        for path in self._post_order():
            kids = self.ctx.children.get(path, [])
            recs = list(self.by_module.get(path, []))
            recs = self._conv_blocks(path, recs)
            for c in kids:
                recs.extend(self.unclaimed.pop(c, []))
            recs.sort(key=lambda r: r.index)
            recs = self._claim_input_gates(path, recs)
            child_kinds = {c: self.blocks[c].kind for c in kids if c in self.blocks}
            found = self._rule(path, recs, child_kinds) if recs else None
            if found is None and recs:
                found = self._per_call(path, recs, child_kinds)
            if found is None:
                left = self._claim_stream_mixing(path, recs)
                if path in self._stream_carriers() or self._mixer_projections(path, left):
                    # a layer of n streams is a unit: its leftovers go to the leftover pass, never
                    # pooled with other layers' into a rule further up (a list or the root); so
                    # are a mixer's projections around it (a layer's own MLP is no mixer's)
                    self.stranded[path] = left
                else:
                    self.unclaimed[path] = left
                continue
            kind, ev, attrs = found
            absorbed = [self.blocks.pop(p) for p in attrs.pop("_absorb", [])]
            self._add(path, kind, ev, attrs, recs)
            for b in absorbed:  # a block taken into this one: its ops and cost count here
                mine = self.blocks[path]
                hist = Counter(mine.op_histogram)
                hist.update(b.op_histogram)
                mine.op_histogram = dict(sorted(hist.items()))
                mine.flops += b.flops
                mine.bytes += b.bytes
                if n := b.attrs.get("weight_matmuls"):
                    mine.attrs["weight_matmuls"] = mine.attrs.get("weight_matmuls", 0) + n
        self._merge_expert_lists()
        self._leftovers()
        self._shared_experts()
        self._inline_routers()
        return sorted(self.blocks.values(), key=lambda b: _path_key(b.path))

    def _per_call(self, path: str, recs: list[OpRecord], child_kinds: dict[str, str]
                  ) -> tuple[str, list[str], dict[str, Any]] | None:
        """A module called more than once in one forward (an lm_head shared with a
        multi-token-prediction head): its calls' ops classified call by call; one kind when
        every call is that kind (the first call's attrs), else None."""
        calls = sorted({r.call for r in self.by_module.get(path, [])})
        if len(calls) < 2:
            return None
        found = [self._rule(path, [r for r in recs if r.call == c], child_kinds) for c in calls]
        if any(f is None for f in found) or len({f[0] for f in found}) != 1:
            return None
        kind, ev, attrs = found[0]
        return kind, [*ev, f"called {len(calls)} times in one forward, each call {kind}"], attrs

    def _leftovers(self) -> None:
        """Substantive compute nobody explained becomes `unknown` at the module that ran it."""
        for container, recs in [*self.unclaimed.items(), *self.stranded.items()]:
            by_origin: dict[str, list[OpRecord]] = {}
            for r in recs:
                origin = self._origin(r.module)
                by_origin.setdefault(origin, []).append(r)
            for origin, group in by_origin.items():
                ops = _hist(group)
                n_mm = len(_matmul_recs(group))
                heavy = [op for op in ("topk", "cumsum", "sort") if ops[op]] + \
                    [op for op in ops if op in SOFTMAX or op in CONV or is_sdpa(op)]
                if origin == container and container in self.blocks:
                    continue
                if n_mm >= 2 or (heavy and n_mm >= 1):
                    self._add(origin, "unknown", [
                        f"{n_mm} matmuls" + (f", {', '.join(sorted(set(heavy)))}" if heavy
                                             else "") + " that no rule explains"], {}, group)

    def _origin(self, module: str) -> str:
        """The largest subtree around ``module`` that holds no block: where leftovers came from.
        A conv split out of a module's own ops (`conv.causal1d`, `conv.noncausal1d`) does not
        count: the compute around it (a mixer that no rule explains) is one leftover, not one
        per projection."""
        def has_block(p: str) -> bool:
            return any(inside(b, p)
                       and self.blocks[b].kind not in CONV_KINDS for b in self.blocks)

        while module and not has_block(parent := module.rsplit(".", 1)[0] if "." in module
                                       else ""):
            module = parent
        return module


def _path_key(path: str) -> list:
    return [int(p) if p.isdigit() else p for p in path.split(".")]
