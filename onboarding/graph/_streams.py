"""The classifier's rules for residual streams: hyper-connections, their stream mixing and projections, and the modules that carry several streams (`StreamRules`, a part of
`classify.Classifier`: its methods read the classifier's capture, context and blocks)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from onboarding.graph._records import (ACTIVATIONS, CONV, VIEW_OPS, _expert_activation, _hist,
                                       _linear_dims, _mixing_shapes, estimate_cost, is_matmul,
                                       is_sdpa)
from onboarding.graph.capture import OpRecord
from onboarding.modpath import inside


class StreamRules:
    """Rules for residual streams; mixed into `classify.Classifier`."""

    def _weight_2d(self, r: OpRecord) -> bool:
        return any(len(self.ctx.param_shapes.get(n, ())) == 2 for n in r.params.values())

    def _stream_carriers(self) -> dict[str, tuple[set[int], int, int, list[int]]]:
        """Modules that map several residual streams to as many: a 4-D first input, returned
        with its shape, whose last dim is the model width (what the forward's last weight
        projection, the head, reads) and one of whose dims is the sequence, or a 3-D one
        [B * n, T, D] whose batch dim is n >= 2 times the forward's (the streams folded into
        the batch); path -> (the other dims >= 2, candidate stream counts, or n when folded; the
        first and last op index under the module; the shape). Cached."""
        if self._carriers is not None:
            return self._carriers
        out: dict[str, tuple[set[int], int, int, list[int]]] = {}
        head = max((r for r in self.cap.records if is_matmul(r.op) and r.params and r.in_shapes
                    and r.in_shapes[0]), key=lambda r: r.index, default=None)
        width = head.in_shapes[0][-1] if head is not None else self.ctx.hidden
        batch = self._batch()
        for p, (ins, outs) in self.cap.module_io.items():
            shape = ins[0].shape if ins else None
            if not shape or shape[-1] != width or not outs or outs[0].shape != shape:
                continue
            if len(shape) == 4 and self.ctx.seq in shape[:-1]:
                rest = list(shape[:-1])
                rest.remove(self.ctx.seq)
                counts = {n for n in rest if n >= 2}
            elif len(shape) == 3 and batch and shape[1] == self.ctx.seq \
                    and shape[0] > batch and shape[0] % batch == 0:
                # the streams folded into the batch dim, [B * n, T, D] (a common library layout)
                counts = {shape[0] // batch}
            else:
                continue
            idx = [r.index for r in self.cap.records if inside(r.module, p)]
            if counts and idx:
                out[p] = (counts, min(idx), max(idx), shape)
        self._carriers = out
        return out

    def _batch(self) -> int | None:
        """The forward's batch size: the rows of the first embedding lookup's output [B, T, D]."""
        emb = next((r for r in self.cap.records if r.op == "embedding" and r.out_shapes
                    and r.out_shapes[0] and len(r.out_shapes[0]) == 3), None)
        return emb.out_shapes[0][0] if emb is not None else None

    @staticmethod
    def _stream_reads(shape: list[int], n: int) -> list[list[int]]:
        """The shapes of the n streams of a carrier's ``shape`` read into one: less the stream
        dim ([B, T, n, D] -> [B, T, D]), or the batch dim divided by n when they are folded
        into it ([B * n, T, D] -> [B, T, D])."""
        if len(shape) == 3:
            return [[shape[0] // n, *shape[1:]]] if shape[0] % n == 0 else []
        return [shape[:i] + shape[i + 1:] for i, s in enumerate(shape[:-1]) if s == n]

    def _stream_coefficients(self, path: str, recs: list[OpRecord], mm: list[OpRecord]
                             ) -> tuple[str, list[str], dict[str, Any]] | None:
        """Per-token coefficients over n residual streams (Gemma 3n's AltUp):
        a module with children whose weight projections are n and n^2 wide, both (n weights per
        stream and an n x n mixing matrix per token), inside (or at) a module whose input carries n streams of the
        model width (`_stream_carriers`). The mixing may run outside the block, in the layer's
        own forward (AltUp's predict / correct are methods the layer calls)."""
        if not mm or not self.ctx.children.get(path) or not all(self._weight_2d(r) for r in mm):
            return None
        outs = {d[1] for r in mm if (d := _linear_dims(r, self.ctx))}
        for p, (counts, _, _, shape) in self._stream_carriers().items():
            if not inside(path, p):
                continue
            n = next((c for c in sorted(counts) if outs == {c, c * c}), None)
            if n is None:
                continue
            ev = [f"{len(mm)} projections to per-token coefficients {n} and {n * n} wide: {n} "
                  f"weights and a mixing matrix of {n} x {n}",
                  f"{p} carries {n} residual streams of width {shape[-1]} (its input {shape})"]
            return "residual.streams", ev, {"role": "mix", "streams": n,
                                            "stream_width": shape[-1]}
        return None

    def _hyper_connection(self, path: str, recs: list[OpRecord], mm: list[OpRecord]
                          ) -> tuple[str, list[str], dict[str, Any]] | None:
        """A hyper-connection: a module handed the n residual streams (its first input has a
        stream carrier's shape, `_stream_carriers`) that returns, among its outputs, one tensor of
        that shape less the stream dim (the streams read into one: a sublayer's input), with
        coefficients that are its own parameters (static: an [n, n], [n, n + 1] or [n + 1, n]
        matrix) or come from weight projections of each stream (D wide) or of the streams
        flattened (nD wide), nothing wider than n^2 + 2n per token (dynamic). Role `mix` when an
        n x n (or n x (n + 1)) mixing matrix is among them: a parameter of that shape, or an op
        output whose last two dims are, or the module runs inside a carrier; `collapse` for a
        weighted read alone after every carrier
        (the streams' final sum). No attention, conv or top-k. The mixing may run in the
        carrier's own forward (`_claim_stream_mixing`). A module inside a carrier without such
        a matrix is `mix` too, with `matrix` false: it reads the streams into a sublayer and
        writes its output back by per-token weights, the streams never mixed with each other."""
        io = self.cap.module_io.get(path)
        if not io or not io[0] or not io[1] or not io[0][0].shape:
            return None
        shape = io[0][0].shape
        carriers = [(c, a, b) for c, a, b, sh in self._stream_carriers().values() if sh == shape]
        ops = _hist(recs)
        if not carriers or ops["topk"] or any(is_sdpa(op) or op in CONV for op in ops):
            return None
        d = shape[-1]
        own = [tuple(s) for name, s in self.ctx.param_shapes.items()
               if name.rsplit(".", 1)[0] == path and len(s) in (1, 2)]
        in_carrier = any(path.startswith(p + ".") for p, (_, _, _, sh) in
                         self._stream_carriers().items() if sh == shape)
        after_all = min(r.index for r in recs) > max(b for _, _, b in carriers)
        for n in sorted(set().union(*(c for c, _, _ in carriers))):
            reads = self._stream_reads(shape, n)
            square = _mixing_shapes(n)
            # a matmul by the static matrix itself (a dispatch capture records the einsum as a
            # bmm with it) mixes the streams: it is no coefficient projection
            proj = [r for r in mm if self._weight_2d(r) and not all(
                tuple(self.ctx.param_shapes.get(w, ())) in square for w in r.params.values())]
            dims = [_linear_dims(r, self.ctx) for r in proj]
            if not any(o.shape in reads for o in io[1]) or any(
                    dd is None or dd[0] not in (d, n * d) or dd[1] > n * n + 2 * n for dd in dims):
                continue
            static = [s for s in own if s in square]
            matrix = bool(static) or any(len(o) >= 3 and tuple(o[-2:]) in square
                                         for r in recs for o in r.out_shapes)
            if not (proj or static or (n,) in own):
                continue  # a plain mean of the streams: no coefficients
            role = "mix" if matrix or in_carrier else "collapse" if after_all else None
            if role is None:
                continue
            ev = [f"its input {shape} is the {n} residual streams of width {d} that the layers "
                  "carry; it returns them read into one (" + "x".join(map(str, reads[0])) + ")"]
            attrs: dict[str, Any] = {"role": role, "streams": n, "stream_width": d,
                                     "coefficients": "dynamic" if proj else "static"}
            if proj:
                flat = all(dd[0] == n * d for dd in dims)
                attrs["projection"] = "flattened" if flat else "per_stream"
                widths = [dd[1] for dd in dims]
                ev.append(f"{len(proj)} projection(s) of the {'flattened streams (' + str(n * d) if flat else 'each stream (' + str(d)} wide) "
                          f"to per-token coefficients {widths} wide" +
                          (f": one fused projection, n^2 + 2n = {n * n + 2 * n} (n input weights, "
                           f"n output weights, the {n} x {n} matrix)" if widths == [n * n + 2 * n] else ""))
            if static:
                ev.append(f"a learned {'x'.join(map(str, static[0]))} parameter: the same "
                          "coefficients for every token" + (" (plus the per-token ones)" if proj else ""))
            if role == "mix" and not matrix:
                attrs["matrix"] = False
                ev.append(f"no {n} x {n} matrix: inside a layer, the streams read into its "
                          "sublayer and its output written back, by per-token weights "
                          "(hyper-connection without residual mixing)")
            elif role == "mix":
                ev.append(f"an {n} x {n} matrix mixes the streams (hyper-connection)")
                if (rounds := self._sinkhorn_rounds(recs, n)):
                    attrs["normalisation"] = "sinkhorn"
                    ev.append(f"its rows and columns normalised in turn ({rounds} divisions): "
                              "Sinkhorn iterations towards a doubly stochastic matrix")
            else:
                ev.append(f"after every carrier, no {n} x {n} matrix: the streams' final weighted sum")
            return "residual.streams", ev, attrs
        return None

    @staticmethod
    def _sinkhorn_rounds(recs: list[OpRecord], n: int) -> int:
        """How many divisions of an [.., n, n] tensor by its sums over the last dim ([.., n, 1])
        or the one before ([.., 1, n]) run, when both kinds do (rows and columns normalised in
        turn); 0 otherwise."""
        rows = cols = 0
        for r in recs:
            if r.op in ("div", "div_") and len(r.in_shapes) > 1 and r.in_shapes[0] \
                    and r.in_shapes[1] and r.in_shapes[0][-2:] == [n, n]:
                rows += r.in_shapes[1][-2:] == [n, 1]
                cols += r.in_shapes[1][-2:] == [1, n]
        return rows + cols if rows and cols else 0

    def _claim_stream_mixing(self, path: str, recs: list[OpRecord]) -> list[OpRecord]:
        """The matmuls in a stream carrier's own forward (a layer with no rule of its own) that
        multiply the n streams by an n x n matrix (or n x (n + 1)): hyper-connections and AltUp
        compute the matrix in a module of their own (a `residual.streams` mix block below the
        carrier) and may mix in the layer. Each is counted in the last mix block below ``path``
        that ran before it; the rest is returned (left unclaimed, as before)."""
        if path not in self._stream_carriers():
            return recs
        mixes = {p: min((r.index for r in self.cap.records
                         if inside(r.module, p)), default=-1)
                 for p, b in self.blocks.items() if p.startswith(path + ".")
                 and b.kind == "residual.streams" and b.attrs.get("role") == "mix"}
        if not mixes:
            return recs
        kept = []
        for r in recs:
            owner = max((p for p, at in mixes.items() if 0 <= at < r.index),
                        key=lambda p: mixes[p], default=None)
            b = self.blocks[owner] if owner is not None else None
            n, d = (b.attrs.get("streams"), b.attrs.get("stream_width")) if b else (None, None)
            shapes = [s for s in r.in_shapes[:2] if s]
            if b is None or r.module != path or not is_matmul(r.op) or r.params \
                    or len(shapes) != 2 or not any(
                        tuple(s[-2:]) in _mixing_shapes(n)
                        and n in (o := shapes[1 - i]) and d in o for i, s in enumerate(shapes)):
                kept.append(r)
                continue
            hist = Counter(b.op_histogram)
            hist[r.op] += 1
            b.op_histogram = dict(sorted(hist.items()))
            flops, nbytes = estimate_cost([r])
            b.flops += flops
            b.bytes += nbytes
            note = f"the streams mixed by its matrix in {path}'s own forward: counted here"
            if note not in b.evidence:
                b.evidence.append(note)
        return kept

    def _claim_input_gates(self, path: str, recs: list[OpRecord]) -> list[OpRecord]:
        """A second input of the module gated into its residual (Gemma 3n's per-layer input: each
        layer is handed an embedding of its own, P wide): in the module's own forward, past
        views, a child projection D -> P, an activation (not a sigmoid: a sigmoid product is a
        gate on the tensor, as on an attention's output), a product with a tensor of that shape
        (the module has an input P wide beside its first), and a child projection P -> D. The
        four ops become one `residual.input_gate` block named after the first projection's
        module (each projection a single linear: no rule of its own sees them together), split
        out before the module's own rules run (they would read the two projections and the
        activation as an MLP); the rest is returned."""
        io = self.cap.module_io.get(path)
        widths = {t.shape[-1] for t in (io[0][1:] if io else []) if t.shape}
        if not widths:
            return recs
        ops = [r for r in recs if r.op not in VIEW_OPS]
        taken: set[int] = set()
        for i in range(len(ops) - 3):
            l1, act, mul, l2 = ops[i:i + 4]
            if not (is_matmul(l1.op) and is_matmul(l2.op)):
                continue
            d1, d2 = _linear_dims(l1, self.ctx), _linear_dims(l2, self.ctx)
            # the widths, not whole shapes: a dispatch capture's mm runs on [B*T, D] views
            out = l1.out_shapes[0][-1:] if l1.out_shapes and l1.out_shapes[0] else None
            if not (self._weight_2d(l1)
                    and self._weight_2d(l2) and d1 and d2 and d1[1] in widths
                    and d2 == (d1[1], d1[0]) and d1[0] != d1[1]
                    and l1.module != l2.module and path not in (l1.module, l2.module)
                    and all(m.rsplit(".", 1)[0] == path and not self.ctx.children.get(m)
                            for m in (l1.module, l2.module))
                    and ACTIVATIONS.get(act.op, "sigmoid") != "sigmoid"
                    and act.out_shapes and act.out_shapes[0][-1:] == out
                    and mul.op in ("mul", "mul_", "multiply") and len(mul.in_shapes) > 1
                    and mul.in_shapes[0] and mul.in_shapes[0] == mul.in_shapes[1]
                    and mul.in_shapes[0][-1:] == out):
                continue
            d, p = d1
            name = _expert_activation([act]) or ACTIVATIONS[act.op]  # gelu's tanh form named
            self._add(l1.module, "residual.input_gate", [
                f"a projection {d} -> {p} ({l1.module}), {name}, times a tensor of that shape: "
                f"{path} is handed an input {p} wide beside its first",
                f"then a projection {p} -> {d} ({l2.module}): the gated input goes back to the "
                "residual width"], {"hidden": d, "input_width": p, "activation": name,
                                    "projection": l2.module}, [l1, act, mul, l2])
            if (o := self.cap.module_io.get(l2.module)) and o[1]:
                self.blocks[l1.module].outputs = list(o[1])
            taken.update(r.index for r in (l1, act, mul, l2))
        return [r for r in recs if r.index not in taken] if taken else recs

    def _stream_projections(self, path: str, recs: list[OpRecord], mm: list[OpRecord]
                            ) -> tuple[str, list[str], dict[str, Any]] | None:
        """n-1 width-preserving projections, one per child module, no activation, run before
        every module that carries n residual streams (they make streams 1..n-1 from the
        embedding: role "expand") or after them all (they fold those streams back: "collapse")."""
        if not mm or any(r.op in ACTIVATIONS for r in recs) \
                or not all(self._weight_2d(r) for r in mm):
            return None
        mods = {r.module for r in mm}
        if len(mods) != len(mm) or path in mods or not all(
                m.rsplit(".", 1)[0] == path for m in mods):
            return None
        dims = {_linear_dims(r, self.ctx) for r in mm}
        carriers = self._stream_carriers()
        if len(dims) != 1 or not carriers:
            return None
        d_in, d_out = dims.pop() or (None, None)
        k = len(mm)
        if any(inside(path, p) for p in carriers) or d_in != d_out \
                or any(sh[-1] != d_in for _, _, _, sh in carriers.values()) \
                or not all(k + 1 in c for c, _, _, _ in carriers.values()):
            return None
        first = min(a for _, a, _, _ in carriers.values())
        last = max(b for _, _, b, _ in carriers.values())
        lo, hi = min(r.index for r in recs), max(r.index for r in recs)
        role = "expand" if hi < first else "collapse" if lo > last else None
        if role is None:
            return None
        return "residual.streams", [
            f"{k} projections {d_in} -> {d_in}, one per child, no activation",
            f"{'before' if role == 'expand' else 'after'} every module that carries {k + 1} "
            f"residual streams: they {'make streams 1..' + str(k) if role == 'expand' else 'fold streams 1..' + str(k) + ' back'}"
        ], {"role": role, "streams": k + 1, "stream_width": d_in}
