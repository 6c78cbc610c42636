"""Coverage says what patching will do for the attention families: a block `onboard map` marks
as served by sink_attention or sparse_attention (template or reviewed kernel) is one their
bindings take, and a block their bindings refuse is not marked so (its entry says why and what
runs instead). The decision is the bindings' own acceptance test, run on what the parse stage
recorded (`onboarding.patching.probe`, the top-k's input in attrs ``topk_inputs``)."""

from __future__ import annotations

import importlib

import pytest
import torch

from onboarding.coverage import build_coverage
from onboarding.families import families, family_module
from onboarding.generate.templating import load_module, render_to
from onboarding.graph.parse import example_inputs, load_stage
from onboarding.load.model import load_model
from onboarding.patching.core import patch_model

FIX = "tests/fixtures/coverage_binding_models.py"
INTERFACE, BIASED = f"{FIX}:InterfaceLM", f"{FIX}:BiasedInterfaceLM"
TOPK, ROW_TOPK = f"{FIX}:TopkSparseLM", f"{FIX}:RowTopkSparseLM"
SINK_TOPK = f"{FIX}:SinkTopkSparseLM"
SHIFTED_SINK_TOPK, ROW_SINK_TOPK = f"{FIX}:ShiftedSinkTopkSparseLM", f"{FIX}:RowSinkTopkSparseLM"
SOFTCAP, INLINE_CAP = f"{FIX}:SoftcapInterfaceLM", f"{FIX}:InlineCapInterfaceLM"
INLINE = "tests/fixtures/handwritten.py:VocabWideLM"
ATTENTION = ("sink_attention", "sparse_attention")
SEQ = 16  # the patched forward runs the kernels in the Triton interpreter
REFUSED = "its binding would leave this block unpatched"


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kernels")


def _attention_entries(graph):
    """Coverage's entries for the attention blocks' cores, by path."""
    cores = ("attention core", "sparse_attention", "indexer + top-k + gathered attention")
    return {e.path: e for e in build_coverage(graph).entries
            if e.op in cores and (e.family in (None, *ATTENTION))}


def test_inline_core_is_not_claimed(parse_model):
    """A core written inline in the block's forward (no function of the attention interface to
    swap): sink_attention's binding rejects it, so coverage leaves it uncovered and says why.
    Before: "template sink_attention/attention", then "patch rejected ... its core runs inline"."""
    g = parse_model(INLINE)
    for path in ("layers.0.attn", "layers.1.attn", "layers.2.attn"):
        e = _attention_entries(g)[path]
        assert e.status == "uncovered" and e.family is None, e
        assert "O(T^2)" in e.reason and REFUSED in e.reason and "its core runs inline" in e.reason, e.reason
        calls = next(b for b in g.blocks if b.path == path).attrs["core_calls"]["attention-core"]
        assert calls == {"reachable": [], "calls": []}


def test_extra_interface_argument_is_not_claimed(parse_model):
    """The attention interface handed a tensor the kernel does not take (Inkling 2's
    position_bias): the binding keeps the original function, coverage says so; the same
    interface without it stays the family's template, its call recorded with the sink and
    window the binding reads."""
    for path, e in _attention_entries(parse_model(BIASED)).items():
        assert e.status == "uncovered", e
        assert REFUSED in e.reason and "arguments the kernel does not take: ['position_bias']" in e.reason
    g = parse_model(INTERFACE)
    entries = _attention_entries(g)
    assert {e.status for e in entries.values()} == {"template"} and len(entries) == 2
    found = g.blocks[[b.path for b in g.blocks].index("layers.0.attn")].attrs["core_calls"]["attention-core"]
    assert found["reachable"] == ["global attend"] and len(found["calls"]) == 1
    call = found["calls"][0]
    assert call["args"]["query"] == {"tensor": [1, 4, g.seq, 8], "dtype": "float32"}
    assert call["args"]["position_bias"] is None and call["kwargs"]["sliding_window"] == 8


def test_softcap_is_read_from_the_call(parse_model):
    """A core whose scores pass through a tanh (a logit soft-cap) is marked so at parse
    (``unfused_core["softcap"]``); handed its cap as the interface's ``softcap`` it is the family's
    template, the cap in its recorded call; with the cap written into the function (no argument
    to read it from) the binding would keep the original function, and coverage says why. A core
    without a tanh carries no mark."""
    g = parse_model(SOFTCAP)
    entries = _attention_entries(g)
    assert {e.status for e in entries.values()} == {"template"} and len(entries) == 2
    assert all("soft-capped" in e.reason for e in entries.values()), entries
    for b in g.blocks:
        if b.path in entries:
            assert b.attrs["unfused_core"]["softcap"] is True
            assert b.attrs["core_calls"]["attention-core"]["calls"][0]["args"]["softcap"] == 2.0
    g = parse_model(INLINE_CAP)
    entries = _attention_entries(g)
    assert len(entries) == 2 and {e.status for e in entries.values()} == {"uncovered"}
    assert all(REFUSED in e.reason and "names no softcap" in e.reason for e in entries.values()), entries
    assert all("softcap" not in b.attrs.get("unfused_core", {}) for b in parse_model(INTERFACE).blocks)


def test_row_topk_selection_is_not_claimed(parse_model):
    """A selection taken per batch entry over a [T, S] score matrix (Kolibri 1.1's weightless
    indexer): the sparse intercept reads only a top-k over a [B, T, S] tensor, so the binding
    finds no selection; coverage says so. The [B, T, S] form stays served."""
    g = parse_model(ROW_TOPK)
    for b in g.by_kind("sparse_attention.topk"):
        assert b.attrs["topk_inputs"] == [{"shape": [g.seq, g.seq], "dtype": "float32", "dim": -1,
                                           "largest": True}] * g.batch
    entries = _attention_entries(g)
    assert len(entries) == 2 and {e.status for e in entries.values()} == {"uncovered"}
    assert all(REFUSED in e.reason and "[B, T, S]" in e.reason for e in entries.values())
    served = [e for e in build_coverage(parse_model(TOPK)).entries if e.family == "sparse_attention"]
    assert len(served) == 4 and {e.status for e in served} <= {"kernel", "template"}


def test_topk_selection_over_a_sink_softmax_is_not_claimed(parse_model):
    """A [B, T, S] top-k whose selection masks an eager attention with a sink column appended
    to its scores (HY V4's layers 0 and 1): the intercept follows no q k^T -> softmax -> v chain
    there, so the binding finds nothing to replace ("no attention ... over the top-k positions").
    Coverage said template sparse_attention/gathered; the probe (`binding.SPARSE`) records what
    the intercept finds and coverage says why it is uncovered."""
    g = parse_model(SINK_TOPK)
    blocks = g.by_kind("sparse_attention.topk")
    assert len(blocks) == 2, [(b.path, b.kind) for b in g.blocks]
    assert all(b.attrs["core_calls"]["sparse-attention"] == {"attention": []} for b in blocks)
    entries = _attention_entries(g)
    assert len(entries) == 2 and {e.status for e in entries.values()} == {"uncovered"}, entries
    assert all(REFUSED in e.reason and "no attention" in e.reason for e in entries.values())
    served = [b for b in parse_model(TOPK).by_kind("sparse_attention.topk")]
    assert all(len(b.attrs["core_calls"]["sparse-attention"]["attention"]) == 1 for b in served)


def test_topk_selection_over_a_per_head_sink_column_is_claimed(parse_model):
    """HY V4's eager attention over the top-k positions (a per-head sink logit appended to the
    scores, the row max subtracted, softmax, the column dropped, ``@ v``): the intercept follows
    it and hands the sinks to the gathered kernel, so coverage serves it, the probe recording the
    call with its sink. Before: uncovered, "no attention ... over the top-k positions". A sink
    column computed per token is not the kernel's per-head sink: uncovered, and the reason says
    so."""
    g = parse_model(SHIFTED_SINK_TOPK)
    blocks = g.by_kind("sparse_attention.topk")
    assert len(blocks) == 2, [(b.path, b.kind) for b in g.blocks]
    for b in blocks:
        (call,) = b.attrs["core_calls"]["sparse-attention"]["attention"]
        assert call["sink"] is True and call["q"][1] == 4 and call["q"][-1] == 8, call
    entries = _attention_entries(g)
    assert len(entries) == 2 and {e.status for e in entries.values()} <= {"template", "kernel"}, entries
    refused = _attention_entries(parse_model(ROW_SINK_TOPK))
    assert len(refused) == 2 and {e.status for e in refused.values()} == {"uncovered"}, refused
    assert all(REFUSED in e.reason and "not one logit per head" in e.reason for e in refused.values())


def _forced(block) -> list[tuple[str, str, dict]]:
    """(family, variant, params) the attention families would render for ``block`` were they to
    claim it anyway (their kind tests alone)."""
    sink, sparse = family_module("sink_attention"), family_module("sparse_attention")
    out = []
    if block.kind in sink.KINDS and block.attrs.get("unfused_core") is not None:
        m = sink.FAMILY.served("attention", {})
        out.append(("sink_attention", m["variant"], m["params"]))
    out += [("sparse_attention", m["variant"], m["params"]) for m in sparse.match_all(block)]
    return out


@pytest.mark.parametrize("ref", [INTERFACE, BIASED, SOFTCAP, INLINE_CAP, TOPK, ROW_TOPK, SINK_TOPK,
                                 SHIFTED_SINK_TOPK, ROW_SINK_TOPK, INLINE])
def test_coverage_predicts_the_bindings(ref, parse_model, kernel_dir):
    """Every attention block coverage serves by a template or reviewed kernel is taken by its
    binding on the patched proxy's first forward; every block coverage says the binding would
    leave is rejected by it when its kernel is bound anyway."""
    graph = parse_model(ref)
    entries = _attention_entries(graph)
    claimed = {p for p, e in entries.items() if e.status in ("template", "kernel")}
    refused = {p for p, e in entries.items() if e.status == "uncovered" and REFUSED in e.reason}
    assert claimed or refused
    blocks = {b.path: b for b in graph.blocks}
    kernels = {}
    for path in sorted(claimed | refused):
        for family, variant, params in _forced(blocks[path]):
            mod = load_module(render_to(kernel_dir, family, variant, params, overwrite=True))
            key = (path, family)
            kernels[key if key not in kernels else (path, f"{family}:{variant}")] = mod
    info = load_stage(load_model(ref, trust_remote_code=True))
    model = info.loaded.build(info.proxy_config, seed=0).eval()
    inputs, kwargs = example_inputs(model, info.proxy_config, 1, SEQ, 0)
    with patch_model(model, graph, kernels) as patches, torch.no_grad():
        model(*inputs, **kwargs)
        status = {r.path: (r.status, r.detail) for r in patches.records}
    assert all(families()[f.partition(":")[0]].binding is not None for _, f in kernels)
    for path in claimed:
        assert status[path][0] in ("active", "dense_by_shape"), (path, status[path])
    for path in refused:
        assert status[path][0] == "rejected", (path, status[path])


def test_family_without_binding_says_nothing_patches_it(monkeypatch):
    """A family with no patch binding (rope had none until its binding: the built-in example's
    one coverable block that alignment never checked; here its spec without it): coverage keeps
    its kernel entry and says the model keeps its own code; a family with a binding says nothing
    of the kind, rope's own now included."""
    import dataclasses

    import onboarding.coverage as coverage
    from onboarding.graph.opgraph import Block, OpGraph

    blocks = [Block(path="rotary", kind="rope", layer=None, class_name="", attrs={"layout": "half"}),
              Block(path="norm", kind="norm.rms", layer=None, class_name="", attrs={"eps": 1e-6})]
    graph = OpGraph(model="m", capture="export", capture_note="", batch=1, seq=8, dtype="float32",
                    blocks=blocks, layer_pattern="", layer_kinds=[], param_counts={}, total_flops=0)
    bound = {e.path: e for e in build_coverage(graph).entries if e.family}
    assert families()["rope"].binding is not None
    assert bound["rotary"].family == "rope" and "no patch binding" not in bound["rotary"].reason
    real = coverage.get_family
    monkeypatch.setattr(coverage, "get_family", lambda name: dataclasses.replace(
        real(name), binding=None) if name == "rope" else real(name))
    entries = {e.path: e for e in build_coverage(graph).entries if e.family}
    assert coverage.get_family("rope").binding is None and families()["rmsnorm"].binding is not None
    assert entries["rotary"].family == "rope" and "no patch binding" in entries["rotary"].reason
    assert entries["norm"].family == "rmsnorm" and "no patch binding" not in entries["norm"].reason


def test_sink_refusal_reads_the_recorded_calls_as_the_swap_reads_its_arguments():
    """`binding.refusal` on hand-written records: a sink handed as an argument (gpt-oss's s_aux)
    with its window is taken; a second tensor or a 3-D query is refused with the swap's own
    reason; a function found but never called as a core says so. The soft-cap: a positive number
    as the call's ``softcap`` is taken (named or in ``**kwargs``); a core whose scores pass
    through a tanh (``capped``) is refused without one the kernel can read, and an uncapped core
    handed one as a named parameter is refused (the kernel would cap what the core does not)."""
    family = family_module("sink_attention")
    binding = importlib.import_module(family.__package__ + ".binding")

    def call(extra_named=None, query=(1, 4, 8, 16), **kwargs):
        args = {"module": {"module": "Attn"}, "query": {"tensor": list(query), "dtype": "float32"},
                "key": {"tensor": [1, 2, 8, 16], "dtype": "float32"},
                "value": {"tensor": [1, 2, 8, 16], "dtype": "float32"},
                "attention_mask": {"tensor": [1, 1, 8, 8], "dtype": "float32"},
                "scaling": 0.25, "dropout": 0.0, **(extra_named or {})}
        return {"function": "global attend", "args": args, "kwargs": kwargs}

    sink = {"tensor": [4], "dtype": "float32"}
    take = {"reachable": ["global attend"], "calls": [call(s_aux=sink, sliding_window=4)]}
    assert binding.refusal(take, {}) is None
    assert binding.refusal({"reachable": ["global attend"], "calls": [call({"s_aux": sink})]}, {}) is None
    bias = {"reachable": ["global attend"], "calls": [call({"bias": {"tensor": [4, 8, 8], "dtype": "float32"}})]}
    assert binding.refusal(bias, {"sinks": 4}) == \
        "global attend: TypeError: arguments the kernel does not take: ['bias']"
    capped = {"reachable": ["global attend"], "calls": [call({"softcap": 30.0})]}
    assert binding.refusal(capped, {}) is None and binding.refusal(capped, {}, capped=True) is None
    assert binding.refusal({"reachable": ["g"], "calls": [call(softcap=30.0)]}, {}, capped=True) is None
    assert "['softcap']" in binding.refusal(capped, {}, capped=False)
    for none in ({}, {"softcap": None}, {"softcap": 0.0}):  # no cap to read: an uncapped core takes it
        assert binding.refusal({"reachable": ["global attend"], "calls": [call(none)]}, {}, capped=True) == \
            f"global attend: TypeError: {binding.CAPPED_UNREAD}"
        assert binding.refusal({"reachable": ["global attend"], "calls": [call(none)]}, {}, capped=False) is None
    for bad in (-1.0, float("inf"), {"tensor": [4], "dtype": "float32"}, True):
        why = binding.refusal({"reachable": ["global attend"], "calls": [call({"softcap": bad})]}, {}, capped=True)
        assert why.startswith("global attend: TypeError: softcap ") and "positive finite" in why, (bad, why)
    # the cap the readings take is the call's, first; without the graph's word, none after it
    caps = [r[3] for r in binding.readings(call({"softcap": 30.0})["args"], {}, {})]
    assert caps[0] == 30.0 and caps[-1] == 0.0 and set(caps) == {30.0, 0.0}
    assert {r[3] for r in binding.readings(call({"softcap": 30.0})["args"], {}, {}, capped=True)} == {30.0}
    assert {r[3] for r in binding.readings(call({"softcap": 30.0})["args"], {}, {}, capped=False)} == {0.0}
    assert binding.refusal({"reachable": ["global attend"], "calls": [call(query=(1, 8, 16))]}, {}) == \
        "global attend: TypeError: query, key and value are not [B, H, T, D] tensors"
    assert binding.refusal({"reachable": ["global attend"], "calls": []}, {}) == "no attention-core call matched"
    assert binding.refusal({"reachable": [], "calls": []}, {}) == binding.NONE_FOUND
    # the window the reading takes is the call's sliding_window, any other integer is refused
    assert binding.readings(call()["args"], {"sliding_window": 4}, {"sinks": 4})[0] == \
        (("param", "sinks"), True, 4, 0.0)
    assert "['chunk']" in binding.refusal({"reachable": ["x"], "calls": [call({"chunk": 4})]}, {})
