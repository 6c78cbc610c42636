"""Triton kernel launches, watched by name.

`watching(around)` patches ``JITFunction.run`` and, where this triton has it, the interpreter's
``InterpretedFunction.run`` at class level for its duration (nested uses undo in reverse order).
Each launch calls ``around(name, warmup, call)`` in its place: ``name`` is the kernel's function
name, ``warmup`` the launch's ``warmup=`` flag (``fn.warmup(...)`` compiles without running),
and ``call()`` runs the launch and returns its result, which ``around`` returns.

`Launches` is the simplest use: a `collections.Counter` of the kernels launched (warm-ups left
out), by name. The runtime anti-cheat `Monitor` (onboarding.generate.llm.runtime) and the
Nsight Compute driver (.ci/h200/ncu_step.py) both watch launches through `watching`.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

Around = Callable[[str, bool, Callable[[], Any]], Any]


def _classes() -> list[type]:
    out = []
    try:
        from triton.runtime.jit import JITFunction

        out.append(JITFunction)
    except ImportError:  # pragma: no cover - Triton absent
        pass
    try:
        from triton.runtime.interpreter import InterpretedFunction

        out.append(InterpretedFunction)
    except ImportError:  # pragma: no cover - an older Triton
        pass
    return out


def kernel_name(fn_obj: Any) -> str:
    """The name of the function a JITFunction / InterpretedFunction wraps ("?" when none)."""
    fn = getattr(fn_obj, "fn", None)
    return getattr(fn, "__name__", None) or getattr(fn_obj, "__name__", None) or "?"


@contextlib.contextmanager
def watching(around: Around) -> Iterator[None]:
    """See the module docstring. Only a class that defines ``run`` itself is patched (a launch
    goes through ``around`` once, never twice through a subclass)."""
    undo: list[tuple[type, Any]] = []
    try:
        for cls in _classes():
            orig = cls.__dict__.get("run")
            if orig is None:
                continue

            def run(fn_self, *args, _orig=orig, **kwargs):
                return around(kernel_name(fn_self), bool(kwargs.get("warmup", False)),
                              lambda: _orig(fn_self, *args, **kwargs))

            cls.run = run
            undo.append((cls, orig))
        yield
    finally:
        for cls, orig in reversed(undo):
            cls.run = orig


class Launches:
    """``with Launches() as l:`` run something; ``l.counts``: kernel name -> launches (warm-ups
    not counted); ``l.take()`` returns the counts so far and starts afresh."""

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        self._cm: contextlib.AbstractContextManager | None = None

    def _around(self, name: str, warmup: bool, call: Callable[[], Any]) -> Any:
        if not warmup:
            self.counts[name] += 1
        return call()

    def __enter__(self) -> Launches:
        self._cm = watching(self._around)
        self._cm.__enter__()
        return self

    def __exit__(self, *exc: Any) -> bool:
        cm, self._cm = self._cm, None
        if cm is not None:
            cm.__exit__(*exc)
        return False

    def take(self) -> collections.Counter:
        out, self.counts = self.counts, collections.Counter()
        return out
