"""The shared-memory descriptors of an sm_90 cubin's wgmma instructions (SASS `HGMMA`), read back from the
SASS and checked against the kernel's shared allocation and the descriptors its PTX builds.

Why: ptxas 12.8 (triton 3.6's) built kimi_delta v51's `kda_qkt_cold` "split" hot launch with a wgmma whose
K steps took the B descriptor's words from the shared base register instead of the descriptor (stride
16896 B for 512), and compute-sanitizer on an H100 saw "Out-of-range shared or local address" there; the
PTX was right (ptxas 12.9 built it right), so no PTX or bounds check could see it.

`check_sass(sass, shared, ptx)` evaluates the uniform-register instructions that build descriptors (UMOV,
S2UR SR_CgaCtaId taken as 0, ULEA, UIADD3 / .X with carries, UIADD3.64, USHF.R.U32.HI, USGXT.U32,
ULOP3.LUT xor / and / or) in address order, straight line, and decodes each HGMMA's A and B descriptors
(bits 0-13 start address >> 4, 32-45 stride byte offset >> 4, 62-63 swizzle). A descriptor is flagged when
its start lies outside [shared base, base + shared) or its high word (stride, swizzle) is none of the high
words the PTX puts into its descriptors (`or.b64` / `add.s64` of a constant with bit 62 or 63 set). An
operand the straight-line evaluation cannot follow (a loop-carried descriptor, one moved from a vector
register; a high word after an unknown carry, flagged only when neither candidate is the PTX's) is counted
in `unknown`. `check_cubin` runs it on a cubin's SASS with three corrections to that reading (found by
.ci/h200/sass_audit.py's audit of every family; each removed false flags on clean builds, and v51's miscompile
is still flagged): an HGMMA with A in registers (RS form) has no A descriptor, so its A slot is not checked;
a `UIADD3.64` with a register pair is split into its two 32-bit adds (`wide_adds_split`); descriptors moved
through vector registers are followed (`vector_moves`). Use: `python sass_hgmma.py CACHE_DIR [KERNEL_NAME]` checks
every cubin of a Triton cache (what the JIT ran), exit 1 on a flag; `python sass_hgmma.py --aot ...` builds a
rendered module's specs for sm_90 and checks them (`check_aot`, tests/kernel_tests/test_kimi_delta.py).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

M32, M64 = (1 << 32) - 1, (1 << 64) - 1
LUTS = {0x3C: lambda x, y, z: x ^ y, 0xC0: lambda x, y, z: x & y, 0xFC: lambda x, y, z: x | y,
        0x96: lambda x, y, z: x ^ y ^ z}


def _num(tok: str) -> int:
    tok = tok.strip()
    v = int(tok.lstrip("-"), 16) if "0x" in tok else int(tok.lstrip("-"))
    return -v if tok.startswith("-") else v


def ptx_high_words(ptx: str) -> set[int]:
    """The descriptors' high words the PTX builds: constants with a swizzle bit (62 or 63) OR-ed or added
    into a 64-bit register."""
    out = set()
    for m in re.finditer(r"(?:or|add)\.[bs]64\s+%rd\d+, %rd\d+, (-?\d+);", ptx):
        c = int(m.group(1)) & M64
        if c >> 62:
            out.add(c >> 32)
    return out


def check_sass(sass: str, shared: int, ptx: str | None = None) -> tuple[int, list[str], list[str]]:
    """(HGMMA count, flagged descriptors, operands not decoded) of a `cuobjdump -sass` listing."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for line in sass.splitlines()
           if (m := re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line))]
    his = ptx_high_words(ptx) if ptx is not None else None
    U: dict[str, int | None] = {}
    P: dict[str, int | None] = {}
    base = None
    flags, unknown, n = [], [], 0
    alt: dict[str, int] = {}  # a register's other candidate value (a high word after an unknown carry)

    def get(r):
        if r == "URZ":
            return 0
        if re.fullmatch(r"-?(0x[0-9a-f]+|\d+)", r):
            return _num(r) & M32
        return U.get(r)

    def pair(r):
        lo, hi = U.get(f"UR{r}"), U.get(f"UR{r + 1}")
        return None if lo is None or hi is None else (hi << 32) | lo

    def forget(reg, wide):
        U[reg] = None
        if wide:
            U[f"UR{int(reg[2:]) + 1}"] = None

    for addr, t in ins:
        t = re.sub(r"^@!?U?P\w+\s+", "", t)
        op, _, rest = t.partition(" ")
        a = [x.strip() for x in rest.split(",")] if rest else []
        if a and re.fullmatch(r"UR\d+", a[0]) and not op.startswith("HGMMA"):
            alt.pop(a[0], None)
            if op.endswith(".64"):
                alt.pop(f"UR{int(a[0][2:]) + 1}", None)
        try:
            if op == "S2UR" and a[1] == "SR_CgaCtaId":
                U[a[0]] = 0
            elif op == "UMOV":
                U[a[0]] = get(a[1])
                if a[1] in alt:
                    alt[a[0]] = alt[a[1]]
            elif op == "ULEA":
                x, y = get(a[1]), get(a[2])
                U[a[0]] = None if x is None or y is None else ((x << _num(a[3])) + y) & M32
                if base is None and U[a[0]] == 0x400:
                    base = 0x400  # the CTA's shared window (CgaCtaId 0): 1 KB reserved, then the allocation
            elif op == "UIADD3.64":
                x, y = pair(int(a[1][2:])), get(a[2])
                if x is None or y is None:
                    forget(a[0], True)
                else:
                    v = (x + (_num(a[2]) & M64 if a[2].startswith("-") else y)) & M64
                    U[a[0]], U[f"UR{int(a[0][2:]) + 1}"] = v & M32, v >> 32
            elif op in ("UIADD3", "UIADD3.X"):
                srcs = [s for s in a[1:] if not re.fullmatch(r"!?UP\w+", s)]
                preds = [s for s in a[1:] if re.fullmatch(r"!?UP\w+", s)]
                vals = [get(s) for s in srcs[:3]]
                if any(v is None for v in vals):
                    U[a[0]] = None
                    for p in preds:
                        P[p] = None
                    continue
                s_ = sum(vals)
                if op == "UIADD3.X":
                    # carries in: the predicates after the sources (UPT / !UPT: none); one not known (its
                    # add's low word unknown) gives the high word two candidates, kept in `alt`
                    carry = [P.get(p) for p in preds if p not in ("UPT", "!UPT")]
                    U[a[0]] = (s_ + sum(c for c in carry if c is not None)) & M32
                    if None in carry:
                        alt[a[0]] = (U[a[0]] + 1) & M32
                    continue
                else:
                    U[a[0]] = s_ & M32
                    for p in preds:
                        if re.fullmatch(r"UP\d", p):  # carries out
                            P[p] = s_ >> 32
                            break
            elif op == "USHF.R.U32.HI":
                x = get(a[3])
                U[a[0]] = None if x is None else (x >> _num(a[2])) & M32
            elif op == "USGXT.U32":
                x = get(a[1])
                U[a[0]] = None if x is None else x & ((1 << _num(a[2])) - 1)
            elif op == "ULOP3.LUT":
                x, y, z = get(a[1]), get(a[2]), get(a[3])
                f = LUTS.get(_num(a[4]))
                U[a[0]] = None if f is None or None in (x, y, z) else f(x, y, z) & M32
            elif op.startswith("HGMMA"):
                n += 1
                r = int(re.search(r"gdesc\[UR(\d+)\]", rest).group(1))
                for which, reg in (("A", r), ("B", r + 2)):
                    lo, hi = U.get(f"UR{reg}"), U.get(f"UR{reg + 1}")
                    bad = []
                    if hi is not None and his is not None and hi not in his and alt.get(f"UR{reg + 1}") not in his:
                        bad.append(f"high word {hi:#x} (stride {(hi & 0x3FFF) << 4} B, swizzle {hi >> 30}) not "
                                   f"among the PTX's {sorted(hex(h) for h in his)}")
                    if lo is not None and base is not None and not base <= (lo & 0x3FFF) << 4 < base + shared:
                        bad.append(f"start {(lo & 0x3FFF) << 4:#x} outside [{base:#x}, {base + shared:#x})")
                    if lo is None or hi is None or f"UR{reg + 1}" in alt:
                        unknown.append(f"{addr:#06x} {which}")
                    if bad:
                        flags.append(f"{addr:#06x} {which}: " + "; ".join(bad))
            elif a and re.fullmatch(r"UR\d+", a[0]):  # any other write of a uniform register
                forget(a[0], op.endswith(".64"))
        except (ValueError, IndexError, KeyError, AttributeError):
            if a and re.fullmatch(r"UR\d+", a[0]):
                forget(a[0], op.endswith(".64"))
    return n, flags, unknown


def cubin_sass(cubin: bytes) -> str:
    """`cuobjdump -sass` of a cubin, by the cuobjdump Triton ships."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout


def wide_adds_split(sass: str) -> str:
    """`UIADD3.64 URd, URa, URb, URZ` with a register pair URb (not an immediate) rewritten as the 32-bit add with
    a carry out and the high words' add with it (`UIADD3 URd, UP9, URa, URb, URZ` + `UIADD3.X URd+1, URa+1,
    URb+1, URZ, UP9, !UPT`): check_sass reads a .64 add's second source as one 32-bit register, so
    a descriptor built as base + (0x40000040:offset) in a register pair (ssd's split kernels, ptxas 12.8) came
    out with a high word 0 (its false "high word 0x0" flag). Left as is where URd overlaps a source's high
    register (the order of the two halves would matter)."""
    def split(m):
        addr, d, a, b = m.group(1), *(int(m.group(i)) for i in (2, 3, 4))
        if d in (a + 1, b + 1):
            return m.group(0)
        return (f"        /*{addr}*/ UIADD3 UR{d}, UP9, UR{a}, UR{b}, URZ ;\n"
                f"        /*{addr}*/ UIADD3.X UR{d + 1}, UR{a + 1}, UR{b + 1}, URZ, UP9, !UPT ;")

    return re.sub(r"^\s+/\*([0-9a-f]{4,})\*/\s+UIADD3\.64 UR(\d+), UR(\d+), UR(\d+), URZ\s*;.*$", split, sass,
                  flags=re.M)


FAKE = 1000  # vector register Rx is followed as the uniform register UR(FAKE + x)


def vector_moves(sass: str) -> str:
    """Descriptors that ptxas parks in vector registers (`MOV Rx, URy` ... `R2UR URz, Rx`, e.g. sparse_attention's
    MLA kernels under register pressure) followed through them: an unpredicated `MOV Rx, URy|imm` (or
    `IMAD.MOV.U32 Rx, RZ, RZ, URy|imm`) becomes `UMOV UR(FAKE+x), ...`, an unpredicated `R2UR URz, Rx` becomes
    `UMOV URz, UR(FAKE+x)`, and every other instruction writing a vector register also forgets the followed
    copies it may overwrite (Rx .. Rx+3; Rx .. Rx+127 for an MMA's accumulators); a predicated move forgets."""
    out = []
    for line in sass.splitlines():
        m = re.match(r"(\s+/\*[0-9a-f]{4,}\*/\s+)(.*?)\s*;", line)
        if not m:
            out.append(line)
            continue
        pre, t = m.groups()
        pred = re.match(r"@!?P\w+\s+", t)
        op, _, rest = t[pred.end() if pred else 0:].partition(" ")
        a = [x.strip() for x in rest.split(",")] if rest else []
        src = r"UR\d+|URZ|-?0x[0-9a-f]+|-?\d+"
        if not pred and op == "MOV" and len(a) == 2 and re.fullmatch(r"R\d+", a[0]) and re.fullmatch(src, a[1]):
            out.append(f"{pre}UMOV UR{FAKE + int(a[0][1:])}, {a[1]} ;")
        elif (not pred and op == "IMAD.MOV.U32" and len(a) == 4 and re.fullmatch(r"R\d+", a[0])
              and a[1] == a[2] == "RZ" and re.fullmatch(src, a[3])):
            out.append(f"{pre}UMOV UR{FAKE + int(a[0][1:])}, {a[3]} ;")
        elif not pred and op == "R2UR" and len(a) == 2 and re.fullmatch(r"UR\d+", a[0]) and re.fullmatch(r"R\d+", a[1]):
            out.append(f"{pre}UMOV {a[0]}, UR{FAKE + int(a[1][1:])} ;")
        else:
            out.append(line)
            if a and re.fullmatch(r"R\d+", a[0]) and a[0] != "RZ":
                x = int(a[0][1:])
                width = 128 if re.match(r"[HIDQ]?[GM]?MMA|HGMMA|HMMA|IMMA", op) else 4
                out += [f"{pre}UFORGET UR{FAKE + i} ;" for i in range(x, x + width)]
    return "\n".join(out)


def check_cubin(cubin: bytes, shared: int, ptx: str | None) -> dict:
    """check_sass on a cubin's SASS, corrected as above (`wide_adds_split`, `vector_moves`), the A slots of
    RS-form HGMMAs left out: a record (hgmma, rs_form, flags, unknown, shared, start_decoded, high_decoded)."""
    sass = vector_moves(wide_adds_split(cubin_sass(cubin)))
    n, flags, unknown = check_sass(sass, shared, ptx)
    # which parts were decoded at all: the same walk against an empty allocation and no PTX high word flags
    # every operand whose start (resp. high word) it followed
    _, probe, _ = check_sass(sass, 0, "")
    # an HGMMA with A in registers (`HGMMA... Rd, Ra, gdesc[URr]`, wgmma's RS form) has no A descriptor: the
    # hardware reads B's at URr+2 only, and URr..URr+1 hold whatever they held (garbage for check_sass)
    rs = {m.group(1) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?HGMMA\S*\s+R\w+,\s*R\d+,\s*gdesc",
                                           sass)}
    rs = {f"{int(a, 16):#06x} A" for a in rs}
    flags = [f for f in flags if f.split(":")[0] not in rs]
    unknown = [u for u in unknown if u not in rs]
    probe = [f for f in probe if f.split(":")[0] not in rs]
    return {"hgmma": n, "rs_form": len(rs), "flags": flags, "unknown": unknown, "shared": shared,
            "start_decoded": sum("start " in f for f in probe), "high_decoded": sum("high word " in f for f in probe)}


def check_cache(cache: Path, kernel: str = "", describe=None) -> int:
    """Every cubin under a Triton cache dir (what a run's JIT built; `kernel`: only those of that name),
    checked by `check_cubin`; one line each (the cache dir, name, constexprs SPLIT / BK / BV / G when the
    metadata has them); `describe(cubin, ptx, flags)` -> {offset: where} adds a flag's source line. The
    number flagged."""
    bad = 0
    for cubin in sorted(cache.rglob(f"{kernel or '*'}.cubin")):
        meta = json.loads(cubin.with_suffix(".json").read_text())
        ptx = cubin.with_suffix(".ptx")
        ptx = ptx.read_text() if ptx.exists() else None
        r = check_cubin(cubin.read_bytes(), int(meta["shared"]), ptx)
        consts = meta.get("constants") if isinstance(meta.get("constants"), dict) else {}
        consts = {k: v for k, v in consts.items() if k in ("SPLIT", "BK", "BV", "G")}
        print(f"{cubin.parent.name[:12]} {cubin.stem} {consts} w {meta.get('num_warps')} shared {r['shared']}: "
              f"{r['hgmma']} HGMMA ({r['rs_form']} with A in registers), {len(r['flags'])} flagged, "
              f"{len(r['unknown'])} descriptors not decoded")
        where = describe(cubin.read_bytes(), ptx, r["flags"]) if describe and r["flags"] else {}
        for f in r["flags"]:
            print(f"    FLAG {f}" + (f"  [source {where.get(hex(int(f.split()[0], 16)), '?')}]" if where else ""))
        bad += bool(r["flags"])
    print(f"# {bad} flagged")
    return bad


def build_spec(fn, spec: dict):
    """(the compiled kernel, its registers, its spill bytes) of one AOT spec built for sm_90 as the GPU's JIT
    specialises it (`aot.divisibility_attrs` "all"; the spec's warps, stages and register cap); registers and
    spills from ptxas's log (spills the larger of stores and loads; None when ptxas printed none)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from onboarding.generate import aot

    s = aot.with_jit_constants(spec, aot.jit_constants(fn, spec, "all"))
    attrs, _ = aot.divisibility_attrs(fn, s, "all")
    opts = {"num_warps": int(spec.get("num_warps", 4)), "num_stages": int(spec.get("num_stages", 3))}
    if spec.get("maxnreg"):
        opts["maxnreg"] = int(spec["maxnreg"])
    with aot._triton_ptxas_log() as log:
        k = triton.compile(ASTSource(fn=fn, signature=s["signature"], constexprs=s.get("constexprs", {}),
                                     attrs=attrs), target=GPUTarget("cuda", 90, 32), options=opts)
    return (k, *aot._usage_in_log(log.getvalue()))


def check_aot(path: str, kernel: str, configs: list[dict], overrides: list[dict], dtype: str = "bf16",
              size: int = 128) -> list[dict]:
    """sm_90 builds of `kernel`'s AOT specs in the rendered module at `path` under each config (`set_config`)
    and constexpr override, specialised as the GPU's JIT (`aot.divisibility_attrs` "all"), and their
    descriptor checks: one record per build (config, override, SPLIT, HGMMA count, flags, unknown, shared,
    registers). Run without TRITON_INTERPRET (a child process of the tests)."""
    import triton

    from onboarding.generate import aot, templating

    module = templating.load_module(path)
    fn = aot.jit_kernels(module)[kernel]
    out = []
    for config in configs:
        module.set_config(config)
        for over in overrides:
            for spec in [s for s in module.aot_specs(dtype, size) if s["kernel"] == kernel]:
                spec = {**spec, "constexprs": {**spec["constexprs"], **over}}
                k, regs, _ = build_spec(fn, spec)
                r = check_cubin(k.asm["cubin"], int(k.metadata.shared), k.asm["ptx"])
                out.append({"config": config, "override": over, "SPLIT": spec["constexprs"].get("SPLIT"),
                            "hgmma": r["hgmma"], "flags": r["flags"], "unknown": r["unknown"], "shared": r["shared"],
                            "regs": regs, "triton": triton.__version__})
    module.set_config(None)
    return out


if __name__ == "__main__":
    if sys.argv[1] == "--aot":  # --aot MODULE KERNEL CONFIGS_JSON OVERRIDES_JSON: one JSON list on the last line
        print(json.dumps(check_aot(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), json.loads(sys.argv[5]))))
    else:
        sys.exit(1 if check_cache(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "") else 0)
