"""md5 of a Triton PTX without line info, comments and debug sections: compare a GPU's JIT dump
(TRITON_KERNEL_DUMP=1 TRITON_DUMP_DIR=...) with this host's AOT build. Usage: ptx_norm.py FILE.ptx ..."""
import hashlib
import sys

SKIP = (".loc", ".file", "$L__tmp", "$L__func")

for f in sys.argv[1:]:
    txt = open(f).read().split("\t.section\t.debug")[0]
    keep = [line.split("//")[0].rstrip() for line in txt.splitlines()]
    keep = [line for line in keep if line.strip() and not line.strip().startswith(SKIP)]
    print(hashlib.md5("\n".join(keep).encode()).hexdigest(), len(keep), f)
