"""Shared test helpers: tolerances by dtype (the one table), the relative errors ‖out−ref‖/‖ref‖ and
max|out−ref|/max|ref|, loading a float64 reference module, torch (or a skip) and tensors as float64 NumPy,
mhc's layer inputs on the GPU, a Python process on the mock CUDA driver, kspec's CLI in a subprocess, the outputs
the registry infers for tensors, and finite-difference gradients for the reference tests."""
import importlib
import importlib.util
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

def _tolerances() -> dict:
    try:
        from kspec import _C
    except ImportError:  # no extension built: only the reference tests run, and they take no TOL
        return {}
    return _C.tolerances()  # the one table (api/src/registry.cpp: tolerance_for)


TOL = _tolerances()


def rel_err(out, ref) -> float:
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    den = np.linalg.norm(ref)
    num = np.linalg.norm(out - ref)
    return float(num / den) if den > 0 else float(num)


def torch_or_skip():
    """torch, or the calling test skipped where it is not installed."""
    return pytest.importorskip("torch")


def to_np(t):
    """A tensor as float64 NumPy on the host (None stays None)."""
    return None if t is None else t.detach().double().cpu().numpy()


def max_rel(out, want) -> float:
    """max |out - ref| / max |ref| (issue 34's measure); out a tensor."""
    out, want = to_np(out), np.asarray(want)
    return float(np.abs(out - want).max() / max(np.abs(want).max(), 1e-300))


def mhc_layer_inputs(B, S, n, D, dtype, seed, gamma=True):
    """x (B, S, n, D) in dtype; phi (n*n + 2n, n*D), alpha (3,), bias (n*n + 2n,) and gamma (n*D,) (or None) in
    fp32; on the GPU, from a CPU generator seeded with seed."""
    t = torch_or_skip()
    g = t.Generator(device="cpu").manual_seed(seed)
    M = n * n + 2 * n
    x = t.randn(B, S, n, D, generator=g).to(dtype).cuda()
    phi = (t.randn(M, n * D, generator=g) / (n * D) ** 0.5).cuda()
    alpha = t.tensor([0.8, -0.6, 1.1]).cuda()
    bias = (0.5 * t.randn(M, generator=g)).cuda()
    gam = (1 + 0.3 * t.randn(n * D, generator=g)).cuda() if gamma else None
    return x, phi, alpha, bias, gam


def run_on_mock_driver(body: str, defs: str = ""):
    """Runs `body` in a fresh Python on the mock CUDA driver (tools/bench/dispatch_host.py builds it and its shim:
    CPU tensors through the torch extension and kspec::call, kernels compiled but not run; the body installs the
    shim after importing torch) with `defs` (Python source) before it; the names it starts with: os, sys, ctypes,
    dh (dispatch_host), gpu_tools (tools/gpu's path), mock and shim (the built libraries). Skips without the torch
    extension or cuda.h; asserts the body exited 0 and printed "ok" last; returns the CompletedProcess."""
    from kspec import _native

    include = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include")
    if _native.ext is None or not os.path.exists(os.path.join(include, "cuda.h")):
        pytest.skip("needs the torch extension and the CUDA toolkit's cuda.h (for the mock driver)")
    here = os.path.dirname(__file__)
    tools = os.path.join(here, "..", "..", "tools", "bench")
    gpu_tools = os.path.join(here, "..", "..", "tools", "gpu")
    prelude = (f"import ctypes, os, sys\nsys.path.insert(0, {tools!r})\nimport dispatch_host as dh\n"
               f"gpu_tools = {gpu_tools!r}\nmock, shim = dh.build({include!r})\ndh.select(mock)\n")
    r = subprocess.run([sys.executable, "-c", prelude + defs + body], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:] + r.stdout[-2000:]
    return r


def cli(*args, env=None, check=True, timeout=None):
    """`python -m kspec *args` with env added to this process's environment (at most timeout seconds); check:
    assert it exited 0."""
    e = dict(os.environ)
    e.update(env or {})
    r = subprocess.run([sys.executable, "-m", "kspec", *args], capture_output=True, text=True, env=e, timeout=timeout)
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def tensor_descs(tensors):
    """_C.infer_outputs's descriptions of tensors (None stays None) at made-up addresses 1 GiB apart."""
    descs, ptr = [], 1 << 32
    for t in tensors:
        if t is None:
            descs.append(None)
            continue
        descs.append((ptr, str(t.dtype).removeprefix("torch."), tuple(t.shape), tuple(t.stride()), 0))
        ptr += 1 << 30
    return descs


def inferred_outputs(op, tensors, params):
    """(dtype, shape) of each output the registry infers for op on tensors (None where absent)."""
    from kspec import _C

    return [None if s is None else (s[0], tuple(s[1])) for s in _C.infer_outputs(op, tensor_descs(tensors), params)]


def load_reference(name: str):
    """kspec.reference.<name>. The references are pure NumPy, but `import kspec` loads the compiled
    extension: where that is not built (a CPU-only checkout), the module is loaded from its file so
    the spec stays testable."""
    try:
        return importlib.import_module(f"kspec.reference.{name}")
    except ImportError:
        path = pathlib.Path(__file__).resolve().parents[2] / f"python/kspec/reference/{name}.py"
        spec = importlib.util.spec_from_file_location(f"_kspec_reference_{name}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


def central_diff(loss, param, step):
    """d loss() / d param by central differences, one element at a time (param is restored)."""
    grad = np.empty_like(param)
    for idx in np.ndindex(param.shape):
        saved = param[idx]
        param[idx] = saved + step
        up = loss()
        param[idx] = saved - step
        down = loss()
        param[idx] = saved
        grad[idx] = (up - down) / (2.0 * step)
    return grad


def assert_grad_close(analytic, numeric, fd_noise, what):
    """~1e-6 relative, against 1e-3 of the tensor's largest element for tiny elements, plus the
    difference quotient's own absolute rounding error (as in the C++ twins of these tests)."""
    assert analytic.shape == numeric.shape, what
    scale = np.maximum(np.abs(analytic), 1e-3 * np.abs(analytic).max())
    err = np.abs(analytic - numeric)
    tol = 1e-6 * scale + fd_noise
    assert np.all(err <= tol), f"{what}: max err {err.max():.3e}, worst excess {(err - tol).max():.3e}"


def case_inputs(info, case):
    """(shapes, dtypes) of a case's inputs from its dims, or None when a present input has a dim the case
    does not give (a derived one)."""
    dims, shapes, dtypes = case["dims"], [], {}
    for d in info["inputs"]:
        if d["optional"] and d["name"] in case["without"]:
            shapes.append(None)
            continue
        tokens = d["alt_shape"] if d["name"] in case["alt_shapes"] else d["shape"]
        shape = []
        for tok in tokens:
            name = tok[3:] if tok.startswith("...") else tok
            if tok.isdigit():
                shape.append(int(tok))
            elif name in dims:
                shape.append(dims[name])
            else:
                return None
        shapes.append(tuple(shape))
    for _ in info["inputs"]:  # dtype_of may name a later input: settle in a few passes
        for d in info["inputs"]:
            if d["name"] in case["tensor_dtypes"]:
                dtypes[d["name"]] = case["tensor_dtypes"][d["name"]]
            elif d["dtype_of"]:
                dtypes[d["name"]] = dtypes.get(d["dtype_of"], "float32")
            else:
                dtypes[d["name"]] = "float32" if "float32" in d["dtypes"] else d["dtypes"][0]
    return shapes, [dtypes[d["name"]] for d in info["inputs"]]
