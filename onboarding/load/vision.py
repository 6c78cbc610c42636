"""``--part vision``: a multimodal model's vision tower as a model of its own, with synthetic pixel
inputs, so that parse, map and align see its blocks (patch embedding, attention, MLP, norms).

By structure and config conventions, never by class or model names:

- the *tower* is the module of the whole model (built from its own classes,
  `multimodal.build_whole`) whose ``config`` is the ``vision_config`` sub-config (the component
  the accounting calls ``vision``);
- the *inputs* come from the tower's forward signature and its first layer: the first parameter
  takes the pixels, a parameter whose name holds ``grid`` takes one (t, h, w) row per image (or
  (h, w)); the convolution with the fewest input channels (else an ``nn.Unfold`` and the first
  linear after it, which reads its patches; else the first linear) gives the channels and the
  patch size (a 3-D kernel: temporal patches too); the grid's height and width are multiples
  of every ``*merge*size*`` field of the config (patches merged after the tower), about
  ``sqrt(seq)`` patches a side. The pixel layouts that fit are tried in turn (flattened
  patches, patches, whole images: about ``sqrt(seq)`` patches a side, then the config's
  ``image_size``, which a tower with a fixed table of positions needs) and the first the tower
  runs on is kept;
- another input the forward requires (no default) is built from the shape its docstring
  documents (``name (`torch.Tensor` of shape `(batch_size, max_num_images, max_num_tiles)`)``):
  ``batch_size`` is the batch, a dimension that counts images is 1 (one image a sample), one
  named for an int field of the vision config is that field; an index input (``*_ids``) holds
  1 (0 is padding by convention), a mask ones. Whole images are also tried with the leading
  dimensions of those shapes ([batch, images, tiles, C, H, W]). An input that cannot be built
  so (no documented shape, a dimension or a kind it cannot tell) is an input error naming it.
"""

from __future__ import annotations

import inspect
import math
import re
from typing import Any

import torch
from torch import nn

from onboarding.errors import InputError


def vision_config_path(cfg: Any) -> tuple[str, ...] | None:
    """The attribute path of the vision tower's sub-config (the shallowest ``vision_config``)."""
    from onboarding.load.multimodal import sub_configs

    found = [p for p, _ in sub_configs(cfg) if p and p[-1] == "vision_config"]
    return min(found, key=len) if found else None


def _get(cfg: Any, path: tuple[str, ...]) -> Any:
    for k in path:
        cfg = getattr(cfg, k)
    return cfg


def find_tower(whole: nn.Module, vision_cfg: Any) -> tuple[str, nn.Module] | None:
    """(path, module): the shallowest module of ``whole`` built from ``vision_cfg``."""
    found = [(p, m) for p, m in whole.named_modules() if p and getattr(m, "config", None) is vision_cfg]
    return min(found, key=lambda pm: pm[0].count(".")) if found else None


def _merge_sizes(cfg: Any) -> tuple[int, int]:
    """(height, width) multiples the grid needs: every ``*merge*size*`` field of the config."""
    mh = mw = 1
    for k, v in vars(cfg).items():
        if "merge" not in k or "size" not in k:
            continue
        vals = [v, v] if isinstance(v, int) and not isinstance(v, bool) else list(v) \
            if isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(x, int) for x in v) \
            else None
        if vals and all(x > 0 for x in vals):
            mh, mw = math.lcm(mh, vals[0]), math.lcm(mw, vals[1])
    return mh, mw


def _first_layer(tower: nn.Module) -> nn.Module | None:
    """The layer that takes the pixels: the convolution with the fewest input channels (a later
    one, such as a patch-merging downsample, takes the tower's width), else the first linear."""
    convs = [m for m in tower.modules() if isinstance(m, nn.modules.conv._ConvNd)]
    if convs:
        return min(convs, key=lambda m: m.in_channels)
    return next((m for m in tower.modules() if isinstance(m, nn.Linear)), None)


def _pair(v: Any) -> tuple[int, int] | None:
    if isinstance(v, int) and not isinstance(v, bool):
        return (v, v)
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(x, int) for x in v):
        return tuple(v)
    return None


def _unfold_patches(tower: nn.Module) -> tuple[int, tuple[int, int]] | None:
    """(channels, kernel) of a tower that cuts images into patches with an ``nn.Unfold`` (no
    convolution) and projects them with the first linear after it: a convolution in two
    steps, which needs whole images [B, C, H, W]. None when there is no such pair."""
    mods = list(tower.modules())
    at = next((i for i, m in enumerate(mods) if isinstance(m, nn.Unfold)), None)
    if at is None:
        return None
    kernel = _pair(mods[at].kernel_size)
    lin = next((m for m in mods[at + 1:] if isinstance(m, nn.Linear)), None)
    if kernel is None or lin is None or lin.in_features % math.prod(kernel):
        return None
    return lin.in_features // math.prod(kernel), kernel


_DOC_SHAPE = re.compile(r"^\s*(\w+) \(`[^`]*` of shape `\(([^)`]*)\)`")


def documented_shapes(fn: Any) -> dict[str, list[str]]:
    """Argument name -> its documented shape's dimension names, from ``fn``'s docstring lines
    ``name (`torch.Tensor` of shape `(batch_size, max_num_tiles)`)`` (transformers' style)."""
    out: dict[str, list[str]] = {}
    for line in (inspect.getdoc(fn) or "").splitlines():
        if m := _DOC_SHAPE.match(line):
            out.setdefault(m.group(1), [d.strip() for d in m.group(2).split(",") if d.strip()])
    return out


def _dim(name: str, batch: int, cfg: Any) -> int | None:
    """The size of a documented dimension: the batch, a number, the vision config's int field
    of that name, or 1 for a count of images (``num_images``, ``max_num_images``: one image a
    sample); None otherwise."""
    if name == "batch_size":
        return batch
    if name.isdigit():
        return int(name)
    v = getattr(cfg, name, None) if cfg is not None else None
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return v
    return 1 if re.search(r"(^|_)num_(\w+_)?(images|media)$", name) else None


class VisionPart(nn.Module):
    """A vision tower as a model: ``forward(pixels, *more)`` (``more``: the grid, then the other
    inputs its forward requires, `extra_args`) runs it and returns every floating tensor of its
    output (features, merged features, intermediate features) flattened into one row, so that
    alignment's loss reaches every part of it."""

    def __init__(self, name: str, tower: nn.Module, config: Any):
        super().__init__()
        self.tower_name = name
        self.add_module(name, tower)
        self.config = config  # the vision sub-config
        sig = inspect.signature(tower.forward)
        params = [p for p in sig.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if not params:
            raise InputError(f"{type(tower).__name__}.forward takes no pixel argument")
        self.pixel_arg = params[0].name
        grid = [p.name for p in params[1:] if "grid" in p.name.lower()]
        self.grid_arg = grid[0] if grid else None
        needed = [p.name for p in params[1:] if p.default is p.empty and p.name not in grid]
        shapes = documented_shapes(tower.forward)
        # each other required input: (name, dimension names, dtype, fill value)
        self.extra_args: list[tuple[str, list[str], torch.dtype, int]] = []
        for n in needed:
            why = self._unbuildable(n, shapes.get(n))
            if why:
                raise InputError(f"the vision tower's forward also needs {n}: synthetic inputs "
                                 f"cannot supply it ({why})")
            # an index: 1 (0 is padding by convention); a mask: ones (nothing masked)
            self.extra_args.append((n, shapes[n], torch.long, 1))
        self._layout: tuple | None = None
        self._tokens: int | None = None  # patches an image of the kept layout makes

    def _unbuildable(self, name: str, dims: list[str] | None) -> str | None:
        """Why the required input ``name`` (documented shape ``dims``) cannot be built; None
        when it can."""
        if dims is None:
            return "its forward's docstring documents no shape for it"
        if not (re.search(r"ids?$", name) or "mask" in name):
            return "neither indices (*_ids) nor a mask: no value to give it"
        unknown = [d for d in dims if _dim(d, 1, self.config) is None]
        if unknown:
            return (f"its documented shape ({', '.join(dims)}) has {', '.join(unknown)}, "
                    "neither the batch, a count of images nor an int field of the vision config")
        return None

    @property
    def tower_module(self) -> nn.Module:
        return self._modules[self.tower_name]

    def forward(self, pixels: torch.Tensor, *more: torch.Tensor) -> torch.Tensor:
        names = ([self.grid_arg] if self.grid_arg is not None else []) + \
            [n for n, *_ in self.extra_args]
        kwargs = {self.pixel_arg: pixels, **dict(zip(names, more))}
        out = self.tower_module(**kwargs)
        flat, _ = torch.utils._pytree.tree_flatten(
            out.to_tuple() if hasattr(out, "to_tuple") else out)
        feats = [t for t in flat if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if not feats:
            raise InputError("the vision tower returned no floating tensor")
        return torch.cat([t.reshape(-1) for t in feats])[None]

    def _extras(self, batch: int) -> list[tuple[str, tuple[int, ...], torch.dtype, int]]:
        return [(n, tuple(_dim(d, batch, self.config) for d in dims), dt, v)
                for n, dims, dt, v in self.extra_args]

    def _patch_cut(self) -> tuple[int, tuple[int, ...]] | None:
        """(channels, kernel) of the layer that cuts images into patches: the tower's first
        convolution, else an unfold and the linear after it (`_unfold_patches`); None."""
        first = _first_layer(self.tower_module)
        if isinstance(first, nn.modules.conv._ConvNd):
            return first.in_channels, tuple(first.kernel_size)
        return _unfold_patches(self.tower_module)

    def _candidates(self, batch: int, seq: int) -> list[tuple[str, tuple, tuple | None]]:
        """(layout, pixel shape, grid) for each input form that fits the tower's first layer."""
        first = _first_layer(self.tower_module)
        if first is None:
            raise InputError("the vision tower has no convolution or linear layer to take pixels")
        mh, mw = _merge_sizes(self.config)
        side = max(1, round(math.sqrt(max(seq, 1))))
        h, w = mh * max(1, round(side / mh)), mw * max(1, round(side / mw))
        out: list[tuple[str, tuple, tuple | None]] = []
        cut = self._patch_cut()
        if cut is not None:
            chans, kernel = cut
            n = batch * h * w
            grids = [(batch, (1, h, w)), (batch, (h, w))] if self.grid_arg else [None]
            for g in grids:
                if isinstance(first, nn.modules.conv._ConvNd):  # an unfold takes whole images
                    out.append(("flat patches", (n, chans * math.prod(kernel)), g))
                    out.append(("patches", (n, chans, *kernel), g))
            if not self.grid_arg:
                frames = (kernel[0],) if len(kernel) == 3 else ()
                sizes = [tuple(k * s for k, s in zip(kernel[-2:], (h, w)))]
                if (cs := _pair(getattr(self.config, "image_size", None))) and cs not in sizes:
                    sizes.append(cs)  # a fixed table of positions: the config's images
                # the leading dimensions of the other inputs (images, tiles a sample)
                lead = [(batch,)]
                for _, shape, _, _ in self._extras(batch):
                    lead += [shape[:i] for i in range(2, len(shape) + 1)
                             if shape[0] == batch and shape[:i] not in lead]
                for size in sizes:
                    for pre in lead:
                        out.append(("images", (*pre, chans, *frames, *size), None))
        else:
            n = batch * h * w
            grids = [(batch, (1, h, w)), (batch, (h, w))] if self.grid_arg else [None]
            for g in grids:
                out.append(("flat patches", (n, first.in_features), g))
                if not self.grid_arg:
                    out.append(("patch sequence", (batch, h * w, first.in_features), None))
        return out

    def _args(self, shape: tuple, grid: tuple | None, batch: int, device: torch.device) -> tuple:
        pixels = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device)
        args = [pixels]
        if grid:
            args.append(torch.tensor([grid[1]] * grid[0], device=device))
        args += [torch.full(s, v, dtype=dt, device=device) for _, s, dt, v in self._extras(batch)]
        return tuple(args)

    def example_inputs(self, batch: int, seq: int) -> tuple:
        """Seeded pixels (grid, other inputs) the tower runs on; the first fitting layout is
        kept."""
        device = next((p.device for p in self.parameters()), torch.device("cpu"))
        errors = []
        cands = self._candidates(batch, seq)
        if self._layout is not None:
            cands = [c for c in cands if self._key(*c) == self._layout]
        for layout, shape, grid in cands:
            args = self._args(shape, grid, batch, device)
            if self._layout is None:
                try:
                    with torch.no_grad():
                        self(*args)
                except Exception as exc:  # noqa: BLE001 - the next layout may fit
                    errors.append(f"{layout} {list(shape)}: {type(exc).__name__}: "
                                  f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")
                    continue
                self._layout = self._key(layout, shape, grid)
            self._tokens = self._plane_tokens(layout, shape)
            return args
        extra = "".join(f"; with {n} {list(s)}" for n, s, _, _ in self._extras(batch))
        raise InputError("no synthetic pixel input runs the vision tower (tried "
                         + "; ".join(errors) + extra + ")")

    @staticmethod
    def _key(layout: str, shape: tuple, grid: tuple | None) -> tuple:
        """A layout as kept across calls: its name, its grid's rank, and for whole images their
        rank and size (fixed by the tower, not by batch or seq)."""
        return (layout, grid is not None and len(grid[1])) + \
            ((len(shape), shape[-2:]) if layout == "images" else ())

    def _plane_tokens(self, layout: str, shape: tuple) -> int | None:
        """Patches an image makes where whole images were given: its patches times the planes
        (tiles) between the batch and the channels."""
        if layout != "images":
            return None
        _, kernel = self._patch_cut()
        chans_at = len(shape) - 3 - (len(kernel) == 3)  # [*planes, C, (frames,) H, W]
        return math.prod(shape[1:chans_at]) * (shape[-2] // kernel[-2]) * (shape[-1] // kernel[-1])

    def tokens_per_image(self, batch: int, seq: int) -> int:
        if self._tokens is not None:  # whole images (`example_inputs` ran)
            return self._tokens
        mh, mw = _merge_sizes(self.config)
        side = max(1, round(math.sqrt(max(seq, 1))))
        return mh * max(1, round(side / mh)) * mw * max(1, round(side / mw))


def no_vision(ref: str, why: str) -> InputError:
    return InputError(f"{ref}: --part vision: the model has no vision part ({why})")


def build_vision_part(cfg: Any, trust_remote_code: bool, device: str | torch.device,
                      ref: str = "model") -> VisionPart:
    """The vision tower of ``cfg`` on ``device``: built alone from its own class when that gives
    the parameters it has in the whole model, else taken from the whole model."""
    from onboarding.load.multimodal import build_whole, layout

    path = vision_config_path(cfg)
    if path is None:
        raise no_vision(ref, "its config has no vision_config")
    vcfg = _get(cfg, path)
    lay = layout(cfg, trust_remote_code)  # the whole model on meta
    found = find_tower(lay.whole, vcfg)
    if found is None:
        if lay.node_path:  # the root did not build (a missing package, the model's own error)
            raise InputError(f"{ref}: --part vision: the vision tower was not built: the whole "
                             f"model was {'; '.join(lay.notes)}")
        raise no_vision(ref, "no module of the model is built from its vision_config")
    tpath, meta_tower = found
    name = tpath.rsplit(".", 1)[-1]
    if torch.device(device).type == "meta":
        part = VisionPart(name, meta_tower, vcfg)
        part.whole_path = tpath
        object.__setattr__(part, "whole_layout", lay)  # for the accounting by component
        return part
    tower = None
    with torch.device(device):
        try:
            cls = type(meta_tower)
            tower = cls._from_config(vcfg) if hasattr(cls, "_from_config") else cls(vcfg)
            if {n: p.shape for n, p in tower.named_parameters()} != \
                    {n: p.shape for n, p in meta_tower.named_parameters()}:
                tower = None
        except Exception:  # noqa: BLE001 - its class wants more than the config: use the whole
            tower = None
        if tower is None:
            whole, _, _ = build_whole(cfg, trust_remote_code)
            tower = whole.get_submodule(tpath)
    part = VisionPart(name, tower, vcfg)
    part.whole_path = tpath
    return part


def select_part(loaded: Any, part: str) -> None:
    """Make ``loaded`` (a `LoadedModel`) build its ``part``; exit 2 when the model has none."""
    if part != "vision":
        raise InputError(f"--part {part!r}: expected language or vision")
    if not loaded.is_hf:
        raise no_vision(loaded.ref, "a module or factory model has no config to find a vision "
                        "tower in")
    if vision_config_path(loaded.config) is None:
        raise no_vision(loaded.ref, f"{type(loaded.config).__name__} has no vision_config")
    loaded.part = "vision"
    loaded.name = f"{loaded.name}-vision"
