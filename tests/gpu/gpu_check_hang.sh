#!/usr/bin/env bash
# gpu-check with a step made to hang still prints its summary within its limit,
# naming the step TIMEOUT (and exits 1). Runs without a GPU: the device probe is
# skipped, and the other steps fail at once for want of a device.
set -uo pipefail
build=${1:?usage: gpu_check_hang.sh BUILD_DIR EXAMPLES}
examples=${2:?}
root="$(cd "$(dirname "$0")/../.." && pwd)"
limit=30
start=$SECONDS
out=$(GPU_CHECK_DEVICE=assume GPU_CHECK_HANG="GPU tests" GPU_CHECK_LIMIT=$limit \
  timeout -k 5 $((limit + 30)) bash "$root/scripts/gpu-check.sh" "$build" "$examples" 2>&1)
rc=$?
took=$((SECONDS - start))
fail() { echo "gpu_check_hang: $1"; echo "$out" | tail -20; exit 1; }
[ $rc -eq 1 ] || fail "exit status $rc, expected 1"
[ $took -le $((limit + 5)) ] || fail "took ${took}s, over its limit of ${limit}s"
grep -q "=== gpu-check summary" <<<"$out" || fail "no summary"
grep -qE "^GPU tests +TIMEOUT" <<<"$out" || fail "the hanging step is not reported as TIMEOUT"
grep -q "performance goals (not correctness)" <<<"$out" || fail "no performance verdict line"
echo "gpu_check_hang: summary printed after ${took}s (limit ${limit}s), the hanging step TIMEOUT"
