"""The Inductor fallback: a block no family serves runs as ``torch.compile`` of its own forward
(the backward comes from AOTAutograd's joint graph), gated by the block check
(`onboarding.generate.blockcheck`) like any kernel.

Backend: Inductor's default for the device, C++/OpenMP on a CPU (`torch._inductor.config.
cpu_backend`), Triton on a GPU (`cuda_backend`); `backend_name()` says which. Shapes are
static (``dynamic=False``): each new size recompiles (the check's three distinct sizes: three
forward and three backward graphs per dtype). Automatic-dynamic shapes would compile fewer
graphs, but Inductor failed to compile Mamba-2's chunked scan with a symbolic sequence length
(docs/LOG.md), and static graphs are what the GPU benchmark times. `compiled(...).finish()`
reports how many graphs were compiled. Inductor's generated code (the Python wrapper with the
C++ or Triton kernels in it) is copied beside the verdict for review:
``<run_dir>/generated/inductor/<block>/`` holds ``code/*.py``, ``verdict.json`` and
``README.md``.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from onboarding.generate.blockcheck import BlockVerdict, Replacement, check_block
from onboarding.load.spec import ModelSpec

TARGET = "onboarding.generate.inductor:compiled"
GENERATED = Path("generated") / "inductor"


def backend_name(device: str | None = None) -> str:
    """Inductor's code generator for ``device`` (default: where kernels run)."""
    import torch._inductor.config as cfg

    if device is None:
        from onboarding.backend import kernel_device

        device = str(kernel_device())
    if device.startswith("cuda"):
        return f"inductor ({getattr(cfg, 'cuda_backend', 'triton')})"
    return f"inductor ({getattr(cfg, 'cpu_backend', 'cpp')}, OpenMP)"


def _code_files() -> dict[str, Path]:
    from torch._inductor.codecache import PyCodeCache

    out = {}
    for mod in list(PyCodeCache.modules):
        f = getattr(mod, "__file__", None)
        if f:
            out[f] = Path(f)
    return out


def compiled(module: nn.Module, *, code_dir: str | None = None, dynamic: bool | None = False,
             forward: Callable | None = None) -> Callable:
    """``torch.compile`` of ``module``'s forward (``forward``: another function to compile in
    its place). The returned function has ``finish()``: copies the generated code written since
    into ``code_dir`` and returns {backend, graphs, files}."""
    before = set(_code_files())
    fn = torch.compile(forward or module.forward, dynamic=dynamic)

    def call(*args, **kwargs):
        # past the recompile limit dynamo would quietly run the block's own code instead: a
        # block recorded as served by Inductor must raise then, never fall back unseen
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            return fn(*args, **kwargs)

    def finish() -> dict[str, Any]:
        new = {k: p for k, p in _code_files().items() if k not in before}
        files = []
        if code_dir is not None:
            dest = Path(code_dir) / "code"
            dest.mkdir(parents=True, exist_ok=True)
            for i, p in enumerate(sorted(new.values(), key=lambda p: p.stat().st_mtime)):
                if p.is_file():
                    target = dest / f"graph{i:02d}_{p.stem[:12]}.py"
                    shutil.copyfile(p, target)
                    files.append(str(target))
        return {"backend": backend_name(), "graphs": len(new), "files": files}

    call.finish = finish  # type: ignore[attr-defined]
    call.compiled = fn  # type: ignore[attr-defined]
    return call


def block_dir(run_dir: Path, path: str) -> Path:
    return Path(run_dir) / GENERATED / re.sub(r"[^A-Za-z0-9_.-]+", "_", path or "model")


def check_inductor(spec: ModelSpec, path: str, run_dir: Path, *, kind: str = "",
                   batch: int = 1, seq: int = 64, seed: int = 0, timeout_s: float = 600.0,
                   dtypes: list[str] | None = None,
                   sizes: list[tuple[int, int]] | None = None) -> BlockVerdict:
    """Compile the block at ``path`` with Inductor and gate it with the block check (in a
    subprocess); writes the generated code, ``verdict.json`` and a README into
    `block_dir(run_dir, path)`."""
    out = block_dir(run_dir, path)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    t0 = time.perf_counter()
    verdict = check_block(spec, path, Replacement(target=TARGET, kwargs={"code_dir": str(out)},
                                                  label="torch.compile (Inductor)"),
                          batch=batch, seq=seq, sizes=sizes, dtypes=dtypes, seed=seed,
                          kind=kind, timeout_s=timeout_s)
    verdict.notes.append(f"wall time of compile + check: {time.perf_counter() - t0:.1f} s")
    (out / "verdict.json").write_text(json.dumps(verdict.to_dict(), indent=1, default=str)
                                      + "\n")
    art = next(iter(verdict.artifacts.values()), {}) if verdict.artifacts else {}
    (out / "README.md").write_text(
        f"# {path}: torch.compile (Inductor)\n\n"
        f"Backend: {art.get('backend', backend_name())}; graphs compiled in the check: "
        f"{art.get('graphs', '?')} (forward and backward, per dtype and dynamic recompile).\n"
        f"Block check: {verdict.summary()}\n\n"
        "`code/` holds Inductor's generated modules as written by the check's process (the "
        "Python wrapper with the C++/OpenMP or Triton kernels inside), for review.\n")
    return verdict
