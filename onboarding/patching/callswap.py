"""Serve a block's core with our kernel by swapping the plain function the block hands it to.

Mixers (delta-rule linear attention, Mamba's scans) compute their projections, convs and gates
with torch modules (which stay: LoRA wraps the projections) and hand the recurrence to one plain
function: an instance attribute in some models, a module-level function their ``forward`` names
in others, a hub or package kernel bound to that name when one is installed. Which one is not
read from names: every function the block can reach whose signature fits the family's interface
(`Interface.fits`) is wrapped while the block runs.

What the block can reach (`reachable`): its instance attributes, the module-level names its
``forward`` reads, and the names read by the module-level helpers it calls, two calls deep, in
its own module (transformers 5.25's Mamba mixers hand the scan to a helper, ``*_scan_forward(self,
...)``, which calls the scan function). A function is also what a stateless module made of one
is (`as_function`: from transformers 5.25, kernels' hub decorator turns such functions into
parameterless ``nn.Module`` instances): its ``forward`` takes the function's arguments. A call
that is handed a module (the block itself, its conv) is a helper of the block, not a core: it
runs as it is, and the functions it calls are swapped in their own right.

On its first call a wrapper runs the original, then our kernel on the same arguments (each of
the interface's variants in turn, all under no_grad), and keeps the swap when one agrees with the
original's output within the layer tolerance. The kernel then serves that first call too, with
its autograd graph: an alignment that runs the model once judges the kernel, forward and
backward. A block where no function was swapped after its first call is reported as rejected,
with the last attempt's reason; its calls keep the original function.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from onboarding.formatting import clip


def forward_function(module: nn.Module) -> Callable:
    """The class's own forward, under any decorating wrappers (its globals are the model's)."""
    return inspect.unwrap(type(module).forward)


def _stateless(module: nn.Module) -> bool:
    return next(module.parameters(), None) is None and next(module.buffers(), None) is None \
        and next(module.children(), None) is None


def as_function(value: Any) -> Callable | None:
    """``value`` as the function model code calls it as, or None: a plain function (under any
    decorating wrappers) itself; for a stateless module (no parameters, buffers or submodules:
    a function that a hub decorator turned into a module, as kernels' does from transformers
    5.25 on), its bound ``forward``, which takes the function's arguments (given that forward,
    the same)."""
    if isinstance(value, nn.Module):
        value = value.forward if _stateless(value) else None
    if inspect.ismethod(value):  # only a stateless module's forward
        owner = value.__self__
        ok = isinstance(owner, nn.Module) and _stateless(owner) and value.__name__ == "forward" \
            and inspect.isfunction(inspect.unwrap(value.__func__))
        return value if ok else None
    if isinstance(value, type) or not callable(value):
        return None
    return value if inspect.isfunction(inspect.unwrap(value)) else None


def positional_counts(fn: Any) -> tuple[int, int] | None:
    """(required, all) positional parameters of a function (`as_function`); None for anything
    else."""
    fn = as_function(fn)
    if fn is None:
        return None
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return sum(p.default is inspect.Parameter.empty for p in positional), len(positional)


def bound_arguments(fn: Callable, args: tuple, kwargs: dict, *, defaults: bool = True
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
    """``fn``'s arguments bound by its own signature: (its named parameters in order, with their
    defaults when ``defaults``; what its ``**kwargs`` took). TypeError for an argument it does
    not take, and for extra positional ones (a ``*args`` that took some)."""
    sig = inspect.signature(fn)
    bound = sig.bind(*args, **kwargs)
    if defaults:
        bound.apply_defaults()
    named = dict(bound.arguments)
    extra: dict[str, Any] = {}
    for p in sig.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            extra = dict(named.pop(p.name, {}) or {})
        elif p.kind is p.VAR_POSITIONAL and named.pop(p.name, ()):
            raise TypeError("extra positional arguments")
    return named, extra


def min_required(n: int) -> Callable[[Any], bool]:
    """`Interface.fits` for functions taking at least ``n`` required positional arguments."""
    def fits(fn: Any) -> bool:
        counts = positional_counts(fn)
        return counts is not None and counts[0] >= n
    return fits


def _bodies(value: Any, glob: dict) -> list[Callable]:
    """The functions behind ``value`` that are defined in the module whose globals are ``glob``:
    the function itself (unwrapped) and those it closes over (a function module's forward
    closes over the function it was made of)."""
    fn = as_function(value)
    if fn is None:
        return []
    inner = inspect.unwrap(fn.__func__ if inspect.ismethod(fn) else fn)
    found = [inner]
    for cell in getattr(inner, "__closure__", None) or ():
        try:
            content = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if inspect.isfunction(content):
            found.append(inspect.unwrap(content))
    return [f for f in found if getattr(f, "__globals__", None) is glob]


HELPER_DEPTH = 2  # module-level helpers followed below the forward (forward -> helper -> helper)


def reachable(module: nn.Module, fits: Callable[[Any], bool]) -> list[tuple[str, str, Callable]]:
    """(where, name, function): the functions ``module`` may hand its core to: its instance
    attributes ("attr"), and the module-level names its forward reads or the module-level
    helpers it calls read, `HELPER_DEPTH` calls deep within its own module ("global"). Each
    function as `as_function` gives it (what to call, with the function's signature)."""
    found = [("attr", n, f) for n, v in vars(module).items()
             if n != "forward" and (f := as_function(v)) is not None and fits(f)]
    fwd = forward_function(module)
    glob = getattr(fwd, "__globals__", {})
    bodies, seen_code, seen_names = [fwd], set(), set()
    for _ in range(HELPER_DEPTH + 1):
        deeper: list[Callable] = []
        for body in bodies:
            code = getattr(body, "__code__", None)
            if code is None or code in seen_code:
                continue
            seen_code.add(code)
            for n in code.co_names:
                if n not in glob or n in seen_names:
                    continue
                seen_names.add(n)
                f = as_function(glob[n])
                if f is None:
                    continue
                if fits(f):
                    found.append(("global", n, f))
                deeper += _bodies(glob[n], glob)
        bodies = deeper
    return found


def outputs_agree(out: Any, ref: Any, dtype: torch.dtype | None = None) -> tuple[bool, str]:
    """Every tensor ``ref`` returns matched by ``out`` within the layer tolerance of ``dtype``
    (default: each output's own dtype); a None in ``ref`` is not compared."""
    from onboarding.align.stats import within
    from onboarding.testing.tolerance import layer_tolerance

    outs = out if isinstance(out, tuple) else (out,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    pairs = [(a, b) for a, b in zip(outs, refs) if isinstance(b, torch.Tensor)]
    if not pairs or len(outs) != len(refs) \
            or not all(isinstance(b, torch.Tensor) or b is None for b in refs):
        return False, "output structure differs"
    for a, b in pairs:
        if not isinstance(a, torch.Tensor) or a.shape != b.shape:
            return False, "output shapes differ"
        ok, msg = within([a.float()], [b.float()], layer_tolerance(dtype or b.dtype), "output")
        if not ok:
            return False, msg
    return True, ""


def _cast_like(out: Any, dtypes: tuple) -> Any:
    """Ours in the original's output dtypes (a torch path may compute and return fp32)."""
    if isinstance(out, tuple):
        return tuple(o.to(d) if isinstance(o, torch.Tensor) and d is not None else o
                     for o, d in zip(out, dtypes))
    return out.to(dtypes[0]) if isinstance(out, torch.Tensor) and dtypes[0] is not None else out


@dataclass(frozen=True)
class Interface:
    """What a family's swap needs to know of the functions it replaces."""

    what: str  # "delta-rule", "chunked-scan": names the call in records
    fits: Callable[[Any], bool]  # a reachable value that may be such a function
    # (fn, kernel, args, kwargs, variant) -> the kernel's output for fn's arguments; raises
    # TypeError when fn was given an argument the kernel does not take
    call: Callable[[Callable, Callable, tuple, dict, Any], Any]
    # (fn, args, kwargs) -> the variants calibration tries, in order (e.g. an l2norm flag)
    variants: Callable[[Callable, tuple, dict], Iterable[Any]] = lambda fn, args, kwargs: (None,)
    # judge at the inputs' dtype (True: the first tensor argument's) rather than the outputs'
    input_dtype_tolerance: bool = False
    # the function is handed the block itself as its first argument (transformers' attention
    # interface: fn(module, query, key, value, attention_mask, ...)): such a call is a core call,
    # not a helper's (a call handed any other module still is)
    takes_block: bool = False
    # the original's output -> what ours returns in its place, the structure the first call is
    # judged on: a None entry is an output ours does not compute (attention weights, which a
    # fused kernel never forms, as transformers' own fused paths return None for them)
    judged: Callable[[Any], Any] | None = None

    def core_call(self, block: nn.Module, args: tuple, kwargs: dict) -> bool:
        """Whether a call of a reachable function is a core call (the swap calibrates on it)
        rather than a helper's: it is handed no module, or, with `takes_block`, the block itself
        first and no other module. The swap (`_Swap`) and the parse stage's probe
        (`record_core_calls`) both decide by this."""
        handed = [a for a in (*args, *kwargs.values()) if isinstance(a, nn.Module)]
        if self.takes_block and args and args[0] is block:
            handed = handed[1:]  # the block, as the interface hands it: a core call
        return not handed


def describe(value: Any) -> Any:
    """An argument's structure as JSON (what the op graph records of a core call and a binding's
    acceptance test reads, `record_core_calls`): a tensor {"tensor": shape, "dtype": ...}, a
    module {"module": its class}, None / bool / int / float / str themselves, a tuple or list
    element by element, anything else {"object": its type}."""
    if isinstance(value, torch.Tensor):
        return {"tensor": list(value.shape), "dtype": str(value.dtype).replace("torch.", "")}
    if isinstance(value, nn.Module):
        return {"module": type(value).__name__}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return [describe(v) for v in value]
    return {"object": type(value).__name__}


def is_tensor(desc: Any, dim: int | None = None) -> bool:
    """A described argument (`describe`) is a tensor (of ``dim`` dims when given)."""
    return isinstance(desc, dict) and "tensor" in desc and (dim is None or len(desc["tensor"]) == dim)


class _Swap:
    """Wraps one reachable function of the block; calibrates on its first call."""

    def __init__(self, fn: Callable, kernel: Callable, patch: CallSwapPatch, name: str):
        self.fn, self.kernel, self.patch, self.name = fn, kernel, patch, name
        self.state = "pending"  # -> bound | kept | helper
        self.variant: Any = None
        self.dtypes: tuple = ()

    def _ours(self, args: tuple, kwargs: dict) -> Any:
        out = self.patch.interface.call(self.fn, self.kernel, args, kwargs, self.variant)
        return _cast_like(out, self.dtypes)

    def __call__(self, *args, **kwargs):
        if self.state == "bound":
            return self._ours(args, kwargs)
        if self.state != "pending":
            return self.fn(*args, **kwargs)
        iface = self.patch.interface
        if not iface.core_call(self.patch.module, args, kwargs):
            # handed a module (the block itself, its conv): a helper of the block, not a core;
            # the functions it calls are swapped in their own right
            self.state = "helper"
            return self.fn(*args, **kwargs)
        # the reference under no_grad: the call that serves the block (ours, or the original's
        # again when no variant agrees) is the only one that saves tensors for the backward, so
        # a first call under activation checkpointing saves what its recomputation will
        with torch.no_grad():
            ref = self.fn(*args, **kwargs)
        judged = iface.judged(ref) if iface.judged is not None else ref
        dtype = None
        if iface.input_dtype_tolerance:
            dtype = next((a.dtype for a in (*args, *kwargs.values())
                          if isinstance(a, torch.Tensor)), None)
        ok, why = False, ""
        for variant in iface.variants(self.fn, args, kwargs):
            try:
                with torch.no_grad():
                    mine = iface.call(self.fn, self.kernel, args, kwargs, variant)
                ok, msg = outputs_agree(mine, judged, dtype)
            except (TypeError, ValueError, RuntimeError) as exc:
                ok, msg = False, f"{type(exc).__name__}: {exc}"
            if ok:
                self.variant = variant
                break
            why = why or msg  # the first variant's reason
        self.state = "bound" if ok else "kept"
        self.patch.calibrated(self.name, ok, why)
        if not ok:
            return self.fn(*args, **kwargs) if torch.is_grad_enabled() else ref
        self.dtypes = tuple(r.dtype if isinstance(r, torch.Tensor) else None
                            for r in (judged if isinstance(judged, tuple) else (judged,)))
        return self._ours(args, kwargs)  # the first call is the kernel's too


def run_swapped(module: nn.Module, original: Callable, wrappers: dict[tuple[str, str], Callable],
                 args: tuple, kwargs: dict) -> Any:
    """``original(*args, **kwargs)`` with each (where, name) of ``module`` (an instance attribute,
    or a global of its forward's module) replaced by its wrapper for the call's duration."""
    glob = forward_function(module).__globals__
    saved_attr, saved_glob = {}, {}
    for (where, name), wrapper in wrappers.items():
        if where == "attr":
            saved_attr[name] = module.__dict__[name]
            module.__dict__[name] = wrapper
        else:
            saved_glob[name] = glob[name]
            glob[name] = wrapper
    try:
        return original(*args, **kwargs)
    finally:
        module.__dict__.update(saved_attr)
        glob.update(saved_glob)


class CallSwapPatch:
    """The swaps of one block, installed for the duration of each of its forward calls."""

    def __init__(self, module: nn.Module, kernel: Callable, record: Any, interface: Interface):
        self.module, self.record, self.interface = module, record, interface
        self.swaps = {(where, name): _Swap(fn, kernel, self, f"{where} {name}")
                      for where, name, fn in reachable(module, interface.fits)}
        self.original = module.forward
        self.calls = 0

    def calibrated(self, name: str, ok: bool, why: str) -> None:
        if ok:
            self.record.status = "active"
            self.record.binding = f"{self.interface.what} call {name} -> kernel"
        elif self.record.status != "active":
            self.record.detail = clip(f"{name}: {why}", 200)

    def forward(self, *args, **kwargs):
        try:
            return run_swapped(self.module, self.original, self.swaps, args, kwargs)
        finally:
            self.calls += 1
            if self.calls == 1 and self.record.status == "pending":
                self.record.status = "rejected"
                self.record.detail = self.record.detail or \
                    f"no {self.interface.what} call matched"


def install(module: nn.Module, kernel: Callable, record: Any, interface: Interface,
            none_found: str) -> Callable[[], None] | None:
    """Install the swaps on ``module``; returns their undo, or None (the record rejected with
    ``none_found``: the block reaches no function that fits)."""
    patch = CallSwapPatch(module, kernel, record, interface)
    if not patch.swaps:
        record.status, record.detail = "rejected", none_found
        return None
    from onboarding.patching.core import swap_forward

    record.binding = "calibrating: " + ", ".join(s.name for s in patch.swaps.values())
    return swap_forward(module, patch.forward)


class _Probe:
    """Wraps one reachable function of a probed block: records its first call when that is a
    core call (`Interface.core_call`, as the swap decides), then always runs the original."""

    def __init__(self, fn: Callable, module: nn.Module, interface: Interface, name: str,
                 calls: list[dict[str, Any]]):
        self.fn, self.module, self.interface, self.name, self.calls = fn, module, interface, name, calls
        self.seen = False

    def __call__(self, *args, **kwargs):
        if not self.seen:
            self.seen = True
            if self.interface.core_call(self.module, args, kwargs):
                try:
                    named, extra = bound_arguments(self.fn, args, kwargs)
                    given = bound_arguments(self.fn, args, kwargs, defaults=False)[0]
                    record: dict[str, Any] = {
                        "function": self.name,
                        "args": {n: describe(v) for n, v in named.items()},
                        "kwargs": {n: describe(v) for n, v in extra.items()},
                        # named parameters the call left at their defaults (a binding that binds
                        # without defaults, as ssd's does, reads only the others)
                        "defaulted": [n for n in named if n not in given]}
                except TypeError as exc:  # the swap's call raises the same on these arguments
                    record = {"function": self.name, "error": f"TypeError: {exc}"}
                self.calls.append(record)
        return self.fn(*args, **kwargs)


def record_core_calls(targets: list[tuple[nn.Module, Interface]], run: Callable[[], Any]
                      ) -> list[dict[str, Any]]:
    """What a swap with each (module, interface) of ``targets`` would find and be handed, read
    off one ``run`` (a forward of the model holding the modules; under no_grad, the swaps' own
    original calls, nothing calibrated): per target, ``{"reachable": [names], "calls": [{"function",
    "args": {name: described}, "kwargs": {...},
    "defaulted": [names left at their defaults]}]}``, the first core call of each reachable
    function that fits (`reachable`, `Interface.core_call`, `describe`), in call order. A
    binding's acceptance test reads this from the op graph (coverage: `FamilySpec.refusal`).
    The functions are wrapped only while their module runs, as the swaps are."""
    from onboarding.patching.core import run_probed, swap_forward

    out: list[dict[str, Any]] = []
    undos: list[Callable[[], None]] = []
    for module, interface in targets:
        calls: list[dict[str, Any]] = []
        probes = {(where, name): _Probe(fn, module, interface, f"{where} {name}", calls)
                  for where, name, fn in reachable(module, interface.fits)}
        out.append({"reachable": [p.name for p in probes.values()], "calls": calls})
        if not probes:
            continue
        undos.append(swap_forward(module, _probing_forward(module, probes)))
    run_probed(undos, run)
    return out


def recorded_refusal(found: dict[str, Any], interface: Interface, none_found: str,
                     call_refusal: Callable[[dict[str, Any]], str | None]) -> str | None:
    """Why `install` and the swaps' first calls would leave a block unpatched, read off what
    `record_core_calls` recorded for ``interface`` (``found``), or None when some call's
    arguments fit: no reachable function (``none_found``, as `install` says), none called as a
    core ("no <what> call matched", as `CallSwapPatch` says), or each call's reason
    (``call_refusal``: the binding's own test on one recorded call; a recorded "error" is the
    TypeError its call raises on those arguments)."""
    if not found.get("reachable"):
        return none_found
    calls = found.get("calls") or []
    if not calls:
        return f"no {interface.what} call matched"
    whys = []
    for call in calls:
        why = call["error"] if "error" in call else call_refusal(call)
        if why is None:
            return None
        whys.append(f"{call['function']}: {why}")
    return "; ".join(whys)


def _probing_forward(module: nn.Module, probes: dict[tuple[str, str], _Probe]) -> Callable:
    original = module.forward

    def forward(*args, **kwargs):
        return run_swapped(module, original, probes, args, kwargs)

    return forward
