"""The torch C++ extension (kspec._torch_ext, loaded by kspec._native) without a GPU: it is built and
loaded where torch is; every registry op a torch surface uses is a dispatcher op (kspec_ops::*) whose
schema is op_info's; kspec.call through it and the dispatcher ops raise the pure path's exceptions with
its messages (CPU tensors reach kspec's validation), from several threads at once too; torch.compile
traces them into one graph with no recompile for a second shape; KSPEC_TORCH_EXT=off keeps the pure
path. Outputs and gradients on a GPU: test_gpu_torch_ext.py."""
import os
import subprocess
import sys
import threading

import pytest

from helpers import run_on_mock_driver

torch = pytest.importorskip("torch")
import kspec  # noqa: E402
from kspec import _C, _core, _native, _surface  # noqa: E402
from kspec._core import _call_general  # noqa: E402

needs_ext = pytest.mark.skipif(_native.ext is None, reason="KSPEC_TORCH_EXT is off")


def _outcome(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 (any exception is the outcome compared)
        return type(e).__name__, str(e)
    return "no error", ""


def test_extension_is_built_and_loaded_where_torch_is():
    if os.environ.get("KSPEC_TORCH_EXT", "on").lower() in ("off", "0", "false", "no"):
        pytest.skip("KSPEC_TORCH_EXT is off")
    from kspec import _torch_ext

    assert _native.ext is _torch_ext
    assert _core._call_torch is _torch_ext.call


@needs_ext
def test_every_surface_op_is_a_dispatcher_op_with_its_op_info_schema():
    ops = [op for s in _surface.FAMILIES.values() for op in s.family.ops]
    assert len(ops) >= 8 and set(ops) == set(_native.defined())
    for op in ops:
        info = _C.op_info(op)
        overload = getattr(torch.ops.kspec_ops, op.replace(".", "_")).default
        assert overload is _native.defined()[op]
        args = overload._schema.arguments
        tensors = [a for a in args if not a.kwarg_only]
        params = [a for a in args if a.kwarg_only]
        assert [a.name for a in tensors] == [d["name"] for d in info["inputs"]], op
        assert [str(a.type) for a in tensors] == ["Optional[Tensor]" if d["optional"] else "Tensor"
                                                  for d in info["inputs"]], op
        kinds = {"int": "int", "float": "float", "bool": "bool", "choice": "str"}
        assert [a.name for a in params] == [p["name"] for p in info["params"]], op
        assert [str(a.type) for a in params] == [f"Optional[{kinds[p['type']]}]" for p in info["params"]], op
        assert all(a.default_value is None for a in params), op
        assert len(overload._schema.returns) == len(info["outputs"]), op


def _bad_calls():
    """(op, inputs, out, params) of calls kspec refuses, on CPU tensors (the first refusal of each is not
    the host-memory one where validation checks something else first)."""
    bf, f32 = torch.bfloat16, torch.float32
    x, w = torch.zeros(4, 256, dtype=bf), torch.ones(256, dtype=bf)
    y, m, r = torch.empty(4, 256, dtype=bf), torch.empty(4), torch.empty(4)
    return {
        "host tensor": ("norm_act.fwd", (x, w, None), None, {}),
        "host tensor, out given": ("norm_act.fwd", (x, w, None), (y, m, r), {}),
        "wrong dtype": ("norm_act.fwd", (x.int(), w, None), None, {}),
        "unsupported dtype": ("norm_act.fwd", (x.to(torch.complex64), w, None), None, {}),
        "wrong shape": ("norm_act.fwd", (x, w[:128], None), None, {}),
        "wrong rank": ("norm_act.fwd", (x, w.view(2, 128), None), None, {}),
        "row stride": ("norm_act.fwd", (torch.zeros(4, 512, dtype=bf)[:, ::2], w, None), None, {}),
        "misaligned": ("norm_act.fwd", (torch.zeros(4 * 256 + 1, dtype=bf)[1:].view(4, 256), w, None), None, {}),
        "missing input": ("norm_act.fwd", (x,), None, {}),
        "unknown param": ("norm_act.fwd", (x, w, None), None, {"bogus": 1}),
        "bad choice": ("norm_act.fwd", (x, w, None), None, {"norm": "batchnorm"}),
        "param type": ("norm_act.fwd", (x, w, None), None, {"eps": [1]}),
        "param range": ("norm_act.fwd", (x, w, None), None, {"eps": float("nan")}),
        "unknown op": ("no_such.op", (x, w, None), None, {}),
        "out not a sequence": ("norm_act.fwd", (x, w, None), y, {}),
        "out overlaps": ("norm_act.fwd", (x, w, None), (x, m, r), {}),
        "out wrong shape": ("norm_act.fwd", (x, w, None), (y[:, :128], m, r), {}),
        "out wrong dtype": ("norm_act.fwd", (x, w, None), (y, m.double(), r), {}),
        "out not a tensor": ("norm_act.fwd", (x, w, None), ("y", m, r), {}),
        "scan wrong shape": ("selective_scan.fwd", (torch.zeros(2, 8, 16), torch.zeros(2, 8, 16), torch.zeros(8, 4),
                                                    torch.zeros(2, 1, 4, 16), torch.zeros(2, 1, 4, 15), None, None,
                                                    None, None), None, {}),
        "gemm k mismatch": ("gemm", (torch.zeros(4, 64, dtype=f32), torch.zeros(32, 48, dtype=f32), None), None, {}),
    }


@needs_ext
def test_extension_errors_match_the_pure_path():
    """kspec.call through the extension (and, where the call fits a schema, the dispatcher op) raises
    the pure path's exception type and message, twice (nothing about a failed call is cached); the
    extension itself handles all but the objects it declines (a complex dtype, a list param)."""
    declined = {"unsupported dtype", "param type", "out not a sequence", "out not a tensor"}
    for name, (op, ins, out, params) in _bad_calls().items():
        for _ in range(2):
            ext = _outcome(lambda: kspec.call(op, *ins, out=out, **params))
            pure = _outcome(lambda: _call_general(op, ins, None, out, params))
            assert ext == pure, (name, ext, pure)
            assert ext[0] in ("InvalidArgument", "Unsupported", "TypeError"), (name, ext)
            assert op in ext[1] or name == "param type", (name, ext)  # a message naming the op
        if name in declined:
            assert _native.ext.call(op, ins, out, params) is NotImplemented, name
        else:  # raised by the extension itself, not by the general path after it declined
            assert _outcome(lambda: _native.ext.call(op, ins, out, params)) == pure, name
        if out is None and op != "no_such.op" and name not in ("missing input", "unknown param", "param type"):
            native = _outcome(lambda: _native.defined()[op](*ins, **params))
            assert native == pure, (name, native, pure)


@needs_ext
def test_a_cpu_tensor_to_a_cuda_op_is_refused_clearly():
    x, w = torch.zeros(4, 256), torch.ones(256)
    msg = "input 'x': expected a CUDA tensor, got one in host memory"
    with pytest.raises(kspec.InvalidArgument, match=msg):
        kspec.call("norm_act.fwd", x, w, None)
    with pytest.raises(kspec.InvalidArgument, match=msg):
        torch.ops.kspec_ops.norm_act_fwd(x, w, None, norm="rmsnorm")
    with pytest.raises(kspec.InvalidArgument, match=msg):
        kspec.ops.norm_act(x, w, None)


@needs_ext
def test_errors_stay_with_their_thread():
    """kspec's error is kept per thread between the C ABI's call and its raise: four threads refused with
    different messages at once each get their own."""
    failures = []

    def worker(rows):
        x, w = torch.zeros(rows, 256), torch.ones(256)
        for _ in range(200):
            try:
                kspec.call("norm_act.fwd", x, w, None)
                failures.append((rows, "no error"))
            except kspec.InvalidArgument as e:
                if f"[{rows}, 256]" not in str(e):
                    failures.append((rows, str(e)))

    threads = [threading.Thread(target=worker, args=(rows,)) for rows in (1, 2, 3, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert not failures, failures[:3]


def _fake_backend(graphs):
    """A torch.compile backend that records the graph and runs it on fake tensors (the fake kernels), then
    returns empty tensors of their shapes: the graph is what is tested here, the kernels need a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def backend(gm, example_inputs):
        graphs.append(gm)

        def run(*args):
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                outs = gm(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
            return [torch.empty(o.shape, dtype=o.dtype) for o in outs]
        return run
    return backend


def _targets(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


@needs_ext
def test_compile_traces_dispatcher_ops_in_one_graph_without_recompiling():
    graphs = []

    def fn(x, w):
        y, mean, rstd = torch.ops.kspec_ops.norm_act_fwd(x, w, None, norm="rmsnorm", act="silu")
        return y * 2, mean

    compiled = torch.compile(fn, backend=_fake_backend(graphs), fullgraph=True, dynamic=True)
    for rows in (6, 10):
        y, mean = compiled(torch.zeros(rows, 256), torch.ones(256))
        assert y.shape == (rows, 256) and mean.shape == (rows,) and mean.dtype == torch.float32
    assert len(graphs) == 1, "a second shape recompiled"
    assert any(t.startswith("kspec_ops.norm_act_fwd") for t in _targets(graphs[0]))


@needs_ext
def test_compile_traces_the_public_ops_in_one_graph():
    graphs = []

    def fn(x, w, wl):
        return kspec.ops.linear(kspec.ops.norm_act(x, w, None, norm="rmsnorm"), wl, None)

    compiled = torch.compile(fn, backend=_fake_backend(graphs), fullgraph=True, dynamic=True)
    # floats stay constants (not lifted to 0-d tensor inputs the fake backend would have to read)
    with torch._dynamo.config.patch(specialize_float=True):
        for rows in (6, 10):
            assert compiled(torch.zeros(rows, 256), torch.ones(256), torch.zeros(64, 256)).shape == (rows, 64)
    assert len(graphs) == 1
    targets = _targets(graphs[0])
    assert any(t.startswith("kspec.norm_act_fwd") for t in targets)
    assert any(t.startswith("kspec.linear_fwd") for t in targets)


@pytest.mark.parametrize("value,loaded", [("off", False), ("0", False), ("on", True)])
def test_knob_chooses_the_pure_path(value, loaded):
    code = ("import torch, kspec; from kspec import _C, _core, _native\n"
            "print(_native.ext is not None, _core._call_torch is not _C.call_torch, len(_native.defined()))\n"
            "try:\n    kspec.call('norm_act.fwd', torch.zeros(4, 256), torch.ones(256), None)\n"
            "except kspec.InvalidArgument as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, KSPEC_TORCH_EXT=value))
    assert r.returncode == 0, r.stderr
    first, msg = r.stdout.splitlines()[:2]
    if loaded and _native.ext is None and os.environ.get("KSPEC_TORCH_EXT") is None:
        pytest.skip("the extension is not built")
    if loaded:  # every Family op a dispatcher op: as many as this process has, when its extension is on
        ext_on, fast, count = first.split()
        assert (ext_on, fast) == ("True", "True") and int(count) == (len(_native.defined()) or int(count)) > 0, first
    else:
        assert first == "False False 0"
    assert "input 'x': expected a CUDA tensor, got one in host memory" in msg  # the same error either way


def test_bad_knob_value_is_named():
    r = subprocess.run([sys.executable, "-c", "import torch, kspec"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, KSPEC_TORCH_EXT="sometimes"))
    assert r.returncode != 0
    assert "KSPEC_TORCH_EXT" in r.stderr and "'sometimes'" in r.stderr


@needs_ext
def test_eager_node_in_cpp_gives_the_functions_gradients(monkeypatch):
    """With a gradient wanted the eager path records one C++ node (kspec._torch_ext.record) instead of the
    autograd.Function: the same outputs and gradients (the kernels stood in for by the float64
    reference on CPU, as in test_surface.py), saved statistics that a second backward needs
    retain_graph for, and no gradient for an input that wants none."""
    from kspec import _torch
    from test_surface import _reference_call

    monkeypatch.setattr(_torch, "call", _reference_call)
    monkeypatch.setattr(_surface, "call", _reference_call)
    monkeypatch.setattr(_torch.norm_act, "grad_call", None)  # the node of record(), not call_grad's
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 24, generator=g, dtype=torch.float64)
    w, b = torch.randn(24, generator=g, dtype=torch.float64), torch.randn(24, generator=g, dtype=torch.float64)
    dy = torch.randn(2, 5, 24, generator=g, dtype=torch.float64)

    ext = _native.ext
    function_node = torch.autograd.function.BackwardCFunction

    def run(wanted):
        leaves = [t.clone().requires_grad_(r) for t, r in zip((x, w, b), wanted)]
        y = kspec.ops.norm_act(*leaves, norm="layernorm", act="gelu_tanh")
        return y, torch.autograd.grad(y, [t for t in leaves if t.requires_grad], dy)

    for wanted in ((True, True, True), (False, True, False)):
        monkeypatch.setattr(_native, "ext", ext)
        y, grads = run(wanted)
        assert y.grad_fn.name() == "NormActBackward" and not isinstance(y.grad_fn, function_node)
        monkeypatch.setattr(_native, "ext", None)  # the autograd.Function path
        want_y, want_grads = run(wanted)
        assert isinstance(want_y.grad_fn, function_node)
        assert torch.equal(y, want_y)
        assert len(grads) == len(want_grads) and all(torch.equal(a, c) for a, c in zip(grads, want_grads))
    monkeypatch.setattr(_native, "ext", ext)
    xl = x.clone().requires_grad_()
    y = kspec.ops.norm_act(xl, w, b, norm="layernorm", act="gelu_tanh")
    torch.autograd.grad(y, xl, dy, retain_graph=True)
    torch.autograd.grad(y, xl, dy)
    with pytest.raises(RuntimeError, match="retain_graph=True"):
        torch.autograd.grad(y, xl, dy)


def test_norm_act_grad_call_plan():
    """norm_act's call_grad arguments, resolved from its Family: the backward op norm_act.bwd reads (dy, x,
    weight, bias, mean, rstd) = (the gradient of y, inputs 0-2, forward outputs 1 and 2) with the params
    norm, act and eps, and gives dx, dweight, dbias for x, weight, bias."""
    from kspec import _torch

    fwd_op, bwd_op, names, pick, bwd_params, codes, grad_of = _torch.norm_act.grad_call
    assert (fwd_op, bwd_op) == ("norm_act.fwd", "norm_act.bwd")
    assert names == ("norm", "act", "eps", "save_stats")
    assert pick((1, 2, 3, "rmsnorm", "silu", 1e-5, True)) == ("rmsnorm", "silu", 1e-5, True)
    assert bwd_params == ("norm", "act", "eps")
    assert codes == (2000, 0, 1, 2, 1001, 1002) and grad_of == (0, 1, 2)
    assert _torch.selective_scan.grad_call is None and _torch.linear_surface.grad_call is None


@pytest.mark.parametrize("node", ["cpp", "function"])
def test_scan_node_materializes_only_the_gradients_its_backward_requires(monkeypatch, node):
    """The scan's graph node (the extension's C++ node, or the autograd.Function without it): a last_state
    the caller did not use gets no zero-filled gradient (the backward takes dlast_state=None: no
    allocation, no fill kernel per training step), while an unused `out` still gets zeros (its dout is a
    required Tensor). The kernels stood in for by a stub that records what the backward was given."""
    from kspec import _torch

    if node == "cpp" and _native.ext is None:
        pytest.skip("KSPEC_TORCH_EXT is off")
    if node == "function":
        monkeypatch.setattr(_native, "ext", None)

    seen = []

    def stub(op, *inputs, out=None, **params):
        if op == "selective_scan.fwd":
            u, A = inputs[0], inputs[2]
            return out if out is not None else (torch.zeros_like(u), torch.zeros(*u.shape[:2], A.shape[1]), None)
        seen.append((inputs[0], inputs[10]))  # dout, dlast_state
        return tuple(None if t is None else torch.zeros_like(t) for t in inputs[1:10])

    monkeypatch.setattr(_torch, "call", stub)
    monkeypatch.setattr(_torch, "call_some", lambda *args: NotImplemented)
    b, d, t, n = 2, 4, 8, 16
    leaves = [torch.randn(b, d, t), torch.rand(b, d, t), -torch.rand(d, n), torch.randn(b, 1, n, t),
              torch.randn(b, 1, n, t)]
    leaves = [v.requires_grad_() for v in leaves]
    out, last = kspec.ops.selective_scan_fn(*leaves, delta_softplus=True, return_last_state=True)
    assert "SelectiveScanBackward" in out.grad_fn.name()
    out.sum().backward()
    dout, dlast = seen[-1]
    assert dout is not None and dlast is None
    out, last = kspec.ops.selective_scan_fn(*leaves, delta_softplus=True, return_last_state=True)
    last.sum().backward()
    dout, dlast = seen[-1]
    assert dlast is not None and dout is not None and dout.shape == out.shape and not dout.any()


# Python source a mock-driver body starts with: sys.setprofile(hook) collects the names of the kspec frames called
# (names) and of the builtins they call (builtins).
_KSPEC_FRAMES = """
names, builtins = [], []
def hook(frame, event, arg):
    if event == "call" and "kspec" in frame.f_code.co_filename:
        names.append(frame.f_code.co_name)
    if event == "c_call" and "kspec" in frame.f_code.co_filename:
        builtins.append(arg.__name__)
"""

def test_scan_host_path_on_the_mock_driver():
    """The extension's whole host path with no GPU (tools/bench/dispatch_host.py: CPU tensors through
    kspec::call into the mock CUDA driver): call_some allocates the outputs left None, keeps the one
    given, allocates one given as a shape with the op's dtype (and leaves a bad shape to the general
    path); a selective_scan_fn training step runs its forward and backward through kspec's launches."""
    run_on_mock_driver("""
import torch, kspec, kspec._torch
from kspec import _native
dh.install_shim(shim)
u, delta = torch.randn(2, 4, 40, dtype=torch.bfloat16), torch.rand(2, 4, 40, dtype=torch.bfloat16)
A = -torch.rand(4, 16)
B, C = torch.randn(2, 1, 16, 40, dtype=torch.bfloat16), torch.randn(2, 1, 16, 40, dtype=torch.bfloat16)
ins, p = (u, delta, A, B, C, None, None, None, None), dict(delta_softplus=True)
states = torch.empty(2, 4, 3, 16)
out, last, got = _native.ext.call_some("selective_scan.fwd", ins, (None, None, states), p)
assert got is states and out.shape == u.shape and out.dtype == u.dtype
assert last.shape == (2, 4, 16) and last.dtype == torch.float32
out, last, made = _native.ext.call_some("selective_scan.fwd", ins, (None, None, (2, 4, 3, 16)), p)
assert made.shape == (2, 4, 3, 16) and made.dtype == torch.float32 and last.shape == (2, 4, 16)
assert _native.ext.call_some("selective_scan.fwd", ins, (None, None, (2, -4)), p) is NotImplemented
leaves = [t.clone().requires_grad_() for t in (u, delta, A, B, C)]
kspec.ops.selective_scan_fn(*leaves, delta_softplus=True).sum().backward()
assert all(t.grad is not None and t.grad.shape == t.shape for t in leaves)
print("ok")
""")


def test_norm_act_with_grad_is_one_cpp_call_on_the_mock_driver():
    """kspec.ops.norm_act with a gradient wanted, through the whole host path on the mock driver: the forward
    is one C++ call (call_grad: no Python beyond the surface's entry), the backward runs no Python at all
    (the C++ node launches norm_act.bwd), the gradients have their inputs' shapes and dtypes (an fp32
    weight under a bf16 x), an absent bias gets none, the saved tensors go with the first backward, and a
    bad weight raises what kspec.call raises."""
    run_on_mock_driver("""
import torch, kspec, kspec._torch
dh.install_shim(shim)
x = torch.randn(4, 256, dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(256, requires_grad=True)
b = torch.randn(256, requires_grad=True)
kspec.ops.norm_act(x, w, b)  # compiles
sys.setprofile(hook)
y = kspec.ops.norm_act(x, w, b)
sys.setprofile(None)
assert names == ["norm_act", "_is_torch", "__call__"], names  # no helper frame around call_grad
assert "call_grad" in builtins, builtins
names.clear()
assert y.grad_fn.name() == "NormActBackward" and not isinstance(y.grad_fn, torch.autograd.function.BackwardCFunction)
dy = torch.randn(4, 256, dtype=torch.bfloat16)
names.clear()
sys.setprofile(hook)
dx, dw, db = torch.autograd.grad(y, (x, w, b), dy, retain_graph=True)
sys.setprofile(None)
assert not names, names
assert (dx.shape, dx.dtype, dw.shape, dw.dtype, db.shape, db.dtype) == (x.shape, x.dtype, w.shape, w.dtype, b.shape, b.dtype)
torch.autograd.grad(y, x, dy)
try:
    torch.autograd.grad(y, x, dy)
    raise SystemExit("a third backward ran")
except RuntimeError as e:
    assert "retain_graph=True" in str(e), e
y = kspec.ops.norm_act(x, w, None, norm="rmsnorm", act="silu")
gx, gw = torch.autograd.grad(y.sum(), (x, w))
assert gx.shape == x.shape and gw.shape == w.shape
def outcome(fn):
    try:
        fn()
    except Exception as e:
        return type(e).__name__, str(e)
bad = torch.randn(255, requires_grad=True)
got = outcome(lambda: kspec.ops.norm_act(x, bad, None))
want = outcome(lambda: kspec.call("norm_act.fwd", x.detach(), bad.detach(), None, norm="layernorm", act="none", eps=1e-5))
assert got == want and got is not None, (got, want)
print("ok")
""", _KSPEC_FRAMES)


def test_call_grad_returns_the_public_outputs_and_takes_names_and_values():
    """call_grad's `public` (an output index: that output alone; a tuple: those) and params as (names, values), the
    surface's form: the same y as the dict form's first output, a node that still saves mean and rstd (its
    backward runs), and the dict form's NotImplemented for a param value the C++ path does not read."""
    run_on_mock_driver("""
import torch, kspec, kspec._torch
from kspec import _native, _torch
dh.install_shim(shim)
ext = _native.ext
x = torch.randn(4, 256, requires_grad=True)
w = torch.randn(256, requires_grad=True)
fwd_op, bwd_op, names, pick, bwd_params, codes, grad_of = _torch.norm_act.grad_call
args = (x, w, None, "rmsnorm", "identity", 1e-5, True)
name, tensors = _torch.norm_act.node_name, _torch.norm_act.pick_tensors
every = ext.call_grad(name, fwd_op, bwd_op, tensors(args), dict(zip(names, pick(args))), bwd_params, codes, grad_of)
assert isinstance(every, tuple) and len(every) == 3
y = ext.call_grad(name, fwd_op, bwd_op, tensors(args), (names, pick(args)), bwd_params, codes, grad_of, 0)
assert isinstance(y, torch.Tensor) and y.shape == x.shape and y.grad_fn.name() == "NormActBackward"
dx, dw = torch.autograd.grad(y.sum(), (x, w))  # the node kept mean and rstd without returning them
assert dx.shape == x.shape and dw.shape == w.shape
y2, rstd = ext.call_grad(name, fwd_op, bwd_op, tensors(args), (names, pick(args)), bwd_params, codes, grad_of, (0, 2))
assert y2.shape == x.shape and rstd.shape == (4,) and rstd.dtype == torch.float32
assert ext.call_grad(name, fwd_op, bwd_op, tensors(args), (names, pick(args)), bwd_params, codes, grad_of, (5,)) == (None,)
odd = (names, ("rmsnorm", "identity", [1e-5], True))  # a list: the general path's to judge
assert ext.call_grad(name, fwd_op, bwd_op, tensors(args), odd, bwd_params, codes, grad_of, 0) is NotImplemented
assert ext.call_grad(name, fwd_op, bwd_op, tensors(args), (names, pick(args)[:2]), bwd_params, codes, grad_of,
                     0) is NotImplemented  # names and values of other lengths
try:
    ext.call_grad(name, fwd_op, bwd_op, tensors(args), (names, pick(args)), bwd_params, codes, grad_of, "y")
    raise SystemExit("a str public was accepted")
except TypeError as e:
    assert "public" in str(e), e
print("ok")
""")


def test_cached_calls_keep_the_gil_and_others_release_it():
    """A call kspec has cached (validated and planned before) runs through call_cached with the GIL held; a new
    signature is declined there (nothing run) and runs through call with the GIL released (it may compile); a
    cached signature whose outputs overlap raises what kspec.call raises for it, from call_cached."""
    run_on_mock_driver("""
import ctypes, torch, kspec, kspec._torch
from kspec import _native
dh.install_shim(shim)
counts = (ctypes.c_longlong * 5)()
def seen():
    dh._keep[0].kspec_ext_shim_counts(counts)
    return list(counts)
x, w = torch.randn(4, 256), torch.randn(256)
nm = dict(norm="rmsnorm", act="identity", eps=1e-5)
c0 = seen()
_native.ext.call("norm_act.fwd", (x, w, None), None, nm)  # a new signature: declined, then run without the GIL
c1 = seen()
assert (c1[0] - c0[0], c1[1] - c0[1], c1[2] - c0[2], c1[4]) == (0, 1, 1, 0), (c0, c1)
for _ in range(3):
    _native.ext.call("norm_act.fwd", (x, w, None), None, nm)
c2 = seen()
assert (c2[0] - c1[0], c2[1] - c1[1], c2[2] - c1[2], c2[3]) == (3, 0, 0, 1), (c1, c2)
y, stats = torch.empty(4, 256), torch.empty(64)
_native.ext.call("norm_act.fwd", (x, w, None), (y, torch.empty(4), torch.empty(4)), nm)  # cached with given outputs
c3 = seen()
try:
    _native.ext.call("norm_act.fwd", (x, w, None), (y, stats[:4], stats[:4]), nm)  # rstd over mean: same signature
    raise SystemExit("an output over another was accepted")
except ValueError as e:
    assert "rstd" in str(e) or "mean" in str(e), e
c4 = seen()
assert c4[2] == c3[2] and c4[1] == c3[1], (c3, c4)  # raised by the cached call itself
print("ok")
""")


def test_mhc_with_grad_is_one_cpp_call_on_the_mock_driver():
    """kspec.ops.mhc_pre and mhc_post with a gradient wanted (issue 34's decode shape scaled down: T 8, n 4),
    through the whole host path on the mock driver: each forward is one C++ call (call_grad) recording a C++
    node, the backward runs no Python (mhc.pre.bwd and mhc.post.bwd launched by the nodes), every gradient has
    its input's shape and dtype (none for an absent gamma), the public outputs are the forward op's first
    ones, and a bad phi raises what kspec.call raises. Without grad mhc_pre is one kspec.call."""
    run_on_mock_driver("""
import torch, kspec, kspec._mhc
dh.install_shim(shim)
T, n, D, bf = 8, 4, 64, torch.bfloat16
M = n * n + 2 * n
x = torch.randn(T, n, D, dtype=bf, requires_grad=True)
phi = (torch.randn(M, n * D) * 0.01).requires_grad_()
alpha, bias = torch.full((3,), 0.01, requires_grad=True), torch.zeros(M, requires_grad=True)
kspec.ops.mhc_pre(x, phi, alpha, bias)  # compiles
sys.setprofile(hook)
y, h_pre, h_post, r = kspec.ops.mhc_pre(x, phi, alpha, bias)
sys.setprofile(None)
# (the public outputs' list comprehension is a frame of its own before Python 3.12)
assert names[:3] == ["mhc_pre", "run_pre", "__call__"] and set(names[3:]) <= {"<listcomp>"}, names
assert "call_grad" in builtins, builtins
assert y.grad_fn.name() == "MhcPreBackward" and h_post.grad_fn is y.grad_fn
assert (y.shape, y.dtype, h_pre.shape, h_post.shape, r.shape) == ((T, D), bf, (T, n), (T, n), (T, n, n))
f = torch.randn(T, D, dtype=bf, requires_grad=True)
out = kspec.ops.mhc_post(x, f, h_post, r)
assert out.grad_fn.name() == "MhcPostBackward" and out.shape == x.shape
names.clear()
sys.setprofile(hook)
gx, gphi, galpha, gbias, gf = torch.autograd.grad(out.float().sum() + y.float().sum(), (x, phi, alpha, bias, f))
sys.setprofile(None)
assert not names, names
for g, t in ((gx, x), (gphi, phi), (galpha, alpha), (gbias, bias), (gf, f)):
    assert g.shape == t.shape and g.dtype == t.dtype, (g.shape, t.shape)
gamma = torch.ones(n * D, requires_grad=True)
y2 = kspec.ops.mhc_pre(x, phi, alpha, bias, gamma)[0]
assert torch.autograd.grad(y2.float().sum(), gamma)[0].shape == gamma.shape
def outcome(fn):
    try:
        fn()
    except Exception as e:
        return type(e).__name__, str(e)
bad = torch.randn(M, n * D - 1, requires_grad=True)
got = outcome(lambda: kspec.ops.mhc_pre(x, bad, alpha, bias))
want = outcome(lambda: kspec.call("mhc.pre.fwd", x.detach(), bad.detach(), alpha.detach(), bias.detach(), None,
                                  eps_rms=1e-6, eps_pre=1e-6, eps_sk=1e-6, t_max=20))
assert got == want and got is not None, (got, want)
with torch.no_grad():
    names.clear()
    sys.setprofile(hook)
    outs = kspec.ops.mhc_pre(x, phi, alpha, bias)
    sys.setprofile(None)
assert len(outs) == 4 and outs[0].grad_fn is None, outs
print("ok")
""", _KSPEC_FRAMES)
