"""Where Triton kernels run: the GPU when there is one, else Triton's CPU interpreter.

torch is imported inside the functions: the command line's parser reads `onboarding.tune.search`
(which imports this) without torch."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def interpreting() -> bool:
    """Whether Triton kernels run in the CPU interpreter in this process (Triton's own knob,
    read from TRITON_INTERPRET)."""
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except Exception:  # pragma: no cover - older triton without knobs
        return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def on_gpu() -> bool:
    """Whether Triton kernels run compiled on a GPU in this process: a CUDA device and no
    interpreter. The one reading of "a GPU host" for the tune stage (its AOT gate, builds ahead
    of checks, studies at once, real timings)."""
    import torch

    return torch.cuda.is_available() and not interpreting()


def kernel_device() -> torch.device:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def ensure_triton_backend() -> str:
    """Select the interpreter on a machine without a GPU; returns "gpu" or "interpreter".

    `TRITON_INTERPRET` is read when `@triton.jit` runs, so this must happen before any rendered
    module is imported (docs/design.md). A user's explicit TRITON_INTERPRET is left alone.
    """
    import torch

    if torch.cuda.is_available():
        return "interpreter" if interpreting() else "gpu"
    os.environ.setdefault("TRITON_INTERPRET", "1")
    return "interpreter"
