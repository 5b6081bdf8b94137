#!/usr/bin/env bash
# The main job (`make run`): every property on the shipped example batches at
# CP sizes 1,2,3,4,8, then a sweep over random layouts, on the threads backend.
set -uo pipefail
cpsim=${1:-build/cpsim}
cd "$(dirname "$0")/.."
status=0
echo "== cpsim check examples/*.json --cp 1,2,3,4,8"
"$cpsim" check examples/*.json --cp 1,2,3,4,8 || status=$?
echo
echo "== cpsim check examples/*.json --cp 1,2,3,4,8 --plan balanced"
out=$("$cpsim" check examples/*.json --cp 1,2,3,4,8 --plan balanced) || { status=$?; echo "$out"; }
echo "${out##*$'\n'}"
echo
echo "== cpsim fuzz --cases 300 --max-cp 16 (plans drawn: equal, balanced, random cuts)"
"$cpsim" fuzz --cases 300 --max-cp 16 --out build/fuzz-counterexample.json || status=$?
echo
echo "== cpsim fuzz --family F --cases 100 --plan equal|balanced, every family in examples/families/"
for family in examples/families/*.json; do
  for plan in equal balanced; do
    out=$("$cpsim" fuzz --family "$family" --cases 100 --plan "$plan" --out build/fuzz-counterexample.json) ||
      { status=$?; echo "$out"; }
    echo "${out%%$'\n'*}"
  done
done
echo
[ $status -eq 0 ] && echo "summary: every property holds" || echo "summary: FAILED (exit $status)"
exit $status
