"""The generated surface on the GPU, every family with the real kernels: the public function's eager path
(the generated autograd.Function), the custom op called directly (its generated autograd) and
torch.compile(fullgraph=True, dynamic=True) of the public function give the same outputs and gradients,
and a second shape in the same bucket compiles no second frame. (E79's three doors: test_gpu_e79.py; the
new families against their float64 references: test_gpu_surface_families.py.)"""
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


def _mlstm(shape, dtype):
    B, NH, S, DK, DV = shape
    g = torch.Generator(device="cuda").manual_seed(S)
    rn = lambda *s, dt=dtype: torch.randn(*s, device="cuda", dtype=dt, generator=g)  # noqa: E731
    q, k, v, i, f = rn(B, NH, S, DK), rn(B, NH, S, DK), rn(B, NH, S, DV), rn(B, NH, S), rn(B, NH, S) + 3
    C0 = rn(B, NH, DK, DV, dt=torch.float32)
    n0, m0 = rn(B, NH, DK, dt=torch.float32), rn(B, NH, 1, dt=torch.float32)

    def public(q, k, v, i, f, C0, n0, m0):  # n and m carry no gradient (held constant, as mlstm_kernels)
        h, (C, _, _) = kspec.ops.mlstm_chunkwise(q, k, v, i, f, C0, n0, m0, return_last_states=True, chunk_size=64)
        return h, C

    def custom(q, k, v, i, f, C0, n0, m0):
        return torch.ops.kspec.mlstm_chunkwise_fwd(q, k, v, i, f, C0, n0, m0, True, 1e-6, 64, True)[0:4:3]

    return (q, k, v, i, f, C0), public, custom, (n0, m0)


def _mlstm_parallel(shape, dtype):
    (q, k, v, i, f, _), _, _, _ = _mlstm(shape, dtype)
    public = lambda q, k, v, i, f: kspec.ops.mlstm_parallel(q, k, v, i, f)  # noqa: E731
    custom = lambda q, k, v, i, f: torch.ops.kspec.mlstm_parallel_fwd(q, k, v, i, f, 1e-6, True)[0]  # noqa: E731
    return (q, k, v, i, f), public, custom


def _mhc(shape, dtype):
    T, n, D = shape
    g = torch.Generator(device="cuda").manual_seed(T)
    rn = lambda *s, dt=torch.float32: torch.randn(*s, device="cuda", dtype=dt, generator=g)  # noqa: E731
    M = n * n + 2 * n
    x, f = rn(T, n, D, dt=dtype), rn(T, D, dt=dtype)
    phi, alpha, bias, gamma = rn(M, n * D) * 0.05, rn(3).abs() + 0.5, rn(M) * 0.1, 1 + 0.1 * rn(n * D)

    def public(x, f, phi, alpha, bias, gamma):
        y, h_pre, h_post, r = kspec.ops.mhc_pre(x, phi, alpha, bias, gamma)
        return y, h_pre, kspec.ops.mhc_post(x, f, h_post, r), kspec.ops.mhc_sinkhorn(r * 3)

    def custom(x, f, phi, alpha, bias, gamma):
        y, h_pre, h_post, r = torch.ops.kspec.mhc_pre_fwd(x, phi, alpha, bias, gamma, 1e-6, 1e-6, 1e-6, 20)[:4]
        return (y, h_pre, torch.ops.kspec.mhc_post_fwd(x, f, h_post, r),
                torch.ops.kspec.mhc_sinkhorn_fwd(r * 3, 1e-6, 20))

    return (x, f, phi, alpha, bias, gamma), public, custom


def _logic(shape, dtype):
    B, n_in, n_out = shape
    g = torch.Generator(device="cuda").manual_seed(B)
    x = torch.rand(B, n_in, device="cuda", generator=g).to(dtype)
    logits = torch.randn(n_out, 16, device="cuda", generator=g)
    a = torch.randint(0, n_in, (n_out,), device="cuda", generator=g, dtype=torch.int32)
    b = torch.randint(0, n_in, (n_out,), device="cuda", generator=g, dtype=torch.int32)
    csr = kspec._difflogic.consumers(n_in, a, b)
    public = lambda x, logits, a, b, csr: kspec.ops.logic_layer(x, logits, a, b, consumers=csr)  # noqa: E731
    custom = lambda x, logits, a, b, csr: torch.ops.kspec.logic_layer_fwd(x, logits, a, b, csr, "soft", 1.0)  # noqa: E731
    return (x, logits), public, custom, (a, b, csr)


# two shapes of one bucket per family (dims that are runtime sizes, not compile-time constants)
FAMILIES = {
    "norm_act": (_norm_act, [(64, 256), (96, 256)]),
    "selective_scan": (_scan, [(2, 32, 100), (2, 32, 140)]),
    "linear": (_linear, [(32, 64, 128), (48, 64, 128)]),
    "mlstm_chunkwise": (_mlstm, [(2, 2, 100, 32, 64), (2, 2, 140, 32, 64)]),
    "mlstm_parallel": (_mlstm_parallel, [(1, 2, 100, 32, 32), (1, 2, 130, 32, 32)]),
    "mhc": (_mhc, [(20, 4, 96), (33, 4, 96)]),
    "logic_layer": (_logic, [(40, 33, 70), (50, 33, 70)]),
}


def _run(fn, inputs, consts=()):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    outs = fn(*leaves, *consts)
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
        # tensors without gradients (wiring, states held constant) are arguments too: the compiled function
        # is the first shape's, so a tensor it closed over would be the first shape's at the second
        inputs, public, custom, *rest = make(shape, dtype)
        consts = rest[0] if rest else ()
        if compiled is None:
            torch._dynamo.reset()
            compiled = torch.compile(public, backend=counter, fullgraph=True, dynamic=True)
        want, want_grads = _run(public, inputs, consts)
        for fn in (custom, compiled):
            got, got_grads = _run(fn, inputs, consts)
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


@pytest.mark.parametrize("hidden", [256, 4095, 16384])  # register kernel, odd width, streamed rows
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_act_without_statistics(hidden, dtype):
    """save_stats=False (the no-grad path of kspec.ops.norm_act) allocates y alone and computes the very
    y of the kernel that also writes mean and rstd (kSaveStats only drops their stores)."""
    g = torch.Generator(device="cuda").manual_seed(hidden)
    x = torch.randn(37, hidden, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(hidden, device="cuda", dtype=dtype, generator=g)
    b = torch.randn(hidden, device="cuda", dtype=dtype, generator=g)
    y, mean, rstd = kspec.call("norm_act.fwd", x, w, b, norm="layernorm", act="silu")
    y2, mean2, rstd2 = kspec.call("norm_act.fwd", x, w, b, norm="layernorm", act="silu", save_stats=False)
    assert mean is not None and rstd is not None and mean2 is None and rstd2 is None
    assert torch.equal(y, y2)
    with torch.no_grad():
        assert torch.equal(kspec.ops.norm_act(x, w, b, norm="layernorm", act="silu"), y)
    # torch.compile without a gradient: one frame, the same y
    compiled = torch.compile(lambda x: kspec.ops.norm_act(x, w, b, norm="layernorm", act="silu"), fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(x), y)
