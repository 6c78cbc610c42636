"""The checks behind every test in this folder (the `reviewed_kernel` fixture): a reviewed kernel
module (kernels/<family>/) against its own `reference`, forward and every gradient, on the inputs
its correctness check ran on, fp32; and that it imports only torch, triton and the standard
library.

Written by `onboard pr create`. Needs only torch, triton and pytest; without a GPU the kernels
run in Triton's interpreter."""

import ast
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ALLOWED = {"torch", "triton", "__future__"} | set(sys.stdlib_module_names)


@dataclass(frozen=True)
class ReviewedKernel:
    """One module, its check inputs, and the bounds the generate stage checked it with:
    name -> (max relative RMS, rtol, atol); no element may lie outside atol + rtol * |expected|."""

    test: Path  # the test file: the repository root is two folders above it
    family: str
    name: str  # the module's file name under kernels/<family>/
    inputs: str  # the file name under inputs/, beside the test
    tolerance: dict

    @property
    def module(self) -> Path:
        return self.test.parents[2] / "kernels" / self.family / self.name

    def load(self):
        # Its own custom-op name: another copy of this module in the same process (a run that
        # loads it from kernels/) keeps its ops.
        text = self.module.read_text()
        text = re.sub(r'^(OP_NAME = "[^"]+)"', r'\1_reviewed_test"', text, count=1, flags=re.M)
        ident = "".join(ch if ch.isalnum() else "_" for ch in f"{self.family}_{self.name}")
        mod = type(sys)(f"reviewed_kernel_test_{ident}")
        mod.__file__ = str(self.module)
        sys.modules[mod.__name__] = mod
        exec(compile(text, str(self.module), "exec"), mod.__dict__)
        return mod

    def close(self, got, want, what):
        rel, rtol, atol = self.tolerance[what]
        a, b = got.detach().double().cpu(), want.detach().double().cpu()
        assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
        fin = torch.isfinite(b)
        assert not (~torch.isfinite(a) & fin).any(), \
            f"{what}: non-finite where the reference is finite"
        diff = torch.where(fin, (a - b).abs(), torch.zeros_like(a))
        norm_b, norm_d = torch.where(fin, b, torch.zeros_like(b)).norm().item(), diff.norm().item()
        err = norm_d / norm_b if norm_b > 0 else (0.0 if norm_d == 0 else float("inf"))
        # relative RMS, or (a reference near zero) an RMS difference within atol
        assert err <= rel or norm_d <= atol * b.numel() ** 0.5, \
            f"{what}: relative RMS error {err:.3e} > {rel:.0e}"
        n_out = int((diff > atol + rtol * b.abs().nan_to_num(0.0)).sum())
        assert n_out == 0, f"{what}: {n_out} elements outside {atol} + {rtol} * |expected|"

    def check_self_contained(self):
        names = set()
        for node in ast.walk(ast.parse(self.module.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                names.add("." * node.level + (node.module or "").split(".")[0])
        assert names <= ALLOWED, f"imports {sorted(names - ALLOWED)}"

    def check_forward_and_gradients(self):
        mod = self.load()
        device = "cuda" if torch.cuda.is_available() else "cpu"
        saved = torch.load(self.test.parent / "inputs" / self.inputs, weights_only=True)

        def prep():
            return [a.detach().clone().to(device).requires_grad_(a.is_floating_point())
                    if isinstance(a, torch.Tensor) else a for a in saved]

        a_args, r_args = prep(), prep()
        out, expect = mod.entry(*a_args), mod.reference(*r_args)
        outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None]
        exps = [e for e in (expect if isinstance(expect, tuple) else (expect,)) if e is not None]
        assert len(outs) == len(exps), f"{len(outs)} outputs, the reference {len(exps)}"
        pairs = []
        for i, (o, e) in enumerate(zip(outs, exps)):
            if not o.is_floating_point():
                assert torch.equal(o.cpu(), e.cpu()), f"out{i}: integer output differs"
                continue
            self.close(o, e, f"out{i}")
            if o.requires_grad and e.requires_grad:
                pairs.append((o, e))
        assert pairs or not any(isinstance(a, torch.Tensor) and a.requires_grad for a in a_args) \
            or all(not o.is_floating_point() for o in outs), "no differentiable output"
        gen = torch.Generator().manual_seed(1)
        cot = [torch.randn(e.shape, generator=gen).to(e.device, e.dtype) for _, e in pairs]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [c.to(o.dtype) for (o, _), c in
                                                            zip(pairs, cot)])
            torch.autograd.backward([e for _, e in pairs], cot)
        n = 0
        for i, (a, r) in enumerate(zip(a_args, r_args)):
            if isinstance(a, torch.Tensor) and a.requires_grad:
                assert (a.grad is None) == (r.grad is None), f"grad{i}: missing on one side"
                if a.grad is not None:
                    self.close(a.grad, r.grad, f"grad{i}")
                    n += 1
        assert n or not pairs, "no gradient reached the inputs"


@pytest.fixture
def reviewed_kernel(request):
    """The test module's KERNEL (family, name, inputs, tolerance) as a `ReviewedKernel`."""
    return ReviewedKernel(Path(request.module.__file__).resolve(), **request.module.KERNEL)
