"""``--part vision``: a multimodal model's vision tower captured, classified and aligned as its
own op graph, on synthetic pixels built from its forward signature and config."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from onboarding.cli.main import main
from onboarding.errors import InputError
from onboarding.load.spec import ModelSpec
from onboarding.load.vision import VisionPart


def _known(model_type: str) -> str:
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"model_type {model_type!r} is not in the installed transformers")
    return f"hf:{model_type}"


@pytest.mark.slow
def test_vision_part_classified_and_aligned(tmp_path):
    """`align --part vision` (parse and map on the way): the tower's blocks get the existing
    kinds by structure, the existing families run where they match (RMSNorm, SwiGLU and the
    rotary on the tower's packed q/k here), and the verdict passes."""
    ref = _known("glm4v_moe")
    out = tmp_path / "a"
    assert main(["align", ref, "--part", "vision", "--seq", "16", "--out", str(out)]) == 0
    m = json.loads((out / "model.json").read_text())
    assert m["name"].endswith("-vision") and m["part"] == "vision"
    from onboarding.generate.tasks import spec_from_run

    assert spec_from_run(out).part == "vision"  # what generate's kernel tasks rebuild
    p = m["params"]
    # the totals are the tower's own; by_part is still the whole model's
    assert 0 < p["total"] < p["by_part"]["language"]
    assert p["total"] <= p["by_part"]["vision"] + p["by_part"]["projector"]
    graph = json.loads((out / "opgraph.json").read_text())
    blocks = graph["blocks"]
    kinds = {b["path"]: b["kind"] for b in blocks}
    assert {"embedding.patch", "attention.full", "mlp.dense", "norm.rms"} <= set(kinds.values())
    assert not set(kinds.values()) & {"lm_head", "moe.experts", "moe.router", "unknown"}, kinds
    assert len({path.split(".")[0] for path in kinds}) == 1, kinds  # one tower
    patch = next(b for b in blocks if b["kind"] == "embedding.patch")
    assert patch["attrs"]["in_channels"] == 3 and len(patch["attrs"]["patch"]) == 3  # t, p, p
    # every tower layer has its attention and its MLP
    assert graph["layer_pattern"] == " ".join(["AF"] * len(graph["layer_kinds"]))
    res = json.loads((out / "alignment.json").read_text())
    active = {r["path"] for r in res["patches"] if r["status"] == "active"}
    assert {kinds[a] for a in active} >= {"norm.rms", "mlp.dense"}, active
    assert res["passed"]
    # every coverable block is patched and checked, the tower's rotary too: the rope binding
    # serves its rotation call on q/k [T, H, D] in every block (before: uncovered, "not 4-D")
    assert res["not_checked"] == [], res["not_checked"]
    cov = json.loads((out / "coverage.json").read_text())
    uncovered = {e["path"] for e in cov["entries"] if e["status"] == "uncovered"}
    assert not uncovered, uncovered
    rope = [r for r in res["patches"] if r["family"] == "rope"]
    assert [r["status"] for r in rope] == ["active"] and len(rope[0]["sites"]) >= 2, rope


@pytest.mark.parametrize("ref", ["hf:qwen3_moe", "hf:glm4v_moe_text", "tiny_dense"])
def test_model_without_a_vision_part_is_exit_2(ref, tmp_path, capsys):
    if ref.startswith("hf:"):
        _known(ref[3:])
    out = tmp_path / "x"
    assert main(["parse", ref, "--part", "vision", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--part vision: the model has no vision part" in err and not out.exists()


def test_part_is_a_typed_field():
    assert ModelSpec().part == "language"
    with pytest.raises(InputError, match="part 'audio'"):
        ModelSpec(part="audio")


class _Tower(nn.Module):
    """A tower whose forward takes patches [N, C, P, P] and one (h, w) row per image."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(merge_kernel_size=[2, 2])
        self.proj = nn.Conv2d(3, 8, kernel_size=4, stride=4)
        self.mlp = nn.Linear(8, 8)

    def forward(self, pixel_values, image_grid_hw):
        assert pixel_values.ndim == 4 and image_grid_hw.shape[1] == 2
        x = self.proj(pixel_values).flatten(1)
        assert x.shape[0] == int(image_grid_hw.prod(-1).sum())
        return (self.mlp(x),)


def test_synthetic_pixels_follow_the_forward_and_the_first_layer():
    """No model names: the pixel argument is the forward's first, the grid the one named *grid*,
    the patch layout the one the tower runs on, the grid a multiple of the merge size."""
    tower = _Tower()
    part = VisionPart("tower", tower, tower.config)
    assert (part.pixel_arg, part.grid_arg) == ("pixel_values", "image_grid_hw")
    pixels, grid = part.example_inputs(2, 36)
    assert part._layout == ("patches", 2)
    assert list(pixels.shape) == [2 * 36, 3, 4, 4] and grid.tolist() == [[6, 6], [6, 6]]
    assert part.tokens_per_image(2, 36) == 36
    out = part(pixels, grid)
    assert out.shape == (1, 72 * 8)
    assert torch.equal(part.example_inputs(2, 36)[0], pixels)  # seeded


def test_a_tower_needing_more_than_pixels_is_an_input_error():
    class NeedsMask(nn.Module):
        def forward(self, pixel_values, attention_mask):
            return pixel_values

    with pytest.raises(InputError, match="also needs attention_mask"):
        VisionPart("t", NeedsMask(), None)


class _UnfoldTower(nn.Module):
    """Patches cut by an ``nn.Unfold`` and projected by a linear (a convolution in two steps),
    then a table of positions sized by the config's image_size: it runs on whole images of
    that size only."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(image_size=12)
        self.unfold = nn.Unfold(kernel_size=4, stride=4)
        self.linear = nn.Linear(3 * 4 * 4, 8, bias=False)
        self.positions = nn.Parameter(torch.randn(9, 8))  # (12 / 4)^2 patches
        self.mlp = nn.Linear(8, 8)

    def forward(self, pixel_values, attention_mask=None):
        b, c, h, w = pixel_values.shape
        x = self.linear(self.unfold(pixel_values).transpose(1, 2)) + self.positions
        return (self.mlp(x),)


def test_an_unfold_tower_gets_whole_images_at_the_configs_size():
    """An Unfold then a linear reads whole images [B, C, H, W] (channels: the linear's inputs
    over the kernel's area); a table of positions fixes their size to the config's image_size,
    tried after the seq-sized one. Before: only flattened patches were offered (exit 2)."""
    tower = _UnfoldTower()
    part = VisionPart("tower", tower, tower.config)
    (pixels,) = part.example_inputs(2, 64)
    assert list(pixels.shape) == [2, 3, 12, 12] and part._layout[0] == "images"
    assert part.tokens_per_image(2, 64) == 9
    assert part(pixels).shape == (1, 2 * 9 * 8)


class _TiledTower(nn.Module):
    """Images cut into tiles [batch, images, tiles, C, H, W] beside two more required inputs,
    an index and a mask, whose shapes the forward's docstring documents."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(image_size=8, max_num_tiles=2)
        self.patch = nn.Conv2d(3, 8, kernel_size=4, stride=4)
        self.tile_embedding = nn.Embedding(3, 2 * 8)

    def forward(self, pixel_values, aspect_ratio_ids, aspect_ratio_mask):
        r"""
        Args:
            aspect_ratio_ids (`torch.Tensor` of shape `(batch_size, max_num_images)`):
                The aspect ratio of each image (0: padding).
            aspect_ratio_mask (`torch.Tensor` of shape `(batch_size, max_num_images, max_num_tiles)`):
                Which tiles hold the image.
        """
        b, m, t, c, h, w = pixel_values.shape
        x = self.patch(pixel_values.reshape(b * m * t, c, h, w)).flatten(2).transpose(1, 2)
        x = x.reshape(b * m, t, -1, 8) + self.tile_embedding(aspect_ratio_ids).reshape(b * m, t, 1, 8)
        return (x * aspect_ratio_mask.reshape(b * m, t, 1, 1),)


def test_required_inputs_are_built_from_their_documented_shapes():
    """Indices hold 1 (0 is padding), masks ones, each in its documented shape: the batch, one
    image a sample, the config's max_num_tiles; the pixels take those leading dimensions.
    Before: an input error (the forward also needs aspect_ratio_ids, aspect_ratio_mask)."""
    tower = _TiledTower()
    part = VisionPart("tower", tower, tower.config)
    assert [n for n, *_ in part.extra_args] == ["aspect_ratio_ids", "aspect_ratio_mask"]
    pixels, ids, mask = part.example_inputs(2, 4)
    assert list(pixels.shape) == [2, 1, 2, 3, 8, 8]
    assert ids.dtype == torch.long and ids.tolist() == [[1], [1]]
    assert mask.tolist() == [[[1, 1]], [[1, 1]]]
    assert part.tokens_per_image(2, 4) == 2 * 4  # two tiles of 2 x 2 patches
    assert part(pixels, ids, mask).shape == (1, 2 * 2 * 4 * 8)


def test_an_input_that_cannot_be_built_is_named_with_why():
    class NeedsTokens(nn.Module):
        def forward(self, pixel_values, token_mask):
            r"""
            token_mask (`torch.Tensor` of shape `(batch_size, sequence_length)`):
                Which tokens to keep.
            """
            return pixel_values

    with pytest.raises(InputError, match="also needs token_mask.*sequence_length"):
        VisionPart("t", NeedsTokens(), SimpleNamespace(image_size=8))


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["llama4", "mllama"])
def test_map_vision_of_towers_on_whole_images(model_type, tmp_path):
    """Llama 4's tower (Unfold + linear, positions for image_size; a pixel-shuffle adapter that
    reads intermediate_size = 4 x hidden) and Mllama's (tiles, aspect ratio ids and mask)
    map on their tiny proxies. Before: exit 2 on both."""
    ref = _known(model_type)
    out = tmp_path / "m"
    assert main(["map", ref, "--part", "vision", "--out", str(out)]) == 0
    cov = json.loads((out / "coverage.json").read_text())
    assert cov["counts"]["uncovered"] == 0 and sum(cov["counts"].values()) > 0


def test_documented_dimensions():
    """The batch, the config's int fields (image_size is the config's, not a count of
    images), one image a sample; anything else is not guessed."""
    from onboarding.load.vision import _dim

    cfg = SimpleNamespace(image_size=8, max_num_tiles=4)
    assert [_dim(n, 2, cfg) for n in ("batch_size", "image_size", "max_num_tiles",
                                      "max_num_images", "num_concurrent_media", "3")] == \
        [2, 8, 4, 1, 1, 3]
    assert _dim("sequence_length", 2, cfg) is None and _dim("image_tokens", 2, cfg) is None


class _VideoTower(nn.Module):
    """Whole clips [B, C, frames, H, W] cut by a Conv3d (temporal patches), no grid argument."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace()
        self.proj = nn.Conv3d(3, 8, kernel_size=(2, 4, 4), stride=(2, 4, 4))

    def forward(self, pixel_values):
        assert pixel_values.ndim == 5 and pixel_values.shape[-1] > 4  # clips, not single patches
        return (self.proj(pixel_values).flatten(2).transpose(1, 2),)


def test_tokens_of_whole_clips_cut_by_a_3d_kernel():
    """Patches a whole image makes, for a 3-D (temporal) kernel: the channels and frames are not
    planes. Before, the kernel's rank was read after it was cut to its last two dims: 3 x the
    patches (the channels counted as tiles)."""
    tower = _VideoTower()
    part = VisionPart("tower", tower, tower.config)
    (pixels,) = part.example_inputs(1, 16)
    assert list(pixels.shape) == [1, 3, 2, 16, 16] and part._layout[0] == "images"
    assert part.tokens_per_image(1, 16) == 16 == part(pixels).numel() // 8
