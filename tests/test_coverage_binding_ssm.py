"""Coverage says what patching will do for the Mamba-style scan families: a mixer `onboard map`
marks as served by ssd or selective_scan (template or reviewed kernel) is one their call-swap
bindings take, and a mixer their bindings refuse is not marked so (its entry says why and what
runs instead). The decision is the bindings' own acceptance test (`binding.unknown_arguments`,
`callswap.recorded_refusal`), run on what the parse stage recorded of the mixers' scan calls
(`onboarding.patching.probe`, the families' `probe`)."""

from __future__ import annotations

import importlib

import pytest
import torch

from onboarding.coverage import build_coverage
from onboarding.families import family_module
from onboarding.generate.templating import load_module, render_to
from onboarding.graph.parse import example_inputs, load_stage
from onboarding.load.model import load_model
from onboarding.patching.core import patch_model

FIX = "tests/fixtures/coverage_binding_ssm_models.py"
CHUNK, SCALED_CHUNK = f"{FIX}:ChunkScanLM", f"{FIX}:ScaledChunkScanLM"
SELECTIVE = "tests/fixtures/user_models.py:SelectiveScanLM"
SCALED_SELECTIVE, INLINE_SELECTIVE = f"{FIX}:ScaledSelectiveScanLM", f"{FIX}:InlineSelectiveScanLM"
SCANS = ("ssd", "selective_scan")
SEQ = 16  # parse and the patched forward (the kernels run in the Triton interpreter)
MIXERS = ("mixers.0", "mixers.1")
REFUSED = "its binding would leave this block unpatched"
CORE = "selective state-space scan"  # coverage's name for a mamba block's core (CORE_OPS)


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kernels")


def _graph(parse_model, ref):
    return parse_model(ref, seq=SEQ)


def _scan_entries(graph):
    """Coverage's entries for the mixers' scan cores, by path: a scan family's, or the uncovered
    core."""
    return {e.path: e for e in build_coverage(graph).entries
            if e.path in MIXERS and (e.family in SCANS or e.op == CORE)}


@pytest.mark.parametrize("ref,family,why", [
    (SCALED_CHUNK, "ssd", "global chunk_scan: TypeError: arguments the kernel does not take: ['step_scale']"),
    (SCALED_SELECTIVE, "selective_scan",
     "global scaled_ssm_scan: TypeError: arguments the kernel does not take: ['u_scale']"),
    (INLINE_SELECTIVE, "selective_scan", "its scan runs inline"),
])
def test_refused_scan_is_not_claimed(ref, family, why, parse_model):
    """A scan function handed an input the kernel does not take (a per-head step scale, a
    per-channel input scale), or a scan written inline in the mixer's forward: the binding
    leaves the mixer unpatched, so coverage leaves its core uncovered and says why. Before:
    "template ssd/scan" / "template selective_scan/scan", then "patch rejected"."""
    entries = _scan_entries(_graph(parse_model, ref))
    assert set(entries) == set(MIXERS)
    for e in entries.values():
        assert e.status == "uncovered" and e.family is None and e.op == CORE, e
        assert f"{family} serves this kind but {REFUSED}" in e.reason and why in e.reason, e.reason


@pytest.mark.parametrize("ref,family", [(CHUNK, "ssd"), (SELECTIVE, "selective_scan")])
def test_accepted_scan_stays_claimed(ref, family, parse_model):
    """The same mixers handing the scan function only what the kernel takes stay the family's
    template, the call recorded as the swap binds it."""
    g = _graph(parse_model, ref)
    entries = _scan_entries(g)
    assert {(e.status, e.family) for e in entries.values()} == {("template", family)} and len(entries) == 2
    what = family_module(family).FAMILY.probe.what
    found = next(b for b in g.blocks if b.path == "mixers.0").attrs["core_calls"][what]
    assert len(found["calls"]) == 1 and found["calls"][0]["function"] in found["reachable"]


@pytest.mark.parametrize("ref", [CHUNK, SCALED_CHUNK, SELECTIVE, SCALED_SELECTIVE, INLINE_SELECTIVE])
def test_coverage_predicts_the_bindings(ref, parse_model, kernel_dir):
    """Every mixer coverage serves by ssd or selective_scan is taken by the binding on the
    patched proxy's first forward; every mixer coverage says the binding would leave is rejected
    by it when the family's kernel is bound anyway."""
    graph = _graph(parse_model, ref)
    entries = _scan_entries(graph)
    claimed = {p: e.family for p, e in entries.items() if e.status in ("template", "kernel")}
    refused = {p: next(f for f in SCANS if f"{f} serves this kind" in e.reason)
               for p, e in entries.items() if e.status == "uncovered" and REFUSED in e.reason}
    assert claimed or refused
    kernels = {}
    for path, family in {**claimed, **refused}.items():
        spec = family_module(family).FAMILY
        m = spec.served("scan", {"chunk_size": 8} if family == "ssd" else {})
        kernels[(path, family)] = load_module(render_to(kernel_dir, family, m["variant"], m["params"],
                                                        overwrite=True))
    info = load_stage(load_model(ref, trust_remote_code=True))
    model = info.loaded.build(info.proxy_config, seed=0).eval()
    inputs, kwargs = example_inputs(model, info.proxy_config, 1, SEQ, 0)
    with patch_model(model, graph, kernels) as patches, torch.no_grad():
        model(*inputs, **kwargs)
        status = {r.path: (r.status, r.detail) for r in patches.records}
    for path in claimed:
        assert status[path][0] == "active", (path, status[path])
    for path in refused:
        assert status[path][0] == "rejected", (path, status[path])
        assert status[path][1] in entries[path].reason, (status[path], entries[path].reason)


def test_scan_refusals_read_the_recorded_calls_as_the_swaps_read_their_arguments():
    """`binding.refusal` on hand-written records: ssd reads only the arguments a call passed
    (one left at a set default is not the call's: the swap binds without defaults), its
    interface's keywords are taken, anything else set is refused; selective_scan reads the
    arguments with their defaults, bools pass, a tensor or number past the interface is refused;
    a function found but never called as a core, or none found, says what `install` says."""
    ssd = importlib.import_module(family_module("ssd").__package__ + ".binding")
    sel = importlib.import_module(family_module("selective_scan").__package__ + ".binding")
    t = {"tensor": [1, 8, 2, 4], "dtype": "float32"}

    def call(args, kwargs=None, defaulted=()):
        return {"function": "global scan", "args": args, "kwargs": kwargs or {}, "defaulted": list(defaulted)}

    five = {n: t for n in ("x", "dt", "A", "B", "C")}
    found = lambda *calls: {"reachable": ["global scan"], "calls": list(calls)}  # noqa: E731
    assert ssd.refusal(found(call({**five, "chunk_size": 8, "D": t, "dt_limit": [0.0, 1.0], "z": None}))) is None
    assert ssd.refusal(found(call({**five, "chunk_size": 8, "scale": 2.0}, defaulted=["scale"]))) is None
    assert ssd.refusal(found(call({**five, "z": t}, {"seq_idx": t}))) == \
        "global scan: TypeError: arguments the kernel does not take: ['z', 'seq_idx']"
    assert ssd.refusal(found(call({"x": t, "dt": t, "A": t, "B": t, "C": None}, defaulted=["C"]))) == \
        "global scan: TypeError: fewer than five arguments"
    assert ssd.refusal(found()) == "no chunked-scan call matched"
    assert ssd.refusal({"reachable": [], "calls": []}) == ssd.NONE_FOUND
    assert ssd.refusal(found({"function": "global scan", "error": "TypeError: got an unexpected keyword"})) == \
        "global scan: TypeError: got an unexpected keyword"
    tail = {"u": t, "delta": t, "A": t, "B": t, "C": t, "D": t, "z": None, "delta_bias": t,
            "delta_softplus": True, "return_last_state": False}
    assert sel.refusal(found(call({**tail, "initial_state": t, "use_fast": True}))) is None
    assert sel.refusal(found(call({**tail, "u_scale": t}, {"algo": "cumsum"}))) == \
        "global scan: TypeError: arguments the kernel does not take: ['u_scale', 'algo']"
    assert sel.refusal(found(call({**tail, "steps": 4}, defaulted=["steps"]))) == \
        "global scan: TypeError: arguments the kernel does not take: ['steps']"
    assert sel.refusal({"reachable": [], "calls": []}) == sel.NONE_FOUND
    # one call taken among refused ones: the swap of that function binds
    assert sel.refusal(found(call({**tail, "u_scale": t}), call(tail))) is None
