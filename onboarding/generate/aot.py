"""Ahead-of-time compilation of a rendered module's Triton kernels for a GPU target, on any host.

`compile_module(module)` compiles every `@triton.jit` kernel of a rendered module (see
`onboarding.generate.templating`) for `GPUTarget("cuda", 90, 32)` (H100/H200) with `triton.compile` and an
`ASTSource`, using the signatures and constexprs from the module's `aot_specs()` (and a spec's
`num_warps`, `num_stages` and, where its launch caps registers, `maxnreg`); no GPU needed.
It catches compile errors early and reports shared memory, and registers/spills from the
`ptxas -v` log of Triton's own ptxas run (its flags: line info, and on triton 3.9
`--regAllocOptLevel=2`; a second `ptxas -v` with default flags allocated differently: the
sink-attention masked forward 668 spill bytes against the build's 780, a backward 0 against 8).

The build is specialised as Triton's JIT specialises a launch (`specialize=True`, the default):
the JIT gives `tt.divisibility` 16 to every pointer argument that is 16-byte aligned and every
integer argument whose value is a multiple of 16, and only with those marks does it vectorise
loads and pipeline them into shared memory (`cp.async`). Without them the AOT build pipelines
less and under-reports shared memory (the sparse MLA forward: 147712 bytes unmarked, 221440 as
the GPU compiles it), and its registers and spills are not the GPU's. Every pointer is marked
(fresh torch allocations are aligned); an integer only where the spec says it is a multiple of 16
(`"divisible": [names]`, or `"values": {name: example}`), since a spec's signature holds types,
not values; `specialize="all"` marks every integer too (every size a multiple of 16),
`specialize=False` is the unmarked build of before. `AotResult.marks` ("none",
"pointers+declared", "all") says which of the three a build used, `AotResult.divisible` which
arguments were marked (`divisibility_attrs`); `AotResult.specialized` is True for either marking.
For build facts at the shapes the GPU runs (every size a multiple of 16), use `specialize="all"`:
True leaves an integer the spec does not declare unmarked, and a mask such as `o_k < K` then has
alignment 1, so loads stay synchronous and ptxas may report spills the GPU's build does not have.
The JIT's other integer specialisation, an argument equal to 1 compiled as the constant 1 (e.g. a
split count of 1), can change registers and spills again (the ssd split backward's dB kernel: 40
bytes spilled as an argument, none as the constant); no mode assumes it: a spec that gives an
integer as 1 in `values` gets it (`jit_constants`, `AotResult.constants`).

Triton API notes: `ASTSource(fn, signature, constexprs=..., attrs=...)` with a name-keyed
signature in which constexprs are typed "constexpr", and attrs keyed by argument-index paths
(`{(i,): [["tt.divisibility", 16]]}`, what the JIT's `_pack_args` builds), is the form of
triton >= 3.3 (constexprs checked on 3.6 and 3.9, attrs on 3.9; `.ci/h200/aot_specialize.sh`
runs tests/test_aot.py on the H200's 3.6); older releases took `constants=` keyed by index and raise `AotUnavailable` here. Under
`TRITON_INTERPRET=1` `@triton.jit` yields interpreter objects: the original Python function is
compiled in a child process without it: once the interpreter is active, `triton.language`
is patched in-process and code generation fails.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

H100_SHARED_BYTES = 232448  # opt-in max dynamic shared memory per block on sm_90


class AotUnavailable(RuntimeError):
    """This Triton build cannot compile ahead of time in the way this module expects."""


@dataclass(kw_only=True, slots=True)
class AotResult:
    kernel: str
    arch: int
    num_warps: int
    ok: bool
    shared_bytes: int | None = None
    n_regs: int | None = None
    n_spills: int | None = None
    error: str = ""
    # compiled with the runtime JIT's specialisation (`specialize` of `compile_module`: True or
    # "all"), and the arguments that got `tt.divisibility` 16 (see `divisibility_attrs`)
    specialized: bool = False
    divisible: list[str] = field(default_factory=list)
    # which marks the build used (`MARKS`, from `specialize`): "none" (False), "pointers+declared"
    # (True: every pointer, the integers the spec declares or gives as multiples of 16), "all"
    # (every pointer and integer). `specialized` stays a bool for its readers (True for either
    # marking); a record without `marks` (written before it existed) gets "none" when not
    # specialized, else "unrecorded" (True and "all" were not told apart then).
    marks: str = ""
    # integer arguments the spec gives as 1 (`values`), compiled as the constant 1 as the JIT
    # compiles them (`jit_constants`)
    constants: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.marks:
            self.marks = "unrecorded" if self.specialized else "none"
        elif self.marks not in MARKS:
            raise ValueError(f"marks={self.marks!r}: expected one of {MARKS}")
        else:
            self.specialized = self.marks != "none"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


MARKS = ("none", "pointers+declared", "all", "unrecorded")


def marks_of(specialize: bool | str) -> str:
    """`AotResult.marks` of a `specialize` value: False "none", True "pointers+declared", "all" "all"."""
    if specialize is False:
        return "none"
    if specialize is True:
        return "pointers+declared"
    if specialize == "all":
        return "all"
    raise ValueError(f"specialize={specialize!r}: expected True, False or 'all'")


def _api():
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:  # pragma: no cover - depends on the installed triton
        raise AotUnavailable(f"triton AOT API not importable: {e}") from e
    params = inspect.signature(ASTSource.__init__).parameters
    if "constexprs" not in params or "attrs" not in params:
        raise AotUnavailable(
            f"triton {triton.__version__}: ASTSource takes {list(params)[1:]}, expected a "
            "'constexprs' and an 'attrs' argument (triton >= 3.3)"
        )
    return triton, GPUTarget, ASTSource


def aot_available() -> tuple[bool, str]:
    """(True, "") when AOT compilation is possible, else (False, reason)."""
    try:
        _api()
    except AotUnavailable as e:
        return False, str(e)
    return True, ""


def jit_kernels(module: ModuleType) -> dict[str, Any]:
    """Every `@triton.jit` function defined in `module`, by name, as compilable `JITFunction`s."""
    from triton.runtime.jit import JITFunction

    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover
        InterpretedFunction = ()  # type: ignore[assignment]
    out = {}
    for name, obj in sorted(vars(module).items()):
        if isinstance(obj, JITFunction):
            out[name] = obj
        elif InterpretedFunction and isinstance(obj, InterpretedFunction):
            out[name] = JITFunction(obj.fn)
    return out


def _ptxas_path(arch: int) -> str | None:
    # Triton picks its ptxas per arch (3.9 ships a newer "ptxas-blackwell" used for sm_90+ whose
    # PTX version the legacy one rejects); older releases have no such helper.
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(arch).path
    except Exception:
        pass
    try:
        from triton import knobs

        return knobs.nvidia.ptxas.path
    except Exception:
        pass
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return path if os.path.exists(path) else None


def _usage_in_log(log: str) -> tuple[int | None, int | None]:
    """(registers, spill bytes: the larger of stores and loads) from a `ptxas -v` log."""
    regs = re.search(r"Used (\d+) registers", log)
    spills = [int(m) for m in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    return (int(regs.group(1)) if regs else None), (max(spills) if spills else None)


@contextlib.contextmanager
def _triton_ptxas_log():
    """Inside: Triton compiles afresh (no cache hit skips ptxas) and prints its ptxas log, which
    lands in the yielded buffer: the registers and spills of the build itself."""
    import triton

    nv, comp = triton.knobs.nvidia, triton.knobs.compilation
    saved = (nv.dump_ptxas_log, comp.always_compile)
    nv.dump_ptxas_log, comp.always_compile = True, True
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            yield buf
    finally:
        nv.dump_ptxas_log, comp.always_compile = saved


def _ptxas_usage(ptx: str, arch: int) -> tuple[int | None, int | None]:
    """(registers, spill bytes) from a separate `ptxas -v` at its default flags, or (None, None)
    when unavailable. Not the build's own allocation (`compile_module` reads Triton's log); kept
    for a PTX that was not built here."""
    ptxas = _ptxas_path(arch)
    if not ptxas:
        return None, None
    suffix = "a" if arch >= 90 else ""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        try:
            run = subprocess.run(
                [ptxas, "-v", f"--gpu-name=sm_{arch}{suffix}", src, "-o", os.path.join(tmp, "k.o")],
                capture_output=True, text=True, timeout=120,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None, None
    return _usage_in_log(run.stdout + run.stderr)


_INT_TYPES = frozenset({"i8", "i16", "i32", "i64", "u8", "u16", "u32", "u64"})


def jit_constants(fn: Any, spec: dict[str, Any], specialize: bool | str = True) -> list[str]:
    """The integer arguments the spec gives as 1 (`spec["values"]`), which Triton's JIT compiles
    as the constant 1 rather than as an argument (e.g. a split count of 1); none unmarked
    (`specialize` False) or where the kernel declares `do_not_specialize`."""
    if not specialize:
        return []
    params = {getattr(p, "name", None): p for p in getattr(fn, "params", [])}
    sig = spec["signature"]
    return [name for name, v in spec.get("values", {}).items()
            if v == 1 and type(v) is int and sig.get(name) in _INT_TYPES
            and not getattr(params.get(name), "do_not_specialize", False)]


def with_jit_constants(spec: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """`spec` with the integer arguments `names` compiled as the constant 1 (`jit_constants`)."""
    if not names:
        return spec
    return {**spec, "signature": {k: ("constexpr" if k in names else t) for k, t in spec["signature"].items()},
            "constexprs": {**spec.get("constexprs", {}), **{k: 1 for k in names}}}


def divisibility_attrs(fn: Any, spec: dict[str, Any], specialize: bool | str = True) -> tuple[dict, list[str]]:
    """(ASTSource `attrs`, the argument names marked): `tt.divisibility` 16 where the runtime JIT
    puts it for the common case, so the build is the one the GPU runs.

    At launch Triton's JIT marks a pointer argument whose address is 16-byte aligned (every
    fresh torch allocation) and an integer argument whose value is a multiple of 16; only with
    these marks does it vectorise and pipeline (`cp.async`) loads whose addresses depend on them.
    `specialize`: False marks nothing (the old build); True marks every pointer and the integer
    arguments the spec says are multiples of 16: named in `spec["divisible"]`, or given in
    `spec["values"]` (example runtime values) as a multiple of 16 -- the specs' signatures hold
    types only, so an integer without either is left unmarked, as the JIT leaves an odd T;
    "all" marks every integer too (the JIT's build when every size and stride is a multiple of
    16, e.g. T 8192, the most it may pipeline). Arguments the kernel declares
    `do_not_specialize` (integers) or `do_not_specialize_on_alignment` are never marked.
    """
    if specialize not in (True, False, "all"):
        raise ValueError(f"specialize={specialize!r}: expected True, False or 'all'")
    if not specialize:
        return {}, []
    sig = spec["signature"]
    names = list(getattr(fn, "arg_names", None) or sig)
    params = {getattr(p, "name", None): p for p in getattr(fn, "params", [])}
    values = spec.get("values", {})
    declared = set(spec.get("divisible", ()))
    unknown = (declared | set(values)) - set(sig)
    if unknown:
        raise ValueError(f"{spec['kernel']}: 'divisible'/'values' name no argument of the signature: {sorted(unknown)}")
    attrs, marked = {}, []
    for name, ty in sig.items():
        p = params.get(name)
        if isinstance(ty, str) and ty.startswith("*"):
            if p is not None and getattr(p, "do_not_specialize_on_alignment", False):
                continue
        elif ty in _INT_TYPES:
            if p is not None and getattr(p, "do_not_specialize", False):
                continue
            v = values.get(name)
            if not (specialize == "all" or name in declared or (isinstance(v, int) and v % 16 == 0)):
                continue
        else:  # constexprs, floats, tensor descriptors: the JIT gives them no divisibility
            continue
        attrs[(names.index(name),)] = [["tt.divisibility", 16]]
        marked.append(name)
    return attrs, marked


def compile_module(
    module: ModuleType,
    *,
    arch: int = 90,
    dtype: str = "bf16",
    size: int | None = None,
    registers: bool = True,
    specialize: bool | str = True,
) -> list[AotResult]:
    """Compile every kernel of a rendered module for `cuda:sm_<arch>`; one result per spec.

    `specialize` (True, "all" or False): the runtime JIT's divisibility marks, see
    `divisibility_attrs`; False is the unspecialised build of before (fewer loads pipelined, so
    less shared memory and different registers than the GPU's).

    Raises AotUnavailable if this Triton cannot do it, and ValueError if a `@triton.jit`
    kernel of the module has no entry in `module.aot_specs()` (every kernel must be covered).
    Compile errors are caught per kernel and reported in `AotResult.error`.
    """
    marks_of(specialize)  # refuses an unknown mode before any work
    triton, GPUTarget, ASTSource = _api()
    if not hasattr(module, "aot_specs"):
        raise ValueError(f"{module.__name__} has no aot_specs(); is it a rendered kernel module?")
    specs = module.aot_specs(dtype) if size is None else module.aot_specs(dtype, size)
    kernels = jit_kernels(module)
    # `_`-prefixed jit functions are device helpers, compiled as part of the kernels calling them.
    missing = sorted({k for k in kernels if not k.startswith("_")} - {s["kernel"] for s in specs})
    if missing:
        raise ValueError(f"{module.__name__}: kernels without an AOT spec: {missing}")
    target = GPUTarget("cuda", arch, 32)
    results = []
    for spec in specs:
        name = spec["kernel"]
        num_warps = int(spec.get("num_warps", 4))
        res = AotResult(kernel=name, arch=arch, num_warps=num_warps, ok=False, specialized=bool(specialize),
                        marks=marks_of(specialize))
        try:
            fn = kernels[name]
            res.constants = jit_constants(fn, spec, specialize)
            spec = with_jit_constants(spec, res.constants)
            attrs, res.divisible = divisibility_attrs(fn, spec, specialize)
            src = ASTSource(fn=fn, signature=spec["signature"], constexprs=spec.get("constexprs", {}), attrs=attrs)
            options = {"num_warps": num_warps, "num_stages": int(spec.get("num_stages", 3))}
            if spec.get("maxnreg"):  # a launch's register cap (`maxnreg=` at the launch): built as launched
                options["maxnreg"] = int(spec["maxnreg"])
            with _triton_ptxas_log() if registers else contextlib.nullcontext() as log:
                compiled = triton.compile(src, target=target, options=options)
            res.shared_bytes = int(compiled.metadata.shared)
            res.ok = True
            if registers:
                res.n_regs, res.n_spills = _usage_in_log(log.getvalue())
                if res.n_regs is None and "ptx" in compiled.asm:  # no log: ptxas again
                    res.n_regs, res.n_spills = _ptxas_usage(compiled.asm["ptx"], arch)
        except Exception as e:  # report per kernel; the caller decides what a failure means
            res.error = f"{type(e).__name__}: {e}"[:2000]
        results.append(res)
    return results


def compile_files(
    paths: list[Path | str],
    *,
    arch: int = 90,
    dtype: str = "bf16",
    size: int | None = None,
    registers: bool = True,
    isolate: bool | None = None,
    specialize: bool | str = True,
) -> dict[str, list[AotResult]]:
    """`compile_module` for rendered module files, keyed by path.

    With `isolate` (default: when this process runs the Triton interpreter) the work runs in one
    child process with `TRITON_INTERPRET` unset.
    """
    paths = [str(Path(p).resolve()) for p in paths]
    if isolate is None:
        from onboarding.backend import interpreting

        isolate = interpreting()
    if not isolate:
        from onboarding.generate.templating import load_module

        return {
            p: compile_module(load_module(p), arch=arch, dtype=dtype, size=size, registers=registers,
                              specialize=specialize)
            for p in paths
        }
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    request = json.dumps({"paths": paths, "arch": arch, "dtype": dtype, "size": size, "registers": registers,
                          "specialize": specialize})
    run = subprocess.run(
        [sys.executable, "-m", "onboarding.generate.aot"], input=request, capture_output=True, text=True, env=env,
    )
    if run.returncode == 3:
        raise AotUnavailable(run.stdout.strip() or run.stderr.strip()[-2000:])
    if run.returncode != 0:
        raise RuntimeError(f"AOT child process failed (rc={run.returncode}):\n{run.stderr[-4000:]}")
    data = json.loads(run.stdout.splitlines()[-1])
    return {p: [AotResult(**r) for r in rs] for p, rs in data.items()}


def _main() -> int:
    req = json.loads(sys.stdin.read())
    ok, why = aot_available()
    if not ok:
        print(why)
        return 3
    out = compile_files(
        req["paths"], arch=req["arch"], dtype=req["dtype"], size=req["size"],
        registers=req["registers"], isolate=False, specialize=req["specialize"],
    )
    print(json.dumps({p: [r.as_dict() for r in rs] for p, rs in out.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
