"""kspec.call as the torch extension's vectorcall entry (kspec._torch_ext.kspec_call, issue 28's host path): it is
kspec.call where the extension is loaded, gives what the Python kspec.call gave (the given outputs as a tuple,
the allocated ones with the op's shapes and dtypes, the same exceptions and messages), hands what it does not take
(a config, an op given twice, a param of a type it does not read, another framework) to the Python function, and
allocates its outputs as at::empty would (NaN-filled under torch's deterministic fill). Without a GPU: CPU tensors
reach kspec's validation, and on the mock driver (tools/bench/dispatch_host.py) the whole host path runs."""
import sys

import pytest

torch = pytest.importorskip("torch")
import kspec  # noqa: E402
from kspec import _C, _core, _native  # noqa: E402
from helpers import run_on_mock_driver  # noqa: E402
from test_torch_ext import _outcome  # noqa: E402

needs_ext = pytest.mark.skipif(_native.ext is None, reason="the torch extension is not loaded")


@needs_ext
def test_kspec_call_is_the_entry_and_the_pure_path_restores_the_python_function():
    assert kspec.call is _native.ext.kspec_call and _core.call is kspec.call
    saved = _core._call_torch, _core._call_some, _core.call
    try:
        _core.use_torch_ext(_C.call_torch)
        assert kspec.call is _core._call_python and _core.call is _core._call_python
    finally:
        _core.use_torch_ext(*saved)
    assert kspec.call is _native.ext.kspec_call


@needs_ext
def test_what_the_entry_declines_raises_what_the_python_function_raises():
    """Each call through the entry against the same call of kspec._core._call_python (the Python kspec.call):
    same exception type and message, for what the entry hands over and for what it raises itself."""
    bf = torch.bfloat16
    x, w = torch.zeros(4, 256, dtype=bf), torch.ones(256, dtype=bf)
    y, m, r = torch.empty(4, 256, dtype=bf), torch.empty(4), torch.empty(4)
    made = "".join(["e", "p", "s"])  # a keyword name made at run time: not interned
    calls = {
        "no op": ((), {}),
        "op not a str": ((1, x, w, None), {}),
        "op twice": (("norm_act.fwd", x, w, None), {"op": "gemm"}),
        "config given": (("norm_act.fwd", x, w, None), {"config": "rows_per_block=1"}),
        "config None": (("norm_act.fwd", x, w, None), {"config": None}),
        "host tensors": (("norm_act.fwd", x, w, None), {"norm": "rmsnorm"}),
        "out given": (("norm_act.fwd", x, w, None), {"out": (y, m, r)}),
        "out a list": (("norm_act.fwd", x, w, None), {"out": [y, m, r]}),
        "out not a sequence": (("norm_act.fwd", x, w, None), {"out": y}),
        "param of a type it does not read": (("norm_act.fwd", x, w, None), {"eps": [1e-5]}),
        "param named at run time": (("norm_act.fwd", x, w, None), {made: float("nan")}),
        "unknown param": (("norm_act.fwd", x, w, None), {"bogus": 1}),
        "no tensor": (("norm_act.fwd", None, None, None), {}),
        "not a tensor": (("norm_act.fwd", [1.0], w, None), {}),
        "unknown op": (("no_such.op", x, w, None), {}),
    }
    for name, (args, kwargs) in calls.items():
        for _ in range(2):
            got = _outcome(lambda: kspec.call(*args, **kwargs))
            want = _outcome(lambda: _core._call_python(*args, **kwargs))
            assert got == want, (name, got, want)
            assert got[0] != "no error", name


def test_entry_on_the_mock_driver():
    """The whole host path on the mock driver: kspec.call runs with no Python frame of kspec's (one C++ call),
    returns the given outputs themselves as a tuple (out= a tuple or a list), allocates the rest with the op's
    shapes and dtypes, contiguous, on the inputs' device; a keyword name made at run time is a param like any;
    under torch's deterministic fill the allocated outputs are NaN (at::empty's fill: the mock's launch writes
    nothing); calls from four threads at once each get their own shapes."""
    run_on_mock_driver("""
import threading, torch, kspec, kspec._torch
from kspec import _native
dh.install_shim(shim)
assert kspec.call is _native.ext.kspec_call
bf = torch.bfloat16
x, w = torch.randn(4, 256, dtype=bf), torch.ones(256, dtype=bf)
nm = dict(norm="rmsnorm", act="identity", eps=1e-5)
kspec.call("norm_act.fwd", x, w, None, **nm)  # compiles
frames = []
def hook(frame, event, arg):
    if event == "call" and "kspec" in frame.f_code.co_filename:
        frames.append(frame.f_code.co_name)
sys.setprofile(hook)
y, mean, rstd = kspec.call("norm_act.fwd", x, w, None, **nm)
sys.setprofile(None)
assert frames == [], frames
assert y.shape == (4, 256) and y.dtype == bf and mean.shape == (4,) and rstd.dtype == torch.float32
assert all(t.is_contiguous() and t.device == x.device for t in (y, mean, rstd))
outs = (torch.empty(4, 256, dtype=bf), torch.empty(4), torch.empty(4))
for given in (outs, list(outs)):
    got = kspec.call("norm_act.fwd", x, w, None, out=given, **nm)
    assert type(got) is tuple and all(a is b for a, b in zip(got, outs)), got
made = "".join(["e", "p", "s"])
assert kspec.call("norm_act.fwd", x, w, None, norm="rmsnorm", act="identity", **{made: 1e-5})[0].shape == (4, 256)
(y2,) = kspec.call("norm_act.fwd", x, w, None, save_stats=False, **nm)[:1]
torch.use_deterministic_algorithms(True)
torch.utils.deterministic.fill_uninitialized_memory = True
try:
    y3, mean3, rstd3 = kspec.call("norm_act.fwd", x, w, None, **nm)
    assert y3.isnan().all() and mean3.isnan().all() and rstd3.isnan().all()
finally:
    torch.use_deterministic_algorithms(False)
failures = []
def worker(rows):
    xr = torch.randn(rows, 256, dtype=bf)
    for _ in range(100):
        y, mean, rstd = kspec.call("norm_act.fwd", xr, w, None, **nm)
        if y.shape != (rows, 256) or mean.shape != (rows,):
            failures.append((rows, y.shape))
threads = [threading.Thread(target=worker, args=(rows,)) for rows in (1, 2, 3, 5)]
for t in threads:
    t.start()
for t in threads:
    t.join(timeout=120)
assert not failures and not any(t.is_alive() for t in threads), failures[:3]
print("ok")
""")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
