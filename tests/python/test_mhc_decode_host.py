"""What a warm kspec.ops.mhc_pre call does on the host at issue 34's decode shape (T 8, n 4, D 4096, bf16), on
the mock CUDA driver (tests/mock_cuda through tools/bench/dispatch_host.py: CPU tensors through the torch
extension and kspec::call, kernels compiled but not run), with algo=decode routed in by a tuning database of the
process's own (tools/bench/dispatch.py --mhc-decode's way): without a gradient, one launch and the four public
outputs as the only allocations (save_stats=False: no inv, no h); with one, one launch too; the counters'
buffer allocated and zeroed once, at the first call on the stream, never per call."""
import pytest

from helpers import run_on_mock_driver

torch = pytest.importorskip("torch")

_BODY = r"""
import collections, ctypes, json
import torch, kspec, kspec._torch
from torch.profiler import ProfilerActivity, profile
dh.install_shim(shim)
import dispatch
folder = dispatch._own_tuning_db()
problem = dict(dtype="bf16", T=8, n=4, D=4096)
dispatch._decode_tuned(folder, [("mhc.pre.fwd", (), dict(problem, save_stats=False)), ("mhc.pre.fwd", (), problem)])
lib = ctypes.CDLL(mock)
lib.kspec_mock_count.restype = ctypes.c_longlong
lib.kspec_mock_count.argtypes = [ctypes.c_char_p]
DRIVER = ("launches", "allocs", "frees", "syncs", "memsets")

def counts():
    return {k: lib.kspec_mock_count(k.encode()) for k in DRIVER}

T, n, D, M = 8, 4, 4096, 24
x = torch.randn(T, n, D, dtype=torch.bfloat16)
phi, alpha, bias, gamma = torch.randn(M, n * D) / 128, torch.tensor([0.7, -0.5, 1.3]), torch.randn(M), torch.randn(n * D)
xg = x.clone().requires_grad_()

def pre():
    with torch.no_grad():
        return kspec.ops.mhc_pre(x, phi, alpha, bias, gamma)

result = {"config": kspec.explain("mhc.pre.fwd", save_stats=False, **problem).config}
first = counts()
pre()
result["first"] = {k: v - first[k] for k, v in counts().items()}
for name, fn in (("no_grad", pre), ("grad", lambda: kspec.ops.mhc_pre(xg, phi, alpha, bias, gamma))):
    for _ in range(3):
        fn()
    before = counts()
    for _ in range(4):
        fn()
    result[name] = {k: (v - before[k]) / 4 for k, v in counts().items()}
with profile(activities=[ProfilerActivity.CPU]) as prof:
    pre()
result["aten"] = dict(collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::")))
result["outputs"] = [tuple(t.shape) for t in pre()]
print(json.dumps(result))
print("ok")
"""


def test_warm_decode_call_is_one_launch_and_four_allocations():
    r = run_on_mock_driver(_BODY)
    import json

    got = json.loads(r.stdout.strip().splitlines()[-2])
    assert got["config"] == "algo=4,threads=256,tokens=1", got
    # the stream's counters and partial sums: one buffer, its counters zeroed once
    assert got["first"] == {"launches": 1, "allocs": 1, "frees": 0, "syncs": 0, "memsets": 1}, got["first"]
    once = {"launches": 1, "allocs": 0, "frees": 0, "syncs": 0, "memsets": 0}
    assert got["no_grad"] == once and got["grad"] == once, got
    assert got["aten"] == {"aten::empty": 4}, got["aten"]  # y, h_pre, h_post, r
    assert got["outputs"] == [[8, 4096], [8, 4], [8, 4], [8, 4, 4]], got["outputs"]
