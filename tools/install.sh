#!/usr/bin/env bash
# Builds and installs the Python package (and with it the `kspec` CLI) into the current python3.
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup.sh
PIP_ROOT_USER_ACTION=ignore "${PYTHON:-python3}" -m pip install -q --no-build-isolation .
"${PYTHON:-python3}" -c "import kspec; print('kspec', kspec.__version__, 'installed')"
