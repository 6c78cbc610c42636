"""sm_90 wgmma-descriptor audit of every kernel family's AOT builds (the ptxas 12.8 miscompile, kimi_delta v51-v53).

What it checks: ptxas 12.8 (the one triton 3.6 ships, the GPU image's) built some sm_90 wgmma (SASS `HGMMA`)
instructions with a B operand's shared-memory descriptor for later K steps taken from an unrelated uniform
register (kimi_delta v51's qkt hot launch: the shared base register, stride 16896 B; compute-sanitizer's
"Out-of-range shared" on an H100). The PTX is right and triton 3.9's ptxas (CUDA 13.4 in the CPU venv) builds
it right, so only the SASS of a triton 3.6 build shows it. For each family with `aot_specs` and dots (JOBS: the
default config of a bench-like render at the size the family's sm_90 AOT tests use, bf16; `--sweep` adds
kimi_delta's bench sweep rows), this builds every spec for sm_90 as the GPU's JIT specialises it
(`aot.divisibility_attrs` "all", the spec's warps, stages and register cap) with THIS process's triton, and
runs tests/kernel_tests/sass_hgmma.py's `check_cubin` (its `check_sass`, corrected as below) on each build: every HGMMA's A / B descriptor decoded
from the SASS, flagged when its start lies outside the kernel's shared allocation or its high word (stride,
swizzle) is none the PTX builds. Descriptors the straight-line evaluation cannot follow are counted as "not
decoded" (loop-carried ones of pipelined K loops, ones computed in vector registers: there the check says
nothing; each line gives how many starts and high words were decoded). Corrections to check_sass's reading
(in sass_hgmma since; each removed false flags on clean builds, ptxas 12.8 and 13.4 alike): an HGMMA with A in registers (RS form)
has no A descriptor, so its A slot is not checked; a `UIADD3.64` with a register pair as second source is
split into its two 32-bit adds (`wide_adds_split`); descriptors moved through vector registers by MOV / R2UR
are followed (`vector_moves`). None hides v51's miscompile: on kimi_delta v51 (git 5c76f00) `--only kimi_delta
--kernel qkt --config '[{"kda_qk": "ksplit", "kda_qkt_cold": "split"}]'` flags the hot launch (SPLIT 1) at
0x64b0 / 0x6500 / 0x6730 (B high word 0x80000420, stride 16896 B; 0x64b0 is the compute-sanitizer address),
the dot `_dot(tl.trans(b_dQ), b_qe * b_c)` by the PTX's call sites. A flagged build is a likely silent wrong
result or fault on the H100/H200: its HGMMA's SASS offset, the cubin's line (nvdisasm -g: mostly the `_dot`
helper's) and the same-rank PTX wgmma's `.loc` with its inlined-at call sites are printed. Families whose
templates have no dot (conv1d, cross_entropy, layernorm, moe_router, pair_sum, rmsnorm, rope, selective_scan,
swiglu) are not built: no wgmma.
Forty-first session (triton 3.6.0, ptxas 12.8): every default build clean (137 builds, 105 with wgmma); under
`--sweep`, kda_chunk_bwd_ktile_kernel at 8 warps (bench KTILES_SWEEP rows `kda_qk` "ktiles", `bwd_bv` 32, BK 16
and 32) flagged at the dot `_dot(tl.trans(b_Tm), b_dw, TM_PREC)` (triton 3.9 builds of the same specs clean).

Run (no GPU needed: a cross-compile; 2 min 11 s for the defaults on two shared CPU cores, warm Triton cache):
  PYTHONPATH=/work/main /tmp/t36/bin/python .ci/h200/sass_audit.py               # every job, default configs
  ... sass_audit.py --sweep                  # + kimi_delta's bench sweep rows (only specs the default lacks)
  ... sass_audit.py --only ssd,kimi_delta    # some families
  ... sass_audit.py --json out.jsonl         # also one JSON record per build
  ... sass_audit.py --only kimi_delta --kernel qkt --config '[{"kda_qkt_cold": "split"}]'   # one kernel, a config
The venv must have triton 3.6 (torch CPU is enough; /tmp/t36 in the forty-first session) and the project on
PYTHONPATH (this file puts its own checkout first); TRITON_INTERPRET is dropped. On the device (the GPU image's
triton 3.6) the same command builds with the image's ptxas; to check what a run's JIT actually built instead,
give it that run's Triton cache (no build; the same corrections):
  TRITON_CACHE_DIR=$(mktemp -d) python ...          # the run
  python .ci/h200/sass_audit.py --cache $TRITON_CACHE_DIR

Output: a header (triton version, ptxas path and version), then one line per build:
  FAMILY VARIANT PARAMS size SIZE CONFIG KERNEL [SPLIT=..] w WARPS s STAGES [maxnreg R]: N HGMMA (k with A in
  registers), F flagged, U operands not decoded (of D descriptors; starts decoded S, high words H), shared B,
  regs R, spills P B (ptxas's spill bytes, the larger of stores and loads) (seconds)
then, for a flagged build, each flagged descriptor `FLAG 0xOFFS A|B: why  [source FILE:LINE; PTX (by order)
...]`; then a per-family / kernel summary table (builds, HGMMA, flagged, not decoded, starts / high words
decoded), the builds not built (compile errors, past --budget), `# FLAGGED:` lines, and a count line. Exit
status 1 when a build is flagged, 2 when one failed to compile, else 0. `--cache`: one line per cubin, `# N
flagged`, exit 1 when N > 0.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "kernel_tests"))
sys.path.insert(0, str(ROOT))
os.environ.pop("TRITON_INTERPRET", None)

import sass_hgmma  # noqa: E402

DELTA = {"chunk_size": 64, "qk_l2norm": True}  # the GPU chunk, as the delta families' aot tests and bench
# (family, variant, params, sizes): the render and the head dim / feature size of the family's sm_90 AOT tests
# (the template's aot_specs default where the tests use it), the default config
JOBS = [
    ("gated_delta", "chunk", DELTA, (128,)),
    ("kimi_delta", "chunk", DELTA, (128,)),
    ("grouped_linear", "sorted", {}, (2048,)),
    ("lora", "linear", {"base": "triton"}, (4096,)),
    ("lora", "linear", {"base": "torch"}, (4096,)),
    ("moe_experts", "swiglu", {}, (2048,)),
    ("moe_experts", "swiglu_lora", {}, (2048,)),
    ("moe_experts", "mlp", {}, (2048,)),
    ("sink_attention", "attention", {}, (64, 128)),
    ("sparse_attention", "indexer", {}, (128,)),
    ("sparse_attention", "gathered", {}, (128,)),
    ("sparse_attention", "gathered", {"layout": "mla", "d_v": 512}, (576,)),
    ("ssd", "scan", {"chunk_size": 256}, (64,)),  # bench.MODEL_CHUNK, head dim 64
]


def sweep_configs(family: str) -> list[dict]:
    """The bench's sweep rows' configs (kimi_delta: FWD_SWEEP + BWD_SWEEP)."""
    if family != "kimi_delta":
        return []
    from onboarding.families import family_module

    bench = family_module("kimi_delta").bench
    return [dict(c) for c in (*bench.FWD_SWEEP, *bench.BWD_SWEEP)]


def source_lines(cubin: bytes, offsets: list[int]) -> dict[int, str]:
    """The source line (file:line) of each SASS offset, from the cubin's line info (`nvdisasm -g`)."""
    from triton import knobs

    nvdisasm = str(Path(knobs.nvidia.cuobjdump.path).with_name("nvdisasm"))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        run = subprocess.run([nvdisasm, "-g", "-c", f.name], capture_output=True, text=True, check=False)
    out, where = {}, "?"
    for line in run.stdout.splitlines():
        m = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if m:
            where = f"{Path(m.group(1)).name}:{m.group(2)}"
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/", line)
        if m and int(m.group(1), 16) in offsets:
            out[int(m.group(1), 16)] = where
    return out


def build_and_check(module, fn, spec: dict) -> dict:
    """One spec built for sm_90 as the GPU's JIT specialises it (`sass_hgmma.build_spec`) and checked
    (`sass_hgmma.check_cubin`, the corrected reading); a flagged build's offsets mapped to source lines
    (the cubin's line info) and to the PTX's call sites."""
    k, regs, spills = sass_hgmma.build_spec(fn, spec)
    rec = sass_hgmma.check_cubin(k.asm["cubin"], int(k.metadata.shared), k.asm["ptx"])
    rec["regs"], rec["spills"] = regs, spills
    if rec["flags"]:
        rec["lines"] = describe(k.asm["cubin"], k.asm["ptx"], rec["flags"])
    return rec


def describe(cubin: bytes, ptx: str | None, flags: list[str]) -> dict[str, str]:
    """Each flagged descriptor's SASS offset -> its source line, and the PTX call site by order."""
    offs = [int(f.split()[0], 16) for f in flags]
    lines = source_lines(cubin, offs)
    calls = ptx_call_sites(sass_hgmma.cubin_sass(cubin), ptx) if ptx else {}
    return {hex(o): lines.get(o, "?") + (f"; PTX (by order) {calls[o]}" if o in calls else "") for o in offs}


def ptx_call_sites(sass: str, ptx: str) -> dict[int, str]:
    """SASS offset of each HGMMA -> the `.loc` comment (with its inlined-at call sites) of the PTX wgmma.mma_async
    of the same rank, when the SASS and the PTX have as many (ptxas kept their order in the builds checked; a
    guess otherwise, so nothing is given when the counts differ)."""
    hg = [int(m.group(1), 16) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?HGMMA", sass)]
    locs, where = [], "?"
    for line in ptx.splitlines():
        m = re.match(r"\s*\.loc\s+\d+\s+\d+\s+\d+\s*//\s*(.*)", line)
        if m:
            where = m.group(1).strip()
        elif "wgmma.mma_async" in line:
            locs.append(where)
    return dict(zip(hg, locs)) if len(hg) == len(locs) else {}


def spec_key(spec: dict) -> str:
    return json.dumps({k: spec.get(k) for k in ("kernel", "signature", "constexprs", "num_warps", "num_stages",
                                                "maxnreg")}, sort_keys=True, default=str)


def run_job(family, variant, params, size, configs, out_dir, emit, deadline, kernel="") -> None:
    from onboarding.generate import aot, templating

    source = templating.render(family, variant, params)
    name = "_".join([variant] + [f"{k}_{v}" for k, v in sorted(params.items())]).replace(".", "p")
    path = templating.write_module(source, Path(out_dir) / family / f"{name}.py", overwrite=True)
    module = templating.load_module(path)
    kernels = aot.jit_kernels(module)
    seen = set()
    for config in configs:
        module.set_config(config or None)
        try:
            specs = module.aot_specs("bf16", size)
        finally:
            module.set_config(None)
        for spec in specs:
            key = spec_key(spec)
            if kernel not in spec["kernel"] or key in seen:  # a sweep row's spec the default (or an earlier row) built already
                continue
            seen.add(key)
            c = spec.get("constexprs", {})
            head = {"family": family, "variant": variant, "params": params, "size": size, "config": config,
                    "kernel": spec["kernel"], "SPLIT": c.get("SPLIT"), "num_warps": spec.get("num_warps", 4),
                    "num_stages": spec.get("num_stages", 3), "maxnreg": spec.get("maxnreg")}
            if time.time() > deadline:
                emit({**head, "skipped": "over --budget"})
                continue
            t0 = time.time()
            module.set_config(config or None)  # the kernels read module globals only at launch; set as built
            try:
                rec = build_and_check(module, kernels[spec["kernel"]], spec)
            except Exception as e:  # report, go on
                rec = {"error": f"{type(e).__name__}: {e}"[:500]}
            finally:
                module.set_config(None)
            emit({**head, **rec, "seconds": round(time.time() - t0, 1)})


def line_of(r: dict) -> str:
    extra = f" SPLIT={r['SPLIT']}" if r.get("SPLIT") is not None else ""
    cap = f" maxnreg {r['maxnreg']}" if r.get("maxnreg") else ""
    head = (f"{r['family']} {r['variant']} {json.dumps(r['params'], separators=(',', ':'))} size {r['size']} "
            f"{json.dumps(r['config'], separators=(',', ':'))} {r['kernel']}{extra} w {r['num_warps']} "
            f"s {r['num_stages']}{cap}")
    if "skipped" in r:
        return f"{head}: SKIPPED ({r['skipped']})"
    if "error" in r:
        return f"{head}: ERROR {r['error']}"
    s = (f"{head}: {r['hgmma']} HGMMA ({r['rs_form']} with A in registers), {len(r['flags'])} flagged, "
         f"{len(r['unknown'])} operands not decoded (of {2 * r['hgmma'] - r['rs_form']} descriptors; starts "
         f"decoded {r['start_decoded']}, high words {r['high_decoded']}), "
         f"shared {r['shared']}, regs {r['regs']}, spills {r.get('spills') or 0} B ({r['seconds']} s)")
    for f in r["flags"]:
        s += f"\n    FLAG {f}  [source {r['lines'].get(f.split()[0], '?')}]"
    return s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated families (default: every job)")
    ap.add_argument("--sweep", action="store_true", help="also kimi_delta's bench sweep rows")
    ap.add_argument("--kernel", default="", help="only the kernels whose name contains this")
    ap.add_argument("--config", default="", help="a JSON list of extra configs (set_config) to build too")
    ap.add_argument("--json", default="", help="append one JSON record per build to this file")
    ap.add_argument("--budget", type=float, default=3600.0, help="seconds; builds past it are skipped")
    ap.add_argument("--cache", default="", help="check a Triton cache dir's cubins instead (no build)")
    a = ap.parse_args()
    if a.cache:
        return 1 if sass_hgmma.check_cache(Path(a.cache), describe=describe) else 0

    import triton

    from onboarding.generate import aot

    ptxas = aot._ptxas_path(90)
    ver = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1:]
    print(f"# triton {triton.__version__}, ptxas {ptxas}: {' '.join(ver)}", flush=True)
    only = {f for f in a.only.split(",") if f}
    records = []
    jf = open(a.json, "a") if a.json else None

    def emit(r):
        records.append(r)
        print(line_of(r), flush=True)
        if jf:
            jf.write(json.dumps(r, default=str) + "\n")
            jf.flush()

    deadline = time.time() + a.budget
    with tempfile.TemporaryDirectory(prefix="sass-audit-") as out_dir:
        for family, variant, params, sizes in JOBS:
            if only and family not in only:
                continue
            configs = [{}] + (sweep_configs(family) if a.sweep else []) + (json.loads(a.config) if a.config else [])
            for size in sizes:
                run_job(family, variant, params, size, configs, out_dir, emit, deadline, a.kernel)

    print("\n# summary: family variant params size / kernel: builds, HGMMA (sum), flagged, descriptors not decoded, "
          "starts decoded, high words decoded (descriptors: 2 per HGMMA, 1 with A in registers)")
    table: dict[tuple, list[int]] = {}
    for r in records:
        if "hgmma" not in r:
            continue
        k = (f"{r['family']} {r['variant']} {json.dumps(r['params'], separators=(',', ':'))} {r['size']}", r["kernel"])
        t = table.setdefault(k, [0, 0, 0, 0, 0, 0])
        for i, v in enumerate((1, r["hgmma"], len(r["flags"]), len(r["unknown"]), r["start_decoded"],
                               r["high_decoded"])):
            t[i] += v
    for (job, kernel), (b, n, f, u, sd, hd) in table.items():
        print(f"{job:60s} {kernel:40s} {b:3d} {n:5d} {f:3d} {u:4d}  starts {sd:4d} high {hd:4d}"
              f"{'  <-- FLAGGED' if f else ''}")
    skipped = [r for r in records if "skipped" in r or "error" in r]
    for r in skipped:
        print("# not built:", line_of(r))
    for r in records:
        if r.get("flags"):
            print("# FLAGGED:", line_of(r).splitlines()[0])
    flagged = sum(bool(r.get("flags")) for r in records)
    print(f"# {len(records)} builds, {sum('hgmma' in r for r in records)} checked, "
          f"{sum(r.get('hgmma', 0) > 0 for r in records)} with wgmma, {flagged} flagged, {len(skipped)} not built")
    return 1 if flagged else 2 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
