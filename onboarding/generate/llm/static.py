"""The static half of the anti-cheat check: read the rendered kernel module's AST and refuse an
answer whose block forward does not launch a Triton kernel, or reaches work that torch (or the
reference, or the model's own code) would do for it.

From ``block_forward`` the check follows every module-level function and class it names,
transitively (an autograd Function's methods included; ``@triton.jit`` bodies are Triton, not
torch, and are not followed). On that path it requires at least one ``kernel[grid](...)`` launch
of a ``@triton.jit`` kernel, and refuses: ``@`` matrix products; ``torch.*`` /
``torch.nn.functional.*`` calls outside the allocation and layout glue; tensor methods that
compute (matmul, softmax, cumsum, exp, sum, ...); a call of ``reference`` or of a module's own
``forward``; ``global`` writes and ``functools`` caches (outputs kept from earlier calls); and
anywhere in the module, imports of transformers, onboarding, the reference file, numpy/scipy or
process and loader modules, and large literal tables (hard-coded values).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

ENTRY = "block_forward"
# torch.* calls the glue of a kernel wrapper needs: allocation, layout, dtype, device, shapes
TORCH_GLUE = frozenset({
    "empty", "empty_like", "empty_strided", "zeros", "zeros_like", "full", "full_like", "ones",
    "ones_like", "arange", "float32", "float16", "bfloat16", "int32", "int64", "bool", "device",
    "dtype", "Size", "is_tensor", "is_floating_point", "is_grad_enabled", "no_grad",
    "enable_grad", "get_default_dtype", "promote_types", "result_type", "finfo", "iinfo",
    "broadcast_shapes", "cdiv", "Tensor", "Generator"})
# tensor methods that compute: the work must be a kernel's
COMPUTE_METHODS = frozenset({
    "matmul", "mm", "bmm", "einsum", "addmm", "addbmm", "baddbmm", "addmv", "mv", "dot", "outer",
    "softmax", "log_softmax", "cumsum", "cumprod", "logcumsumexp", "exp", "exp_", "log", "log1p",
    "sigmoid", "logsigmoid", "tanh", "softplus", "relu", "silu", "gelu", "sum", "mean", "prod",
    "max", "min", "amax", "amin", "maximum", "minimum", "norm", "sqrt", "rsqrt", "pow", "abs",
    "mul", "mul_", "div", "div_", "add", "add_", "sub", "sub_", "addcmul", "addcdiv", "lerp",
    "tril", "triu", "where", "masked_fill", "clamp", "sort", "topk", "argsort", "scatter_add",
    "index_add", "logsumexp", "var", "std", "linear", "__matmul__"})
FORBIDDEN_IMPORTS = ("transformers", "onboarding", "onboard_families", "numpy", "scipy",
                     "importlib", "subprocess", "ctypes", "pickle", "marshal", "runpy", "builtins")
MAX_LITERAL_NUMBERS = 64


@dataclass(kw_only=True)
class StaticReport:
    ok: bool
    reason: str = ""  # the first problem, one line
    problems: list[str] = field(default_factory=list)
    kernels: list[str] = field(default_factory=list)  # @triton.jit kernels defined
    launched: list[str] = field(default_factory=list)  # kernels launched on the block's path
    reachable: list[str] = field(default_factory=list)  # module-level defs on that path


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _is_jit(fn: ast.FunctionDef) -> bool:
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        name = _dotted(target)
        if name.split(".")[-1] in ("jit", "autotune", "heuristics") and name.split(".")[0] in ("triton", "jit"):
            return True
    return False


def check_source(source: str, filename: str = "<kernel>") -> StaticReport:
    """Check a rendered kernel module's source; see the module docstring."""
    try:
        tree = ast.parse(source, filename)
    except SyntaxError as exc:
        return StaticReport(ok=False, reason=f"syntax error at line {exc.lineno}: {exc.msg}",
                            problems=[f"syntax error at line {exc.lineno}"])
    problems: list[str] = []
    aliases: dict[str, str] = {}  # local name -> imported dotted name
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                _check_import(a.name, node.lineno, problems)
        elif isinstance(node, ast.ImportFrom):
            mod = ("." * node.level) + (node.module or "")
            _check_import(mod, node.lineno, problems)
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module or ''}.{a.name}"
                if a.name == "reference":
                    problems.append(f"line {node.lineno}: imports the reference")
        elif isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            n = sum(isinstance(e, ast.Constant) and isinstance(e.value, (int, float)) for e in node.elts)
            if n > MAX_LITERAL_NUMBERS:
                problems.append(f"line {node.lineno}: a literal table of {n} numbers (hard-coded values)")
    defs: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs[node.name] = node
    kernels = sorted(n for n, d in defs.items() if isinstance(d, ast.FunctionDef) and _is_jit(d))
    if ENTRY not in defs:
        return StaticReport(ok=False, reason=f"the module defines no {ENTRY}(module, *args, **kwargs)",
                            problems=problems + [f"no {ENTRY}"], kernels=kernels)
    reach, order = {ENTRY}, [ENTRY]
    launched: set[str] = set()
    i = 0
    while i < len(order):
        name = order[i]
        i += 1
        node = defs[name]
        if name in kernels:
            continue
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and sub.id in defs and sub.id not in reach:
                reach.add(sub.id)
                order.append(sub.id)
        _check_body(name, node, kernels, aliases, problems, launched)
    if "reference" in reach:
        problems.append("block_forward reaches reference(): the kernel must not call the reference")
    if not launched:
        problems.append("no @triton.jit kernel is launched (kernel[grid](...)) on block_forward's path")
    return StaticReport(ok=not problems, reason=problems[0] if problems else "", problems=problems,
                        kernels=kernels, launched=sorted(launched),
                        reachable=[n for n in order if n not in kernels])


def _check_import(mod: str, line: int, problems: list[str]) -> None:
    top = mod.lstrip(".").split(".")[0]
    if mod.startswith("."):
        problems.append(f"line {line}: relative import {mod!r} (the kernel module is self-contained)")
    elif top in FORBIDDEN_IMPORTS:
        problems.append(f"line {line}: imports {mod!r}")
    elif top == "reference":
        problems.append(f"line {line}: imports the reference")


def _check_body(name: str, node: ast.AST, kernels: list[str], aliases: dict[str, str],
                problems: list[str], launched: set[str]) -> None:
    where = f"{name}()"
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        for d in node.decorator_list:
            dn = _dotted(d.func if isinstance(d, ast.Call) else d)
            if dn.split(".")[-1] in ("lru_cache", "cache", "cached_property"):
                problems.append(f"{where}: decorated with {dn} (outputs kept from earlier calls)")
    first_arg = None
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.args.args:
        first_arg = node.args.args[0].arg
    for sub in ast.walk(node):
        if isinstance(sub, ast.Global):
            problems.append(f"{where}: writes module-level state (global {', '.join(sub.names)})")
        elif isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.MatMult):
            problems.append(f"{where}: line {sub.lineno}: a torch matrix product (@) does the work")
        elif isinstance(sub, ast.Call):
            f = sub.func
            if isinstance(f, ast.Subscript) and isinstance(f.value, ast.Name) and f.value.id in kernels:
                launched.add(f.value.id)
                continue
            dn = _dotted(f)
            full = _resolve(dn, aliases)
            head, _, last = full.rpartition(".")
            if full.startswith(("torch.nn.functional.", "torch.linalg.", "torch.special.", "torch.fft.",
                                "torch.ops.", "torch.func.", "torch.autograd.grad", "torch.compile",
                                "torch._dynamo", "torch.nn.modules")):
                problems.append(f"{where}: line {sub.lineno}: calls {full} (torch does the work)")
            elif head == "torch" and last not in TORCH_GLUE:
                problems.append(f"{where}: line {sub.lineno}: calls {full} (torch does the work)")
            elif isinstance(f, ast.Attribute) and f.attr in COMPUTE_METHODS and not full.startswith(("tl.", "triton.")):
                problems.append(f"{where}: line {sub.lineno}: calls .{f.attr}() (torch does the work)")
            elif isinstance(f, ast.Attribute) and f.attr in ("forward", "_call_impl", "__call__"):
                problems.append(f"{where}: line {sub.lineno}: calls a module's own {f.attr} (the eager block)")
            elif isinstance(f, ast.Name) and f.id == first_arg and name == ENTRY:
                problems.append(f"{where}: line {sub.lineno}: calls the module itself (the eager block)")
            elif isinstance(f, ast.Name) and f.id in ("getattr", "eval", "exec", "__import__") and \
                    f.id != "getattr":
                problems.append(f"{where}: line {sub.lineno}: calls {f.id}()")
            elif isinstance(f, ast.Name) and f.id == "getattr" and any(
                    isinstance(a, ast.Constant) and a.value in ("forward", "_call_impl", "reference")
                    for a in sub.args):
                problems.append(f"{where}: line {sub.lineno}: getattr of a forward or the reference")


def _resolve(dotted: str, aliases: dict[str, str]) -> str:
    if not dotted:
        return ""
    head, _, rest = dotted.partition(".")
    base = aliases.get(head, head)
    if base == "torch.nn.functional" or (head == "F" and base.endswith("functional")):
        base = "torch.nn.functional"
    return f"{base}.{rest}" if rest else base
