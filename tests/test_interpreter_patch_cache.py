"""tests/fixtures/interpreter_patch_cache.py patches exactly what Triton's interpreter patches, and
a kernel calling a `@triton.jit` helper runs under it with triton.language restored after."""

from __future__ import annotations

import pytest
import torch

from fixtures import interpreter_patch_cache as cache  # noqa: E402

interp = pytest.importorskip("triton.runtime.interpreter")
if cache.UNCACHED is None:
    pytest.skip("the cache is installed where Triton runs in the interpreter", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


class _Recorder:
    def __init__(self):
        self.names = []

    def set_attr(self, obj, name, value):
        self.names.append((id(obj), name))


def test_builtins_patched_are_the_interpreters_own_in_its_order():
    uncached, _, _ = cache.UNCACHED
    for pkg in (tl, tl.core, tl.tensor, tl.math, tl.core.tensor_descriptor_base):
        want, got = _Recorder(), _Recorder()
        uncached(pkg, None, want)
        for _ in range(2):  # the first call scans, the second reads the kept names
            got.names.clear()
            interp._patch_builtin(pkg, None, got)
            assert got.names == want.names and want.names, pkg


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, _twice(tl.load(x_ptr + offs)) + tl.sum(tl.load(x_ptr + offs), axis=0))


def test_a_kernel_with_a_helper_runs_and_triton_language_is_restored():
    before = {n: getattr(tl, n) for n in ("load", "store", "sum", "arange", "range", "reduce")}
    x = torch.arange(8, dtype=torch.float32)
    out = torch.empty_like(x)
    _kernel[(1,)](x, out, N=8)
    torch.testing.assert_close(out, x * 2 + x.sum())
    assert {n: getattr(tl, n) for n in before} == before
    # inside no launch, a helper's patch is the interpreter's own, restorable
    scope = interp._patch_lang(_twice.fn)
    assert not tl.core.is_builtin(tl.load)
    scope.restore()
    assert tl.load is before["load"]



@triton.jit
def _three_standard_helpers(out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    acc = tl.zeros((N,), tl.float32) + tl.cdiv(N, 4)
    acc += tl.zeros((N,), tl.float32) + tl.sum(tl.full((N,), 1.0, tl.float32), axis=0)
    tl.store(out_ptr + offs, acc)


def test_a_launch_patches_for_its_standard_helpers_once(monkeypatch):
    """Triton's standard helpers (tl.zeros, tl.cdiv, tl.sum) see triton.language.core, which the
    launch's patch (the kernel sees triton.language) leaves out: the first helper's call patches,
    and its patch covers the launch's later helpers; before, each of the four helper calls
    re-patched (five patches in all)."""
    scopes = []  # each patch's scope, kept alive (distinct ids: one per patch)
    core = interp._patch_lang_core
    monkeypatch.setattr(interp, "_patch_lang_core",
                        lambda lang, scope: (scopes.append(scope), core(lang, scope)))
    out = torch.empty(8)
    _three_standard_helpers[(1,)](out, N=8)
    torch.testing.assert_close(out, torch.full((8,), 2.0 + 8.0))
    assert len({id(s) for s in scopes}) == 2  # the launch's and the first helper's


def test_numpy_dtypes_are_the_interpreters_own():
    _, _, uncached = cache.UNCACHED
    scalars = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64,
               tl.uint64, tl.float16, tl.bfloat16, tl.float32, tl.float64, tl.float8e5,
               tl.float8e4nv]
    kinds = [*scalars, *(tl.block_type(t, [4, 2]) for t in scalars), tl.pointer_type(tl.float32),
             tl.block_type(tl.pointer_type(tl.bfloat16), [8])]
    for _ in range(2):  # the first ask fills the table, the second reads it
        for t in kinds:
            assert interp._get_np_dtype(t) == uncached(t), t
    with pytest.raises(KeyError):  # a type the interpreter has no numpy dtype for
        interp._get_np_dtype(tl.void)
