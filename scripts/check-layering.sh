#!/usr/bin/env bash
# The include rules of the design, checked on every test run:
#   core/   includes only core/ (operators never know a backend);
#   verify/ includes core/ and verify/ only (backends only through core/comm/registry);
#   sim/, gpu/ (backends) never include verify/, cli/ or bench/;
#   gpu/ reaches sim/ only for the Gloo side channel of nccl jobs (sim/world.hpp,
#   sim/gloo/gloo.hpp).
set -euo pipefail
cd "$(dirname "$0")/.."
status=0
check() {  # folder, pattern of forbidden includes, why
  local hits
  hits=$(grep -rnE "#include \"($2)/" "$1" --include='*.hpp' --include='*.cpp' --include='*.cu' --include='*.cuh' 2>/dev/null || true)
  if [ -n "$hits" ]; then
    echo "layering: $1 must not include $2/ ($3):"
    echo "$hits"
    status=1
  fi
}
check core "sim|gpu|verify|cli|bench|tests" "operators never know which backend runs them"
check verify "sim|gpu|cli|bench|tests" "verify/ reaches backends only through the registry"
check sim "verify|cli|bench|tests|gpu" "backends know nothing of properties"
if [ -d gpu ]; then
  check gpu "verify|cli|bench|tests" "backends know nothing of properties"
  hits=$(grep -rnE '#include "sim/' gpu | grep -vE '#include "sim/(world|gloo/gloo)\.hpp"' || true)
  if [ -n "$hits" ]; then
    echo "layering: gpu/ may include only sim/world.hpp and sim/gloo/gloo.hpp of sim/ (the side channel):"
    echo "$hits"
    status=1
  fi
fi
[ $status -eq 0 ] && echo "layering: core, verify and backends keep to their includes"
exit $status
