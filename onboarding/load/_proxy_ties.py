"""Ties between config fields that the proxy's shrink broke, found by running the proxy.

A model's code may tie a width to others without the config saying so: Llama 4's vision
tower pixel-shuffles its features (hidden x 1 / ratio^2 wide) into a linear that reads
``intermediate_size`` (Llama-4-Scout: 1408 x 4 = 5632); the shrink, which caps the FFN width on
its own, gives a linear of 256 inputs the 4 x 128 = 512-wide features. Scaling every width by one
factor would not find it either where the config itself does not hold the tie (transformers'
default Llama4VisionConfig: hidden 768, intermediate 5632, so its own tower does not run).

So the tie is read off the proxy that does not run: every ``nn.Linear`` checks its input's
width before it runs, and the first one given a width other than its ``in_features`` names the
field: an int field of the config of the module that owns it (its nearest ancestor with a
``config``, the same sub-config of the proxy), equal to ``in_features`` and changed by the
shrink (its full-size value differs), takes the width the linear was given. The proxy is run
again, a few repairs at most; a repair is kept only if the proxy then runs. No class or model
names.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from torch import nn

MAX_REPAIRS = 4


class _Mismatch(RuntimeError):
    def __init__(self, path: str, in_features: int, width: int):
        super().__init__(f"{path} reads {in_features} features, given {width}")
        self.path, self.in_features, self.width = path, in_features, width


def _first_mismatch(model: nn.Module, run: Callable[[nn.Module], None]
                    ) -> _Mismatch | None | bool:
    """Run ``model`` with every linear checking its input width: True when it runs, the first
    mismatch seen (where one was seen), else None (it failed otherwise)."""
    seen: list[_Mismatch] = []
    handles = []
    for path, m in model.named_modules():
        if isinstance(m, nn.Linear):
            def check(mod, args, path=path):
                x = args[0] if args else None
                if hasattr(x, "shape") and x.shape and x.shape[-1] != mod.in_features:
                    seen.append(_Mismatch(path, mod.in_features, int(x.shape[-1])))
                    raise seen[-1]
            handles.append(m.register_forward_pre_hook(check))
    try:
        run(model)
        return True
    except Exception:  # noqa: BLE001 - the model's own code, whatever it raises
        return seen[0] if seen else None
    finally:
        for h in handles:
            h.remove()


def _owner_config(model: nn.Module, path: str) -> Any:
    """The config of the nearest module on ``path`` (the linear itself, then its parents) that
    has one."""
    parts = path.split(".") if path else []
    for i in range(len(parts), -1, -1):
        m = model.get_submodule(".".join(parts[:i]))
        if getattr(m, "config", None) is not None:
            return m.config
    return None


def _same_config(cfg: Any, owner: Any) -> list[tuple[tuple[str, ...], Any]]:
    """The sub-configs of ``cfg`` that are ``owner`` (or a copy of it: a class built from a
    copied config)."""
    from onboarding.load.multimodal import sub_configs

    subs = list(sub_configs(cfg))
    same = [(p, c) for p, c in subs if c is owner]
    if same:
        return same
    d = owner.to_dict() if hasattr(owner, "to_dict") else None
    return [(p, c) for p, c in subs if type(c) is type(owner) and d is not None and c.to_dict() == d]


def _get(cfg: Any, path: tuple[str, ...]) -> Any:
    for k in path:
        cfg = getattr(cfg, k, None)
    return cfg


def keep_ties(full: Any, cfg: Any, build: Callable[[Any], nn.Module],
              run: Callable[[nn.Module, Any], None]) -> tuple[Any, list[str]] | None:
    """A copy of the proxy config ``cfg`` (of the full config ``full``) with the ties the shrink
    broke kept (module docstring), and a note for each field changed; None when the proxy does
    not run for another reason or no repair makes it run. ``build(cfg)`` builds the proxy on
    the CPU, ``run(model, cfg)`` runs it (raising when it fails)."""
    cfg = copy.deepcopy(cfg)
    notes: list[str] = []
    for _ in range(MAX_REPAIRS + 1):
        try:
            model = build(cfg)
        except Exception:  # noqa: BLE001 - the model's own code, whatever it raises
            return None
        got = _first_mismatch(model, lambda m: run(m, cfg))
        if got is True:
            return (cfg, notes) if notes else None
        if got is None or len(notes) >= MAX_REPAIRS:
            return None
        owner = _owner_config(model, got.path)
        fixed = []
        for path, c in _same_config(cfg, owner) if owner is not None else []:
            was = _get(full, path)
            for k, v in list(vars(c).items()):
                if k.startswith("_") or not isinstance(v, int) or isinstance(v, bool) \
                        or v != got.in_features \
                        or getattr(was, k, None) == v:
                    continue
                setattr(c, k, got.width)
                fixed.append(".".join(path + (k,)))
        if not fixed:
            return None
        notes.append(f"{', '.join(fixed)} {got.in_features} -> {got.width}: the width "
                     f"{got.path} reads (a tie between config fields that the shrink broke, "
                     "found by running the proxy)")
    return None
