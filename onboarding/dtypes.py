"""Dtype names: the one map from "bf16" / "bfloat16" / ... to torch dtypes, and back."""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "as_dtype", "dtype_name"]

DTYPES: dict[str, torch.dtype] = {
    "fp64": torch.float64, "float64": torch.float64, "fp32": torch.float32,
    "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``dtype`` as a torch dtype; a name must be one of `DTYPES` (ValueError naming them)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(DTYPES)}")
    return DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    """"bfloat16" for torch.bfloat16 (torch's own name, as results record it)."""
    return str(dtype).replace("torch.", "")
