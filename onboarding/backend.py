"""Where Triton kernels run: the GPU when there is one, else Triton's CPU interpreter."""

from __future__ import annotations

import os

import torch


def kernel_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def ensure_triton_backend() -> str:
    """Select the interpreter on a machine without a GPU; returns "gpu" or "interpreter".

    `TRITON_INTERPRET` is read when `@triton.jit` runs, so this must happen before any rendered
    module is imported (DESIGN.md). A user's explicit TRITON_INTERPRET is left alone.
    """
    if torch.cuda.is_available():
        return "interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "gpu"
    os.environ.setdefault("TRITON_INTERPRET", "1")
    return "interpreter"
