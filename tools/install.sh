#!/usr/bin/env bash
# Builds and installs the Python package (and with it the `kspec` CLI) into $PYTHON (tools/setup.sh:
# .venv at the repository root unless PYTHON or an active virtual environment says otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup.sh
# The build directory tools/wheel_check.sh builds its wheel in: tools/test.sh's wheel check then compiles nothing
# again (the extension's sources are the same; a torch extension built here is left out of the wheel by an option).
PIP_ROOT_USER_ACTION=ignore "$PYTHON" -m pip install -q --no-build-isolation -C "build-dir=build/wheel-{wheel_tag}" .
"$PYTHON" -c "import kspec; print('kspec', kspec.__version__, 'installed')"
