"""Split-by-size per-expert linears (ScatterMoE / Megablocks experts): classified by structure,
matched by the `grouped_linear` family only, and patched into a tiny JetMoE (MoE MLP and
mixture-of-attention experts) with forward and gradients equal to the unpatched model."""

from __future__ import annotations

import pytest

from onboarding.graph.split import split_linear
from onboarding.backend import kernel_device
from onboarding.graph.capture import OpRecord
from onboarding.families import family_module
grouped_linear = family_module("grouped_linear")
moe_experts = family_module("moe_experts")
from onboarding.generate.candidates import check_candidate, kernels_for, render_candidates
from onboarding.load.model import load_model
from onboarding.graph.parse import example_inputs, load_stage, parse_stage
from onboarding.patching.core import patch_model
from onboarding.coverage import build_coverage

W = "blk.weight"
SHAPES = {W: [4, 6, 5]}  # E=4, N=6, K=5


def _rec(i, op, ins, outs, scalars=None, params=None):
    return OpRecord(index=i, module="blk", op=op, in_shapes=ins, in_dtypes=[None] * len(ins), out_shapes=outs,
                    out_dtypes=["float32"] * len(outs), scalars=scalars or [None] * len(ins), params=params or {})


def _records(sizes=(3, 0, 4, 2), skip_empty=False, extra=()):
    """split_with_sizes of x [S, 5], then per piece select + t + mm against the weight, then cat."""
    recs = [_rec(0, "split_with_sizes", [[sum(sizes), 5], None], [[s, 5] for s in sizes], [None, list(sizes)])]
    for e, s in enumerate(sizes):
        if skip_empty and s == 0:
            continue
        i = len(recs)
        recs += [_rec(i, "select", [[4, 6, 5], None, None], [[6, 5]], [None, 0, e], {0: W}),
                 _rec(i + 1, "t", [[6, 5]], [[5, 6]], None, {0: W}),
                 _rec(i + 2, "mm", [[s, 5], [5, 6]], [[s, 6]], None, {1: W})]
    recs += [_rec(len(recs) + j, op, [[sum(sizes), 6]], [[sum(sizes), 6]]) for j, op in enumerate(extra)]
    return recs + [_rec(len(recs) + len(extra), "cat", [None], [[sum(sizes), 6]])]


def test_split_linear_reads_the_structure():
    _, attrs = split_linear("blk", _records(), SHAPES)
    assert attrs["layout"] == "split_linear" and (attrs["n_experts"], attrs["out_features"],
                                                  attrs["in_features"], attrs["weight"]) == (4, 6, 5, "weight")
    assert split_linear("blk", _records(skip_empty=True), SHAPES) is not None  # fewer linears than E
    assert split_linear("blk", _records(extra=("silu",)), SHAPES) is None  # compute beyond the linears
    assert split_linear("blk", _records(), {**SHAPES, "blk.bias": [4, 6]}) is None  # a second parameter
    assert split_linear("blk", _records(sizes=(3, 0, 4, 2, 1)), SHAPES) is None  # more pieces than experts
    along_cols = _records()
    along_cols[0].scalars = [None, [3, 0, 4, 2], 1]
    assert split_linear("blk", along_cols, SHAPES) is None


# A smaller JetMoE than the tiny proxy (the interpreter pays per Triton program): 1 layer, 4 experts.
TINY = dict(num_hidden_layers=1, num_local_experts=4, hidden_size=64, intermediate_size=48, kv_channels=16)


@pytest.fixture(scope="module")
def tiny_jetmoe():
    info = load_stage(load_model("hf:jetmoe"))
    for key, value in TINY.items():
        setattr(info.proxy_config, key, value)
    return info, parse_stage(info, seq=16, try_export=False)


def test_jetmoe_experts_are_split_linear_and_matched_by_grouped_linear_only(tiny_jetmoe):
    jetmoe = tiny_jetmoe[1]
    experts = jetmoe.by_kind("moe.experts")
    assert len(experts) == 4  # input/output linears of the MoE MLP and of the mixture of attention
    for b in experts:
        assert b.attrs["layout"] == "split_linear", b.evidence
        assert b.params == {"weight": [b.attrs["n_experts"], b.attrs["out_features"], b.attrs["in_features"]]}
        assert moe_experts.match(b) is None
        assert grouped_linear.match(b) == {"variant": "sorted", "params": {}}
    entries = [e for e in build_coverage(jetmoe).entries if e.kind == "moe.experts"]
    assert {(e.status, e.family) for e in entries} == {("template", "grouped_linear")}


def test_patched_jetmoe_matches_unpatched(tiny_jetmoe, tmp_path):
    info, jetmoe = tiny_jetmoe
    cov = build_coverage(jetmoe)
    cands = [check_candidate(c, c.shapes) for c in render_candidates(cov, tmp_path) if c.family == "grouped_linear"]
    assert len(cands) == 1 and cands[0].status == "passed", cands[0].error
    kernels = kernels_for(cov, cands)
    # the grouped-linear module (the RMSNorms of the proxy may be served by reviewed kernels too)
    grouped = next(m for (_, family), m in kernels.items() if family == "grouped_linear")
    # few large tiles: the interpreter pays per program
    grouped.set_config({"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 64, "BWD_BLOCK_M": 128,
                        "BWD_BLOCK_N": 64, "BWD_BLOCK_K": 16})
    device = kernel_device()  # the GPU when there is one, else the interpreter on the CPU
    model = info.loaded.build(info.proxy_config, seed=0).eval().to(device)
    inputs, kwargs = example_inputs(model, info.proxy_config, 1, jetmoe.seq, 1)
    inputs = tuple(t.to(device) for t in inputs)

    def run():
        model.zero_grad()
        logits = model(*inputs, **kwargs).logits
        logits.square().mean().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if "linear" in n}

    expected, grads = run()
    with patch_model(model, jetmoe, kernels, kinds={"moe.experts"}) as patches:
        got, got_grads = run()  # the first call calibrates each patch, then returns the kernel's output
        assert len(patches.active()) == 4 and {r.family for r in patches.records} == {"grouped_linear"}, \
            [r.detail for r in patches.records]
    assert (got - expected).norm() / expected.norm() < 1e-5
    assert len(grads) == 4
    for n, g in grads.items():
        assert (got_grads[n] - g).norm() / g.norm() < 1e-5, n
    assert all("forward" not in m.__dict__ for m in model.modules())  # restored
