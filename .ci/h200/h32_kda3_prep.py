"""Issue 32: GPU ms of KDA's prepare step alone (the module's `_prepare`: the forward's first
kernel, 74% of its GPU time at template v24) under prepare configs, at the Kimi-Linear layout
(B1 H32, K = V = 128, bf16, in-kernel l2norm, the bench's inputs) and T 8192 and 32768: CUDA-graph
replay medians (the bench's `graph_time`), and each config's outputs against the default's
(relative RMS of w, u, kd, qg, Aqk, gl; the bf16 bars test is the accuracy gate, this only
catches a broken build). The configs compile first, in parallel child processes (one each, at
T 256: the same specialisation as the timed T), which fill Triton's cache for this process.

    python3 .ci/h200/h32_kda3_prep.py [CONFIGS_JSON [OUT_JSON]]

CONFIGS_JSON: a JSON list of config dicts (default: `DEFAULT_CONFIGS`). On a CPU
(TRITON_INTERPRET=1) it runs every config once at T 70, H 1, K = V = 16, as a smoke test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

from onboarding.bench.cases import kernel
from onboarding.bench.cases_linear_attention import CHUNK, make_inputs

# {}: the default, "pipelined" from template v26 (the twenty-eighth session's rows in family.py ran
# before it, when {} was "fused")
DEFAULT_CONFIGS = [{}, {"kda_prep": "fused"}, {"prep_stages": 3}, {"kda_prep_maxnreg": 168}]
NAMES = ("w", "u", "kd", "qg", "Aqk", "gl")


def _setup(T: int, cfg: dict, dev: torch.device):
    """(module, prepare step on the bench's inputs at T) with `cfg` pinned on the module."""
    cfg = dict(cfg)
    # "_module": the path of an edited copy of the rendered module instead (ablations: the
    # twenty-eighth session timed the fused kernel with parts cut out this way, family.py)
    path = cfg.pop("_module", None)
    if path:
        from onboarding.generate.templating import load_module
        mod = load_module(path)
    else:
        mod, _ = kernel("kimi_delta", "chunk", {"chunk_size": CHUNK, "qk_l2norm": True})
    H, D = (32, 128) if dev.type == "cuda" else (1, 16)
    q, k, v, g, beta = (x.detach() for x in make_inputs(True, 1, T, H, H, D, dev, seed=0))
    bucket = mod.shape_bucket(D)
    mod.set_config(None, bucket=bucket)  # the bucket's own config under this one only
    mod.set_config({**mod.config_for(D), **cfg}, bucket=bucket)
    scale = D ** -0.5
    return mod, lambda i=0: mod._prepare(q, k, v, g, beta, scale, True)[:6]


def _compile(cfg: dict) -> None:
    """Child process: one prepare call under `cfg` (its kernels compile into Triton's cache)."""
    dev = torch.device("cuda")
    _, step = _setup(256, cfg, dev)
    with torch.no_grad():
        step()
    torch.cuda.synchronize()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main() -> None:
    configs = json.loads(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1] else DEFAULT_CONFIGS
    out = sys.argv[2] if len(sys.argv) > 2 else None
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    if cuda:  # compile every config at once, one child each (errors show again when timed)
        def child(cfg):
            run = subprocess.run([sys.executable, __file__, "--compile", json.dumps(cfg)],
                                 capture_output=True, text=True, env=os.environ)
            return cfg, run.returncode, run.stderr[-400:]
        with ThreadPoolExecutor(max_workers=min(8, len(configs))) as pool:
            for cfg, rc, err in pool.map(child, configs):
                print(f"compiled {cfg}: rc {rc}" + (f" {err}" if rc else ""), flush=True)
    from onboarding.bench.harness import graph_time

    rows = []
    for T in ((8192, 32768) if cuda else (70,)):
        ref = None
        for cfg in configs:
            row = {"T": T, "config": cfg}
            try:
                mod, step = _setup(T, cfg, dev)
                with torch.no_grad():
                    outs = step()
                    if ref is None:
                        ref = [o.clone() for o in outs]
                    row["rel_vs_first"] = {n: float(f"{_rel(a, b):.3g}") for n, a, b in zip(NAMES, outs, ref)}
                    if cuda:
                        t = graph_time(step)
                        row["graph_ms"] = round(t.median_ms, 4)
                del mod, step, outs
            except Exception as exc:  # noqa: BLE001 - report and go on
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
            print(json.dumps(row), flush=True)
        ref = None
        if cuda:
            torch.cuda.empty_cache()
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--compile":
        _compile(json.loads(sys.argv[2]))
    else:
        main()
