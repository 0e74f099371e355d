"""tools/gpu/sanitize_all.sh without a GPU: stand-ins for compute-sanitizer and python3 on PATH. A run that
exits 1 with "0 errors" (kspec check's own failure, as initcheck_mhc.pre.bwd on the H100) is told apart
from sanitizer errors, every run gets the same --seed, and the summary keeps each failing run's log tail
(the H100 run's log of that failure did not come back)."""
import os
import pathlib
import shutil
import subprocess

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "tools/gpu/sanitize_all.sh"

# compute-sanitizer stand-in: logs its command line; initcheck of mhc.pre.bwd fails as kspec check does
# (exit 1, no sanitizer error), memcheck of norm_act.fwd reports errors (the --error-exitcode given).
FAKE_SANITIZER = r'''#!/usr/bin/env bash
echo "argv: $*"
tool=$2; code=$4
case "$tool $*" in
  initcheck*mhc.pre.bwd*) echo "mhc.pre.bwd  dy_dr  f32  FAIL dphi error 0.000012 > 0.000010; (seed 34)"
                          echo "1 passed, 1 failed"; echo "========= ERROR SUMMARY: 0 errors"; exit 1 ;;
  memcheck*norm_act.fwd*) echo "========= Invalid __global__ read of size 4"; echo "========= ERROR SUMMARY: 2 errors"
                          exit "$code" ;;
  *) echo "========= ERROR SUMMARY: 0 errors"; exit 0 ;;
esac
'''
FAKE_PYTHON = '#!/usr/bin/env bash\necho "mhc.pre.bwd norm_act.fwd"\n'


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils timeout")
def test_summary_names_who_failed_and_keeps_the_log_tail(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("compute-sanitizer", FAKE_SANITIZER), ("python3", FAKE_PYTHON)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "KSPEC_SANITIZE_OPS": "mhc.pre.bwd|norm_act.fwd", "KSPEC_SANITIZE_JOBS": "2"}
    r = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    row = {ln.split()[0]: ln for ln in lines if ln and not ln.startswith(" ")}
    assert "kspec check found mismatches, rc=1 (ERROR SUMMARY: 0 errors)" in row["initcheck_mhc.pre.bwd"]
    assert "sanitizer errors (ERROR SUMMARY: 2 errors)" in row["memcheck_norm_act.fwd"]
    assert row["racecheck_mhc.pre.bwd"].split()[1] == "ok"
    # the failing row itself, under its run, in the summary file too
    summary = (tmp_path / "out/sanitize/summary.txt").read_text()
    assert "    | mhc.pre.bwd  dy_dr  f32  FAIL dphi error" in summary
    assert "    | ========= Invalid __global__ read of size 4" in summary
    logs = list((tmp_path / "out/sanitize").glob("*.log"))
    assert len(logs) == 6 and all("--seed 34" in p.read_text() for p in logs)
