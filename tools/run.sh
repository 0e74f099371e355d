#!/usr/bin/env bash
# Quick start, command 1: install kspec and run the main job. On a GPU: every op against its float64
# reference, with a table. Without one: one representative specialization per op and dtype compiled
# into the cache, with a table (about a minute; `kspec precompile --all` is the full sweep). Python is
# .venv at the repository root unless PYTHON or an active virtual environment says otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup.sh
bash tools/install.sh
exec "$PYTHON" -m kspec run "$@"
