"""The generated surface on the GPU, every family with the real kernels: the public function's eager path
(the generated autograd.Function), the custom op called directly (its generated autograd) and
torch.compile(fullgraph=True, dynamic=True) of the public function give the same outputs and gradients,
and a second shape in the same bucket compiles no second frame. (E79's three doors: test_gpu_e79.py.)"""
import pytest

from helpers import TOL, rel_err

torch = pytest.importorskip("torch")
import kspec  # noqa: E402

pytestmark = pytest.mark.gpu


def _np(t):
    return t.detach().double().cpu().numpy()


def _norm_act(shape, dtype):
    rows, hidden = shape
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, hidden, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(hidden, device="cuda", dtype=dtype, generator=g)
    b = torch.randn(hidden, device="cuda", dtype=dtype, generator=g)
    public = lambda x, w, b: kspec.ops.norm_act(x, w, b, norm="layernorm", act="gelu_tanh")  # noqa: E731
    custom = lambda x, w, b: torch.ops.kspec.norm_act_fwd(x, w, b, "layernorm", "gelu_tanh", 1e-5)[0]  # noqa: E731
    return (x, w, b), public, custom


def _scan(shape, dtype):
    batch, dim, seqlen = shape
    g = torch.Generator(device="cuda").manual_seed(seqlen)
    rn = lambda *s, dt=dtype: torch.randn(*s, device="cuda", dtype=dt, generator=g)  # noqa: E731
    u, delta, z = rn(batch, dim, seqlen), rn(batch, dim, seqlen).abs() * 0.1, rn(batch, dim, seqlen)
    A = -torch.rand(dim, 16, device="cuda", generator=g)
    B, C = rn(batch, 1, 16, seqlen), rn(batch, 1, 16, seqlen)
    D, db = rn(dim, dt=torch.float32), rn(dim, dt=torch.float32)

    def public(u, delta, A, B, C, D, z, db):
        return kspec.ops.selective_scan_fn(u, delta, A, B, C, D, z, db, True, return_last_state=True)

    def custom(u, delta, A, B, C, D, z, db):
        return torch.ops.kspec.selective_scan_fwd(u, delta, A, B, C, D, z, db, None, True, True)[:2]

    return (u, delta, A, B, C, D, z, db), public, custom


def _linear(shape, dtype):
    m, k, n = shape
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=g) * k ** -0.5
    b = torch.randn(n, device="cuda", dtype=dtype, generator=g)
    public = lambda x, w, b: kspec.ops.linear(x, w, b, act="gelu")  # noqa: E731
    custom = lambda x, w, b: torch.ops.kspec.linear_fwd(x, w, b, "gelu", False)[0]  # noqa: E731
    return (x, w, b), public, custom


# two shapes of one bucket per family (dims that are runtime sizes, not compile-time constants)
FAMILIES = {
    "norm_act": (_norm_act, [(64, 256), (96, 256)]),
    "selective_scan": (_scan, [(2, 32, 100), (2, 32, 140)]),
    "linear": (_linear, [(32, 64, 128), (48, 64, 128)]),
}


def _run(fn, inputs):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator(device="cuda").manual_seed(7)
    cots = [torch.randn(o.shape, device="cuda", dtype=o.dtype, generator=g) for o in outs]
    grads = torch.autograd.grad(outs, leaves, cots)
    return outs, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_three_doors_agree(name, dtype):
    from torch._dynamo.testing import CompileCounterWithBackend

    make, shapes = FAMILIES[name]
    counter = CompileCounterWithBackend("inductor")
    compiled, frames = None, []
    for shape in shapes:
        inputs, public, custom = make(shape, dtype)
        if compiled is None:
            torch._dynamo.reset()
            compiled = torch.compile(public, backend=counter, fullgraph=True, dynamic=True)
        want, want_grads = _run(public, inputs)
        for fn in (custom, compiled):
            got, got_grads = _run(fn, inputs)
            for a, b in zip(got + got_grads, want + want_grads):
                assert a.shape == b.shape and a.dtype == b.dtype
                # the same kernels: equal up to the order of atomic sums in a backward
                assert rel_err(_np(a), _np(b)) <= TOL[str(dtype).removeprefix("torch.")], (name, shape)
        frames.append(counter.frame_count)
    assert frames[0] >= 1 and frames[1] == frames[0], f"a second shape in the same bucket recompiled: {frames}"


def test_no_grad_runs_the_forward_alone():
    """Without a gradient wanted no autograd node is recorded; with one, the generated Function."""
    (x, w, b), public, _ = _norm_act((8, 128), torch.float32)
    assert public(x, w, b).grad_fn is None
    w.requires_grad_()
    assert public(x, w, b).grad_fn.name() == "NormActBackward"
