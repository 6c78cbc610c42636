"""The gate's numeric and runtime check, run in a subprocess (``python -m
onboarding.generate.llm.worker``, a JSON request on stdin, the verdict as the last stdout line).

It rebuilds the proxy model from the run's ModelSpec (seeded), and at each size (batch, seq)
captures the block's call arguments twice, from two different random batches (a forward
pre-hook with kwargs). On the first draw it runs the block's own forward, then, in a separate
call under the `Monitor` (fresh allocations poisoned, Triton launches counted, ATen ops
recorded), ``block_forward(module, ...)``; it compares every output tensor and every gradient
(the float inputs and the block's parameters, under random output weights) with the eager ones.
On the second draw it calls the kernel again on the redrawn inputs and compares again: a kernel
that returns values kept from the first call fails there. The kernel module's data globals are
snapshotted around the calls; one that changed is reported. The answer's reference is compared
with the block on the first draw, forward only.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from typing import Any

import torch

from onboarding.generate.llm.folder import flat_tensors
from onboarding.generate.llm.runtime import Monitor, module_state, state_changes


class _Stop(Exception):
    pass


def _clone(x: Any, grad: bool) -> Any:
    if isinstance(x, torch.Tensor):
        y = x.detach().clone()
        return y.requires_grad_(grad and y.is_floating_point())
    if isinstance(x, tuple):
        return tuple(_clone(v, grad) for v in x)
    if isinstance(x, list):
        return [_clone(v, grad) for v in x]
    if isinstance(x, dict):
        return {k: _clone(v, grad) for k, v in x.items()}
    return x


def capture(model: torch.nn.Module, module: torch.nn.Module, inputs: tuple, kwargs: dict
            ) -> tuple[tuple, dict]:
    """The block's (args, kwargs) on its first call during a forward of ``model``."""
    seen: dict[str, Any] = {}

    def pre(m, args, kw):
        seen["call"] = (_clone(args, False), _clone(kw, False))
        raise _Stop

    h = module.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        with torch.no_grad():
            model(*inputs, **kwargs)
    except _Stop:
        pass
    finally:
        h.remove()
    if "call" not in seen:
        raise RuntimeError("the block was not called by the model's forward")
    return seen["call"]


def _leaves(args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    out = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.requires_grad:
            out.append((f"arg{i}", a))
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor) and v.requires_grad:
            out.append((k, v))
    return out


def _run(fn: Any, module: torch.nn.Module, call: tuple[tuple, dict], weights_seed: int,
         monitor: Monitor | None) -> tuple[list[torch.Tensor], list[tuple[str, torch.Tensor | None]]]:
    """(outputs, [(name, grad)]) of ``fn(*args, **kwargs)`` on fresh leaf copies of the call."""
    args, kwargs = _clone(call[0], True), _clone(call[1], True)
    params = [(f"param {n}", p) for n, p in module.named_parameters() if p.requires_grad]
    leaves = _leaves(args, kwargs) + params
    for _, p in params:
        p.grad = None
    if monitor is not None:
        with monitor:
            out = fn(*args, **kwargs)
    else:
        out = fn(*args, **kwargs)
    outs = flat_tensors(out)
    gen = torch.Generator().manual_seed(weights_seed)
    diff = [o for o in outs if o.is_floating_point() and o.requires_grad]
    ws = [torch.randn(o.shape, generator=gen, dtype=torch.float32).to(o.dtype) for o in diff]
    grads: list[Any] = [None] * len(leaves)
    if diff and leaves:
        if monitor is not None:
            with monitor:
                grads = list(torch.autograd.grad(diff, [t for _, t in leaves], ws, allow_unused=True))
        else:
            grads = list(torch.autograd.grad(diff, [t for _, t in leaves], ws, allow_unused=True))
    return [o.detach() for o in outs], [(n, g) for (n, _), g in zip(leaves, grads)]


def _compare(outs, ref_outs, grads, ref_grads, kind: str) -> tuple[list[dict], str]:
    from onboarding.testing.tolerance import compare_scaled, tolerance_for

    rows, reason = [], ""
    if len(outs) != len(ref_outs):
        return [], f"{len(outs)} output tensors, the block returns {len(ref_outs)}"
    for i, (a, b) in enumerate(zip(outs, ref_outs)):
        if not b.is_floating_point():
            ok = a.shape == b.shape and bool((a == b).all())
            rows.append({"name": f"output {i}", "passed": ok, "rel_rms": 0.0 if ok else 1.0})
            reason = reason or ("" if ok else f"output {i}: integer values differ")
            continue
        c = compare_scaled(a.float(), b.float(), tolerance_for(b.dtype, "layer"), f"output {i}")
        rows.append(c.as_dict())
        if not c.passed and not reason:
            reason = f"output {i}: {c.message}"
    for (name, g), (_, r) in zip(grads, ref_grads):
        if r is None and g is None:
            continue
        if r is None or g is None:
            rows.append({"name": f"grad of {name}", "passed": False, "rel_rms": 1.0})
            reason = reason or f"grad of {name}: {'missing' if g is None else 'unexpected'} " \
                "(no gradient reached it)"
            continue
        c = compare_scaled(g.float(), r.float(), tolerance_for(r.dtype, "layer"), f"grad of {name}")
        rows.append(c.as_dict())
        if not c.passed and not reason:
            reason = c.message
    return rows, reason


def check(req: dict[str, Any]) -> dict[str, Any]:
    from onboarding.backend import ensure_triton_backend

    ensure_triton_backend()
    from onboarding.generate.templating import load_module
    from onboarding.graph.parse import example_inputs, load_stage
    from onboarding.load.spec import ModelSpec

    kmod = load_module(req["module"])
    fn = getattr(kmod, "block_forward", None)
    if fn is None:
        return {"ok": False, "reason": "the rendered module has no block_forward", "stage": "load"}
    spec = ModelSpec(**req["spec"])
    info = load_stage(spec.load(), spec.proxy)
    model = info.loaded.build(info.proxy_config, device="cpu", seed=req.get("seed", 0)).float().eval()
    module = dict(model.named_modules()).get(req["path"])
    if module is None:
        return {"ok": False, "reason": f"no module at {req['path']} in the proxy", "stage": "load"}
    monitor = Monitor(poison=True)
    sizes, reason, state_diff, first_call = [], "", [], None
    before = module_state(kmod)
    for n, (batch, seq) in enumerate(req["sizes"]):
        t0 = time.perf_counter()
        draws = []
        for d in range(2):
            ins, kw = example_inputs(model, info.proxy_config, batch, seq, 1000 * n + d + 1)
            draws.append(capture(model, module, ins, kw))
        first_call = first_call or draws[0]
        row: dict[str, Any] = {"batch": batch, "seq": seq, "draws": []}
        for d, call in enumerate(draws):
            ref_outs, ref_grads = _run(module.forward, module, call, 7 + d, None)
            try:
                outs, grads = _run(lambda *a, **k: fn(module, *a, **k), module, call, 7 + d, monitor)
            except Exception as exc:
                last = (str(exc).strip().splitlines() or [""])[-1][:300]
                reason = f"batch {batch}, seq {seq}: block_forward raised {type(exc).__name__}: {last}"
                row["draws"].append({"error": reason})
                break
            rows, why = _compare(outs, ref_outs, grads, ref_grads, "layer")
            row["draws"].append({"checks": rows})
            if why:
                reason = f"batch {batch}, seq {seq}, draw {d + 1}{' (inputs redrawn)' if d else ''}: {why}"
                break
        row["seconds"] = round(time.perf_counter() - t0, 2)
        sizes.append(row)
        if reason:
            break
    state_diff = state_changes(before, module_state(kmod))
    rec = monitor.record
    ref_check = _check_reference(req, module, first_call)
    cheat = ""
    if state_diff:
        cheat = f"anti-cheat (runtime): module-level state written during calls: {', '.join(state_diff)} " \
            "(outputs kept from earlier calls)"
    elif rec.forbidden:
        ops = ", ".join(f"aten.{k} x{v}" for k, v in sorted(rec.forbidden.items()))
        cheat = f"anti-cheat (runtime): torch ops do the work outside Triton kernels: {ops}"
    elif rec.launches == 0 and not reason:
        cheat = "anti-cheat (runtime): no Triton kernel was launched by block_forward"
    if cheat:  # the cheat is the reason; what the numbers said comes after it
        reason = cheat + (f"; also {reason}" if reason else "")
    if not reason and ref_check.get("reason"):
        reason = ref_check["reason"]
    return {"ok": not reason, "reason": reason, "stage": "runtime" if reason else "passed",
            "sizes": sizes, "monitor": rec.as_dict(), "state_changes": state_diff,
            "reference": ref_check}


def _check_reference(req: dict[str, Any], module: torch.nn.Module, call: Any) -> dict[str, Any]:
    """The answer's reference against the block on one draw, forward only."""
    if not req.get("reference") or call is None:
        return {"checked": False}
    import importlib.util

    spec = importlib.util.spec_from_file_location("onboard_llm_reference", req["reference"])
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
        with torch.no_grad():
            out = flat_tensors(mod.reference(module, *_clone(call[0], False), **_clone(call[1], False)))
            ref = flat_tensors(module.forward(*_clone(call[0], False), **_clone(call[1], False)))
    except Exception as exc:
        return {"checked": True, "reason": f"reference raised {type(exc).__name__}: "
                f"{(str(exc).strip().splitlines() or [''])[-1][:200]}"}
    rows, why = _compare(out, ref, [], [], "layer")
    return {"checked": True, "checks": rows, "reason": f"reference does not match the block: {why}" if why else ""}


def main() -> int:
    req = json.loads(sys.stdin.read())
    try:
        out = check(req)
    except Exception as exc:
        tb = traceback.format_exc().strip().splitlines()
        out = {"ok": False, "stage": "error", "reason": f"{type(exc).__name__}: "
               f"{(str(exc).strip().splitlines() or [''])[-1][:300]}", "traceback": tb[-8:]}
    print(json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
