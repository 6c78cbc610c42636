"""Resolve a MODEL reference into a buildable model: a config plus a factory.

MODEL forms (docs/design.md):
  - a directory in the Hugging Face layout (config.json, optional remote code and weights);
  - ``hf:<model_type>`` with the default config of an architecture transformers knows;
  - ``path/to/file.py:Name`` or ``package.module:Name`` (an nn.Module class or a factory);
  - the name of a built-in example under ``examples/`` (``example``: the default one).

Nothing here allocates weights: `LoadedModel.build` takes a device, and the full-size model is
built on ``meta``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from onboarding.errors import InputError
from onboarding.load.examples import (DEFAULT_EXAMPLE, EXAMPLE_ALIAS, EXAMPLES_DIR,  # noqa: F401
                                      builtin_example, list_examples, model_forms)  # (re-exported)
from onboarding.load.overrides import apply_overrides, type_matches
from onboarding.load.multimodal import build_language_model, has_causal_lm, whole_of_causal_lm


@dataclass(kw_only=True)
class LoadedModel:
    """A resolved MODEL: where it came from, its config (if any) and how to build it."""

    ref: str
    name: str
    source: str  # "directory" | "example" | "hf" | "module" | "file"
    config: Any | None
    trust_remote_code: bool = False
    weights: list[Path] = field(default_factory=list)
    directory: Path | None = None  # where the model's own code lives (remote code only)
    compat_shims: list[dict[str, str]] = field(default_factory=list)  # see load.compat
    impl_note: str | None = None  # remote code whose model_type transformers also implements
    part: str = "language"  # "vision": the vision tower alone (onboarding.load.vision)
    _factory: Callable[..., nn.Module] | None = None
    factory_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def is_hf(self) -> bool:
        return self.config is not None and self._factory is None

    def factory_arguments(self) -> list[str] | None:
        """The names ``--set`` gives a factory (a class's constructor arguments); None for a
        model built from its config."""
        if self.is_hf or self._factory is None:
            return None
        try:
            return list(inspect.signature(self._factory).parameters)
        except (TypeError, ValueError):  # a builtin or extension callable: no signature
            return []

    @property
    def probe_proxy(self) -> Callable[[Any], bool] | None:
        """For a model taken out of a multimodal one: whether a (small) config builds and runs a
        few tokens on the CPU; None for the rest."""
        if not self.is_hf or (self.part == "language"
                              and has_causal_lm(self.config, self.trust_remote_code)):
            return None
        from onboarding.load.multimodal import runs

        return lambda cfg: runs(self, cfg)

    def build(self, config: Any | None = None, *, device: str | torch.device = "cpu",
              dtype: torch.dtype | None = None, seed: int | None = 0,
              init: bool = True) -> nn.Module:
        """Build the model (``config`` defaults to the full-size one) on ``device``.

        The same seed gives the same weights. Errors from the user's code become `InputError`.
        ``init=False``: the weight initialization is skipped (torch.nn.init's functions and
        transformers' ``init_weights``, transformers' own ``no_init_weights``) and every floating
        parameter is filled from one fixed pattern instead (`fill_parameters`): a model that runs,
        made without the seed's initialization, which fills each tensor on one CPU thread, for
        what needs a forward but not the seed's weights (the training preflight's op graph).
        Buffers are the constructors' own either way.
        """
        if seed is not None:
            torch.manual_seed(seed)
        cfg = config if config is not None else self.config
        from transformers.initialization import no_init_weights

        try:
            with torch.device(device), (contextlib.nullcontext() if init else no_init_weights()):
                if self._factory is not None:
                    model = self._factory(**self.factory_kwargs)
                elif self.part == "vision":
                    from onboarding.load.vision import build_vision_part

                    model = build_vision_part(cfg, self.trust_remote_code, device, self.ref)
                elif not has_causal_lm(cfg, self.trust_remote_code):
                    # multimodal / bare decoder: its language model as a causal LM
                    model = build_language_model(cfg, self.trust_remote_code, device)
                else:
                    from transformers import AutoModelForCausalLM

                    kwargs = {"trust_remote_code": self.trust_remote_code}
                    if dtype is not None:
                        kwargs["dtype"] = dtype
                    model = AutoModelForCausalLM.from_config(cfg, **kwargs)
                    if torch.device(device).type == "meta":  # its towers, for the accounting
                        object.__setattr__(model, "whole_model", functools.partial(
                            whole_of_causal_lm, model, cfg, self.trust_remote_code))
        except InputError:
            raise
        except Exception as exc:  # the user's model code failed: report it as their input
            if self.directory is not None:
                from onboarding.load.compat import raise_remote

                raise_remote(exc, ref=self.ref, what="building the model", config=cfg,
                             directory=self.directory)
            site = model_code_site(exc) if self.is_hf else None
            where = (f" at {site} (a config field that line reads may need a value: "
                     "--set KEY=VALUE)") if site else ""
            raise InputError(f"{self.ref}: building the model failed: "
                             f"{type(exc).__name__}: {_first_line(exc)}{where}") from exc
        if not isinstance(model, nn.Module):
            raise InputError(f"{self.ref}: the factory returned {type(model).__name__}, "
                             "not a torch.nn.Module")
        if not init:
            fill_parameters(model)
        if dtype is not None:
            model = model.to(dtype)
        return model


# `fill_parameters`' period: a prime, so that no weight row or expert repeats another's values
FILL_PERIOD = 1_000_003


@torch.no_grad()
def fill_parameters(model: nn.Module, std: float = 0.02) -> None:
    """Every floating parameter of ``model`` (not on ``meta``) from one fixed block of
    `FILL_PERIOD` normal(0, ``std``) values, laid end to end across the parameters in order: two
    broadcast copies a parameter, on every CPU thread (690 M parameters: 3 s on this project's
    loaded 2-core machine, first touch of the memory included; `normal_` alone on one 690 M
    tensor took 6 s there). The same model gets the same values."""
    block = torch.randn(FILL_PERIOD, generator=torch.Generator().manual_seed(0)) * std
    pos = 0
    for p in model.parameters():
        if not p.is_floating_point() or p.device.type == "meta":
            continue
        src = block.roll(-(pos % FILL_PERIOD)).to(device=p.device, dtype=p.dtype)
        flat = p.view(-1) if p.is_contiguous() else torch.empty(p.numel(), dtype=p.dtype,
                                                               device=p.device)
        rows, rest = divmod(flat.numel(), FILL_PERIOD)
        flat[:rows * FILL_PERIOD].view(rows, FILL_PERIOD).copy_(src.expand(rows, FILL_PERIOD))
        flat[rows * FILL_PERIOD:].copy_(src[:rest])
        if not p.is_contiguous():
            p.copy_(flat.view(p.shape))
        pos += flat.numel()


def model_code_site(exc: BaseException) -> str | None:
    """``modeling_x.py:LINE (`source`)`` of the innermost frame of ``exc`` in transformers' model
    code (its ``models/`` folder), or None: where a config transformers ships (an ``hf:`` type's
    defaults) or one given with ``--set`` fails to build, which the exception's text alone does
    not say (hf:lfm2_moe's default ``layer_types`` is None: "'NoneType' object is not
    subscriptable")."""
    import linecache

    import transformers

    from onboarding.load.compat import innermost_frame

    models = Path(transformers.__file__).resolve().parent / "models"
    frame = innermost_frame(exc, lambda f: Path(f).resolve().is_relative_to(models))
    if frame is None:
        return None
    line = linecache.getline(*frame).strip()
    return f"{Path(frame[0]).name}:{frame[1]}" + (f" (`{line}`)" if line else "")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else ""


_MODULE_REF = re.compile(r"^(?P<mod>[A-Za-z_][\w.]*|.+\.py):(?P<name>[A-Za-z_]\w*)$")


def load_model(ref: str | None, *, overrides: dict[str, Any] | None = None,
               trust_remote_code: bool = False, impl: str = "auto",
               part: str = "language") -> LoadedModel:
    """Resolve ``ref`` (None: the default example) and apply ``--set`` overrides.

    ``impl``: for a directory with remote code whose model_type the installed transformers also
    implements, ``native`` uses transformers' own classes (only when their parameter names and
    shapes agree with the remote model's), ``remote`` (and ``auto``) the model's code.
    ``part="vision"``: the vision tower of a multimodal model (exit 2 when there is none)."""
    ref = ref or DEFAULT_EXAMPLE
    overrides = overrides or {}
    if ref.startswith("hf:"):
        loaded = _load_hf_type(ref)
    elif (m := _MODULE_REF.match(ref)) and not Path(ref).is_dir():
        loaded = _load_python_ref(ref, m.group("mod"), m.group("name"))
    elif Path(ref).is_dir():
        loaded = _load_directory(ref, Path(ref), "directory", trust_remote_code, impl)
    elif (example := builtin_example(ref)) is not None:
        # Built-in examples are our own code: running them needs no flag. The alias is only a
        # spelling: what is recorded (model.json's ref, the run's name) is the example's name.
        loaded = _load_directory(example, EXAMPLES_DIR / example, "example", True)
    elif Path(ref).exists():
        raise InputError(f"{ref}: not a model directory (expected a directory with config.json)")
    else:
        raise InputError(f"{ref}: no such path; MODEL is {model_forms()}")
    if overrides:
        if loaded.config is not None and loaded._factory is None:
            apply_overrides(loaded.config, overrides)
        else:
            _apply_factory_overrides(loaded, overrides)
    if part != "language":
        from onboarding.load.vision import select_part

        select_part(loaded, part)
    return loaded


def _load_hf_type(ref: str) -> LoadedModel:
    from transformers import AutoConfig

    from transformers import CONFIG_MAPPING

    model_type = ref[3:]
    if model_type not in CONFIG_MAPPING:
        raise InputError(f"{ref}: unknown model_type {model_type!r} for the installed "
                         "transformers")
    try:
        config = AutoConfig.for_model(model_type)
    except Exception as exc:  # the type's own default config fails its validation: bad input
        raise InputError(f"{ref}: the default config of model_type {model_type!r} does not "
                         f"build in the installed transformers: {type(exc).__name__}: "
                         f"{' '.join(str(exc).split())[:400]}") from exc
    return LoadedModel(ref=ref, name=model_type, source="hf", config=config)


def _load_directory(ref: str, path: Path, source: str, trust_remote_code: bool,
                    impl: str = "auto") -> LoadedModel:
    from transformers import AutoConfig

    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise InputError(f"{ref}: directory has no config.json")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"{cfg_file}: malformed JSON (line {exc.lineno}: {exc.msg})") from exc
    if not isinstance(raw, dict):
        raise InputError(f"{cfg_file}: expected a JSON object")
    auto_map = raw.get("auto_map") or {}
    native = _native_type(raw) if auto_map else None
    if auto_map and impl == "native":
        return _load_native(ref, path, source, raw, trust_remote_code)
    if auto_map and not trust_remote_code:
        raise InputError(f"{ref}: the model ships its own code ({', '.join(sorted(auto_map))} "
                         "in auto_map); read it, then pass --trust-remote-code to run it"
                         + (f" (or --impl native: the installed transformers implements "
                            f"model_type {native!r})" if native else ""))
    if not auto_map:
        model_type = raw.get("model_type")
        from transformers import CONFIG_MAPPING

        if model_type not in CONFIG_MAPPING:
            raise InputError(f"{cfg_file}: unknown model_type {model_type!r} and no auto_map "
                             "with remote code")
    shims: list[dict[str, str]] = []
    if auto_map:
        from onboarding.load import compat

        compat.check_auto_map(ref, path, auto_map)
        shims = compat.install_shims(path)
    try:
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=bool(auto_map))
    except Exception as exc:
        if auto_map:
            compat.raise_remote(exc, ref=ref, what="reading the config", directory=path)
        raise InputError(f"{ref}: transformers could not read the config: "
                         f"{type(exc).__name__}: {_first_line(exc)}") from exc
    if auto_map:
        compat.install_config_shims(config, shims, path)
    weights = sorted(path.glob("*.safetensors"))
    name = path.resolve().name
    return LoadedModel(ref=ref, name=name, source=source, config=config,
                       trust_remote_code=bool(auto_map), weights=weights,
                       directory=path if auto_map else None, compat_shims=shims,
                       impl_note=(f"remote code; model_type {native!r} is also implemented in "
                                  "the installed transformers: --impl native uses that when "
                                  "its parameter names and shapes agree") if native else None)


def _native_type(raw: dict) -> str | None:
    """config.json's model_type when the installed transformers implements it (with a CausalLM)."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    mt = raw.get("model_type")
    return mt if mt in CONFIG_MAPPING and mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else None


def _load_native(ref: str, path: Path, source: str, raw: dict,
                 trust_remote_code: bool) -> LoadedModel:
    """``--impl native``: transformers' own classes for the directory's model_type, used only when
    their parameter names and shapes agree with the remote model's (built on meta when its code
    may run, else the shipped safetensors' headers)."""
    import transformers
    from transformers import CONFIG_MAPPING

    from onboarding.load.weights import check_fit, read_shapes

    mt = raw.get("model_type")
    if _native_type(raw) is None:
        raise InputError(f"{ref}: --impl native: model_type {mt!r} has no causal-LM "
                         f"implementation in the installed transformers "
                         f"{transformers.__version__}; run the model's own code "
                         "(--impl remote --trust-remote-code)")
    try:
        config = CONFIG_MAPPING[mt].from_dict({k: v for k, v in raw.items() if k != "auto_map"})
    except Exception as exc:
        raise InputError(f"{ref}: --impl native: transformers' {mt} config cannot read "
                         f"config.json: {type(exc).__name__}: {_first_line(exc)}") from exc
    weights = sorted(path.glob("*.safetensors"))
    loaded = LoadedModel(ref=ref, name=path.resolve().name, source=source, config=config,
                         weights=weights, impl_note=f"--impl native: transformers' own {mt} "
                         "classes, not the model's code")
    model = loaded.build(device="meta", seed=None)
    if trust_remote_code:
        remote = _load_directory(ref, path, source, True, "remote")
        other = remote.build(device="meta", seed=None).state_dict()
        against = "the model's own code"
    elif weights:
        other, against = read_shapes(weights), "the shipped safetensors"
    else:
        raise InputError(f"{ref}: --impl native: checking that transformers' {mt} has the "
                         "parameter names and shapes of the model's own code runs that code: "
                         "pass --trust-remote-code too")
    problems = check_fit(model, other)
    if problems:
        raise InputError(f"{ref}: --impl native: transformers' own {mt} does not match "
                         f"{against}: {'; '.join(problems)}; use --impl remote "
                         "--trust-remote-code")
    return loaded


def _load_python_ref(ref: str, mod: str, name: str) -> LoadedModel:
    if mod.endswith(".py"):
        file = Path(mod)
        if not file.is_file():
            raise InputError(f"{ref}: no such file {mod}")
        mod_name = f"_onboard_user_{abs(hash(file.resolve()))}"
        spec = importlib.util.spec_from_file_location(mod_name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(mod_name, None)
            raise InputError(f"{ref}: importing {mod} failed: {type(exc).__name__}: "
                             f"{_first_line(exc)}") from exc
        source = "file"
    else:
        try:
            module = importlib.import_module(mod)
        except ImportError as exc:
            raise InputError(f"{ref}: cannot import module {mod!r}: {exc}") from exc
        source = "module"
    obj = getattr(module, name, None)
    if obj is None:
        raise InputError(f"{ref}: {mod} has no attribute {name!r}")
    config = None
    if inspect.isclass(obj):
        if not issubclass(obj, nn.Module):
            raise InputError(f"{ref}: {name} is a class but not a torch.nn.Module")
        config_class = getattr(obj, "config_class", None)
        if config_class is not None and _takes_config(obj):
            # A transformers-style model class: build it from its config class' defaults.
            config = config_class()
            factory = obj
            return LoadedModel(ref=ref, name=name, source=source, config=config,
                               _factory=lambda **kw: factory(config), factory_kwargs={})
    elif not callable(obj):
        raise InputError(f"{ref}: {name} is a {type(obj).__name__}, not an nn.Module "
                         "class or factory")
    return LoadedModel(ref=ref, name=name, source=source, config=None, _factory=obj)


def _takes_config(cls: type) -> bool:
    try:
        params = list(inspect.signature(cls.__init__).parameters)
    except (TypeError, ValueError):
        return False
    return len(params) >= 2 and params[1] == "config"


def _apply_factory_overrides(loaded: LoadedModel, overrides: dict[str, Any]) -> None:
    if loaded.config is not None:
        apply_overrides(loaded.config, overrides)
        return
    sig = inspect.signature(loaded._factory)
    accepts_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    for key, value in overrides.items():
        param = sig.parameters.get(key)
        if param is None and not accepts_any:
            raise InputError(f"--set {key}: unknown key; {loaded.ref} accepts "
                             f"{', '.join(sig.parameters) or 'no arguments'}")
        default = param.default if param is not None else None
        if default is not inspect.Parameter.empty and default is not None:
            if not type_matches(default, value):
                raise InputError(f"--set {key}={value!r}: expected "
                                 f"{type(default).__name__}, got {type(value).__name__}")
        loaded.factory_kwargs[key] = value
