#!/usr/bin/env bash
# Installs what kspec needs to build and test, on a fresh Debian/Ubuntu machine with the CUDA toolkit
# (CUDA_HOME or /usr/local/cuda). Idempotent; skips what is already there, so it also works offline
# on a machine that has everything (the GPU machine).
set -euo pipefail

need_apt=()
dpkg -s nlohmann-json3-dev >/dev/null 2>&1 || need_apt+=(nlohmann-json3-dev)
dpkg -s libgtest-dev >/dev/null 2>&1 || need_apt+=(libgtest-dev)
command -v cmake >/dev/null 2>&1 || need_apt+=(cmake)
command -v ninja >/dev/null 2>&1 || need_apt+=(ninja-build)
command -v g++ >/dev/null 2>&1 || need_apt+=(g++)
if ((${#need_apt[@]})); then
  echo "setup: installing ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
missing=()
# jax (CPU wheels unless a CUDA jax is there): its XLA FFI headers build kspec's XLA handlers, tested in CI.
for mod in pybind11 scikit_build_core pytest numpy rich jax; do
  "$PY" -c "import $mod" 2>/dev/null || missing+=("$mod")
done
if ((${#missing[@]})); then
  pkgs=()
  for m in "${missing[@]}"; do pkgs+=("${m//_/-}"); done
  echo "setup: pip installing ${pkgs[*]}"
  "$PY" -m pip install -q "${pkgs[@]}"
fi

if [ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ]; then export CUDA_HOME=/usr/local/cuda; fi
command -v nvcc >/dev/null 2>&1 || export PATH="${CUDA_HOME:-/usr/local/cuda}/bin:$PATH"
