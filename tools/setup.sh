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

# Python: $PYTHON if given, else the active virtual environment, else python3 when it is a virtual
# environment's, else .venv at the repository root,
# created here. Never the system interpreter itself: Debian's is externally managed (PEP 668) and
# refuses pip. The venv sees the system's site-packages, so what a machine already has (torch, or
# everything on an offline GPU machine) is used as it is and only what is missing is pip-installed.
if [ -z "${PYTHON:-}" ]; then
  if [ -n "${VIRTUAL_ENV:-}" ]; then
    PYTHON="$VIRTUAL_ENV/bin/python"
  elif python3 -c "import sys; sys.exit(sys.prefix == sys.base_prefix)" 2>/dev/null; then
    # python3 is itself a virtual environment's (a machine's prepared one, e.g. torch's): a venv made from it
    # would see the base interpreter's packages, not its own, so use it as it is.
    PYTHON="$(python3 -c "import sys; print(sys.executable)")"
  else
    venv="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv"
    if [ ! -x "$venv/bin/python" ]; then
      # Debian/Ubuntu ship venv's ensurepip in a separate package.
      if ! python3 -c "import ensurepip, venv" >/dev/null 2>&1; then
        echo "setup: installing python3-venv"
        SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-venv >/dev/null
      fi
      echo "setup: creating the virtual environment $venv"
      python3 -m venv --system-site-packages "$venv"
    fi
    PYTHON="$venv/bin/python"
  fi
fi
export PYTHON
PY=$PYTHON
missing=()
# jax (CPU wheels unless a CUDA jax is there): its XLA FFI headers build kspec's XLA handlers, tested in CI.
for mod in pybind11 scikit_build_core pytest numpy rich jax; do
  "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('$mod') is None)" 2>/dev/null || missing+=("$mod")
done
if ((${#missing[@]})); then
  pkgs=()
  for m in "${missing[@]}"; do pkgs+=("${m//_/-}"); done
  echo "setup: pip installing ${pkgs[*]}"
  "$PY" -m pip install -q "${pkgs[@]}"
fi
# mypy for tests/python/test_typing.py's type check, which skips without it (an offline machine)
"$PY" -c "import mypy" 2>/dev/null || timeout 120 "$PY" -m pip install -q mypy 2>/dev/null \
  || echo "setup: mypy could not be installed: the type check will be skipped"

if [ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ]; then export CUDA_HOME=/usr/local/cuda; fi
command -v nvcc >/dev/null 2>&1 || export PATH="${CUDA_HOME:-/usr/local/cuda}/bin:$PATH"
