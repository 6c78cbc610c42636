"""Model code's optional GPU kernel libraries kept out of the runs onboard makes on the CPU.

transformers wraps functions such as Qwen3-Next's ``chunk_gated_delta_rule`` or a causal conv1d
with ``use_kernel_func_from_hub_with_fallback``: when a kernel package (flash-linear-attention,
causal-conv1d, mamba-ssm) imports, the wrapper calls it, whatever the device of the tensors. On a
machine with that package installed, the CPU forward of parsing and alignment then hands CPU
tensors to a Triton kernel and fails ("0 active drivers", "Pointer argument cannot be accessed
from Triton"). The wrappers already take their torch path while torch.export runs (they check
``is_torchdynamo_exporting``); inside `torch_reference_paths` they take it on every call, so the
CPU runs record and compare the model's own PyTorch formulation, as the export does. Models
that call a kernel library directly are not covered: their failure names the package
(`onboarding.graph.capture`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

_HUB = "transformers.integrations.hub_kernels"
_CHECK = "is_torchdynamo_exporting"


@contextlib.contextmanager
def torch_reference_paths() -> Iterator[None]:
    """Inside this block transformers' kernel-with-fallback wrappers run their torch function.
    No effect when transformers (or that mechanism) is not loaded."""
    hub = sys.modules.get(_HUB)
    before = getattr(hub, _CHECK, None) if hub is not None else None
    if not callable(before):
        yield
        return
    setattr(hub, _CHECK, lambda: True)
    try:
        yield
    finally:
        setattr(hub, _CHECK, before)
