"""swiglu's family declines a gated-SiLU MLP whose own parameters its kernel never reads (Dory's
MLP scales gate and up by the per-channel vectors ``suv_gate``/``suv_up`` before the activation):
coverage leaves it uncovered and says why, rather than claiming it for a patch that calibration
then rejects ("patch rejected: no binding matched the original", the block not checked). The
projections' own biases, split or fused, are still the kernel's."""

from __future__ import annotations

from onboarding.coverage import build_coverage
from onboarding.graph.opgraph import Block, OpGraph

GATED = {"activation": "silu", "gated": True, "clamp": None, "hidden": 8, "intermediate": 16}
SPLIT = {"gate_proj.weight": [16, 8], "up_proj.weight": [16, 8], "down_proj.weight": [8, 16]}


def _coverage(params_by_path: dict[str, dict[str, list[int]]]):
    blocks = [Block(path=p, kind="mlp.dense", layer=0, class_name="", params=params,
                    attrs=dict(GATED)) for p, params in params_by_path.items()]
    graph = OpGraph(model="m", capture="export", capture_note="", batch=1, seq=8, dtype="float32",
                    blocks=blocks, layer_pattern="", layer_kinds=[], param_counts={}, total_flops=0)
    return build_coverage(graph).entries


def test_swiglu_declines_an_mlp_with_parameters_its_kernel_does_not_take():
    entries = _coverage({
        "plain": SPLIT,
        "biased": {**SPLIT, "gate_proj.bias": [16], "up_proj.bias": [16], "down_proj.bias": [8]},
        "fused": {"gate_up_proj.weight": [32, 8], "gate_up_proj.bias": [32],
                  "down_proj.weight": [8, 16]},
        "scaled": {"suv_gate": [16], "suv_up": [16], **SPLIT},  # Dory
        "normed": {**SPLIT, "sub_norm.weight": [16]},  # a norm inside the block, its weight
    })
    served = {e.path: e.variant for e in entries if e.family == "swiglu"}
    assert served == {"plain": "split", "biased": "split", "fused": "fused"}
    for path, names in (("scaled", "suv_gate, suv_up"), ("normed", "sub_norm.weight")):
        why = [e for e in entries if e.path == path and e.status == "uncovered"]
        assert len(why) == 1 and why[0].op == "mlp.dense", why
        assert "swiglu serves this kind but its binding would leave this block unpatched" \
            in why[0].reason and f"({names})" in why[0].reason, why[0].reason
