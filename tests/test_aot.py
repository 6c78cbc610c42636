"""`onboarding.generate.aot`: sm_90 builds specialised as the runtime JIT specialises a launch.

A small matmul whose A rows lie `stride` elements apart: Triton pipelines a loop's loads into
shared memory (cp.async) only when their addresses are known multiples of 16 bytes, so its
shared memory grows with each divisibility mark: W's tile once the pointers are marked, A's once
`stride` is too. The builds run in a child process (the AOT compile cannot run under the
interpreter), every build in one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from onboarding.generate import aot

KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def strided_mm_kernel(p_x, p_w, p_y, K, stride, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(p_x + rows[:, None] * stride + (k + cols)[None, :])
        w = tl.load(p_w + (k + cols)[:, None] * BLOCK_K + cols[None, :])
        acc += tl.dot(x, w)
    tl.store(p_y + rows[:, None] * BLOCK_K + cols[None, :], acc)


def aot_specs(dtype: str = "bf16", size: int = 64) -> list[dict]:
    return [{"kernel": "strided_mm_kernel",
             "signature": {"p_x": "*" + dtype, "p_w": "*" + dtype, "p_y": "*fp32", "K": "i32", "stride": "i32",
                           "BLOCK_M": "constexpr", "BLOCK_K": "constexpr"},
             "constexprs": {"BLOCK_M": 64, "BLOCK_K": size}, "num_warps": 4, "num_stages": 3, **EXTRA}]
'''

# Child: compile_module at each (extra spec keys, specialize), and the old build by hand (the
# ASTSource without attrs that compile_module made before it specialised).
_CHILD = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from onboarding.generate import aot
from onboarding.generate.templating import load_module
out = {"rows": []}
for path, mode in json.loads(sys.argv[1]):
    [r] = aot.compile_module(load_module(path), specialize=mode)
    out["rows"].append(r.as_dict())
m = load_module(json.loads(sys.argv[1])[0][0])
[spec] = m.aot_specs()
with aot._triton_ptxas_log() as log:
    c = triton.compile(ASTSource(fn=aot.jit_kernels(m)[spec["kernel"]], signature=spec["signature"],
                                 constexprs=spec["constexprs"]),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
regs, spills = aot._usage_in_log(log.getvalue())
out["old"] = {"shared_bytes": int(c.metadata.shared), "n_regs": regs, "n_spills": spills}
# the registers of the cubin itself (cuobjdump), beside the ones compile_module reports
import os, re, subprocess, tempfile
tool = os.path.join(os.path.dirname(aot._ptxas_path(90) or ""), "cuobjdump")
if os.path.exists(tool):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(c.asm["cubin"]); f.flush()
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    out["cubin_regs"] = int(re.search(r"REG:(\\d+)", res).group(1))
print(json.dumps(out))
"""


def _module(tmp_path: Path, name: str, extra: dict) -> str:
    path = tmp_path / "aot_test" / f"{name}.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text(KERNEL + f"\n\nEXTRA = {extra!r}\n")
    return str(path)


def _import(path: str):
    """Imported by hand, not by `load_module`: its registry is for rendered modules (conftest
    restores their tile pins)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"aot_test_{Path(path).stem}", path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    ok, why = aot.aot_available()
    if not ok:
        pytest.skip(f"triton cannot compile ahead of time here: {why}")
    tmp = tmp_path_factory.mktemp("aot")
    cases = {
        "off": ({}, False),
        "pointers": ({}, True),
        "declared": ({"divisible": ["stride"]}, True),
        "value48": ({"values": {"K": 200, "stride": 48}}, True),
        "value24": ({"values": {"K": 256, "stride": 24}}, True),
        "all": ({}, "all"),
        "one": ({"values": {"K": 256, "stride": 1}}, True),
        "capped": ({"maxnreg": 60}, True),  # wgmma needs >= 58 (ptxas C7602 below)
    }
    req = [(_module(tmp, name, extra), mode) for name, (extra, mode) in cases.items()]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(aot.__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    run = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(req)], capture_output=True, text=True,
                         env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.splitlines()[-1])
    return {"old": out["old"], "cubin_regs": out.get("cubin_regs"), **dict(zip(cases, out["rows"]))}


def test_specialisation_marks_what_the_jit_marks_and_pipelines_the_strided_load(builds):
    """Unmarked, neither tile pipelines (16 KB: the dot's operands once); marked pointers
    pipeline W's contiguous tile; `stride` marked (declared, or given as a multiple of 16)
    pipelines A's rows too. An integer the spec gives as 24, or not at all, stays unmarked."""
    for name, r in builds.items():
        assert name == "cubin_regs" or r.get("ok", True), r
    off, ptrs, declared = builds["off"], builds["pointers"], builds["declared"]
    assert (off["specialized"], off["marks"], off["divisible"]) == (False, "none", [])
    assert (ptrs["specialized"], ptrs["marks"], ptrs["divisible"]) == (True, "pointers+declared", ["p_x", "p_w", "p_y"])
    assert (builds["all"]["specialized"], builds["all"]["marks"]) == (True, "all")
    assert declared["divisible"] == ["p_x", "p_w", "p_y", "stride"]
    assert builds["value48"]["divisible"] == ["p_x", "p_w", "p_y", "stride"]  # K 200: not a multiple
    assert builds["value24"]["divisible"] == ["p_x", "p_w", "p_y", "K"]
    assert builds["all"]["divisible"] == ["p_x", "p_w", "p_y", "K", "stride"]
    # each mark pipelines one more [64, 64] bf16 tile (3 stages: 2 buffered + the dot's 1 = 8 KB
    # per buffered stage; triton 3.9 measured 16384 / 32768 / 49152)
    assert off["shared_bytes"] < ptrs["shared_bytes"] < declared["shared_bytes"], builds
    assert builds["value48"]["shared_bytes"] == builds["all"]["shared_bytes"] == declared["shared_bytes"]
    assert builds["value24"]["shared_bytes"] == ptrs["shared_bytes"]
    for name, r in builds.items():
        if name not in ("old", "cubin_regs"):
            assert r["constants"] == (["stride"] if name == "one" else []), r


def test_an_integer_given_as_1_is_built_as_the_constant_the_jit_makes_it(builds):
    """stride given as 1: compiled as the constant 1 (so not marked, and the build compiles with
    it in the signature as a constexpr), K marked as a multiple of 16."""
    one = builds["one"]
    assert (one["ok"], one["marks"], one["constants"]) == (True, "pointers+declared", ["stride"]), one
    assert one["divisible"] == ["p_x", "p_w", "p_y", "K"]


def test_specialize_false_is_the_old_unspecialised_build(builds):
    """`specialize=False` compiles exactly what compile_module compiled before: an ASTSource
    without attrs (same shared memory, registers and spills)."""
    off = builds["off"]
    assert {k: off[k] for k in ("shared_bytes", "n_regs", "n_spills")} == builds["old"]


def test_registers_are_the_builds_own(builds):
    """The registers compile_module reports are those of the cubin Triton built (its own ptxas
    run and flags), read back from the cubin by cuobjdump; a second `ptxas -v` at default flags
    can allocate differently."""
    if builds["cubin_regs"] is None:
        pytest.skip("no cuobjdump beside Triton's ptxas")
    assert builds["off"]["n_regs"] == builds["old"]["n_regs"] == builds["cubin_regs"], builds
    assert builds["off"]["n_spills"] is not None


def test_a_specs_register_cap_is_built_as_the_launch_caps_it(builds):
    """A spec's `maxnreg` (a launch's `maxnreg=`, e.g. kimi_delta's wykp at 168) reaches the
    build: the capped build holds at most that many registers, the same spec without it more."""
    capped, free = builds["capped"], builds["pointers"]
    assert capped["ok"] and free["ok"], (capped, free)
    if free["n_regs"] is None:
        pytest.skip("no ptxas register report on this host")
    if free["n_regs"] <= 60:
        pytest.skip(f"the uncapped build holds {free['n_regs']} registers: the cap changes nothing to tell apart")
    assert capped["n_regs"] <= 60 < free["n_regs"], (capped, free)


def test_marks_record_the_mode_and_old_records_still_read():
    """`marks` tells True from "all" (`specialized` is True for both, as before); a record
    written before `marks` existed reads back, its mode "unrecorded" when specialized."""
    assert [aot.marks_of(m) for m in (False, True, "all")] == ["none", "pointers+declared", "all"]
    with pytest.raises(ValueError, match="specialize"):
        aot.marks_of("some")
    base = dict(kernel="k", arch=90, num_warps=4, ok=True)
    for marks, specialized in (("none", False), ("pointers+declared", True), ("all", True)):
        r = aot.AotResult(**base, specialized=bool(specialized), marks=marks)
        assert (r.specialized, r.marks) == (specialized, marks)
        assert aot.AotResult(**r.as_dict()) == r  # the child process's JSON round trip
    # `specialized` follows `marks` where both are given
    assert aot.AotResult(**base, marks="all").specialized is True
    old = {**base, "specialized": True, "divisible": ["p_x"]}
    assert aot.AotResult(**old).marks == "unrecorded"
    assert aot.AotResult(**base).marks == "none"
    with pytest.raises(ValueError, match="marks"):
        aot.AotResult(**base, marks="pointers")


def test_compile_module_refuses_an_unknown_mode_before_building():
    import types

    with pytest.raises(ValueError, match="specialize"):
        aot.compile_module(types.ModuleType("empty"), specialize="some")


@pytest.fixture()
def kernel(tmp_path):
    """The test kernel as a compilable JITFunction (the interpreter's wrapper unwrapped), and its spec."""
    from triton.runtime.jit import JITFunction

    m = _import(_module(tmp_path, "plain", {}))
    fn = m.strided_mm_kernel
    return (fn if isinstance(fn, JITFunction) else JITFunction(fn.fn)), m.aot_specs()[0]


def test_divisibility_attrs_match_the_jits_own_specialisation(kernel):
    """The marks equal those Triton's JIT derives from real arguments (16-byte aligned tensors,
    int values) with its own specialisation function, per argument index."""
    try:
        import torch
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import native_specialize_impl
    except ImportError as e:
        pytest.skip(f"this triton has no native_specialize_impl: {e}")
    fn, spec = kernel
    x = torch.zeros(64 * 64, dtype=torch.bfloat16)
    for K, stride, px in ((256, 48, x), (200, 24, x[1:]), (32, 16, x), (256, 1, x)):
        args = {"p_x": px, "p_w": x, "p_y": x.float(), "K": K, "stride": stride}
        jit, jit_consts = {}, []
        for i, name in enumerate(fn.arg_names):
            if name in args:
                ty, key = native_specialize_impl(BaseBackend, args[name], False, True, True)
                if ty == "constexpr":  # an int 1
                    assert key == 1, (name, ty, key)
                    jit_consts.append(name)
                elif BaseBackend.parse_attr(key):
                    jit[(i,)] = BaseBackend.parse_attr(key)
        vspec = {**spec, "values": {"K": K, "stride": stride}}
        consts = aot.jit_constants(fn, vspec)
        assert consts == jit_consts, (K, stride, consts, jit_consts)
        ours, marked = aot.divisibility_attrs(fn, aot.with_jit_constants(vspec, consts))
        # an unaligned pointer is the exception the AOT build does not model: it marks every pointer
        if px is x:
            assert ours == jit, (K, stride, ours, jit)
        else:
            assert set(jit) == set(ours) - {(0,)}, (jit, ours)
        assert marked == [n for i, n in enumerate(fn.arg_names) if (i,) in ours]


def test_divisibility_attrs_refuse_unknown_names_and_modes_and_keep_do_not_specialize(kernel):
    from triton.runtime.jit import JITFunction

    fn, spec = kernel
    assert aot.divisibility_attrs(fn, spec, False) == ({}, [])
    with pytest.raises(ValueError, match="strde"):
        aot.divisibility_attrs(fn, {**spec, "divisible": ["strde"]})
    with pytest.raises(ValueError, match="specialize"):
        aot.divisibility_attrs(fn, spec, "some")
    # the kernel's own opt-outs hold, as at launch
    held = JITFunction(fn.fn, do_not_specialize=["stride"], do_not_specialize_on_alignment=["p_w"])
    assert aot.divisibility_attrs(held, spec, "all")[1] == ["p_x", "p_y", "K"]
    ones = {**spec, "values": {"K": 1, "stride": 1}}
    assert aot.jit_constants(held, ones) == ["K"]
    assert aot.jit_constants(fn, ones, False) == []
    assert aot.jit_constants(fn, {**spec, "values": {"K": True}}) == []  # a bool is no int 1


def test_aot_build_is_the_one_the_gpu_jit_launches(kernel, tmp_path):
    """On an sm_90 GPU: the kernel launched by the JIT with aligned tensors, K 256 and stride 48
    (both multiples of 16) compiles to the shared memory and registers the AOT build reports for
    a spec giving those values; the unmarked build differs (it pipelines less)."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU (H100/H200)")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("the interpreter launches no compiled kernel")
    ok, why = aot.aot_available()
    if not ok:
        pytest.skip(f"triton cannot compile ahead of time here: {why}")
    fn, spec = kernel
    K, stride, m = 256, 48, 128
    x = torch.randn(m, stride * (K // 48 + 1), device="cuda").bfloat16()
    w = torch.randn(K, 64, device="cuda").bfloat16()
    y = torch.empty(m, 64, device="cuda")
    launched = fn[(m // 64,)](x, w, y, K, stride, BLOCK_M=64, BLOCK_K=64, num_warps=4, num_stages=3)
    ref = x.float().as_strided((m, K), (stride, 1)) @ w.float()
    assert torch.allclose(y, ref, rtol=2e-2, atol=2e-1), (y - ref).abs().max()
    gpu = _import(_module(tmp_path, "gpu", {"values": {"K": K, "stride": stride}}))
    [ours] = aot.compile_module(gpu)
    [off] = aot.compile_module(gpu, specialize=False)
    assert (ours.marks, off.marks) == ("pointers+declared", "none")
    assert ours.divisible == ["p_x", "p_w", "p_y", "K", "stride"]
    assert ours.shared_bytes == launched.metadata.shared, (ours, launched.metadata.shared)
    assert ours.n_regs is None or ours.n_regs == launched.n_regs, (ours, launched.n_regs)
    assert off.shared_bytes < launched.metadata.shared, (off, launched.metadata.shared)
