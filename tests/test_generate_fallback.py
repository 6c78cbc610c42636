"""Kernel tasks for uncovered blocks, the block check, the Inductor fallback and the decision loop
(`onboarding.generate`), on a tiny hand-written model whose mixers no family serves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from onboarding.coverage import build_coverage
from onboarding.graph.opgraph import Block, TensorMeta
from onboarding.load.spec import ModelSpec

FIXTURES = Path(__file__).resolve().parent / "fixtures"
CUM = f"{FIXTURES / 'uncovered_models.py'}:CumLM"


@pytest.fixture(scope="module")
def cum_graph(parse_model):
    return parse_model(CUM, seq=16)


def test_tasks_of_the_uncovered_mixers(cum_graph):
    from onboarding.generate.tasks import KernelTask, build_tasks

    cov = build_coverage(cum_graph)
    tasks = build_tasks(graph=cum_graph, coverage=cov, spec=ModelSpec(ref=CUM))
    assert [t.path for t in tasks] == ["layers.0.mixer", "layers.1.mixer"]
    t = tasks[0]
    assert t.kind == "unknown" and t.class_name == "CumMixer"
    # the class and the module-level function its forward calls, nothing of torch's
    assert "class CumMixer" in t.source and "def running_mean" in t.source
    assert [n.rsplit(".", 1)[1] for n in t.functions] == ["CumMixer", "running_mean"]
    assert t.op_histogram.get("cumsum") == 1 and t.params == {"inp.weight": [16, 16],
                                                              "out.weight": [16, 16]}
    assert t.inputs == [{"shape": [1, 16, 16], "dtype": "float32"}] == t.inputs_full
    assert "meta" in t.full_note and t.examples and t.examples_note
    assert tasks[1].key == t.key  # the same problem twice: one check serves both
    again = KernelTask.from_dict(json.loads(json.dumps(t.to_dict())))
    assert again == t
    # no spec: the structure only, and the task says what is missing
    bare = build_tasks(graph=cum_graph, coverage=cov)
    assert bare[0].source == "" and "no model spec" in bare[0].source_note
    # a block whose family failed alignment is a task too, with that reason
    failed = build_tasks(graph=cum_graph, coverage=cov,
                         failed={"layers.0.norm": "somefamily: fwd rel_rms 3e-1"})
    norm = next(t for t in failed if t.path == "layers.0.norm")
    assert norm.failed_family == "somefamily" and "fwd rel_rms" in norm.reason


def test_full_size_shapes_by_dim_map_when_meta_cannot_run():
    from onboarding.generate.tasks import dim_map, scale_shapes

    mapping, ambiguous = dim_map({"w": [8, 128]}, {"w": [16, 4096]},
                                 {"n_heads": 4, "other": 2}, {"n_heads": 32, "other": 3})
    assert mapping == {8: 16, 128: 4096, 4: 32, 2: 3} and not ambiguous
    out = scale_shapes([{"shape": [64, 128], "dtype": "float32"}], mapping, keep={1, 64})
    assert out == [{"shape": [64, 4096], "dtype": "float32"}]
    _, amb = dim_map({"a": [8], "b": [8]}, {"a": [16], "b": [32]}, None, None)
    assert amb == {8}


def test_full_size_shapes_map_the_head_dim_the_module_computes():
    """hf:minimax's lightning attention: the meta forward cannot run and the head dim
    (hidden_size / num_attention_heads) has no config field, so the full-size state and cos/sin
    kept the proxy's 32 (128 at full size). The block module's integer attributes, name by name,
    map it."""
    import types

    import torch

    from onboarding.generate.tasks import KernelTask, _full_shapes

    class Heads(torch.nn.Module):
        """Its head dim is computed from the config (no field of its own), and its forward
        reads a value (no meta forward)."""

        def __init__(self, hidden: int, heads: int):
            super().__init__()
            self.heads, self.head_dim = heads, hidden // heads
            self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)

        def forward(self, x):
            q = self.qkv(x)[..., : x.shape[-1]].unflatten(-1, (self.heads, self.head_dim))
            return torch.einsum("bthd,bthe->bhde", q, q) * x.abs().max().item()

    proxy_cfg, full_cfg = {"hidden_size": 24, "num_heads": 4}, {"hidden_size": 64, "num_heads": 8}
    with torch.device("meta"):
        proxy, full = (torch.nn.ModuleDict({"attn": Heads(c["hidden_size"], c["num_heads"])})
                       for c in (proxy_cfg, full_cfg))
    t = KernelTask(path="attn", kind="unknown", reason="", op="", params={"qkv.weight": [72, 24]},
                   inputs=[{"shape": [1, 16, 24], "dtype": "float32"}],
                   outputs=[{"shape": [1, 4, 6, 6], "dtype": "float32"}], batch=1, seq=16)
    _full_shapes(t, full, (torch.empty(1, 16, 64, device="meta"),), {}, proxy_cfg, full_cfg,
                 types.SimpleNamespace(batch=1, seq=16), proxy["attn"])
    assert "meta forward of the full-size model failed" in t.full_note and "6->8" in t.full_note
    assert t.params_full == {"qkv.weight": [192, 64]}
    assert [m["shape"] for m in t.inputs_full + t.outputs_full] == [[1, 16, 64], [1, 8, 8, 8]]


@pytest.mark.slow
def test_minimax_full_size_shapes_have_its_head_dim():
    """The prompt's full-size shapes of hf:minimax's lightning attention (no meta forward): the
    state [batch, heads, head_dim, head_dim] and cos/sin at head dim 128, not the proxy's 32."""
    from onboarding.coverage import build_coverage
    from onboarding.generate.tasks import build_tasks
    from onboarding.graph.parse import load_stage, parse_stage

    spec = ModelSpec(ref="hf:minimax")
    graph = parse_stage(load_stage(spec.load(), spec.proxy))
    (t,) = [t for t in build_tasks(graph=graph, coverage=build_coverage(graph), spec=spec)
            if t.kind == "linear_attention.other"]
    assert t.outputs[1]["shape"] == [1, 4, 32, 32]
    assert [m["shape"] for m in t.inputs_full[:3]] == [[1, 64, 4096], [1, 64, 128], [1, 64, 128]]
    assert t.outputs_full[1]["shape"] == [1, 32, 128, 128]


def test_worked_examples_by_structure():
    """A router-like block (selection, softmax, integer indices out) gets the family that serves
    routers; any block gets the simplest norm family; names come from the registry."""
    from onboarding.families import match_block
    from onboarding.generate.tasks import _prototypes, worked_examples

    router = Block(path="r", kind="unknown", layer=0, class_name="X",
                   op_histogram={"linear": 1, "softmax": 2, "max": 2, "gather": 2},
                   outputs=[TensorMeta(shape=[4, 2], dtype="int64")])
    names, why = worked_examples(router)
    protos = dict(_prototypes(router))
    assert len(names) == 2 and len(protos) == 2
    for (what, proto), name in zip(_prototypes(router), names):
        assert name in [n for n, _ in match_block(proto)] and name in why
    plain = Block(path="p", kind="unknown", layer=0, class_name="Y", op_histogram={"mm": 2})
    assert worked_examples(plain)[0] == names[-1:]


# -- the block check ---------------------------------------------------------------------------

def _running_mean(v):
    import torch

    n = torch.arange(1, v.shape[1] + 1, dtype=v.dtype)
    return torch.cumsum(v, dim=1) / n[:, None]


def _own(m):
    return m.forward


def _off(m):
    return lambda x: m.forward(x) * 1.01


def _no_param_grad(m):
    import torch

    def fwd(x):
        v = torch.nn.functional.linear(x, m.inp.weight.detach())
        return m.out(_running_mean(v) * v)
    return fwd


def _cached(m):
    """Returns the first call's output again for inputs of the same shape."""
    memo = {}

    def fwd(x):
        if x.shape not in memo:
            out = m.forward(x)
            memo[x.shape] = out.detach()
            return out
        return memo[x.shape] + 0 * x.sum()
    return fwd


def _example_shape_only(m):
    """Right at the captured length, a wrong causal mean elsewhere (a hard-coded length)."""
    import torch

    def fwd(x):
        v = m.inp(x)
        n = torch.arange(1, 17, dtype=v.dtype)[: v.shape[1]]
        mean = torch.cumsum(v, dim=1) / (n if v.shape[1] == 16 else n.flip(0))[:, None]
        return m.out(mean * v)
    return fwd


def _raises(m):
    def fwd(x):
        raise RuntimeError("launch failed\ninvalid grid (0, 1, 1)")
    return fwd


@pytest.mark.parametrize("make, passed, reason, where", [
    (_own, True, "", ""),
    (_off, False, "out0: rel_rms 1.0e-02 > 1e-04", "(batch 1, seq 16, fp32)"),
    (_no_param_grad, False, "no gradient reached parameter inp.weight",
     "(batch 1, seq 16, fp32)"),
    (_cached, False, "out0: rel_rms", "(batch 1, seq 16, fp32)"),
    (_example_shape_only, False, "out0: rel_rms", "(batch 1, seq 13, fp32)"),
    (_raises, False, "the replacement raised at batch 1, seq 16, fp32: RuntimeError: "
                     "invalid grid (0, 1, 1)", ""),
])
def test_block_check_verdicts(make, passed, reason, where):
    from onboarding.generate.blockcheck import check_block

    v = check_block(ModelSpec(ref=CUM), "layers.0.mixer", make, seq=16, in_process=True)
    assert v.passed is passed and v.reason.startswith(reason), v.reason
    assert v.reason.endswith(where)
    if passed:  # every size checked: forward, the input's and both weights' gradients
        assert [(s.batch, s.seq) for s in v.sizes] == [(1, 16), (1, 16), (1, 13), (3, 13)]
        assert {e.name for e in v.sizes[-1].errors} == {
            "out0", "grad of x", "grad of param inp.weight", "grad of param out.weight"}
    if make is _cached:  # right on the first draw, wrong on the second draw at the same shape
        assert v.sizes[0].passed and v.sizes[1].draw != v.sizes[0].draw
        assert not v.sizes[1].passed


def _state_in_dtype(m):
    """Fp32StateMixer with its state in the input's dtype: right in bf16 too."""
    import torch

    def fwd(x):
        v = m.inp(x)
        return m.out(_running_mean(v) * v + v @ torch.zeros(v.shape[-1], v.shape[-1],
                                                           dtype=v.dtype))
    return fwd


def test_block_check_bf16_where_the_blocks_own_forward_fails():
    """xLSTM's chunkwise mLSTM raises in bf16 (fp32 initial states times bf16 keys; seen on the
    H200): a replacement that runs there is judged by the bf16 row alone, and the block's own
    code compiled, raising the same, has those sizes skipped, not failed."""
    from onboarding.generate.blockcheck import check_block

    spec = ModelSpec(ref=f"{FIXTURES / 'uncovered_models.py'}:Fp32StateLM")
    kw = dict(seq=16, sizes=[(1, 16), (3, 13)], dtypes=["bf16"], in_process=True)
    v = check_block(spec, "layers.0.mixer", _state_in_dtype, **kw)
    assert v.passed, v.reason
    assert [s.dtype for s in v.sizes] == ["bf16", "bf16"] and all(s.errors for s in v.sizes)
    assert any("own bf16 forward fails" in n and "judged by the bf16 row alone" in n
               for n in v.notes), v.notes
    v = check_block(spec, "layers.0.mixer", _own, **kw)
    assert not v.passed and all(s.skipped.endswith("so does the replacement") for s in v.sizes)
    assert v.reason.startswith("no size could be checked: the block's own bf16 forward fails")


def test_block_check_subprocess_timeout():
    from onboarding.generate.blockcheck import Replacement, check_block

    v = check_block(ModelSpec(ref=CUM), "layers.0.mixer",
                    Replacement(target=f"{FIXTURES / 'uncovered_models.py'}:running_mean"), seq=16,
                    timeout_s=1)
    assert not v.passed and v.reason == "timeout after 1 s"
    with pytest.raises(TypeError, match="cannot cross into the check's subprocess"):
        check_block(ModelSpec(ref=CUM), "layers.0.mixer", _own, seq=16)


# -- the decision loop -------------------------------------------------------------------------

class _Outcome:
    """What `onboarding.generate.llm.propose` returns, as far as the loop reads it."""

    def __init__(self, accepted: bool, reason: str = "", family: str | None = None):
        self.accepted, self.reason, self.family = accepted, reason, family
        self.variant, self.folder, self.summary = "plain", None, ""
        self.attempts = [object(), object()]


def _fake_check(passed: bool, reason: str = ""):
    from onboarding.generate.blockcheck import BlockVerdict, SizeCheck

    calls = []

    def check(spec, path, run_dir, **kw):
        calls.append(path)
        return BlockVerdict(path=path, replacement="torch.compile (Inductor)", passed=passed,
                            reason=reason, sizes=[SizeCheck(batch=1, seq=16, dtype="fp32", draw=1,
                                                            passed=passed)],
                            artifacts={"fp32": {"backend": "inductor (cpp, OpenMP)",
                                                "graphs": 2}})
    check.calls = calls
    return check


@pytest.mark.parametrize("llm, inductor, decision, why", [
    (None, True, "inductor", "inductor: torch.compile (inductor (cpp, OpenMP)) passed the block "
                             "check: (1x16 fp32); template: no family's match accepts it"),
    (_Outcome(False, "numerics off: out0 rel_rms 3e-1"), True, "inductor",
     "llm: 2 attempt(s) rejected: numerics off: out0 rel_rms 3e-1"),
    (_Outcome(True, family="cum_mixer"), True, "generated",
     "llm: family cum_mixer accepted after 2 attempt(s)"),
    (_Outcome(False, "empty answer"), False, "uncovered",
     "inductor: block check: timeout after 9 s"),
])
def test_decision_loop_with_an_injected_llm(cum_graph, tmp_path, llm, inductor, decision, why):
    """template -> LLM (only with a client) -> Inductor -> uncovered, each with its evidence; the
    same structure is decided once; coverage, swaps and the report take the decisions."""
    from onboarding.generate.decide import (DECISIONS_FILE, GenerateOptions, apply_to_coverage,
                                            decide, load_decisions, save_decisions, swaps)
    from onboarding.generate.tasks import build_tasks
    from onboarding.report import _decisions_section

    cov = build_coverage(cum_graph)
    tasks = build_tasks(graph=cum_graph, coverage=cov, full_size=False)
    asked = []

    def propose(task, client, *, attempts, budget_s, run_dir, spec):
        asked.append((task.path, client, attempts))
        return llm

    client = object() if llm is not None else None
    check = _fake_check(inductor, "" if inductor else "timeout after 9 s")
    ds = decide(tasks, ModelSpec(ref=CUM), tmp_path, graph=cum_graph, client=client,
                propose=propose, check=check, opts=GenerateOptions(llm_attempts=2, seq=16))
    assert [d.decision for d in ds] == [decision, decision]
    assert why in ds[0].why() and ds[1].same_as == "layers.0.mixer"
    # one problem, decided once: the LLM asked (with the injected client) and checked once
    assert asked == ([("layers.0.mixer", client, 2)] if client is not None else [])
    assert check.calls == ([] if decision == "generated" else ["layers.0.mixer"])
    assert [e.option for e in ds[0].evidence][:2] == ["template", "llm"]
    if llm is None:
        assert ds[0].evidence[1].outcome == "skipped" and ds[0].evidence[1].reason == "--llm off"
    save_decisions(ds, tmp_path / DECISIONS_FILE)
    assert load_decisions(tmp_path / DECISIONS_FILE) == ds
    apply_to_coverage(cov, ds)
    statuses = {e.path: e.status for e in cov.entries if e.path.endswith("mixer")
                and e.status not in ("torch_fast",)}
    assert statuses == {"layers.0.mixer": decision, "layers.1.mixer": decision}
    assert [s.path for s in swaps(ds)] == (["layers.0.mixer", "layers.1.mixer"]
                                           if decision == "inductor" else [])
    section = _decisions_section(tmp_path)
    assert "## Why this kernel" in section and "and 1 more like it" in section
    assert f"| {decision} |" in section


def test_a_loop_over_time_is_not_handed_to_inductor(parse_model, tmp_path):
    """A recurrent mixer written as a loop over the positions (`recurrence: time_loop`) is not
    compiled: dynamo would unroll the loop (a graph per length, growing with it). The block stays
    uncovered with that reason, and the Inductor check is never called."""
    from onboarding.generate.decide import decide
    from onboarding.generate.tasks import build_tasks

    ref = f"{FIXTURES / 'uncovered_models.py'}:LoopLM"
    g = parse_model(ref, seq=12)
    tasks = build_tasks(graph=g, coverage=build_coverage(g), full_size=False)
    assert [t.path for t in tasks] == ["layers.0.mixer", "layers.1.mixer"]
    check = _fake_check(True)
    ds = decide(tasks, ModelSpec(ref=ref), tmp_path, graph=g, check=check)
    assert [d.decision for d in ds] == ["uncovered", "uncovered"] and check.calls == []
    ev = ds[0].evidence[-1]
    assert (ev.option, ev.outcome) == ("inductor", "skipped") and "loop over time (12 positions" in ev.reason


def test_decision_budget_and_nesting(cum_graph, tmp_path):
    """A spent --generate-budget leaves blocks uncovered with that reason; a block inside one
    that Inductor serves is compiled with it, not decided on its own."""
    from onboarding.generate.decide import GenerateOptions, decide
    from onboarding.generate.tasks import KernelTask

    tasks = [KernelTask(path="layers.0.mixer", kind="unknown", reason="", op="x", key="a"),
             KernelTask(path="layers.0.mixer.inp", kind="unknown", reason="", op="y", key="b"),
             KernelTask(path="layers.1.mixer", kind="unknown", reason="", op="z", key="c")]
    check = _fake_check(True)
    ds = decide(tasks, ModelSpec(ref=CUM), tmp_path, graph=cum_graph, check=check)
    assert [(d.decision, d.inside) for d in ds] == [("inductor", None),
                                                     ("inductor", "layers.0.mixer"),
                                                     ("inductor", None)]
    assert check.calls == ["layers.0.mixer", "layers.1.mixer"]
    ds = decide(tasks, ModelSpec(ref=CUM), tmp_path, graph=cum_graph, check=check,
                opts=GenerateOptions(budget_s=0))
    assert {d.decision for d in ds} == {"uncovered"}
    assert "generate budget of 0 s spent" in ds[0].why()


def test_a_generated_family_serves_every_op_of_its_block(monkeypatch):
    """An LLM-written family's block_forward runs the whole module: the block's projections,
    which map lists as cuBLAS GEMMs of the torch path, run inside it. Coverage kept them
    torch_fast beside the generated core (hf:minimax's lightning attention: "projections (GEMM):
    3 dense GEMMs: cuBLAS"). They are the family's now, saying what the module's own code did;
    the entries of other paths and of a block Inductor serves keep theirs, and the family is
    still one kernel for its block (`Coverage.served`, `kernels_for`)."""
    import onboarding.tune.store as store
    from onboarding.coverage import Coverage, CoverageEntry
    from onboarding.generate.candidates import Candidate, kernels_for
    from onboarding.generate.decide import Decision, Evidence, apply_to_coverage

    core, gemm = "linear-attention recurrence", "projections (GEMM)"

    def entry(path, op, status, reason, **kw):
        return CoverageEntry(path=path, kind="linear_attention.other", op=op, status=status,
                             shapes=[[1, 16, 16]], dtype="float32", reason=reason, **kw)

    def decision(path, decision, family=None):
        return Decision(path=path, kind="linear_attention.other", op=core, key="k",
                        decision=decision, family=family, variant="plain" if family else None,
                        evidence=[Evidence(option="llm", outcome="accepted", reason="passed")])

    cov = Coverage(model="m", entries=[
        entry("layers.0.mixer", gemm, "torch_fast", "3 dense GEMMs: cuBLAS"),
        entry("layers.0.mixer", core, "uncovered", "no family matches this block yet"),
        entry("layers.0.norm", "rmsnorm", "template", "template rmsnorm/plain", family="rmsnorm",
              variant="plain"),
        entry("layers.1.mixer", gemm, "torch_fast", "3 dense GEMMs: cuBLAS"),
        entry("layers.1.mixer", core, "uncovered", "no family matches this block yet")])
    apply_to_coverage(cov, [decision("layers.0.mixer", "generated", "cum_mixer"),
                            decision("layers.1.mixer", "inductor")])
    mixer = [e for e in cov.entries if e.path == "layers.0.mixer"]
    assert [(e.op, e.status, e.family, e.variant) for e in mixer] == [
        (gemm, "generated", "cum_mixer", "plain"), (core, "generated", "cum_mixer", "plain")]
    assert mixer[0].reason == ("inside cum_mixer's block_forward, which runs the whole module "
                               "(the module's own code: 3 dense GEMMs: cuBLAS)")
    assert [(e.status, e.family, e.reason) for e in cov.entries[2:4]] == [
        ("template", "rmsnorm", "template rmsnorm/plain"),
        ("torch_fast", None, "3 dense GEMMs: cuBLAS")]
    assert [(e.path, e.family) for e in cov.served()] == [("layers.0.mixer", "cum_mixer"),
                                                          ("layers.0.norm", "rmsnorm")]
    monkeypatch.setattr(store, "load_tuned", lambda path: path)
    passed = [Candidate(family=f, variant="plain", params={}, path=f"{f}.py", status="passed")
              for f in ("cum_mixer", "rmsnorm")]
    assert kernels_for(cov, passed) == {("layers.0.mixer", "cum_mixer"): "cum_mixer.py",
                                        ("layers.0.norm", "rmsnorm"): "rmsnorm.py"}


@pytest.mark.parametrize("retry, family, gemm_after", [
    ("inductor", None, ("torch_fast", None, "3 dense GEMMs: cuBLAS")),
    ("uncovered", None, ("torch_fast", None, "3 dense GEMMs: cuBLAS")),
    ("generated", "cum_mixer_2", ("generated", "cum_mixer_2",
                                  "inside cum_mixer_2's block_forward, which runs the whole "
                                  "module (the module's own code: 3 dense GEMMs: cuBLAS)"))])
def test_a_generated_family_left_out_gives_its_block_back(tmp_path, retry, family, gemm_after):
    """The LLM-written family of a whole module failed alignment: the retry decides the block
    again (`retry_blocks`; the first-pass decision kept it out) and the projections' GEMMs it
    had taken over name what serves them now: the torch path's cuBLAS GEMMs under Inductor
    (which compiles the module's own code) or the module's own code, or the new family. Before,
    they kept naming the left-out family in coverage.json and the report."""
    from onboarding.coverage import Coverage, CoverageEntry
    from onboarding.generate.decide import (DECISIONS_FILE, Decision, Evidence, apply_to_coverage,
                                            retry_blocks, save_decisions)
    from onboarding.report import _coverage_section, _decisions_section

    core, gemm, path = "linear-attention recurrence", "projections (GEMM)", "layers.0.mixer"
    first = Decision(path=path, kind="linear_attention.other", op=core, key="k",
                     decision="generated", family="cum_mixer", variant="plain",
                     evidence=[Evidence(option="llm", outcome="accepted", reason="passed")])
    cov = Coverage(model="m", entries=[
        CoverageEntry(path=path, kind="linear_attention.other", op=gemm, status="torch_fast",
                      reason="3 dense GEMMs: cuBLAS"),
        CoverageEntry(path=path, kind="linear_attention.other", op=core, status="uncovered",
                      reason="no family matches this block yet")])
    apply_to_coverage(cov, [first]).save(tmp_path / "coverage.json")
    excluded = [[path, "cum_mixer"], ["layers.1.mixer", "inductor"], ["layers.0.norm", "rmsnorm"]]
    assert retry_blocks([first], excluded, 1) == {
        path: "cum_mixer: left out after alignment attempt 1",
        "layers.0.norm": "rmsnorm: left out after alignment attempt 1"}
    again = Decision(path=path, kind="linear_attention.other", op="linear_attention.other",
                     key="k", decision=retry, family=family, variant="plain" if family else None,
                     failed_family="cum_mixer",
                     evidence=[Evidence(option=retry, outcome="accepted", reason="passed")])
    decisions = [first, again]
    assert retry_blocks(decisions, excluded, 2) == {  # decided again once
        "layers.0.norm": "rmsnorm: left out after alignment attempt 2"}
    # the retry applies every decision to the coverage the first pass wrote (`run_decide`)
    cov = apply_to_coverage(Coverage.load(tmp_path / "coverage.json"), decisions)
    apply_to_coverage(cov, decisions).save(tmp_path / "coverage.json")  # twice: no change
    got = [(e.op, e.status, e.family, e.reason) for e in cov.entries]
    assert got[0] == (gemm, *gemm_after)
    assert got[1][:3] == (core, "generated", "cum_mixer")  # the family's, which alignment left out
    assert [g[1:3] for g in got[2:]] == ([] if retry == "uncovered" else [(retry, family)])
    assert {(e.path, e.family) for e in cov.served()} == {(path, "cum_mixer")} | (
        {(path, family)} if family else set())
    section = _coverage_section(tmp_path)
    assert ("| torch_fast | projections (GEMM) |" in section) == (retry != "generated")
    save_decisions(decisions, tmp_path / DECISIONS_FILE)
    (tmp_path / "alignment.json").write_text(json.dumps({"blocks": [
        {"path": path, "fwd": {"verdict": "pass"}, "bwd": {"verdict": "pass"}}]}))
    section = _decisions_section(tmp_path)
    assert f"{int(retry != 'uncovered')} of 1 blocks" in section
    assert "| generated, left out |" in section and "| failed alignment (decided again) |" in section
    assert f"| {retry} |" in section and section.count("fwd pass, bwd pass") == 1
    # the left-out family is no kernel-PR candidate, though the block passed with what replaced it
    from onboarding.generate.llm.review import pr_candidates

    (tmp_path / "alignment.json").write_text(json.dumps({"blocks": [
        {"path": path, "fwd": {"verdict": "pass"}, "bwd": {"verdict": "pass"}}], "patches": [
        {"path": path, "family": family or retry, "status": "active"}][:retry != "uncovered"]}))
    first.folder = str(tmp_path / "cum_mixer")
    again.folder = str(tmp_path / family) if family else None
    save_decisions(decisions, tmp_path / DECISIONS_FILE)
    (left,) = [c for c in pr_candidates(tmp_path) if c["family"] == "cum_mixer"]
    assert left["status"] == f"alignment failed: {path}"
    assert left["blocks"][0]["patched"] == "left out"


def test_the_retry_node_decides_a_left_out_generated_family_again(tmp_path, monkeypatch):
    """The agent's generate node on a retry: the block whose LLM-written family alignment left
    out goes back to the decision loop (it was skipped: the block had a first-pass decision),
    and the node's summary counts each block's last decision."""
    from dataclasses import asdict

    import agents.nodes as nodes
    from agents.state import RunConfig, RunState
    from onboarding.generate.decide import Decision

    path = "layers.0.mixer"
    first = Decision(path=path, kind="unknown", op="unclassified compute", key="k",
                     decision="generated", family="cum_mixer", variant="plain")
    again = Decision(path=path, kind="unknown", op="unknown", key="k", decision="inductor",
                     failed_family="cum_mixer")
    asked = []

    def decide(state, run_dir, step, failed=None):
        asked.append(failed)
        return [first, again]

    monkeypatch.setattr(nodes, "_decide", decide)
    monkeypatch.setattr(nodes, "run_generate", lambda *a, **k: [])
    monkeypatch.setattr(nodes.Coverage, "load", staticmethod(lambda path: None))
    state = RunState(config=RunConfig(), run_dir=str(tmp_path), completed=["generate", "align"],
                     generate_decisions=[asdict(first)], excluded_kernels=[[path, "cum_mixer"]],
                     align_attempts=[{"attempt": 1, "passed": False}])
    out = nodes.generate_node(state)
    assert asked == [{path: "cum_mixer: left out after alignment attempt 1"}]
    assert out["summary"]["generated"] == 0 and out["summary"]["inductor"] == 1


# -- the Inductor fallback, for real -----------------------------------------------------------

@pytest.mark.slow
def test_inductor_fallback_checked_then_aligned(cum_graph, tmp_path):
    """torch.compile of an uncovered mixer passes the block check in its subprocess (the
    generated code saved beside the verdict), and alignment swaps it in for both mixers and
    checks them forward and backward."""
    from onboarding.generate.decide import Decision, Evidence, apply_to_coverage, swaps
    from onboarding.generate.inductor import check_inductor
    from onboarding.graph.parse import load_stage
    from onboarding.load.model import load_model
    from onboarding.stages import run_align

    # one size: the odd sizes are the block check's own tests above; alignment then runs at
    # this shape and finds the compiled graphs in Inductor's cache
    v = check_inductor(ModelSpec(ref=CUM), "layers.0.mixer", tmp_path, seq=16, sizes=[(1, 16)])
    assert v.passed, v.reason
    art = v.artifacts["fp32"]
    assert art["backend"].startswith("inductor (cpp") and art["files"]
    out = tmp_path / "generated" / "inductor" / "layers.0.mixer"
    assert (out / "verdict.json").exists() and "Backend: inductor" in (out / "README.md").read_text()
    assert all(e.passed for s in v.sizes for e in s.errors)
    ds = [Decision(path=p, kind="unknown", op="unclassified compute", key="k",
                   decision="inductor", verdict=v.summary(),
                   evidence=[Evidence(option="inductor", outcome="accepted", reason="passed")])
          for p in ("layers.0.mixer", "layers.1.mixer")]
    cov = apply_to_coverage(build_coverage(cum_graph), ds)
    info = load_stage(load_model(CUM))
    result = run_align(info, cum_graph, cov, [], None, families=None, seq=16,
                       swaps=swaps(ds))
    recs = {r["path"]: r for r in result.patches if r["family"] == "inductor"}
    assert {p: r["status"] for p, r in recs.items()} == {"layers.0.mixer": "active",
                                                          "layers.1.mixer": "active"}
    for p in recs:
        b = result.block(p)
        assert (b.fwd.verdict, b.bwd.verdict) == ("pass", "pass"), (b.fwd, b.bwd)
    assert result.passed and not [x for x in result.not_checked if "mixer" in x["path"]]


def test_a_block_whose_family_failed_alignment_is_decided_again(cum_graph, tmp_path):
    """A retry's task: the block keeps its family's coverage entry (left out by alignment) and
    gets one for what the loop chose, with both reasons."""
    from onboarding.generate.decide import apply_to_coverage, decide, swaps
    from onboarding.generate.tasks import build_tasks

    cov = build_coverage(cum_graph)
    fam = next(e for e in cov.entries if e.path == "layers.0.norm").family
    tasks = [t for t in build_tasks(graph=cum_graph, coverage=cov, full_size=False,
                                    failed={"layers.0.norm": f"{fam}: left out after attempt 1"})
             if t.failed_family]
    assert [t.path for t in tasks] == ["layers.0.norm"]
    ds = decide(tasks, ModelSpec(ref=CUM), tmp_path, graph=cum_graph, check=_fake_check(True))
    assert ds[0].decision == "inductor" and ds[0].failed_family == fam
    apply_to_coverage(cov, ds)
    entries = [(e.status, e.family) for e in cov.entries if e.path == "layers.0.norm"]
    assert entries[0][1] == fam and entries[1:] == [("inductor", None)]
    assert f"after {fam} failed alignment" in cov.entries[-1].reason
    assert [s.path for s in swaps(ds)] == ["layers.0.norm"]


@pytest.mark.parametrize("kernels, active", [(None, True), (["rmsnorm"], False),
                                              (["rmsnorm", "inductor"], True)])
def test_kernels_list_keeps_or_names_the_inductor_swaps(cum_graph, kernels, active):
    """An explicit --kernels list patches those families only: Inductor's block swaps stay in
    when it names 'inductor', and otherwise the unchecked blocks say why (the swaps were once
    dropped with no way to keep them, and reported as having no patch binding)."""
    from onboarding.cli.common import selected_kernels
    from onboarding.generate.decide import Decision, apply_to_coverage
    from onboarding.graph.parse import load_stage
    from onboarding.load.model import load_model
    from onboarding.patching.core import BlockSwap
    from onboarding.stages import run_align

    assert selected_kernels(type("A", (), {"kernels": "rmsnorm,inductor,generated"})) == [
        "rmsnorm", "inductor", "generated"]
    paths = ("layers.0.mixer", "layers.1.mixer")
    ds = [Decision(path=p, kind="unknown", op="unclassified compute", key="k",
                   decision="inductor") for p in paths]
    cov = apply_to_coverage(build_coverage(cum_graph), ds)
    swaps = [BlockSwap(path=p, kind="unknown", label="inductor", make=lambda m: m.forward)
             for p in paths]  # the block's own forward stands in for the compiled one
    result = run_align(load_stage(load_model(CUM)), cum_graph, cov, [], None, families=kernels,
                       seq=16, swaps=swaps)
    recs = {r["path"]: r["status"] for r in result.patches if r["family"] == "inductor"}
    unchecked = {x["path"]: x["reason"] for x in result.not_checked}
    if active:
        assert recs == {p: "active" for p in paths} and not set(paths) & set(unchecked)
    else:
        assert recs == {}
        assert {unchecked[p] for p in paths} == {
            "inductor not selected (--kernels) (name 'inductor' to keep the swaps)"}


def test_compile_ladder_in_the_decision_coverage_and_swap(cum_graph, tmp_path):
    """A block Inductor served only regionally: the decision's reason (coverage, the report's
    table) says what was left eager, and alignment's swap starts at that rung with those nodes
    eager (read from the check's verdict.json)."""
    import json as _json

    import torch

    from onboarding.generate.decide import GenerateOptions, apply_to_coverage, decide, swaps
    from onboarding.generate.inductor import block_dir
    from onboarding.generate.tasks import build_tasks

    ladder = [{"graph": 0, "nodes": 7, "rung": "regional", "regions": 2, "eager_nodes": ["cumsum"],
               "eager": ["call_function:cumsum @ uncovered_models.py:23"],
               "failures": [{"rung": "default", "error": "InductorError: split scan"},
                            {"rung": "safe", "error": "InductorError: split scan"}]}]
    check = _fake_check(True)

    def laddered(spec, path, run_dir, **kw):
        v = check(spec, path, run_dir, **kw)
        v.artifacts["fp32"].update(rung="regional", ladder=ladder)
        out = block_dir(run_dir, path)
        out.mkdir(parents=True, exist_ok=True)
        (out / "verdict.json").write_text(_json.dumps(v.to_dict()))
        return v

    cov = build_coverage(cum_graph)
    tasks = build_tasks(graph=cum_graph, coverage=cov, full_size=False)
    ds = decide(tasks, ModelSpec(ref=CUM), tmp_path, graph=cum_graph, check=laddered,
                opts=GenerateOptions(seq=16))
    d = next(d for d in ds if d.path == "layers.0.mixer")
    assert d.decision == "inductor"
    assert "compile ladder: graph 0: compiled in 2 regions, eager: call_function:cumsum @ " \
           "uncovered_models.py:23 (default failed: InductorError: split scan" in d.why()
    cov = apply_to_coverage(cov, ds)
    assert "eager: call_function:cumsum" in next(e.reason for e in cov.entries
                                                 if e.path == "layers.0.mixer"
                                                 and e.status == "inductor")
    (swap,) = [s for s in swaps(ds) if s.path == "layers.0.mixer"]
    fn = swap.make(torch.nn.Linear(2, 2))  # compiles lazily: nothing runs here
    assert fn.ladder.start == "regional" and fn.ladder.eager == {"cumsum"}


def test_block_check_integer_outputs_in_16_bits():
    """A router's picks in bf16 may differ from the fp32 block where rounding flips a near tie;
    the bf16 block's own picks flip there too: as many (or up to twice as many) differences
    pass, more fail; fp32 (no floor) stays exact."""
    import torch

    from onboarding.generate.blockcheck import _judge

    ref = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    own = ref.clone()
    own[1, 0] = 3  # the bf16 block's own flip
    one, three = own.clone(), own.clone()
    three[2, 0], three[3, 1] = 5, 6

    def judge(c, floor):
        return _judge(([c], {}), ([ref], {}), None if floor is None else ([floor], {}),
                      "bf16" if floor is not None else "fp32", "")[0]

    assert judge(ref, None).passed and not judge(one, None).passed
    assert judge(one, own).passed and "the 16-bit block's own: 1" in judge(one, own).message
    bad = judge(three, own)
    assert not bad.passed and bad.message == ("out0: integer output differs in 3 of 8 "
                                              "elements (the 16-bit block's own: 1)")
