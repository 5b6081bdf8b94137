#!/usr/bin/env bash
# The project's Python environment: .venv/ (or $CPSIM_VENV) with the pinned
# packages of python/requirements.txt, from PyPI. Debian's python3 makes it; no
# system site-packages are touched. pip keeps what it downloads in its cache
# (~/.cache/pip), so a second machine run of this script downloads nothing.
# Idempotent: does nothing when the environment already has the pinned set.
# Prints the environment's python.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${CPSIM_VENV:-$PWD/.venv}
requirements=python/requirements.txt
stamp="$venv/.cpsim-requirements"
if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && cmp -s "$requirements" "$stamp"; then
  echo "$venv/bin/python"
  exit 0
fi
echo "python-env: installing python/requirements.txt into $venv (torch wheel: about 3 GB with its CUDA libraries, once)" >&2
/usr/bin/python3 -m venv "$venv" >&2
"$venv/bin/python" -m pip install -q --upgrade-strategy only-if-needed -r "$requirements" >&2
cp "$requirements" "$stamp"
echo "$venv/bin/python"
