"""The ``*.safetensors`` a model directory ships, loaded into a model built at full size.

Every name and shape must fit: a checkpoint with tensors the model lacks, parameters it does not
hold (tied parameters count as held when one of their names is there) or other shapes is bad
input, named by its first mismatches; so is a file that is not whole (truncated, corrupt header).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from onboarding.errors import InputError

SHOWN = 3  # mismatches named per kind


def read_safetensors(files: list) -> dict[str, torch.Tensor]:
    """All tensors of ``files``; a truncated or corrupt file is an `InputError` naming it."""
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    for f in files:
        path = Path(f)
        try:
            with safe_open(str(path), framework="pt", device="cpu") as fh:
                for key in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                    if key in state:
                        raise InputError(f"{path}: tensor {key} is also in another "
                                         "safetensors file of the directory")
                    state[key] = fh.get_tensor(key)
        except InputError:
            raise
        except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError, ...
            lines = str(exc).strip().splitlines()
            size = path.stat().st_size if path.exists() else 0
            raise InputError(f"{path}: not a readable safetensors file ({size:,} bytes; "
                             f"truncated or corrupt?): {type(exc).__name__}: "
                             f"{lines[0] if lines else ''}") from exc
    return state


def _shown(items: list[str]) -> str:
    more = f", ... ({len(items) - SHOWN} more)" if len(items) > SHOWN else ""
    return ", ".join(items[:SHOWN]) + more


def check_fit(model: nn.Module, state: dict[str, torch.Tensor]) -> list[str]:
    """What does not fit between ``model`` and the checkpoint ``state`` (empty: it fits)."""
    own = model.state_dict(keep_vars=True)
    # names of one tied tensor (the same Parameter): any of them in the checkpoint loads them all
    groups: dict[int, list[str]] = {}
    for name, t in own.items():
        groups.setdefault(id(t), []).append(name)
    tied = {n: g for g in groups.values() if len(g) > 1 for n in g}
    # what transformers itself skips: the model's declared patterns, and checkpoint entries for
    # buffers it keeps out of its state dict (an old rotary inv_freq)
    skip_unexpected = _patterns(model, "_keys_to_ignore_on_load_unexpected")
    skip_missing = _patterns(model, "_keys_to_ignore_on_load_missing")
    buffers = {n for n, _ in model.named_buffers()}
    unexpected = sorted(k for k in state if k not in own and k not in buffers
                        and not any(p.search(k) for p in skip_unexpected))
    missing = sorted(k for k in own if k not in state
                     and not any(o in state for o in tied.get(k, ()))
                     and not any(p.search(k) for p in skip_missing))
    shapes = [f"{k} (checkpoint {list(state[k].shape)}, model {list(own[k].shape)})"
              for k in sorted(state) if k in own and tuple(state[k].shape) != tuple(own[k].shape)]
    problems = []
    if shapes:
        problems.append(f"{len(shapes)} of other shapes: {_shown(shapes)}")
    if unexpected:
        problems.append(f"{len(unexpected)} the model does not have: {_shown(unexpected)}")
    if missing:
        problems.append(f"{len(missing)} of the model's missing: {_shown(missing)}")
    return problems


def _patterns(model: nn.Module, attr: str) -> list[re.Pattern]:
    out = []
    for m in model.modules():
        for p in getattr(m, attr, None) or ():
            try:
                out.append(re.compile(p))
            except (re.error, TypeError):
                pass
    return out


def _raise_unfit(model: nn.Module, state: dict[str, torch.Tensor], files: list) -> None:
    problems = check_fit(model, state)
    if problems:
        where = files[0] if len(files) == 1 else f"{len(files)} safetensors files in " \
            f"{Path(files[0]).parent}"
        raise InputError(f"{where}: the weights do not fit the model: " + "; ".join(problems))


def read_shapes(files: list) -> dict[str, torch.Tensor]:
    """Every tensor of ``files`` as an empty ``meta`` tensor of its shape: headers only (a file
    whose data is cut short fails here too, as safetensors checks the sizes on open)."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as fh:
                for key in fh.keys():  # noqa: SIM118
                    out[key] = torch.empty(fh.get_slice(key).get_shape(), device="meta")
        except Exception:  # noqa: BLE001 - read_safetensors names the problem
            read_safetensors([f])
            raise
    return out


def check_shipped(info) -> None:
    """Before anything is written: the weights a full-size run would load fit the model (a
    ``meta`` build against the files' headers). ``info`` is the load stage's `ModelInfo`."""
    files = info.loaded.weights
    if not files or not info.proxy_note.startswith("full size"):
        return
    model = info.loaded.build(info.proxy_config, device="meta", seed=None)
    _raise_unfit(model, read_shapes(files), files)


def load_safetensors(model: nn.Module, files: list) -> int:
    """Load ``files`` into ``model`` after checking every name and shape; returns the number of
    tensors loaded."""
    state = read_safetensors(files)
    _raise_unfit(model, state, files)
    own = model.state_dict()
    model.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)
    return len(state)
