"""Host cost of the pieces of one kernel call, on this machine's CPU (the device's host): what a
fwd+bwd step of a host-bound family spends its host time on (`host_step.py --cprofile` shows where,
with the profiler's own cost inflating every Python call; this times each piece bare).

Rows, microseconds per call (median of `--rounds`, each `--n` calls back to back, no synchronize):
- triton launch, JIT path: `kernel[grid](...)` of a kernel with `--args` tensor / int arguments
  (as our families' kernels take), doing nothing (the GPU drains it faster than the host enqueues);
- triton launch, compiled path: the same compiled kernel through `CompiledKernel[grid](...)`
  (no binding, specialisation or cache lookup);
- torch.empty on the device (the caching allocator's hit path);
- a torch.library custom op with register_autograd around a no-op, called with grad (the
  dispatcher, autograd wrapper, aliasing check) against a plain autograd.Function doing the same.

    python3 .ci/h200/launch_cost.py --n 2000 --rounds 5
    TRITON_INTERPRET=1 python3 .ci/h200/launch_cost.py --cpu --n 20 --rounds 1   (the script's own check)
"""

import argparse
import os
import statistics
import time


def per_call_us(fn, n: int, rounds: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        times.append(1e6 * (time.perf_counter() - t) / n)
        sync()
    return statistics.median(times)


def main(argv=None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--args", type=int, default=12, help="tensor arguments (as many int arguments besides)")
    ap.add_argument("--cpu", action="store_true")
    a = ap.parse_args(argv)

    global torch
    import torch
    import triton

    dev = "cpu" if a.cpu else "cuda"
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    names = [f"p{i}" for i in range(a.args)] + [f"n{i}" for i in range(a.args)]
    src = (f"def nop({', '.join(names)}, BLOCK: tl.constexpr):\n"
           "    i = tl.program_id(0)\n"
           "    if i < 0:\n"
           "        tl.store(p0 + tl.arange(0, BLOCK), tl.zeros([BLOCK], tl.float32) + n0)\n")
    import tempfile
    path = os.path.join(tempfile.mkdtemp(prefix="launch-cost-"), f"nop_{a.args}.py")
    with open(path, "w") as f:
        f.write("import triton\nimport triton.language as tl\n\n@triton.jit\n" + src)
    import importlib.util
    spec = importlib.util.spec_from_file_location("launch_cost_k", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    nop = mod.nop
    ts = [torch.empty(4096, device=dev) for _ in range(a.args)]
    ints = [4096 + 16 * i for i in range(a.args)]
    rows = {}
    rows["triton launch, JIT path"] = per_call_us(lambda: nop[(1,)](*ts, *ints, BLOCK=16), a.n, a.rounds, sync)
    compiled = nop[(1,)](*ts, *ints, BLOCK=16)
    if compiled is not None and hasattr(compiled, "__getitem__") and not a.cpu:
        runner = compiled[(1, 1, 1)]
        rows["triton launch, compiled path"] = per_call_us(lambda: runner(*ts, *ints, 16), a.n, a.rounds, sync)
    rows["torch.empty (1 MiB)"] = per_call_us(lambda: torch.empty(1 << 18, device=dev), a.n, a.rounds, sync)

    @torch.library.custom_op("launch_cost::noop", mutates_args=())
    def noop(x: torch.Tensor, y: torch.Tensor, s: float = 1.0) -> torch.Tensor:
        return torch.empty_like(x)

    @noop.register_fake
    def _(x, y, s=1.0):
        return torch.empty_like(x)

    def setup(ctx, inputs, output):
        pass

    def backward(ctx, g):
        return g, None, None

    noop.register_autograd(backward, setup_context=setup)

    class Plain(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y, s=1.0):
            return torch.empty_like(x)

        @staticmethod
        def backward(ctx, g):
            return g, None, None

    x = torch.empty(1024, device=dev, requires_grad=True)
    y = torch.empty(1024, device=dev)
    rows["custom op with autograd (no-op body)"] = per_call_us(lambda: noop(x, y, 2.0), a.n, a.rounds, sync)
    rows["autograd.Function (no-op body)"] = per_call_us(lambda: Plain.apply(x, y, 2.0), a.n, a.rounds, sync)
    rows["plain empty_like (the body alone)"] = per_call_us(lambda: torch.empty_like(x), a.n, a.rounds, sync)
    print(f"torch {torch.__version__} triton {triton.__version__} on {dev}; {a.args} tensor + {a.args} int args")
    for k, v in rows.items():
        print(f"{k:45s} {v:8.2f} us")
    return rows


if __name__ == "__main__":
    main()
