#!/usr/bin/env bash
# Quick start, command 1: install kspec and run the main job. On a GPU: every op against its float64
# reference, with a table. Without one: specialize and compile every op into the cache.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install.sh
exec "${PYTHON:-python3}" -m kspec run "$@"
