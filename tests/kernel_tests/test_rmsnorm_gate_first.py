"""The worked example family, examples/families/rmsnorm_gate_first (gate-first gated RMSNorm,
Mamba-2's mixer norm), loaded from outside the built-in folder: forward and every gradient against
its reference at odd shapes, per group and per row, the custom ops, the sm_90 compile, its match
against the classifier's attrs, and the whole-row rmsnorm family declining those blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kernel_cases import DTYPES, OPCHECK_SPLIT, check_match

from onboarding import families
from onboarding.families import discover
from onboarding.graph.opgraph import Block
from onboarding.testing import (KernelFixture, check_aot_sm90, check_forward_backward,
                                check_module_contract, check_opcheck)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "families"
NAME = "rmsnorm_gate_first"
# (params, x shape): whole rows and Mamba-2's groups, odd widths and row counts
CASES = [({}, (37, 100)), ({"group_size": 32}, (2, 5, 96)), ({"group_size": 8, "unit_offset": True}, (3, 24)),
         ({}, (1, 1))]


@pytest.fixture(scope="module")
def family():
    """The example registered for this module only (other tests see the built-in families)."""
    families.add_dirs([EXAMPLES])
    yield families.family_module(NAME)
    discover._EXTRA_DIRS.remove(EXAMPLES.resolve())
    families.reset()


def fixture(module, shape) -> KernelFixture:
    def make_inputs(dtype, device, gen):
        x, z = (torch.randn(shape, generator=gen).to(device, dtype) for _ in range(2))
        w = (0.5 * torch.randn(shape[-1], generator=gen) + 1.0).to(device, dtype)
        return [x, z, w, 1e-5]

    return KernelFixture(name=NAME, module=module, make_inputs=make_inputs, weights=(2,))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("params,shape", CASES, ids=lambda c: str(c))
def test_forward_backward(family, load_kernel, device, params, shape, dtype):
    module = load_kernel(NAME, "plain", params)
    check_forward_backward(fixture(module, shape), dtype, device)


@pytest.mark.parametrize("opcheck_utils", OPCHECK_SPLIT)
def test_contract_opcheck_and_sample_inputs(family, load_kernel, device, opcheck_utils):
    for params, shape in CASES[:2]:
        module = load_kernel(NAME, "plain", params)
        check_module_contract(module)
        check_opcheck(fixture(module, shape), torch.float32, device, utils=opcheck_utils)
        # the generate stage's check: entry(*sample_inputs) against the reference
        args = family.sample_inputs("plain", family.FAMILY.resolve("plain", params), [[shape[-1]]],
                                    torch.Generator().manual_seed(0))
        args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
        torch.testing.assert_close(module.entry(*args), module.reference(*args), rtol=1e-5, atol=1e-5)


def test_reference_is_the_gate_first_formula(family, load_kernel, device):
    """Against the model's own code: the gated norm of a tiny transformers Mamba-2 mixer (its
    ``norm``, whatever its class is named: MambaRMSNormGated up to 5.24, Mamba2RMSNormGated from
    5.25), groups included where that norm groups (5.17's normalises whole rows)."""
    transformers = pytest.importorskip("transformers")

    cfg = transformers.Mamba2Config(vocab_size=32, hidden_size=48, num_hidden_layers=1, num_heads=6,
                                    head_dim=16, state_size=8, n_groups=3, expand=2, layer_norm_epsilon=1e-5)
    norm = transformers.Mamba2Model(cfg).layers[0].mixer.norm.to(device)
    assert norm.weight.shape == (96,)
    group = getattr(norm, "group_size", 96)
    assert group in (32, 96)  # intermediate 96 over n_groups=3, or whole rows
    module = load_kernel(NAME, "plain", {"group_size": group} if group != 96 else {})
    with torch.no_grad():
        norm.weight.normal_()
    eps = norm.variance_epsilon
    x, z = torch.randn(4, 96, device=device), torch.randn(4, 96, device=device)
    torch.testing.assert_close(module.entry(x, z, norm.weight, eps), norm(x, z), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(module.reference(x, z, norm.weight, eps), norm(x, z), rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_named(family, load_kernel):
    module = load_kernel(NAME, "plain", {"group_size": 32})
    with pytest.raises(ValueError, match="not a multiple of group_size=32"):
        module.entry(torch.randn(2, 48), torch.randn(2, 48), torch.ones(48))
    with pytest.raises(ValueError, match=r"z \(2, 8\) must match x \(2, 64\)"):
        module.entry(torch.randn(2, 64), torch.randn(2, 8), torch.ones(64))


def _norm(**attrs) -> Block:
    return Block(path="m.norm", kind="norm.rms_gated", layer=0, class_name="",
                 attrs={"dim": 96, "eps": 1e-5, "has_weight": True, "activation": "silu",
                        "gate_activation": "silu", **attrs})


def test_match_takes_gate_first_blocks_and_rmsnorm_declines_them(family):
    rmsnorm = families.family_module("rmsnorm")
    check_match(family, _norm(norm_before_gate=False, group_size=32),
                ("plain", {"eps": 1e-5, "group_size": 32}))
    check_match(family, _norm(norm_before_gate=False), ("plain", {"eps": 1e-5}))
    check_match(family, _norm(), None)  # gated after the norm: the built-in family's
    check_match(family, _norm(norm_before_gate=False, activation="sigmoid", gate_activation="sigmoid"), None)
    # the built-in family normalises whole rows, gated after: neither fits these blocks
    check_match(rmsnorm, _norm(norm_before_gate=False), None)
    check_match(rmsnorm, _norm(group_size=32), None)
    assert rmsnorm.match(_norm()) is not None


def test_mamba2_norm_is_classified_gate_first_and_grouped(family):
    """By structure: the gate multiplies the input before the mean of squares, and the mean runs
    over groups of the row."""
    from onboarding.load.model import load_model
    from onboarding.graph.parse import load_stage, parse_stage

    graph = parse_stage(load_stage(load_model("hf:mamba2")), seq=16)
    norms = [b for b in graph.blocks if b.kind == "norm.rms_gated"]
    assert norms and all(b.attrs.get("norm_before_gate") is False for b in norms)
    cfg_groups = {b.attrs["dim"] // b.attrs["group_size"] for b in norms}
    assert cfg_groups and all(g > 1 for g in cfg_groups)
    assert [n for n, _ in families.match_block(norms[0])] == [NAME]


def test_aot_sm90(family, tmp_path):
    from onboarding.generate import templating

    path = templating.render_to(tmp_path, NAME, "plain", {"group_size": 64})
    check_aot_sm90([str(path)], size=4096)
