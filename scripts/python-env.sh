#!/usr/bin/env bash
# The project's Python environment: .venv/ (or $CPSIM_VENV) with the pinned
# packages of python/requirements.txt, from PyPI, and the CP libraries of
# python/requirements-libraries.txt, without their dependencies (--no-deps: their
# training stacks are not what their CP code imports). Debian's python3 makes it; no
# system site-packages are touched. The wheels are kept in a folder of their own
# ($CPSIM_WHEELS, default ~/.cache/cpsim/wheels; pip's own cache keeps nothing
# when the index forbids caching), so a second run on the machine, a fresh clone
# included, installs from there and downloads nothing.
# Idempotent: does nothing when the environment already has the pinned set.
# Prints the environment's python.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${CPSIM_VENV:-$PWD/.venv}
requirements=python/requirements.txt
libraries=python/requirements-libraries.txt
stamp="$venv/.cpsim-requirements"
if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && cat "$requirements" "$libraries" | cmp -s - "$stamp"; then
  echo "$venv/bin/python"
  exit 0
fi
wheels=${CPSIM_WHEELS:-$HOME/.cache/cpsim/wheels}
mkdir -p "$wheels"
[ -x "$venv/bin/python" ] || /usr/bin/python3 -m venv "$venv" >&2  # an existing one is kept (its own interpreter)
local_install() {
  "$venv/bin/python" -m pip install -q --no-index --find-links "$wheels" -r "$requirements" >&2 &&
    "$venv/bin/python" -m pip install -q --no-index --find-links "$wheels" --no-deps -r "$libraries" >&2
}
if ! local_install 2>/dev/null; then
  echo "python-env: downloading python/requirements*.txt into $wheels (the torch wheel with its CUDA libraries: about 3 GB, once)" >&2
  "$venv/bin/python" -m pip download -q -d "$wheels" -r "$requirements" >&2
  "$venv/bin/python" -m pip download -q -d "$wheels" --no-deps -r "$libraries" >&2
  local_install
fi
cat "$requirements" "$libraries" > "$stamp"
echo "$venv/bin/python"
