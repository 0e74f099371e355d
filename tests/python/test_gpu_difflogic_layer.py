"""The layer ops' feature-major kernels from Python, each config by name (issue 30 Speed): lanes 0 (the flat
kernels) and 4, 8, 16, 32 (the batch-tiled ones; kspec.nn.LogicLayer's defaults 16 forward, 32 backward) through kspec.call with
config=, fp32 / fp16 / bf16, B = 1, 33 (rows not 16-byte aligned: scalar accesses) and 1032 (aligned, a
partial last tile), self-paired gates and an unread input, against the float64 reference; two runs bitwise
equal. The GoogleTest twin with more shapes: tests/cpp/test_difflogic.cpp DiffLogicGpuTiled."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import kspec  # noqa: E402
from kspec._core import call  # noqa: E402
from kspec._difflogic import consumers  # noqa: E402
from kspec.reference import difflogic as dl_ref  # noqa: E402

pytestmark = pytest.mark.gpu

# fwd, bwd bounds (max|got - ref| / max|ref|): fp32 issue 30's 1e-4; halves their rounding of y and dx
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 4e-3), torch.bfloat16: (1e-2, 2e-2)}


def _err(got, want):
    got = got.detach().double().cpu().numpy()
    assert got.shape == np.shape(want) and np.all(np.isfinite(got))
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def _fm(t):
    """The same values as a (B, n) view of a contiguous (n, B) tensor."""
    return t.t().contiguous().t()


@pytest.mark.parametrize("lanes", [0, 4, 8, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B,n_in,n_out", [(1, 7, 33), (33, 65, 1000), (1032, 300, 257)])
def test_feature_major_config_matches_reference(lanes, dtype, B, n_in, n_out):
    g = torch.Generator(device="cuda").manual_seed(B * 7 + n_in + lanes)
    x = torch.rand(B, n_in, device="cuda", generator=g).to(dtype)
    logits = torch.randn(n_out, 16, device="cuda", generator=g) * 1.5
    a = torch.randint(0, n_in - 1, (n_out,), device="cuda", generator=g, dtype=torch.int32)  # n_in - 1 unread
    b = torch.randint(0, n_in - 1, (n_out,), device="cuda", generator=g, dtype=torch.int32)
    b[::3] = a[::3]  # self-paired gates
    dy = torch.randn(B, n_out, device="cuda", generator=g).to(dtype)
    csr = consumers(n_in, a, b)
    config = f"threads=256,lanes={lanes}"
    bwd_config = config + f",ahead={1 if lanes else 0},pool=0"  # the batch-tiled default: loads a step ahead
    xf, dyf = _fm(x), _fm(dy)

    def fwd():
        y = torch.empty(n_out, B, dtype=dtype, device="cuda").t()
        return call("difflogic.layer.fwd", xf, logits, a, b, layout="feature_major", config=config + ",stage=0",
                    out=(y, None))[0]

    def bwd():
        dx = torch.empty(n_in, B, dtype=dtype, device="cuda").t()
        return call("difflogic.layer.bwd", xf, logits, a, b, dyf, csr, grad_factor=0.5, layout="feature_major",
                    config=bwd_config, out=(dx, torch.empty_like(logits)))

    xs, lg, wa, wb = x.double().cpu().numpy(), logits.double().cpu().numpy(), a.cpu().numpy(), b.cpu().numpy()
    want_dx, want_dl = dl_ref.layer_bwd(dy.double().cpu().numpy(), xs, lg, wa, wb, 0.5)
    fwd_tol, bwd_tol = TOL[dtype]
    y = fwd()
    assert _err(y, dl_ref.layer_fwd(xs, lg, wa, wb)) <= fwd_tol
    dx, dl = bwd()
    assert _err(dx, want_dx) <= bwd_tol and _err(dl, want_dl) <= bwd_tol
    assert torch.all(dx[:, n_in - 1] == 0)
    dx2, dl2 = bwd()
    assert torch.equal(fwd(), y) and torch.equal(dx2, dx) and torch.equal(dl2, dl)  # no atomics: the same bits


def test_row_major_refuses_the_tiled_kernels():
    """lanes > 0 needs layout feature_major: a clear error naming the axis, not a wrong answer."""
    x = torch.rand(4, 8, device="cuda")
    logits = torch.zeros(8, 16, device="cuda")
    a = torch.arange(8, device="cuda", dtype=torch.int32)
    with pytest.raises(kspec.InvalidArgument, match="lanes"):
        call("difflogic.layer.fwd", x, logits, a, a, config="threads=256,lanes=8,stage=0")
    with pytest.raises(kspec.InvalidArgument, match="stage"):  # y feature-major too: the layout check passes
        call("difflogic.layer.fwd", x.t().contiguous().t(), logits, a, a, layout="feature_major",
             config="threads=256,lanes=0,stage=1", out=(torch.empty(8, 4, device="cuda").t(), None))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,cols", [(1, 1), (1, 33), (33, 1), (65, 130), (1024, 4097), (0, 5)])
def test_transpose_is_exact(dtype, rows, cols):
    """difflogic.transpose: bit for bit torch's x.t().contiguous(), tiles partial at both edges."""
    g = torch.Generator(device="cuda").manual_seed(rows + cols)
    x = torch.randn(rows, cols, device="cuda", generator=g).to(dtype)
    (y,) = call("difflogic.transpose", x)
    assert y.shape == (cols, rows) and y.is_contiguous() and torch.equal(y, x.t().contiguous())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,n_in,n_out", [(33, 65, 1000), (1032, 300, 257)])
def test_row_major_x_is_transposed_to_the_tiled_kernels(dtype, B, n_in, n_out):
    """A row-major x (the user's layout) runs the feature-major kernels after one transpose: y comes back
    feature-major, dx row-major (x's layout), both against the float64 reference and equal to the row-major
    kernels' (row_major="direct") to rounding; two runs bitwise equal."""
    from kspec._difflogic import feature_major

    g = torch.Generator(device="cuda").manual_seed(B + n_out)
    x = torch.rand(B, n_in, device="cuda", generator=g).to(dtype)
    logits = torch.randn(n_out, 16, device="cuda", generator=g)
    a = torch.randint(0, n_in - 1, (n_out,), device="cuda", generator=g)  # input n_in - 1 unread
    b = torch.randint(0, n_in - 1, (n_out,), device="cuda", generator=g)
    b[::3] = a[::3]
    dy = torch.randn(B, n_out, device="cuda", generator=g).to(dtype)

    def run(row_major):
        xl, ll = x.clone().requires_grad_(), logits.clone().requires_grad_()
        y = kspec.ops.logic_layer(xl, ll, a, b, grad_factor=1.5, row_major=row_major)
        y.backward(dy)
        return y.detach(), xl.grad, ll.grad

    y, dx, dl = run("auto")
    assert feature_major(y) and dx.is_contiguous()
    xs, lg, wa, wb = x.double().cpu().numpy(), logits.double().cpu().numpy(), a.cpu().numpy(), b.cpu().numpy()
    want_dx, want_dl = dl_ref.layer_bwd(dy.double().cpu().numpy(), xs, lg, wa, wb, 1.5)
    fwd_tol, bwd_tol = TOL[dtype]
    assert _err(y, dl_ref.layer_fwd(xs, lg, wa, wb)) <= fwd_tol
    assert _err(dx, want_dx) <= bwd_tol and _err(dl, want_dl) <= bwd_tol
    assert torch.all(dx[:, n_in - 1] == 0)
    y2, dx2, dl2 = run("auto")
    assert torch.equal(y2, y) and torch.equal(dx2, dx) and torch.equal(dl2, dl)  # no atomics: the same bits
    yd, dxd, dld = run("direct")
    assert yd.is_contiguous()
    near = 1e-6 if dtype == torch.float32 else 2.0 ** -8  # other FMA contractions (test_gpu_surface_families)
    assert _err(y, yd.double().cpu().numpy()) <= near and _err(dx, dxd.double().cpu().numpy()) <= near
    assert _err(dl, dld.double().cpu().numpy()) <= bwd_tol


def test_chain_of_layers_and_compile():
    """Row-major input -> LogicLayer -> a torch op -> LogicLayer: the second layer gets the first's feature-major
    y (no copy); values and gradients equal to the chain on the row-major kernels to rounding. Under
    torch.compile, row_major="transpose" traces the transpose as a torch op and gives the eager values."""
    from kspec._difflogic import feature_major

    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.rand(256, 100, device="cuda", generator=g)
    dy = torch.randn(256, 150, device="cuda", generator=g)
    out = {}
    for row_major in ("auto", "direct"):
        torch.manual_seed(0)
        l1 = kspec.nn.LogicLayer(100, 300, row_major=row_major)
        l2 = kspec.nn.LogicLayer(300, 150, row_major=row_major)  # 150 gates read up to 300 inputs
        xl = x.clone().requires_grad_()
        h = l1(xl)
        assert feature_major(h) == (row_major == "auto")
        y = l2(h * 0.5 + 0.25)
        y.backward(dy)
        out[row_major] = [y.detach(), xl.grad, l1.weights.grad, l2.weights.grad]
    for got, want in zip(out["auto"], out["direct"]):
        assert _err(got, want.double().cpu().numpy()) <= 1e-4  # dlogits: the two paths sum the batch in other orders
    torch.manual_seed(0)
    layer = kspec.nn.LogicLayer(100, 300)
    a, b, csr = layer.wiring()

    def f(x, w):
        return kspec.ops.logic_layer(x, w, a, b, consumers=csr, row_major="transpose")

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    xe, we = x.clone().requires_grad_(), layer.weights.detach().clone().requires_grad_()
    xc, wc = x.clone().requires_grad_(), layer.weights.detach().clone().requires_grad_()
    ye, yc = f(xe, we), compiled(xc, wc)
    cot = torch.randn(ye.shape, device="cuda", generator=g)
    ge, gc = torch.autograd.grad(ye, (xe, we), cot), torch.autograd.grad(yc, (xc, wc), cot)
    for got, want in zip((yc.detach(),) + gc, (ye.detach(),) + ge):
        assert _err(got, want.double().cpu().numpy()) <= 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B,n_in,n_out", [(2, 7, 33), (33, 4097, 999), (1031, 2, 1000), (7, 16383, 4097),
                                          (3, 65536, 257)])
def test_staged_row_major_forward(dtype, B, n_in, n_out):
    """The row-major forward's staged kernel (config stage=1, the row-major default: whole rows of x in shared
    memory; 65536 fp32 does not fit and takes the flat kernel) against the float64 reference and the flat
    kernel (stage=0, to rounding), hard and soft; two runs bitwise equal. Through kspec.ops.logic_layer:
    no gradient -> "auto" runs it (y row-major, no transpose); row_major="staged" in training (the staged
    kernel writing xt, save_xt) gives "auto"'s gradients bit for bit (xt is x transposed exactly: the same
    backward) and its y to rounding; where staging does not pay
    (64k halves, 65536 fp32) "staged" is "auto"."""
    from kspec._difflogic import stage_pays

    g = torch.Generator(device="cuda").manual_seed(B + n_in + n_out)
    x = torch.rand(B, n_in, device="cuda", generator=g).to(dtype)
    logits = torch.randn(n_out, 16, device="cuda", generator=g) * 1.5
    a = torch.randint(0, max(n_in - 1, 1), (n_out,), device="cuda", generator=g, dtype=torch.int32)
    b = torch.randint(0, max(n_in - 1, 1), (n_out,), device="cuda", generator=g, dtype=torch.int32)
    b[::3] = a[::3]
    xs, lg, wa, wb = x.double().cpu().numpy(), logits.double().cpu().numpy(), a.cpu().numpy(), b.cpu().numpy()
    fwd_tol, bwd_tol = TOL[dtype]
    near = 1e-6 if dtype == torch.float32 else 2.0 ** -8
    for mode in ("soft", "hard"):
        y = call("difflogic.layer.fwd", x, logits, a, b, mode=mode, config="threads=256,lanes=0,stage=1")[0]
        flat = call("difflogic.layer.fwd", x, logits, a, b, mode=mode, config="threads=256,lanes=0,stage=0")[0]
        assert _err(y, dl_ref.layer_fwd(xs, lg, wa, wb, hard=mode == "hard")) <= fwd_tol
        assert _err(y, flat.double().cpu().numpy()) <= near
        again = call("difflogic.layer.fwd", x, logits, a, b, mode=mode, config="threads=256,lanes=0,stage=1")[0]
        assert torch.equal(again, y)
    if B == 1 or n_in == 1:
        return
    with torch.no_grad():
        yn = kspec.ops.logic_layer(x, logits, a, b)
    assert yn.is_contiguous() == stage_pays(x)
    assert _err(yn, dl_ref.layer_fwd(xs, lg, wa, wb)) <= fwd_tol
    dy = torch.randn(B, n_out, device="cuda", generator=g).to(dtype)
    out = {}
    for row_major in ("staged", "auto"):
        xl, ll = x.clone().requires_grad_(), logits.clone().requires_grad_()
        yl = kspec.ops.logic_layer(xl, ll, a, b, grad_factor=1.5, row_major=row_major)
        yl.backward(dy)
        out[row_major] = (yl.detach(), xl.grad, ll.grad)
    (ys, dxs, dls), (ya, dxa, dla) = out["staged"], out["auto"]
    assert ys.is_contiguous() == stage_pays(x) and dxs.is_contiguous()  # "staged" is "auto" where staging does not pay
    assert _err(ys, ya.double().cpu().numpy()) <= near
    assert torch.equal(dxs, dxa) and torch.equal(dls, dla)
    want_dx, want_dl = dl_ref.layer_bwd(dy.double().cpu().numpy(), xs, lg, wa, wb, 1.5)
    assert _err(dxs, want_dx) <= bwd_tol and _err(dls, want_dl) <= bwd_tol
