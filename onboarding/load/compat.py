"""Remote code written for transformers 4.x, run under the installed transformers 5.

Two jobs, both for a model directory whose ``auto_map`` ships its own code:

- `install_shims`: read the remote ``*.py`` files (AST only, nothing runs), find the 4.x names and
  behaviours they use that the installed transformers removed or changed, and supply those:
  the ``transformers.modeling_attn_mask_utils`` module (also where the installed one cannot build
  float64 masks, as 5.25's deprecated copy), ``is_*_available`` probes, the
  ``<Prefix>FlashAttention2`` / ``<Prefix>SdpaAttention`` class aliases, the legacy-cache methods
  of ``Cache`` (``from_legacy_cache``, ``to_legacy_cache``, ``get_usable_length``,
  ``seen_tokens``), and ``config.rope_scaling is None`` for "no scaling". A shim goes in only when
  the code uses the name *and* the installed transformers lacks it; each one used is returned
  (name, why, where the code uses it) for ``model.json`` and the report.
- `describe_failure`: an exception raised inside remote code (at import, at build or in forward)
  becomes one line naming the file and line (``modeling_x.py:123``), the transformers version the
  code was written for (``config.json``'s ``transformers_version``) and, for a missing package,
  its real PyPI name.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from onboarding.errors import InputError

# ---------------------------------------------------------------------------------------------
# what the remote code uses


@dataclass
class RemoteUses:
    """Names the remote files use, each with its first ``file:line``."""

    imports: dict[tuple[str, str], str]  # (module, name) from `from module import name`
    modules: dict[str, str]  # modules imported (`import m`, `from m import ...`)
    attrs: dict[str, str]  # attribute names read anywhere (`x.name`)


def scan_remote_code(directory: Path) -> RemoteUses:
    """The transformers names the directory's ``*.py`` files import and the attributes they read."""
    uses = RemoteUses({}, {}, {})
    for file in sorted(Path(directory).glob("*.py")):
        try:
            tree = ast.parse(file.read_text(), filename=str(file))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue  # the import itself will fail and `describe_failure` names the line
        for node in ast.walk(tree):
            where = f"{file.name}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                uses.modules.setdefault(node.module, where)
                for alias in node.names:
                    uses.imports.setdefault((node.module, alias.name), where)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    uses.modules.setdefault(alias.name, where)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                uses.attrs.setdefault(node.attr, where)
    return uses


# ---------------------------------------------------------------------------------------------
# 4.x attention-mask helpers (transformers.modeling_attn_mask_utils, removed in 5)


def _min(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).min


class AttentionMaskConverter:
    """The 4.x mask converter: 2-D padding masks and causal (optionally sliding) masks as additive
    4-D float masks [batch, 1, query, key] holding 0 where attended and the dtype's minimum
    elsewhere."""

    def __init__(self, is_causal: bool, sliding_window: int | None = None):
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        self.is_causal = is_causal
        self.sliding_window = sliding_window

    def to_causal_4d(self, batch_size, query_length, key_value_length, dtype=torch.float32,
                     device="cpu"):
        if not self.is_causal:
            raise ValueError("to_causal_4d needs a causal converter")
        past = key_value_length - query_length
        if query_length > 1 or self.sliding_window is not None:
            return self._make_causal_mask((batch_size, query_length), dtype, device, past,
                                          self.sliding_window)
        return None

    def to_4d(self, attention_mask_2d, query_length, dtype=torch.float32, key_value_length=None):
        bsz = attention_mask_2d.shape[0]
        causal = None
        if self.is_causal and (query_length > 1 or self.sliding_window is not None):
            if key_value_length is None:
                raise ValueError("a causal mask needs key_value_length")
            causal = self._make_causal_mask((bsz, query_length), dtype, attention_mask_2d.device,
                                            key_value_length - query_length, self.sliding_window)
        expanded = self._expand_mask(attention_mask_2d, dtype, query_length).to(
            attention_mask_2d.device)
        if causal is not None:
            expanded = causal.masked_fill(expanded.bool(), _min(dtype))
        return expanded

    @staticmethod
    def _make_causal_mask(input_ids_shape, dtype, device, past_key_values_length=0,
                          sliding_window=None):
        bsz, tgt = input_ids_shape
        total = tgt + past_key_values_length
        q = torch.arange(tgt, device=device)[:, None] + past_key_values_length
        k = torch.arange(total, device=device)[None, :]
        blocked = k > q
        if sliding_window is not None:
            blocked = blocked | (k <= q - sliding_window)
        mask = torch.zeros(tgt, total, dtype=dtype, device=device).masked_fill(blocked, _min(dtype))
        return mask[None, None].expand(bsz, 1, tgt, total)

    @staticmethod
    def _expand_mask(mask, dtype, tgt_len=None):
        bsz, src = mask.shape
        tgt = tgt_len if tgt_len is not None else src
        expanded = mask[:, None, None, :].expand(bsz, 1, tgt, src).to(dtype)
        inverted = 1.0 - expanded
        return inverted.masked_fill(inverted.to(torch.bool), _min(dtype))

    @staticmethod
    def _unmask_unattended(expanded_mask, min_dtype):
        # rows masked everywhere (left padding) attend everywhere instead of producing NaNs
        fully = torch.all(expanded_mask == min_dtype, dim=-1, keepdim=True)
        return expanded_mask.mul(~fully)

    @staticmethod
    def _ignore_causal_mask_sdpa(attention_mask, inputs_embeds, past_key_values_length,
                                 sliding_window=None, is_training=False):
        # always materialise the mask: correct everywhere, never relies on is_causal
        return False


def _prepare_4d_causal_attention_mask(attention_mask, input_shape, inputs_embeds,
                                      past_key_values_length, sliding_window=None):
    conv = AttentionMaskConverter(is_causal=True, sliding_window=sliding_window)
    kv_len = input_shape[-1] + past_key_values_length
    dtype, device = inputs_embeds.dtype, inputs_embeds.device
    if attention_mask is not None and attention_mask.dim() == 2:
        return conv.to_4d(attention_mask, input_shape[-1], dtype=dtype, key_value_length=kv_len)
    if attention_mask is not None and attention_mask.dim() == 4:
        expected = (input_shape[0], 1, input_shape[1], kv_len)
        if tuple(attention_mask.shape) != expected:
            raise ValueError(f"attention mask of shape {tuple(attention_mask.shape)}, "
                             f"expected {expected}")
        inverted = 1.0 - attention_mask.to(dtype)
        return inverted.masked_fill(inverted.to(torch.bool), _min(dtype))
    return AttentionMaskConverter._make_causal_mask(input_shape, dtype, device,
                                                    past_key_values_length, sliding_window)


def _prepare_4d_attention_mask(mask, dtype, tgt_len=None):
    return AttentionMaskConverter._expand_mask(mask, dtype, tgt_len)


def _attn_mask_module() -> types.ModuleType:
    mod = types.ModuleType("transformers.modeling_attn_mask_utils",
                           "4.x attention-mask helpers supplied by onboard's compatibility layer")
    mod.AttentionMaskConverter = AttentionMaskConverter
    mod._prepare_4d_causal_attention_mask = _prepare_4d_causal_attention_mask
    # the SDPA variants returned None when a mask could be skipped; a materialised mask is
    # always correct for SDPA too
    mod._prepare_4d_causal_attention_mask_for_sdpa = _prepare_4d_causal_attention_mask
    mod._prepare_4d_attention_mask = _prepare_4d_attention_mask
    mod._prepare_4d_attention_mask_for_sdpa = _prepare_4d_attention_mask
    mod.__onboard_shim__ = True
    return mod


# ---------------------------------------------------------------------------------------------
# 4.x legacy-cache methods (removed from transformers.cache_utils.Cache in 5)


def _from_legacy_cache(cls, past_key_values=None):
    cache = cls()
    for i, layer in enumerate(past_key_values or ()):
        cache.update(layer[0], layer[1], i)
    return cache


def _to_legacy_cache(self):
    return tuple((layer.keys, layer.values) for layer in getattr(self, "layers", ()))


def _get_usable_length(self, new_seq_length, layer_idx=0):
    previous = self.get_seq_length(layer_idx)
    max_length = self.get_max_length(layer_idx) if hasattr(self, "get_max_length") else None
    # 4.x: None meant "no maximum"; 5 says -1
    if max_length is not None and max_length >= 0 and previous + new_seq_length > max_length:
        return max_length - new_seq_length
    return previous


_CACHE_METHODS: dict[str, Callable[[], Any]] = {
    "from_legacy_cache": lambda: classmethod(_from_legacy_cache),
    "to_legacy_cache": lambda: _to_legacy_cache,
    "get_usable_length": lambda: _get_usable_length,
    "seen_tokens": lambda: property(lambda self: self.get_seq_length()),
}

# 4.x probes whose answer under torch 2.x is always yes
_ALWAYS_TRUE = ("is_torch_fx_available", "is_torch_sdpa_available")


# ---------------------------------------------------------------------------------------------
# install


# where a name that left its 4.x module may live now
_HOMES = ("transformers", "transformers.utils", "transformers.pytorch_utils",
          "transformers.modeling_utils", "transformers.configuration_utils",
          "transformers.cache_utils", "transformers.utils.generic",
          "transformers.utils.import_utils")


def _moved(name: str) -> str | None:
    for home in _HOMES:
        mod = _module_or_none(home)
        try:
            if mod is not None and getattr(mod, name, None) is not None:
                return home
        except Exception:  # noqa: BLE001 - a lazy attribute that fails to import
            continue
    return None


def _missing_module(name: str) -> bool:
    if name in sys.modules:
        return getattr(sys.modules[name], "__onboard_shim__", False)
    try:
        importlib.import_module(name)
        return False
    except ImportError:
        return True


def _masks_fail_in_float64(name: str) -> bool:
    """Whether the installed 4.x mask helpers cannot build a float64 causal mask (onboard's
    reference dtype). transformers 5.25 brought `modeling_attn_mask_utils` back, deprecated, as
    4.x had it: its causal mask fills a float32 tensor with float64's minimum and raises."""
    import warnings

    try:
        fn = importlib.import_module(name)._prepare_4d_causal_attention_mask
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mask = fn(None, (1, 2), torch.zeros(1, 2, 1, dtype=torch.float64), 0)
        return not (isinstance(mask, torch.Tensor) and mask.dtype == torch.float64
                    and bool((mask[..., 0, 1] < -1e300).all()) and bool((mask[..., 1, :] == 0).all()))
    except Exception:  # noqa: BLE001 - whatever fails here fails in the remote code's forward
        return True


def _module_or_none(name: str):
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - a module the installed transformers lacks
        return None


_INSTALLED: dict[tuple[str, str], str] = {}  # (module, name) supplied -> why


def _replacement(module: str, name: str, installed: str) -> tuple[Any, str]:
    """What stands in for ``module.name`` (which the installed transformers lacks), and why;
    (None, "") when nothing does."""
    if name in _ALWAYS_TRUE:
        return (lambda: True), (f"removed in transformers 5 (installed {installed}); always "
                                "true under torch 2")
    m = re.fullmatch(r"(\w+?)(FlashAttention2|SdpaAttention)", name)
    mod = importlib.import_module(module)
    if m and hasattr(mod, m.group(1) + "Attention"):
        return getattr(mod, m.group(1) + "Attention"), (
            "transformers 5 has one attention class per model dispatching on "
            f"attn_implementation; aliased to {m.group(1)}Attention")
    home = _moved(name)
    if home is not None:
        return getattr(importlib.import_module(home), name), (
            f"not in {module} in transformers {installed}; re-exported from {home}")
    if module == "transformers.cache_utils" and name.endswith("Cache"):
        from transformers.cache_utils import DynamicCache

        return type(name, (DynamicCache,), {"__module__": module, "__onboard_shim__": True}), (
            f"cache class removed in transformers 5 (installed {installed}); a DynamicCache "
            "stand-in for imports and isinstance checks (onboard runs the model without a "
            "cache)")
    return None, ""


def install_shims(directory: Path) -> list[dict[str, str]]:
    """Supply what the directory's remote code uses and the installed transformers lacks.

    Returns one entry per shim used: ``{"name", "why", "used_at"}``. Module-level shims go into
    ``sys.modules`` / onto transformers' classes (they only add names that are missing, so native
    models are unaffected); the config-level one is installed by `install_config_shims`.
    """
    import transformers

    uses = scan_remote_code(directory)
    used: list[dict[str, str]] = []

    def record(name: str, why: str, where: str) -> None:
        used.append({"name": name, "why": why, "used_at": where})

    installed = transformers.__version__
    # 1. whole modules removed in 5
    # (5.25 has it again, deprecated, as 4.x had it: unable to build float64 masks, onboard's
    # reference dtype; the supplied helpers replace it, transformers' own code not importing it)
    mask_mod = "transformers.modeling_attn_mask_utils"
    missing = mask_mod in uses.modules and _missing_module(mask_mod)
    if mask_mod in uses.modules and (missing or _masks_fail_in_float64(mask_mod)):
        why = (f"module removed in transformers 5 (installed {installed}); 4.x mask helpers "
               "supplied") if missing else (
            f"transformers {installed}'s deprecated copy of the module cannot build float64 masks "
            "(onboard's reference dtype); 4.x mask helpers supplied")
        mod = sys.modules.get(mask_mod)
        if mod is None or not getattr(mod, "__onboard_shim__", False):
            mod = _attn_mask_module()
            mod.__onboard_why__ = why
            sys.modules[mask_mod] = mod
        why = getattr(mod, "__onboard_why__", why)
        names = sorted(n for (m, n) in uses.imports if m == mask_mod) or ["(module)"]
        for n in names:
            if n == "(module)" or hasattr(mod, n):
                record(f"{mask_mod}.{n}" if n != "(module)" else mask_mod, why,
                       uses.imports.get((mask_mod, n), uses.modules[mask_mod]))
    # 2. names imported from modules that still exist but lost them
    for (module, name), where in sorted(uses.imports.items()):
        if not module.startswith("transformers") or module == mask_mod:
            continue
        mod = _module_or_none(module)
        if mod is None:
            continue
        if (module, name) in _INSTALLED:  # supplied for an earlier model of this process
            record(f"{module}.{name}", _INSTALLED[(module, name)], where)
            continue
        if hasattr(mod, name):
            continue
        value, why = _replacement(module, name, installed)
        if value is not None:
            setattr(mod, name, value)
            _INSTALLED[(module, name)] = why
            record(f"{module}.{name}", why, where)
    # 3. legacy-cache methods the code calls
    if any(m.startswith("transformers.cache_utils") for m in uses.modules) or \
            any(a in uses.attrs for a in _CACHE_METHODS):
        from transformers.cache_utils import Cache

        for attr, make in _CACHE_METHODS.items():
            if attr not in uses.attrs:
                continue
            if not hasattr(Cache, attr):
                setattr(Cache, attr, make())
                setattr(Cache, f"_onboard_shim_{attr}", True)
            elif not getattr(Cache, f"_onboard_shim_{attr}", False):
                continue  # the installed transformers has it
            record(f"transformers.cache_utils.Cache.{attr}",
                   f"legacy-cache API removed in transformers 5 (installed {installed})",
                   uses.attrs[attr])
    if "rope_scaling" in uses.attrs:
        record("config.rope_scaling", "transformers 5 reads rope_scaling as rope_parameters "
               "({'rope_type': 'default', ...} when unscaled); 4.x code expects None for no "
               "scaling and a 'type' key otherwise", uses.attrs["rope_scaling"])
    return used


def _rope_scaling_v4(self):
    params = getattr(self, "rope_parameters", None)
    if not params or params.get("rope_type", params.get("type")) == "default":
        return None
    out = dict(params)
    out.setdefault("type", out.get("rope_type"))
    return out


# remote-code package (``transformers_modules.<dir>``) -> the transformers version it targets:
# a proxy config rewrites ``transformers_version``, a failure in forward still names the original
_TARGETS: dict[str, str] = {}


def _package_of_file(filename: str) -> str | None:
    parts = Path(filename).parts
    if "transformers_modules" not in parts:
        return None
    i = parts.index("transformers_modules")
    return parts[i + 1] if len(parts) > i + 2 else None  # the directory's name (then a hash)


def install_config_shims(config: Any, shims: list[dict[str, str]],
                         directory: Path | None = None) -> None:
    """The config-level shims `install_shims` listed: on the remote config class only. Also
    remembers the version the directory's code targets, for failures in forward."""
    from transformers import PretrainedConfig

    version = target_version(config, directory)
    package = type(config).__module__.split(".")
    if version and package[0] == "transformers_modules" and len(package) > 2:
        _TARGETS[package[1]] = version
    if not any(s["name"] == "config.rope_scaling" for s in shims):
        return
    for cfg in [config, *(v for v in vars(config).values() if isinstance(v, PretrainedConfig))]:
        cls = type(cfg)
        if cls.__module__.split(".")[0] == "transformers" or "rope_scaling" in vars(cls):
            continue  # a native config class, or already shimmed
        base = getattr(PretrainedConfig, "rope_scaling", None)
        if isinstance(base, property):
            cls.rope_scaling = property(_rope_scaling_v4, base.fset)


# ---------------------------------------------------------------------------------------------
# failures inside remote code

# import name -> PyPI distribution, where they differ (a missing package cannot be asked)
PYPI_NAMES = {
    "fla": "flash-linear-attention", "flash_attn": "flash-attn",
    "flash_attn_interface": "flash-attn (hopper build)", "causal_conv1d": "causal-conv1d",
    "mamba_ssm": "mamba-ssm", "PIL": "pillow", "cv2": "opencv-python", "sklearn": "scikit-learn",
    "yaml": "PyYAML", "liger_kernel": "liger-kernel", "transformer_engine": "transformer-engine",
    "grouped_gemm": "grouped_gemm", "deep_gemm": "deep-gemm", "xformers": "xformers",
    "einops": "einops", "timm": "timm", "tiktoken": "tiktoken", "sentencepiece": "sentencepiece",
    "blobfile": "blobfile", "megablocks": "megablocks", "attn_gym": "attn-gym",
    "torchvision": "torchvision", "google.protobuf": "protobuf", "bitsandbytes": "bitsandbytes",
}


# packages that build CUDA extensions: installing them on a machine without a GPU does not help
CUDA_ONLY = frozenset({"flash_attn", "flash_attn_interface", "causal_conv1d", "mamba_ssm",
                       "deep_gemm", "transformer_engine", "grouped_gemm", "megablocks"})


def pypi_name(import_name: str) -> str:
    top = import_name.split(".")[0]
    if top in PYPI_NAMES:
        return PYPI_NAMES[top]
    try:
        from importlib.metadata import packages_distributions

        dists = packages_distributions().get(top)
        if dists:
            return dists[0]
    except Exception:  # noqa: BLE001
        pass
    return top.replace("_", "-")


_REQUIRES = re.compile(r"requires the following packages that were not found in your "
                       r"environment:\s*([^.\n]+)")


def missing_packages(exc: BaseException) -> list[str]:
    """Import names of the packages whose absence raised ``exc`` (or one of its causes)."""
    seen: list[str] = []
    e: BaseException | None = exc
    while e is not None:
        if isinstance(e, ModuleNotFoundError) and e.name:
            seen.append(e.name)
        if m := _REQUIRES.search(str(e)):
            seen += [p.strip() for p in m.group(1).split(",") if p.strip()]
        e = e.__cause__ or e.__context__
    return list(dict.fromkeys(seen))


def remote_site(exc: BaseException, directory: Path | None = None) -> str | None:
    """``file.py:line`` of the innermost frame of ``exc`` in remote code: a file under
    transformers' dynamic-module cache (``transformers_modules``) or in ``directory``."""
    names = {p.name for p in Path(directory).glob("*.py")} if directory else set()

    def is_remote(filename: str) -> bool:
        p = Path(filename)
        if "transformers_modules" in p.parts:
            return True
        return bool(directory) and p.name in names and \
            p.resolve().parent == Path(directory).resolve()

    frame = innermost_frame(exc, is_remote)
    return None if frame is None else f"{Path(frame[0]).name}:{frame[1]}"


def innermost_frame(exc: BaseException, is_remote: Callable[[str], bool]
                    ) -> tuple[str, int] | None:
    """(file, line) of the innermost frame of ``exc`` whose file ``is_remote`` takes (a
    SyntaxError's own file and line first), along its chain of causes and contexts; None."""
    e: BaseException | None = exc
    while e is not None:
        if isinstance(e, SyntaxError) and e.filename and is_remote(e.filename):
            return e.filename, e.lineno or 0
        frames = [f for f in traceback.extract_tb(e.__traceback__) if is_remote(f.filename)]
        if frames:
            return frames[-1].filename, frames[-1].lineno or 0
        e = e.__cause__ or e.__context__
    return None


def _target_of(exc: BaseException) -> str | None:
    frame = innermost_frame(exc, lambda f: "transformers_modules" in Path(f).parts)
    package = _package_of_file(frame[0]) if frame else None
    return _TARGETS.get(package) if package else None


def target_version(config: Any = None, directory: Path | None = None) -> str | None:
    """The transformers version the code was written for: config.json's ``transformers_version``."""
    if directory is not None:
        import json

        try:
            raw = json.loads((Path(directory) / "config.json").read_text())
            if isinstance(raw, dict) and raw.get("transformers_version"):
                return str(raw["transformers_version"])
        except (OSError, ValueError):
            pass
    return getattr(config, "transformers_version", None) if config is not None else None


def describe_failure(exc: BaseException, *, what: str, config: Any = None,
                     directory: Path | None = None) -> str | None:
    """One line for an exception raised in remote code (None when no frame is remote and no
    package is missing): what failed, ``file:line``, the targeted and installed transformers,
    the missing packages by their PyPI names."""
    import transformers

    site = remote_site(exc, directory)
    missing = missing_packages(exc)
    if site is None and missing and directory is not None:
        # transformers checks a file's imports before running it: name the import line
        modules = scan_remote_code(directory).modules
        site = next((w for m, w in modules.items()
                     if m.split(".")[0] == missing[0].split(".")[0]), None)
    if site is None and not missing:
        return None
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}"
    if missing:
        names = [pypi_name(m) for m in missing]
        text = (f"missing package{'s' if len(names) > 1 else ''} "
                f"{', '.join(f'{m} (pip install {n})' for m, n in zip(missing, names))}")
        cuda = [pypi_name(m) for m in missing if m.split(".")[0] in CUDA_ONLY]
        if cuda and not torch.cuda.is_available():
            text += (f"; {', '.join(cuda)} need{'s' if len(cuda) == 1 else ''} a CUDA GPU and "
                     "this machine has none, and the code imports it unconditionally (no "
                     "eager/torch path to fall back on)")
    where = f" at {site}" if site else ""
    version = target_version(None, directory) or _target_of(exc) or \
        target_version(config, None)
    written = f"the code was written for transformers {version}" if version else \
        "the code names no transformers_version"
    return (f"the model's own code failed {what}{where}: {text} ({written}; installed "
            f"{transformers.__version__})")


def raise_remote(exc: BaseException, *, ref: str, what: str, config: Any = None,
                 directory: Path | None = None, error: type[InputError] = InputError) -> None:
    """Re-raise ``exc`` as ``error`` when `describe_failure` recognises it; else return."""
    msg = describe_failure(exc, what=what, config=config, directory=directory)
    if msg is not None:
        raise error(f"{ref}: {msg}") from exc


def check_auto_map(ref: str, directory: Path, auto_map: Any) -> None:
    """Every ``auto_map`` entry onboard runs (the config and model classes) names a file the
    directory has and a class that file defines."""
    if not isinstance(auto_map, dict):
        raise InputError(f"{ref}: config.json's auto_map must be an object, got "
                         f"{type(auto_map).__name__}")
    for auto, target in auto_map.items():
        if not (auto == "AutoConfig" or auto.startswith("AutoModel")):
            continue  # tokenizers, processors: not what onboard runs
        for entry in target if isinstance(target, (list, tuple)) else [target]:
            if entry is None:
                continue
            if not isinstance(entry, str) or "." not in entry:
                raise InputError(f"{ref}: auto_map {auto}: expected 'module.Class', got {entry!r}")
            if "--" in entry:
                continue  # code in another repository: transformers fetches it
            module, cls = entry.rsplit(".", 1)
            file = Path(directory) / (module.replace(".", "/") + ".py")
            if not file.is_file():
                raise InputError(f"{ref}: auto_map {auto} points at {entry}, but the directory "
                                 f"has no {file.name}")
            try:
                tree = ast.parse(file.read_text(), filename=str(file))
            except SyntaxError as exc:
                raise InputError(f"{ref}: the model's own code does not parse: "
                                 f"{file.name}:{exc.lineno}: {exc.msg}") from exc
            if cls not in _top_level_names(tree):
                raise InputError(f"{ref}: auto_map {auto} points at {entry}, but {file.name} "
                                 f"defines no {cls}")


def _top_level_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):  # includes names bound under try/if at module level
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names
