"""md5 of a Triton PTX without line info, comments and debug sections: compare a GPU's JIT dump
(TRITON_KERNEL_DUMP=1 TRITON_DUMP_DIR=...) with this host's AOT build. usage: ptx_norm.py FILE.ptx ..."""
import hashlib, re, sys
for f in sys.argv[1:]:
    txt = open(f).read()
    txt = txt.split("\t.section\t.debug")[0]
    keep = [l.split("//")[0].rstrip() for l in txt.splitlines()]
    keep = [l for l in keep if l.strip() and not l.strip().startswith((".loc", ".file", "$L__tmp", "$L__func"))]
    print(hashlib.md5("\n".join(keep).encode()).hexdigest(), len(keep), f)
