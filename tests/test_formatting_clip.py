"""Recorded reasons (a rejected patch's error) are cut at a word boundary with an ellipsis, not
mid-word: `onboarding.formatting.clip`, used wherever such reasons are cut."""

from torch import nn

from onboarding.formatting import clip


def test_clip_cuts_at_a_word_boundary_with_an_ellipsis():
    text = "the function failed on the probe's inputs: " + "an expansion " * 30
    out = clip(text, 200)
    assert len(out) <= 200 and out.endswith("\u2026")
    assert text.startswith(out[:-1]) and text[len(out) - 1] == " "  # a whole word before it
    assert out[:-1].rsplit(" ", 1)[-1] in {"an", "expansion"}
    assert clip("short", 200) == "short" and clip("x" * 10, 10) == "x" * 10
    assert clip("x" * 30, 10) == "x" * 9 + "\u2026"  # no space to cut at: cut at the limit


def test_rejected_swap_reason_ends_in_an_ellipsis_not_mid_word():
    from onboarding.patching.core import BlockSwap, swap_blocks

    def make(module):
        raise ValueError("the block's layout needs an expansion " * 20)

    model = nn.Sequential(nn.Linear(2, 2))
    patches = swap_blocks(model, [BlockSwap(path="0", label="test", make=make)])
    record = patches.records[0]
    assert record.status == "rejected" and len(record.detail) <= 200
    assert record.detail.startswith("ValueError: the block's layout") and record.detail.endswith(
        "\u2026")
    assert record.detail[:-1].rsplit(" ", 1)[-1] in {"the", "block's", "layout", "needs", "an",
                                                     "expansion"}
