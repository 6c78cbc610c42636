"""Alignment details measured on the H200: heavy-tailed bf16 errors and routing near ties."""

from __future__ import annotations

import torch

from onboarding.align.replay import _keep_rows, _Replay, _selection_flips
from onboarding.testing.tolerance import compare, layer_tolerance, tolerance_for


def test_layer_tolerance_admits_a_sparse_tail_but_not_a_wrong_row():
    g = torch.Generator().manual_seed(0)
    b = torch.randn(256, 1024, generator=g, dtype=torch.float64)
    a = b + 1e-3 * torch.randn(256, 1024, generator=g, dtype=torch.float64)
    a[3, 7] += 0.4  # one element past atol (0.25 RMS): a tail, as measured at this width
    assert compare(a, b, layer_tolerance("bf16")).passed
    assert not compare(a, b, tolerance_for("bf16")).passed  # kernel tests allow no outlier
    a[5] += 0.4  # a whole wrong row: 4e-3 of the elements
    c = compare(a, b, layer_tolerance("bf16"))
    assert not c.passed and "elements outside" in c.message


def _router_replay(scores: torch.Tensor, k: int, grad: torch.Tensor) -> _Replay:
    idx = scores.topk(k, -1).indices
    return _Replay(outputs=[scores, scores.gather(-1, idx)], input_grads=[grad], param_grads=[],
                   discrete=[idx])


def test_near_tie_selection_flips_are_masked_and_real_flips_are_not():
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(16, 8, generator=g, dtype=torch.float64)
    ref[4] = torch.tensor([3.0, 2.0, 1.001, 1.0, -1, -2, -3, -4], dtype=torch.float64)
    cand = ref.to(torch.bfloat16)  # the candidate's scores, rounded
    cand[4, 2], cand[4, 3] = 1.0, 1.0078125  # one bf16 ulp apart: the 3rd choice flips
    grad = torch.randn(16, 32, generator=g, dtype=torch.float64)
    keep, msg = _selection_flips(_router_replay(cand, 3, grad), _router_replay(ref, 3, grad))
    assert keep is not None and not keep[4] and keep.sum() == 15 and "near ties" in msg
    assert _keep_rows([grad], keep)[0].shape == (15, 32)

    wrong = cand.clone()
    wrong[9] = -wrong[9]  # a sign error: a different selection with no near tie behind it
    keep, msg = _selection_flips(_router_replay(wrong, 3, grad), _router_replay(ref, 3, grad))
    assert keep is None and "no near tie" in msg


def test_no_flips_no_mask():
    s = torch.randn(4, 8, dtype=torch.float64)
    keep, msg = _selection_flips(_router_replay(s, 2, s), _router_replay(s, 2, s))
    assert keep is None and msg == ""


def test_slot_grads_follow_choices_that_swap_slots():
    from onboarding.align.replay import _follow_selection

    ref_idx = torch.tensor([[5, 2, 7], [1, 0, 3]])
    cand_idx = torch.tensor([[2, 5, 7], [1, 0, 4]])  # row 0: same choices, swapped; row 1: a flip
    g = torch.tensor([[0.5, 0.2, 0.7], [0.1, 0.0, 0.3]])
    (out,) = _follow_selection([g], [cand_idx], [ref_idx])
    assert torch.equal(out[0], torch.tensor([0.2, 0.5, 0.7]))  # each grad goes with its expert
    assert torch.equal(out[1], g[1])  # a different set: left to _selection_flips
    other = torch.ones(2, 4)  # not slot-aligned with the selection: untouched
    assert _follow_selection([other], [cand_idx], [ref_idx])[0] is other


def test_scaled_compare_is_scale_free_but_catches_wrong_values():
    from onboarding.testing.tolerance import compare_scaled

    g = torch.Generator().manual_seed(2)
    b = 1e5 * torch.randn(4096, generator=g, dtype=torch.float64)
    b[7] = 3.0  # an element that cancelled to near zero keeps its terms' rounding error
    a = b * (1 + 1e-3 * torch.randn(4096, generator=g, dtype=torch.float64))
    a[7] = 300.0
    tol = tolerance_for("bf16", "reduction")
    assert not compare(a, b, tol).passed  # absolute atol: fails on the cancelled element
    assert compare_scaled(a, b, tol).passed  # atol in units of the RMS (1e5): within
    assert compare_scaled(a * 1e-7, b * 1e-7, tol).passed  # scale-free
    a[100:140] = -b[100:140]  # a wrong block of values
    assert not compare_scaled(a, b, tol).passed
