"""Type hints on the public API (the package ships py.typed): every parameter and return of kspec.call,
compile, explain, op_info, list_ops, every function of kspec.ops, the kspec.nn modules' constructors and
forward, and kspec.optim.AdamW is annotated; and mypy finds no error in those modules (skipped where
mypy is not installed: tools/setup.sh installs it when it can)."""
import importlib.util
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import kspec

ROOT = Path(__file__).resolve().parents[2]


def _public_callables():
    out = [(f"kspec.{n}", getattr(kspec, n)) for n in ("call", "compile", "explain", "op_info", "list_ops")]
    out += [(f"kspec.ops.{n}", f) for n, f in vars(kspec.ops).items()
            if inspect.isfunction(f) and not n.startswith("_") and f.__module__ == "kspec.ops"]
    if importlib.util.find_spec("torch") is not None:
        nn, optim = importlib.import_module("kspec.nn"), importlib.import_module("kspec.optim")
        for cls in (nn.E79Cell, nn.E79CoupledMatrix, nn.LayerNorm, nn.RMSNorm, nn.Mamba):
            for m in ("__init__", "forward", "step", "allocate_inference_cache"):
                if m in vars(cls) or (m in ("__init__", "forward") and hasattr(cls, m)):
                    out.append((f"kspec.nn.{cls.__name__}.{m}", getattr(cls, m)))
        for m in ("__init__", "step", "state_dict", "load_state_dict"):
            out.append((f"kspec.optim.AdamW.{m}", getattr(optim.AdamW, m)))
    return out


@pytest.mark.parametrize("name, fn", _public_callables(), ids=lambda v: v if isinstance(v, str) else "")
def test_public_api_is_annotated(name, fn):
    sig = inspect.signature(fn)
    missing = [p.name for p in sig.parameters.values()
               if p.name != "self" and p.annotation is inspect.Parameter.empty]
    assert not missing, f"{name}: parameters without a type hint: {missing}"
    assert sig.return_annotation is not inspect.Signature.empty, f"{name}: no return type hint"


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed")
def test_mypy_finds_no_error_in_the_public_modules():
    files = [f"python/kspec/{f}.py" for f in ("ops", "nn", "_nn_norm", "_nn_mamba", "optim", "_core", "_typing")]
    # only these files are checked (--follow-imports=silent); the cache under build/ keeps a rerun short
    r = subprocess.run([sys.executable, "-m", "mypy", "--ignore-missing-imports", "--follow-imports=silent",
                        "--cache-dir", str(ROOT / "build" / "mypy-cache"), *files],
                       cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
