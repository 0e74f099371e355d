#!/usr/bin/env bash
# Quick start, command 2 (and CI): install, build, and run every test — GoogleTest (ctest), pytest,
# the downstream find_package(kspec) project, the wheel in a fresh venv (tools/wheel_check.sh), and the
# precompile check (every op x case x dtype x tuning config through NVRTC for sm_90, the GPU kspec targets,
# and every case's default plan for sm_80; failing on a compile error or a spill). GPU tests run when a
# GPU is present and skip otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup.sh
PY=$PYTHON  # set by setup.sh: .venv unless PYTHON or an active venv says otherwise
JOBS=${JOBS:-$(nproc)}
export KSPEC_CACHE_DIR=${KSPEC_CACHE_DIR:-$(mktemp -d)/kspec-cache}
# One cache for ctest's processes, pytest and the precompile step: a kernel is compiled once in this run.
export KSPEC_TEST_CACHE_DIR=${KSPEC_TEST_CACHE_DIR:-$KSPEC_CACHE_DIR}
start=$SECONDS
step() { echo "== [$((SECONDS - start)) s] $*"; }

step "C++: configure, build, ctest"
cmake -S . -B build/test -G Ninja -DCMAKE_BUILD_TYPE=Release -DKSPEC_BUILD_TESTS=ON -DKSPEC_PYTHON="$(command -v "$PY")" >/dev/null
cmake --build build/test -j "$JOBS"
(cd build/test && ctest --output-on-failure -j "$JOBS")

step "C++: install and use from a downstream CMake project"
prefix=$(mktemp -d)
cmake --install build/test --prefix "$prefix" >/dev/null
cmake -S tests/downstream -B build/downstream -G Ninja -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build build/downstream
./build/downstream/kspec_downstream
./build/downstream/kspec_downstream_c

step "Python: install and pytest"
bash tools/install.sh
"$PY" -m pytest -q tests/python

step "Python: the wheel in a fresh venv without the toolkit (auditwheel, NVRTC from pip's wheels)"
bash tools/wheel_check.sh

step "precompile: every specialization for sm_90 (every config of every tuning space), every default plan for sm_80"
"$PY" -m kspec precompile --all --arch sm_90 --defaults sm_80
step "done"
