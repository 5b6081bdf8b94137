#!/usr/bin/env bash
# Installs the Debian packages cpsim builds and tests with, when missing.
# Idempotent: does nothing (and needs no root) when everything is present.
set -euo pipefail
packages=(cmake g++ make ccache pkg-config libgtest-dev libgmock-dev libbenchmark-dev librapidcheck-dev
          libgloo-dev libhiredis-dev nlohmann-json3-dev libcli11-dev libfmt-dev redis-server
          python3-numpy python3-venv python3-dev clang libclang-rt-14-dev
          openmpi-bin slurmctld slurmd slurm-client munge iproute2 nftables)
# Thrust/CUB (the one kernel source): the CUDA toolkit's CCCL, else Debian's.
[ -e /usr/local/cuda/include/cccl/thrust/version.h ] || packages+=(libthrust-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "install-deps: installing ${missing[*]}"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq || true
# The launchers' daemons (munge, slurmctld, slurmd, redis-server) are started by
# the tests that need them, on free ports: installing starts none of them.
guard=""
if [ ! -e /usr/sbin/policy-rc.d ]; then
  guard=/usr/sbin/policy-rc.d
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$guard" >/dev/null
  $SUDO chmod +x "$guard"
fi
rc=0
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null || rc=$?
[ -z "$guard" ] || $SUDO rm -f "$guard"
exit $rc
