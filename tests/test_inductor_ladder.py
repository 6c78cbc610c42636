"""The Inductor fallback's compile ladder (onboarding.generate.inductor): a graph Inductor cannot
compile is retried with the safe configuration, then compiled regionally with the failing nodes
bisected down and left eager, what ran where recorded. Inductor itself is replaced by a stand-in
that fails on chosen ops (the real failures were on the H200: docs/LOG.md), so these tests need
no compiler; `onboard bench --blocks` is checked for its refusals."""

from __future__ import annotations

import pytest
import torch

from onboarding.generate import inductor as I


class _Mixer(torch.nn.Module):
    """A projection, a causal cumsum and a gate: the cumsum is the op the stand-in refuses."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.inp = torch.nn.Linear(d, d)
        self.gate = torch.nn.Linear(d, d)

    def forward(self, x):
        v = self.inp(x)
        c = torch.cumsum(v, dim=1) / torch.arange(1, x.shape[1] + 1, dtype=x.dtype)[:, None]
        return c * torch.sigmoid(self.gate(x)) + v


class _StandIn(I.LadderBackend):
    """Compiles by returning the graph itself (eager); raises where Inductor failed: on any
    graph holding a refused op at a refused rung. Records every call."""

    def __init__(self, refuse=("cumsum",), at=I.RUNGS, **kw):
        super().__init__(**kw)
        self.refuse, self.at, self.calls = refuse, at, []

    def compile_graph(self, gm, inputs, rung):
        import torch._inductor.config as icfg
        from torch._inductor.virtualized import V

        with I._config_patch(rung):
            self.calls.append({"rung": rung, "nodes": [n.name for n in gm.graph.nodes
                                                       if n.op == "call_function"],
                               "split_reductions": icfg.split_reductions,
                               "split": V.choices.reduction_split_factor(None, 1 << 20, 1, True)
                               if rung != "default" else None})
        ops = {getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes
               if n.op == "call_function"}
        if rung in self.at and ops & set(self.refuse):
            raise RuntimeError("codegen for the chunked cumsum failed (stand-in)")
        return gm.forward


def _run(backend, x):
    m = _Mixer()
    torch.manual_seed(0)
    for p in m.parameters():
        torch.nn.init.normal_(p)
    ref_x = x.clone().requires_grad_(True)
    ref = m(ref_x)
    ref.backward(torch.ones_like(ref))
    got_x = x.clone().requires_grad_(True)
    torch._dynamo.reset()
    got = torch.compile(m.forward, backend=backend, dynamic=False)(got_x)
    got.backward(torch.ones_like(got))
    assert torch.allclose(got, ref) and torch.allclose(got_x.grad, ref_x.grad)
    return backend.graphs


def test_failing_node_left_eager_the_rest_compiled():
    b = _StandIn()
    (g,) = _run(b, torch.randn(2, 6, 8))
    assert [f["rung"] for f in g["failures"]] == ["default", "safe"]
    assert "chunked cumsum failed" in g["failures"][0]["traceback"]
    assert g["rung"] == "regional" and g["regions"] >= 2
    assert g["eager_nodes"] == ["cumsum"]
    (where,) = g["eager"]  # the op and its source line in the block's code
    line = next(i for i, ln in enumerate(open(__file__), 1) if "c = torch.cumsum(v" in ln)
    assert where == f"call_function:cumsum @ test_inductor_ladder.py:{line}"
    assert g["compiled_nodes"] == g["nodes"] - 1
    # the safe rung really ran without split reductions or split scans
    safe = next(c for c in b.calls if c["rung"] == "safe")
    assert safe["split_reductions"] is False and safe["split"] == 1
    assert b.calls[0]["split"] is None
    s = I.ladder_summary(b.graphs)
    assert "compiled in" in s and "eager: call_function:cumsum" in s and "safe failed" in s
    assert I.furthest_rung(b.graphs) == "regional"


def test_nodes_named_in_inductors_error_left_eager_first():
    """Inductor names the origins of the buffer it could not generate: those nodes go eager at
    once and the runs around them compile (two compiles, no search)."""
    class Named(_StandIn):
        def compile_graph(self, gm, inputs, rung):
            try:
                return super().compile_graph(gm, inputs, rung)
            except RuntimeError as exc:
                raise RuntimeError("Error in codegen for ComputedBuffer(name='buf3', data=SplitScan("
                                   "origin_node=cumsum, origins=OrderedSet([cumsum]))") from exc

    b = Named()
    (g,) = _run(b, torch.randn(2, 6, 8))
    assert g["hinted"] == ["cumsum"] and g["eager_nodes"] == ["cumsum"] and g["tries"] == 2
    assert g["eager_why"] == [{"nodes": [g["eager"][0]], "why": "named in Inductor's error"}]


def test_safe_rung_serves_when_only_the_defaults_fail():
    (g,) = _run(_StandIn(at=("default",)), torch.randn(1, 5, 8))
    assert g["rung"] == "safe" and [f["rung"] for f in g["failures"]] == ["default"]


def test_known_eager_nodes_skip_the_search():
    """Alignment's swap starts where the check ended: the known failing node eager at once,
    the runs around it compiled whole (two compiles, no bisection)."""
    b = _StandIn(start="regional", eager=["cumsum"])
    (g,) = _run(b, torch.randn(2, 6, 8))
    assert g["failures"] == [] and g["eager_nodes"] == ["cumsum"]
    assert len(b.calls) == g["tries"] == 2


def test_every_rung_failing_raises_with_each_reason():
    b = _StandIn(refuse=("cumsum", "linear", "sigmoid", "truediv", "mul", "add", "arange"),
                 max_tries=6)
    with pytest.raises(Exception, match="at every rung"):
        _run(b, torch.randn(1, 4, 8))
    assert [f["rung"] for f in b.graphs[0]["failures"]] == list(I.RUNGS)


def test_ladder_kwargs_from_the_checks_verdict(tmp_path):
    import json

    (tmp_path / "verdict.json").write_text(json.dumps({"artifacts": {
        "fp32": {"ladder": [{"rung": "default"}, {"rung": "regional", "eager_nodes": ["cumsum"]}]},
        "bf16": {"ladder": [{"rung": "safe"}]}}}))
    assert I.ladder_kwargs(tmp_path) == {"start": "regional", "eager": ["cumsum"]}
    assert I.ladder_kwargs(tmp_path / "missing") == {}
    with pytest.raises(ValueError, match="inductor rung 'fast'"):
        I.LadderBackend(start="fast")


def test_bench_blocks_model_at_paths():
    from onboarding.bench.blocks import split_ref

    assert split_ref("hf:mamba2@backbone.layers.0.mixer") == ("hf:mamba2",
                                                              ["backbone.layers.0.mixer"])
    assert split_ref("hf:xlstm") == ("hf:xlstm", [])
    assert split_ref("runs/a@b/run") == ("runs/a@b/run", [])  # a folder name, not a block
    assert split_ref("m.py:LM@layers.0.mixer, layers.1.mixer") == (
        "m.py:LM", ["layers.0.mixer", "layers.1.mixer"])


@pytest.mark.parametrize("argv, why", [
    (["--blocks", "hf:xlstm", "--family", "rmsnorm"], "--family: not with --blocks"),
    (["--blocks", "hf:xlstm", "--suite", "nightly"], "--blocks: not with --suite nightly"),
    (["--blocks", "hf:xlstm", "--seq", "0"], "--seq 0: must be >= 1"),
])
def test_bench_blocks_refusals(argv, why, capsys):
    from onboarding.cli.main import main

    assert main(["bench", *argv]) == 2
    assert why in capsys.readouterr().err
