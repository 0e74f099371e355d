"""The torch C++ extension (kspec._torch_ext) on the GPU: every family's public op gives the pure path's
outputs and gradients (bitwise where the pure path repeats itself bitwise, else within the dtype's
tolerance), the dispatcher ops (kspec_ops::*) give kspec.call's outputs, and both run on torch's
current stream and under CUDA-graph capture."""
import pytest

from helpers import TOL, rel_err

torch = pytest.importorskip("torch")
import kspec  # noqa: E402
from kspec import _C, _core, _native  # noqa: E402
from test_gpu_surface import FAMILIES  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_native.ext is None, reason="the torch extension is not loaded")]


class pure_path:
    """Without the extension: _C's call path, and the autograd.Function (not the extension's C++ nodes)."""

    def __enter__(self):
        self.saved = _core._call_torch, _core._call_some, _core.call, _native.ext
        _core.use_torch_ext(_C.call_torch)
        _native.ext = None

    def __exit__(self, *exc):
        _core.use_torch_ext(*self.saved[:3])
        _native.ext = self.saved[3]


def _np(t):
    return t.detach().double().cpu().numpy()


def _run(fn, inputs, consts=()):
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    outs = fn(*leaves, *consts)
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator(device="cuda").manual_seed(7)
    cots = [torch.randn(o.shape, device="cuda", dtype=o.dtype, generator=g) for o in outs]
    grads = torch.autograd.grad(outs, [t for t in leaves if t.requires_grad], cots, allow_unused=True)
    return [t for t in list(outs) + list(grads) if t is not None]


def _same(got, want, again, dtype, what):
    for i, (a, b, c) in enumerate(zip(got, want, again)):
        assert a.shape == b.shape and a.dtype == b.dtype, (what, i)
        if torch.equal(b, c):  # the pure path repeats itself bitwise: so must the extension
            assert torch.equal(a, b), (what, i)
        else:  # atomic sums in a backward
            assert rel_err(_np(a), _np(b)) <= TOL[str(dtype).removeprefix("torch.")], (what, i)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_public_ops_same_outputs_and_gradients_as_pure_path(name, dtype):
    make, shapes = FAMILIES[name]
    inputs, public, _, *rest = make(shapes[0], dtype)  # rest: tensors without gradients (test_gpu_surface)
    consts = rest[0] if rest else ()
    got = _run(public, inputs, consts)
    with pure_path():
        want, again = _run(public, inputs, consts), _run(public, inputs, consts)
    _same(got, want, again, dtype, name)
    with torch.no_grad():  # the no-grad path (the forward alone)
        got = public(*inputs, *consts)
        with pure_path():
            want, again = public(*inputs, *consts), public(*inputs, *consts)
    got, want, again = ((t,) if isinstance(t, torch.Tensor) else t for t in (got, want, again))
    _same(got, want, again, dtype, name + " no grad")


@pytest.mark.parametrize("bias", ["none", "fixed", "input"])
def test_e79_same_outputs_and_gradients_as_pure_path(bias):
    from test_e79_custom_op import make_inputs

    n = 16
    inp = make_inputs(13, 3, n, bias, torch.bfloat16, "cuda")
    args = [inp[k] for k in ("kvqm", "b_s", "b_m", "S0", "M0")]
    present = [a for a in args if a is not None]

    def cell(*ts):
        it = iter(ts)
        full = [None if a is None else next(it) for a in args]
        return kspec.ops.e79_cell(full[0], n, *full[1:], bias=bias, chunk=4)

    got = _run(cell, present)
    with pure_path():
        want, again = _run(cell, present), _run(cell, present)
    _same(got, want, again, torch.bfloat16, f"e79 {bias}")


def test_dispatcher_ops_match_kspec_call():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(33, 1000, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(1000, device="cuda", dtype=torch.bfloat16, generator=g)
    nm = dict(norm="layernorm", act="gelu_tanh", eps=1e-5)
    want = kspec.call("norm_act.fwd", x, w, None, **nm)
    for got, ref in zip(torch.ops.kspec_ops.norm_act_fwd(x, w, None, **nm), want):
        assert torch.equal(got, ref)
    lw = torch.randn(64, 1000, device="cuda", dtype=torch.bfloat16, generator=g)
    y, pre = torch.ops.kspec_ops.gemm(x, lw, None, act="relu")
    assert pre.numel() == 0  # an absent output: the empty stand-in
    assert torch.equal(y, kspec.call("gemm", x, lw, None, act="relu")[0])


def test_runs_on_the_current_stream_and_under_graph_capture():
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, device="cuda", dtype=torch.bfloat16)
    want = kspec.ops.norm_act(x, w, None, norm="rmsnorm", act="silu")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
        for _ in range(2):
            kspec.ops.norm_act(x, w, None, norm="rmsnorm", act="silu")
            torch.ops.kspec_ops.norm_act_fwd(x, w, None, norm="rmsnorm", act="silu")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y1 = kspec.ops.norm_act(x, w, None, norm="rmsnorm", act="silu")
        y2 = torch.ops.kspec_ops.norm_act_fwd(x, w, None, norm="rmsnorm", act="silu")[0]
    x.copy_(torch.randn_like(x))
    want = kspec.ops.norm_act(x, w, None, norm="rmsnorm", act="silu")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y1, want) and torch.equal(y2, want)


def test_scan_forward_allocates_in_cpp_and_leaves_an_unused_last_state_unfilled():
    """The scan's forward with a gradient wanted allocates out and last_state in C++ (call_some) beside the
    states it is given; its graph node passes None (no zero-filled tensor, no fill kernel) for the gradient
    of a last_state the caller did not use: the gradients of the pure path's (which, with its
    autograd.Function, does the same), and of a kspec.call with states given."""
    from test_gpu_surface import _scan

    inputs, public, *_ = _scan((2, 32, 100), torch.bfloat16)

    def out_only(*ts):
        return public(*ts)[0]

    got = _run(out_only, inputs)
    with pure_path():
        want, again = _run(out_only, inputs), _run(out_only, inputs)
    _same(got, want, again, torch.bfloat16, "scan, out only")
    u, delta, A, B, C = (t.detach() for t in inputs[:5])
    states = torch.full((2, 32, 7, A.shape[1]), float("nan"), device="cuda")
    out, last, same = _native.ext.call_some("selective_scan.fwd", (u, delta, A, B, C, None, None, None, None),
                                            (None, None, states), {"delta_softplus": True})
    assert same is states and not states.isnan().any()
    # the same plan as with states given from Python (a forward without states may take another)
    want = kspec.call("selective_scan.fwd", u, delta, A, B, C, None, None, None, None, delta_softplus=True,
                      out=(torch.empty_like(u), torch.empty(2, 32, A.shape[1], device="cuda"),
                           torch.empty_like(states)))
    assert torch.equal(out, want[0]) and torch.equal(last, want[1]) and torch.equal(states, want[2])
    out, last, made = _native.ext.call_some("selective_scan.fwd", (u, delta, A, B, C, None, None, None, None),
                                            (None, None, tuple(states.shape)), {"delta_softplus": True})
    assert torch.equal(made, want[2]) and torch.equal(out, want[0]) and torch.equal(last, want[1])


def _norm_act_cases():
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(2, 33, 384, device="cuda", dtype=torch.bfloat16, generator=g)
    w32 = torch.randn(384, device="cuda", generator=g)
    for norm, act, w, b in (("layernorm", "gelu_tanh", w32.bfloat16(), w32.bfloat16() * 0.5),
                            ("rmsnorm", "silu", w32, None), ("layernorm", "none", w32, w32 * 0.1)):
        yield f"norm_act {norm} {act} bias={b is not None} w {w.dtype}", (x, w, b), \
            lambda x, w, b, norm=norm, act=act: kspec.ops.norm_act(x, w, b, norm=norm, act=act)


def _linear_cases():
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(3, 40, 96, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(64, 96, device="cuda", dtype=torch.bfloat16, generator=g) * 0.1
    b = torch.randn(64, device="cuda", dtype=torch.bfloat16, generator=g)
    for act in ("none", "relu"):
        yield f"linear {act} bias", (x, w, b), lambda x, w, b, act=act: kspec.ops.linear(x, w, b, act)
        yield f"linear {act} no bias", (x, w), lambda x, w, act=act: kspec.ops.linear(x, w, None, act)
        yield f"linear {act} 1-d x, transposed weight", (x[0, 0], w.t().contiguous().t(), b), \
            lambda x, w, b, act=act: kspec.ops.linear(x, w, b, act)


def _outputs_and_grads(fn, inputs, loss):
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]  # None: no bias
    y = fn(*leaves)
    return y, [y] + list(torch.autograd.grad(loss(y), [t for t in leaves if t is not None]))


def _op_node(y):
    """The node that made y, past the views a wrapper adds (a 1-d x's output is squeezed back)."""
    fn = y.grad_fn
    while type(fn).__name__.startswith(("Squeeze", "Unsqueeze", "View", "Reshape")):
        fn = fn.next_functions[0][0]
    return fn


@pytest.mark.parametrize("cases", [_norm_act_cases, _linear_cases])
def test_call_grad_node_gives_the_functions_outputs_and_gradients(cases):
    """norm_act and linear (act none/relu) with a gradient wanted are one C++ call (call_grad: the forward op
    and a C++ node running the backward op without Python): the outputs and gradients of the
    autograd.Function on the pure path, for a broadcast gradient (y.sum(): strides 0) too."""
    for what, inputs, fn in cases():
        for loss in (lambda y: y.float().square().sum(), lambda y: y.sum()):
            y, got = _outputs_and_grads(fn, inputs, loss)
            assert not isinstance(_op_node(y), torch.autograd.function.BackwardCFunction), what
            with pure_path():
                want_y, want = _outputs_and_grads(fn, inputs, loss)
                assert isinstance(_op_node(want_y), torch.autograd.function.BackwardCFunction), what
                again = _outputs_and_grads(fn, inputs, loss)[1]
            _same(got, want, again, torch.bfloat16, what)
