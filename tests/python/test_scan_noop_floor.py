"""The floors a selective_scan training step's host time is read against (issue 33 item 4): kspec._torch_ext.noop_grad,
an output like inputs[0] whose C++ node allocates a gradient like each input that wants one and runs nothing (the
floor of call_grad's step, whose node is a C++ one too), and tools/bench/selective_scan_host.py's rows on the mock
driver (each path's step once, the C++ floor's among them)."""
import pytest

from helpers import run_on_mock_driver

torch = pytest.importorskip("torch")
import kspec._torch  # noqa: E402,F401  (loads the extension)
from kspec import _native  # noqa: E402


def _noop_grad():
    if _native.ext is None:
        pytest.skip("needs the torch extension")
    return _native.ext.noop_grad


def test_noop_grad_allocates_the_gradients_its_inputs_want():
    noop = _noop_grad()
    u = torch.randn(2, 3, 5, dtype=torch.bfloat16, requires_grad=True)
    A = torch.randn(3, 4, requires_grad=True)
    frozen = torch.randn(3)  # no gradient wanted: none made
    y = noop((u, A, None, frozen))
    assert y.shape == u.shape and y.dtype == u.dtype and y.grad_fn.name() == "NoopBackward"
    y.backward(torch.ones_like(y))
    assert u.grad.shape == u.shape and u.grad.dtype == torch.bfloat16
    assert A.grad.shape == A.shape and A.grad.dtype == torch.float32
    assert frozen.grad is None
    # torch.autograd.grad's inputs: only the one asked for
    y = noop((u, A))
    (gA,) = torch.autograd.grad(y, (A,), torch.ones_like(y))
    assert gA.shape == A.shape


def test_noop_grad_refuses_what_is_not_a_tuple_of_tensors():
    noop = _noop_grad()
    for bad in ((), [torch.ones(1)], (None, torch.ones(1)), (torch.ones(1), 3), None, 3):
        with pytest.raises(TypeError, match="noop_grad"):
            noop(bad)


_ROWS = """
import torch
import kspec, kspec._torch
dh.install_shim(shim)
sys.path.insert(0, gpu_tools)
import selective_scan_host as sh
leaves = sh._leaves(torch, 1, 16, 32)
dout = torch.randn(1, 16, 32, dtype=torch.bfloat16)
rows = sh.step_rows(torch, leaves, dout)
assert "no-op C++ node" in rows and "bare backward (one view, 1 element)" in rows, list(rows)
for name, (enter, leave, fwd, bwd) in rows.items():
    enter()
    try:
        for v in leaves:
            v.grad = None
        bwd(fwd())
    finally:
        leave()
    if "bare" not in name:
        assert all(v.grad is not None and v.grad.shape == v.shape for v in leaves), name
print("ok")
"""


def test_selective_scan_host_rows_run_on_the_mock_driver():
    run_on_mock_driver(_ROWS)


_TORCH_PROFILE = """
import torch
import kspec, kspec._torch
dh.install_shim(shim)
sys.path.insert(0, gpu_tools)
import profile_scan_host as ph
ph.torch_profile_shape("1x16x32", steps=3, dev="cpu")
print("ok")
"""


def test_torch_profile_runs_on_the_mock_driver():
    """profile_scan_host.py --torch-profile's rows (kspec's step and the C++ floor's under torch.profiler), CPU only."""
    r = run_on_mock_driver(_TORCH_PROFILE)
    assert "torch-profile kspec selective_scan_fn: host" in r.stdout and "torch-profile no-op C++ node: host" in r.stdout
