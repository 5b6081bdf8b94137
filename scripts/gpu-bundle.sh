#!/usr/bin/env bash
# make gpu-bundle: a relocatable folder for a GPU machine that has neither the
# Debian dev packages nor a network: the binaries, every shared library they need
# beyond glibc, the CUDA driver and NCCL (found on that machine: NCCL_HOME,
# LD_LIBRARY_PATH or the CUDA toolkit), the examples and the check script.
# Binaries find lib/ through their rpath ($ORIGIN/lib). At most 64 MiB.
set -euo pipefail
build=${1:?usage: gpu-bundle.sh BUILD_DIR [OUT_DIR]}
out=${2:-$build/gpu-bundle}
root="$(cd "$(dirname "$0")/.." && pwd)"
bins=(cpsim cpsim_gpu_tests cpsim_gpu_bench)
for b in "${bins[@]}"; do
  [ -x "$build/$b" ] || { echo "gpu-bundle: $build/$b is missing (is nvcc on the PATH? make build first)" >&2; exit 2; }
done
rm -rf "$out"
mkdir -p "$out/lib" "$out/examples"
for b in "${bins[@]}"; do
  cp "$build/$b" "$out/$b"
  strip --strip-unneeded "$out/$b" 2>/dev/null || true
done
# Libraries beyond glibc, the driver and NCCL.
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libpthread\.so|libdl\.so|librt\.so|libutil\.so|libcuda\.so|libnccl\.so|libnvidia)'
# A library ldd cannot find goes with nothing: say which, and stop (the driver and
# NCCL come from the GPU machine, so their absence here is expected).
missing=$(for b in "${bins[@]}"; do ldd "$build/$b" | awk -v b="$b" '/=> not found/ {print b ": " $1}'; done |
  grep -vE ": (libcuda\.so|libnccl\.so|libnvidia)" | sort -u || true)
if [ -n "$missing" ]; then
  echo "gpu-bundle: libraries not found (set LD_LIBRARY_PATH to where they are, then make gpu-bundle again):" >&2
  echo "$missing" | sed 's/^/  /' >&2
  exit 1
fi
for b in "${bins[@]}"; do
  ldd "$build/$b" | awk '/=> \// {print $1, $3}' | while read -r name path; do
    [[ "$name" =~ $skip ]] && continue
    [ -e "$out/lib/$name" ] || cp -L "$path" "$out/lib/$name"
  done
done
cp -r "$root/examples/." "$out/examples/"
cp "$root/scripts/gpu-check.sh" "$out/gpu-check"
chmod +x "$out/gpu-check"
size=$(du -sm "$out" | cut -f1)
echo "gpu-bundle: $out (${size} MiB): ${bins[*]}, $(ls "$out/lib" | wc -l) libraries, examples, gpu-check"
if [ "$size" -gt 64 ]; then echo "gpu-bundle: ${size} MiB is over the 64 MiB limit" >&2; exit 1; fi
