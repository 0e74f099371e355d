"""compute-sanitizer over small GPU cases, as tests: initcheck (global memory read before it is written),
memcheck and racecheck on the kernels where a defect of that class was found. The E79 backward once read
the unused floats of its record's norm slot (28 uninitialized reads per step at n = 16, B = 2, outside
testing, issue 33): its gradients passed, so only initcheck shows it. tools/gpu/sanitize_all.sh runs every
op's cases under all three tools; this file keeps the known cases in the GPU test suite. Skipped without a
GPU or without compute-sanitizer."""
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

_SANITIZER = shutil.which("compute-sanitizer") or next(
    (p for p in (os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "compute-sanitizer"),)
     if os.path.exists(p)), None)


@pytest.mark.skipif(_SANITIZER is None, reason="compute-sanitizer not found")
@pytest.mark.parametrize("tool,op,extra", [
    ("initcheck", "e79.bwd", ["--case", "n_16", "--case", "T_2_B_1"]),
    ("initcheck", "e79.bwd", ["--case", "B_1_n_64_T_not_multiple_of_K", "--config", "split=4,cluster=2"]),
    ("initcheck", "e79.fwd", ["--case", "n_16"]),
    ("memcheck", "e79.bwd", ["--case", "n_16"]),
    ("initcheck", "mhc.pre.bwd", ["--seed", "34"]),  # exited 1 with 0 errors under sanitize_all.sh (H100)
])
def test_sanitizer_clean(tool, op, extra):
    cmd = [_SANITIZER, "--tool", tool, "--error-exitcode", "3", "--print-limit", "5", sys.executable, "-m", "kspec",
           "check", "--op", op, "--dtype", "f32", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    tail = (r.stdout + r.stderr)[-3000:]
    assert "ERROR SUMMARY: 0 errors" in r.stdout + r.stderr, tail
    assert r.returncode == 0, tail
    assert " 0 failed" in r.stdout + r.stderr, tail
