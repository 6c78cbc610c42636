"""Device check (issue 34): the bf16 GPU bars' slow-decay K=64 case (tests/kernel_tests'
test_bf16_vs_fp32_on_gpu[k64-slow]) for gated_delta and kimi_delta under candidate configs of the
K <= 64 bucket, each in its own process with CUDA_LAUNCH_BLOCKING=1 (a fault poisons the CUDA
context and names its kernel only when launches block). Prints one line per (family, config).
    python3 .ci/h200/gdn_k64bars.py [family ...]
"""
import json, os, subprocess, sys, time

CHILD = """
import json, sys
sys.path[:0] = ["tests/kernel_tests", "tests"]
from test_gated_delta import GPU_CASES, check_bf16_vs_fp32_gpu, load
from onboarding.families import family_module
fam, cfg, which = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
spec = family_module(fam).FAMILY
load(spec, {"chunk_size": 64}).set_config({"dot_precision": "ieee", **cfg})
case, slow = GPU_CASES[which].values
check_bf16_vs_fp32_gpu(spec, fam == "kimi_delta", case, slow)
print("PASS")
"""
CFGS = json.loads(os.environ["CFGS"]) if "CFGS" in os.environ else [
    {}, {"num_warps": 8}, {"prep_bk": 64}, {"BK": 64, "BV": 32}, {"prep_stages": 2}, {"num_warps": 8, "state_bwd_stages": 1}]
fams = sys.argv[1:] or ["gated_delta", "kimi_delta"]
env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1"}
t0, budget = time.time(), float(os.environ.get("BUDGET", 330))
for fam in fams:
    for cfg in CFGS if fam == fams[0] else CFGS[:2]:  # the later families: the default and 8 warps
        if time.time() - t0 > budget:
            print("budget spent", flush=True)
            sys.exit(0)
        for which in (1,) if cfg and len(CFGS) > 1 else (1, 0):
            try:
                r = subprocess.run([sys.executable, "-c", CHILD, fam, json.dumps(cfg), str(which)], capture_output=True,
                                   text=True, timeout=int(os.environ.get("CHILD_TIMEOUT", 60)), env=env)
                out = (r.stdout + r.stderr).strip().splitlines()
                lines = [ln for ln in out if "PASS" in ln or "over the bar" in ln or "Error" in ln or "Skipped" in ln or "_kernel" in ln]
                res = "PASS" if r.returncode == 0 else " | ".join(lines[-4:])[:600]
            except subprocess.TimeoutExpired:
                res = "timeout"
            print(f"{fam} {['k128-mixed', 'k64-slow'][which]} {cfg}: {res}", flush=True)
