"""Where NVRTC comes from, seen from Python (issue 31): an explicit KSPEC_NVRTC that is wrong gives a
kspec.CudaError naming it while `import kspec` still works, and pip's `nvidia` package directories (here a
stand-in laid out like the CUDA 13 wheel, on PYTHONPATH) come before the toolkit. Each case runs in a
fresh interpreter: NVRTC is loaded once per process. tools/wheel_check.sh does the same for the built
wheel in a fresh venv with the real nvidia wheels."""
import json
import os
import subprocess
import sys
from pathlib import Path

import kspec

# torch is kept out: its own libraries load NVRTC at import, and the probe asks whether kspec does.
PROBE = """
import json, sys
sys.modules["torch"] = None
import kspec
out = {"maps_nvrtc": "libnvrtc" in open("/proc/self/maps").read(), "doctor": dict(kspec.doctor())}
try:
    out["compiled"] = [r["source"] for r in kspec.compile("norm_act.fwd", dtype="f16", arch="sm_80", hidden=256)]
except kspec.CudaError as e:
    out["error"] = str(e)
print(json.dumps(out))
"""


def _probe(tmp_path, **env):
    full = {k: v for k, v in os.environ.items() if k != "KSPEC_NVRTC"}
    full.update(KSPEC_CACHE_DIR=str(tmp_path / "cache"), **env)
    r = subprocess.run([sys.executable, "-c", PROBE], env=full, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _system_nvrtc() -> str:
    return dict(kspec.doctor())["nvrtc library"]


def test_wrong_kspec_nvrtc_is_an_error_naming_it(tmp_path):
    missing = tmp_path / "nowhere" / "libnvrtc.so.13"
    out = _probe(tmp_path, KSPEC_NVRTC=str(missing))
    assert out["maps_nvrtc"] is False  # nothing loaded NVRTC at import
    assert f"KSPEC_NVRTC {missing}: no such file" in out["error"]
    assert "pip install nvidia-cuda-nvrtc" in out["error"]
    assert out["doctor"]["nvrtc"].startswith("NOT FOUND")


def test_pip_nvidia_wheel_layout_comes_first(tmp_path):
    system = Path(_system_nvrtc())
    lib = tmp_path / "site" / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    for f in system.parent.glob("libnvrtc*.so.*"):  # libnvrtc and its builtins, as the wheel ships them
        (lib / f.name).symlink_to(f.resolve())
    path = os.pathsep.join(p for p in [str(tmp_path / "site"), os.environ.get("PYTHONPATH")] if p)
    out = _probe(tmp_path, PYTHONPATH=path)
    assert out["doctor"]["nvrtc library"] == str(lib / system.name), out["doctor"]
    assert out["compiled"] and all(s in ("compiled", "disk") for s in out["compiled"]), out


def test_one_version_and_the_wheel_metadata():
    """The package's version is CMake's project version (pyproject reads it from CMakeLists.txt), and the
    wheel carries its licence, readme and py.typed."""
    from importlib import metadata

    assert metadata.version("kspec") == kspec.__version__
    meta = metadata.metadata("kspec")
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta["Requires-Python"] and meta["Description-Content-Type"] == "text/markdown"
    assert "Typing :: Typed" in meta.get_all("Classifier")
    names = {str(f) for f in metadata.files("kspec")}
    assert "kspec/py.typed" in names
