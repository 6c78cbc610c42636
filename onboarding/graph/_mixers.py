"""The classifier's rules for sequence mixers: softmax attention (dense, top-k, compressed, depth-wise), linear attention and selective state-space scans (`MixerRules`, a part of
`classify.Classifier`: its methods read the classifier's capture, context and blocks)."""

from __future__ import annotations

import math
from typing import Any

from onboarding.graph._records import (ACTIVATIONS, GATE_ACTIVATIONS, SOFTMAX, _core_widths,
                                       _hist, _linear_dims, _matmul_recs, _topk_input, _topks,
                                       is_matmul, is_sdpa, layer_of)
from onboarding.graph.capture import OpRecord


class MixerRules:
    """Rules for sequence mixers; mixed into `classify.Classifier`."""

    def _depth_attention(self, path: str, recs: list[OpRecord], mm: list[OpRecord]
                         ) -> tuple[str, list[str], dict[str, Any]] | None:
        """Attention over depth (block attention residuals): at every position, q learned
        queries (a parameter of the module, [D] or [q, D], the same for every token) score k
        stacked states [.., T, k, D] (what earlier layers, or blocks of layers, wrote, and the
        current partial sum), a softmax over those k, not over the sequence, and the states
        summed by those weights: the input of the next sublayer. No weight projection, no top-k:
        scores [.., T, q, k] written out (two matmuls of activations) or a fused SDPA whose
        query and key lengths are q and k at T "heads"."""
        ctx = self.ctx
        if any(self._weight_2d(r) for r in mm) or any(r.op == "topk" for r in recs):
            return None
        found = None
        for r in recs:
            a = r.in_shapes[0] if r.in_shapes else None
            if r.op in SOFTMAX and a and len(a) >= 3 and a[-3] == ctx.seq and a[-1] != ctx.seq:
                found = (a[-2], a[-1], None)
            elif is_sdpa(r.op) and len(r.in_shapes) > 1 and a and r.in_shapes[1] \
                    and len(a) >= 3 and a[-3] == ctx.seq and r.in_shapes[1][-3] == ctx.seq \
                    and r.in_shapes[1][-2] != ctx.seq:
                found = (a[-2], r.in_shapes[1][-2], a[-1])
            if found:
                break
        if found is None:
            return None
        q, k, width = found
        if width is None:  # the weighted sum's width: [.., q, k] x [.., k, D]
            width = next((r.out_shapes[0][-1] for r in mm if r.in_shapes and r.in_shapes[0]
                          and r.in_shapes[0][-2:] == [q, k] and r.out_shapes and r.out_shapes[0]),
                         None)
        own = [n for n, sh in ctx.param_shapes.items() if n.rsplit(".", 1)[0] == path
               and width and sh in ([width], [q, width])]
        if not width or not own:
            return None
        normed = any(r.op in ("rsqrt", "rms_norm", "_fused_rms_norm") for r in recs) or any(
            b.kind == "norm.rms" and b.inputs and len(b.inputs[0].shape) >= 3
            and b.inputs[0].shape[-2:] == [k, width]
            for b in (self.blocks.get(c) for c in ctx.children.get(path, [])) if b is not None)
        ev = [f"{q} learned quer{'y' if q == 1 else 'ies'} ({own[0][len(path) + 1:]}, the same "
              f"for every token) against {k} stacked states of width {width} at each position",
              f"softmax over the {k} states, not over the sequence: a per-token weighted sum of "
              "what earlier layers wrote (attention over depth)"]
        if normed:
            ev.append("the states RMS-normalised before they are scored")
        return "residual.depth_attention", ev, {"queries": q, "states": k, "width": width,
                                                "normalised": normed}

    def _attention(self, path, recs, attn, seq_topk, child_kinds, pooled=None):
        ctx, ev, attrs = self.ctx, list(attn), {}
        mm = _matmul_recs(recs)
        # attention over pooled keys: the scores softmax reads T + C (or C) keys, not T
        keys = {r.in_shapes[0][-1] for r in recs if r.op in SOFTMAX and r.in_shapes
                and r.in_shapes[0] and len(r.in_shapes[0]) >= 2 and r.in_shapes[0][-2] == ctx.seq}
        if pooled and not any(is_sdpa(r.op) for r in recs) and not keys & {ctx.seq, ctx.seq + 1}:
            return self._compressed_attention(path, recs, ev, pooled, keys, child_kinds)
        if core := _core_widths(recs, ctx.seq):  # heads and widths, config-free (training FLOPs)
            attrs["core_widths"] = core
        if not seq_topk and not any(is_sdpa(r.op) for r in recs):
            # softmax(Q K^T) V written out: the scores are a tensor in memory, O(T^2) per head
            soft = next((r for r in recs if r.op in SOFTMAX and r.in_shapes
                         and r.in_shapes[0] and r.in_shapes[0][-2:] in ([ctx.seq, ctx.seq],
                                                                        [ctx.seq, ctx.seq + 1])),
                        None)
            scores = soft.in_shapes[0] if soft is not None else None
            attrs["unfused_core"] = {"scores": scores, "score_gemms": sum(
                1 for r in mm if not r.params and r.op in ("mm", "bmm"))}
            ev.append(f"unfused: the scores {scores} are materialised, O(T^2) memory and traffic")
            # a logit soft-cap (c tanh(s / c), Gemma 2's): a tanh over the [.., T, T] scores
            # before their softmax; the key only where there is one
            if soft is not None and any(r.op in ("tanh", "tanh_") and r.index < soft.index and r.in_shapes
                                        and r.in_shapes[0] and r.in_shapes[0][-2:] == [ctx.seq, ctx.seq]
                                        for r in recs):
                attrs["unfused_core"]["softcap"] = True
                ev.append("the scores soft-capped before the softmax: a tanh over them (c tanh(s / c))")
        # MLA: a low-rank latent that a child norm normalises and a projection expands again.
        # Per-head q/k norms see [B, T, H, D]; a latent norm sees [B, T, r] straight from a
        # projection.
        latent_dims = {self.blocks[c].attrs.get("dim") for c in child_kinds
                       if child_kinds[c] == "norm.rms" and self.blocks[c].inputs
                       and len(self.blocks[c].inputs[0].shape) == 3}
        in_dims = {d[0] for r in mm if (d := _linear_dims(r, ctx))}
        latent = sorted(d for d in latent_dims & in_dims if d and d != ctx.hidden)
        if latent:
            ev.append(f"low-rank latent of width {latent} normalised then expanded (MLA)")
            attrs["layout"] = "mla"
            attrs["kv_latent"] = latent
        if any(r.op == "slice" and len(r.scalars) > 4 and r.scalars[4] == 2 for r in recs):
            attrs["rope_layout"] = "interleaved"
        elif any(r.op == "neg" for r in recs):
            attrs["rope_layout"] = "half"
        # a sigmoid of logsumexp(scores) less a per-head parameter, scaling the output, is one
        # more softmax-denominator logit (a sink), no gate: its input is the scores' [.., T]
        # log-normaliser, not a projection of the hidden state
        lse = [r for r in recs if r.op == "logsumexp" and r.in_shapes and r.in_shapes[0]
               and len(r.in_shapes[0]) >= 2 and r.in_shapes[0][-2] == ctx.seq and r.out_shapes]
        sink = [r for r in recs if r.op == "sigmoid" and r.in_shapes and any(
            lo.index < r.index and r.in_shapes[0] == lo.out_shapes[0] for lo in lse)]
        # the output gate is read before the kinds that return early: an MLA or top-k block
        # gates its output the same way (Ling 3's MLA, one sigmoid per head)
        gate = self._output_gate(path, recs, mm, sink)
        if gate is not None:
            act, per_head, source = gate
            attrs.update(gate_activation=act, gate_per_head=per_head)
            if per_head and source is not None:
                attrs.update(gate_projection=source[0], gate_width=source[1])
            ev.append(f"attention output multiplied by {act}(a projection of the hidden state"
                      f"{', one value per head' if per_head else ''}) before the out projection")
        if seq_topk:
            r, k, n = seq_topk[0]
            relu = any(x.op in ("relu", "relu_") for x in recs)
            ev.append(f"topk k={k} over {n} key positions" + (" of ReLU indexer scores"
                                                               if relu else ""))
            attrs.update(topk=k, indexer_relu=relu, topk_inputs=[_topk_input(t) for t, _, _ in seq_topk])
            return "sparse_attention.topk", ev, attrs
        if latent:
            return "attention.mla", ev, attrs
        if sink:
            attrs["sink"] = True
            ev.append(f"output scaled by sigmoid(logsumexp(scores) - s): a sink (one more "
                      f"softmax-denominator logit), no gate; the sigmoid reads the scores' "
                      f"{sink[0].in_shapes[0]} log-normaliser")
        hint = ctx.layer_hints.get(layer_of(path) if layer_of(path) is not None else -1, "")
        if "sliding" in hint or "chunked" in hint or "local" in hint:
            ev.append(f"hint: config layer type {hint!r} (the mask is built outside the block)")
            return "attention.sliding", ev, attrs
        return ("attention.full" if gate is None else "attention.gated"), ev, attrs

    def _output_gate(self, path: str, recs: list[OpRecord], mm: list[OpRecord],
                     sink: list[OpRecord]) -> tuple[str, bool, tuple[str, int] | None] | None:
        """The attention output's gate as (the activation's name, whether it is one value per
        head: fewer elements per token than the output it scales, its source), or None. The
        source: (the weight, named under ``path``, of the projection the gate is read from, one
        as wide as the gate, else the last before it whose width is a multiple of the gate's;
        the gate's elements per token), or None for a weight outside the block. A projection of
        the hidden state or one chained onto it (a low-rank gate's up projection, g_b in
        g_b(g_a(x)), the one that makes the gate). A per-head gate's projection tells its head
        count at another size (the plan's, where the config gives none:
        `onboarding.plan.shapes.gate_heads`). Read by structure: an elementwise activation
        (`GATE_ACTIVATIONS`: sigmoid, softplus, silu, ...) of a token-major [B, T, ..] tensor of
        n elements per token, run after a weight projection of the hidden state (or one chained
        onto it) whose width is a multiple of n (the gate's own projection, or a part of one it
        shares with the queries), and a product after the attention core and before the
        out projection of a tensor with the activation's elements and the attention output (the
        out projection's input width per token). The records carry no data flow, so shapes and
        order stand for it: a sink's sigmoid (``sink``) reads the scores' [.., T] log-normaliser
        and a logit soft-cap's tanh the [.., T, T] scores, neither token-major; a gate on the
        queries multiplies before the core."""
        ctx, last = self.ctx, mm[-1] if mm else None
        core = next((r.index for r in recs if is_sdpa(r.op) or r.op in SOFTMAX), None)
        if last is None or core is None or not last.in_shapes or not last.in_shapes[0]:
            return None
        width = last.in_shapes[0][-1]

        def per_token(shape: list[int] | None) -> int | None:
            if shape and len(shape) >= 3 and shape[1] == ctx.seq and ctx.seq not in shape[2:]:
                return math.prod(shape[2:])
            return None

        # the hidden state's width: the embedding's, or what the block's first projection reads
        first = next((d for r in mm if self._weight_2d(r) and (d := _linear_dims(r, ctx))), None)
        hidden = {ctx.hidden, first[0] if first else None} - {None}
        # projections of the hidden state, and those chained onto one (reading a width an earlier
        # one wrote): a low-rank gate's is its second, g_b of g_b(g_a(x)), D -> r -> n
        projs: list[tuple[int, int, str]] = []
        for r in mm:
            if self._weight_2d(r) and (d := _linear_dims(r, ctx)) \
                    and (d[0] in hidden or any(w == d[0] for _, w, _ in projs)):
                projs.append((r.index, d[1], next(n for n in r.params.values()
                                                  if len(ctx.param_shapes.get(n, ())) == 2)))
        for a in recs:
            n = per_token(a.in_shapes[0]) if a.in_shapes else None
            src = [(w, name) for i, w, name in projs if n and i < a.index and w % n == 0]
            if a.op not in GATE_ACTIVATIONS or a in sink or a.index >= last.index or not n \
                    or not a.out_shapes or not src:
                continue
            _, name = ([x for x in src if x[0] == n] or src)[-1]
            source = (name[len(path) + 1:], n) if name.startswith(path + ".") else None
            size = math.prod(a.out_shapes[0])
            for x in recs:
                if x.op not in ("mul", "mul_") or not max(a.index, core) < x.index < last.index \
                        or len(x.in_shapes) < 2 or not x.in_shapes[0] or not x.in_shapes[1] \
                        or not x.out_shapes or per_token(x.out_shapes[0]) != width:
                    continue
                g, o = x.in_shapes[0], x.in_shapes[1]
                if (math.prod(g) == size and per_token(o) == width) or \
                        (math.prod(o) == size and per_token(g) == width):
                    return GATE_ACTIVATIONS[a.op], n < width, source
        return None

    def _compressed_attention(self, path, recs, ev, pooled, keys, child_kinds):
        """`attention.compressed`: softmax attention whose keys/values include C pooled entries
        (`_compressed_kv`), each one window of r tokens; a top-k over those C entries (an
        indexer's, scored apart from the attention) picks the ones a query reads."""
        ctx, c = self.ctx, pooled["compressed_keys"]
        attrs = dict(pooled)
        width = max(keys)
        sink = width - 1 in (ctx.seq + c, c)
        attrs["local_keys"] = width - sink == ctx.seq + c
        attrs["sink"] = sink
        ev.append(f"{c} key/value entries pooled from windows of {pooled['window']} positions "
                  f"(stride {pooled['compress_ratio']}" +
                  (", overlapping" if pooled["overlap"] else "") + f"; {pooled['pooling']})")
        ev.append("scores over the " + (f"{ctx.seq} local keys and " if attrs["local_keys"] else "")
                  + f"{c} pooled entries" + (" and a sink column" if sink else ""))
        sel = [t for t in _topks(recs) if t[2] == c]
        attrs["topk"] = sel[0][1] if sel else None
        if sel:
            relu = any(x.op in ("relu", "relu_") for x in recs)
            attrs["indexer_relu"] = relu
            ev.append(f"topk k={sel[0][1]} over the {c} pooled entries" +
                      (" of ReLU indexer scores" if relu else ""))
        # the same layout facts as the other attention kinds (MLA latent, RoPE layout)
        _, _, extra = self._attention(path, recs, [], [], child_kinds)
        extra.pop("unfused_core", None)
        attrs.update(extra)
        return "attention.compressed", ev, attrs

    def _selective_scan(self, path: str, recs: list[OpRecord], child_kinds: dict[str, str]
                        ) -> tuple[str, list[str], dict[str, Any]] | None:
        """A Mamba-1 mixer (a per-channel selective scan), read off its weights and ops: a
        [I, N] parameter exponentiated (A = -exp(A_log), one decay per channel and state), a
        softplus time step, a depthwise causal conv over I channels, and weight projections
        I -> R + 2N (x_proj: dt, B, C), R -> I (dt_proj), width -> 2I (in_proj: x and the gate)
        and I -> width (out_proj). None otherwise (Mamba-2's A is one scalar per head)."""
        ops, shapes = _hist(recs), self.ctx.param_shapes
        if not ops["softplus"] or not ops["exp"]:
            return None
        a_shapes = [shapes[n] for r in recs if r.op == "exp" for n in r.params.values()
                    if len(shapes.get(n, ())) == 2]
        if not a_shapes or len({tuple(s) for s in a_shapes}) != 1:
            return None
        inner, state = a_shapes[0]
        # weights [out, in] of the matmuls (nn.Linear, or W @ x)
        mats = [shapes[n] for r in recs if is_matmul(r.op) for n in r.params.values()
                if len(shapes.get(n, ())) == 2]
        # x_proj [R + 2N, I] beside dt_proj [I, R] (out_proj [width, I] also reads I)
        x_proj = [m for m in mats if m[1] == inner and m[0] > 2 * state
                  and [inner, m[0] - 2 * state] in mats]
        rank = x_proj[0][0] - 2 * state if x_proj else None
        dt_proj = rank is not None
        in_proj = [m for m in mats if m[0] == 2 * inner]
        out_proj = [m for m in mats if m[1] == inner and in_proj and m[0] == in_proj[0][1]]
        convs = [self.blocks[c].attrs for c, k in child_kinds.items()
                 if k == "conv.causal1d" and self.blocks[c].attrs.get("channels") == inner]
        if not (x_proj and dt_proj and in_proj and out_proj and convs):
            return None
        norms = {self.blocks[c].attrs.get("dim") for c, k in child_kinds.items()
                 if k == "norm.rms"}
        norm_dt, norm_bc = rank in norms, state in norms
        has_d = any(r.op in ("mul", "mul_") and shapes.get(n) == [inner]
                    for r in recs for n in r.params.values())
        gate = next((ACTIVATIONS[r.op] for r in reversed(recs) if r.op in ACTIVATIONS), None)
        ev = [f"A: a [{inner}, {state}] parameter exponentiated (one decay per channel and state)",
              "softplus time step", f"depthwise causal conv over {inner} channels",
              (f"projections {in_proj[0][1]} -> {2 * inner} (x and gate), {inner} -> {rank} + "
               f"2x{state} (dt, B, C), {rank} -> {inner} (dt), {inner} -> {out_proj[0][0]}"),
              "per-channel selective scan (Mamba-1)"]
        if norm_dt or norm_bc:
            ev.append("RMS-normed " + " and ".join(n for n, on in (("dt", norm_dt), ("B/C", norm_bc))
                                                    if on))
        return "linear_attention.mamba", ev, {
            "scan": "selective", "per_channel_decay": True, "inner": inner, "state": state,
            "dt_rank": rank, "conv_width": convs[0].get("kernel_size"), "norm_dt": norm_dt,
            "norm_bc": norm_bc, "has_d": has_d, "gate": gate}

    def _state_linear_attention(self, path: str, recs: list[OpRecord], mm: list[OpRecord]
                                ) -> tuple[str, list[str], dict[str, Any]] | None:
        """Linear attention read off its state (MiniMax's lightning attention: a fixed per-head
        decay made once as buffers, so no decay cumsum): weight projections, no softmax, fused
        attention or top-k, and two products of activations, neither a weight: K^T V, keys
        against values over positions, into a [.., a, b] state (a, b not the sequence; over the
        whole sequence or block by block, the blocks' positions summing to T), and a read-out of
        a state of that shape by the queries of as many positions (Q S, [.., n, a] x [.., a, b]).
        The scores Q K^T, if any, are never normalised over the keys."""
        ctx, ops = self.ctx, _hist(recs)
        if not any(r.params for r in mm) or any(op in SOFTMAX or is_sdpa(op) for op in ops) \
                or ops["topk"]:
            return None
        two = [r for r in mm if not r.params and len(r.in_shapes) > 1 and r.in_shapes[0]
               and r.in_shapes[1] and len(r.in_shapes[0]) >= 2 and len(r.in_shapes[1]) >= 2
               and r.out_shapes and r.out_shapes[0]]
        # K^T V: [.., a, n] x [.., n, b] over n positions into an [a, b] state (a, b not the
        # sequence), once over the whole sequence or once a block, the blocks' n summing to T
        # (a product over anything else, hyper-connections' streams, sums to something else);
        # Q S: the queries of n positions, [.., n, a], against a state of that shape
        by_state: dict[tuple[int, int], list[int]] = {}
        for r in two:
            (a, n), (n2, b) = r.in_shapes[0][-2:], r.in_shapes[1][-2:]
            if n == n2 > 1 and r.out_shapes[0][-2:] == [a, b] and ctx.seq not in (a, b):
                by_state.setdefault((a, b), []).append(n)
        found = next(((a, b) for (a, b), ns in by_state.items() if sum(ns) == ctx.seq and any(
            r.in_shapes[1][-2:] == [a, b] and r.in_shapes[0][-1] == a and r.in_shapes[0][-2] in ns
            for r in two)), None)
        if found is None:
            return None
        a, b = found
        decayed = any(r.op in ("mul", "mul_") and r.in_shapes and r.in_shapes[0]
                      and r.in_shapes[0][-2:] == [a, b] for r in recs)
        ev = [f"K^T V over positions into a [{a}, {b}] state, read out by the queries (Q S)",
              "no softmax, fused attention or top-k: linear attention"]
        if decayed:
            ev.append("the state is scaled before it takes the next keys and values (a decay)")
        return "linear_attention.other", ev, {"recurrence": "state", "state": [a, b],
                                              "state_decay": decayed}

    def _linear_attention(self, recs, decay, tri):
        ops = _hist(recs)
        ev = ["exp + cumsum: cumulative decay in log space"]
        if tri:
            ev.append(f"triangular masks/solves ({', '.join(sorted(tri))})")
        loop = ops["copy_"] + ops["index_put"] + ops["index_put_"]
        if loop >= 8:
            ev.append(f"{loop} in-place row updates (forward substitution / chunk loop)")
        shape = decay.in_shapes[0] or []
        dim = decay.scalars[1] if len(decay.scalars) > 1 and isinstance(decay.scalars[1],
                                                                         int) else -1
        per_channel = dim % max(len(shape), 1) != len(shape) - 1
        beta = ops["sigmoid"] > 0
        l2 = any(r.op in ("rsqrt", "sqrt", "norm", "linalg_vector_norm") for r in recs)
        attrs = {"decay_shape": shape, "cumsum_dim": dim, "per_channel_decay": per_channel,
                 "chunk": shape[dim] if shape else None}
        if tri and beta and (loop >= 8 or "linalg_solve_triangular" in tri):
            ev.append("sigmoid beta with a triangular delta-rule correction")
            if l2:
                ev.append("q/k normalised (l2)")
            if per_channel:
                ev.append(f"decay cumsum over dim {dim} of {shape}: per-channel gate")
                return "linear_attention.kimi_delta", ev, attrs
            ev.append(f"decay cumsum over the last dim of {shape}: scalar gate per head")
            return "linear_attention.gated_delta", ev, attrs
        if ops["softplus"] and not beta:
            ev.append("softplus time step without a delta-rule beta (selective state space)")
            return "linear_attention.mamba", ev, attrs
        return "linear_attention.other", ev, attrs
