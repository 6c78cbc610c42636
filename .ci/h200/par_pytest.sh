# Run pytest groups as parallel processes on the device, one shared Triton cache (the host's cores compile
# the groups' kernels at once: the forty-second session's KDA cold-tier rows, which never fitted one call
# when run in turn, finished in 100-230 s this way). After `source .ci/h200/setup.sh`:
#   bash .ci/h200/par_pytest.sh SECONDS 'GROUP' ['GROUP' ...]
# GROUP: pytest arguments, read as a shell would (quote a -k expression inside it), e.g.
#   bash .ci/h200/par_pytest.sh 290 \
#     'tests/kernel_tests/test_kimi_delta.py::test_bf16_vs_fp32_on_gpu[k128-mixed]' \
#     'tests/kernel_tests/test_kimi_delta.py -k "ksplit_sweep and inline"'
# Each group's output goes to $OUT/r/pN.txt (N from 1), cut at SECONDS; then one line per group: its
# arguments, its pytest summary (or "no summary: cut at SECONDS s" / the last line), and the first
# assertion line of a failure. Exit status: the number of groups without a "passed" summary free of
# failures and errors. Timing runs (bench, host_step) do not belong beside it: the groups share the GPU.
set -u
T=$1; shift
mkdir -p "$OUT/r"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tc_par}
mkdir -p "$TRITON_CACHE_DIR"
i=0
for g in "$@"; do
  i=$((i + 1))
  ( eval "timeout $T python3 -m pytest -q -p no:cacheprovider --durations 3 $g" > "$OUT/r/p$i.txt" 2>&1 ) &
done
wait
bad=0; i=0
for g in "$@"; do
  i=$((i + 1)); f="$OUT/r/p$i.txt"
  s=$(grep -E "^(=+ )?[0-9]+ (passed|failed|skipped|error)" "$f" | tail -1)
  [ -z "$s" ] && s="no summary: cut at $T s? last line: $(tail -1 "$f" | cut -c1-160)"
  echo "p$i  $g"
  echo "    $s"
  grep -m1 -E "^E  " "$f" | cut -c1-300 | sed 's/^/    /'
  case "$s" in *passed*) case "$s" in *failed*|*error*) bad=$((bad + 1));; esac;; *) bad=$((bad + 1));; esac
done
exit $bad
