"""selective_scan with a gradient wanted as one C++ call (kspec._torch_ext.call_grad: the forward op, its
outputs allocated in C++ — `states` sized from the inputs by the family's CeilDiv rule — and a C++ graph node
whose backward runs selective_scan.bwd without a Python frame). Without a GPU: the plan resolved from the
Family, and the whole host path on the mock CUDA driver (tools/bench/dispatch_host.py: CPU tensors through
kspec::call, kernels compiled, launches counted, nothing computed). The GPU twin, which compares the node's
outputs and gradients with the autograd.Function's, is test_gpu_scan_one_call.py."""
import json
import os

import pytest

torch = pytest.importorskip("torch")
from kspec import _surface, _torch  # noqa: E402
try:  # the shared helper (h-dup11 moved test_scan_host_counts' runner into helpers.py); this branch's own copy before
    from helpers import run_on_mock_driver as _run_on_mock  # noqa: E402
except ImportError:
    from test_scan_host_counts import _run_on_mock  # noqa: E402


def test_scan_grad_call_plan():
    """The Family's spec resolved once: the registry's params only (save_states is no param of
    selective_scan.fwd: the saving forward is what `sized` allocates), the backward's arguments (dout
    required, dlast_state optional, the saved inputs, states as forward output 2), a gradient per input,
    and states [batch, dim, ceil(seqlen / 16), dstate] from u's dims 0-2 and A's dim 1."""
    s = _torch.selective_scan
    fwd_op, bwd_op, names, pick, bwd_params, codes, grad_of = s.grad_call
    assert (fwd_op, bwd_op) == ("selective_scan.fwd", "selective_scan.bwd")
    assert names == ("delta_softplus",) and bwd_params == ("delta_softplus",)
    assert pick(tuple(range(9)) + (True, False)) == (True,)
    assert codes == (2000, 0, 1, 2, 3, 4, 5, 6, 7, 8, 3001, 1002) and grad_of == tuple(range(9))
    assert s.grad_sized == (None, None, ((0, 0, 1), (0, 1, 1), (0, 2, 16), (2, 1, 1)))
    assert _torch.norm_act.grad_sized is None  # no output with a dim no input binds


def test_ceil_div_is_a_derived_rule():
    rule = _surface.CeilDiv("seqlen", 16)
    assert [rule({"seqlen": t}) for t in (1, 16, 17, 333, 512)] == [1, 1, 2, 21, 32]
    assert _torch.selective_scan.family.derived["nstates"] == rule


def test_one_call_refuses_what_it_cannot_size_or_pass():
    """A one_call family whose derived dim is a plain function, or whose forward has an argument that is neither
    a param of its op nor the save_arg, is refused when it is built (not at its first call)."""
    f = _torch.selective_scan.family
    with pytest.raises(ValueError, match="CeilDiv"):
        _surface.Surface(_surface.replace(f, name="test_scan_lambda_rule",
                                          derived={"nstates": lambda dims: -(-dims["seqlen"] // 16)}))
    with pytest.raises(ValueError, match=r"no param of selective_scan.fwd \(chunk\)"):
        _surface.Surface(_surface.replace(f, name="test_scan_extra_arg", fwd=f.fwd + ", int chunk=1"))


_BODY = r"""
import collections, json
import torch, kspec, kspec._torch
from torch.profiler import ProfilerActivity, profile
from kspec import _native, _torch
dh.install_shim(shim)
lib = ctypes.CDLL(mock)
lib.kspec_mock_count.restype = ctypes.c_longlong
lib.kspec_mock_count.argtypes = [ctypes.c_char_p]
launches = lambda: lib.kspec_mock_count(b"launches")
res = {}
b, d, t, n, bf = 2, 64, 40, 16, torch.bfloat16
base = [torch.randn(b, d, t, dtype=bf), torch.rand(b, d, t, dtype=bf), -torch.rand(d, n),
        torch.randn(b, 1, n, t, dtype=bf), torch.randn(b, 1, n, t, dtype=bf), torch.randn(d),
        torch.randn(b, d, t, dtype=bf), torch.randn(d) * 0.1, torch.randn(b, d, n)]

def leaves(wanted=(True,) * 9):
    return [v.clone().requires_grad_(w) for v, w in zip(base, wanted)]

sys.path.insert(0, TESTS)
from test_host_path import frames

def kspec_frames(fn):
    return frames(fn, kspec_only=True)

def aten(fn):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return dict(collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::")))

# 1. a training step: one C++ node, the backward without Python, a gradient per input (h0's too)
x = leaves()
out, last = kspec.ops.selective_scan_fn(*x[:8], True, return_last_state=True, h0=x[8])
node = out.grad_fn
res["node"] = [node.name(), type(node).__name__, isinstance(node, torch.autograd.function.BackwardCFunction),
               last.grad_fn is node]
before = launches()
bwd_frames = kspec_frames(lambda: out.backward(torch.randn_like(out)))
res["bwd_frames"], res["bwd_launches"] = bwd_frames, launches() - before
res["grads"] = [v.grad is not None and v.grad.shape == v.shape and v.grad.dtype == v.dtype for v in x]
x = leaves()
res["fwd_frames"] = kspec_frames(lambda: kspec.ops.selective_scan_fn(*x[:8], True))

# 2. what the step allocates: out, last_state, states, then the 8 gradients; no zeros for the unused last_state
x = leaves()
dout = torch.randn(b, d, t, dtype=bf)
def step():
    for v in x:
        v.grad = None
    kspec.ops.selective_scan_fn(*x[:8], True).backward(dout)
step()
res["step_aten"] = aten(step)
# only last_state used: dout zeros (its argument is a required Tensor); a broadcast dlast_state made contiguous
def last_only():
    kspec.ops.selective_scan_fn(*x[:8], True, return_last_state=True)[1].sum().backward()
last_only()
res["last_only_aten"] = aten(last_only)
# a non-contiguous dout (a transposed view): made contiguous in C++
x = leaves()
o = kspec.ops.selective_scan_fn(*x[:8], True)
o.backward(torch.randn(b, t, d, dtype=bf).transpose(1, 2))
res["transposed_dout"] = all(v.grad is not None for v in x[:8])

# 3. gradients only for the inputs that want them; the saved tensors go with the first backward
x = leaves((True, False, False, True, False, False, False, False, False))
o = kspec.ops.selective_scan_fn(*x[:8], True)
gu, gB = torch.autograd.grad(o, (x[0], x[3]), torch.ones_like(o), retain_graph=True)
res["partial"] = [gu.shape == x[0].shape, gB.shape == x[3].shape, o.grad_fn.name()]
o.backward(torch.ones_like(o))
try:
    o.backward(torch.ones_like(o))
    res["second_backward"] = "no error"
except RuntimeError as e:
    res["second_backward"] = str(e)

# 4. save_states=False keeps the record node (its backward recomputes the states); the pure path's
# Function without the extension
x = leaves()
o = kspec.ops.selective_scan_fn(*x[:8], True, save_states=False)
res["no_states"] = [o.grad_fn.name(), "_native_backward" in kspec_frames(lambda: o.sum().backward())]

# 5. bad input with a gradient wanted: kspec.call's own error, nothing recorded
def error(fn):
    try:
        fn()
    except Exception as e:
        return type(e).__name__ + ": " + str(e).splitlines()[0]
    return None
x = leaves()
bad_A = -torch.rand(d + 1, n, requires_grad=True)
got = error(lambda: kspec.ops.selective_scan_fn(x[0], x[1], bad_A, x[3], x[4], delta_softplus=True))
want = error(lambda: kspec.call("selective_scan.fwd", x[0].detach(), x[1].detach(), bad_A.detach(), x[3].detach(),
                                x[4].detach(), delta_softplus=True))
res["bad_A"] = [got, want]
short = torch.randn(b, d, dtype=bf, requires_grad=True)  # 2-d u: `sized` declines, kspec.call's path judges it
got = error(lambda: kspec.ops.selective_scan_fn(short, x[1], x[2], x[3], x[4], delta_softplus=True))
res["short_u"] = got
print(json.dumps(res))
print("ok")
"""


def test_scan_step_is_one_cpp_call_on_the_mock_driver():
    r = _run_on_mock(_BODY, f"TESTS = {os.path.dirname(os.path.abspath(__file__))!r}\n")
    got = json.loads(r.stdout.strip().splitlines()[-2])
    name, kind, is_function, shared = got["node"]
    assert name == "SelectiveScanBackward" and kind != "BackwardCFunction" and not is_function and shared, got["node"]
    # the backward: no Python of kspec's at all, and the backward's kernels launched (main and reduce at least)
    assert got["bwd_frames"] == [] and got["bwd_launches"] >= 2, got
    assert all(got["grads"]), got["grads"]
    # the forward's Python: the wrapper (its contiguity pass) and the surface's entry, nothing per output
    # (Python 3.12 inlines list comprehensions: no "<listcomp>" frame there)
    assert [f for f in got["fwd_frames"] if f != "<listcomp>"] == ["selective_scan_fn", "_is_torch", "__call__"], \
        got["fwd_frames"]
    # out, last_state, states and the 8 gradients; no zeros, fill, copy or clone (the unused last_state's
    # gradient is no tensor: the backward reads dlast_state as absent)
    assert {k: v for k, v in got["step_aten"].items() if k != "aten::detach"} == {"aten::empty": 11}, got["step_aten"]
    # the unused out's gradient as zeros, the broadcast dlast_state made contiguous
    last_only = got["last_only_aten"]
    assert last_only.get("aten::zeros", 0) + last_only.get("aten::zeros_like", 0) >= 1, last_only
    assert last_only.get("aten::contiguous", 0) + last_only.get("aten::clone", 0) >= 1, last_only
    assert got["transposed_dout"]
    assert got["partial"] == [True, True, "SelectiveScanBackward"]
    assert "retain_graph=True" in got["second_backward"], got["second_backward"]
    assert got["no_states"] == ["SelectiveScanBackward", True], got["no_states"]
    bad, want = got["bad_A"]
    assert bad == want and bad is not None and "'A'" in bad, got["bad_A"]
    assert got["short_u"] is not None and "selective_scan.fwd" in got["short_u"] and "'u'" in got["short_u"], got
