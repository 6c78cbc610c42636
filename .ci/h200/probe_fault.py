"""Name the kernel behind an illegal memory access in `onboard train`'s export probe.

`onboard train hf:qwen3_next --proxy small --seq 16384 ... --steps 4` on an H100 trained its steps,
then faulted in the export's probe (`peft_export.probe_logits`: eval, no_grad, the first 16 tokens):
"an illegal memory access", surfacing at a later launch (the fault is sticky). This script runs the
same thing with a `torch.cuda.synchronize()` around every module's forward (pre- and post-hooks on
every module) and around every Triton launch (``JITFunction.run`` / the interpreter's
``InterpretedFunction.run``, patched at class level: every family's rendered kernels), printing each
module path / kernel name before (``>``) and ``ok`` after, so that the last lines before the error
name the culprit.

The run is `onboard train`'s own worker in this process (`onboarding.train.worker.run`, role
``reference``, one process): the config from `onboard train`'s options (`onboarding.cli.train`:
the same MODEL and flags, written to train.toml and read back as the worker reads it), the model
built, the expert-parallel experts, LoRA and, on CUDA, the kernels patched in by `worker.prepare`
exactly as a GPU run does; ``--steps`` training steps (default 1 at ``--seq`` 256; 0: none). Only
the export is replaced: where `worker.run` calls `peft_export.export_run`, this runs its first step
(`probe_logits` on the first ``--tokens`` tokens of the first data row, as `export_run` does) under
the synchronizing trace, and writes nothing else. ``--trace-steps`` traces the training steps too.
On the CPU (``--device cpu``: Triton's interpreter, TRITON_INTERPRET=1 set here) the kernels are
patched in as on CUDA by tests/fixtures/step_host_cost.py's `gpu_like` (the worker patches them on
CUDA only).

Findings go to ``--out`` (JSON; here ``--out`` is that file, the run directory is ``--run-dir``):
``ok``, ``phase`` (setup / train / probe / done), ``culprit`` (a sentence), ``failing`` (the event in
progress: kind module / triton / sync, its name, the stage that raised: ``sync before`` = work
enqueued since ``last_completed``, ``launch`` = this launch itself (compile, load, launch),
``sync after`` = this kernel / this module's own work since ``last_completed``; a Triton event
carries its module, the enclosing module path, grid and argument shapes), ``last_completed``,
``error``, ``traceback``, ``sequence`` (every completed probe event in order) and ``launches``
(Triton launches per kernel in the probe). Exit 0 when the probe ran clean, 1 when it raised.

Usage (repository root; every `onboard train` option is taken; the defaults here: MODEL
hf:qwen3_next, --proxy small, --dtype bf16, --micro-batch 1, --nproc 1 (the only one), --steps 1,
--seq 256):

    python3 .ci/h200/probe_fault.py hf:qwen3_next --proxy small --seq 16384 --steps 4 \
        --device cuda --out $OUT/probe_fault.json [--blocking] [--tokens 16] [--trace-steps]
    python3 .ci/h200/probe_fault.py --proxy tiny --device cpu --seq 64 --out /tmp/pf.json   (CPU)

``--blocking`` sets CUDA_LAUNCH_BLOCKING=1 before torch starts CUDA (each launch then reports its
own fault). ``--no-sync`` prints the same trace without synchronizing (does the fault reproduce in
this script as in `onboard train`; a synchronize between launches can hide a race). ``--quiet``
prints the Triton launches only. On the device, `source .ci/h200/setup.sh` first (carry .whl):

    source .ci/h200/setup.sh > /dev/null && python3 .ci/h200/probe_fault.py hf:qwen3_next \
        --proxy small --seq 16384 --micro-batch 1 --nproc 1 --dtype bf16 --device cuda \
        --recompute none --steps 4 --out $OUT/pf.json > $OUT/pf.log 2>&1; tail -40 $OUT/pf.log
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = "hf:qwen3_next"


def parser() -> argparse.ArgumentParser:
    from onboarding.cli.train import _train_options

    p = argparse.ArgumentParser(prog="probe_fault.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _train_options(p, layout=True)
    for action in p._actions:
        if action.dest == "out":
            action.help = "the findings (JSON) go here (default probe_fault.json)"
        if action.dest == "model":
            action.help = f"{action.help.split(';')[0]}; default {DEFAULT_MODEL}"
    p.add_argument("--run-dir", default=None, help="the run directory (default a fresh temp dir)")
    p.add_argument("--tokens", type=int, default=None,
                   help="the probe's length (default the export's PROBE_TOKENS, 16)")
    p.add_argument("--blocking", action="store_true",
                   help="CUDA_LAUNCH_BLOCKING=1 (set before torch initialises CUDA)")
    p.add_argument("--trace-steps", action="store_true",
                   help="trace (synchronize and print around) the training steps too")
    p.add_argument("--no-sync", action="store_true",
                   help="trace without synchronizing (does the fault reproduce here)")
    p.add_argument("--quiet", action="store_true",
                   help="print only the Triton launches and the failure (the JSON has it all)")
    p.set_defaults(model=DEFAULT_MODEL, steps=1, seq=256, proxy="small", dtype="bf16",
                   micro_batch=1, nproc=1, out="probe_fault.json")
    return p


def _describe(x, depth: int = 0):
    import torch

    if isinstance(x, torch.Tensor):
        return {"shape": list(x.shape), "stride": list(x.stride()), "dtype": str(x.dtype),
                "device": str(x.device), "offset": x.storage_offset(),
                "storage_bytes": x.untyped_storage().nbytes(), "contiguous": x.is_contiguous()}
    if isinstance(x, (bool, int, float, str)) or x is None:
        return x
    if isinstance(x, (tuple, list)) and depth < 2:
        return [_describe(v, depth + 1) for v in x]
    return type(x).__name__


class Tracer:
    """Synchronize and print around module forwards and Triton launches while ``active``."""

    def __init__(self, cuda: bool, quiet: bool) -> None:
        self.cuda, self.quiet = cuda, quiet  # cuda False: no synchronize (the CPU, --no-sync)
        self.active = False
        self.phase = "setup"
        self.stack: list[str] = []  # the module paths whose forward is running
        self.current: dict | None = None  # the event in progress, with the stage that runs
        self.last_ok: dict | None = None
        self.sequence: list[str] = []
        self.launches: collections.Counter = collections.Counter()
        self.record = False  # sequence / launches: the probe's only

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def check(self, event: dict, stage: str) -> None:
        self.current = {**event, "stage": stage}
        self.sync()
        self.current = None

    def done(self, event: dict, label: str) -> None:
        self.last_ok = event
        if self.record:
            self.sequence.append(label)

    def say(self, text: str, always: bool = False) -> None:
        if always or not self.quiet:
            print(text, flush=True)

    # ---- modules
    def hook(self, model) -> None:
        for path, mod in model.named_modules():
            path = path or "<model>"
            mod.register_forward_pre_hook(lambda m, a, p=path: self._enter(m, p))
            mod.register_forward_hook(lambda m, a, o, p=path: self._exit(m, p))

    def _event(self, mod, path: str) -> dict:
        return {"kind": "module", "name": path, "class": type(mod).__name__, "phase": self.phase}

    def _enter(self, mod, path: str) -> None:
        if not self.active:
            return
        self.say(f"{'  ' * len(self.stack)}> {path} ({type(mod).__name__})")
        self.check(self._event(mod, path), "sync before")
        self.stack.append(path)

    def _exit(self, mod, path: str) -> None:
        if not self.active:
            return
        ev = self._event(mod, path)
        self.check(ev, "sync after")
        if self.stack and self.stack[-1] == path:
            self.stack.pop()
        self.say(f"{'  ' * len(self.stack)}ok {path}")
        self.done(ev, f"module {path}")

    # ---- Triton launches
    def patch_triton(self, setattr_) -> None:
        """Every Triton launch (class level: every family's rendered kernels) goes through
        `_launch` while active; ``setattr_`` records the patch for undoing."""
        classes = []
        try:
            from triton.runtime.jit import JITFunction

            classes.append(JITFunction)
        except ImportError:  # pragma: no cover
            pass
        try:
            from triton.runtime.interpreter import InterpretedFunction

            classes.append(InterpretedFunction)
        except ImportError:  # pragma: no cover
            pass
        for cls in classes:
            orig = cls.__dict__.get("run")
            if orig is None:
                continue

            def run(fn_self, *args, _orig=orig, **kwargs):
                if not self.active or kwargs.get("warmup", False):
                    return _orig(fn_self, *args, **kwargs)
                return self._launch(fn_self, args, kwargs, lambda: _orig(fn_self, *args, **kwargs))
            setattr_(cls, "run", run)

    def _launch(self, fn_self, args, kwargs, call):
        fn = getattr(fn_self, "fn", None)
        name = getattr(fn, "__name__", None) or "?"
        grid = kwargs.get("grid")
        ev = {"kind": "triton", "name": name, "module": getattr(fn, "__module__", None),
              "in": self.stack[-1] if self.stack else None, "phase": self.phase,
              "grid": repr(grid) if callable(grid) else _describe(grid),
              "args": [_describe(a) for a in args],
              "kwargs": {k: _describe(v) for k, v in kwargs.items() if k not in ("grid", "warmup")}}
        where = f" [{ev['in']}]" if ev["in"] else ""
        self.say(f"{'  ' * len(self.stack)}> triton {name} ({ev['module']}){where}", always=True)
        self.check(ev, "sync before")
        self.current = {**ev, "stage": "launch"}
        out = call()
        self.check(ev, "sync after")
        self.say(f"{'  ' * len(self.stack)}ok triton {name}", always=True)
        if self.record:
            self.launches[name] += 1
        self.done(ev, f"triton {name}")
        return out


def culprit(failing: dict | None, last_ok: dict | None, stack: list[str]) -> str:
    """A sentence naming where the error came from (see the module docstring's stages)."""
    since = f"{last_ok['kind']} {last_ok['name']}" if last_ok else "the start of the trace"
    if failing is None:
        inside = f"inside module {stack[-1]}" if stack else "outside any traced module"
        return f"raised {inside}, not at a synchronize (after {since})"
    what = f"{failing['kind']} {failing['name']}"
    stage = failing["stage"]
    if failing["kind"] == "triton":
        inside = f" in {failing['in']}" if failing.get("in") else ""
        if stage == "sync after":
            return f"the Triton kernel {failing['name']} ({failing.get('module')}){inside}"
        if stage == "launch":
            return (f"the launch of the Triton kernel {failing['name']}{inside} itself (compile, "
                    "load or launch; the synchronize before it was clean)")
    if failing["kind"] == "sync":
        return f"work enqueued after {since}, found at the synchronize after {failing['name']}"
    if failing["kind"] == "module" and stage == "sync after":
        return f"work of module {failing['name']} ({failing['class']}) after {since}"
    return f"work enqueued between {since} and {what} ({stage})"


def early_env(argv: list[str]) -> None:
    """What torch and triton read once, set before either is imported (the script imports them
    in `main` only): CUDA_LAUNCH_BLOCKING for ``--blocking``, TRITON_INTERPRET for the CPU."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--blocking", action="store_true")
    pre.add_argument("--device", default=None)
    early, _ = pre.parse_known_args(argv)
    if early.blocking:
        os.environ["CUDA_LAUNCH_BLOCKING"] = "1"
    if early.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")


def main(argv: list[str] | None = None) -> int:
    """Run (see the module docstring); returns 0 when the probe ran clean, else 1. Every patch
    it makes is undone on return (tests call it in their own process)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    early_env(argv)
    args = parser().parse_args(argv)
    if args.nproc != 1:
        raise SystemExit("probe_fault.py runs one process (--nproc 1): the export's probe is the "
                         "single-process reference's")
    import torch

    undo: list[tuple[object, str, object]] = []

    def setattr_(obj, name, value):
        undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)
    try:
        return _run(args, argv, setattr_, torch)
    finally:
        for obj, name, value in reversed(undo):
            setattr(obj, name, value)


def _run(args, argv, setattr_, torch) -> int:
    from onboarding.cli.train import config_from_args
    from onboarding.optional_kernels import hide
    from onboarding.train import peft_export, worker
    from onboarding.train.config import TrainConfig
    from onboarding.train.kernels import summary
    from onboarding.train.launch import write_config
    from onboarding.train.setup import resolve_device

    result: dict = {"argv": argv, "model": args.model, "synchronize": not args.no_sync,
                    "blocking": os.environ.get("CUDA_LAUNCH_BLOCKING") == "1",
                    "cuda_initialized_at_start": torch.cuda.is_initialized(),
                    "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
                    "torch": torch.__version__}
    steps = args.steps
    if steps == 0:
        args.steps = 1  # a valid config; the run below trains none
    cfg = config_from_args(args)
    cfg.out = str(Path(args.run_dir or tempfile.mkdtemp(prefix="probe_fault_")).resolve())
    cfg.export = True
    cfg = TrainConfig.from_toml(write_config(cfg))  # what the worker reads, as `onboard train`
    if steps == 0:  # valid with steps 1, run with none
        validate = cfg.validate
        cfg.steps = 0

        def validate_steps_0(**kw):
            cfg.steps = 1
            try:
                validate(**kw)
            finally:
                cfg.steps = 0
        cfg.validate = validate_steps_0
    hide()  # as the worker's main: the model's torch path plus onboard's kernels
    device = resolve_device(cfg)
    tracer = Tracer(cuda=device.type == "cuda" and not args.no_sync, quiet=args.quiet)
    tracer.patch_triton(setattr_)
    result.update(device=str(device), run_dir=cfg.out,
                  gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                  config={k: getattr(cfg, k) for k in ("proxy", "seq_len", "micro_batch", "dtype",
                                                       "kernels", "recompute", "compile")},
                  steps=steps)
    if device.type != "cuda" and cfg.kernels:  # the worker patches kernels on CUDA only
        sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
        from step_host_cost import gpu_like

        gpu_like(True, setattr_)
        result["cpu_kernels"] = "tests/fixtures/step_host_cost.py gpu_like"
    prepare = worker.prepare
    held = {}

    def traced_prepare(cfg, role, built, layout, device):
        ep_mods, patches, attached = prepare(cfg, role, built, layout, device)
        held.update(patches=patches, attached=attached)
        tracer.hook(built.model)
        tracer.phase = "train"
        tracer.active = args.trace_steps
        return ep_mods, patches, attached
    setattr_(worker, "prepare", traced_prepare)
    if args.tokens is not None:
        setattr_(peft_export, "PROBE_TOKENS", args.tokens)  # worker.run reads it at the export

    def probe_export(model, graph, cfg, ep_mods, ids, train_dir):
        """`export_run`'s first step, traced: `probe_logits` on the ids `worker.run` gives it."""
        tracer.active = False
        tracer.phase = "probe"
        patches = held.get("patches")
        if patches is not None:  # after the steps: the patches calibrated on the first call
            result["kernels"] = {**summary(patches), **held["attached"]}
            result["kernels_not_active"] = {r.path: f"{r.status}: {r.detail}"
                                            for r in patches.records if r.status != "active"}
        tracer.say(f"probe: ids {tuple(ids.shape)} on {ids.device}", always=True)
        result["tokens"] = int(ids.shape[-1])
        tracer.check({"kind": "sync", "name": "the training steps"}, "sync after")
        tracer.active = tracer.record = True
        t0 = time.perf_counter()
        logits = peft_export.probe_logits(model, ids)
        tracer.active = False
        tracer.check({"kind": "sync", "name": "the probe"}, "sync after")
        result["probe"] = {"logits": list(logits.shape),
                           "finite": bool(torch.isfinite(logits).all()),
                           "seconds": round(time.perf_counter() - t0, 3)}
        tracer.phase = "done"
        return Path(train_dir) / "adapter"
    setattr_(peft_export, "export_run", probe_export)

    ok, t0 = True, time.perf_counter()
    try:
        worker.run(cfg, "reference")
        if tracer.phase != "done":
            raise RuntimeError("the run ended without the export's probe")
    except Exception as exc:  # noqa: BLE001 - a CUDA fault is a RuntimeError; report any
        ok = False
        failing = tracer.current
        result.update(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc(),
                      failing=failing, culprit=culprit(failing, tracer.last_ok, tracer.stack))
        print(traceback.format_exc(), file=sys.stderr, flush=True)
        print(f"FAULT in phase {tracer.phase}: {result['culprit']}", flush=True)
        print(f"  failing: {json.dumps(failing, default=str)}", flush=True)
        print(f"  last completed: {json.dumps(tracer.last_ok, default=str)}", flush=True)
    finally:
        tracer.active = False
    result.update(ok=ok, phase=tracer.phase, last_completed=tracer.last_ok,
                  open_modules=list(tracer.stack), sequence=tracer.sequence,
                  launches=dict(tracer.launches), seconds=round(time.perf_counter() - t0, 1))
    out_json = Path(args.out)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"{'OK' if ok else 'FAULT'} ({result['culprit'] if not ok else 'probe clean'}): "
          f"{len(tracer.sequence)} probe events, {sum(tracer.launches.values())} Triton launches; "
          f"{out_json}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # no interpreter teardown after a CUDA fault (a faulted context can hang it)
