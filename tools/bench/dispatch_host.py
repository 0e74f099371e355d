"""The host path of kspec's torch surface on a machine without a GPU: torch's CPU tensors go through the
torch extension (kspec._torch_ext) and the whole of kspec::call (validation, call cache, plan) into the mock
CUDA driver and mock cuBLASLt (tests/mock_cuda: host memory, launches and matmuls that only count). A shim
of kspec._C's C ABI
(dispatch_host_shim.cpp) moves every view to device 0 on the way, so nothing is stubbed but the GPU.
Rows as tools/bench/dispatch.py's (median host µs of N calls, each timed alone) and, exact whatever the
machine's load, the Python-level calls per call (cProfile). Kernels are compiled for sm_90 on first use
(NVRTC: the CUDA toolkit is needed, not a GPU). Differs from the GPU: the autograd engine runs a CPU
graph's backward on the calling thread, where a CUDA graph's runs on the device's worker thread.

    python3 tools/bench/dispatch_host.py [--calls N] [--cuda-include DIR] [--row TEXT] [--profile] [--callgrind]

--row keeps the rows whose name contains TEXT; --profile prints each row's Python functions by own time
(cProfile), the pieces of its host time; --callgrind runs the rows under valgrind's callgrind instead and
prints each row's instructions per call (exact whatever the machine's load: collected only around each row's
--calls calls, less an empty row's loop; the rows' kernels must be in kspec's disk cache from a run without it).
"""
from __future__ import annotations

import argparse
import cProfile
import ctypes
import os
import pstats
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build(cuda_include: str) -> tuple[str, str]:
    """(mock driver and cuBLASLt in one library, C ABI shim): compiled with g++ into a temporary folder."""
    out = tempfile.mkdtemp(prefix="kspec-dispatch-host-")
    mock, shim = os.path.join(out, "libcuda_mock.so"), os.path.join(out, "shim.so")
    flags = ["g++", "-O2", "-std=c++17", "-fPIC", "-shared"]
    subprocess.run(flags + [f"-I{cuda_include}", os.path.join(ROOT, "tests/mock_cuda/cuda_mock.cpp"),
                            os.path.join(ROOT, "tests/mock_cuda/cublaslt_mock.cpp"), "-o", mock], check=True)
    subprocess.run(flags + [f"-I{ROOT}", f"-I{ROOT}/api/include", f"-I{ROOT}/jit/base/include",
                            os.path.join(ROOT, "tools/bench/dispatch_host_shim.cpp"), "-o", shim], check=True)
    return mock, shim


_keep = []  # the shim's library and the capsule's name live as long as the process


def select(mock: str) -> None:
    """The mock as kspec's driver and cuBLASLt: before kspec loads either."""
    os.environ["KSPEC_LIBCUDA"] = os.environ["KSPEC_LIBCUBLASLT"] = mock


def install_shim(shim_path: str) -> None:
    """kspec._torch_ext re-initialized with the shim over kspec._C's C ABI."""
    from kspec import _C, _native

    if _native.ext is None:
        sys.exit("dispatch_host: kspec._torch_ext is not loaded (built without torch, or KSPEC_TORCH_EXT=off)")
    name = b"kspec._C._ext_api"
    api = ctypes.pythonapi
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    api.PyCapsule_New.restype = ctypes.py_object
    api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    lib = ctypes.CDLL(shim_path)
    lib.kspec_ext_shim.restype = ctypes.c_void_p
    lib.kspec_ext_shim.argtypes = [ctypes.c_void_p]
    shim = lib.kspec_ext_shim(api.PyCapsule_GetPointer(_C._ext_api, name))
    _keep.extend([lib, name])
    _native.ext.init(api.PyCapsule_New(shim, name, None))


_COUNTER = r"""
#include <valgrind/callgrind.h>
extern "C" void kspec_count_start() { CALLGRIND_ZERO_STATS; CALLGRIND_TOGGLE_COLLECT; }
extern "C" void kspec_count_stop(const char* name) { CALLGRIND_TOGGLE_COLLECT; CALLGRIND_DUMP_STATS_AT(name); }
"""


def instructions(fn, calls: int, lib, name: str) -> None:
    """fn called `calls` times with callgrind collecting (a dump named `name`); nothing outside valgrind."""
    for _ in range(10):
        fn()
    lib.kspec_count_start()
    for _ in range(calls):
        fn()
    lib.kspec_count_stop(name.encode())


def counter_lib(shim: str):
    """The callgrind client requests (kspec_count_start / stop) as a library built beside the shim."""
    counter = os.path.join(os.path.dirname(shim), "count.so")
    subprocess.run(["g++", "-O2", "-fPIC", "-shared", "-x", "c++", "-", "-o", counter], input=_COUNTER.encode(),
                   check=True)
    lib = ctypes.CDLL(counter)
    lib.kspec_count_stop.argtypes = [ctypes.c_char_p]
    return lib


def callgrind(argv: list, calls: int, script: str = __file__) -> None:
    """`script` (this one unless given) under callgrind with --count; prints each row's instructions per call (its
    dump's total over `calls`, less the empty row's)."""
    import glob
    import re

    out = tempfile.mkdtemp(prefix="kspec-callgrind-")
    subprocess.run(["valgrind", "--tool=callgrind", "--collect-atstart=no", f"--callgrind-out-file={out}/cg.out",
                    sys.executable, os.path.abspath(script), "--count"] + argv, check=True)
    totals = {}
    for path in glob.glob(f"{out}/cg.out*"):
        text = open(path, errors="replace").read()
        name = re.search(r"^desc: Trigger: Client Request: (.*)$", text, re.M)
        total = re.search(r"^(?:totals|summary): (\d+)", text, re.M)
        if name and total:
            totals[name.group(1)] = int(total.group(1)) / calls
    empty = totals.pop("empty", 0.0)
    print(f"instructions per call (callgrind, {calls} calls a row, less an empty row's {empty:.0f})")
    for name, ir in totals.items():
        print(f"{name:52s} {ir - empty:9.0f}")


def host_us(fn, calls: int) -> float:
    for _ in range(calls // 10):
        fn()
    t = [0] * calls
    clock = time.perf_counter_ns
    for i in range(calls):
        t0 = clock()
        fn()
        t[i] = clock() - t0
    t.sort()
    return t[calls // 2] / 1e3


def py_calls(fn, n=50, profile=False) -> float:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    stats = pstats.Stats(prof)
    if profile:
        stats.sort_stats("tottime").print_stats(12)
    return stats.total_calls / n


def rows():
    import torch

    import kspec

    bf = torch.bfloat16
    x = torch.randn(4, 256, dtype=bf)
    w = torch.ones(256, dtype=bf)
    xg = x.clone().requires_grad_()
    y, mean, rstd = torch.empty_like(x), torch.empty(4), torch.empty(4)
    nm = dict(norm="rmsnorm", act="identity", eps=1e-5)
    b, d, t, n = 1, 16, 32, 16
    u = torch.randn(b, d, t, dtype=bf)
    delta = torch.rand(b, d, t, dtype=bf)
    A = -torch.rand(d, n)
    B = torch.randn(b, 1, n, t, dtype=bf)
    C = torch.randn(b, 1, n, t, dtype=bf)
    D = torch.randn(d)
    ug = u.clone().requires_grad_()
    gy = torch.randn(4, 256, dtype=bf)

    def norm_step():
        xg.grad = None
        kspec.ops.norm_act(xg, w, None, norm="rmsnorm").backward(gy)

    # issue 33's host-bound training step (2, 4096, 333): every input a leaf that wants its gradient
    b2, d2, t2 = 2, 4096, 333
    leaves = [torch.randn(b2, d2, t2, dtype=bf), torch.rand(b2, d2, t2, dtype=bf), -torch.rand(d2, n),
              torch.randn(b2, 1, n, t2, dtype=bf), torch.randn(b2, 1, n, t2, dtype=bf), torch.randn(d2),
              torch.randn(b2, d2, t2, dtype=bf), torch.randn(d2) * 0.1]
    leaves = [v.requires_grad_() for v in leaves]
    dout = torch.randn(b2, d2, t2, dtype=bf)

    def scan_step():
        for v in leaves:
            v.grad = None
        kspec.ops.selective_scan_fn(*leaves, delta_softplus=True).backward(dout)

    lx = torch.randn(4, 256, dtype=bf)
    lw = torch.randn(256, 256, dtype=bf) * 0.06
    lb = torch.zeros(256, dtype=bf)
    lxg, lwg, lbg = (v.clone().requires_grad_() for v in (lx, lw, lb))

    T, hn, hd = 8, 4, 4096
    hx = torch.randn(T, hn, hd, dtype=bf)
    hxg = hx.clone().requires_grad_()
    phi = torch.randn(hn * hn + 2 * hn, hn * hd) * 0.01
    alpha, hbias = torch.full((3,), 0.01), torch.zeros(hn * hn + 2 * hn)
    hw, hf = torch.ones(hn * hd, dtype=bf), torch.randn(T, hd, dtype=bf)
    h_post, h_res = torch.rand(T, hn), torch.rand(T, hn, hn)

    def no_grad(fn):
        def run():
            with torch.no_grad():
                return fn()
        return run

    def linear_step():
        for v in (lxg, lwg, lbg):
            v.grad = None
        kspec.ops.linear(lxg, lwg, lbg, "relu").backward(gy)

    return [
        ("kspec.call norm_act.fwd, out=", lambda: kspec.call("norm_act.fwd", x, w, None, out=(y, mean, rstd), **nm)),
        ("kspec.call norm_act.fwd (allocated)", lambda: kspec.call("norm_act.fwd", x, w, None, **nm)),
        ("kspec.ops.norm_act (no grad)", lambda: kspec.ops.norm_act(x, w, None, norm="rmsnorm")),
        ("kspec.ops.norm_act (input requires grad)", lambda: kspec.ops.norm_act(xg, w, None, norm="rmsnorm")),
        ("kspec.ops.selective_scan_fn [1, 16, 32] (no grad)",
         lambda: kspec.ops.selective_scan_fn(u, delta, A, B, C, D, delta_softplus=True)),
        ("kspec.ops.selective_scan_fn (input requires grad)",
         lambda: kspec.ops.selective_scan_fn(ug, delta, A, B, C, D, delta_softplus=True)),
        ("kspec.ops.linear [4, 256] x [256, 256] (no grad)", lambda: kspec.ops.linear(lx, lw, lb)),
        ("kspec.ops.linear (input requires grad)", lambda: kspec.ops.linear(lxg, lw, lb)),
        ("norm_act fwd+bwd step [4, 256]", norm_step),
        ("linear relu fwd+bwd step", linear_step),
        ("scan fwd+bwd step (2, 4096, 333)", scan_step),
        # issue 34's decode shape (T 8, n 4, D 4096, bf16), without grad as a decode step runs, and with
        ("torch.rms_norm [8, 16384] (no grad, CPU: a peer only in kind)", no_grad(lambda: torch.rms_norm(
            hx.view(8, -1), (hn * hd,), hw, 1e-6))),
        ("kspec.call mhc.pre.fwd (no grad, 6 outputs)", no_grad(lambda: kspec.call("mhc.pre.fwd", hx, phi, alpha,
                                                                                  hbias, None))),
        ("kspec.call mhc.post.fwd (no grad, 1 output)", no_grad(lambda: kspec.call("mhc.post.fwd", hx, hf, h_post,
                                                                                  h_res))),
        ("kspec.ops.mhc_pre T=8 n=4 D=4096 (no grad)", no_grad(lambda: kspec.ops.mhc_pre(hx, phi, alpha, hbias))),
        ("kspec.ops.mhc_pre (input requires grad)", lambda: kspec.ops.mhc_pre(hxg, phi, alpha, hbias)),
    ]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--cuda-include", default=os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include"))
    p.add_argument("--row", default="", help="only the rows whose name contains this")
    p.add_argument("--profile", action="store_true", help="each row's Python functions by own time")
    p.add_argument("--callgrind", action="store_true", help="instructions per call under valgrind's callgrind")
    p.add_argument("--count", action="store_true", help=argparse.SUPPRESS)  # the run under callgrind
    a = p.parse_args()
    if a.callgrind:
        callgrind([arg for arg in sys.argv[1:] if arg != "--callgrind"], a.calls)
        return
    mock, shim = build(a.cuda_include)
    lib = counter_lib(shim) if a.count else None
    select(mock)
    import kspec
    import kspec._torch  # noqa: F401  (loads the extension)

    install_shim(shim)
    if a.count:
        instructions(lambda: None, a.calls, lib, "empty")
        for name, fn in rows():
            if a.row in name:
                instructions(fn, a.calls, lib, name)
        return
    print(f"kspec {kspec.__file__}: median host µs of {a.calls} calls (CPU, mock driver), Python calls per call")
    for name, fn in rows():
        if a.row not in name:
            continue
        fn()  # compiles on first use
        us = host_us(fn, a.calls if "step" not in name else max(a.calls // 10, 20))
        print(f"{name:52s} {us:9.1f} {py_calls(fn, profile=a.profile):9.1f}")


if __name__ == "__main__":
    main()
