"""The block check: the gate every replacement of a whole block passes before it is used (the
Inductor fallback, an LLM-written kernel family's forward).

A replacement is made from the block's module, ``make(module) -> forward_fn`` with the module's
own forward signature. The check rebuilds the seeded proxy model from its `ModelSpec` and, at
each size, draws fresh model inputs, runs the model's forward up to the block (a forward
pre-hook with kwargs captures the block's inputs and ends the forward there), then calls the
replacement and the block's own eager forward in separate calls on separate clones of those
inputs (replacement first, so nothing it returns can come from the reference's call), and
back-propagates the same random cotangents through both. Compared: every floating output, every
gradient of a floating input, and every gradient of the block's trainable parameters, by
relative RMS under the "layer" row of `onboarding.testing.tolerance` (integer outputs must be
equal). Sizes: the captured (batch, seq), the same again with a second draw (a replacement that
returns values cached from an earlier call fails there), then an odd, non-power-of-two sequence
length at batch 1 and 3. A size at which the model's own forward fails is skipped and said so.
Dtypes: fp32, and bf16 on a GPU that supports it (there the reference is the block in fp32 and
the bar is the bf16 "layer" row, or twice the unpatched bf16 block's own error where that is
larger, as in alignment; integer outputs, a router's picks, equal the fp32 block's or differ
in at most twice as many elements as the bf16 block's own; the rows where they, or the bf16
block's own, differ are then compared nowhere, their count kept in the size's
``excluded_rows`` and the verdict's notes: a flipped pick changes everything downstream in its
row, and parameter gradients are compared with those rows' cotangents zeroed in every backward,
see `onboarding.generate.flips`; so are the few rows the fp32 block itself jumps in when its
inputs and parameters move by bf16's epsilon, a threshold its routing weights cross with the
picks unchanged, found from the block alone). Where the block's own bf16 forward
raises (xLSTM's chunkwise path multiplies fp32 initial states with bf16 keys), the replacement
is judged by the row alone, and a replacement that raises there too (the block's code compiled)
has that size skipped.

`check_block` runs all this in a subprocess with a timeout (the replacement named by
`Replacement`, "package.module:function" or "/path/file.py:function", so it can be made on the
other side) and returns a `BlockVerdict`. ``in_process=True`` takes any callable (tests).
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import inspect
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from onboarding.generate import flips
from onboarding.generate.flips import RowExclusion
from onboarding.load.spec import ModelSpec
from onboarding.testing.tolerance import compare_scaled, layer_tolerance, rel_rms

FLOOR_FACTOR = 2.0  # bf16: at most this times the unpatched bf16 block's own error


@dataclass(kw_only=True)
class Replacement:
    """How the check's subprocess makes the replacement: ``target`` names a function
    ("package.module:function" or "/path/to/file.py:function") called as
    ``function(module, **kwargs) -> forward_fn``. A forward_fn with a ``finish()`` method has it
    called after the last size; what it returns (JSON) is kept in the verdict's ``artifacts``."""

    target: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    label: str = ""

    def load(self) -> Callable[..., Callable]:
        where, _, name = self.target.rpartition(":")
        if not where or not name:
            raise ValueError(f"replacement target {self.target!r}: expected module:function")
        if where.endswith(".py"):
            spec = importlib.util.spec_from_file_location(f"_onboard_repl_{abs(hash(where))}",
                                                          where)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
        else:
            mod = importlib.import_module(where)
        fn = getattr(mod, name, None)
        if not callable(fn):
            raise ValueError(f"replacement target {self.target!r}: no function {name}")
        return lambda module: fn(module, **self.kwargs)


@dataclass(kw_only=True)
class TensorError:
    name: str  # "out0", "grad of hidden_states", "grad of param inp.weight"
    passed: bool
    rel_rms: float | None = None
    bound: float | None = None
    message: str = ""


@dataclass(kw_only=True)
class SizeCheck:
    batch: int
    seq: int
    dtype: str
    draw: int  # the seed the model inputs were drawn with
    passed: bool = False
    skipped: str = ""  # why this size was not checked (the model's own forward fails there)
    errors: list[TensorError] = field(default_factory=list)
    seconds: float = 0.0  # the replacement's first call at this size (compiles included)
    # 16 bits: rows whose integer picks (a router's) flipped within the tolerance, or that jumped
    # where the fp32 block itself is unstable, left out of the comparisons
    # (onboarding.generate.flips)
    excluded_rows: int = 0


@dataclass(kw_only=True)
class BlockVerdict:
    path: str
    replacement: str
    passed: bool = False
    reason: str = ""  # the first failure, in one line; "" when passed
    sizes: list[SizeCheck] = field(default_factory=list)
    device: str = ""
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    artifacts: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BlockVerdict:
        d = dict(d)
        d["sizes"] = [SizeCheck(**{**s, "errors": [TensorError(**e) for e in s["errors"]]})
                      for s in d.get("sizes", [])]
        return cls(**d)

    def summary(self) -> str:
        checked = [s for s in self.sizes if not s.skipped]
        worst = max((e.rel_rms for s in checked for e in s.errors if e.rel_rms is not None
                     and math.isfinite(e.rel_rms)), default=None)
        what = ", ".join(f"{s.batch}x{s.seq} {s.dtype}" + (f" ({s.excluded_rows} rows "
                                                           "excluded)" if s.excluded_rows else "")
                         for s in checked) or "no size"
        head = "passed" if self.passed else f"FAILED: {self.reason}"
        return head + f" ({what}" + (f"; worst rel_rms {worst:.1e}" if worst is not None
                                     else "") + ")"


def default_sizes(batch: int, seq: int) -> list[tuple[int, int]]:
    """The captured size twice (two draws), then an odd, non-power-of-two seq at batch 1 and 3."""
    odd = max(3, seq // 2 + 5) | 1
    if odd & (odd - 1) == 0 or odd == seq:
        odd += 2
    return [(batch, seq), (batch, seq), (1, odd), (3, odd)]


def default_dtypes(device: str) -> list[str]:
    if device.startswith("cuda") and torch.cuda.is_bf16_supported():
        return ["fp32", "bf16"]
    return ["fp32"]


def check_block(spec: ModelSpec, path: str, replacement: Replacement | Callable, *,
                batch: int = 1, seq: int = 64, sizes: list[tuple[int, int]] | None = None,
                dtypes: list[str] | None = None, seed: int = 0, kind: str = "",
                timeout_s: float = 600.0,
                in_process: bool = False, env: dict[str, str] | None = None) -> BlockVerdict:
    """Check ``replacement`` against the block at ``path`` of the proxy of ``spec`` (module
    docstring). In a subprocess with ``timeout_s`` unless ``in_process``."""
    label = replacement.label or replacement.target if isinstance(replacement, Replacement) \
        else getattr(replacement, "__qualname__", repr(replacement))
    request = {"spec": asdict(spec), "path": path, "batch": batch, "seq": seq,
               "sizes": sizes or default_sizes(batch, seq), "dtypes": dtypes, "seed": seed,
               "kind": kind}
    if in_process:
        make = replacement.load() if isinstance(replacement, Replacement) else replacement
        return run_check(request, make, label)
    if not isinstance(replacement, Replacement):
        raise TypeError("a callable cannot cross into the check's subprocess: give a "
                        "Replacement naming it (module:function), or in_process=True")
    from onboarding.families import subprocess_env

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="blockcheck-") as tmp:
        out = Path(tmp) / "verdict.json"
        request.update(replacement=asdict(replacement), out=str(out), label=label)
        try:
            proc = subprocess.run([sys.executable, "-m", "onboarding.generate.blockcheck"],
                                  input=json.dumps(request), capture_output=True, text=True,
                                  timeout=timeout_s, env=subprocess_env(env))
        except subprocess.TimeoutExpired:
            return BlockVerdict(path=path, replacement=label, passed=False,
                                reason=f"timeout after {timeout_s:.0f} s",
                                seconds=round(time.perf_counter() - t0, 1))
        if out.exists():
            return BlockVerdict.from_dict(json.loads(out.read_text()))
        lines = [ln for ln in (proc.stderr or proc.stdout or "").strip().splitlines() if ln]
        return BlockVerdict(path=path, replacement=label, passed=False,
                            reason=f"check process exited {proc.returncode}: "
                            + (lines[-1][:300] if lines else "no output"),
                            seconds=round(time.perf_counter() - t0, 1))


# -- the check itself (runs in the subprocess) --------------------------------------------------

class _Stop(Exception):
    pass


def _clone(x: Any, grad: bool = False) -> Any:
    if isinstance(x, torch.Tensor):
        y = x.detach().clone()
        return y.requires_grad_(True) if grad and y.is_floating_point() else y
    if isinstance(x, tuple):
        return tuple(_clone(v, grad) for v in x)
    if isinstance(x, list):
        return [_clone(v, grad) for v in x]
    if isinstance(x, dict):
        return {k: _clone(v, grad) for k, v in x.items()}
    return x


class NotCalled(Exception):
    """The model's forward never called the block."""


def capture_block_inputs(model: torch.nn.Module, config: Any, path: str, batch: int, seq: int,
                         seed: int) -> tuple[tuple, dict]:
    """(args, kwargs) of the module at ``path`` on its first call during a forward of ``model``
    on inputs drawn at (batch, seq) with ``seed`` (clones; the forward stops there). Raises what
    the model's forward raises, or `NotCalled`."""
    from onboarding.graph.parse import example_inputs

    module = model.get_submodule(path)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    captured: dict[str, Any] = {}

    def pre(mod, args, kwargs):
        captured["args"], captured["kwargs"] = _clone(args), _clone(kwargs)
        raise _Stop

    handle = module.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        inputs, kwargs = example_inputs(model, config, batch, seq, seed)
        inputs = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs)
        with torch.no_grad():
            model(*inputs, **kwargs)
    except _Stop:
        pass
    finally:
        handle.remove()
    if not captured:
        raise NotCalled(f"the model's forward did not call {path} at batch {batch}, seq {seq}")
    return captured["args"], captured["kwargs"]


def _cast(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, (tuple, list)):
        return type(x)(_cast(v, dtype) for v in x)
    if isinstance(x, dict):
        return {k: _cast(v, dtype) for k, v in x.items()}
    return x


def _flat(x: Any) -> list[torch.Tensor | None]:
    """The tensors of an output, in order (a ModelOutput by its fields; None kept as None)."""
    if isinstance(x, torch.Tensor) or x is None:
        return [x]
    if hasattr(x, "to_tuple"):
        return _flat(x.to_tuple())
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _flat(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _flat(v)]
    return []


def _leaves(args: tuple, kwargs: dict, names: list[str]) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of the floating inputs that require grad, named by the signature."""
    out = []
    for i, a in enumerate(args):
        name = names[i] if i < len(names) else f"arg{i}"
        out += [(name if len(_flat(a)) == 1 else f"{name}[{j}]", t)
                for j, t in enumerate(_flat(a)) if isinstance(t, torch.Tensor)
                and t.requires_grad]
    for k, v in kwargs.items():
        out += [(k if len(_flat(v)) == 1 else f"{k}[{j}]", t) for j, t in enumerate(_flat(v))
                if isinstance(t, torch.Tensor) and t.requires_grad]
    return out


@dataclass
class _Call:
    """One forward on fresh clones, its graph kept for `_backward`."""

    outs: list[Any]
    leaves: list[tuple[str, torch.Tensor]]
    diff: list[torch.Tensor]


def _forward(fn: Callable, args: tuple, kwargs: dict, names: list[str]) -> _Call:
    a, k = _clone(args, grad=True), _clone(kwargs, grad=True)
    outs = _flat(fn(*a, **k))
    return _Call(outs=outs, leaves=_leaves(a, k, names),
                 diff=[o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad])


def _backward(call: _Call, module: torch.nn.Module, cot_seed: int,
              rows: RowExclusion | None = None
              ) -> tuple[list[torch.Tensor | None], dict[str, torch.Tensor | None]]:
    """Outputs and gradients (inputs, then parameters) of ``call``, back-propagating random
    cotangents drawn from ``cot_seed`` (zeroed in the excluded ``rows``)."""
    for p in module.parameters():
        p.grad = None
    gen = torch.Generator().manual_seed(cot_seed)
    if call.diff:
        cots = [torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in call.diff]
        if rows is not None:
            cots = [rows.zero(c) for c in cots]
        torch.autograd.backward(call.diff, cots)
    grads: dict[str, torch.Tensor | None] = {}
    for name, t in call.leaves:
        grads[f"grad of {name}"] = None if t.grad is None else t.grad.detach().clone()
    for name, p in module.named_parameters():
        if p.requires_grad:
            grads[f"grad of param {name}"] = None if p.grad is None else p.grad.detach().clone()
        p.grad = None
    return [o.detach() if isinstance(o, torch.Tensor) else o for o in call.outs], grads


def _exclusion(cand: _Call, ref: _Call, floor: _Call | None,
               make_probe: Callable[[], Callable[[torch.Generator, float], list]],
               dtype: torch.dtype, seed: int) -> RowExclusion | None:
    """The rows whose integer picks flipped within the 16-bit tolerance (`flips`): the
    replacement's or the 16-bit block's own, against the fp32 reference, and the rows the fp32
    block itself jumps in under perturbations of ``dtype``'s size (`flips.probe`, run by what
    ``make_probe()`` returns, made only where a row of a block with such picks jumped). None in
    fp32 (no floor: any flip fails) and where nothing is excluded."""
    if floor is None:
        return None
    tolerated = [isinstance(r, torch.Tensor) and not r.is_floating_point()
                 and isinstance(c, torch.Tensor) and c.shape == r.shape
                 and _integers("", c, r, f).passed
                 for c, r, f in zip(cand.outs, ref.outs,
                                    floor.outs + [None] * (len(ref.outs) - len(floor.outs)))]
    if len(cand.outs) != len(ref.outs) or not any(tolerated):
        return None
    return flips.exclusion(cand.outs, ref.outs, floor.outs, [t for _, t in ref.leaves],
                           tolerated, lambda n: flips.probe(make_probe(), ref.outs, n, seed,
                                                            eps=torch.finfo(dtype).eps))


def _perturbed_runner(module: torch.nn.Module, args: tuple, kwargs: dict
                      ) -> Callable[[torch.Generator, float], list]:
    """``run(gen, eps)``: the fp32 block (a copy of ``module``) on ``args``/``kwargs`` with its
    parameters and floating inputs multiplied by (1 +- eps), signs drawn from ``gen``."""
    mod = copy.deepcopy(module)
    base = [p.detach().clone() for p in mod.parameters()]

    def run(gen: torch.Generator, eps: float) -> list:
        with torch.no_grad():
            for p, p0 in zip(mod.parameters(), base):
                p.copy_(p0)
            flips.perturb(list(mod.parameters()), eps, gen)
            a, k = _clone(args), _clone(kwargs)
            flips.perturb([t for t in _flat(a) + _flat(k) if isinstance(t, torch.Tensor)],
                          eps, gen)
            return _flat(mod(*a, **k))
    return run


@dataclass
class _SizeOutcome:
    """What `_check_size` found at one size: the errors when every step ran, else why not."""

    errors: list[TensorError] | None = None
    skipped: str = ""  # no verdict on the replacement (the block's own code failed first)
    failure: str = ""  # the replacement raised
    own: str = ""  # the block's own 16-bit code failed: judged by the row alone
    rows: RowExclusion | None = None
    seconds: float | None = None  # the replacement's forward + backward, once it ran


def _check_size(fn: Callable, module: torch.nn.Module, ref_module: torch.nn.Module, original: Callable,
                args: tuple, kwargs: dict, names: list[str], dtype: str, kind: str, draw: int,
                floor: bool, where: str = "", strict: bool = False) -> _SizeOutcome:
    """One size of the block check: ``fn`` against the reference (``original``, the block's own
    forward, when ``ref_module`` is ``module``; else ``ref_module``'s fp32 forward on fp32
    inputs), with the unpatched 16-bit block (``original``) as the floor when ``floor`` and the
    reference is not the block itself; the rows whose integer picks flipped within the tolerance
    left out (`_exclusion`); forward and every gradient under cotangents drawn from ``draw``.
    ``strict``: every exception propagates (the tuner's trials); else a failing step becomes the
    outcome's reason (``where`` names the size in it)."""
    from onboarding.align.core import as_dtype

    def attempt(thunk: Callable[[], Any]) -> tuple[Any, str]:
        if strict:
            return thunk(), ""
        try:
            return thunk(), ""
        except Exception as exc:  # noqa: BLE001 - the reason is the outcome
            return None, _last_line(exc)

    out = _SizeOutcome()
    own_ref = ref_module is module
    ref_args = args if own_ref else _cast(args, torch.float32)
    ref_kw = kwargs if own_ref else _cast(kwargs, torch.float32)
    ref_call, err = attempt(lambda: _forward(original if own_ref else ref_module.forward, ref_args, ref_kw,
                                             names))
    if err:
        out.skipped = f"the block's own forward fails at {where}: {err}"
        return out
    floor_call = None
    if floor and not own_ref:  # 16-bit: the unpatched block's own error sets a floor
        floor_call, err = attempt(lambda: _forward(original, args, kwargs, names))
        if err:  # the block's own code fails in 16 bits (xLSTM's chunkwise path: fp32 initial
            # states @ bf16 keys): no floor, the row alone
            out.own = f"the block's own {dtype} forward fails at {where}: {err}"
    s0 = time.perf_counter()
    cand_call, err = attempt(lambda: _forward(fn, args, kwargs, names))
    if err:
        out.seconds = round(time.perf_counter() - s0, 2)
        _fail(out, dtype, where, err)
        return out
    s1 = time.perf_counter()
    # rows whose integer picks flipped within the 16-bit tolerance (or jumped where the block
    # itself is unstable): compared nowhere, their cotangents zeroed in every backward
    # (onboarding.generate.flips)
    out.rows = _exclusion(cand_call, ref_call, floor_call,
                          lambda: _perturbed_runner(ref_module, _cast(args, torch.float32),
                                                    _cast(kwargs, torch.float32)),
                          as_dtype(dtype), draw)
    ref, err = attempt(lambda: _backward(ref_call, ref_module, draw, out.rows))
    if err:
        out.skipped = f"the block's own backward fails at {where}: {err}"
        return out
    floor_out = None
    if floor_call is not None:
        floor_out, err = attempt(lambda: _backward(floor_call, module, draw, out.rows))
        if err:
            out.own = f"the block's own {dtype} backward fails at {where}: {err}"
    s2 = time.perf_counter()
    cand, err = attempt(lambda: _backward(cand_call, module, draw, out.rows))
    out.seconds = round(s1 - s0 + time.perf_counter() - s2, 2)
    if err:
        _fail(out, dtype, where, err)
        return out
    out.errors = _judge(cand, ref, floor_out, dtype, kind, out.rows)
    return out


def _fail(out: _SizeOutcome, dtype: str, where: str, err: str) -> None:
    """The replacement raised: a failure, or no verdict where the block's own code fails too."""
    if out.own:
        out.skipped = f"{out.own}; so does the replacement"
    else:
        out.failure = f"the replacement raised at {where}, {dtype}: {err}"


def judge_once(fn: Callable, module: torch.nn.Module, ref_module: torch.nn.Module,
               args: tuple, kwargs: dict, names: list[str], draw: int, dtype: str, kind: str,
               floor: bool = False) -> list[TensorError]:
    """One size of the block check as `run_check` judges it (`_check_size`), for the tuner's
    check of each trial: the same comparisons, without skip reasons; raises what the calls
    raise."""
    out = _check_size(fn, module, ref_module, module.forward, args, kwargs, names, dtype, kind, draw,
                      floor, strict=True)
    assert out.errors is not None  # strict: every step ran or raised
    return out.errors


def _judge(cand: tuple, ref: tuple, floor: tuple | None, dtype: str, kind: str,
           rows: RowExclusion | None = None) -> list[TensorError]:
    """Every output and gradient of ``cand`` against ``ref`` (the bar: the layer row, or
    FLOOR_FACTOR times the 16-bit block's own error ``floor``). ``rows``: the excluded rows
    (`_exclusion`), left out of the floating outputs and the input gradients
    (parameter gradients: the caller zeroed those rows' cotangents)."""
    tol = layer_tolerance(dtype, kind)
    (c_out, c_grads), (r_out, r_grads) = cand, ref
    errors: list[TensorError] = []
    if len(c_out) != len(r_out):
        return [TensorError(name="outputs", passed=False,
                            message=f"the replacement returned {len(c_out)} tensors, the "
                            f"block {len(r_out)}")]

    def bound_for(name: str, f: torch.Tensor | None, r: torch.Tensor) -> float:
        if f is None:
            return tol.max_rel_rms
        return max(tol.max_rel_rms, FLOOR_FACTOR * rel_rms(f.float(), r.float()))

    def kept(name: str, c: torch.Tensor, r: torch.Tensor, f: torch.Tensor | None):
        """(c, r, f) without the excluded rows where ``r`` has them, else as given."""
        if rows is None or name.startswith("grad of param "):
            return c, r, f
        rk = rows.keep(r)
        ck = rows.keep(c) if c.shape == r.shape else None
        if rk is None or ck is None:
            return c, r, f
        return ck, rk, rows.keep(f) if f is not None and f.shape == r.shape else None

    f_out, f_grads = floor if floor is not None else ([None] * len(r_out), {})
    for i, (c, r) in enumerate(zip(c_out, r_out)):
        name = f"out{i}"
        if r is None or c is None:
            if (r is None) != (c is None):
                errors.append(TensorError(name=name, passed=False, message=f"{name}: "
                                          f"{'None' if c is None else 'a tensor'} where the "
                                          f"block returns {'None' if r is None else 'a tensor'}"))
            continue
        if not r.is_floating_point():
            errors.append(_integers(name, c, r, f_out[i] if i < len(f_out) else None))
            continue
        c, r, f = kept(name, c, r, f_out[i] if i < len(f_out) else None)
        errors.append(_compare(name, c, r, bound_for(name, f, r), tol))
    for name, r in r_grads.items():
        c = c_grads.get(name)
        if r is None:
            continue
        if c is None:
            what = name.replace("grad of param ", "parameter ").replace("grad of ", "input ")
            errors.append(TensorError(name=name, passed=False,
                                      message=f"no gradient reached {what}"))
            continue
        c, r, f = kept(name, c, r, f_grads.get(name))
        errors.append(_compare(name, c, r, bound_for(name, f, r), tol))
    return errors


def _integers(name: str, c: torch.Tensor, r: torch.Tensor, f: torch.Tensor | None
              ) -> TensorError:
    """Integer outputs (a router's selected experts) equal the reference's. In 16 bits (``f``:
    the unpatched 16-bit block's own) a pick that rounding flips away from the fp32 reference
    flips for the block too: equal to the block's own 16-bit result, or at most FLOOR_FACTOR
    times its count of elements that differ from the reference, passes."""
    if c.shape != r.shape:
        return TensorError(name=name, passed=False, message=f"{name}: integer output of shape "
                           f"{tuple(c.shape)}, the block's {tuple(r.shape)}")
    c, r = c.cpu(), r.cpu()
    bad = int((c != r).sum())
    if not bad:
        return TensorError(name=name, passed=True, message=f"{name}: equal")
    if f is not None and f.shape == r.shape:
        f = f.cpu()
        own = int((f != r).sum())
        if torch.equal(c, f) or bad <= FLOOR_FACTOR * own:
            return TensorError(name=name, passed=True, message=f"{name}: {bad} of {r.numel()} "
                               f"differ from the fp32 block, the 16-bit block's own: {own}")
        return TensorError(name=name, passed=False, message=f"{name}: integer output differs "
                           f"in {bad} of {r.numel()} elements (the 16-bit block's own: {own})")
    return TensorError(name=name, passed=False, message=f"{name}: integer output differs in "
                       f"{bad} of {r.numel()} elements")


def _compare(name: str, c: torch.Tensor, r: torch.Tensor, bound: float, tol) -> TensorError:
    from dataclasses import replace

    cmp = compare_scaled(c.float(), r.float(), replace(tol, max_rel_rms=bound), name)
    rr = cmp.rel_rms if math.isfinite(cmp.rel_rms) else None
    msg = cmp.message if cmp.passed else (
        f"{name}: rel_rms {cmp.rel_rms:.1e} > {bound:.0e}" if not math.isfinite(cmp.rel_rms)
        or cmp.rel_rms > bound else cmp.message)
    return TensorError(name=name, passed=cmp.passed, rel_rms=rr, bound=bound, message=msg)


# torch's closing advice lines, not the error (an InductorError ends with them)
_BOILERPLATE = ("Set TORCHDYNAMO_VERBOSE", "For even more developer context", "You can suppress",
                "To execute this test", "from user code:", "  File ")


def _last_line(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).strip().splitlines()
             if ln.strip() and not ln.lstrip().startswith(_BOILERPLATE)]
    return f"{type(exc).__name__}: {lines[-1].strip()[:240] if lines else ''}"


def run_check(req: dict[str, Any], make: Callable[..., Callable], label: str) -> BlockVerdict:
    """The check of the module docstring, in this process."""
    from onboarding.align.core import as_dtype
    from onboarding.backend import kernel_device
    from onboarding.graph.parse import load_shipped_weights, load_stage

    t0 = time.perf_counter()
    path, seed = req["path"], int(req.get("seed", 0))
    device = str(kernel_device())
    verdict = BlockVerdict(path=path, replacement=label, device=device)
    spec = ModelSpec(**req["spec"])
    info = load_stage(spec.load(), spec.proxy)
    base = info.loaded.build(info.proxy_config, seed=seed).eval()
    load_shipped_weights(base, info)
    kind = req.get("kind") or ""
    for dtype_name in req.get("dtypes") or default_dtypes(device):
        dtype = as_dtype(dtype_name)
        model = copy.deepcopy(base).to(device=device, dtype=dtype).eval()
        module = dict(model.named_modules()).get(path)
        if module is None:
            verdict.reason = f"no module at {path} in the proxy model"
            break
        original = module.forward
        names = [p for p in inspect.signature(original).parameters]
        ref_module = module if dtype == torch.float32 else \
            copy.deepcopy(module).to(torch.float32)
        try:
            fn = make(module)
        except Exception as exc:  # the replacement could not be made: its own failure
            verdict.reason = f"making the replacement raised {_last_line(exc)}"
            break
        if not callable(fn):
            verdict.reason = f"the replacement's make() returned {type(fn).__name__}, " \
                "not a forward function"
            break
        for draw, (b, t) in enumerate(req["sizes"]):
            size = SizeCheck(batch=b, seq=t, dtype=dtype_name, draw=seed + 1 + draw)
            verdict.sizes.append(size)
            try:
                args, kw = capture_block_inputs(model, info.proxy_config, path, b, t, size.draw)
            except NotCalled as exc:
                size.skipped = str(exc)
                continue
            except Exception as exc:
                size.skipped = f"the model's own forward fails at batch {b}, seq {t}: " \
                    + _last_line(exc)
                continue
            out = _check_size(fn, module, ref_module, original, args, kw, names, dtype_name, kind,
                              size.draw, floor=True, where=f"batch {b}, seq {t}")
            if out.seconds is not None:
                size.seconds = out.seconds
            if out.skipped:
                size.skipped = out.skipped
                continue
            if out.failure:
                verdict.reason = out.failure
                break
            if out.own:
                verdict.notes.append(f"{out.own} (judged by the {dtype_name} row alone)")
            if out.rows is not None:
                size.excluded_rows = out.rows.count
                verdict.notes.append(f"{dtype_name} at batch {b}, seq {t}: "
                                     + out.rows.describe(dtype_name))
            size.errors = out.errors
            size.passed = all(e.passed for e in size.errors)
            if not size.passed:
                bad = next(e for e in size.errors if not e.passed)
                verdict.reason = f"{bad.message} (batch {b}, seq {t}, {dtype_name})"
                break
        finish = getattr(fn, "finish", None)
        if callable(finish):
            try:
                verdict.artifacts[dtype_name] = finish()
            except Exception as exc:
                verdict.notes.append(f"finish() raised {_last_line(exc)}")
        if verdict.reason:
            break
    checked = [s for s in verdict.sizes if not s.skipped]
    skipped = [s for s in verdict.sizes if s.skipped]
    if skipped:
        verdict.notes += sorted({s.skipped for s in skipped})
    if not verdict.reason and not checked:
        verdict.reason = "no size could be checked: " + (skipped[0].skipped if skipped else
                                                          "no sizes")
    verdict.passed = not verdict.reason and all(s.passed for s in checked)
    verdict.seconds = round(time.perf_counter() - t0, 1)
    return verdict


def main() -> int:
    req = json.loads(sys.stdin.read())
    repl = Replacement(**req["replacement"])
    out = Path(req["out"])
    try:
        make = repl.load()
        verdict = run_check(req, make, req.get("label") or repl.target)
    except Exception as exc:
        verdict = BlockVerdict(path=req["path"], replacement=req.get("label") or repl.target,
                               passed=False, reason=_last_line(exc))
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(verdict.to_dict(), default=str))
    os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
