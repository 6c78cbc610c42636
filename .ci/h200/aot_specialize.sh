# H200 call (helper aot): the AOT build's divisibility specialisation on the H200's triton 3.6.
# tests/test_aot.py there: the ASTSource `attrs` form works on 3.6 (the CPU run is 3.9), and
# test_aot_build_is_the_one_the_gpu_jit_launches compares the AOT build (specialize=True, spec
# values K 256 / stride 48) with the kernel the JIT compiles at launch: same shared bytes and
# registers; the unmarked build asks for less shared memory. < 100 s.
#   source .ci/h200/setup.sh && bash .ci/h200/aot_specialize.sh
set -o pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p "$O"
t0=$(date +%s); stamp() { echo "=== $1 at +$(( $(date +%s) - t0 )) s"; }
stamp test_aot
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_aot.py -rsxX --durations=5 2>&1 | tail -25
stamp end
