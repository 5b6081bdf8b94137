#!/usr/bin/env bash
# The include rules of the design, checked on every test run:
#   core/   includes only core/ (operators never know a backend);
#   verify/ includes core/ and verify/ only (backends only through core/comm/registry);
#   sim/ and gpu/ (the backends, and sim/job/) are siblings: neither includes the
#   other, nor verify/, cli/ or bench/ (a job hands a backend its side channel
#   through core/comm/side_channel.hpp); inside sim/, threads/ and gloo/ are
#   siblings too, and job/ builds on gloo/ (its side channel), never the reverse;
#   python/ (the torch backend) is an adapter on core/ and the CPU backends'
#   public headers: no verify/, cli/, bench/ or gpu/, and no Gloo (the process
#   wire of torch's point to point is sim/gloo/process_wire.hpp).
set -euo pipefail
cd "$(dirname "$0")/.."
status=0
check() {  # folder, pattern of forbidden includes, why
  local hits
  hits=$(grep -rnE "#include [\"<]($2)/" "$1" --include='*.hpp' --include='*.cpp' --include='*.cu' --include='*.cuh' 2>/dev/null || true)
  if [ -n "$hits" ]; then
    echo "layering: $1 must not include $2/ ($3):"
    echo "$hits"
    status=1
  fi
}
check core "sim|gpu|verify|cli|bench|tests" "operators never know which backend runs them"
check verify "sim|gpu|cli|bench|tests" "verify/ reaches backends only through the registry"
check sim "verify|cli|bench|tests|gpu" "backends know nothing of properties, nor of each other"
check sim/threads "sim/gloo|sim/job" "the threads backend is a sibling of gloo and of the jobs"
check sim/gloo "sim/threads|sim/job" "gloo is a sibling of threads; jobs build on gloo, not gloo on jobs"
check sim/job "sim/threads" "a job runs over gloo's side channel, whatever backend its runs use"
if [ -d gpu ]; then
  check gpu "verify|cli|bench|tests|sim" "backends know nothing of properties, nor of each other"
fi
check python "verify|cli|bench|tests|gpu|gloo" "the torch backend adapts the comm layer; Gloo stays in sim/gloo/"
[ $status -eq 0 ] && echo "layering: core, verify, backends and the torch backend keep to their includes"
exit $status
