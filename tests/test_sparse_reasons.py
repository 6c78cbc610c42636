"""The reasons a sparse block's patch records when no binding calibrates (`SparseBlock`): cut with
`formatting.clip` (at a word, with "…"), as the other patches' reasons are."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from onboarding.formatting import clip
from onboarding.patching.core import PatchRecord
from onboarding.patching.sparse import SparseBlock


class _TopkAttention(nn.Module):
    """Each query row's top-2 keys, then SDPA: the structure the sparse intercept reads."""

    def forward(self, x):  # x [B, H, T, D]
        scores = (x[:, 0] @ x[:, 0].transpose(-1, -2)).float()  # [B, T, S]
        torch.topk(scores, 2, dim=-1)
        return F.scaled_dot_product_attention(x, x, x)


def _rejected_detail(bindings) -> str:
    record = PatchRecord(path="attn", kind="attention.sparse", family="sparse_attention")
    block = _TopkAttention()
    block.forward = SparseBlock(block, record, bindings)
    block(torch.randn(1, 2, 4, 8))
    assert record.status == "rejected"
    return record.detail


def test_rejected_sparse_reasons_are_clipped_at_a_word():
    """A binding that raises a long error, and three of them: each reason was cut at 200
    characters and their join at 400 by slicing, mid-word and with no mark that it was cut."""
    words = " ".join(f"word{i:03d}" for i in range(80))

    def raises(*args, **kwargs):
        raise ValueError(words)

    one = _rejected_detail({"a": (raises, None, "topk")})
    assert one == clip(f"a: ValueError: {words}", 200)
    assert one.endswith("…") and len(one) <= 200
    many = _rejected_detail({n: (raises, None, "topk") for n in ("a", "b", "c")})
    reasons = [clip(f"{n}: ValueError: {words}", 200) for n in ("a", "b", "c")]
    assert many == clip("; ".join(reasons), 400)
    assert many.endswith("…") and len(many) <= 400
