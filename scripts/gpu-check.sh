#!/usr/bin/env bash
# gpu-check: everything GPU in one run of a few minutes. Run it inside the bundle
# (./gpu-check) or in a tree (make gpu-check, which passes the build folder).
#   1. the GPU tests (kernels against the host kernels, cuda-sim bitwise against
#      threads, the property table on cuda-sim and nccl, errors);
#   2. cpsim check examples/*.json on cuda-sim at CP 1, 2, 4, 8, and on nccl at
#      the GPU count CUDA reports (CUDA_VISIBLE_DEVICES honoured);
#   3. cpsim fuzz --cases 300 on cuda-sim;
#   4. compute-sanitizer memcheck on one small case, when it is installed and
#      can attach to this device (else "unavailable here", not a failure);
#   5. the kernel benchmarks against a same-run device-to-device copy: their
#      goals are a verdict line of their own, apart from correctness.
# Every step runs under a timeout that leaves time for the summary, which is
# always printed, within GPU_CHECK_LIMIT seconds (default 280) in all.
# Exit 2 with "no CUDA device" where there is none; 1 when a step fails or
# times out. (GPU_CHECK_HANG=STEP makes the step whose name starts with STEP
# hang, and GPU_CHECK_DEVICE=assume skips the device probe: they test this
# script itself.)
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin=${1:-$here}
examples=${2:-$here/examples}
[ -d "$examples" ] || examples="$here/../examples"
limit=${GPU_CHECK_LIMIT:-280}
# NCCL comes from this machine, loaded when the nccl backend is first used:
# CPSIM_NCCL_LIBRARY, NCCL_HOME, PyTorch's pip packages (nvidia/nccl/lib),
# LD_LIBRARY_PATH, or the CUDA toolkit. The summary says which one was used.
torch_nccl=""
for py in python3 /usr/bin/python3; do
  command -v "$py" >/dev/null || continue
  torch_nccl=$("$py" -c 'import importlib.util as u, os
s = u.find_spec("nvidia.nccl")
for d in (s.submodule_search_locations or []) if s else []:
    if os.path.exists(os.path.join(d, "lib", "libnccl.so.2")): print(os.path.join(d, "lib")); break' 2>/dev/null)
  [ -n "$torch_nccl" ] && break
done
export LD_LIBRARY_PATH="$bin/lib${NCCL_HOME:+:$NCCL_HOME/lib:$NCCL_HOME/lib64}${torch_nccl:+:$torch_nccl}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}:/usr/local/cuda/lib64:/usr/local/cuda/lib"
export CPSIM_BINARY="$bin/cpsim" CPSIM_EXAMPLES="$examples"
cpsim="$bin/cpsim"

if [ "${GPU_CHECK_DEVICE:-}" != assume ]; then
  probe=$(timeout -k 5 60 "$cpsim" check "$examples/agreeing_forms.json" --backend cuda-sim --cp 1 2>&1 >/dev/null)
  probe_rc=$?
  if [ $probe_rc -eq 2 ] && grep -q "no CUDA device" <<<"$probe"; then
    echo "gpu-check: no CUDA device ${probe#*no CUDA device }" >&2
    exit 2
  fi
fi

status=0
summary=()
performance="not measured"
finish() {
  echo "=== gpu-check summary (${SECONDS}s of ${limit}s)"
  printf '%s\n' "${summary[@]}"
  printf '%-44s %s\n' "performance goals (not correctness)" "$performance"
}
trap 'finish; exit $status' EXIT
trap 'summary+=("interrupted"); status=1; exit' INT TERM

# Seconds the next step may take: its own cap, within what is left before the
# summary (20 s kept for it).
budget() {
  local cap=$1 left=$((limit - SECONDS - 20))
  [ $left -lt $cap ] && cap=$left
  [ $cap -lt 1 ] && cap=1
  echo $cap
}
step() {  # name, cap in seconds, command...
  local name=$1 cap
  cap=$(budget "$2")
  shift 2
  if [ -n "${GPU_CHECK_HANG:-}" ] && [[ "$name" == "$GPU_CHECK_HANG"* ]]; then set -- sleep 100000; fi
  echo "=== $name (at most ${cap}s)"
  local t0=$SECONDS rc verdict
  timeout -k 5 "$cap" "$@"
  rc=$?
  case $rc in
    0) verdict=ok ;;
    124 | 137) verdict=TIMEOUT ;;
    *) verdict="FAIL($rc)" ;;
  esac
  summary+=("$(printf '%-44s %-9s %4ds' "$name" "$verdict" $((SECONDS - t0)))")
  [ $rc -eq 0 ] || status=1
  return $rc
}

# The GPU count as CUDA reports it: the nccl backend's rank limit (one per GPU),
# and the NCCL it loaded (or why none).
version=$("$cpsim" --version 2>/dev/null)
gpus=$(sed -n 's/^  nccl: up to \([0-9]*\) ranks.*/\1/p' <<<"$version")
if [ -z "$gpus" ]; then
  gpus=$(sed -n 's/^  cuda-sim: up to \([0-9]*\) ranks.*/\1/p' <<<"$version")
fi
[ "${gpus:-0}" -ge 1 ] 2>/dev/null || gpus=1
summary+=("$(printf '%-44s %s' "GPUs (CUDA's count)" "$gpus")")
nccl=$(sed -n 's/^  nccl: .*NCCL: \(.*\))$/\1/p; s/^  nccl: unavailable: \(.*\)$/unavailable: \1/p' <<<"$version")
summary+=("$(printf '%-44s %s' "NCCL" "${nccl:-unknown}")")

step "GPU tests" 90 "$bin/cpsim_gpu_tests"
step "check examples, cuda-sim, cp 1,2,4,8" 40 "$cpsim" check "$examples"/*.json --backend cuda-sim --cp 1,2,4,8
step "check examples, nccl, cp $gpus" 40 "$cpsim" check "$examples"/*.json --backend nccl --cp "$gpus"
step "fuzz 300 cases, cuda-sim" 60 "$cpsim" fuzz --backend cuda-sim --cases 300 --out "${TMPDIR:-/tmp}/cpsim-gpu-fuzz.json"
cs=$(command -v compute-sanitizer || { [ -x /usr/local/cuda/bin/compute-sanitizer ] && echo /usr/local/cuda/bin/compute-sanitizer; })
if [ -z "$cs" ]; then
  summary+=("$(printf '%-44s %s' "compute-sanitizer memcheck" "not installed")")
elif ! attach=$(timeout -k 5 "$(budget 30)" "$cs" --tool memcheck "$cpsim" --version 2>&1) ||
  grep -qiE "not supported|unable to" <<<"$attach"; then
  summary+=("$(printf '%-44s %s' "compute-sanitizer memcheck" "unavailable here: $(grep -m1 -iE 'not supported|unable to' <<<"$attach")")")
else
  step "compute-sanitizer memcheck, cuda-sim cp 2" 60 "$cs" --tool memcheck --error-exitcode 1 \
    "$cpsim" check "$examples/agreeing_forms.json" --backend cuda-sim --cp 2
fi
bench_out="${TMPDIR:-/tmp}/cpsim-gpu-bench-$$.txt"
step "kernel benchmarks vs device-to-device copy" 90 \
  bash -c 'set -o pipefail; "$0" --benchmark_counters_tabular=true | tee "$1"' "$bin/cpsim_gpu_bench" "$bench_out"
if grep -q "every goal met" "$bench_out" 2>/dev/null; then
  performance="every goal met"
elif grep -q "some goals not met" "$bench_out" 2>/dev/null; then
  performance="BELOW: $(grep -c ' BELOW$' "$bench_out") of $(grep -cE ' (met|BELOW)$' "$bench_out") goal rows (see the table above)"
fi
rm -f "$bench_out"
