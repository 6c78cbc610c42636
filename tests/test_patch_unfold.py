"""A patch embedding written as an unfold (im2col) and a linear is a patch embedding block, by
structure: kernel = stride, the linear reading channels x the kernel's area."""

from onboarding.coverage import _fast_paths


def test_an_unfold_and_a_linear_are_a_patch_embedding(parse_model):
    """Llama 4's vision tower (Llama4UnfoldConvolution): before, its ops were in no block, the
    patch GEMM listed nowhere in coverage."""
    g = parse_model("tests/fixtures/unfold_patch_models.py:UnfoldTower")
    kinds = {b.path: b for b in g.blocks}
    patch = kinds.get("patch_embedding")
    assert patch is not None and patch.kind == "embedding.patch", sorted(
        (b.path, b.kind) for b in g.blocks)
    assert patch.attrs == {"in_channels": 3, "dim": 32, "patch": [4, 4]}
    assert _fast_paths(patch) == [("patch convolution", "an unfold (im2col) and one GEMM: cuBLAS")]


def test_an_overlapping_unfold_is_no_patch_embedding(parse_model):
    g = parse_model("tests/fixtures/unfold_patch_models.py:OverlappingUnfoldTower")
    assert not [b for b in g.blocks if b.kind == "embedding.patch"]
