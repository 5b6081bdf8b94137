#!/usr/bin/env bash
# gpu-check: everything GPU in one run of a few minutes. Run it inside the bundle
# (./gpu-check) or in a tree (make gpu-check, which passes the build folder).
#   1. the GPU tests (kernels against the host kernels, cuda-sim bitwise against
#      threads, the property table on cuda-sim and nccl, errors);
#   2. cpsim check examples/*.json on cuda-sim at CP 1, 2, 4, 8, and on nccl at
#      the visible GPU count;
#   3. cpsim fuzz --cases 300 on cuda-sim;
#   4. compute-sanitizer memcheck on one small case, when it is installed;
#   5. the kernel benchmarks against a same-run device-to-device copy; their goal
#      table comes last.
# Exit 2 with "no CUDA device" where there is none; 1 when a step fails.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin=${1:-$here}
examples=${2:-$here/examples}
[ -d "$examples" ] || examples="$here/../examples"
# NCCL comes from this machine: NCCL_HOME, LD_LIBRARY_PATH, or the CUDA toolkit.
export LD_LIBRARY_PATH="$bin/lib${NCCL_HOME:+:$NCCL_HOME/lib:$NCCL_HOME/lib64}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}:/usr/local/cuda/lib64:/usr/local/cuda/lib"
export CPSIM_BINARY="$bin/cpsim" CPSIM_EXAMPLES="$examples"
cpsim="$bin/cpsim"

probe=$("$cpsim" check "$examples/agreeing_forms.json" --backend cuda-sim --cp 1 2>&1 >/dev/null)
probe_rc=$?
if [ $probe_rc -eq 2 ] && grep -q "no CUDA device" <<<"$probe"; then
  echo "gpu-check: no CUDA device ${probe#*no CUDA device }" >&2
  exit 2
fi

status=0
summary=()
step() {  # name, command...
  local name=$1
  shift
  echo "=== $name"
  local t0=$SECONDS
  "$@"
  local rc=$?
  summary+=("$(printf '%-44s %-6s %4ds' "$name" "$([ $rc -eq 0 ] && echo ok || echo FAIL)" $((SECONDS - t0)))")
  [ $rc -eq 0 ] || status=1
}
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
[ "${gpus:-0}" -ge 1 ] || gpus=1

step "GPU tests" "$bin/cpsim_gpu_tests"
step "check examples, cuda-sim, cp 1,2,4,8" "$cpsim" check "$examples"/*.json --backend cuda-sim --cp 1,2,4,8
step "check examples, nccl, cp $gpus" "$cpsim" check "$examples"/*.json --backend nccl --cp "$gpus"
step "fuzz 300 cases, cuda-sim" "$cpsim" fuzz --backend cuda-sim --cases 300 --out "${TMPDIR:-/tmp}/cpsim-gpu-fuzz.json"
if command -v compute-sanitizer >/dev/null || [ -x /usr/local/cuda/bin/compute-sanitizer ]; then
  cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  step "compute-sanitizer memcheck, cuda-sim cp 2" "$cs" --tool memcheck --error-exitcode 1 \
    "$cpsim" check "$examples/agreeing_forms.json" --backend cuda-sim --cp 2
else
  summary+=("$(printf '%-44s %-6s' "compute-sanitizer memcheck" "not installed")")
fi
step "kernel benchmarks vs device-to-device copy" "$bin/cpsim_gpu_bench" --benchmark_counters_tabular=true

echo "=== gpu-check summary"
printf '%s\n' "${summary[@]}"
exit $status
