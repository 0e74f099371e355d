#!/usr/bin/env bash
# Builds and installs the Python package (and with it the `kspec` CLI) into $PYTHON (tools/setup.sh:
# .venv at the repository root unless PYTHON or an active virtual environment says otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup.sh
PIP_ROOT_USER_ACTION=ignore "$PYTHON" -m pip install -q --no-build-isolation .
"$PYTHON" -c "import kspec; print('kspec', kspec.__version__, 'installed')"
